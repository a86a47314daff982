"""Population-based training (exploit / explore) of 16 members trained as ONE wide model.

Every `--interval` steps the members are ranked by validation loss; each member of the bottom
quarter copies a random member of the top quarter (weights, buffers, optimizer state and
hyperparameters: WideModel.copy_member_weights(src, dst, optimizer)) and then perturbs its learning rate
and momentum (optimizer.set_member_hyperparameters), all in place, without leaving the fused model.

    python examples/pbt.py [--steps 400]
"""
from __future__ import annotations

import argparse
import random

import torch
import torch.nn.functional as F
import wide_compiler as wc
from torch import nn


def task(n: int, seed: int):
    """A built-in regression task: y = sin(3 x0) * x1 + noise."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 4, generator=g) * 2 - 1
    y = (torch.sin(3 * x[:, :1]) * x[:, 1:2]) + 0.05 * torch.randn(n, 1, generator=g)
    return x, y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--members", type=int, default=16)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--interval", type=int, default=50)
    args = ap.parse_args()
    n = args.members
    torch.manual_seed(0)
    rng = random.Random(0)

    models = [nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
              for _ in range(n)]
    wide = wc.compile(models, torch.randn(64, 4), config=wc.WideConfig.fast())
    lrs = [10 ** rng.uniform(-4, -0.5) for _ in range(n)]
    moms = [rng.uniform(0.0, 0.95) for _ in range(n)]
    opt = wc.optim.SGD(wide.parameters(), lr=lrs, momentum=moms)

    x_train, y_train = task(8192, 1)
    x_val, y_val = task(1024, 2)
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, len(x_train), (n, 64))
        losses = wc.optim.member_losses(F.mse_loss, wide(x_train[idx]), y_train[idx])
        opt.zero_grad()
        losses.sum().backward()
        opt.step()
        if step % args.interval == 0:
            with torch.no_grad():
                val = wc.optim.member_losses(F.mse_loss, wide(x_val.expand(n, *x_val.shape)), y_val,
                                             shared_target=True)
            order = val.argsort().tolist()
            quarter = max(1, n // 4)
            top, bottom = order[:quarter], order[-quarter:]
            for dst in bottom:
                src = rng.choice(top)
                wide.copy_member_weights(src, dst, opt)                    # exploit
                hp = opt.member_hyperparameters(dst)
                opt.set_member_hyperparameters(                            # explore
                    dst, lr=hp["lr"] * rng.choice([0.8, 1.25]),
                    momentum=min(0.99, hp["momentum"] * rng.choice([0.9, 1.1])))
            print(f"step {step:4d}: best val {val.min():.5f} (member {order[0]}, "
                  f"lr {opt.member_hyperparameters(order[0])['lr']:.2e}), "
                  f"median {val.median():.5f}; replaced {len(bottom)} members")
    best = int(order[0])
    model = wide.member(best)
    print(f"best member {best}: {opt.member_hyperparameters(best)}; unfused as {type(model).__name__}")


if __name__ == "__main__":
    main()
