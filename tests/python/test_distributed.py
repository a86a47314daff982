"""wide_compiler.distributed: members sharded over gloo process groups of 2 and 4 processes
(spawned here, CPU only), checked member by member against one single-process wide model; plus
the world-size-1 paths and the error cases.

The multi-process workers run in fresh interpreters (torch.multiprocessing, "spawn"), one world
of 2 and one of 4 processes for the whole module (Note [One world per size]), joined in a gloo group
through a file in tmp_path, with one thread and a 600 s collective timeout (a guard against a hang,
not a time limit: on a busy machine one rank can trail the others by a minute); they assert inside
the workers (a failing worker fails its test with its traceback)."""
from __future__ import annotations

import copy
import datetime
import json
import os
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import wide_compiler as wc
import wide_compiler.distributed as wcd
from torch import nn
from wide_compiler.distributed.sharding import _as_sharded, _owner

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with gloo is not available")

FAST = wc.WideConfig.fast()
SAMPLE = torch.randn(3, 4)


def make(i: int, *, bn: bool = True, seed: int = 100) -> nn.Module:
    """Member i: the same module whichever process builds it."""
    torch.manual_seed(seed + i)
    # (BatchNorm after the activation: a bias right before it would get a zero gradient, whose
    # rounding noise Adam blows up to +-lr, differently for different N)
    layers = [nn.Linear(4, 8), nn.Tanh()] + ([nn.BatchNorm1d(8)] if bn else []) + [nn.Linear(8, 2)]
    return nn.Sequential(*layers)


def data(n: int, batch: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, batch, 4, generator=g), torch.randn(n, batch, 2, generator=g)


def hyper(n: int) -> dict:
    return {"lr": [0.01 * (i + 1) for i in range(n)], "betas": (0.9, [0.99 - 0.001 * i for i in range(n)])}


def sliced(h: dict, r: range) -> dict:
    return {"lr": h["lr"][r.start:r.stop], "betas": (h["betas"][0], h["betas"][1][r.start:r.stop])}


def train_step(model, opt, x, y) -> torch.Tensor:
    losses = wc.optim.member_losses(F.mse_loss, model(x), y)
    opt.zero_grad()
    losses.sum().backward()
    opt.step()
    return losses.detach()


# -- worker plumbing ------------------------------------------------------------------------------
def _entry(rank: int, world: int, init_file: str, fn_name: str, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))  # a hang guard (module docstring)
    try:
        globals()[fn_name](rank, world, *args)
        # every rank is done with its collectives before any tears the group down: a rank that
        # destroyed its gloo pairs while the other still had a collective in flight aborted the
        # other ('terminate called without an active exception'), seen once under load
        dist.barrier()
    finally:
        dist.destroy_process_group()


def spawn(fn, world: int, tmp_path, *args) -> None:
    """Run ``fn(rank, world, *args)`` in ``world`` fresh processes joined in one gloo group."""
    import torch.multiprocessing as mp

    init_file = tmp_path / f"init_{fn.__name__}_{world}"
    env = {"OMP_NUM_THREADS": "1"}  # the children inherit sys.path from this process (spawn)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        mp.start_processes(_entry, args=(world, str(init_file), fn.__name__, args), nprocs=world,
                           join=True, start_method="spawn")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def assert_members_equal(sharded: wcd.ShardedWideModel, full: wc.WideModel, *, exact: bool) -> None:
    r = sharded.members
    check = torch.testing.assert_close if not exact else (lambda a, b, msg=None: torch.testing.assert_close(a, b, rtol=0, atol=0, msg=msg))
    for (name, t), (ref_name, ref) in zip(sharded.wide.state_dict().items(), full.state_dict().items()):
        assert name == ref_name
        check(t, ref[r.start:r.stop], msg=lambda m, name=name: f"rank {sharded.rank} {name}: {m}")


def assert_optim_equal(opt, opt_full, r: range, *, exact: bool) -> None:
    tol = {"rtol": 0, "atol": 0} if exact else {}
    for p, q in zip((p for g in opt.param_groups for p in g["params"]),
                    (q for g in opt_full.param_groups for q in g["params"])):
        assert set(opt.state[p]) == set(opt_full.state[q])
        for key, t in opt.state[p].items():
            torch.testing.assert_close(t, opt_full.state[q][key][r.start:r.stop], **tol, msg=key)
    for g, h in zip(opt.param_groups, opt_full.param_groups):
        torch.testing.assert_close(g["lr"], h["lr"][r.start:r.stop], rtol=0, atol=0)
        for a, b in zip(g["betas"], h["betas"]):
            torch.testing.assert_close(a, b[r.start:r.stop], rtol=0, atol=0)


