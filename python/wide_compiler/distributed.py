"""N members sharded across processes with ``torch.distributed`` (DESIGN §7, "Beyond one process").

Each rank of a process group holds a contiguous slice of the N members as its own
:class:`~wide_compiler.WideModel`; member ids stay GLOBAL everywhere in this module. With N
members over W ranks, rank ``r`` holds ``shard_range(N, W, r)``: the split is as even as possible
and the earlier ranks take the extra members (N=10 over 4 ranks: 3, 3, 2, 2).

- :func:`shard` builds a rank's shard (:class:`ShardedWideModel`) from N modules or from a
  factory of a global member index (so no rank builds the members it does not hold).
- :func:`gather_outputs` / :func:`all_gather_metrics` give every rank the full ``[N, ...]``
  output or the ``[N]`` per-member losses (to rank the population).
- :func:`copy_member` copies member ``src`` onto member ``dst`` across ranks: weights, buffers
  and, with a :mod:`wide_compiler.optim` optimizer, its per-member state and hyperparameters
  (the "exploit" step of population-based training).
- :func:`save_members` / :func:`load_members` write and read per-member checkpoints (one file per
  member plus ``index.json``) that need no process group to read: a run of 4 ranks resumes on 2
  or on 1, and :func:`load_member` gives one member's ordinary ``state_dict`` back.

Collective calls: :func:`shard`, :func:`gather_outputs`, :func:`all_gather_metrics`,
:func:`copy_member` and :func:`save_members` must be called by EVERY rank of the group, in the same
order and with the same arguments (as every ``torch.distributed`` collective). Loading is local.
Without an initialised process group (or with ``torch.distributed`` unavailable) everything
behaves as world size 1, which is how the examples below run.

Example (world size 1; under ``torchrun`` every rank runs the same code and gets its slice):

    >>> import torch, wide_compiler as wc
    >>> import wide_compiler.distributed as wcd
    >>> factory = lambda i: torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    >>> sharded = wcd.shard(factory, torch.randn(2, 4), n=6, config=wc.WideConfig.fast())
    >>> sharded.members, sharded.rank, sharded.world_size
    (range(0, 6), 0, 1)
    >>> x = torch.randn(6, 5, 4)[sharded.members.start:sharded.members.stop]   # this rank's members
    >>> out = wcd.gather_outputs(sharded(x), sharded)                      # [N, ...] on every rank
    >>> out.shape
    torch.Size([6, 5, 1])
    >>> wcd.shard_range(10, 4, 2)                                          # rank 2 of 4 holds 6, 7
    range(6, 8)

Launching: ``torchrun --nproc_per_node 4 train.py`` with ``dist.init_process_group("gloo")`` (CPU)
or ``"nccl"`` (one GPU per rank: call ``torch.cuda.set_device(local_rank)`` and move the shard
with ``sharded.to(device)``); the code is the same. See ``examples/distributed_pbt.py``.

Composing with data parallelism (:class:`torch.nn.parallel.DistributedDataParallel`): the member
axis and the data axis are two process groups. With W = S * R ranks, S shards of the population
and R replicas of each shard, the ranks of one replica shard the members between them (the
"member group", passed to :func:`shard`), and the ranks holding the SAME members in different
replicas average their gradients with DDP (the "data group")::

    S, R = 2, 2                                           # 4 ranks: rank = replica * S + shard
    rank = dist.get_rank()
    member_group, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])   # every rank calls both
    data_group, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    sharded = wcd.shard(factory, sample, group=member_group, n=32)
    ddp = DistributedDataParallel(sharded, process_group=data_group)   # same members, other data
    losses = wc.optim.member_losses(F.mse_loss, ddp(x_my_data), y_my_data)
    losses.sum().backward()      # member i's gradient: the mean over the replicas' batches

Every replica keeps an identical optimizer (its gradients are identical after DDP's all-reduce).
To keep the replicas identical through population-based training, every replica must take the
same decisions: average the gathered metrics over the data group
(``dist.all_reduce(m, group=data_group); m /= R``) or evaluate every replica on the same data,
then call :func:`copy_member` with the same ``(src, dst)`` in every replica (over its member
group). The functions here accept the DDP wrapper wherever they take a ``ShardedWideModel``.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._files import atomic_write, ensure_directory
from .model import WideModel

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ShardedWideModel",
    "all_gather_metrics",
    "copy_member",
    "gather_outputs",
    "load_member",
    "load_member_optimizer",
    "load_members",
    "read_index",
    "save_members",
    "shard",
    "shard_range",
]

log = logging.getLogger(__name__)

FORMAT = "wide_compiler.members"
FORMAT_VERSION = 1
INDEX_FILE = "index.json"


# -- process groups -----------------------------------------------------------------------------
def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _rank_and_size(group: Any) -> tuple[int, int]:
    if not _dist_ready():
        launched = os.environ.get("WORLD_SIZE", "1")
        if launched.isdigit() and int(launched) > 1:
            # torchrun (or another launcher) started several processes but none joined a group:
            # each would run as world size 1, train all N members and write the same checkpoints.
            raise RuntimeError(
                f"wide_compiler.distributed: this process was launched as rank "
                f"{os.environ.get('RANK', '?')} of WORLD_SIZE={launched} (torchrun's environment) but "
                "torch.distributed is not initialised, so every rank would hold all the members; call "
                "torch.distributed.init_process_group() first (e.g. init_process_group('gloo') on CPU: "
                "torchrun's environment supplies the rank, world size and address)")
        if group is not None:
            raise RuntimeError("wide_compiler.distributed: a process group was given but "
                               "torch.distributed is not initialised; call "
                               "torch.distributed.init_process_group first (or pass group=None "
                               "to run as world size 1)")
        return 0, 1
    dist = torch.distributed
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"wide_compiler.distributed: this process (global rank {dist.get_rank()}) "
                         f"is not a member of the given process group")
    return rank, dist.get_world_size(group)


def shard_range(n: int, world_size: int, rank: int) -> range:
    """The GLOBAL member ids that rank ``rank`` of ``world_size`` holds out of ``n`` members:
    contiguous, as even as possible, earlier ranks taking the extra members.

    Raises ``ValueError`` when ``n < world_size`` (a rank would hold no member) or an argument is
    out of range.

    Example:
        >>> [shard_range(10, 4, r) for r in range(4)]
        [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    """
    for what, v in (("n", n), ("world_size", world_size), ("rank", rank)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"wide_compiler.distributed.shard_range: {what} must be an int, got {v!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"wide_compiler.distributed.shard_range: rank {rank} out of range for "
                         f"world size {world_size}")
    if n < world_size:
        raise ValueError(f"wide_compiler.distributed: N={n} members cannot be sharded over "
                         f"{world_size} ranks (every rank must hold at least one member); use at "
                         f"least {world_size} members or a smaller process group")
    base, extra = divmod(n, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (rank < extra))


def _owner(n: int, world_size: int, i: int) -> int:
    """The rank holding member ``i`` (in ``[0, n)``) under :func:`shard_range`."""
    base, extra = divmod(n, world_size)
    big = extra * (base + 1)  # members held by the ranks with one extra
    return i // (base + 1) if i < big else extra + (i - big) // base


# -- the sharded model --------------------------------------------------------------------------
class ShardedWideModel(nn.Module):
    """This rank's slice of an N-member population: a local :class:`~wide_compiler.WideModel`
    (``.wide``) over the global members ``.members``, plus the map between global and local ids.

    Calling it calls the local wide model: inputs and outputs are ``[n_local, ...]`` (this rank's
    members, in order). ``parameters()``, ``to()``, ``train()``/``eval()`` and optimizers work as
    on any module; its ``state_dict`` is the local wide model's under the prefix ``wide.``.
    Per-member methods here take GLOBAL ids and work on the members this rank holds; the
    cross-rank operations are the functions of :mod:`wide_compiler.distributed`. Built by
    :func:`shard`.

    Attributes:
        members: ``range`` of the global ids held here.
        rank, world_size: this process's rank in the group and the group's size (0 and 1
            without a process group).
        n_global: N, the size of the whole population; ``n_local = len(members)``.
        group: the process group (``None``: the default group, or none at all).
    """

    def __init__(self, wide: WideModel, *, n_global: int, rank: int, world_size: int,
                 group: Any = None, standalone: bool = False) -> None:
        super().__init__()
        self.wide = wide
        self.n_global = n_global
        self.rank = rank
        self.world_size = world_size
        self.members = shard_range(n_global, world_size, rank)
        self._group = _GroupRef(group)
        self._standalone = standalone  # a plain WideModel seen as world size 1: no collectives
        if len(self.members) != wide.n:
            raise ValueError(f"wide_compiler.distributed: rank {rank} should hold {len(self.members)} "
                             f"members ({_span(self.members)}) but its wide model has N={wide.n}")

    @property
    def group(self) -> Any:
        """The process group the members are sharded over (None: the default group). A copy
        (``copy.deepcopy``) shares it; a pickled model forgets it: with world size > 1 every
        collective then raises ``RuntimeError`` until ``.group`` is set again."""
        group = self._group.group
        if group is _LOST:
            if _collective(self):
                raise RuntimeError(f"wide_compiler.distributed: this ShardedWideModel (rank {self.rank} "
                                   f"of {self.world_size}) was pickled, and its process group was "
                                   f"lost in pickling; set .group to the group it was sharded over "
                                   f"(None: the default group) before any collective")
            return None
        return group

    @group.setter
    def group(self, group: Any) -> None:
        self._group = _GroupRef(group)

    # -- ids ------------------------------------------------------------------------------------
    @property
    def n_local(self) -> int:
        return len(self.members)

    @property
    def ranges(self) -> list[range]:
        """The global ids held by every rank, indexed by rank."""
        return [shard_range(self.n_global, self.world_size, r) for r in range(self.world_size)]

    def check_member(self, i: Any, what: str = "member") -> int:
        """Global id ``i`` (negative counts from the end) as an int in ``[0, N)``; raises
        ``IndexError`` naming ``what``."""
        if isinstance(i, bool) or not isinstance(i, int) or not -self.n_global <= i < self.n_global:
            raise IndexError(f"wide_compiler.distributed: {what} id {i!r} out of range for a "
                             f"population of N={self.n_global} members (global ids 0..{self.n_global - 1})")
        return i % self.n_global

    def owner(self, i: int) -> int:
        """The rank holding global member ``i``.

        Example:
            >>> import torch, wide_compiler as wc, wide_compiler.distributed as wcd
            >>> sharded = wcd.shard(lambda i: torch.nn.Linear(2, 2), torch.randn(1, 2), n=3,
            ...                     config=wc.WideConfig.fast())
            >>> sharded.owner(2), sharded.is_local(2), sharded.local(2)
            (0, True, 2)
        """
        return _owner(self.n_global, self.world_size, self.check_member(i))

    def is_local(self, i: int) -> bool:
        """Whether this rank holds global member ``i``."""
        return self.check_member(i) in self.members

    def local(self, i: int) -> int:
        """The local index (into ``.wide`` and its optimizer) of global member ``i``; raises
        ``IndexError`` naming the rank that holds it when it is not here."""
        g = self.check_member(i)
        if g not in self.members:
            raise IndexError(f"wide_compiler.distributed: member {g} is held by rank {self.owner(g)}, "
                             f"not by rank {self.rank} (which holds members {_span(self.members)})")
        return g - self.members.start

    def global_id(self, local: int) -> int:
        """The global id of local member ``local``."""
        if isinstance(local, bool) or not isinstance(local, int) or not 0 <= local < self.n_local:
            raise IndexError(f"wide_compiler.distributed: local index {local!r} out of range for "
                             f"rank {self.rank}'s {self.n_local} members")
        return self.members.start + local

    # -- running --------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.wide(*args, **kwargs)

    # -- per-member (local members, global ids) -------------------------------------------------
    def member(self, i: int) -> nn.Module:
        """Global member ``i`` (held here) as an ordinary module of the original class."""
        return self.wide.member(self.local(i))

    def member_state_dict(self, i: int) -> dict[str, torch.Tensor]:
        """Global member ``i``'s (held here) ``state_dict``, loadable into the original module."""
        return self.wide.member_state_dict(self.local(i))

    def load_member_state_dict(self, i: int, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load global member ``i`` (held here) from an ordinary module's ``state_dict`` (checked
        before anything changes, as :meth:`WideModel.load_member_state_dict`; errors name the
        global member)."""
        self.wide._load_member_state_dict(self.local(i), state_dict, f"member {self.check_member(i)}")

    def unfuse(self) -> list[nn.Module]:
        """This rank's members as ordinary modules, in the order of ``.members``."""
        return self.wide.unfuse()

    def extra_repr(self) -> str:
        return (f"members={_span(self.members)} of N={self.n_global}, rank={self.rank}, "
                f"world_size={self.world_size}")


_LOST = object()  # the group of an unpickled _GroupRef


class _GroupRef:
    """Holds a process group: deep copies share it, pickling drops it (process groups are
    neither copyable nor picklable; an unpickled one holds ``_LOST``)."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def __deepcopy__(self, memo: dict) -> _GroupRef:
        return self

    def __reduce__(self) -> tuple:
        return (_lost_group_ref, ())


def _lost_group_ref() -> _GroupRef:
    return _GroupRef(_LOST)


def _span(r: range) -> str:
    return f"{r.start}..{r.stop - 1}" if len(r) else "none"


def _as_sharded(model: Any, what: str) -> ShardedWideModel:
    """A ShardedWideModel (unwrapping DDP), or a plain WideModel seen as world size 1."""
    ddp = getattr(nn.parallel, "DistributedDataParallel", None)
    if ddp is not None and isinstance(model, ddp):
        model = model.module
    if isinstance(model, ShardedWideModel):
        return model
    if isinstance(model, WideModel):
        return ShardedWideModel(model, n_global=model.n, rank=0, world_size=1, standalone=True)
    raise TypeError(f"wide_compiler.distributed.{what}: expected a ShardedWideModel (from "
                    f"wide_compiler.distributed.shard) or a WideModel, got {type(model).__name__}")


def _collective(sharded: ShardedWideModel) -> bool:
    return sharded.world_size > 1 and not sharded._standalone


def shard(models: Sequence[nn.Module] | Callable[[int], nn.Module], sample: Any, group: Any = None,
          *, n: int | None = None, config: Any = None, **compile_kwargs: Any) -> ShardedWideModel:
    """Build this rank's shard of an N-member population: the members ``shard_range(N, W, rank)``
    compiled into one local :class:`~wide_compiler.WideModel` (collective: every rank calls it).

    Args:
        models: either the N member modules (every rank passes the same list, e.g. built from
            the same seeds; each rank keeps only its slice), or a factory ``factory(i) -> module``
            of the GLOBAL member index ``i``, with ``n=N``: each rank builds only its own members
            (seed inside the factory, e.g. ``torch.manual_seed(i)``, to make member ``i`` the same
            whichever rank builds it).
        sample: ONE member's input, as for :func:`wide_compiler.compile`.
        group: the process group to shard over (default: the default group; without an
            initialised process group the world size is 1 and this rank holds all N members).
        n: the number of members, required with a factory (checked against the list otherwise).
        config: :class:`~wide_compiler.WideConfig` for the local compile.
        **compile_kwargs: other keyword arguments of :func:`wide_compiler.compile`
            (``validate``, ``strict``, ``sample_kwargs``, ``dynamic_shapes``).

    Every rank then checks, in one small all-gather, that all ranks got the same N and the
    same member architecture (parameter and buffer names, shapes, dtypes) and built their shard;
    if any rank failed, every rank raises (naming the rank) instead of hanging in a later
    collective.

    Raises:
        ValueError: N < world size, a wrong ``n``, or ranks that disagree.
        TypeError: ``models`` is neither a sequence of modules nor a factory.

    Example:
        >>> import torch, wide_compiler as wc, wide_compiler.distributed as wcd
        >>> def member(i):
        ...     torch.manual_seed(i)                       # member i is the same on any rank
        ...     return torch.nn.Linear(3, 2)
        >>> sharded = wcd.shard(member, torch.randn(1, 3), n=4, config=wc.WideConfig.fast())
        >>> sharded  # doctest: +ELLIPSIS
        ShardedWideModel(
          members=0..3 of N=4, rank=0, world_size=1
          (wide): WideModel(...)
        )
        >>> torch.equal(sharded.wide.weight[1], member(1).weight)
        True
    """
    from .api import compile as wide_compile

    rank, world = _rank_and_size(group)
    wide, error, ids, total, signature = None, None, range(0), None, None
    try:  # a rank that fails tells the others (in the all-gather below) instead of leaving them hanging
        if "compile_model" in compile_kwargs:
            raise TypeError("wide_compiler.distributed.shard: compile_model is not supported here; "
                            "wrap the shard's .wide in torch.compile yourself")
        if isinstance(models, nn.Module):
            raise TypeError("wide_compiler.distributed.shard: got ONE module; pass the N members as a "
                            "list, or a factory f(i) -> module of the global member index with n=N")
        if callable(models):
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"wide_compiler.distributed.shard: a member factory needs n=N (the "
                                 f"population size, an int >= 1); got n={n!r}")
            factory, total = models, n
        elif isinstance(models, Sequence):
            members_list = list(models)
            if n is not None and n != len(members_list):
                raise ValueError(f"wide_compiler.distributed.shard: n={n} but {len(members_list)} "
                                 f"models were given")
            total = len(members_list)
            if total == 0:
                raise ValueError("wide_compiler.distributed.shard: expected at least one model, got "
                                 "an empty list")
            factory = members_list.__getitem__
        else:
            raise TypeError(f"wide_compiler.distributed.shard: expected a sequence of N modules or a "
                            f"factory f(i) -> module, got {type(models).__name__}")
        ids = shard_range(total, world, rank)  # N < world size
        local = []
        for i in ids:
            m = factory(i)
            if not isinstance(m, nn.Module):
                raise TypeError(f"wide_compiler.distributed.shard: member {i} is a "
                                f"{type(m).__name__}, expected an nn.Module")
            local.append(m)
        wide = wide_compile(local, sample, config=config, **compile_kwargs)
        signature = [(k, tuple(v.shape), str(v.dtype)) for k, v in wide.member_state_dict(0).items()]
    except Exception as e:
        if world == 1:
            raise
        error, signature = e, None

    if world > 1:
        mine = (total, f"{type(error).__name__}: {error}" if error is not None else None, signature)
        everyone: list[Any] = [None] * world
        torch.distributed.all_gather_object(everyone, mine, group=group)
        if error is not None:
            raise error
        for r, (n_r, err_r, sig_r) in enumerate(everyone):
            if err_r is not None:
                raise RuntimeError(f"wide_compiler.distributed.shard: rank {r} failed to build its "
                                   f"shard ({err_r}); see that rank's traceback")
            if n_r != total:
                raise ValueError(f"wide_compiler.distributed.shard: rank {r} has N={n_r} members, "
                                 f"rank {rank} has N={total}: every rank must pass the same population")
            if sig_r != signature:
                diff = sorted(set(sig_r) ^ set(signature))[:3]
                raise ValueError(f"wide_compiler.distributed.shard: rank {r}'s members differ from "
                                 f"rank {rank}'s (parameters/buffers name, shape, dtype; first "
                                 f"differences: {diff}): every rank must build the same architecture")
    sharded = ShardedWideModel(wide, n_global=total, rank=rank, world_size=world, group=group)
    log.info("wide_compiler.distributed: rank %d/%d holds members %s of N=%d", rank, world,
             _span(ids), total)
    return sharded


# -- gathering outputs --------------------------------------------------------------------------
def _comm_device(sharded: ShardedWideModel, t: torch.Tensor | None = None) -> torch.device:
    """The device collectives use: the tensor's, else the model's parameters' (CUDA for NCCL)."""
    if t is not None:
        return t.device
    p = next(sharded.parameters(), None)
    if p is None:
        p = next(sharded.buffers(), None)
    return p.device if p is not None else torch.device("cpu")


def gather_outputs(output: Any, sharded: Any) -> Any:
    """The full ``[N, ...]`` output on every rank from each rank's ``[n_local, ...]`` output
    (collective; every rank calls it). ``output`` is a tensor or any pytree of them (tuples,
    dicts...); non-tensor leaves are returned as this rank's. Uneven shards are handled; every
    leaf must have the same trailing shape and dtype on every rank (checked on every rank, so a
    mismatch raises everywhere instead of hanging).

    The rows of this rank's members keep their autograd graph; the other ranks' rows are
    detached values (gradients stay local, as in ``all_gather``).

    Example:
        >>> import torch, wide_compiler as wc, wide_compiler.distributed as wcd
        >>> sharded = wcd.shard([torch.nn.Linear(3, 2) for _ in range(4)], torch.randn(1, 3),
        ...                     config=wc.WideConfig.fast())
        >>> wcd.gather_outputs(sharded(torch.randn(4, 5, 3)), sharded).shape
        torch.Size([4, 5, 2])
    """
    return _gather(output, _as_sharded(sharded, "gather_outputs"), "gather_outputs")


def _gather(output: Any, sharded: ShardedWideModel, what: str) -> Any:
    leaves, spec = tree_flatten(output)
    meta = [(tuple(t.shape), str(t.dtype)) if isinstance(t, torch.Tensor) else None for t in leaves]
    if not _collective(sharded):
        _check_meta([meta], sharded, what)
        return output
    group, world = sharded.group, sharded.world_size
    everyone: list[Any] = [None] * world
    torch.distributed.all_gather_object(everyone, meta, group=group)
    _check_meta(everyone, sharded, what)  # on every rank: a mismatch raises everywhere
    sizes = [len(r) for r in sharded.ranges]
    most = max(sizes)
    out = []
    for t in leaves:
        if not isinstance(t, torch.Tensor):
            out.append(t)
            continue
        send = t.detach()
        if send.shape[0] < most:
            send = torch.cat([send, send.new_zeros((most - send.shape[0], *send.shape[1:]))])
        bufs = [torch.empty_like(send, memory_format=torch.contiguous_format) for _ in range(world)]
        torch.distributed.all_gather(bufs, send.contiguous(), group=group)
        pieces = [b[:k] for b, k in zip(bufs, sizes)]
        pieces[sharded.rank] = t
        out.append(torch.cat(pieces))
    return tree_unflatten(out, spec)


def _check_meta(everyone: list, sharded: ShardedWideModel, what: str) -> None:
    ranges = sharded.ranges
    name = f"wide_compiler.distributed.{what}"
    first = everyone[0]
    for r, meta in enumerate(everyone):
        if len(meta) != len(first) or [m is None for m in meta] != [m is None for m in first]:
            raise ValueError(f"{name}: rank {r}'s output has a different structure from rank 0's")
        for k, (m, m0) in enumerate(zip(meta, first)):
            if m is None:
                continue
            shape, dtype = m
            if not shape or shape[0] != len(ranges[r]):
                raise ValueError(f"{name}: output {k} of rank {r} has shape {list(shape)}; expected "
                                 f"[{len(ranges[r])}, ...] (dim 0: one per member of that rank, "
                                 f"{_span(ranges[r])})")
            if shape[1:] != m0[0][1:] or dtype != m0[1]:
                raise ValueError(f"{name}: output {k} is {list(shape)} {dtype} on rank {r} but {list(m0[0])} {m0[1]} on "
                                 f"rank 0: every rank's members must give the same shape and dtype")


def all_gather_metrics(values: Any, sharded: Any) -> torch.Tensor:
    """This rank's per-member values (a ``[n_local]`` tensor, or ``n_local`` numbers) as the
    population's ``[N]`` tensor, on every rank (collective): the losses or scores by which
    population-based training ranks its members. Detached; numbers become float64.

    Example:
        >>> import torch, wide_compiler as wc, wide_compiler.distributed as wcd
        >>> sharded = wcd.shard([torch.nn.Linear(3, 1) for _ in range(3)], torch.randn(1, 3),
        ...                     config=wc.WideConfig.fast())
        >>> wcd.all_gather_metrics([0.5, 0.25, 1.0], sharded)
        tensor([0.5000, 0.2500, 1.0000], dtype=torch.float64)
    """
    sharded = _as_sharded(sharded, "all_gather_metrics")
    if isinstance(values, torch.Tensor):
        t = values.detach()
    else:
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_comm_device(sharded))
    return _gather(t, sharded, "all_gather_metrics")  # checks the counts on every rank


