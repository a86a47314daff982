"""Population-based training of 32 members sharded over processes with torch.distributed.

Each rank holds a contiguous slice of the population as ONE wide model
(wide_compiler.distributed.shard); member ids are global. Every `--interval` steps every rank
gets all N validation losses (all_gather_metrics), takes the same decisions (the same seeded
RNG everywhere), and each member of the bottom quarter copies a random member of the top quarter
wherever it lives (copy_member_weights: weights, optimizer state and hyperparameters, sent between the
two ranks that hold them), then perturbs its learning rate and momentum on the rank holding it.
The data and the mini-batches are the same whatever the number of processes, so 1, 2 or 4
processes train the same population.

    python examples/distributed_pbt.py                       # one process (world size 1)
    python examples/distributed_pbt.py --nproc 4             # spawns 4 processes itself
    torchrun --nproc_per_node 2 examples/distributed_pbt.py  # under torchrun (gloo on CPU)

With GPUs the same code runs on NCCL (one GPU per rank, picked from LOCAL_RANK); only gloo on
CPU was tested here.
"""
from __future__ import annotations

import argparse
import datetime
import os
import random
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import wide_compiler as wc
import wide_compiler.distributed as wcd
from torch import nn


def task(n: int, seed: int):
    """A built-in regression task: y = sin(3 x0) * x1 + noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 4, generator=g) * 2 - 1
    y = (torch.sin(3 * x[:, :1]) * x[:, 1:2]) + 0.05 * torch.randn(n, 1, generator=g)
    return x, y


def member(i: int) -> nn.Module:
    """Global member i, the same on whichever rank builds it."""
    torch.manual_seed(1000 + i)
    return nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))


def train(args: argparse.Namespace, device: torch.device) -> None:
    n = args.members
    sharded = wcd.shard(member, torch.randn(64, 4), n=n, config=wc.WideConfig.fast()).to(device)
    mine = sharded.members                      # the global ids this rank holds
    lead = sharded.rank == 0
    rng = random.Random(0)                      # same decisions on every rank
    lrs = [10 ** rng.uniform(-3, -0.5) for _ in range(n)]
    moms = [rng.uniform(0.0, 0.95) for _ in range(n)]
    opt = wc.optim.SGD(sharded.parameters(), lr=lrs[mine.start:mine.stop], momentum=moms[mine.start:mine.stop])
    if lead:
        print(f"{sharded.world_size} process(es), {n} members; rank 0 holds {len(mine)}")

    x_train, y_train = (t.to(device) for t in task(8192, 1))
    x_val, y_val = (t.to(device) for t in task(1024, 2))
    batches = torch.Generator().manual_seed(3)  # the same global mini-batches on every rank
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, len(x_train), (n, 64), generator=batches)[mine.start:mine.stop].to(device)
        losses = wc.optim.member_losses(F.mse_loss, sharded(x_train[idx]), y_train[idx])
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
        if step % args.interval:
            continue
        with torch.no_grad():
            local_val = wc.optim.member_losses(F.mse_loss, sharded(x_val.expand(len(mine), *x_val.shape)),
                                               y_val, shared_target=True)
        val = wcd.all_gather_metrics(local_val, sharded).cpu()              # [N] on every rank
        lr_all = wcd.all_gather_metrics(opt.param_groups[0]["lr"].to(device), sharded).cpu()
        order = val.argsort().tolist()
        quarter = max(1, n // 4)
        top, bottom = order[:quarter], order[-quarter:]
        if lead:
            print(f"step {step:4d}: best {val[order[0]]:.5f} (member {order[0]}, lr {lr_all[order[0]]:.2e}), "
                  f"worst {val[order[-1]]:.5f}, median {val.median():.5f}")
        for dst in bottom:
            src = rng.choice(top)
            lr_factor, mom_factor = rng.choice([0.8, 1.25]), rng.choice([0.9, 1.1])
            wcd.copy_member_weights(sharded, src, dst, opt)               # exploit (collective)
            if sharded.is_local(dst):                                      # explore (local)
                hp = opt.member_hyperparameters(sharded.local(dst))
                opt.set_member_hyperparameters(sharded.local(dst), lr=hp["lr"] * lr_factor,
                                               momentum=min(0.99, hp["momentum"] * mom_factor))
    best = order[0]
    if args.save:
        wcd.save_members(sharded, args.save, opt, metadata={"step": args.steps})   # collective
        if lead:  # any process can read a member back as an ordinary module, without a group
            model = member(best)
            model.load_state_dict(wcd.load_member(args.save, best))
            with torch.no_grad():
                check = F.mse_loss(model(x_val.cpu()), y_val.cpu()).item()
            print(f"saved to {args.save}; best member {best} as an ordinary {type(model).__name__}: "
                  f"val {check:.5f}")
    if lead:
        print(f"done in {time.perf_counter() - start:.1f} s; best member {best}, val {val[best]:.5f}")


def worker(rank: int, world: int, init_file: str, args: argparse.Namespace) -> None:
    """A process of `--nproc N`: join the group through a file, then train."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))
    try:
        train(args, torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--interval", type=int, default=50)
    ap.add_argument("--nproc", type=int, default=0, help="spawn this many processes (not under torchrun)")
    ap.add_argument("--save", default=None, help="write a per-member checkpoint to this directory")
    args = ap.parse_args()
    if args.steps < args.interval:
        ap.error("--steps must be at least --interval (one PBT round)")

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:       # under torchrun
        if torch.cuda.is_available():                               # NCCL: not tested here
            local_rank = int(os.environ.get("LOCAL_RANK", "0"))
            torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl")
            device = torch.device("cuda", local_rank)
        else:
            torch.set_num_threads(1)
            dist.init_process_group("gloo")
            device = torch.device("cpu")
        try:
            train(args, device)
        finally:
            dist.destroy_process_group()
    elif args.nproc > 1:
        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            mp.start_processes(worker, args=(args.nproc, os.path.join(tmp, "init"), args),
                               nprocs=args.nproc, start_method="spawn")
    else:                                                            # one process, no group
        train(args, torch.device("cuda" if torch.cuda.is_available() else "cpu"))


if __name__ == "__main__":
    main()