# -- workers (run in the spawned processes) -----------------------------------------------------
def _match_single_process(rank: int, world: int, n: int, form: str, ckpt: str | None) -> None:
    full = wc.compile([make(i) for i in range(n)], SAMPLE, config=FAST)
    source = make if form == "factory" else [make(i) for i in range(n)]
    sharded = wcd.shard(source, SAMPLE, n=n, config=FAST)
    r = sharded.members
    assert (sharded.rank, sharded.world_size, sharded.n_global) == (rank, world, n)
    assert r == wcd.shard_range(n, world, rank) and sharded.wide.n == len(r)
    assert_members_equal(sharded, full, exact=True)

    # forward / backward, member by member
    x, y = data(n)
    out = sharded(x[r.start:r.stop])
    ref = full(x)
    gathered = wcd.gather_outputs(out, sharded)
    torch.testing.assert_close(gathered, ref.detach())
    assert gathered.requires_grad  # this rank's rows keep their graph
    nested = wcd.gather_outputs({"a": out.detach(), "b": (out.detach() * 2, "tag")}, sharded)
    torch.testing.assert_close(nested["b"][0], 2 * ref.detach())
    assert nested["b"][1] == "tag"
    losses = wc.optim.member_losses(F.mse_loss, out, y[r.start:r.stop])
    ref_losses = wc.optim.member_losses(F.mse_loss, ref, y)
    losses.sum().backward()
    ref_losses.sum().backward()
    metrics = wcd.all_gather_metrics(losses, sharded)
    assert metrics.shape == (n,)
    torch.testing.assert_close(metrics, ref_losses.detach())
    torch.testing.assert_close(wcd.all_gather_metrics([float(v) for v in losses.detach()], sharded),
                               ref_losses.detach().double())
    for (name, p), (_, q) in zip(sharded.wide.named_parameters(), full.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad[r.start:r.stop], msg=lambda m, name=name: f"grad {name}: {m}")
    assert_members_equal(sharded, full, exact=False)  # BatchNorm running stats too

    # PBT across ranks: weights, buffers, Adam state and per-member hyperparameters
    h = hyper(n)
    opt = wc.optim.Adam(sharded.parameters(), **sliced(h, r))
    opt_full = wc.optim.Adam(full.parameters(), **h)
    opt.step()
    opt_full.step()
    # start from identical values (gathered from the shards), so the copies must match exactly
    _sync_full(full, opt_full, sharded, opt)
    pairs = [(0, n - 1), (n - 1, 1), (2, 0), (1, 1), (n - 2, n - 3), (-1, 2)]
    for src, dst in pairs:
        wcd.copy_member_weights(sharded, src, dst, opt)
        full.copy_member_weights(src, dst, opt_full)
    assert_members_equal(sharded, full, exact=True)
    assert_optim_equal(opt, opt_full, r, exact=True)
    # training goes on alike after the copies
    x2, y2 = data(n, seed=1)
    train_step(sharded, opt, x2[r.start:r.stop], y2[r.start:r.stop])
    train_step(full, opt_full, x2, y2)
    assert_members_equal(sharded, full, exact=False)
    assert_optim_equal(opt, opt_full, r, exact=False)
    # weights only (no optimizer): the optimizer is untouched
    lr_before = opt.param_groups[0]["lr"].clone()
    wcd.copy_member_weights(sharded, 0, n - 1)
    full.copy_member_weights(0, n - 1)
    assert_members_equal(sharded, full, exact=False)
    assert torch.equal(opt.param_groups[0]["lr"], lr_before)

    if ckpt is not None:  # a checkpoint, and the state one more step later (for the resume tests)
        wcd.save_members(sharded, os.path.join(ckpt, "a"), opt, metadata={"step": 2, "world": world})
        x3, y3 = data(n, seed=2)
        train_step(sharded, opt, x3[r.start:r.stop], y3[r.start:r.stop])
        wcd.save_members(sharded, os.path.join(ckpt, "b"), opt)


def _sync_full(full, opt_full, sharded, opt) -> None:
    """Give every rank's single-process reference exactly the sharded population's values
    (all-gathered), so that the copies that follow can be compared bit for bit."""
    with torch.no_grad():
        for p, q in zip(sharded.wide.parameters(), full.parameters()):
            q.copy_(wcd.gather_outputs(p.detach(), sharded))
        for b, c in zip(sharded.wide.buffers(), full.buffers()):
            c.copy_(wcd.gather_outputs(b, sharded))
        for p, q in zip(sharded.wide.parameters(), full.parameters()):
            for key, t in opt.state[p].items():
                opt_full.state[q][key].copy_(wcd.gather_outputs(t, sharded))