# -- copying members across ranks ---------------------------------------------------------------
def _check_optimizer(optimizer: Any, sharded: ShardedWideModel, what: str) -> None:
    if optimizer is None:
        return
    from .optim import WideOptimizer

    if not isinstance(optimizer, WideOptimizer):
        raise TypeError(f"wide_compiler.distributed.{what}: {type(optimizer).__name__} is not a "
                        f"wide_compiler.optim optimizer (per-member state is needed)")
    if optimizer.n != sharded.n_local:
        raise ValueError(f"wide_compiler.distributed.{what}: the optimizer has N={optimizer.n} members "
                         f"but rank {sharded.rank} holds {sharded.n_local}: build it over this rank's "
                         f"shard (optimizer(sharded.parameters(), ...))")
    optimizer._renormalize_all()  # hyperparameters assigned by hand (group["lr"] = 1e-4) become [N] again


def _agree(error: BaseException | None, sharded: ShardedWideModel, what: str) -> None:
    """Every rank learns whether any rank failed (one small all-gather) and raises: the failing
    rank its own exception, the others a ``RuntimeError`` naming it; instead of one rank raising
    while the others wait in the next collective. Without collectives: raises ``error``."""
    everyone: list[Any] = [None]
    if _collective(sharded):
        everyone = [None] * sharded.world_size
        mine = None if error is None else f"{type(error).__name__}: {error}"
        torch.distributed.all_gather_object(everyone, mine, group=sharded.group)
    if error is not None:
        raise error
    for r, err in enumerate(everyone):
        if err is not None:
            raise RuntimeError(f"wide_compiler.distributed.{what}: rank {r} failed ({err}); see that "
                               f"rank's traceback")


