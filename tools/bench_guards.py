"""The cost of checking a call against its graph's assumptions (Note [Guards] in
python/wide_compiler/fx/guards.py), per call, on a model with 5 inputs.

Times (median of repeats, microseconds): the generated check alone (``Guards.holds``: structure, fixed sizes, dtypes, guards), the whole check a
call makes before its graph runs (structure, fixed sizes and ranges, guards: what
``WideModel._graph_covering`` does), and the forward of a tiny wide model whose run time is
mostly that overhead, beside the same model with the check skipped. Writes JSON (``--json``,
default under bench-results/).

    python tools/bench_guards.py [--repeats 20000] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch import nn

import wide_compiler as wc
from wide_compiler.fx.state import call_graph


class FiveInputs(nn.Module):
    """Five inputs, two of them tied by the forward (one size), a parity branch on a length."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, y, mask, bias, scale):
        h = self.a(x) + self.b(y)
        if x.shape[1] % 2 == 1:
            h = h * 2
        return (h * mask.unsqueeze(-1)).sum(1) + bias * scale


def _median_us(fn, repeats: int) -> float:
    return _interleaved_us({"fn": fn}, repeats)["fn"]


def _interleaved_us(fns: dict, repeats: int) -> dict:
    """Median microseconds per call of each function, timed in alternating rounds (the heap and
    caches a round leaves favour no one function)."""
    rounds: dict = {k: [] for k in fns}
    for _ in range(7):
        for k, fn in fns.items():
            t = time.perf_counter()
            for _ in range(repeats // 7):
                fn()
            rounds[k].append((time.perf_counter() - t) / (repeats // 7) * 1e6)
    return {k: statistics.median(v) for k, v in rounds.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20000)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    n, b, t = args.n, 2, 5
    models = [FiveInputs() for _ in range(n)]
    sample = (torch.randn(b, t, 8), torch.randn(b, t, 8), torch.ones(b, t), torch.randn(b, 8), torch.randn(b, 1))
    wide = wc.compile(models, sample, config=wc.WideConfig.fast()).eval()
    xs = tuple(torch.randn(n, *s.shape) for s in sample)
    with torch.no_grad():
        wide(*xs)
        wg, flat = wide._graph_covering(False, xs, {})
        holders = wide._holders(wg)
        rec = {
            "target": "guards", "n": n, "inputs": len(xs), "guards": len(wg.guards.code) + len(xs),
            "guards_us": _median_us(lambda: wg.guards.holds(flat, wide._param_dtype, wide._param_device), args.repeats),
            "guards_hold": wg.guards.holds(flat, wide._param_dtype, wide._param_device),
            "call_check_us": _median_us(lambda: wide._graph_covering(False, xs, {}), args.repeats),
            **{f"forward{k}_us": v for k, v in _interleaved_us(
                {"": lambda: wide(*xs), "_unchecked": lambda: call_graph(wg, wide, holders, flat)},
                args.repeats // 10).items()},
            "torch": torch.__version__,
        }
    print(json.dumps(rec, indent=1))
    path = Path(args.json or f"bench-results/guards-{time.strftime('%Y%m%d-%H%M%S')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([rec], indent=1))


if __name__ == "__main__":
    main()