def _errors(rank: int, world: int, tmp: str) -> None:
    n = 3  # ranks hold 2 and 1 members
    sharded = wcd.shard(make, SAMPLE, n=n, config=FAST)
    assert [len(x) for x in sharded.ranges] == [2, 1]
    with pytest.raises(ValueError, match="N=1 members cannot be sharded over 2 ranks"):
        wcd.shard(make, SAMPLE, n=1, config=FAST)
    with pytest.raises(IndexError, match="src id 3 out of range"):
        wcd.copy_member_weights(sharded, 3, 0)
    with pytest.raises(IndexError, match="dst id 'a' out of range"):
        wcd.copy_member_weights(sharded, 0, "a")
    other = 2 if rank == 0 else 0
    with pytest.raises(IndexError, match=f"member {other} is held by rank {1 - rank}"):
        sharded.local(other)
    # a wrong output on ONE rank: every rank raises (no hang)
    out = sharded(torch.randn(len(sharded.members), 2, 4))
    with pytest.raises(ValueError, match="output 0 of rank 1 has shape"):
        wcd.gather_outputs(out if rank == 0 else out[:0], sharded)
    # a wrong number of metrics on ONE rank: every rank raises (no hang)
    with pytest.raises(ValueError, match=r"all_gather_metrics: output 0 of rank 1 has shape \[5\]"):
        wcd.all_gather_metrics(torch.zeros(len(sharded.members) if rank == 0 else 5), sharded)
    # an optimizer on one rank only: both ranks of the copy raise (no hang)
    opt = wc.optim.SGD(sharded.parameters(), lr=0.1, momentum=0.9)
    with pytest.raises(ValueError, match="differ in structure"):
        wcd.copy_member_weights(sharded, 0, 2, opt if rank == 0 else None)
    # an optimizer that fails its checks on ONE of the two ranks: both raise
    wrong_n = wc.optim.SGD([nn.Parameter(torch.zeros(5, 2))], lr=0.1)
    for src, dst in ((0, 2), (2, 0)):
        with pytest.raises((ValueError, RuntimeError), match="the optimizer has N=5|rank 1 failed"):
            wcd.copy_member_weights(sharded, src, dst, opt if rank == 0 else wrong_n)
    # save_members failing on ONE rank (a torch.optim optimizer on rank 0, an unwritable
    # directory on rank 1): every rank raises, no index.json is written
    with pytest.raises((TypeError, RuntimeError), match="not a wide_compiler.optim|rank 0 failed"):
        wcd.save_members(sharded, os.path.join(tmp, "s1"),
                         torch.optim.SGD(sharded.parameters(), lr=0.1) if rank == 0 else opt)
    blocker = os.path.join(tmp, f"file_{rank}")
    open(blocker, "w").close()
    with pytest.raises((OSError, RuntimeError), match="rank 1 failed|File exists|Not a directory"):
        wcd.save_members(sharded, os.path.join(tmp, "s2") if rank == 0 else os.path.join(blocker, "s2"))
    assert not os.path.exists(os.path.join(tmp, "s2", "index.json"))
    # a pickled shard lost its process group: collectives raise until .group is set again
    clone = pickle.loads(pickle.dumps(sharded))
    for call in (lambda: wcd.gather_outputs(clone.wide.get_parameter("0.weight").detach(), clone),
                 lambda: wcd.copy_member_weights(clone, 0, 2), lambda: wcd.save_members(clone, tmp)):
        with pytest.raises(RuntimeError, match="process group was lost in pickling; set .group"):
            call()
    clone.group = None
    assert wcd.gather_outputs(clone.wide.get_parameter("0.weight").detach(), clone).shape[0] == n
    # argument errors of shard() on ONE rank: every rank raises
    with pytest.raises((TypeError, RuntimeError), match="got ONE module|rank 1 failed to build"):
        wcd.shard(make(0) if rank == 1 else make, SAMPLE, n=n, config=FAST)
    # ranks that disagree on N: every rank raises at shard() (none is left hanging)
    with pytest.raises((ValueError, RuntimeError), match="cannot be sharded|rank 1 failed to build"):
        wcd.shard(make, SAMPLE, n=3 if rank == 0 else 1, config=FAST)
    with pytest.raises(ValueError, match="every rank must pass the same population"):
        wcd.shard(make, SAMPLE, n=3 if rank == 0 else 4, config=FAST)
    # a rank whose members differ: every rank raises at shard()
    with pytest.raises(ValueError, match="members differ"):
        wcd.shard(lambda i: make(i, bn=(rank == 0)), SAMPLE, n=n, config=FAST)
    # the group still works after all of the above
    wcd.copy_member_weights(sharded, 0, 2)
    weights = wcd.gather_outputs(sharded.wide.get_parameter("0.weight").detach(), sharded)
    assert torch.equal(weights[0], weights[2])