def _member_entries(sharded: ShardedWideModel, local: int, optimizer: Any) -> dict[str, Any]:
    """Everything a member is made of, by name: ``"model"`` (weights then buffers) and
    ``"optimizer"`` (per-member state) map names to views of the member's rows, with the
    state's parameter index and key; ``"hparams"``: its hyperparameters."""
    wide = sharded.wide
    params, buffers = wide._member_names()
    out: dict[str, Any] = {"model": {name: wide._stacked(name)[local] for name in (*params, *buffers)},
                           "optimizer": None, "hparams": None}
    if optimizer is not None:
        state = {}
        for pid, p in enumerate(q for g in optimizer.param_groups for q in g["params"]):
            for key, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() >= 1 and v.shape[0] == optimizer.n:
                    state[f"{pid}.{key}"] = (pid, key, v[local])
        out["optimizer"], out["hparams"] = state, optimizer._member_values(local)
    return out


def _describe(entries: dict[str, Any]) -> dict[str, Any]:
    """What the peer needs to know of ``_member_entries``: names, shapes, dtypes (and the
    hyperparameter values, which travel here)."""
    shape = lambda t: (tuple(t.shape), t.dtype)  # noqa: E731
    return {"model": {k: shape(t) for k, t in entries["model"].items()},
            "optimizer": None if entries["optimizer"] is None else
            {k: (pid, key, *shape(t)) for k, (pid, key, t) in entries["optimizer"].items()},
            "hparams": entries["hparams"]}


