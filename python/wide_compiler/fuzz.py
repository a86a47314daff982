"""A model-level differential fuzzer: random valid programs, compiled wide and compared with their
members (DESIGN §9, layer 4).

Note [The model fuzzer]
~~~~~~~~~~~~~~~~~~~~~~~
Tests written by the people who wrote the rules share their blind spots. :func:`generate` writes
the source of a random ``nn.Module`` from a small grammar (anchored on NNSmith's generated valid
programs and Csmith's differential testing): a chain of layers over a tensor whose kind it tracks
(``[B, F]`` vectors, ``[B, T, F]`` sequences, ``[B, C, H, W]`` images) -- modules (Linear, Conv,
norms, Dropout, Embedding, GRU, attention), functional ops, reshapes and reductions, residual
branches, Python branches on sizes (``T % 2``, batch parity, ``T == 1``), on per-member
attributes and on both (``T >= self.s``), float constants that differ between members (slopes, scales, clamp bounds, dropout
rates), a second input, Python state the forward reads (module globals, a config class's
attribute, a dict, a list inside a tuple, a flag, a helper function, a forward hook: Note [State
changed after compiling]). :func:`run_program` compiles N members of it and calls the wide model in
train and eval mode at the sample's sizes and at others (another batch, a batch of 1, another
length), comparing every member's outputs, input gradients and parameter gradients with the
member run alone, by the noise-aware check of :mod:`wide_compiler.testing` (float64: within
1e-10, and a tensor outside that judged against the member's own float64 rounding, so that a ReLU
whose input is 0 up to rounding is not a finding; float32: against a float64 run of the members;
the long mode runs every fourth program in float32), buffers after each call included; then it
changes that state, as a user would between calls, and compares again; a float32 program is called
under bfloat16 autocast too (Note [Autocast in the fuzzer]); the wide model is called under
``torch.compile(fullgraph=True)`` (Note [torch.compile in the fuzzer]); both sides are converted to the other
of float32 and float64 and called again (Note [A dtype change in the fuzzer]); then it trains: a few
steps of a wide optimizer with per-member hyperparameters, after which the members the wide model
gives back must hold what each member trained alone holds (Note [Training steps in the fuzzer]).

Note [State changed after compiling]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A compiled graph bakes in every Python value its capture read; it may run only while they still
hold (guards). Productions of a third stream (seeded by the seed apart from the other two, so older
seeds draw what they drew) put such a value at the program's top level and read it in the forward
or in a hook, and record the statement that changes it (``Program.mutations``). After the first
round of calls, :func:`run_program` executes those statements in the program's namespace and calls
again at the sample's sizes: the wide model must capture again, or refuse clearly, but never run
the old value.

Note [The generator's fourth stream]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Probes of issue 44 found most silent errors in size sweeps (``compile(..., pad=True)``), which the
first three streams never made. A fourth stream (``generate(seed, fourth=True)``, what the long mode
runs; recorded seeds keep their programs) draws, for half the programs, a width offset per member
(0, 2, 4 or 6, at least two different): every width a production makes (a Linear's outputs, a
conv's channels, an embedding's dim) is that width plus the member's offset (``c['pad']`` in its
``__init__``), so the members differ in sizes only and compile padded (``Program.sizes``); offsets
are even, so a size's parity (``chunk(2)``, ``GroupNorm(2, c)``) is every member's. Attention,
whose source splits a width by a number, is left out there. The stream also writes in-place ops
after a step (an activation with ``inplace=True``, a residual ``add_``, ``mul_``), which export
keeps as such and padding must follow (probe 16, P16-1).

Each program ends in one of: ``ok``; ``refused`` (a clear error of wide_compiler's, at compile or
at a call: allowed, the library may refuse what it cannot prove); ``skipped`` (the members
themselves fail, or the train graph draws random numbers the check cannot fix to one value on
both sides, so only eval is compared; dropout's are fixed and compared, Note [Fixed draws in the
trust check]); or a finding:
``wrong`` (a member differs) or ``crash`` (an error that is not a clear refusal). A finding keeps
the program's source, so it can be pasted into a regression test as it is.

Run it for a while::

    python -m wide_compiler.fuzz --minutes 30 --out fuzz-findings/

The project's tests run a fixed set of seeds (tests/python/test_fuzz_models.py).

Example:
    >>> from wide_compiler import fuzz
    >>> program = fuzz.generate(3)
    >>> "class Fuzzed(nn.Module)" in program.source
    True
    >>> fuzz.run_program(program).outcome in fuzz.OUTCOMES      # doctest: +SKIP
    True
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import logging
import math
import random
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ._equivalence.draws import fixed_draws

__all__ = ["OUTCOMES", "Program", "Result", "generate", "main", "run_program"]

log = logging.getLogger(__name__)

OUTCOMES = ("ok", "refused", "skipped", "wrong", "crash")


@dataclasses.dataclass
class Program:
    """One generated model: its source (a module class ``Fuzzed`` whose ``__init__`` takes the
    member's constants ``c``), every member's constants, the sample's sizes and kinds of inputs."""

    seed: int
    source: str
    constants: list[dict[str, float]]  # per member
    inputs: list[tuple[str, tuple[int, ...]]]  # (kind, one member's shape): kind "float" or "index:<vocab>"
    other_shapes: list[list[tuple[int, ...]]]  # more calls' input shapes (another batch, length...)
    n: int
    random: bool = False  # the train graph draws random numbers (a dropout with p > 0 in some member)
    #: statements that change state the forward reads, run after the first calls (Note [State changed after compiling])
    mutations: list[str] = dataclasses.field(default_factory=list)
    #: the members differ in sizes (Note [The generator's fourth stream]): compiled with pad=True
    sizes: bool = False
    fourth: bool = False  # made by generate(seed, fourth=True)
    #: the namespace the last :meth:`module_class` ran the source in (the mutations run there)
    namespace: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def module_class(self) -> type[nn.Module]:
        self.namespace = {"__name__": f"fuzz_program_{self.seed}"}
        exec(compile(self.source, f"<fuzz program {self.seed}>", "exec"), self.namespace)  # noqa: S102 -- generated here
        return self.namespace["Fuzzed"]

    def mutate(self) -> None:
        """Run :attr:`mutations` in the namespace of the members' class."""
        for statement in self.mutations:
            exec(statement, self.namespace)  # noqa: S102 -- generated here

    def members(self, dtype: torch.dtype = torch.float64) -> list[nn.Module]:
        cls = self.module_class()
        out = []
        for i, c in enumerate(self.constants):
            torch.manual_seed(self.seed * 1000 + i)
            out.append(cls(c).to(dtype))
        return out

    def make_inputs(self, shapes: list[tuple[int, ...]], dtype: torch.dtype, gen: torch.Generator) -> list[torch.Tensor]:
        """N-first inputs for one call: ``[N, *shape]`` per input, on the default device."""
        xs = []
        for (kind, _), shape in zip(self.inputs, shapes):
            if kind.startswith("index:"):
                # distinct indices down the batch at each position: two equal rows would make a
                # batch norm's variance 0 and put a ReLU exactly at its kink, where any rounding
                # picks another subgradient (a tie, not a defect: seed 100166 of the long mode)
                vocab, (b, *rest) = int(kind.split(":")[1]), shape
                cols = [torch.randperm(vocab, generator=gen, device=gen.device)[:b]
                        for _ in range(self.n * max(1, math.prod(rest)))]
                xs.append(torch.stack(cols, -1).reshape(b, self.n, *rest).movedim(0, 1).contiguous())
            else:
                xs.append(torch.randn((self.n, *shape), generator=gen, device=gen.device, dtype=dtype))
        # drawn from the CPU generator, then where the members are made (the default device)
        return [x.to(torch.get_default_device()) for x in xs]


@dataclasses.dataclass
class Result:
    """What :func:`run_program` found."""

    program: Program
    outcome: str  # one of OUTCOMES
    detail: str = ""

    def report(self) -> str:
        return (f"# fuzz seed {self.program.seed}: {self.outcome}\n# {self.detail}\n"
                f"# fuzz.generate({self.program.seed}, fourth={self.program.fourth}); members differ in sizes "
                f"(pad=True): {self.program.sizes}\n"
                f"# members: {self.program.n}, constants: {self.program.constants}\n"
                f"# inputs: {self.program.inputs}, other calls: {self.program.other_shapes}\n"
                f"# after the first calls: {self.program.mutations}\n{self.program.source}")


# --- the generator --------------------------------------------------------------------------------


class _Writer:
    """Builds the source of ``Fuzzed`` while tracking the current tensor's kind and sizes."""

    def __init__(self, rng: random.Random, n: int, extra: random.Random | None = None) -> None:
        self.rng, self.n = rng, n
        # Note [The generator's second stream]: productions added after the first seeds were
        # recorded draw from a stream of their own (seeded by the seed, its constants named s1,
        # s2, ...), so every older production draws what it drew before: a seed's program is its
        # first-grammar program plus, at most, the added lines; generate(seed,
        # second_stream=False) replays a recorded finding exactly
        self.extra, self.k_extra = extra, 0
        self.state: random.Random | None = None  # the third stream (Note [State changed after compiling])
        self.fourth: random.Random | None = None  # Note [The generator's fourth stream]
        self.sizes = False  # widths differ between members (c['pad'])
        self.top: list[str] = []  # module-level lines before the class
        self.mutations: list[str] = []
        self.init: list[str] = []
        self.body: list[str] = []
        self.constants: list[dict[str, float]] = [{} for _ in range(n)]
        self.k = 0
        self.random = False  # a random op that draws in train mode

    def name(self, prefix: str) -> str:
        self.k += 1
        return f"{prefix}{self.k}"

    def constant(self, lo: float, hi: float, *, differ: bool | None = None, choices: list[float] | None = None,
                 rng: random.Random | None = None) -> str:
        """A float attribute, per member: the same for all, or different (``differ``)."""
        if rng is None:
            rng, name = self.rng, self.name("c")
        else:  # the second stream's names count apart (Note [The generator's second stream])
            self.k_extra += 1
            rng, name = rng, f"s{self.k_extra}"
        differ = rng.random() < 0.6 if differ is None else differ
        differ = differ and not self.sizes  # padded members differ in sizes only (Note [The generator's fourth stream])
        pick = (lambda: rng.choice(choices)) if choices else (lambda: round(rng.uniform(lo, hi), 3))
        first = pick()
        for c in self.constants:
            c[name] = pick() if differ else first
        self.init.append(f"self.{name} = c[{name!r}]")
        return f"self.{name}"

    def module(self, code: str) -> str:
        name = self.name("m")
        self.init.append(f"self.{name} = {code}")
        return f"self.{name}"

    def line(self, code: str) -> None:
        self.body.append(code)


def _size_and_constant(w: _Writer, dim: int) -> None:
    """From the second stream: a Python branch on a size and a per-member constant together (an
    independent probe found those ran member 0's branch for every member: issue 44, F7)."""
    e = w.extra
    if e is None or e.random() >= 0.12:
        return
    if dim == 0:
        s = w.constant(0, 0, choices=[0.25, 0.5, 1.0], rng=e)
        w.line(f"if h.shape[0] * {s} <= 1:")
    else:
        s = w.constant(0, 0, choices=[2.0, 3.0, 4.0, 6.0], rng=e)
        w.line(f"if h.shape[{dim}] {e.choice(['>=', '<'])} {s}:")
    w.line(f"    h = h * {e.choice(['0.5', '2', '-1'])}")


def _state_read(w: _Writer, module: str | None) -> None:
    """From the third stream: the forward (or a hook on ``module``, the last module made) reads
    Python state at the program's top level, and a statement changing it runs after the first calls
    (Note [State changed after compiling]; probe 4's F5 and F6 were of these kinds)."""
    e = w.state
    # one per program: a change another change's recapture follows would go unseen (it re-reads all)
    if e is None or e.random() >= 0.15 or w.mutations:
        return
    value, new = e.choice([0.5, 1.5, 2.0]), e.choice([-1.0, 0.25, 3.0])
    kind = e.choice(["global", "class", "dict", "tuple_list", "flag", "helper", "hook"] if module else
                    ["global", "class", "dict", "tuple_list", "flag", "helper"])
    if kind == "global":
        w.top.append(f"G = {value}")
        w.line("h = h * G")
        w.mutations.append(f"G = {new}")
    elif kind == "class":
        w.top += ["class Cfg:", f"    K = {value}"]
        w.line("h = h + Cfg.K")
        w.mutations.append(f"Cfg.K = {new}")
    elif kind == "dict":
        w.top.append(f"D = {{'scale': {value}}}")
        w.line("h = h * D['scale']")
        w.mutations.append(f"D['scale'] = {new}")
    elif kind == "tuple_list":
        w.top.append(f"T = ('scale', [{value}])")
        w.line("h = h - T[1][0]")
        w.mutations.append(f"T[1][0] = {new}")
    elif kind == "flag":
        w.top.append("FLAG = True")
        w.line("if FLAG:")
        w.line("    h = torch.tanh(h)")
        w.mutations.append("FLAG = False")
    elif kind == "helper":
        w.top += [f"H = {value}", "", "", "def helper(t):", "    return t * H + 1"]
        w.line("h = helper(h)")
        w.mutations.append(f"H = {new}")
    else:
        w.top.append(f"HOOK = {value}")
        w.init.append(f"{module}.register_forward_hook(lambda mod, args, out: out * HOOK)")
        w.mutations.append(f"HOOK = {new}")


# Note [The grammar's tables]: the productions of each kind of tensor (vec ``[B, F]``, seq
# ``[B, T, F]``, img ``[B, C, H, W]``), name -> a function of the writer and the current size that
# draws what it needs and gives its lines, or ``(lines, kind, size)`` where it changes the tensor's
# kind or size; one where the size does not allow it gives no lines. A step draws a name from its
# kind's list (a name listed twice is drawn twice as often), in the order every recorded seed was
# drawn with: the draws of each production are those the first grammar made, in its order.
_Production = Callable[[_Writer, int], "list[str] | tuple[list[str], str, int]"]


class _Width(int):
    """A width that is ``int(self)`` plus the member's offset where the source writes it (Note [The
    generator's fourth stream]); arithmetic on it is the base width's (offsets keep its parity)."""

    def __format__(self, spec: str) -> str:
        return f"({int(self)} + c['pad'])"


def _width(w: _Writer, size: int) -> int:
    return _Width(size) if w.sizes else size


def _linear(kind: str, sizes: list[int], *, drawn_bias: bool = False) -> _Production:
    """A new ``nn.Linear`` to a size drawn of ``sizes`` (its ``bias`` drawn too, or the default)."""

    def production(w: _Writer, f: int) -> tuple[list[str], str, int]:
        g = _width(w, w.rng.choice(sizes))
        layer = f"nn.Linear({f}, {g}, bias={w.rng.random() < 0.8})" if drawn_bias else f"nn.Linear({f}, {g})"
        return [f"h = {w.module(layer)}(h)"], kind, g

    return production


def _dropout(w: _Writer, f: int) -> list[str]:
    p = w.constant(0.0, 0.5, choices=[0.0, 0.0, 0.1, 0.3])
    w.random = w.random or any(c[p.removeprefix("self.")] > 0 for c in w.constants)
    return [f"h = F.dropout(h, {p}, self.training)"]


def _branch_attr(w: _Writer, f: int) -> list[str]:
    s = w.constant(-1.0, 1.0, choices=[0.0, 0.5, 0.5, 1.0])
    return [f"if {s} != 0:", f"    h = h * {s}", "else:", "    h = torch.tanh(h)"]


def _to_seq(w: _Writer, f: int) -> tuple[list[str], str, int]:
    t = w.rng.choice([2, 3])
    line = f"h = h.unsqueeze(1).expand(-1, {t}, -1) * torch.arange(1, {t + 1}, dtype=h.dtype).view(1, -1, 1)"
    return [line], "seq", f


def _attention(w: _Writer, f: int) -> list[str]:
    if f % 2 or w.sizes:  # its source splits the width by a number: one member's only
        return []
    qkv, heads = w.module(f"nn.Linear({f}, {3 * f})"), w.rng.choice([1, 2])
    return [f"q, k, v = {qkv}(h).chunk(3, dim=-1)",
            f"q, k, v = (t.unflatten(-1, ({heads}, {f // heads})).transpose(1, 2) for t in (q, k, v))",
            f"h = h + F.scaled_dot_product_attention(q, k, v, is_causal={w.rng.random() < 0.5})"
            ".transpose(1, 2).flatten(2)"]


def _conv1d(w: _Writer, f: int) -> list[str]:
    k = w.rng.choice([1, 3])
    return [f"h = {w.module(f'nn.Conv1d({f}, {f}, {k}, padding={k // 2})')}(h.transpose(1, 2)).transpose(1, 2)"]


def _conv2d(w: _Writer, c: int) -> tuple[list[str], str, int]:
    k, d = w.rng.choice([1, 3]), _width(w, w.rng.choice([4, 6]))
    conv = w.module(f"nn.Conv2d({c}, {d}, {k}, padding={k // 2}, stride={w.rng.choice([1, 1, 2])})")
    return [f"h = {conv}(h)"], "img", d


_VEC_ACTIVATIONS = ["torch.relu", "torch.tanh", "F.gelu", "F.silu", "torch.sigmoid", "F.softplus"]
_VEC: dict[str, _Production] = {
    "linear": _linear("vec", [3, 4, 6, 8], drawn_bias=True),
    "act": lambda w, f: [f"h = {w.rng.choice(_VEC_ACTIVATIONS)}(h)"],
    "leaky": lambda w, f: [f"h = F.leaky_relu(h, {w.constant(0.01, 0.3)})"],
    "norm": lambda w, f: [f"h = {w.module(f'nn.LayerNorm({f}, eps={w.rng.choice([1e-5, 1e-3])})')}(h)"],
    "bn": lambda w, f: [f"h = {w.module(f'nn.BatchNorm1d({f})')}(h)"],
    "dropout": _dropout,
    "residual": lambda w, f: [f"h = h + {w.module(f'nn.Linear({f}, {f})')}(torch.relu(h))"],
    "scale": lambda w, f: [f"h = h * {w.constant(-2.0, 2.0)} + {w.constant(-1.0, 1.0)}"],
    "clamp": lambda w, f: [f"h = h.clamp({w.constant(-1.0, 0.0)}, {w.constant(0.0, 1.0)})"],
    "softmax": lambda w, f: ["h = torch.softmax(h, dim=-1) * h.shape[-1]"],
    "chunk": lambda w, f: [] if f % 2 else ["a, b = h.chunk(2, dim=-1)",
                                            "h = torch.cat([b * torch.sigmoid(a), a], dim=-1)"],
    "branch_batch": lambda w, f: ["if h.shape[0] % 2 == 1:", "    h = h.flip(0) * 0.5"],
    "branch_attr": _branch_attr,
    "to_seq": _to_seq,
}
_SEQ: dict[str, _Production] = {
    "linear": _linear("seq", [4, 6, 8]),
    "act": lambda w, f: [f"h = {w.rng.choice(['torch.relu', 'torch.tanh', 'F.gelu'])}(h)"],
    "norm": lambda w, f: [f"h = {w.module(f'nn.LayerNorm({f})')}(h)"],
    "mean": lambda w, f: (["h = h.mean(1)"], "vec", f),
    "attention": _attention,
    "gru": lambda w, f: [f"h, _ = {w.module(f'nn.GRU({f}, {f}, batch_first=True)')}(h)"],
    "conv1d": _conv1d,
    "branch_parity": lambda w, f: ["if h.shape[1] % 2 == 0:", "    h = h * 2"],
    "branch_one": lambda w, f: ["if h.shape[1] == 1:", "    h = h - 1"],
    "pad4": lambda w, f: ["pad = (-h.shape[1]) % 4", "if pad:", "    h = F.pad(h, (0, 0, 0, pad))"],
    "cumsum": lambda w, f: ["h = h.cumsum(1) / h.shape[1]"],
    "slice": lambda w, f: ["h = torch.cat([h[:, :1] * 0.5, h[:, 1:]], dim=1)"],
    "last": lambda w, f: (["h = h[:, -1]"], "vec", f),
}
_IMG: dict[str, _Production] = {
    "conv": _conv2d,
    "bn": lambda w, c: [f"h = {w.module(f'nn.BatchNorm2d({c})')}(h)"],
    "act": lambda w, c: [f"h = {w.rng.choice(['torch.relu', 'F.hardswish', 'F.silu'])}(h)"],
    "pool": lambda w, c: [f"h = {w.rng.choice(['F.max_pool2d', 'F.avg_pool2d'])}(h, 2, ceil_mode=True)"],
    "residual": lambda w, c: [f"h = h + {w.module(f'nn.Conv2d({c}, {c}, 3, padding=1)')}(torch.relu(h))"],
    "odd": lambda w, c: ["if h.shape[-1] % 2 == 1:", "    h = F.pad(h, (0, 1, 0, 1))"],
    "gn": lambda w, c: [] if c % 2 else [f"h = {w.module(f'nn.GroupNorm(2, {c})')}(h)"],
    "to_vec": lambda w, c: (["h = F.adaptive_avg_pool2d(h, 1).flatten(1)" if w.rng.random() < 0.5
                             else "h = h.mean((2, 3))"], "vec", c),
}
# kind -> (its productions, the list a step draws from, the dim of _size_and_constant's branch or None)
_GRAMMAR: dict[str, tuple[dict[str, _Production], list[str], int | None]] = {
    "vec": (_VEC, list(_VEC), 0),
    "seq": (_SEQ, list(_SEQ), 1),
    "img": (_IMG, ["conv", "conv", "bn", "act", "pool", "residual", "odd", "gn", "to_vec", "to_vec"], None),
}


def _in_place(w: _Writer, kind: str) -> None:
    """From the fourth stream: an in-place op after a step (Note [The generator's fourth stream]);
    on a copy, so that the sample (a leaf that may require grad) is never written."""
    e = w.fourth
    if e is None or e.random() >= 0.2:
        return
    act = e.choice(["F.relu", "F.silu", "F.hardswish", "F.elu"] if kind != "img" else ["F.relu", "F.silu"])
    for line in e.choice([[f"h = {act}(h.clone(), inplace=True)"], ["r = h.clone()", "r += h", "h = r.mul_(0.5)"]]):
        w.line(line)


def _step(w: _Writer, kind: str, f: int) -> tuple[str, int]:
    """One production of ``kind`` (Note [The grammar's tables]): its lines written; the tensor's
    kind and size after it."""
    productions, names, dim = _GRAMMAR[kind]
    if dim is not None:
        _size_and_constant(w, dim)
    out = productions[w.rng.choice(names)](w, f)
    lines, kind, f = out if isinstance(out, tuple) else (out, kind, f)
    for line in lines:
        w.line(line)
    _in_place(w, kind)
    return kind, f


def generate(seed: int, *, n: int | None = None, second_stream: bool = True, state: bool = True,
             fourth: bool = False) -> Program:
    """A random valid program (Note [The model fuzzer]), reproducible from ``seed``; without
    ``second_stream``, the program the first grammar made of it (Note [The generator's second
    stream]: how seeds recorded before it came are replayed); without ``state``, no productions
    of Note [State changed after compiling] (the programs of seeds recorded before them); with
    ``fourth``, Note [The generator's fourth stream] (members of different sizes, in-place ops)."""
    rng = random.Random(seed)
    n = n or rng.choice([2, 3, 4])
    w = _Writer(rng, n, random.Random(f"extra {seed}") if second_stream else None)
    w.state = random.Random(f"state {seed}") if state else None
    if fourth:
        w.fourth = random.Random(f"fourth {seed}")
        w.sizes = w.fourth.random() < 0.5
        if w.sizes:
            offsets = [w.fourth.choice([0, 2, 4, 6]) for _ in range(n)]
            offsets[w.fourth.randrange(n)] = 0  # at least two sizes: one member at 0, another not
            offsets[(offsets.index(0) + 1) % n] = w.fourth.choice([2, 4, 6])
            for c, offset in zip(w.constants, offsets):
                c["pad"] = offset
    kind = rng.choice(["vec", "seq", "img", "index"])
    b = rng.choice([2, 3, 4])
    inputs: list[tuple[str, tuple[int, ...]]]
    other: list[list[tuple[int, ...]]]
    if kind == "vec":
        f = rng.choice([4, 5, 8])
        inputs, other = [("float", (b, f))], [[(b + 2, f)], [(1, f)]]
    elif kind == "seq":
        f, t = rng.choice([4, 6]), rng.choice([3, 5])
        inputs, other = [("float", (b, t, f))], [[(b, t + 1, f)], [(1, t, f)], [(b, 1, f)]]
    elif kind == "img":
        f, s = rng.choice([2, 3]), rng.choice([6, 7, 8])
        inputs, other = [("float", (b, f, s, s))], [[(b + 1, f, s, s)], [(b, f, s + 3, s + 3)]]
    else:
        vocab, t, f = rng.choice([7, 11]), rng.choice([3, 4]), rng.choice([4, 6])
        inputs, other = [(f"index:{vocab}", (b, t))], [[(b, t + 2)], [(1, t)]]
        f = _width(w, f)
        w.line(f"h = {w.module(f'nn.Embedding({vocab}, {f})')}(x)")
        kind = "seq"
    if not w.body:
        w.line("h = x")
    second = rng.random() < 0.3
    steps = rng.randint(2, 7)
    for k in range(steps):
        kind, f = _step(w, kind, f)
        modules = [line.split(" = ")[0] for line in w.init if line.startswith("self.m") and "nn.GRU" not in line]
        _state_read(w, modules[-1] if modules else None)
        if second and k == steps // 2 and kind == "vec":
            proj = w.module(f"nn.Linear(3, {f})")
            w.line(f"h = h + {proj}(y)")
            inputs.append(("float", (b, 3)))
            other = [shapes + [(shapes[0][0], 3)] for shapes in other]
            second = False
    if kind == "img":
        w.line("h = h.flatten(1)")
    args = ", ".join(["x", "y"][: len(inputs)])
    source = "\n".join([
        "import torch", "import torch.nn.functional as F", "from torch import nn", "", "",
        *([*w.top, "", ""] if w.top else []),
        "class Fuzzed(nn.Module):",
        "    def __init__(self, c):",
        "        super().__init__()",
        *(f"        {line}" for line in w.init),
        "",
        f"    def forward(self, {args}):",
        *(f"        {line}" for line in w.body),
        "        return h",
        "",
    ])
    return Program(seed, source, w.constants, inputs, other, n, w.random, w.mutations, sizes=w.sizes, fourth=fourth)


# --- running one program ---------------------------------------------------------------------------


def _is_refusal(e: BaseException) -> bool:
    """A clear refusal of wide_compiler's (not an internal crash): its own error types, or an
    error whose message it wrote."""
    from .errors import ArchitectureMismatchError, WideCompileError

    if isinstance(e, torch._dynamo.exc.Unsupported):  # ours, raised inside torch.compile(fullgraph=True)
        return re.search(r"""raised exception \w+\(['"]wide_compiler""", str(e)) is not None
    return isinstance(e, (WideCompileError, ArchitectureMismatchError)) or (
        isinstance(e, (ValueError, TypeError, RuntimeError, IndexError)) and str(e).startswith("wide_compiler"))


def _check(wide: nn.Module, members: list[nn.Module], xs: list[torch.Tensor], training: bool,
           dtype: torch.dtype) -> str | None:
    """None when every member of ``wide`` computes what the member computes alone on ``xs``
    (outputs, input and parameter gradients, buffers after the call), by the project's harness
    (:func:`wide_compiler.testing.check_equivalence`'s noise-aware rule: Note [The float64
    reference] and Note [Rounding in a float64 model] in _equivalence/reference.py)."""
    from ._equivalence import check_equivalence

    per_member = [tuple(x[i] for x in xs) for i in range(len(members))]
    try:
        check_equivalence(wide, members, per_member, training=training, dtype=dtype, equal_nan=True)
    except AssertionError as e:
        return str(e).splitlines()[0][:500]
    return None


# Note [Autocast in the fuzzer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A float32 program is also called under bfloat16 autocast on its device, in train and eval mode at
# the sample's sizes and one other, after the calls outside it: the wide model captured outside
# autocast must return each member's dtype and values there (or capture again, or refuse), judged
# by the same check, whose float64 run of the members autocast leaves alone (it casts float32 and
# float16 only) and whose float32 judgement takes the bfloat16 rounding of the members' own run.
# Its first runs found graphs that kept a dtype the forward read at capture (float32 where the
# member returned bfloat16: Note [A dtype the forward reads] in fx/export_watch.py).
#
# Note [torch.compile in the fuzzer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A wide model runs under ``torch.compile(fullgraph=True)`` (the project's promise for every
# compiled model): so the fuzzer calls ``torch.compile(wide, backend="aot_eager_decomp_partition",
# fullgraph=True)`` at the sample's sizes and one other, in train and eval mode, with the same
# check. Dynamo traces the wide model's own Python (its guards, per-member constants, graph choice)
# and AOTAutograd its graph and backward with inductor's decompositions and partitioner, without
# inductor's code generation (seconds a program; inductor would take minutes). Not plain
# ``aot_eager``: ATen's ``hardswish_backward`` has fake strides that follow its second input where
# the CPU kernel follows its first, and a backward graph made from them failed with "view size is
# not compatible" (fuzz seed 1503038; PyTorch's, any model; the decomposition has no such kernel).
# A graph break is a crash: fullgraph refuses it;
# a refusal of ours raised inside the trace (a call that needs a capture: Note [No capture under
# torch.compile]) is a refusal. A train graph that draws is called in eval mode only (the check's
# fixed draws are a dispatch mode, which Dynamo does not trace).
#
# Note [A dtype change in the fuzzer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Last, the wide model and its members are converted with ``.to()`` to the other of float32 and
# float64 and called again at the sample's sizes in train and eval mode: a graph captured in one
# dtype must not run in another (Note [A graph runs in the dtype it was captured in], model.py),
# and the training steps below then run in the new dtype.
#
# Note [Training steps in the fuzzer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The calls above compare one forward and backward from equal states; what users run is training:
# steps, each member with its own hyperparameters, the state moving on (weights, BatchNorm's
# running statistics, optimizer state), and the members taken out at the end. So after them, at
# the sample's sizes in train mode, the wide model takes TRAIN_STEPS steps of one of the wide
# optimizers (TRAIN_OPTIMIZERS: SGD, Adam, AdamW, RMSprop or Adagrad, with per-member
# hyperparameters and shared flags drawn from the seed) on the loss sum_i <member i's output, a
# random cotangent of its shape> (a padded model's members' own parts, ``member_outputs``); each
# member takes the same steps alone with the torch.optim optimizer of that name and its own values.
# The members the wide model gives back (``unfuse``) must then hold what each member holds, weights
# and buffers, within TRAIN_TOLERANCE. Rounding-sized gradient differences do not always stay
# rounding-sized in the weights: a flip (a ReLU whose input is 0 up to rounding, Note [The float64
# reference]) moves a gradient by a whole term, and Adam moves a weight whose gradient is rounding
# noise by about lr whatever the noise's size (eps of 1e-3 or more bounds that: TRAIN_OPTIMIZERS).
# So a tensor outside the tolerance is judged as the check judges a call: member i trains again, up
# to RESAMPLES times, from its state before the steps with its inputs and every op's result
# re-rounded at random (_Rerounded), and the tensor passes if the wide model is within NOISE_FACTOR
# times as far from the member as those runs are. A defect -- a member stepped with another's
# value, a padded weight that moved, statistics not given back -- is in none of them. A train graph
# with draws the check cannot fix (Note [Fixed draws in the trust check]) takes no steps.
TRAIN_STEPS = 2
TRAIN_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-3}  # rtol; atol the same times 0.01
#: optimizer name (in wc.optim and torch.optim) -> (per-member hyperparameters' choices, a tuple of
#: choices for a pair; shared flags' choices), drawn from the seed.
#: The optimizers that divide by a root of the squared gradients take ``eps`` of 1e-3 or more: with
#: torch's default (1e-8, 1e-10) a gradient that is 0 in exact arithmetic (a bias before a BatchNorm)
#: moves its weight by lr * sign(rounding noise), and by 0 where the noise is exactly 0.0 by luck in
#: one program and not in the other (fuzz seed 1502585, Adagrad in float32: 0.1 apart, with the
#: re-rounded runs, never exactly 0.0, all agreeing with the member). eps >= 1e-3 keeps the update
#: Lipschitz in the gradient at noise scale (lr * 1e-5 / 1e-3 in float32).
TRAIN_OPTIMIZERS: dict[str, tuple[dict[str, Any], dict[str, list]]] = {
    "SGD": ({"lr": [0.01, 0.1, 0.5], "momentum": [0.0, 0.5, 0.9], "weight_decay": [0.0, 0.01]}, {}),
    "Adam": ({"lr": [1e-3, 1e-2], "betas": ([0.8, 0.9], [0.99, 0.999]), "eps": [1e-3, 1e-2],
              "weight_decay": [0.0, 0.01]}, {"amsgrad": [False, True]}),
    "AdamW": ({"lr": [1e-3, 1e-2], "betas": ([0.8, 0.9], [0.99, 0.999]), "eps": [1e-3, 1e-2],
               "weight_decay": [0.0, 0.1]}, {}),
    "RMSprop": ({"lr": [1e-3, 1e-2], "alpha": [0.9, 0.99], "eps": [1e-3, 1e-2], "momentum": [0.0, 0.9],
                 "weight_decay": [0.0, 0.01]}, {"centered": [False, True]}),
    "Adagrad": ({"lr": [0.01, 0.1], "lr_decay": [0.0, 0.01], "weight_decay": [0.0, 0.01],
                 "initial_accumulator_value": [0.0, 0.1], "eps": [1e-3, 1e-2]}, {}),
}