def _sgd_partial_momentum(rank: int, world: int) -> None:
    """SGD with momentum [0, 0, 0.9, 0.9]: rank 0's optimizer has no momentum buffer (its members
    have none), rank 1's has; copies both ways match one wide model's."""
    n, momentum = 4, [0.0, 0.0, 0.9, 0.9]
    sharded = wcd.shard(lambda i: make(i, bn=False), SAMPLE, n=n, config=FAST)
    full = wc.compile([make(i, bn=False) for i in range(n)], SAMPLE, config=FAST)
    r = sharded.members
    opt = wc.optim.SGD(sharded.parameters(), lr=0.1, momentum=momentum[r.start:r.stop])
    opt_full = wc.optim.SGD(full.parameters(), lr=0.1, momentum=momentum)
    x, y = data(n)
    train_step(sharded, opt, x[r.start:r.stop], y[r.start:r.stop])
    train_step(full, opt_full, x, y)
    p = next(iter(sharded.wide.parameters()))
    assert ("momentum_buffer" in opt.state[p]) == (rank == 1)
    for src, dst in ((1, 2), (3, 0), (0, 1)):  # from a rank without the buffer, to one, within one
        wcd.copy_member_weights(sharded, src, dst, opt)
        full.copy_member_weights(src, dst, opt_full)
    assert "momentum_buffer" in opt.state[p]  # created on rank 0 by the copy 3 -> 0
    torch.testing.assert_close(opt.param_groups[0]["momentum"],
                               opt_full.param_groups[0]["momentum"][r.start:r.stop], rtol=0, atol=0)
    for _ in range(2):
        x, y = data(n, seed=1 + _)
        train_step(sharded, opt, x[r.start:r.stop], y[r.start:r.stop])
        train_step(full, opt_full, x, y)
    assert_members_equal(sharded, full, exact=False)
    moving = [i for i in r if float(opt_full.param_groups[0]["momentum"][i]) > 0]
    for q, q_full in zip(sharded.wide.parameters(), full.parameters()):
        for i in moving:
            torch.testing.assert_close(opt.state[q]["momentum_buffer"][sharded.local(i)],
                                       opt_full.state[q_full]["momentum_buffer"][i])


def _resume(rank: int, world: int, n: int, ckpt: str) -> None:
    sharded = wcd.shard(lambda i: make(i, seed=999), SAMPLE, n=n, config=FAST)  # other weights
    r = sharded.members
    opt = wc.optim.Adam(sharded.parameters())  # fresh: no state, default hyperparameters
    index = wcd.load_members(sharded, os.path.join(ckpt, "a"), opt)
    assert index["metadata"] == {"step": 2, "world": 4} and index["saved_by_world_size"] == 4
    _check_against_checkpoint(sharded, opt, os.path.join(ckpt, "a"))
    x3, y3 = data(n, seed=2)
    train_step(sharded, opt, x3[r.start:r.stop], y3[r.start:r.stop])
    _check_against_checkpoint(sharded, opt, os.path.join(ckpt, "b"), exact=False)


def _check_against_checkpoint(sharded, opt, directory: str, *, exact: bool = True) -> None:
    tol = {"rtol": 0, "atol": 0} if exact else {}
    for i in sharded.members:
        torch.testing.assert_close(sharded.member_state_dict(i), wcd.load_member(directory, i), **tol)
        mine, saved = opt.member_state_dict(sharded.local(i)), wcd.load_member_optimizer(directory, i)
        torch.testing.assert_close(mine["state"], saved["state"], **tol)
        assert mine["param_groups"] == saved["param_groups"]