def _structure_error(src: dict, dst: dict) -> str | None:
    """Why member state described by ``src`` cannot be copied onto ``dst``'s, or None."""
    if src["model"] != dst["model"]:
        diff = sorted(set(src["model"].items()) ^ set(dst["model"].items()), key=str)[:3]
        return f"the two ranks' members differ in structure (first differences: {diff})"
    if (src["optimizer"] is None) != (dst["optimizer"] is None):
        return ("the two ranks' optimizer states differ in structure: an optimizer was given on one "
                "rank only")
    if src["optimizer"] is not None:
        for k in src["optimizer"].keys() & dst["optimizer"].keys():
            if src["optimizer"][k] != dst["optimizer"][k]:
                return (f"the two ranks' optimizer states differ in structure: state {k} is "
                        f"{src['optimizer'][k][2:]} on one, {dst['optimizer'][k][2:]} on the other")
        if len(src["hparams"]) != len(dst["hparams"]):
            return "the two ranks' optimizers have different numbers of param groups"
    return None


def _flat_by_dtype(tensors: list[torch.Tensor], device: torch.device) -> dict[torch.dtype, torch.Tensor]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t.reshape(-1).to(device))
    return {dt: torch.cat(ts) for dt, ts in groups.items()}


@torch.no_grad()
def copy_member(sharded: Any, src: int, dst: int, optimizer: Any = None) -> None:
    """Global member ``dst`` becomes a copy of global member ``src``, wherever they live:
    weights and buffers and, with ``optimizer`` (this rank's :mod:`wide_compiler.optim`
    optimizer over the shard), the optimizer state (moments, step counts) and per-member
    hyperparameters. The "exploit" step of population-based training.

    COLLECTIVE: every rank of the group calls it with the same ``src`` and ``dst`` (and an
    optimizer on every rank or on none); only the two ranks holding them communicate: first a
    small description of the member (and any error on either rank), so that both raise instead
    of hanging when one fails or the two ranks' members differ, then one message per dtype of
    the member's tensors. Optimizer state that only one of the two ranks has yet (SGD's
    momentum buffer on a rank whose members all have momentum 0) is handled as on one wide
    model: state ``src`` has and ``dst``'s rank lacks is created (zeros for its other members),
    state ``src``'s rank lacks is zeroed for ``dst``. When both members are on one rank this is
    :meth:`WideModel.copy_member`. Copies issued one after another in the same order on every
    rank give the same result as the same sequence on a single wide model.

    Example:
        >>> import torch, wide_compiler as wc, wide_compiler.distributed as wcd
        >>> sharded = wcd.shard([torch.nn.Linear(3, 2) for _ in range(4)], torch.randn(1, 3),
        ...                     config=wc.WideConfig.fast())
        >>> opt = wc.optim.Adam(sharded.parameters(), lr=[0.1, 0.2, 0.3, 0.4])
        >>> wcd.copy_member(sharded, 3, 0, opt)
        >>> torch.equal(sharded.wide.weight[0], sharded.wide.weight[3]), opt.param_groups[0]["lr"][0].item()
        (True, 0.4)
    """
    sharded = _as_sharded(sharded, "copy_member")
    src = sharded.check_member(src, "src")
    dst = sharded.check_member(dst, "dst")
    group = sharded.group  # (raises on every rank when a pickled model lost its group)
    s_rank, d_rank = sharded.owner(src), sharded.owner(dst)
    me = sharded.rank
    if src == dst or me not in (s_rank, d_rank):
        _check_optimizer(optimizer, sharded, "copy_member")
        return
    if s_rank == d_rank:
        _check_optimizer(optimizer, sharded, "copy_member")
        sharded.wide.copy_member(sharded.local(src), sharded.local(dst), optimizer)
        return
    dist = torch.distributed
    peer = d_rank if me == s_rank else s_rank
    peer_global = dist.get_global_rank(group, peer) if group is not None else peer
    device = _comm_device(sharded)
    where = f"wide_compiler.distributed.copy_member member {src} (rank {s_rank}) -> member {dst} (rank {d_rank})"
    error, entries, mine = None, None, None
    try:  # a failure here is sent to the peer (which raises too) instead of leaving it waiting
        _check_optimizer(optimizer, sharded, "copy_member")
        entries = _member_entries(sharded, sharded.local(src if me == s_rank else dst), optimizer)
        mine = _describe(entries)
    except Exception as e:
        error = e
    message = [{"error": None if error is None else f"{type(error).__name__}: {error}", "meta": mine}]
    if me == s_rank:  # the source describes, the destination answers with a verdict
        dist.send_object_list(message, dst=peer_global, group=group, device=device)
        verdict = [None]
        dist.recv_object_list(verdict, src=peer_global, group=group, device=device)
        if error is not None:
            raise error
        if verdict[0] is not None:
            raise ValueError(f"{where}: {verdict[0]}")
        tensors = [t for t in entries["model"].values()] + [t for *_, t in (entries["optimizer"] or {}).values()]
        for flat in _flat_by_dtype(tensors, device).values():
            dist.send(flat, dst=peer_global, group=group)
        log.debug("%s: sent", where)
        return
    theirs = [None]
    dist.recv_object_list(theirs, src=peer_global, group=group, device=device)
    theirs = theirs[0]
    if error is not None:
        verdict = f"rank {d_rank} failed ({message[0]['error']}); see that rank's traceback"
    elif theirs["error"] is not None:
        verdict = f"rank {s_rank} failed ({theirs['error']}); see that rank's traceback"
    else:
        verdict = _structure_error(theirs["meta"], mine)
        if verdict is None and optimizer is not None:
            try:  # hyperparameters first: validated before anything changes
                optimizer._set_member_values(sharded.local(dst), theirs["meta"]["hparams"])
            except (ValueError, TypeError) as e:
                verdict = f"the source's hyperparameters do not fit this optimizer ({e})"
    dist.send_object_list([verdict], dst=peer_global, group=group, device=device)
    if error is not None:
        raise error
    if verdict is not None:
        raise ValueError(f"{where}: {verdict}")
    meta = theirs["meta"]
    specs = list(meta["model"].values()) + [spec[2:] for spec in (meta["optimizer"] or {}).values()]
    sizes: dict[torch.dtype, int] = {}
    for shape, dtype in specs:
        sizes[dtype] = sizes.get(dtype, 0) + torch.Size(shape).numel()
    flats = {dt: torch.empty(k, dtype=dt, device=device) for dt, k in sizes.items()}
    for flat in flats.values():
        dist.recv(flat, src=peer_global, group=group)
    offsets = dict.fromkeys(flats, 0)

    def take(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        k = offsets[dtype]
        offsets[dtype] = k + torch.Size(shape).numel()
        return flats[dtype][k:offsets[dtype]].view(shape)

    for name, (shape, dtype) in meta["model"].items():
        entries["model"][name].copy_(take(shape, dtype))
    if optimizer is not None:
        local = sharded.local(dst)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for name, (pid, key, shape, dtype) in meta["optimizer"].items():
            value = take(shape, dtype)
            if name in entries["optimizer"]:
                entries["optimizer"][name][2].copy_(value)
            else:  # state this rank's optimizer has not created yet: zeros for the other members
                p = params[pid]
                on = p.device if shape else torch.device("cpu")  # step counts live on the CPU
                optimizer.state[p][key] = t = torch.zeros((optimizer.n, *shape), dtype=dtype, device=on)
                t[local].copy_(value)
        for name in entries["optimizer"].keys() - meta["optimizer"].keys():
            entries["optimizer"][name][2].zero_()  # state the source's rank does not have
    log.debug("%s: received", where)


# -- checkpoints ---------------------------------------------------------------------------------
def _member_file(i: int) -> str:
    return f"member_{i:06d}.pt"


def save_members(model: Any, directory: str | os.PathLike, optimizer: Any = None, *,
                 metadata: Mapping[str, Any] | None = None) -> Path:
    """Write a per-member checkpoint: one file per member (``member_000007.pt``: its
    ``state_dict`` and, with ``optimizer``, its optimizer state as the ``state_dict`` of the
    matching ``torch.optim`` optimizer) and ``index.json`` (format, version, N, keys, shapes,
    dtypes, optimizer class, your ``metadata``). Returns the directory.

    ``model`` is a :class:`ShardedWideModel` (COLLECTIVE: every rank writes the members it
    holds; rank 0 removes an older ``index.json`` (and member files of a larger older N) first
    and writes the new one last, once every rank has written its members, so a directory with
    an ``index.json`` holds a complete checkpoint; the directory must be one all ranks see, e.g.
    a shared filesystem) or a plain :class:`~wide_compiler.WideModel` (all its members). Files
    are written atomically: each goes to a temporary file of an unpredictable name, created
    exclusively in the directory (never through a file or symlink planted there), then renamed
    over its final name (a symlink at that name is replaced, not followed). When any rank fails
    (a wrong optimizer, a full disk, a directory that cannot be written: an ``OSError`` naming
    the path), every rank raises. Read it back with :func:`load_members` on any number of
    ranks, or :func:`load_member` without any.

    Saving over an existing checkpoint is NOT crash-safe: the old one is invalidated before the
    new one is complete, so a crash in between leaves no checkpoint there. Save each round to a
    fresh directory (and remove older ones once the new one is written).

    Example:
        >>> import tempfile, torch, wide_compiler as wc, wide_compiler.distributed as wcd
        >>> models = [torch.nn.Linear(3, 2) for _ in range(4)]
        >>> sharded = wcd.shard(models, torch.randn(1, 3), config=wc.WideConfig.fast())
        >>> d = tempfile.mkdtemp()
        >>> _ = wcd.save_members(sharded, d, metadata={"round": 3})
        >>> wcd.read_index(d)["n"], wcd.read_index(d)["metadata"]
        (4, {'round': 3})
        >>> plain = torch.nn.Linear(3, 2)                  # member 2 as an ordinary module
        >>> plain.load_state_dict(wcd.load_member(d, 2))
        <All keys matched successfully>
        >>> torch.equal(plain.weight, models[2].weight)
        True
    """
    what = "wide_compiler.distributed.save_members"
    sharded = _as_sharded(model, "save_members")
    _ = sharded.group  # raises on every rank when a pickled model lost its group
    path = Path(directory)
    error = None
    try:  # every step ends with _agree: a rank that fails makes every rank raise (none hangs)
        _check_optimizer(optimizer, sharded, "save_members")
        if metadata is not None:
            try:
                metadata = json.loads(json.dumps(dict(metadata)))
            except (TypeError, ValueError) as e:
                raise ValueError(f"{what}: metadata must be JSON-serialisable ({e})") from e
        if sharded.rank == 0:  # an older checkpoint here is no longer complete once we start writing
            ensure_directory(path, what)
            (path / INDEX_FILE).unlink(missing_ok=True)  # (a symlink there: the link goes, not its target)
            for f in path.glob("member_*.pt"):  # members of a larger older N
                k = f.stem.removeprefix("member_")
                if k.isdigit() and int(k) >= sharded.n_global:
                    f.unlink(missing_ok=True)
    except Exception as e:
        error = e
    _agree(error, sharded, "save_members")
    try:
        ensure_directory(path, what)
        for i in sharded.members:
            payload = {"format": FORMAT, "version": FORMAT_VERSION, "member": i,
                       "model": sharded.member_state_dict(i),
                       "optimizer": optimizer.member_state_dict(sharded.local(i)) if optimizer is not None else None}
            atomic_write(path / _member_file(i), lambda f, payload=payload: torch.save(payload, f), what)
    except Exception as e:
        error = e
    _agree(error, sharded, "save_members")
    try:
        if sharded.rank == 0:
            sd = sharded.member_state_dict(sharded.members.start)
            index = {
                "format": FORMAT, "version": FORMAT_VERSION, "n": sharded.n_global,
                "files": [_member_file(i) for i in range(sharded.n_global)],
                "keys": list(sd), "shapes": {k: list(v.shape) for k, v in sd.items()},
                "dtypes": {k: str(v.dtype) for k, v in sd.items()},
                "module": type(sharded.wide._template).__qualname__,
                "optimizer": type(optimizer).__name__ if optimizer is not None else None,
                "saved_by_world_size": sharded.world_size, "torch": torch.__version__,
                "metadata": metadata,
            }
            text = json.dumps(index, indent=1).encode()
            atomic_write(path / INDEX_FILE, lambda f: f.write(text), what)
    except Exception as e:
        error = e
    _agree(error, sharded, "save_members")
    log.info("wide_compiler.distributed: rank %d saved members %s to %s", sharded.rank,
             _span(sharded.members), path)
    return path


def _dtype_of(name: Any) -> torch.dtype | None:
    """The torch dtype that ``str(dtype)`` wrote as ``name`` (``"torch.float32"``), or None."""
    if not isinstance(name, str) or not name.startswith("torch."):
        return None
    dtype = getattr(torch, name.removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else None


def _check_index(index: dict[str, Any], path: Path) -> None:
    """The fields of an ``index.json`` that loading relies on, checked for what
    :func:`save_members` writes (a corrupt or hand-edited index raises ``ValueError``)."""
    where = f"wide_compiler.distributed: {path}"
    n = index.get("n")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"{where}: 'n' (the number of members) must be an int >= 1; got {n!r} "
                         f"({type(n).__name__}): a corrupt or hand-edited index")
    files = index.get("files")
    if not isinstance(files, list) or len(files) != n:
        got = f"{len(files)} entries" if isinstance(files, list) else f"a {type(files).__name__}"
        raise ValueError(f"{where}: 'files' must list the checkpoint's {n} member files (one per "
                         f"member, n={n}); got {got}: a corrupt or hand-edited index")
    for i, name in enumerate(files):
        if name != _member_file(i):
            raise ValueError(f"{where}: member {i}'s file is listed as {name!r}; save_members names it "
                             f"{_member_file(i)!r}, in the checkpoint's own directory (a path elsewhere "
                             f"is never followed): a corrupt or hand-edited index")
    keys = index.get("keys")
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
        raise ValueError(f"{where}: 'keys' must be a list of distinct state_dict names; got {keys!r}")
    for field in ("shapes", "dtypes"):
        table = index.get(field)
        if not isinstance(table, dict) or sorted(table) != sorted(keys):
            raise ValueError(f"{where}: {field!r} must map every key of 'keys' to its {field[:-1]}; "
                             f"got {table!r}")
    for k in keys:
        shape = index["shapes"][k]
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool)
                                                  and d >= 0 for d in shape):
            raise ValueError(f"{where}: the shape of {k!r} must be a list of sizes; got {shape!r}")
        if _dtype_of(index["dtypes"][k]) is None:
            raise ValueError(f"{where}: the dtype of {k!r} must name a torch dtype ('torch.float32'); "
                             f"got {index['dtypes'][k]!r}")
    if not isinstance(index.get("optimizer"), (str, type(None))):
        raise ValueError(f"{where}: 'optimizer' must be an optimizer class name or null; got "
                         f"{index.get('optimizer')!r}")


