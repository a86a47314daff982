"""N members sharded across processes with ``torch.distributed`` (DESIGN §7, "Beyond one process").

Each rank of a process group holds a contiguous slice of the N members as its own
:class:`~wide_compiler.WideModel`; member ids stay GLOBAL everywhere in this module. With N
members over W ranks, rank ``r`` holds ``shard_range(N, W, r)``: the split is as even as possible
and the earlier ranks take the extra members (N=10 over 4 ranks: 3, 3, 2, 2).

- :func:`shard` builds a rank's shard (:class:`ShardedWideModel`) from N modules or from a
  factory of a global member index (so no rank builds the members it does not hold).
- :func:`gather_outputs` / :func:`all_gather_metrics` give every rank the full ``[N, ...]``
  output or the ``[N]`` per-member losses (to rank the population).
- :func:`copy_member_weights` copies member ``src`` onto member ``dst`` across ranks: weights,
  buffers and, with a :mod:`wide_compiler.optim` optimizer, its per-member state and
  hyperparameters (the "exploit" step of population-based training). (Its old name,
  ``copy_member``, is a deprecated alias.)
- :func:`save_members` / :func:`load_members` write and read per-member checkpoints (one file per
  member plus ``index.json``) that need no process group to read: a run of 4 ranks resumes on 2
  or on 1, and :func:`load_member` gives one member's ordinary ``state_dict`` back.

Collective calls: :func:`shard`, :func:`gather_outputs`, :func:`all_gather_metrics`,
:func:`copy_member_weights` and :func:`save_members` must be called by EVERY rank of the group, in
the same order and with the same arguments (as every ``torch.distributed`` collective). Loading is
local.
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
then call :func:`copy_member_weights` with the same ``(src, dst)`` in every replica (over its member
group). The functions here accept the DDP wrapper wherever they take a ``ShardedWideModel``.

The package is split by concern: :mod:`~wide_compiler.distributed.sharding` (which rank holds
which member, :class:`ShardedWideModel`, :func:`shard`),
:mod:`~wide_compiler.distributed.collectives` (gathering outputs and metrics, copying members
across ranks) and :mod:`~wide_compiler.distributed.checkpoints` (per-member checkpoints); every
public name is importable from ``wide_compiler.distributed`` itself.
"""

from __future__ import annotations

from .checkpoints import (
    FORMAT,
    FORMAT_VERSION,
    load_member,
    load_member_constants,
    load_member_optimizer,
    load_members,
    read_index,
    save_members,
)
from .collectives import all_gather_metrics, copy_member, copy_member_weights, gather_outputs
from .sharding import ShardedWideModel, shard, shard_range
from .sharding import _lost_group_ref  # noqa: F401 -- named by models pickled before the split

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "ShardedWideModel",
    "all_gather_metrics",
    "copy_member",
    "copy_member_weights",
    "gather_outputs",
    "load_member",
    "load_member_constants",
    "load_member_optimizer",
    "load_members",
    "read_index",
    "save_members",
    "shard",
    "shard_range",
]
