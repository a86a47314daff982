"""The command line's parser and ``main`` (Note [A quick CLI]).

Each command lives in its own module of this package, imported only when it runs:
:mod:`.info`, :mod:`.check` (``test``), :mod:`.trace`, :mod:`.benchmark`, :mod:`.analyze`.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .inputs import INPUT_HELP, UsageError, input_arg, shape_arg

__all__ = ["PRESETS", "build_parser", "main"]

# Note [A quick CLI]
# ~~~~~~~~~~~~~~~~~~
# `python -m wide_compiler --help` must answer in well under the seconds `import torch` takes. So
# this module, the package root (Note [Lazy package root]) and .inputs import neither torch nor
# the library (.importlinter checks it); each command names its module (`_Command`), imported
# when the command runs, and imports what it needs itself: `info` torch and the C++ core only.
# The benchmark targets (their registry imports torch) are listed by `benchmark --help` alone.

#: The benchmark presets (wide_compiler.bench.PRESET_NAMES; a test keeps the two equal).
PRESETS = ("ci", "quick", "full")
#: The baselines ``benchmark --baselines`` names (wide_compiler.bench.vision makes them).
BASELINE_NAMES = ("loop", "loop_cl", "vmap", "compile_loop", "compile_vmap", "processes")


class _Command:
    """A command's ``run(args)``, in ``wide_compiler.cli.<module>``, imported when called."""

    def __init__(self, module: str) -> None:
        self.module = module

    def __call__(self, args: argparse.Namespace) -> int:
        return importlib.import_module(f"{__package__}.{self.module}").run(args)

    def __repr__(self) -> str:
        return f"<command {__package__}.{self.module}.run>"


def _with_targets(format_help: Callable[[], str]) -> Callable[[], str]:
    """``benchmark --help`` with the registered targets (imported then) above its examples."""

    def with_targets() -> str:
        targets = importlib.import_module(f"{__package__}.benchmark").targets_help()
        text = format_help()
        head, sep, examples = text.rpartition("examples:\n")
        return f"{head}{targets}\n\n{sep}{examples}" if sep else f"{text}\n{targets}\n"

    return with_targets


def _baseline_names(text: str) -> tuple[str, ...]:
    """argparse ``type`` of ``--baselines``: known names, comma-separated, at least one."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in BASELINE_NAMES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated names of {', '.join(BASELINE_NAMES)}")
    return names


def _positive_int(text: str) -> int:
    """argparse ``type`` of a count: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


_DESCRIPTION = """\
Fuse N models of one architecture into one wide model, check it member by member, and measure
what it buys on this machine.

commands:
  info       versions, threads, CPU ISA, the C++ build and every registered wide:: operator
  test       the self-check of this install, or N members of YOUR model checked one by one
  trace      a model's captured graph beside its wide graph, and the compile report
  benchmark  time wide ops and models against the loop, vmap and torch.compile (JSON records)
  analyze    compile, time, profile and size N members of YOUR model: what fusing buys

Each command has its own help: python -m wide_compiler COMMAND --help"""

_EPILOG = """\
examples:
  python -m wide_compiler info
  python -m wide_compiler test
  python -m wide_compiler test my_model.py:make --input ids:int64:4,16 --input mask:bool:4,16
  python -m wide_compiler trace -m transformer
  python -m wide_compiler benchmark linear --preset quick --json bench-results/linear.json
  python -m wide_compiler analyze my_model.py:make --shape 8,3,32,32 -n 4,16 --plot speedup.png"""