def read_index(directory: str | os.PathLike) -> dict[str, Any]:
    """The ``index.json`` of a checkpoint written by :func:`save_members`, checked (format,
    version, and the fields loading relies on: ``n`` an int, one ``files`` entry per member named
    as :func:`save_members` names it, keys, shapes and dtypes); raises
    ``FileNotFoundError``/``ValueError`` saying what is wrong."""
    path = Path(directory) / INDEX_FILE
    if not path.is_file():
        raise FileNotFoundError(f"wide_compiler.distributed: {path} not found: not a checkpoint "
                                f"written by save_members (or one whose save did not complete)")
    try:
        index = json.loads(path.read_text())
    except (ValueError, RecursionError) as e:
        raise ValueError(f"wide_compiler.distributed: {path} is not valid JSON ({e})") from e
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"wide_compiler.distributed: {path} is not a {FORMAT} index")
    if index.get("version") != FORMAT_VERSION:
        raise ValueError(f"wide_compiler.distributed: {path} has format version {index.get('version')!r}; "
                         f"this wide_compiler reads version {FORMAT_VERSION}")
    _check_index(index, path)
    return index


def _open_member(directory: str | os.PathLike, i: int, index: dict) -> tuple[Path, Any]:
    """The path of member ``i``'s file and the file opened for reading; refuses a file that
    resolves outside the checkpoint directory (a symlink to elsewhere) or is not a regular file."""
    base = Path(directory)
    path = base / index["files"][i]  # a plain name: checked by read_index
    if not path.exists():
        raise FileNotFoundError(f"wide_compiler.distributed: {path} (member {i}) is missing from the "
                                f"checkpoint")
    root, real = base.resolve(), path.resolve()
    if not real.is_relative_to(root):
        raise ValueError(f"wide_compiler.distributed: {path} (member {i}) is a symlink to {real}, "
                         f"outside the checkpoint directory {root}: refused (a checkpoint's files "
                         f"are its own)")
    if not real.is_file():
        raise ValueError(f"wide_compiler.distributed: {path} (member {i}) is not a regular file")
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    fd = os.open(real, flags)  # the resolved path: no symlink is followed from here on
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"wide_compiler.distributed: {path} (member {i}) is not a regular file")
    return path, os.fdopen(fd, "rb")