def _distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """Max abs difference of two tensors of one shape over the places both are finite; inf where
    their shapes, dtypes or non-finite places differ."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return math.inf
    if not a.is_floating_point():
        return 0.0 if torch.equal(a, b) else math.inf
    finite = torch.isfinite(a) & torch.isfinite(b)
    if not torch.equal(a[~finite].nan_to_num(posinf=1, neginf=-1), b[~finite].nan_to_num(posinf=1, neginf=-1)):
        return math.inf
    return float((a - b)[finite].abs().max()) if finite.any() else 0.0


def _train_steps(prog: Program, wide: nn.Module, members: list[nn.Module], dtype: torch.dtype,
                 gen: torch.Generator) -> str | None:
    """Note [Training steps in the fuzzer]: None when every member of ``wide`` trains as the member
    does alone (or no step could be compared), else what differs."""
    from . import optim as wide_optim
    from ._equivalence.reference import NOISE_FACTOR, RESAMPLES, _Rerounded

    params = [p for p in wide.parameters() if p.requires_grad]
    if not params:
        return None
    rng = random.Random(prog.seed * 7919 + 1)  # apart from the generator's streams
    n = len(members)
    name = rng.choice(sorted(TRAIN_OPTIMIZERS))
    values, flags = TRAIN_OPTIMIZERS[name]
    hp = {k: [tuple(rng.choice(c) for c in choices) if isinstance(choices, tuple) else rng.choice(choices)
              for _ in range(n)] for k, choices in values.items()}
    shared = {k: rng.choice(choices) for k, choices in flags.items()}
    opt = getattr(wide_optim, name)(params, **{k: tuple(zip(*v)) if isinstance(values[k], tuple) else v
                                               for k, v in hp.items()}, **shared)
    what = f"{TRAIN_STEPS} {name} steps"
    wide.train()
    xs = prog.make_inputs([shape for _, shape in prog.inputs], dtype, gen)
    split = getattr(wide, "member_outputs", None) or (lambda out: list(out.unbind(0)))
    cotangents = []
    for _ in range(TRAIN_STEPS):
        with fixed_draws(prog.random) as unfixed:
            outs = split(wide(*xs))
            cots = [torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device) for o in outs]
            sum((o * c).sum() for o, c in zip(outs, cots)).backward()
        if unfixed:
            return None
        opt.step()
        opt.zero_grad()
        cotangents.append(cots)

    def trained(i: int, nudge: torch.Generator | None) -> dict[str, torch.Tensor]:
        """Member i's state after the steps alone, from its state now (kept), nudged or not."""
        m, start = members[i], {k: v.clone() for k, v in members[i].state_dict().items()}
        rerounded = _Rerounded(nudge) if nudge is not None else contextlib.nullcontext()
        x = [rerounded._nudge(t[i]) if nudge is not None else t[i] for t in xs]
        member_opt = getattr(torch.optim, name)(m.train().parameters(), **{k: v[i] for k, v in hp.items()}, **shared)
        for cots in cotangents:
            with fixed_draws(prog.random), rerounded:
                (m(*x) * cots[i]).sum().backward()
            member_opt.step()
            member_opt.zero_grad()
        out = {k: v.clone() for k, v in m.state_dict().items()}
        m.load_state_dict(start)
        return out

    rtol = TRAIN_TOLERANCE.get(dtype, 1e-3)
    for i, got in enumerate(wide.unfuse()):
        have, want = got.state_dict(), trained(i, None)
        if have.keys() != want.keys():
            return f"after {what}, member {i} given back holds {sorted(have)}, its model {sorted(want)}"
        far = {k: _distance(have[k], v) for k, v in want.items()
               if not torch.allclose(have[k], v, rtol=rtol, atol=rtol * 0.01, equal_nan=True)}
        own = dict.fromkeys(far, 0.0)
        for r in range(RESAMPLES):
            if all(far[k] <= NOISE_FACTOR * own[k] for k in far):
                break
            nudged = trained(i, torch.Generator().manual_seed(prog.seed * 100 + r))
            own = {k: max(own[k], _distance(nudged[k], want[k])) for k in far}
        for k in far:
            if far[k] > NOISE_FACTOR * own[k]:
                return (f"after {what}, member {i}'s {k} given back is {far[k]:.3g} from the member's own "
                        f"(max abs), its own re-rounded training {own[k]:.3g} ({RESAMPLES} runs); its "
                        f"hyperparameters {({k: v[i] for k, v in hp.items()} | shared)}")
    return None


