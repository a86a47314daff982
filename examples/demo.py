"""wide_compiler demo (``make demo``): 64 MLPs fused into one wide model.

1. build a population: 64 MLPs 64 -> 256 -> 256 -> 10, each from its own seed;
2. ``wc.compile`` them from one member's sample input;
3. check every member with ``wide_compiler.testing.check_equivalence``: its slice of the wide
   output, of the input and parameter gradients of one backward, against the member run on its
   own (tolerances from ``wide_compiler.testing.tolerance``); the error of every member;
4. show ``wide.summary()`` and check the ``unfuse()`` round trip;
5. time it against what you would otherwise write: the N models in a Python loop, and
   ``torch.func`` ensembling (``stack_module_state`` + ``functional_call`` + ``vmap``), for
   inference and for one training step (forward + backward).

Exits non-zero if any member differs. Runs in well under two minutes on two cores.

    python examples/demo.py [--n 64] [--batch 32] [--min-run-time 0.5]
"""
from __future__ import annotations

import argparse
import sys

import torch
import wide_compiler as wc
from torch import nn
from wide_compiler import measure, testing, zoo
from wide_compiler.bench import engine

ATOL = testing.tolerance(torch.float32)["atol"]  # the timed results' check (outputs)


def make_mlp(seed: int, sizes: tuple[int, ...] = (64, 256, 256, 10)) -> nn.Module:
    """One member: Linear-ReLU-Linear-GELU-Linear, initialised from ``seed`` (the zoo's
    :func:`wide_compiler.zoo.mlp_stack`)."""
    return zoo.mlp_stack(sizes, seed=seed)


def print_member_grid(errs: list[float], per_line: int = 8) -> None:
    for start in range(0, len(errs), per_line):
        cells = [f"#{i:02d} {errs[i]:.1e}" for i in range(start, min(start + per_line, len(errs)))]
        print("  " + "   ".join(cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=64, help="number of members (default 64)")
    parser.add_argument("--batch", type=int, default=32, help="batch per member (default 32)")
    parser.add_argument("--min-run-time", type=float, default=0.5,
                        help="seconds of timing per contender (default 0.5)")
    args = parser.parse_args(argv)
    n, batch = args.n, args.batch
    failed = False

    print(f"wide_compiler {wc.__version__}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, CPU {torch.backends.cpu.get_cpu_capability()}\n")

    # 1-2. population and compile -------------------------------------------------------------
    models = [make_mlp(seed) for seed in range(n)]
    per_member = sum(p.numel() for p in models[0].parameters())
    print(f"[1] population: {n} MLPs 64 -> 256 -> 256 -> 10 ({per_member:,} parameters each), "
          f"seeds 0..{n - 1}")
    clock = measure.Stopwatch()
    wide = wc.compile(models, torch.randn(batch, 64))  # ONE member's sample input
    print(f"[2] wc.compile: {clock.seconds:.2f} s (capture, widen, strategy tuning)\n")

    # 3. every member against its own model -----------------------------------------------------
    torch.manual_seed(1234)
    x = torch.randn(n, batch, 64)  # member i gets x[i]
    print("[3] every member vs its own model (outputs, input and parameter gradients; "
          "testing.check_equivalence):")
    try:
        report = testing.check_equivalence(wide, models, x)
    except AssertionError as e:  # names the first member that differs and by how much
        failed = True
        print(f"FAIL  {e}\n")
    else:
        print_member_grid(report.per_member)
        print(f"PASS  all {n} members match: {report}\n")

    # 4. summary and unfuse round trip ------------------------------------------------------------
    print("[4] wide.summary():")
    print(wide.summary())
    back = wide.unfuse()
    with torch.no_grad():
        round_trip = max((b(x[i]) - m(x[i])).abs().max().item()
                         for i, (b, m) in enumerate(zip(back, models)))
    same_type = all(type(b) is type(m) for b, m in zip(back, models))
    if len(back) == n and same_type and round_trip == 0.0:
        print(f"PASS  unfuse(): {n} {type(back[0]).__name__} modules, outputs identical to the "
              f"originals\n")
    else:
        failed = True
        print(f"FAIL  unfuse(): {len(back)} modules, same class: {same_type}, "
              f"max abs err {round_trip:.1e}\n")

    # 5. speed ---------------------------------------------------------------------------------
    print(f"[5] speed: N={n}, batch {batch} per member, float32, medians of interleaved rounds "
          f"(wide_compiler.measure.time_interleaved, {torch.get_num_threads()} threads)")
    strategy = ",".join(sorted(set(wide.strategies.values())))
    base = {"target": "mlp", "batch": batch, "in_features": 64, "out_features": 10,
            "shape": "64-256-256-10", "dtype": "float32"}
    machine = measure.machine_info()
    wide_c = measure.wide_contender(strategy, wide, models[0])
    records = []
    for mode in measure.MODES:
        records += engine.run_case(
            models, x, [wide_c], [measure.loop_contender(models), measure.vmap_contender(models)],
            mode=mode, base=dict(base, case="separate"), min_run_time=args.min_run_time,
            machine=machine)
    x_shared = x[0].expand(n, *x[0].shape)  # one batch for all members
    records += engine.run_case(
        models, x_shared, [wide_c],
        [measure.loop_contender(models), measure.vmap_contender(models, shared=True)],
        mode="inference", base=dict(base, case="shared"), min_run_time=args.min_run_time,
        machine=machine)
    print(engine.format_table(records, header=False))
    worst = max(r["max_abs_err"] for r in records)
    if not worst <= ATOL:
        failed = True
        print(f"FAIL  timed results differ from the members: max abs err {worst:.1e}")
    print()
    print("FAILED: some members differ" if failed else
          "OK: every member matches its own model")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