def _read_member(directory: str | os.PathLike, i: int, index: dict | None = None,
                 map_location: Any = "cpu") -> dict[str, Any]:
    """Member ``i``'s payload, read with ``weights_only=True`` and checked against the index
    (format, member id, keys, shapes and dtypes, an optimizer entry that is a dict or None)."""
    index = index if index is not None else read_index(directory)
    n = index["n"]
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
        raise IndexError(f"wide_compiler.distributed: member {i!r} out of range for the checkpoint "
                         f"in {directory} (N={n})")
    path, f = _open_member(directory, i, index)
    where = f"wide_compiler.distributed: {path} (member {i})"
    with f:
        try:
            payload = torch.load(f, map_location=map_location, weights_only=True)
        except Exception as e:  # a truncated file, or one holding more than tensors and containers
            raise ValueError(f"{where} cannot be read as a checkpoint file ({type(e).__name__}: {e})") from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT or payload.get("member") != i:
        raise ValueError(f"{where} is not member {i} of a {FORMAT} checkpoint")
    model = payload.get("model")
    if not isinstance(model, dict):
        raise ValueError(f"{where} has no model state_dict (got {type(model).__name__})")
    missing = [k for k in index["keys"] if k not in model]
    extra = [k for k in model if k not in index["keys"]]
    if missing or extra:
        raise ValueError(f"{where} does not match its index.json: keys missing from it {missing}, "
                         f"unexpected keys {extra}")
    for k in index["keys"]:
        v, shape, dtype = model[k], index["shapes"][k], _dtype_of(index["dtypes"][k])
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"{where}: {k!r} is a {type(v).__name__}, not a tensor")
        if list(v.shape) != shape or v.dtype != dtype:
            raise ValueError(f"{where}: {k!r} is {list(v.shape)} {v.dtype}, but index.json records "
                             f"{shape} {dtype}: the file does not belong to this checkpoint")
    if not isinstance(payload.get("optimizer"), (dict, type(None))):
        raise ValueError(f"{where}: its optimizer state is a {type(payload.get('optimizer')).__name__}; "
                         f"expected a state_dict or None")
    return payload


