"""A width x learning-rate sweep trained as ONE padded wide model.

Eight MLPs that differ in hidden width (16, 32, 64, 128) and learning rate (3e-3, 1e-2) train
together on a built-in synthetic classification task (three interleaved spirals). Their widths
differ, so they are not one program: ``wc.compile(..., pad=True)`` pads every member to the widest
one, exactly (the padding stays zero through every forward, backward and AdamW step), and each
member comes back out at its own width. The member with the best validation loss is picked and
unfused into an ordinary nn.Module.

    python examples/width_sweep.py [--steps 300]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
import wide_compiler as wc
from wide_compiler.zoo import spirals
from torch import nn


def mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(2, width), nn.LayerNorm(width), nn.GELU(), nn.Linear(width, width),
                         nn.GELU(), nn.Linear(width, 3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=128)
    args = ap.parse_args()
    torch.manual_seed(0)
    grid = [(w, lr) for w in (16, 32, 64, 128) for lr in (3e-3, 1e-2)]
    models = [mlp(w) for w, _ in grid]
    wide = wc.compile(models, torch.randn(args.batch, 2), pad=True)
    opt = wc.optim.AdamW(wide.parameters(), lr=[lr for _, lr in grid], weight_decay=1e-4)
    print(next(line for line in wide.summary().splitlines() if line.startswith("padded members:")))

    x_train, y_train = spirals(4096, seed=1)
    x_val, y_val = spirals(1024, seed=2)
    n = len(grid)
    for step in range(args.steps):
        idx = torch.randint(0, len(x_train), (n, args.batch))  # each member its own batch
        losses = wc.optim.member_losses(F.cross_entropy, wide(x_train[idx]), y_train[idx])
        opt.zero_grad()
        losses.sum().backward()
        opt.step()

    wide.eval()
    with torch.no_grad():
        out = wide(x_val.expand(n, *x_val.shape))  # one validation set for all members
        val = wc.optim.member_losses(F.cross_entropy, out, y_val.expand(n, -1))
        acc = (out.argmax(-1) == y_val).float().mean(-1)
    for (w, lr), v, a in zip(grid, val.tolist(), acc.tolist()):
        print(f"width {w:4d}  lr {lr:.0e}  val loss {v:.3f}  accuracy {a:.1%}")
    best = int(val.argmin())
    model = wide.member(best)  # an ordinary nn.Sequential of the best member's own width
    with torch.no_grad():
        check = F.cross_entropy(model(x_val), y_val).item()
    print(f"best: width {grid[best][0]}, lr {grid[best][1]:.0e} (alone: val loss {check:.3f}, "
          f"{sum(p.numel() for p in model.parameters()):,} parameters)")


if __name__ == "__main__":
    main()
