"""Member tiles side by side (Note [Member tiles] in python/wide_compiler/fx/tiling.py).

One process, one model, the same graph untiled and in tiles of 4 and 8 (``WideConfig.fast()``
with ``member_tile=0/4/8``), timed interleaved with the members' loop (medians), in inference
and a training step. Writes the records as JSON (``--json``, default under bench-results/).

    python tools/bench_member_tiles.py [--model resnet_nopool] [--n 16] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import wide_compiler as wc
from wide_compiler import measure
from wide_compiler.bench.vision_models import MODELS


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="resnet_nopool", choices=sorted(MODELS))
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--tiles", type=int, nargs="+", default=[0, 4, 8])
    ap.add_argument("--seconds", type=float, default=3.0, help="timing per contender and mode")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    spec = MODELS[args.model]
    torch.manual_seed(0)
    batch = spec.batch["small"]
    x = spec.inputs((args.n, batch), "small", torch.Generator().manual_seed(0))
    records = []
    for mode in measure.MODES:
        models = [spec.make("small").train(mode == "train") for _ in range(args.n)]
        steps = {"loop": measure.make_step(measure.loop_contender(models), x, mode)}
        for k in args.tiles:
            wide = wc.compile(models, *[t[0] for t in x], config=wc.WideConfig.fast().replace(member_tile=k))
            steps[f"tiles{k}"] = measure.make_step(measure.wide_contender(f"tiles{k}", wide, models[0]), x, mode)
        ms = measure.time_interleaved(steps, min_run_time=args.seconds, rounds=11)
        untiled = ms[f"tiles{args.tiles[0]}"]
        for name, t in ms.items():
            records.append({"model": args.model, "n": args.n, "batch": batch, "mode": mode, "contender": name,
                            "ms": t, "vs_first": t / untiled, "vs_loop": ms["loop"] / t})
            print(f"{args.model} N={args.n} {mode:9s} {name:8s} {t:8.2f} ms  {t / untiled:5.2f}x of "
                  f"tiles{args.tiles[0]}  {ms['loop'] / t:5.2f}x the loop")
    out = Path(args.json or f"bench-results/member-tiles-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": measure.machine_info(), "records": records}, indent=1, default=str))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