def load_member(directory: str | os.PathLike, i: int, *, map_location: Any = "cpu") -> dict[str, torch.Tensor]:
    """Member ``i``'s ``state_dict`` from a checkpoint of :func:`save_members` (no process group
    needed): load it into an ordinary module with ``module.load_state_dict``. The file is read
    with ``torch.load(weights_only=True)`` and checked against ``index.json``."""
    return _read_member(directory, i, map_location=map_location)["model"]


def load_member_optimizer(directory: str | os.PathLike, i: int, *, map_location: Any = "cpu") -> dict | None:
    """Member ``i``'s optimizer state as the ``state_dict`` of the matching ``torch.optim``
    optimizer over that member's parameters (``torch.optim.Adam(module.parameters())
    .load_state_dict(...)``), or None when the checkpoint was saved without an optimizer."""
    return _read_member(directory, i, map_location=map_location)["optimizer"]


def load_members(model: Any, directory: str | os.PathLike, optimizer: Any = None) -> dict[str, Any]:
    """Load the members this rank holds (a :class:`ShardedWideModel`: its ``.members``; a
    :class:`~wide_compiler.WideModel`: all N) from a checkpoint of :func:`save_members`, whatever
    the number of ranks that wrote it; with ``optimizer``, their optimizer state and per-member
    hyperparameters too (state tensors are created when the optimizer has none yet). Local: no
    communication. Returns the checkpoint's index (``index["metadata"]``: what was saved with it).

    Everything is read and checked before anything changes: the index (``n`` an int equal to
    the model's N, one file per member named as :func:`save_members` names it, inside the
    checkpoint directory: a path or symlink leading elsewhere is refused), every member file
    this rank loads (read with ``torch.load(weights_only=True)``; its keys, shapes and dtypes),
    and with ``optimizer`` every member's optimizer state (param groups, state shapes and dtypes)
    and hyperparameters (the optimizer's rules). A failure raises and leaves the model and the
    optimizer as they were.

    Raises ``ValueError`` when the checkpoint's N, keys, shapes or dtypes (in its ``index.json``
    or its member files) differ from the model's, a file is not the one its index names, or an
    optimizer is given and the checkpoint has none (or another optimizer class's, or state that
    does not fit it); ``FileNotFoundError`` when a file is missing. (The index's ``module``,
    the member class's name, is informational and not checked.)

    Example:
        >>> import tempfile, torch, wide_compiler as wc, wide_compiler.distributed as wcd
        >>> a = wc.compile([torch.nn.Linear(3, 2) for _ in range(4)], torch.randn(1, 3), config=wc.WideConfig.fast())
        >>> opt_a = wc.optim.Adam(a.parameters(), lr=[0.1, 0.2, 0.3, 0.4])
        >>> d = tempfile.mkdtemp(); _ = wcd.save_members(a, d, opt_a)
        >>> b = wc.compile([torch.nn.Linear(3, 2) for _ in range(4)], torch.randn(1, 3), config=wc.WideConfig.fast())
        >>> opt_b = wc.optim.Adam(b.parameters())
        >>> _ = wcd.load_members(b, d, opt_b)
        >>> torch.equal(a.weight, b.weight), opt_b.param_groups[0]["lr"].tolist()
        (True, [0.1, 0.2, 0.3, 0.4])
    """
    name = "wide_compiler.distributed.load_members"
    sharded = _as_sharded(model, "load_members")
    _check_optimizer(optimizer, sharded, "load_members")
    index = read_index(directory)
    if index["n"] != sharded.n_global:
        raise ValueError(f"{name}: the checkpoint in {directory} has N={index['n']} members, the "
                         f"model N={sharded.n_global}")
    sd = sharded.member_state_dict(sharded.members.start)
    keys = list(sd)
    if sorted(index["keys"]) != sorted(keys):
        missing = sorted(set(keys) - set(index["keys"]))
        extra = sorted(set(index["keys"]) - set(keys))
        raise ValueError(f"{name}: the checkpoint in {directory} does not match the model: keys "
                         f"missing from it {missing}, unexpected keys {extra}")
    for k, v in sd.items():
        saved = (index["shapes"][k], index["dtypes"][k])
        if saved != (list(v.shape), str(v.dtype)):
            raise ValueError(f"{name}: the checkpoint in {directory} does not match the model: {k!r} "
                             f"was saved as {saved[0]} {saved[1]}, the model's is {list(v.shape)} {v.dtype}")
    if optimizer is not None and index.get("optimizer") != type(optimizer).__name__:
        raise ValueError(f"{name}: the checkpoint in {directory} has optimizer state of "
                         f"{index.get('optimizer')!r}; got a {type(optimizer).__name__} (load it "
                         f"into the same optimizer class, or pass optimizer=None)")
    device = _comm_device(sharded)
    # Every file is read and checked (against the index, itself checked against the model
    # above) before anything changes.
    payloads = {i: _read_member(directory, i, index, map_location=device) for i in sharded.members}
    if optimizer is not None:
        _check_optimizer_payloads(optimizer, sharded, payloads, directory)
    for i, payload in payloads.items():
        sharded.load_member_state_dict(i, payload["model"])
        if optimizer is not None:
            _load_member_optimizer(optimizer, sharded.local(i), payload["optimizer"])
    log.info("wide_compiler.distributed: rank %d loaded members %s from %s", sharded.rank,
             _span(sharded.members), directory)
    return index