def _ddp(rank: int, world: int) -> None:
    """2 shards x 2 replicas: members over the member group, data parallel over the data group."""
    n, shards, batch = 5, 2, 4
    replica, shard_id = divmod(rank, shards)
    member_group, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    data_group, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    sharded = wcd.shard(lambda i: make(i, bn=False), SAMPLE, member_group, n=n, config=FAST)
    assert (sharded.rank, sharded.world_size) == (shard_id, shards)
    r = sharded.members
    assert copy.deepcopy(sharded).group is sharded.group is member_group
    ddp = nn.parallel.DistributedDataParallel(sharded, process_group=data_group)
    full = wc.compile([make(i, bn=False) for i in range(n)], SAMPLE, config=FAST)
    x, y = data(n, batch=2 * batch)
    mine = slice(replica * batch, (replica + 1) * batch)
    losses = wc.optim.member_losses(F.mse_loss, ddp(x[r.start:r.stop, mine]), y[r.start:r.stop, mine])
    losses.sum().backward()
    wc.optim.member_losses(F.mse_loss, full(x), y).sum().backward()  # the whole batch at once
    for (name, p), (_, q) in zip(sharded.wide.named_parameters(), full.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad[r.start:r.stop], msg=lambda m, name=name: f"grad {name}: {m}")
    # PBT on top: replicas take the same decisions from metrics averaged over the data group
    opt = wc.optim.SGD(sharded.parameters(), lr=[0.1 * (i + 1) for i in r], momentum=0.9)
    opt.step()
    metrics = wcd.all_gather_metrics(losses, ddp)
    dist.all_reduce(metrics, group=data_group)
    metrics /= 2
    order = metrics.argsort().tolist()
    wcd.copy_member_weights(ddp, order[0], order[-1], opt)
    # both replicas of every member hold the same weights and optimizer state
    for t in [*sharded.wide.parameters(), *(v for s in opt.state.values() for v in s.values()),
              opt.param_groups[0]["lr"]]:
        both = [torch.empty_like(t) for _ in range(2)]
        dist.all_gather(both, t.detach().contiguous(), group=data_group)
        assert torch.equal(both[0], both[1])
    gathered = wcd.gather_outputs(sharded.wide.get_parameter("0.weight").detach(), sharded)
    assert torch.equal(gathered[order[0]], gathered[order[-1]])


# -- tests ----------------------------------------------------------------------------------------
# Note [One world per size]: every 2-rank worker runs in ONE spawned 2-process world, every 4-rank
# worker in ONE 4-process world (one after the other, a barrier between them), not in a fresh
# world each: each fresh process costs an import of torch and wide_compiler and its compiles, which
# was most of these tests' time. Each worker still checks exactly what it checked in a world of its
# own (each builds its own shards, models and optimizers; nothing carries over but the process
# group, which the error cases run last and leave working). Each test asserts that its worker ran
# to the end on every rank; a worker that fails stops the world there, so the tests of the workers
# after it fail too, naming the first failure.
class _World:
    """The outcome of one spawned world that ran ``steps`` (worker names) in order."""

    def __init__(self, world: int, tmp, steps: list[tuple[str, tuple]]):
        self.world, self.tmp, self.error = world, tmp, None
        try:
            spawn(_run_steps, world, tmp, str(tmp), steps)
        except Exception as e:  # noqa: BLE001 (reported by the tests whose worker did not finish)
            self.error = e

    def check(self, name: str) -> None:
        """Fail unless worker ``name`` ran to the end on every rank."""
        done = [os.path.exists(os.path.join(self.tmp, f"done_{name}_{rank}")) for rank in range(self.world)]
        if not all(done):
            pytest.fail(f"{name} did not finish on ranks {[r for r, d in enumerate(done) if not d]} of "
                        f"{self.world}: {self.error!r}", pytrace=False)


def _run_steps(rank: int, world: int, tmp: str, steps: list[tuple[str, tuple]]) -> None:
    for name, args in steps:
        globals()[name](rank, world, *args)
        dist.barrier()  # every rank is done with this worker's collectives
        open(os.path.join(tmp, f"done_{name}_{rank}"), "w").close()


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> _World:
    """The 4-process world (Note [One world per size]): the single-process comparison with N=6
    built by a factory (2, 2, 1, 1 members; every check of ``_match_single_process``), which then
    writes a checkpoint (``a``) and the same population one training step later (``b``); then the
    DDP run (``_ddp``)."""
    tmp = tmp_path_factory.mktemp("ranks4")
    return _World(4, tmp, [("_match_single_process", (6, "factory", str(tmp))), ("_ddp", ())])


