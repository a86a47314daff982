"""WideRouter example: a heterogeneous collective of towers, grouped by program.

1. a collective of 8 towers of 2 architectures (5 MLP towers, 3 residual towers) and a learned
   fusion head on their concatenated outputs; ``prepare_for_compile`` groups the towers into 2
   wide models, then a few Adam steps on built-in random data (a fixed random "teacher" labels
   them), printing the loss;
2. checks: every tower's output equals the same tower unfused and run alone, and ``write_back``
   puts the trained weights into the original tower modules;
3. the inverse pair: towers that differ only in a Python constant (``self.sign = +1 / -1``,
   read in forward) never share one program: they land in two groups.

Exits non-zero if a check fails. Runs in seconds.

    python examples/router.py [--steps 20]
"""
from __future__ import annotations

import argparse
import sys

import torch
import wide_compiler as wc
from torch import nn
from wide_compiler.router import Tower, WideRouter

IN, OUT, CLASSES = 32, 16, 4


class MLPTower(Tower):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(IN, 64), nn.GELU(), nn.Linear(64, OUT))

    def forward(self, x, mask=None):
        y = self.net(x)
        return y if mask is None else y * mask


class ResTower(Tower):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, OUT)
        self.norm = nn.LayerNorm(OUT)
        self.ff = nn.Linear(OUT, OUT)

    def forward(self, x, mask=None):
        h = self.inp(x)
        y = h + self.ff(torch.relu(self.norm(h)))
        return y if mask is None else y * mask


class Collective(WideRouter):
    """8 towers + a fusion head; the towers run as one wide model per architecture."""

    def __init__(self) -> None:
        super().__init__(config=wc.WideConfig.fast())
        for i in range(5):
            self.attach(f"mlp{i}", MLPTower())
        for i in range(3):
            self.attach(f"res{i}", ResTower())
        self.attach("head", nn.Linear(8 * OUT, CLASSES))  # not a Tower: an ordinary submodule
        self.discover_towers()

    def forward(self, x, mask):
        outs = self.wide_forward(x, mask=mask)
        return self.head(torch.cat([outs[n] for n in self.tower_names], dim=-1))


class SignTower(Tower):
    def __init__(self, sign: int) -> None:
        super().__init__()
        self.sign = sign
        self.fc = nn.Linear(IN, OUT)

    def forward(self, x):
        return self.sign * self.fc(x)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    opts = parser.parse_args()
    torch.manual_seed(0)
    ok = True

    # -- 1. the collective, trained -------------------------------------------------------
    x = torch.randn(256, IN)
    mask = (torch.rand(256, 1) > 0.1).float()  # [B, 1]: its dim 0 is the dynamic batch too
    teacher = nn.Linear(IN, CLASSES)
    labels = teacher(x).argmax(-1).detach()
    model = Collective()
    originals = {n: model.get_submodule(n) for n in model.tower_names}
    model.prepare_for_compile(x[:8], mask=mask[:8])  # group and compile now ...
    print(model.report())
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)  # ... and make the optimizer after
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{n_params:,} parameters, each once in model.parameters()")
    for step in range(opts.steps):
        loss = nn.functional.cross_entropy(model(x, mask), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 5 == 0 or step == opts.steps - 1:
            print(f"step {step:3d}  loss {loss.item():.4f}")

    # -- 2. checks --------------------------------------------------------------------------
    model.eval()
    with torch.no_grad():
        outs = model.wide_forward(x, mask=mask)
        towers = model.unfuse()
        err = max((outs[n] - towers[n](x, mask=mask)).abs().max().item() for n in model.tower_names)
        model.write_back()
        err_wb = max((outs[n] - originals[n].eval()(x, mask=mask)).abs().max().item() for n in model.tower_names)
    print(f"max |router - tower alone|: unfused {err:.2e}, written back {err_wb:.2e}")
    ok &= err < 1e-4 and err_wb < 1e-4

    # -- 3. the inverse pair ------------------------------------------------------------------
    pair = WideRouter(config=wc.WideConfig.fast())
    for name, sign in (("pos0", +1), ("neg0", -1), ("pos1", +1), ("neg1", -1)):
        pair.register_tower(name, SignTower(sign))
    pair.prepare_for_compile(x)
    groups = pair.group_members()
    print(f"inverse pair groups: {groups}")
    ok &= groups == {"pos0": ["pos0", "pos1"], "neg0": ["neg0", "neg1"]}
    with torch.no_grad():
        outs = pair.wide_forward(x)
        alone = pair.unfuse()
        ok &= all(torch.allclose(outs[n], alone[n](x), atol=1e-5) for n in outs)

    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