def _hparam_names(optimizer: Any) -> tuple[str, ...]:
    return (*optimizer._hparams, *optimizer._pairs, "initial_lr")


def _check_optimizer_payloads(optimizer: Any, sharded: ShardedWideModel, payloads: dict[int, dict],
                              directory: Any) -> None:
    """Every member's saved optimizer state fits ``optimizer`` (structure, state shapes and
    dtypes) and its hyperparameters pass the optimizer's rules: applied, in order, to a
    throwaway copy of the param groups, so nothing of ``optimizer`` changes here."""
    for i, payload in payloads.items():
        _check_member_optimizer(optimizer, payload["optimizer"], f"member {i} in {directory}")
    probe = object.__new__(type(optimizer))
    probe.__dict__.update(optimizer.__dict__)
    probe.param_groups = [dict(g) for g in optimizer.param_groups]  # updated instead of the real ones
    names = _hparam_names(optimizer)
    for i, payload in payloads.items():
        groups = payload["optimizer"]["param_groups"]
        try:
            probe._set_member_values(sharded.local(i), {gi: {k: sg[k] for k in names if k in sg}
                                                        for gi, sg in enumerate(groups)})
        except (ValueError, TypeError, IndexError) as e:
            raise ValueError(f"wide_compiler.distributed.load_members (member {i} in {directory}): its "
                             f"saved hyperparameters do not fit the optimizer ({e}); nothing was "
                             f"loaded") from e


def _check_member_optimizer(optimizer: Any, osd: Any, where: str) -> None:
    name = f"wide_compiler.distributed.load_members ({where})"
    if not isinstance(osd, dict) or "param_groups" not in osd:
        raise ValueError(f"{name}: no optimizer state in the checkpoint (saved without an optimizer)")
    groups, states = osd["param_groups"], osd.get("state", {})
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise ValueError(f"{name}: 'param_groups' must be a list of dicts; got {type(groups).__name__}")
    if not isinstance(states, dict):
        raise ValueError(f"{name}: 'state' must be a dict; got {type(states).__name__}")
    if len(groups) != len(optimizer.param_groups):
        raise ValueError(f"{name}: {len(groups)} saved param groups, the optimizer has "
                         f"{len(optimizer.param_groups)}")
    for gi, (g, sg) in enumerate(zip(optimizer.param_groups, groups)):
        if not isinstance(sg.get("params"), list) or len(sg["params"]) != len(g["params"]):
            saved = len(sg["params"]) if isinstance(sg.get("params"), list) else sg.get("params")
            raise ValueError(f"{name}: param group {gi} saved with {saved!r} parameters, "
                             f"the optimizer's has {len(g['params'])}")
        for flag in optimizer._flags:
            if flag in sg and sg[flag] != g.get(flag):
                raise ValueError(f"{name}: param group {gi} was saved with {flag}={sg[flag]!r}, the "
                                 f"optimizer has {flag}={g.get(flag)!r} (a flag shared by all members)")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for pid, st in states.items():
        if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < len(params):
            raise ValueError(f"{name}: state for parameter {pid!r}; the optimizer has {len(params)} "
                             f"parameters (ids 0..{len(params) - 1})")
        if not isinstance(st, dict):
            raise ValueError(f"{name}: the state of parameter {pid} is a {type(st).__name__}; expected a dict")
        p = params[pid]
        current = optimizer.state.get(p, {})
        for key, v in st.items():
            if not isinstance(v, torch.Tensor):
                raise ValueError(f"{name}: state {key!r} of parameter {pid} is a {type(v).__name__}; "
                                 f"expected a tensor")
            if v.dim() and tuple(v.shape) != tuple(p.shape[1:]):
                raise ValueError(f"{name}: state {key!r} of parameter {pid} has shape {list(v.shape)}; "
                                 f"expected {list(p.shape[1:])}")
            cur = current.get(key)
            if cur is not None and (not isinstance(cur, torch.Tensor) or tuple(cur.shape) != (optimizer.n, *v.shape)
                                    or cur.dtype != v.dtype):
                held = f"{list(cur.shape)} {cur.dtype}" if isinstance(cur, torch.Tensor) else type(cur).__name__
                raise ValueError(f"{name}: state {key!r} of parameter {pid} was saved as {list(v.shape)} "
                                 f"{v.dtype}; the optimizer holds {held} for its {optimizer.n} members")


@torch.no_grad()
def _load_member_optimizer(optimizer: Any, local: int, osd: dict) -> None:
    """Member ``local``'s optimizer state and hyperparameters from ``osd`` (checked by
    :func:`_check_optimizer_payloads`)."""
    names = _hparam_names(optimizer)
    optimizer._set_member_values(local, {gi: {k: sg[k] for k in names if k in sg}
                                         for gi, sg in enumerate(osd["param_groups"])})
    params = [p for g in optimizer.param_groups for p in g["params"]]
    for pid, st in osd.get("state", {}).items():
        p = params[pid]
        state = optimizer.state[p]
        for key, v in st.items():
            cur = state.get(key)
            if cur is None:  # a fresh optimizer: make the [N, ...] state this member needs
                device = p.device if v.dim() else torch.device("cpu")  # step counts live on the CPU
                cur = state[key] = torch.zeros((optimizer.n, *v.shape), dtype=v.dtype, device=device)
            cur[local].copy_(v)
