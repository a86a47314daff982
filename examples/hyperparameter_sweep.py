"""A 32-point learning-rate sweep trained as ONE wide model.

32 copies of one MLP, each with its own learning rate (log-spaced 1e-4 .. 1e-1), train together
on a built-in synthetic classification task (three interleaved spirals): one forward, one
backward and one fused AdamW step per iteration for all 32. The member with the best validation
loss is picked and unfused back into an ordinary nn.Module.

    python examples/hyperparameter_sweep.py [--steps 300]
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import wide_compiler as wc
from wide_compiler.zoo import spirals
from torch import nn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=32)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=128)
    args = ap.parse_args()
    n = args.members
    torch.manual_seed(0)

    def make():
        return nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))

    models = [make() for _ in range(n)]
    wide = wc.compile(models, torch.randn(args.batch, 2), config=wc.WideConfig.fast())
    lrs = torch.logspace(-4, -1, n)
    opt = wc.optim.AdamW(wide.parameters(), lr=lrs, weight_decay=1e-4)
    sched = wc.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)

    x_train, y_train = spirals(4096, seed=1)
    x_val, y_val = spirals(1024, seed=2)
    t0 = time.perf_counter()
    for step in range(args.steps):
        idx = torch.randint(0, len(x_train), (n, args.batch))           # each member its own batch
        out = wide(x_train[idx])
        losses = wc.optim.member_losses(F.cross_entropy, out, y_train[idx])
        opt.zero_grad()
        losses.sum().backward()                                           # = each member's own gradient
        wc.optim.clip_grad_norm_(wide.parameters(), max_norm=5.0)         # one norm per member
        opt.step()
        sched.step()
    elapsed = time.perf_counter() - t0

    with torch.no_grad():
        wide.eval()
        val = wc.optim.member_losses(F.cross_entropy, wide(x_val.expand(n, *x_val.shape)), y_val,
                                     shared_target=True)
        acc = (wide(x_val.expand(n, *x_val.shape)).argmax(-1) == y_val).float().mean(1)
    best = int(val.argmin())
    print(f"trained {n} members x {args.steps} steps in {elapsed:.1f}s "
          f"({1e3 * elapsed / args.steps:.1f} ms per step for all members)")
    print(" lr        val loss  val acc")
    for i in range(0, n, max(1, n // 8)):
        print(f" {lrs[i]:.2e}  {val[i]:.4f}    {acc[i]:.3f}")
    print(f"best member {best}: lr={lrs[best]:.2e} val loss {val[best]:.4f} acc {acc[best]:.3f}")

    model = wide.unfuse()[best]                                           # an ordinary nn.Sequential
    with torch.no_grad():
        check = F.cross_entropy(model(x_val), y_val)
    assert torch.allclose(check, val[best], atol=1e-4), (check, val[best])
    print(f"unfused best member: {type(model).__name__}, val loss {check:.4f} (matches)")


if __name__ == "__main__":
    main()
