"""Collective operations over a sharded population: every rank gets the full ``[N, ...]``
output (:func:`gather_outputs`) or the ``[N]`` per-member metrics (:func:`all_gather_metrics`),
and member ``src`` is copied onto member ``dst`` wherever they live
(:func:`copy_member_weights`, the "exploit" step of population-based training). Every function
here is COLLECTIVE: every rank of the group calls it, in the same order, with the same arguments.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .._deprecation import warn_renamed
from ..fx.constants import check_member_constants, member_constants, set_member_constants
from .sharding import ShardedWideModel, _as_sharded, _check_optimizer, _collective, _comm_device, _span

__all__ = ["all_gather_metrics", "copy_member", "copy_member_weights", "gather_outputs"]

log = logging.getLogger(__name__)


# -- gathering outputs --------------------------------------------------------------------------
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
                           "optimizer": None, "hparams": None, "constants": member_constants(wide, local)}
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
            "hparams": entries["hparams"], "constants": entries["constants"]}


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
def copy_member_weights(sharded: Any, src: int, dst: int, optimizer: Any = None) -> None:
    """Global member ``dst`` becomes a copy of global member ``src``, wherever they live:
    weights and buffers, per-member constants (Note [Per-member constants] in fx/constants.py:
    across ranks, only to a configuration ``dst``'s rank was compiled for, else both ranks raise)
    and, with ``optimizer`` (this rank's :mod:`wide_compiler.optim`
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
    :meth:`WideModel.copy_member_weights`. Copies issued one after another in the same order on
    every rank give the same result as the same sequence on a single wide model.

    Example:
        >>> import torch, wide_compiler as wc, wide_compiler.distributed as wcd
        >>> sharded = wcd.shard([torch.nn.Linear(3, 2) for _ in range(4)], torch.randn(1, 3),
        ...                     config=wc.WideConfig.fast())
        >>> opt = wc.optim.Adam(sharded.parameters(), lr=[0.1, 0.2, 0.3, 0.4])
        >>> wcd.copy_member_weights(sharded, 3, 0, opt)
        >>> torch.equal(sharded.wide.weight[0], sharded.wide.weight[3]), opt.param_groups[0]["lr"][0].item()
        (True, 0.4)
    """
    sharded = _as_sharded(sharded, "copy_member_weights")
    src = sharded.check_member(src, "src")
    dst = sharded.check_member(dst, "dst")
    group = sharded.group  # (raises on every rank when a pickled model lost its group)
    s_rank, d_rank = sharded.owner(src), sharded.owner(dst)
    me = sharded.rank
    if src == dst or me not in (s_rank, d_rank):
        _check_optimizer(optimizer, sharded, "copy_member_weights")
        return
    if s_rank == d_rank:
        _check_optimizer(optimizer, sharded, "copy_member_weights")
        sharded.wide.copy_member_weights(sharded.local(src), sharded.local(dst), optimizer)
        return
    dist = torch.distributed
    peer = d_rank if me == s_rank else s_rank
    peer_global = dist.get_global_rank(group, peer) if group is not None else peer
    device = _comm_device(sharded)
    where = (f"wide_compiler.distributed.copy_member_weights member {src} (rank {s_rank}) -> member {dst} "
             f"(rank {d_rank})")
    error, entries, mine = None, None, None
    try:  # a failure here is sent to the peer (which raises too) instead of leaving it waiting
        _check_optimizer(optimizer, sharded, "copy_member_weights")
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
        moves = {}
        if verdict is None:  # the source's per-member constants, where this rank's model proved them
            try:
                moves = check_member_constants(sharded.wide, {sharded.local(dst): theirs["meta"]["constants"]},
                                               lambda local: f"member {dst}", source=f"member {src} (rank {s_rank})")
            except ValueError as e:
                verdict = str(e)
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
    set_member_constants(sharded.wide, moves)
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


def copy_member(sharded: Any, src: int, dst: int, optimizer: Any = None) -> None:
    """Deprecated alias of :func:`copy_member_weights` (warns once)."""
    warn_renamed("wide_compiler.distributed.copy_member", "wide_compiler.distributed.copy_member_weights")
    copy_member_weights(sharded, src, dst, optimizer)