@pytest.fixture(scope="module")
def checkpoint_4_ranks(four_ranks) -> str:
    """The checkpoint the 4 ranks wrote (fails the test if they did not)."""
    four_ranks.check("_match_single_process")
    return str(four_ranks.tmp)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, four_ranks) -> _World:
    """The 2-process world (Note [One world per size]): N=5 as a list of modules (3 + 2 members),
    SGD with partial momentum, the resume of the 4-rank checkpoint (when it was written), and
    the error cases last."""
    tmp = tmp_path_factory.mktemp("ranks2")
    steps = [("_match_single_process", (5, "list", None)), ("_sgd_partial_momentum", ())]
    if all(os.path.exists(os.path.join(four_ranks.tmp, f"done__match_single_process_{r}")) for r in range(4)):
        steps.append(("_resume", (6, str(four_ranks.tmp))))
    steps.append(("_errors", (str(tmp),)))
    return _World(2, tmp, steps)


def test_sharded_matches_single_process_2_ranks(two_ranks):
    """Forward/backward, gathered outputs and metrics, and PBT copies across ranks (weights,
    BatchNorm buffers, Adam state, per-member lr and betas) equal one single-process wide model.
    (N=5 as a list of modules over 2 ranks: 3 + 2 members; the 4-rank run, N=6 from a factory,
    is in the ``four_ranks`` fixture.)"""
    two_ranks.check("_match_single_process")


def test_errors_across_ranks(two_ranks):
    two_ranks.check("_errors")


def test_copy_member_sgd_partial_momentum(two_ranks):
    two_ranks.check("_sgd_partial_momentum")


def test_ddp_2_shards_x_2_replicas(four_ranks):
    """4 ranks: members sharded over 2 ranks, each shard data-parallel (DDP) over 2 replicas:
    gradients equal the single-process wide model's on the whole batch; replicas stay identical
    through an optimizer step and a PBT copy."""
    four_ranks.check("_ddp")


def test_sharded_matches_single_process_4_ranks_and_checkpoint(checkpoint_4_ranks):
    index = wcd.read_index(os.path.join(checkpoint_4_ranks, "a"))
    assert index["n"] == 6 and index["optimizer"] == "Adam" and index["version"] == wcd.FORMAT_VERSION
    assert index["keys"] == list(make(0).state_dict())
    assert sorted(os.listdir(os.path.join(checkpoint_4_ranks, "a"))) == ["index.json"] + [
        f"member_{i:06d}.pt" for i in range(6)]


def test_checkpoint_resumes_on_2_ranks(checkpoint_4_ranks, two_ranks):
    """Each of 2 ranks loads its 3 members (written by 4 ranks) into a fresh shard and optimizer:
    identical members and optimizer state; one more step matches the 4-rank run's."""
    two_ranks.check("_resume")


def test_checkpoint_resumes_on_1_process(checkpoint_4_ranks):
    """Without a process group: into a plain WideModel, and into ordinary modules and
    torch.optim.Adam (the same step as the 4-rank run, member by member)."""
    a, b = (os.path.join(checkpoint_4_ranks, k) for k in "ab")
    wide = wc.compile([make(i, seed=7) for i in range(6)], SAMPLE, config=FAST)
    opt = wc.optim.Adam(wide.parameters())
    wcd.load_members(wide, a, opt)
    sharded = _as_sharded(wide, "test")
    _check_against_checkpoint(sharded, opt, a)
    x3, y3 = data(6, seed=2)
    train_step(wide, opt, x3, y3)
    _check_against_checkpoint(sharded, opt, b, exact=False)
    # ordinary modules
    for i in (0, 5):
        m = make(i, seed=7)
        m.load_state_dict(wcd.load_member(a, i))
        o = torch.optim.Adam(m.parameters())
        o.load_state_dict(wcd.load_member_optimizer(a, i))
        loss = F.mse_loss(m(x3[i]), y3[i])
        o.zero_grad()
        loss.backward()
        o.step()
        torch.testing.assert_close(m.state_dict(), wcd.load_member(b, i))