class _AppendInput(argparse.Action):
    """``--input``, repeatable; a keyword name given twice is a usage error."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        items = list(getattr(namespace, self.dest, None) or [])
        if values.name and any(i.name == values.name for i in items):
            raise argparse.ArgumentError(self, f"{values.text!r}: input {values.name!r} is given twice")
        setattr(namespace, self.dest, [*items, values])


def _inputs_parent() -> argparse.ArgumentParser:
    """``--shape``/``--input``/``--sample``, shared by test, analyze and trace."""
    p = argparse.ArgumentParser(add_help=False)
    x = p.add_mutually_exclusive_group()
    x.add_argument("--shape", type=shape_arg, metavar="SHAPE",
                   help="one float32 input of this shape, e.g. 32,64 (built-in models: their own)")
    x.add_argument("--input", type=input_arg, action=_AppendInput, metavar="[NAME:]DTYPE:SHAPE[:VALUES]",
                   help="one input, repeatable: positional when unnamed, a keyword when named "
                        "(e.g. ids:int64:4,16:0-1000, mask:bool:4,16)")
    x.add_argument("--sample", metavar="FILE.py:FUNC",
                   help="a function of yours returning one member's input (tensor, tuple, dict or "
                        "(tuple, dict)); FUNC alone: in the model's file")
    return p


def _wrap(text: str, width: int = 88) -> str:
    """Each line of ``text`` filled to ``width`` columns (help kept raw: examples keep their lines)."""
    import textwrap

    return "\n".join(textwrap.fill(line, width) if line else "" for line in text.split("\n"))


def _command(sub: Any, name: str, module: str, parents: list[argparse.ArgumentParser], *, help: str,
             description: str, epilog: str) -> argparse.ArgumentParser:
    """The parser of command ``name``: its help, its description filled to 88 columns
    (:func:`_wrap`), its examples kept line by line, and ``run`` of ``.<module>`` as its ``func``
    (imported when the command runs: Note [A quick CLI])."""
    p = sub.add_parser(name, parents=parents, formatter_class=argparse.RawDescriptionHelpFormatter,
                       help=help, description=_wrap(description), epilog=epilog)
    p.set_defaults(func=_Command(module), parser=p)
    return p


def build_parser() -> argparse.ArgumentParser:
    """The parser of every command; imports neither torch nor the library (Note [A quick CLI])."""
    parser = argparse.ArgumentParser(prog="wide_compiler", description=_DESCRIPTION, epilog=_EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log INFO messages (and tracebacks of failed checks)")
    # -v is accepted before or after the command (SUPPRESS: a subcommand's default must not
    # overwrite a -v given before it).
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                        help="log INFO messages (and tracebacks of failed checks)")
    inputs = _inputs_parent()
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    model_help = ("a built-in model (mlp, resblock, convnet, transformer) or path/to/file.py:factory "
                  "(module:factory works too): a zero-argument callable, or an nn.Module class, "
                  "returning one member")

    p = _command(
        sub, "info", "info", [common],
        help="versions, threads, CPU ISA, C++ build, registered ops",
        description="Print what this install runs on: wide_compiler, torch, Python and platform "
                    "versions, torch's threads and CPU capability, the C++ core's build info "
                    "(compiler, ISA, OpenMP) and every registered wide:: operator with its schema "
                    "and dispatch keys. Attach it to bug reports.",
        epilog="example:\n  python -m wide_compiler info")

    p = _command(
        sub, "test", "check", [common, inputs],
        help="quick self-check on this machine, or check a model of yours member by member "
             "(PASS/FAIL, exit 0/1)",
        description="Without MODEL: a self-check of this install (the wide ops against PyTorch, "
                    "opcheck, compile, unfuse), one PASS/FAIL line each.\nWith MODEL: compile N "
                    "members of your model and check every member in train and eval mode, on its "
                    "own input and on a shared one (outputs, input and parameter gradients, "
                    "buffers: wide_compiler.testing.check_compile). Exit 0 when all pass, 1 when "
                    "one fails, 2 for a usage error.",
        epilog="examples:\n"
               "  python -m wide_compiler test\n"
               "  python -m wide_compiler test my_model.py:make --shape 32,64\n"
               "  python -m wide_compiler test lm.py:make --input ids:int64:4,16 --input mask:bool:4,16:1\n"
               "  python -m wide_compiler test lm.py:make --sample lm.py:make_sample -n 4\n\n" + INPUT_HELP)
    p.add_argument("model", nargs="?", metavar="MODEL", help=model_help + "; without: the self-check")
    p.add_argument("-n", type=_positive_int, default=3, help="members to check (default 3)")
    p.add_argument("--strict", action="store_true", help="refuse per-member fallbacks")

    p = _command(
        sub, "trace", "trace", [common, inputs],
        help="a model's captured graph and wide graph side by side",
        description="Capture one member with torch.export, compile N members, and print the "
                    "captured member graph beside the wide graph (one line per node), then the "
                    "compile report: each wide op with its strategy, fallbacks, layout conversions.",
        epilog="examples:\n"
               "  python -m wide_compiler trace -m transformer\n"
               "  python -m wide_compiler trace my_model.py:make --shape 8,16 -n 2\n"
               "  python -m wide_compiler trace lm.py:make --input ids:int64:4,16\n\n" + INPUT_HELP)
    p.add_argument("model", nargs="?", metavar="MODEL", help=model_help)
    p.add_argument("-m", "--model", dest="model_opt", metavar="MODEL", help="the same as MODEL")
    p.add_argument("-n", type=_positive_int, default=4, help="number of members (default 4)")

    p = _command(
        sub, "benchmark", "benchmark", [common],
        help="time wide ops against loop / vmap / torch.compile",
        description="Time the wide model against the baselines; print a table and optionally write "
                    "JSON records.\nWithout a target: the list of targets.",
        epilog="examples:\n"
               "  python -m wide_compiler benchmark linear --preset ci\n"
               "  python -m wide_compiler benchmark all --preset quick --save --plot speedup.png")
    p.format_help = _with_targets(p.format_help)  # the registry imports torch: only for this help
    # Checked by the command (not `choices`): no target lists the targets, exit 0.
    p.add_argument("target", nargs="?", metavar="TARGET",
                   help="what to benchmark: a target listed below, or all")
    p.add_argument("--list", action="store_true",
                   help="print the target names, one a line, and exit")
    p.add_argument("--preset", default="quick", choices=PRESETS,
                   help="ci: tiny smoke run; quick: the headline case (default); full: the grid")
    p.add_argument("--json", metavar="FILE", help="write the records (a JSON list) to FILE")
    p.add_argument("--compile", nargs="?", const="default", metavar="MODE",
                   help="run the wide model and every baseline under torch.compile (targets on the "
                        "shared engine: all but optim and train), checked against the eager loop; MODE "
                        "is torch.compile's mode (reduce-overhead: CUDA graphs on a GPU, for every contender)")
    p.add_argument("--baselines", metavar="NAMES", type=_baseline_names,
                   help="comma-separated baselines the vision targets (models, real, conv, ...) time instead of "
                        f"each case's own: {', '.join(BASELINE_NAMES)} (compile_*: torch.compile of the loop or of "
                        "the vmapped members; processes: N processes side by side, one member each)")
    p.add_argument("--save", action="store_true",
                   help="also write them to bench-results/TARGET-PRESET-YYYYmmdd-HHMMSS.json")
    p.add_argument("--top", type=_positive_int, metavar="K",
                   help="print only the K records with the largest speedup over their best baseline")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw speedup vs N per baseline to FILE.png, one panel per target and mode "
                        "(needs matplotlib: pip install 'wide_compiler[plot]')")
    p.add_argument("--case", action="append", metavar="NAME",
                   help="run only this case of the target (repeatable; 'resnet18' or 'resnet18 N=4'): "
                        "one process per case bounds memory when the models are large")
    p.add_argument("--tuned-allocator", action="store_true",
                   help="call wc.tune_cpu_allocator() first (raises glibc's malloc thresholds for "
                        "the whole process, every contender alike; by default nothing process-wide "
                        "changes); records say which in 'allocator'")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where the members, their inputs and every contender run (the targets "
                        "built on whole models and linear; records say the device)")
    p.add_argument("-q", "--quiet", action="store_true", help="no table, no progress bar")

    p = _command(
        sub, "analyze", "analyze", [common, inputs],
        help="compile, time, profile and size N members of a model",
        description="Report what fusing N members of a model buys on this machine: wide ops and "
                    "fallbacks, speed vs loop and vmap, per-op profile, memory and the largest N "
                    "that fits, recommendations. Takes about a minute (progress on stderr: a bar "
                    "in a terminal, one line per stage in CI or a pipe).",
        epilog="examples:\n"
               "  python -m wide_compiler analyze convnet -n 4,16 --memory 8GB\n"
               "  python -m wide_compiler analyze my_model.py:make --shape 8,3,32,32 --plot speedup.png\n"
               "  python -m wide_compiler analyze lm.py:make --input ids:int64:8,32 --modes inference\n\n"
               + INPUT_HELP)
    p.add_argument("model", metavar="MODEL", help=model_help)
    p.add_argument("-n", default="4,16", help="population sizes, comma-separated (default 4,16)")
    p.add_argument("--modes", default="inference,train", help="inference,train (default both)")
    p.add_argument("--memory", help="memory budget for the largest-N search, e.g. 8GB (default: MemAvailable)")
    p.add_argument("--repeats", type=_positive_int, default=7, help="interleaved timing repeats (default 7)")
    p.add_argument("--config", default="fast", choices=("fast", "default", "safe"),
                   help="WideConfig preset to compile with (default fast: heuristic strategies; "
                        "default: strategies measured at compile time)")
    p.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    p.add_argument("--markdown", metavar="FILE", help="also write the report as Markdown to FILE")
    p.add_argument("--plot", metavar="FILE.png",
                   help="draw the speedup over loop and vmap against N, a panel per mode (needs "
                        "matplotlib, checked first: pip install 'wide_compiler[plot]')")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m wide_compiler`` and the ``wide_compiler`` console script: parse,
    configure logging, run the command. A :class:`UsageError` of the command is printed as
    argparse prints its own (usage line, ``wide_compiler COMMAND: error: ...``) and returns 2."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except UsageError as e:
        sub = args.parser
        if args.verbose and e.__cause__ is not None:
            traceback.print_exception(e.__cause__)
        sub.print_usage(sys.stderr)
        print(f"{sub.prog}: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `... | head`: the reader left; say nothing more
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
