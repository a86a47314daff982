"""Sharding N members over the ranks of a process group: which rank holds which member
(:func:`shard_range`), this rank's slice of the population (:class:`ShardedWideModel`) and how it
is built (:func:`shard`). Member ids are GLOBAL everywhere; see :mod:`wide_compiler.distributed`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..model import WideModel

__all__ = ["ShardedWideModel", "shard", "shard_range"]

log = logging.getLogger(__name__)


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
    from ..api import compile as wide_compile

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


# -- helpers shared by the collectives and the checkpoints -------------------------------------
def _comm_device(sharded: ShardedWideModel, t: torch.Tensor | None = None) -> torch.device:
    """The device collectives use: the tensor's, else the model's parameters' (CUDA for NCCL)."""
    if t is not None:
        return t.device
    p = next(sharded.parameters(), None)
    if p is None:
        p = next(sharded.buffers(), None)
    return p.device if p is not None else torch.device("cpu")


def _check_optimizer(optimizer: Any, sharded: ShardedWideModel, what: str) -> None:
    if optimizer is None:
        return
    from ..optim import WideOptimizer

    if not isinstance(optimizer, WideOptimizer):
        raise TypeError(f"wide_compiler.distributed.{what}: {type(optimizer).__name__} is not a "
                        f"wide_compiler.optim optimizer (per-member state is needed)")
    if optimizer.n != sharded.n_local:
        raise ValueError(f"wide_compiler.distributed.{what}: the optimizer has N={optimizer.n} members "
                         f"but rank {sharded.rank} holds {sharded.n_local}: build it over this rank's "
                         f"shard (optimizer(sharded.parameters(), ...))")
    optimizer._renormalize_all()  # hyperparameters assigned by hand (group["lr"] = 1e-4) become [N] again