# -- world size 1 (no process group) ---------------------------------------------------------------
def test_world_size_1_without_process_group():
    assert not dist.is_initialized()
    sharded = wcd.shard(make, SAMPLE, n=3, config=FAST)
    assert (sharded.members, sharded.rank, sharded.world_size, sharded.n_global) == (range(3), 0, 1, 3)
    assert [sharded.local(i) for i in range(3)] == [0, 1, 2] and sharded.local(-1) == 2
    assert sharded.global_id(1) == 1
    assert copy.deepcopy(sharded).members == range(3)
    assert pickle.loads(pickle.dumps(sharded)).group is None
    x, y = data(3)
    assert wcd.gather_outputs(sharded(x), sharded).shape == (3, 6, 2)
    assert torch.equal(sharded.member(1).state_dict()["0.weight"], make(1).state_dict()["0.weight"])
    full = wc.compile([make(i) for i in range(3)], SAMPLE, config=FAST)
    full(x)  # the same BatchNorm running-stat update as the call above
    opt, opt_full = wc.optim.Adam(sharded.parameters(), **hyper(3)), wc.optim.Adam(full.parameters(), **hyper(3))
    train_step(sharded, opt, x, y)
    train_step(full, opt_full, x, y)
    wcd.copy_member_weights(sharded, 2, 0, opt)
    wcd.copy_member_weights(full, 2, 0, opt_full)  # a plain WideModel is accepted too
    assert_members_equal(sharded, full, exact=True)
    assert_optim_equal(opt, opt_full, range(3), exact=True)
    opt.param_groups[0]["lr"] = 0.5  # the manual-schedule idiom: one float for every member
    wcd.copy_member_weights(sharded, 1, 2, opt)
    assert opt.param_groups[0]["lr"].tolist() == [0.5, 0.5, 0.5]


def test_copy_member_is_a_deprecated_alias_of_copy_member_weights(monkeypatch):
    """The old name still copies (world size 1 here), warning once with the new name."""
    from wide_compiler import _deprecation

    monkeypatch.setattr(_deprecation, "_warned", set())
    sharded = wcd.shard(make, SAMPLE, n=3, config=FAST)
    with pytest.warns(DeprecationWarning, match="distributed.copy_member is deprecated.*copy_member_weights"):
        wcd.copy_member(sharded, 2, 0)
    assert torch.equal(sharded.wide.get_parameter("0.weight")[0], sharded.wide.get_parameter("0.weight")[2])
    assert "copy_member" in wcd.__all__ and "copy_member_weights" in wcd.__all__


@pytest.mark.parametrize("n,world", [(1, 1), (5, 2), (6, 4), (7, 3), (10, 4), (32, 4), (9, 9)])
def test_shard_range_and_owner(n, world):
    ranges = [wcd.shard_range(n, world, r) for r in range(world)]
    assert [i for rg in ranges for i in rg] == list(range(n))
    assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
    assert [len(rg) for rg in ranges] == sorted((len(rg) for rg in ranges), reverse=True)
    assert [_owner(n, world, i) for i in range(n)] == [r for r, rg in enumerate(ranges) for _ in rg]


def test_errors_world_size_1(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="cannot be sharded over 4 ranks"):
        wcd.shard_range(3, 4, 0)
    with pytest.raises(ValueError, match="factory needs n=N"):
        wcd.shard(make, SAMPLE, config=FAST)
    with pytest.raises(TypeError, match="got ONE module"):
        wcd.shard(make(0), SAMPLE, n=2, config=FAST)
    with pytest.raises(ValueError, match="n=3 but 2 models"):
        wcd.shard([make(0), make(1)], SAMPLE, n=3, config=FAST)
    with pytest.raises(TypeError, match="member 1 is a str"):
        wcd.shard(lambda i: make(i) if i == 0 else "x", SAMPLE, n=2, config=FAST)
    with pytest.raises(RuntimeError, match="not initialised"):
        wcd.shard(make, SAMPLE, group=object(), n=2, config=FAST)
    sharded = wcd.shard(make, SAMPLE, n=2, config=FAST)
    with pytest.raises(IndexError, match="src id 2 out of range for a population of N=2"):
        wcd.copy_member_weights(sharded, 2, 0)
    with pytest.raises(TypeError, match="not a wide_compiler.optim optimizer"):
        wcd.copy_member_weights(sharded, 0, 1, torch.optim.SGD(sharded.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="expected a ShardedWideModel"):
        wcd.gather_outputs(torch.zeros(2), make(0))
    # checkpoints
    with pytest.raises(FileNotFoundError, match="index.json not found"):
        wcd.load_members(sharded, tmp_path)
    wcd.save_members(sharded, tmp_path / "c")
    other = wcd.shard(make, SAMPLE, n=3, config=FAST)
    with pytest.raises(ValueError, match="has N=2 members, the model N=3"):
        wcd.load_members(other, tmp_path / "c")
    wcd.save_members(other, tmp_path / "c2")
    wcd.save_members(sharded, tmp_path / "c2")  # over an older, larger checkpoint
    assert wcd.read_index(tmp_path / "c2")["n"] == 2
    assert sorted(os.listdir(tmp_path / "c2")) == ["index.json", "member_000000.pt", "member_000001.pt"]
    wcd.load_members(sharded, tmp_path / "c2")
    with pytest.raises(ValueError, match="optimizer state of None"):
        wcd.load_members(sharded, tmp_path / "c", wc.optim.Adam(sharded.parameters()))
    assert wcd.load_member_optimizer(tmp_path / "c", 1) is None
    with pytest.raises(IndexError, match="member 2 out of range for the checkpoint"):
        wcd.load_member(tmp_path / "c", 2)
    no_bn = wcd.shard(lambda i: make(i, bn=False), SAMPLE, n=2, config=FAST)
    with pytest.raises(ValueError, match="keys missing from it"):
        wcd.load_members(no_bn, tmp_path / "c")
    narrow = wcd.shard(lambda i: nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.BatchNorm1d(5), nn.Linear(5, 2)),
                       SAMPLE, n=2, config=FAST)
    with pytest.raises(ValueError, match=r"'0.weight' was saved as \[8, 4\] torch.float32, the model's is \[5, 4\]"):
        wcd.load_members(narrow, tmp_path / "c")
    double = wcd.shard(lambda i: make(i).double(), SAMPLE.double(), n=2, config=FAST)
    with pytest.raises(ValueError, match="was saved as .* torch.float32, the model's is .* torch.float64"):
        wcd.load_members(double, tmp_path / "c")
    wcd.save_members(sharded, tmp_path / "d", wc.optim.Adam(sharded.parameters()))
    with pytest.raises(ValueError, match="optimizer state of 'Adam'; got a SGD"):
        wcd.load_members(sharded, tmp_path / "d", wc.optim.SGD(sharded.parameters(), lr=0.1))
    index = tmp_path / "d" / "index.json"
    index.write_text(index.read_text().replace('"version": 1', '"version": 99'))
    with pytest.raises(ValueError, match="format version 99"):
        wcd.read_index(tmp_path / "d")
    with pytest.raises(ValueError, match="JSON-serialisable"):
        wcd.save_members(sharded, tmp_path / "e", metadata={"x": object()})
    # a write that fails leaves no temporary file behind
    def full_disk(obj, f):  # (f: the open temporary file)
        f.write(b"partial")
        raise OSError("No space left on device")
    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        wcd.save_members(sharded, tmp_path / "f")
    assert os.listdir(tmp_path / "f") == []