def run_program(prog: Program, *, config: Any = None, dtype: torch.dtype = torch.float64) -> Result:
    """Compile ``prog``'s members in ``dtype`` and compare them with the wide model (Note [The
    model fuzzer]) by the noise-aware check."""
    from . import api
    from .config import WideConfig

    config = config or WideConfig.fast()
    gen = torch.Generator().manual_seed(prog.seed)
    members = prog.members(dtype)
    sample_shapes = [shape for _, shape in prog.inputs]
    sample = [x[0] for x in prog.make_inputs(sample_shapes, dtype, gen)]
    try:
        for m in members:
            m(*sample)
    except Exception as e:  # noqa: BLE001 -- the program itself is invalid: not a finding
        return Result(prog, "skipped", f"a member fails on the sample: {type(e).__name__}: {e}")
    try:
        wide = api.compile(members, tuple(sample), config=config, pad=prog.sizes)
    except Exception as e:  # noqa: BLE001
        if _is_refusal(e):
            return Result(prog, "refused", f"compile: {str(e).splitlines()[0][:300]}")
        return Result(prog, "crash", f"compile: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
    outcome, refused = "ok", ""
    plain, bfloat16 = contextlib.nullcontext, functools.partial(
        torch.autocast, torch.get_default_device().type, dtype=torch.bfloat16)
    other = torch.float32 if dtype == torch.float64 else torch.float64

    def convert() -> None:  # Note [A dtype change in the fuzzer]
        wide.to(other)
        for m in members:
            m.to(other)

    compiled: list[nn.Module] = []

    def under_compile() -> None:  # Note [torch.compile in the fuzzer]
        torch._dynamo.reset()  # every program's wide model has the same forward: its own budget of recompiles
        compiled[:] = [torch.compile(wide, backend="aot_eager_decomp_partition", fullgraph=True)]

    # (what, the calls' input shapes, autocast or not, what happens first, the dtype after it, what is called)
    rounds = [("", [sample_shapes, *prog.other_shapes], plain, None, dtype, lambda: wide)]
    if prog.mutations:  # Note [State changed after compiling]
        rounds.append(("after the state change: ", [sample_shapes, *prog.other_shapes[:1]], plain, prog.mutate, dtype,
                       lambda: wide))
    if dtype == torch.float32:  # Note [Autocast in the fuzzer]
        rounds.append(("under autocast: ", [sample_shapes, *prog.other_shapes[:1]], bfloat16, None, dtype, lambda: wide))
    rounds.append(("under torch.compile: ", [sample_shapes, *prog.other_shapes[:1]], plain, under_compile, dtype,
                   lambda: compiled[0]))
    rounds.append((f"after .to({other}): ", [sample_shapes], plain, convert, other, lambda: wide))
    for when, shape_sets, amp, before, dtype, called in rounds:
        if before is not None:
            try:
                before()
            except Exception as e:  # noqa: BLE001 -- what follows would run on a half-changed model
                if _is_refusal(e):
                    return Result(prog, "refused" if outcome == "ok" else outcome,
                                  refused or f"{when}{str(e).splitlines()[0][:300]}")
                return Result(prog, "crash", f"{when}{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
        for training in (True, False):
            for m in members:
                m.train(training)
            wide.train(training)
            draws = training and prog.random
            if draws and before is under_compile:  # the fixed draws are a dispatch mode, which Dynamo refuses
                continue
            mode = f"{when}{'train' if training else 'eval'} call"
            for shapes in shape_sets:
                xs = prog.make_inputs(shapes, dtype, gen)
                state = {k: v.clone() for k, v in wide.state_dict().items()}
                member_states = [{k: v.clone() for k, v in m.state_dict().items()} for m in members]
                try:
                    with torch.no_grad():
                        [m(*(x[i] for x in xs)) for i, m in enumerate(members)]
                except Exception:  # noqa: BLE001 -- the members refuse these sizes themselves
                    continue
                finally:
                    for m, s in zip(members, member_states):
                        m.load_state_dict(s)
                try:
                    # a train call that draws: every draw fixed on both sides (Note [Fixed draws in
                    # the trust check]); a draw that cannot be fixed: only finite outputs, skipped
                    with fixed_draws(draws) as unfixed, amp():
                        why = _check(called(), members, xs, training, dtype)
                    if unfixed:
                        with torch.no_grad(), amp():
                            out = called()(*xs)
                        if not torch.isfinite(out).all():
                            return Result(prog, "wrong", f"{mode} {shapes}: non-finite output")
                        outcome = "skipped" if outcome == "ok" else outcome
                    elif why is not None:
                        return Result(prog, "wrong", f"{mode} {shapes}: {why}")
                except Exception as e:  # noqa: BLE001
                    if _is_refusal(e):
                        outcome = "refused" if outcome != "skipped" else outcome
                        refused = refused or f"{mode} {shapes}: {str(e).splitlines()[0][:300]}"
                        continue
                    return Result(prog, "crash", f"{mode} {shapes}: "
                                  f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
                finally:  # batch norm's running stats: both sides start each call equal
                    wide.load_state_dict(state)
                    for m, s in zip(members, member_states):
                        m.load_state_dict(s)
    try:
        why = _train_steps(prog, wide, members, dtype, gen)
    except Exception as e:  # noqa: BLE001
        if not _is_refusal(e):
            return Result(prog, "crash", f"train steps: {type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
        outcome, refused = ("refused", refused or f"train steps: {str(e).splitlines()[0][:300]}") \
            if outcome == "ok" else (outcome, refused)
    else:
        if why is not None:
            return Result(prog, "wrong", why)
    return Result(prog, outcome, refused if outcome == "refused" else "")


# --- the long mode ---------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``python -m wide_compiler.fuzz``: run random programs for a while, write each finding."""
    ap = argparse.ArgumentParser(prog="python -m wide_compiler.fuzz", description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="how long to run (default 5)")
    ap.add_argument("--programs", type=int, default=None, help="stop after this many programs")
    ap.add_argument("--seed", type=int, default=None, help="first seed (default: from the clock)")
    ap.add_argument("--out", default="fuzz-findings", help="directory for findings and the summary")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    seed = args.seed if args.seed is not None else int(time.time()) % 1_000_000 * 1000
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counts = dict.fromkeys(OUTCOMES, 0)
    reasons: dict[str, int] = {}  # the refusals' reasons, numbers and names left out: a false refusal shows here
    end = time.monotonic() + args.minutes * 60
    ran = 0
    try:
        from tqdm import tqdm
        bar = tqdm(total=args.programs, unit="program", disable=not sys.stderr.isatty())
    except ImportError:  # pragma: no cover
        bar = None
    # the run's compile cache in a directory of its own (the user's is not filled): every program
    # is new, so a hit is two programs sharing a key, and the check shows the other's outputs
    from .config import WideConfig

    cache = tempfile.TemporaryDirectory(prefix="wide-fuzz-cache-")
    config = WideConfig.fast().replace(cache_dir=cache.name)
    while time.monotonic() < end and (args.programs is None or ran < args.programs):
        result = run_program(generate(seed + ran, fourth=True), dtype=torch.float32 if ran % 4 == 3 else torch.float64,
                             config=config)
        counts[result.outcome] += 1
        ran += 1
        if result.outcome == "refused" and result.detail:
            reason = re.sub(r"<fuzz program \d+>:\d+|\d+", "#", result.detail)[:160]
            reasons[reason] = reasons.get(reason, 0) + 1
        if result.outcome in ("wrong", "crash"):
            (out / f"finding-{result.program.seed}.py").write_text(result.report())
        if bar is not None:
            bar.update(1)
            bar.set_postfix(counts)
        summary = {"programs": ran, "first_seed": seed, **counts,  # after each program: a stopped run keeps it
                   "refusals": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:20])}
        (out / f"summary-{seed}.json").write_text(json.dumps(summary, indent=1))
    cache.cleanup()
    log.warning("wide_compiler.fuzz: %s", json.dumps({"programs": ran, "first_seed": seed, **counts}))
    return 1 if counts["wrong"] or counts["crash"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