# --- torchrun: the docs' distributed snippet (issue 26) -------------------------------------------------
def _readme_distributed_block() -> str:
    import re
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", docs, flags=re.S) if "wcd.shard(member" in b]
    assert len(blocks) == 1, "the docs' distributed snippet moved"
    return blocks[0]


def test_readme_snippet_under_torchrun_with_two_processes(tmp_path):
    """Each rank joins torchrun's group and holds its own half; the checkpoint has all N members."""
    import subprocess
    import sys

    script = tmp_path / "snippet.py"
    # each rank writes its own file (two ranks printing at once can interleave their lines)
    script.write_text(_readme_distributed_block()
                      + "\nopen(os.path.join(os.environ['TMPDIR'], f'rank{sharded.rank}.txt'), 'w').write("
                        "f'{sharded.rank} {sharded.world_size} {list(sharded.members)}')\n")
    env = dict(os.environ, TMPDIR=str(tmp_path), OMP_NUM_THREADS="1")
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(script)], env=env, capture_output=True, text=True, timeout=900)  # a hang guard
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    ranks = [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)]
    assert ranks == ["0 2 [0, 1, 2, 3]", "1 2 [4, 5, 6, 7]"], run.stdout
    index = json.loads((tmp_path / "pbt_members" / "index.json").read_text())
    assert index["n"] == 8 and len(index["files"]) == 8


def test_shard_refuses_a_torchrun_process_without_a_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    with pytest.raises(RuntimeError, match=r"rank 1 of WORLD_SIZE=2 .*init_process_group"):
        wcd.shard([nn.Linear(3, 2), nn.Linear(3, 2)], torch.randn(1, 3), config=wc.WideConfig.fast())
    monkeypatch.setenv("WORLD_SIZE", "1")  # a single-process launch runs as world size 1
    assert wcd.shard([nn.Linear(3, 2), nn.Linear(3, 2)], torch.randn(1, 3), config=wc.WideConfig.fast()).world_size == 1


def test_every_public_name_of_the_parts_is_importable_from_the_package():
    """The package docstring's promise (``load_member_constants`` was missing)."""
    from wide_compiler.distributed import checkpoints, collectives, sharding

    for part in (checkpoints, collectives, sharding):
        missing = set(part.__all__) - set(wcd.__all__)
        assert not missing, (part.__name__, missing)
        assert all(getattr(wcd, name) is getattr(part, name) for name in part.__all__)
