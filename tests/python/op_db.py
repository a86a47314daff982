"""The test database of every ``torch.ops.wide`` operator (one :class:`OpInfo` per schema).

Each entry says, for one op of csrc/wide/registration.cpp:

* ``sample_inputs(dtype, requires_grad)`` -- a few fixed, seeded calls (random shapes, batch 1,
  N = 1, the op's strategies and layouts: N-first, channel-packed, stride-0 shared, strided);
* ``fuzz(rng, dtype)`` -- one random valid call drawn from a ``random.Random`` (shapes and
  hyperparameters), for the seeded fuzz test;
* ``reference`` -- what ONE member computes, with plain torch ops: it is called with the op's own
  argument list in which every per-member tensor is replaced by member ``i``'s slice
  (:meth:`SampleInput.member_args`), and returns what member ``i`` of the wide result must equal
  (:attr:`OpInfo.member_output` picks that part of the wide result);
* whether the op is differentiable, and whether ``gradcheck`` / ``gradgradcheck`` apply;
* tolerances (by default :func:`wide_compiler.testing.tolerance`) and known failures.

tests/python/test_op_db.py turns the entries into opcheck, reference, gradient, gradcheck and fuzz
tests, and checks that the database and the registered schemas name the same ops.

Note [How a member sees a wide argument]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every wide op takes its per-member tensors N-first (``[N, ...]``; member i reads ``t[i]``), except
where the sample says otherwise: ``packed`` arguments are channel-packed ``[B, N*C, *]`` (member i
owns channels ``[i*C, (i+1)*C)``), ``same`` arguments are passed whole to every member (a shared
1-d ``offsets``, a ``[1]`` hyperparameter). A stride-0 shared input ``x.expand(N, ...)`` needs no
kind of its own: its member slice ``t[i]`` is the shared value. Lists of tensors (``hx``, the
recurrent ``params``) are sliced element by element; everything else is passed as is, so a
reference ignores the wide-only arguments (``n``, ``packed_input``, ``strategy``).

The member slices of the differentiable arguments are views of the very tensors the wide op gets,
so one ``autograd.grad`` over all members' references gives the reference gradient of every leaf
in the wide layout (a shared leaf's gradient is the sum over members; a packed leaf's gradient is
packed) -- no per-layout bookkeeping. Arguments the op writes in place (the schema's ``(a!)``
ones: running statistics, optimizer state) are cloned per member before the wide call, and the
members' updated clones are compared with the wide tensors after it.
"""
from __future__ import annotations

import functools
import math
import os
import random
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
import torch.optim.adagrad as optim_adagrad
import torch.optim.adam as optim_adam
import torch.optim.rmsprop as optim_rmsprop
import torch.optim.sgd as optim_sgd
import wide_compiler  # noqa: F401  (registers torch.ops.wide)
from wide_compiler.ops import WIDE_OPS
from wide_compiler.testing import tolerance

W = torch.ops.wide
F32, F64 = torch.float32, torch.float64
#: Where the samples live: ``WIDE_TEST_DEVICE=cuda`` runs the whole database on a GPU (values are
#: drawn on the CPU from the same seeds, then moved, so a GPU run checks the same calls).
DEVICE = torch.device(os.environ.get("WIDE_TEST_DEVICE", "cpu"))


def _on_device(v):
    """``v`` (a tensor, or a list/tuple of them) on :data:`DEVICE`; tensors already there (the
    :class:`Maker`'s, with their layouts and autograd leaves) and everything else unchanged."""
    if isinstance(v, torch.Tensor):
        return v if v.device == DEVICE else v.to(DEVICE)
    if isinstance(v, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in v):
        return type(v)(_on_device(t) for t in v)
    return v


# --------------------------------------------------------------------------------------------
# Samples
# --------------------------------------------------------------------------------------------
@dataclass
class SampleInput:
    """One call of a wide op: ``op(*args, **kwargs)`` with ``n`` members.

    ``packed``: argument (position or keyword) -> channels per member, for channel-packed
    arguments; ``same``: arguments every member gets whole (Note [How a member sees a wide
    argument]). ``gradcheck``: whether this sample may serve the gradcheck test (set False where a
    path is not twice differentiable or too big); ``aot``: also run opcheck's
    ``test_aot_dispatch_dynamic`` (an AOTAutograd compile, ~0.3 s) on it.
    """

    desc: str
    n: int
    args: tuple
    kwargs: dict = field(default_factory=dict)
    packed: dict = field(default_factory=dict)
    same: frozenset = frozenset()
    gradcheck: bool = True
    aot: bool = False

    def __post_init__(self) -> None:
        # the few plain tensors a sample builds itself (offsets, steps, masks) follow the Maker's
        self.args = tuple(_on_device(v) for v in self.args)
        self.kwargs = {k: _on_device(v) for k, v in self.kwargs.items()}

    def member_args(self, i: int, mutable: frozenset = frozenset()) -> tuple[tuple, dict]:
        """Member ``i``'s arguments: per-member tensors sliced, ``mutable`` ones (positions or
        keywords the op writes in place) detached clones of the slice."""
        def one(key, v):
            if isinstance(v, torch.Tensor):
                if key in self.same:
                    m = v
                elif key in self.packed:
                    c = self.packed[key]
                    m = v[:, i * c:(i + 1) * c]
                else:
                    m = v[i]
                return m.detach().clone() if key in mutable else m
            if isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v):
                return [t[i] for t in v]
            return v
        return (tuple(one(k, v) for k, v in enumerate(self.args)),
                {k: one(k, v) for k, v in self.kwargs.items()})

    def leaves(self) -> list[torch.Tensor]:
        """The autograd leaves behind the arguments that require grad (a shared input's leaf is
        the tensor it expands), each once."""
        out: list[torch.Tensor] = []

        def add(t):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                leaf = t if t.is_leaf else t._base
                if leaf is not None and leaf.is_leaf and not any(leaf is o for o in out):
                    out.append(leaf)
            elif isinstance(t, (list, tuple)):
                for u in t:
                    add(u)
        for v in (*self.args, *self.kwargs.values()):
            add(v)
        return out

    def grad_positions(self) -> list[tuple]:
        """Where the arguments that require grad sit: ``(position,)`` or ``(position, index)``
        into a list argument; only meaningful when each is a leaf (see :meth:`gradcheckable`)."""
        pos = []
        for k, v in enumerate(self.args):
            if isinstance(v, torch.Tensor) and v.requires_grad:
                pos.append((k,))
            elif isinstance(v, (list, tuple)):
                pos += [(k, j) for j, t in enumerate(v) if isinstance(t, torch.Tensor) and t.requires_grad]
        return pos

    def gradcheckable(self) -> bool:
        """Every differentiable argument is a leaf passed positionally (gradcheck perturbs it)."""
        if not self.gradcheck:
            return False
        args = [t for p in self.grad_positions() for t in [self._at(p)]]
        kw = [v for v in self.kwargs.values() if isinstance(v, torch.Tensor) and v.requires_grad]
        return bool(args) and not kw and all(t.is_leaf for t in args)

    def _at(self, p: tuple) -> torch.Tensor:
        return self.args[p[0]] if len(p) == 1 else self.args[p[0]][p[1]]

    def with_grad_args(self, values) -> tuple:
        """``args`` with the arguments at :meth:`grad_positions` replaced by ``values``."""
        args = [list(a) if isinstance(a, (list, tuple)) else a for a in self.args]
        for p, v in zip(self.grad_positions(), values):
            if len(p) == 1:
                args[p[0]] = v
            else:
                args[p[0]][p[1]] = v
        return tuple(args)

    def numel(self) -> int:
        return sum(t.numel() for t in self.leaves())


class Maker:
    """Seeded tensors of one dtype; float tensors require grad when ``requires_grad`` (and the
    caller does not say otherwise). ``layout`` makes the same values live in another memory
    layout (Note [How a member sees a wide argument]): ``contiguous``; ``sliced`` (every other
    element of the last dim); ``transposed`` (last two dims swapped in memory); ``member_inner``
    (dims 0 and 1 swapped in memory); ``shared`` (one member's value expanded over dim 0, stride
    0); ``channels_last`` (a packed [B, N*C, *] tensor with channels innermost)."""

    def __init__(self, seed: Any, dtype: torch.dtype, requires_grad: bool):
        self.g = torch.Generator().manual_seed(zlib.crc32(str(seed).encode()))
        self.dtype, self.requires_grad = dtype, requires_grad

    def _layout(self, fill: Callable[[tuple], torch.Tensor], shape: tuple, layout: str, grad: bool):
        shape = tuple(shape)
        fill = lambda s, fill=fill: fill(s).to(DEVICE)  # noqa: E731 (drawn on the CPU: same values anywhere)
        if layout == "shared":
            leaf = fill(shape[1:]).requires_grad_(grad)
            return leaf.expand(shape)
        if layout == "sliced" and len(shape) >= 1:
            t = fill((*shape[:-1], 2 * shape[-1]))[..., 1::2]
        elif layout == "transposed" and len(shape) >= 2:
            t = fill((*shape[:-2], shape[-1], shape[-2])).transpose(-1, -2)
        elif layout == "member_inner" and len(shape) >= 2:
            t = fill((shape[1], shape[0], *shape[2:])).transpose(0, 1)
        elif layout == "channels_last" and len(shape) >= 3:
            t = fill((shape[0], *shape[2:], shape[1])).movedim(-1, 1)
        else:
            t = fill(shape)
        return t.detach().requires_grad_(grad)

    def randn(self, *shape, layout="contiguous", scale=1.0, shift=0.0, grad=None) -> torch.Tensor:
        grad = self.requires_grad if grad is None else grad
        return self._layout(lambda s: torch.randn(s, generator=self.g, dtype=self.dtype, device="cpu") * scale + shift,
                            shape, layout, grad)

    def pos(self, *shape, layout="contiguous", lo=0.5, grad=None) -> torch.Tensor:
        """Values in [lo, lo + 1): variances, slopes, second moments."""
        grad = self.requires_grad if grad is None else grad
        return self._layout(lambda s: torch.rand(s, generator=self.g, dtype=self.dtype, device="cpu") + lo, shape, layout, grad)

    def ints(self, high, *shape, layout="contiguous", dtype=torch.int64) -> torch.Tensor:
        return self._layout(lambda s: torch.randint(0, high, s, generator=self.g, dtype=dtype, device="cpu"), shape, layout, False)

    def maybe(self, flag: bool, *shape, **kw) -> torch.Tensor | None:
        return self.randn(*shape, **kw) if flag else None


# --------------------------------------------------------------------------------------------
# The op entries
# --------------------------------------------------------------------------------------------
def member_nfirst(out, i: int, s: SampleInput):
    """Member ``i`` of an N-first result (any tree of tensors: ``t[i]`` each; None stays None)."""
    if isinstance(out, torch.Tensor):
        return out[i]
    if isinstance(out, (list, tuple)):
        return type(out)(member_nfirst(o, i, s) for o in out)
    return out


def member_packed(out: torch.Tensor, i: int, s: SampleInput) -> torch.Tensor:
    """Member ``i`` of a channel-packed result ``[B, N*C, *]``: channels ``[i*C, (i+1)*C)``."""
    c = out.shape[1] // s.n
    return out[:, i * c:(i + 1) * c]


@dataclass
class OpInfo:
    """One ``torch.ops.wide`` op and how to test it (module docstring)."""

    name: str
    sample_inputs: Callable[[torch.dtype, bool], Iterator[SampleInput]]
    fuzz: Callable[[random.Random, torch.dtype], SampleInput]
    reference: Callable[..., Any]
    member_output: Callable[[Any, int, SampleInput], Any] = member_nfirst
    dtypes: tuple = (F32, F64)
    differentiable: bool = True
    gradcheck: bool = True
    gradgradcheck: bool = True
    # how many of the first samples also run without gradients (the ops pick other kernels then:
    # wide::fused_norm's CPU kernel, small_attention)
    nograd_samples: int = 1
    # (dtype, kind) -> dict(rtol=, atol=), overriding wide_compiler.testing.tolerance
    tolerances: dict = field(default_factory=dict)
    # test name ("opcheck", "reference", "gradcheck", "fuzz") -> reason: strict xfail
    xfail: dict = field(default_factory=dict)

    @property
    def op(self) -> torch._ops.OpOverload:
        return getattr(W, self.name).default

    @property
    def mutable(self) -> frozenset:
        """Positions (and keyword names) of the arguments the schema marks written (``(a!)``)."""
        out = set()
        for k, a in enumerate(self.op._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                out |= {k, a.name}
        return frozenset(out)

    def samples(self) -> list[SampleInput]:
        """The fixed samples the opcheck and reference tests run: every dtype, with gradients
        where the op is differentiable, and the first float32 configuration without gradients
        (ops choose other kernels when no gradient is wanted)."""
        out = []
        for dtype in self.dtypes:
            for s in self.sample_inputs(dtype, self.differentiable):
                s.aot = s.aot and dtype == self.dtypes[-1]  # one AOT compile per marked sample
                s.desc = f"{s.desc}-{str(dtype).removeprefix('torch.')}{'-grad' if self.differentiable else ''}"
                out.append(s)
        if self.differentiable:
            for _, s in zip(range(self.nograd_samples), self.sample_inputs(self.dtypes[0], False)):
                s.aot = False
                s.desc = f"{s.desc}-{str(self.dtypes[0]).removeprefix('torch.')}-nograd"
                out.append(s)
        return out


def _spatial(rng: random.Random, lo: int, hi: int, most: int = 3) -> list[int]:
    return [rng.randint(1, most) for _ in range(rng.randint(lo, hi))]


# ---- linear ---------------------------------------------------------------------------------
LINEAR_STRATEGIES = WIDE_OPS["linear"].choices
NFIRST_LAYOUTS = ("contiguous", "sliced", "transposed", "member_inner", "shared")


def _linear(m: Maker, desc, n, lead, fin, fout, layout, bias, strategy, aot=False) -> SampleInput:
    return SampleInput(desc, n, (m.randn(n, *lead, fin, layout=layout), m.randn(n, fout, fin, scale=0.5),
                                 m.maybe(bias, n, fout)), {"strategy": strategy}, aot=aot)


def linear_samples(dtype, rg):
    m = Maker("linear", dtype, rg)
    # contiguous first: the first four (one per strategy) also run without gradients
    for j, layout in enumerate(("contiguous", "sliced", "member_inner", "shared")):
        for k, strategy in enumerate(LINEAR_STRATEGIES):
            yield _linear(m, f"{strategy}-{layout}", 3, (2,), 5, 4, layout, (j + k) % 2 == 0, strategy,
                          aot=layout == "contiguous" or (strategy, layout) == ("loop", "shared"))
    yield _linear(m, "rank1-N1", 1, (), 5, 3, "contiguous", True, "auto")
    yield _linear(m, "rank3-B1", 2, (1, 3), 4, 3, "contiguous", False, "auto")
    yield _linear(m, "rank3-strided", 3, (2, 2), 3, 2, "sliced", False, "auto")


def linear_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, dtype == F64)
    n = rng.randint(1, 4)
    lead = tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 2)))
    return _linear(m, "fuzz", n, lead, rng.randint(1, 6), rng.randint(1, 6), rng.choice(NFIRST_LAYOUTS),
                   rng.random() < 0.5, rng.choice(LINEAR_STRATEGIES))


def linear_ref(x, w, b=None, *, strategy="auto"):
    return F.linear(x, w, b)


# ---- layout ops -----------------------------------------------------------------------------
def to_packed_samples(dtype, rg):
    m = Maker("to_packed", dtype, rg)
    yield SampleInput("4d", 3, (m.randn(3, 2, 4, 5),), aot=True)
    yield SampleInput("3d-B1", 2, (m.randn(2, 1, 3),))
    yield SampleInput("shared", 2, (m.randn(2, 2, 3, 2, layout="shared"),))
    yield SampleInput("member_inner", 3, (m.randn(3, 2, 2, 2, layout="member_inner"),))


def to_packed_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, dtype == F64)
    n = rng.randint(1, 4)
    return SampleInput("fuzz", n, (m.randn(n, rng.randint(1, 3), rng.randint(1, 3), *_spatial(rng, 0, 2),
                                           layout=rng.choice(NFIRST_LAYOUTS)),))


def to_nfirst_samples(dtype, rg):
    m = Maker("to_nfirst", dtype, rg)
    yield SampleInput("3d", 3, (m.randn(2, 6, 3), 3), packed={0: 2}, aot=True)
    yield SampleInput("2d-N1", 1, (m.randn(1, 4), 1), packed={0: 4})
    yield SampleInput("channels_last", 2, (m.randn(2, 4, 3, 2, layout="channels_last"), 2), packed={0: 2})


def to_nfirst_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, dtype == F64)
    n, c = rng.randint(1, 4), rng.randint(1, 3)
    layout = rng.choice(("contiguous", "sliced", "channels_last"))
    return SampleInput("fuzz", n, (m.randn(rng.randint(1, 3), n * c, *_spatial(rng, 0, 2), layout=layout), n),
                       packed={0: c})


def to_channels_first_samples(dtype, rg):
    m = Maker("to_channels_first", dtype, rg)
    yield SampleInput("channels_last", 2, (m.randn(2, 6, 3, 4, layout="channels_last"),), packed={0: 3}, aot=True)
    yield SampleInput("contiguous-B1", 3, (m.randn(1, 3, 2, 2),), packed={0: 1})
    yield SampleInput("3d-sliced", 2, (m.randn(2, 4, 3, layout="sliced"),), packed={0: 2})


def to_channels_first_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, dtype == F64)
    n, c = rng.randint(1, 4), rng.randint(1, 3)
    layout = rng.choice(("contiguous", "sliced", "channels_last"))
    return SampleInput("fuzz", n, (m.randn(rng.randint(1, 3), n * c, *_spatial(rng, 0, 2), layout=layout),),
                       packed={0: c})


# ---- conv / conv_transpose ------------------------------------------------------------------
CONV_F = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}
CONVT_F = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}
CONV_STRATEGIES = WIDE_OPS["conv"].choices


def _conv_input(m: Maker, n, b, c, spatial, packed, layout):
    if packed:
        return m.randn(b, n * c, *spatial, layout=layout)
    return m.randn(n, b, c, *spatial, layout=layout)


def conv_samples(dtype, rg):
    m = Maker("conv", dtype, rg)
    op = {"packed_input": True}
    yield SampleInput("nfirst-groups2", 2, (m.randn(2, 3, 4, 6, 6), m.randn(2, 6, 2, 3, 3, scale=0.3), m.randn(2, 6),
                                             [1, 1], [1, 1], [1, 1], 2))
    yield SampleInput("packed-loop-1d-left-right", 2, (m.randn(3, 8, 7), m.randn(2, 5, 4, 3, scale=0.3), None,
                                                       [2], [1, 2], [1], 1), {**op, "strategy": "loop"}, packed={0: 4},
                      aot=True)
    yield SampleInput("nfirst-loop-2d-B1", 2, (m.randn(2, 1, 3, 4, 4), m.randn(2, 8, 3, 3, 3, scale=0.3), m.randn(2, 8),
                                               [1, 1], [1, 1], [1, 1], 1), {"strategy": "loop"})
    yield SampleInput("nfirst-grouped_cl", 2, (m.randn(2, 3, 4, 6, 6), m.randn(2, 6, 2, 3, 3, scale=0.3), m.randn(2, 6),
                                               [1, 1], [1, 1], [1, 1], 2), {"strategy": "grouped_cl"})
    yield SampleInput("packed-grouped_cl-pads", 2, (m.randn(3, 8, 6, 5, layout="channels_last"),
                                                    m.randn(2, 5, 4, 3, 3, scale=0.3), m.randn(2, 5),
                                                    [2, 1], [1, 2, 0, 1], [1, 1], 1),
                      {**op, "strategy": "grouped_cl"}, packed={0: 4}, aot=True)
    yield SampleInput("shared-1d", 2, (m.randn(2, 3, 4, 6, layout="shared"), m.randn(2, 5, 4, 3, scale=0.3),
                                       m.randn(2, 5), [1], [1], [1], 1), aot=True)
    yield SampleInput("tiny-1d", 2, (m.randn(2, 1, 2, 4), m.randn(2, 2, 2, 2, scale=0.5), m.randn(2, 2),
                                     [1], [1], [1], 1),
                      aot=True)
    yield SampleInput("grouped-3d-dilated-N1", 1, (m.randn(1, 2, 2, 4, 3, 3), m.randn(1, 2, 2, 2, 1, 2, scale=0.3),
                                                   None, [1, 2, 1], [0, 1, 1], [2, 1, 1], 1), {"strategy": "grouped"})


def _conv_fuzz(rng, dtype, transposed):
    m = Maker(rng.random(), dtype, dtype == F64)
    n, d, b = rng.randint(1, 3), rng.randint(1, 3), rng.randint(1, 2)
    groups = rng.choice((1, 1, 2))
    cin, cout = groups * rng.randint(1, 2), groups * rng.randint(1, 2)
    kernel = [rng.randint(1, 3) for _ in range(d)]
    stride = [rng.randint(1, 2) for _ in range(d)]
    dilation = [rng.randint(1, 2) for _ in range(d)]
    span = [dl * (k - 1) + 1 for k, dl in zip(kernel, dilation)]
    extra = 2 if d < 3 else 1
    packed = rng.random() < 0.5
    layout = rng.choice(("contiguous", "sliced", "channels_last") if packed else NFIRST_LAYOUTS)
    strategy = rng.choice(CONV_STRATEGIES)
    bias = rng.random() < 0.5
    if not transposed:
        if rng.random() < 0.3:  # (left, right) per dim, F.pad order
            padding = [rng.randint(0, 2) for _ in range(2 * d)]
            total = [padding[2 * (d - 1 - k)] + padding[2 * (d - 1 - k) + 1] for k in range(d)]
        else:
            padding = [rng.randint(0, 2) for _ in range(d)]
            total = [2 * p for p in padding]
        spatial = [max(1, s - t) + rng.randint(0, extra) for s, t in zip(span, total)]
        x = _conv_input(m, n, b, cin, spatial, packed, layout)
        args = (x, m.randn(n, cout, cin // groups, *kernel, scale=0.5), m.maybe(bias, n, cout),
                stride, padding, dilation, groups)
    else:
        spatial = [rng.randint(1, 1 + extra) for _ in range(d)]
        output_padding = [rng.randint(0, max(s, dl) - 1) for s, dl in zip(stride, dilation)]
        padding = [rng.randint(0, min(((sp - 1) * s + sn - 1 + op) // 2, 2))
                   for sp, s, sn, op in zip(spatial, stride, span, output_padding)]
        x = _conv_input(m, n, b, cin, spatial, packed, layout)
        args = (x, m.randn(n, cin, cout // groups, *kernel, scale=0.5), m.maybe(bias, n, cout),
                stride, padding, output_padding, groups, dilation)
    return SampleInput("fuzz", n, args, {"packed_input": packed, "strategy": strategy},
                       packed={0: cin} if packed else {})


def conv_ref(x, w, b, stride, padding, dilation, groups, *, packed_input=False, strategy="auto"):
    d = w.dim() - 2
    if len(padding) == 2 * d:  # (left, right) per dim in F.pad order
        return CONV_F[d](F.pad(x, padding), w, b, stride, 0, dilation, groups)
    return CONV_F[d](x, w, b, stride, padding, dilation, groups)


def conv_transpose_samples(dtype, rg):
    m = Maker("conv_transpose", dtype, rg)
    yield SampleInput("nfirst-groups2", 2, (m.randn(2, 3, 4, 5, 5), m.randn(2, 4, 3, 3, 3, scale=0.3), m.randn(2, 6),
                                             [2, 2], [1, 1], [1, 1], 2, [1, 1]))
    yield SampleInput("shared-1d", 2, (m.randn(2, 3, 4, 5, layout="shared"), m.randn(2, 4, 3, 3, scale=0.3), None,
                                       [2], [0], [0], 1, [1]), aot=True)
    yield SampleInput("packed-loop-B1", 3, (m.randn(1, 6, 4), m.randn(3, 2, 3, 2, scale=0.3), m.randn(3, 3),
                                            [1], [1], [0], 1, [2]), {"packed_input": True, "strategy": "loop"},
                      packed={0: 2})
    yield SampleInput("tiny-1d", 2, (m.randn(2, 1, 2, 3), m.randn(2, 2, 2, 2, scale=0.5), m.randn(2, 2),
                                     [2], [1], [1], 1, [1]), aot=True)
    yield SampleInput("packed-N1", 1, (m.randn(2, 2, 3), m.randn(1, 2, 2, 2, scale=0.3), m.randn(1, 2),
                                       [2], [0], [1], 1, [1]), {"packed_input": True}, packed={0: 2})
    yield SampleInput("grouped_cl-2d", 2, (m.randn(2, 2, 2, 3, 3), m.randn(2, 2, 3, 2, 2, scale=0.3), m.randn(2, 3),
                                           [2, 1], [0, 1], [1, 0], 1, [1, 1]), {"strategy": "grouped_cl"})


def conv_transpose_ref(x, w, b, stride, padding, output_padding, groups, dilation, *, packed_input=False,
                       strategy="auto"):
    return CONVT_F[w.dim() - 2](x, w, b, stride, padding, output_padding, groups, dilation)


# ---- batch / instance / group norm ----------------------------------------------------------
def _stats(m: Maker, n, c, layout="contiguous"):
    return (m.randn(n, c, layout=layout, scale=0.5, grad=False), m.pos(n, c, layout=layout, grad=False))


def batch_norm_samples(dtype, rg):
    m = Maker("batch_norm", dtype, rg)
    yield SampleInput("train", 2, (m.randn(2, 4, 3, 5), m.pos(2, 3), m.randn(2, 3), *_stats(m, 2, 3),
                                   True, 0.1, 1e-5), aot=True)
    yield SampleInput("eval-packed-no-affine", 2, (m.randn(4, 6, 5), None, None, *_stats(m, 2, 3), False, 0.1, 1e-5),
                      {"packed_input": True}, packed={0: 3})
    yield SampleInput("train-transposed-stats", 2, (m.randn(2, 4, 3), m.pos(2, 3), None, *_stats(m, 2, 3, "transposed"),
                                                    True, 0.2, 1e-5), aot=True)
    yield SampleInput("train-no-stats-shared-B2", 3, (m.randn(3, 2, 2, 2, layout="shared"), m.pos(3, 2), m.randn(3, 2),
                                                      None, None, True, 0.1, 1e-3))
    # PyTorch's own batch norm double backward drops the bias term when there is no weight
    # (gradgradcheck of F.batch_norm(x, rm, rv, None, b) fails too): not a gradcheck sample.
    yield SampleInput("eval-B1-N1", 1, (m.randn(1, 1, 3, 2, 2), None, m.randn(1, 3), *_stats(m, 1, 3),
                                        False, 0.1, 1e-5), gradcheck=False)
    yield SampleInput("tiny-affine-train", 2, (m.randn(2, 2, 2), m.pos(2, 2), m.randn(2, 2), *_stats(m, 2, 2),
                                               True, 0.1, 1e-5))
    # 16+ values per (sample, channel): the training kernel (Note [Batch norm training kernel])
    yield SampleInput("train-kernel", 2, (m.randn(2, 3, 2, 4, 5), m.pos(2, 2), m.randn(2, 2), *_stats(m, 2, 2),
                                          True, 0.1, 1e-5), aot=True)
    yield SampleInput("train-kernel-packed-no-stats", 3, (m.randn(2, 6, 17), m.pos(3, 2), None, None, None, True,
                                                          0.1, 1e-3), {"packed_input": True}, packed={0: 2})


def batch_norm_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, dtype == F64)
    n, b, c = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 3)
    spatial = _spatial(rng, 0, 2)
    training = rng.random() < 0.5
    if training and b * math.prod(spatial) == 1:
        b = 2  # one value to normalise raises, as PyTorch does (test_fuzz_ops covers that)
    track = not training or rng.random() < 0.5
    packed = rng.random() < 0.5
    x = _conv_input(m, n, b, c, spatial, packed, rng.choice(("contiguous", "sliced")))
    stats = _stats(m, n, c, rng.choice(("contiguous", "transposed"))) if track else (None, None)
    return SampleInput("fuzz", n, (x, m.pos(n, c) if rng.random() < 0.7 else None,
                                   m.maybe(rng.random() < 0.7, n, c), *stats, training,
                                   rng.choice((0.0, 0.1, 1.0)), rng.choice((1e-5, 1e-3))),
                       {"packed_input": packed}, packed={0: c} if packed else {})


def batch_norm_ref(x, w, b, rm, rv, training, momentum, eps, *, packed_input=False):
    if w is None and b is not None and x.device.type != "cpu":
        w = torch.ones_like(b)  # PyTorch's CUDA backward fails on a bias without a weight; the same norm
    return F.batch_norm(x, rm, rv, w, b, training, momentum, eps)


def instance_norm_samples(dtype, rg):
    m = Maker("instance_norm", dtype, rg)
    yield SampleInput("train", 2, (m.randn(2, 4, 3, 5), m.pos(2, 3), m.randn(2, 3), *_stats(m, 2, 3),
                                   True, 0.1, 1e-5), aot=True)
    yield SampleInput("eval-stats-packed", 3, (m.randn(2, 6, 2, 2), None, None, *_stats(m, 3, 2), False, 0.1, 1e-5),
                      {"packed_input": True}, packed={0: 2})
    yield SampleInput("no-stats-B1", 2, (m.randn(2, 1, 2, 4), m.pos(2, 2), None, None, None, True, 0.1, 1e-5))


def instance_norm_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, dtype == F64)
    n, b, c = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 3)
    spatial = _spatial(rng, 1, 2)
    use_input_stats = rng.random() < 0.5
    if use_input_stats and math.prod(spatial) == 1:
        spatial[0] = 2
    track = not use_input_stats or rng.random() < 0.5
    packed = rng.random() < 0.5
    x = _conv_input(m, n, b, c, spatial, packed, "contiguous")
    stats = _stats(m, n, c) if track else (None, None)
    return SampleInput("fuzz", n, (x, m.maybe(rng.random() < 0.5, n, c, shift=1.0), m.maybe(rng.random() < 0.5, n, c),
                                   *stats, use_input_stats, rng.choice((0.0, 0.1, 1.0)), 1e-5),
                       {"packed_input": packed}, packed={0: c} if packed else {})


def instance_norm_ref(x, w, b, rm, rv, use_input_stats, momentum, eps, *, packed_input=False):
    return F.instance_norm(x, rm, rv, w, b, use_input_stats, momentum, eps)


def group_norm_samples(dtype, rg):
    m = Maker("group_norm", dtype, rg)
    yield SampleInput("nfirst", 2, (m.randn(2, 4, 6, 5), 2, 3, m.pos(2, 6), m.randn(2, 6), 1e-5), aot=True)
    yield SampleInput("packed-no-affine-B1", 3, (m.randn(1, 12, 2), 3, 2, None, None, 1e-5), {"packed_input": True},
                      packed={0: 4})
    yield SampleInput("one-group-2d", 2, (m.randn(2, 3, 4), 2, 1, m.pos(2, 4), None, 1e-3))


def group_norm_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, dtype == F64)
    n, b, groups = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 3)
    c = groups * rng.randint(1, 3)
    spatial = _spatial(rng, 0, 2)
    if b * (c // groups) * math.prod(spatial) == 1:
        b = 2
    packed = rng.random() < 0.5
    # PyTorch's own F.group_norm fails the backward of a bias without a weight: a bias comes
    # with a weight here (test_fuzz_ops.gen_group_norm compares that configuration's forward).
    affine = rng.random() < 0.6
    return SampleInput("fuzz", n, (_conv_input(m, n, b, c, spatial, packed, rng.choice(("contiguous", "sliced"))),
                                   n, groups, m.maybe(affine, n, c, shift=1.0), m.maybe(affine, n, c),
                                   rng.choice((1e-5, 1e-3))),
                       {"packed_input": packed}, packed={0: c} if packed else {})


def group_norm_ref(x, n, num_groups, w=None, b=None, eps=1e-5, *, packed_input=False):
    return F.group_norm(x, num_groups, w, b, eps)


def _nfirst_group_norm_samples(name, dtype, rg):
    m = Maker(name, dtype, rg)
    yield SampleInput("affine", 2, (m.randn(2, 4, 6, 5, shift=0.5), 3, m.pos(2, 6), m.randn(2, 6), 1e-5), aot=True)
    yield SampleInput("no-affine-B1-2d", 3, (m.randn(3, 1, 4, 2, 3), 2, None, None, 1e-5))
    yield SampleInput("weight-only-sliced", 2, (m.randn(2, 3, 4, 3, layout="sliced"), 1, m.pos(2, 4), None, 1e-3))
    yield SampleInput("per-channel-transposed", 2, (m.randn(2, 2, 3, 4, layout="transposed"), 3, m.pos(2, 3),
                                                    m.randn(2, 3), 1e-5))


def _nfirst_group_norm_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, dtype == F64)
    n, b, groups = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 3)
    c = groups * rng.randint(1, 3)
    spatial = _spatial(rng, 0, 2)
    if (c // groups) * math.prod(spatial) == 1:  # rows of one value: 0 here, ATen's variance noise there
        spatial = [*spatial, 2]
    # a bias comes with a weight: PyTorch's F.group_norm backward fails on a bias alone
    affine = rng.random() < 0.6
    return SampleInput("fuzz", n, (m.randn(n, b, c, *spatial, layout=rng.choice(NFIRST_LAYOUTS[:3])), groups,
                                   m.maybe(affine, n, c, shift=1.0), m.maybe(affine, n, c), rng.choice((1e-5, 1e-3))))


def group_norm_nfirst_samples(dtype, rg):
    return _nfirst_group_norm_samples("group_norm_nfirst", dtype, rg)


def fused_group_norm_samples(dtype, rg):
    return _nfirst_group_norm_samples("fused_group_norm", dtype, rg)


def nfirst_group_norm_ref(x, num_groups, w=None, b=None, eps=1e-5):
    return F.group_norm(x, num_groups, w, b, eps)


# ---- layer / rms norm and the fused kernels -------------------------------------------------
def layer_norm_samples(dtype, rg):
    m = Maker("layer_norm", dtype, rg)
    yield SampleInput("2dims", 2, (m.randn(2, 4, 3, 5), [3, 5], m.pos(2, 3, 5), m.randn(2, 3, 5), 1e-5), aot=True)
    yield SampleInput("fused-no-affine", 3, (m.randn(3, 2, 4), [4], None, None, 1e-5), {"strategy": "fused"})
    yield SampleInput("loop-shared-B1", 2, (m.randn(2, 1, 6, layout="shared"), [6], m.pos(2, 6), None, 1e-3),
                      {"strategy": "loop"})
    yield SampleInput("sliced-bias-only", 2, (m.randn(2, 3, 4, layout="sliced"), [4], None, m.randn(2, 4), 1e-5))


def _trailing(rng, m: Maker):
    n = rng.randint(1, 4)
    lead = [rng.randint(1, 3) for _ in range(rng.randint(0, 2))]
    ns = [rng.randint(1, 4) for _ in range(rng.randint(1, 2))]
    return n, lead, ns


def layer_norm_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, dtype == F64)
    n, lead, ns = _trailing(rng, m)
    return SampleInput("fuzz", n, (m.randn(n, *lead, *ns, layout=rng.choice(NFIRST_LAYOUTS), scale=2.0, shift=0.5),
                                   ns, m.maybe(rng.random() < 0.5, n, *ns, shift=1.0),
                                   m.maybe(rng.random() < 0.5, n, *ns),
                                   rng.choice((1e-5, 1e-3))), {"strategy": rng.choice(WIDE_OPS["layer_norm"].choices)})


def layer_norm_ref(x, ns, w=None, b=None, eps=1e-5, *, strategy="auto"):
    return F.layer_norm(x, ns, w, b, eps)


def rms_norm_samples(dtype, rg):
    m = Maker("rms_norm", dtype, rg)
    yield SampleInput("eps-none", 2, (m.randn(2, 4, 5), [5], m.pos(2, 5), None), aot=True)
    yield SampleInput("2dims-no-weight", 3, (m.randn(3, 2, 2, 3), [2, 3], None, 1e-2))
    yield SampleInput("shared-B1", 2, (m.randn(2, 1, 4, layout="shared"), [4], m.pos(2, 4), 1e-5))


def rms_norm_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, dtype == F64)
    n, lead, ns = _trailing(rng, m)
    return SampleInput("fuzz", n, (m.randn(n, *lead, *ns, layout=rng.choice(NFIRST_LAYOUTS), shift=0.5), ns,
                                   m.maybe(rng.random() < 0.5, n, *ns, shift=1.0), rng.choice((None, 1e-5, 1e-2))))


def rms_norm_ref(x, ns, w=None, eps=None):
    return F.rms_norm(x, ns, w, eps)


def add_layer_norm_samples(dtype, rg):
    m = Maker("add_layer_norm", dtype, rg)
    yield SampleInput("affine", 2, (m.randn(2, 4, 5), m.randn(2, 4, 5), [5], m.pos(2, 5), m.randn(2, 5), 1e-5),
                      aot=True)
    yield SampleInput("broadcast-residual", 2, (m.randn(2, 4, 5), m.randn(2, 1, 5), [5], None, m.randn(2, 5), 1e-5))
    yield SampleInput("2dims-B1-N1", 1, (m.randn(1, 1, 2, 3), m.randn(1, 1, 2, 3), [2, 3], m.pos(1, 2, 3), None, 1e-3))


def add_layer_norm_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, dtype == F64)
    n, lead, ns = _trailing(rng, m)
    return SampleInput("fuzz", n, (m.randn(n, *lead, *ns, layout=rng.choice(NFIRST_LAYOUTS)),
                                   m.randn(n, *lead, *ns, layout=rng.choice(NFIRST_LAYOUTS)), ns,
                                   m.maybe(rng.random() < 0.5, n, *ns, shift=1.0), m.maybe(rng.random() < 0.5, n, *ns),
                                   rng.choice((1e-5, 1e-3))))


def add_layer_norm_ref(x, r, ns, w=None, b=None, eps=1e-5):
    return F.layer_norm(x + r, ns, w, b, eps)


def fused_norm_samples(dtype, rg):
    m = Maker("fused_norm", dtype, rg)
    yield SampleInput("ln-residual", 2, (m.randn(2, 4, 3, 5), m.randn(2, 4, 3, 5), 15, m.pos(2, 3, 5), m.randn(2, 3, 5),
                                         1e-5, False), aot=True)
    yield SampleInput("rms", 3, (m.randn(3, 4, 6), None, 6, m.pos(3, 6), None, 1e-6, True), aot=True)
    yield SampleInput("ln-bias-only", 2, (m.randn(2, 4, 5), None, 5, None, m.randn(2, 5), 1e-5, False))
    yield SampleInput("ln-no-affine-B1", 2, (m.randn(2, 1, 4), None, 4, None, None, 1e-5, False))


def fused_norm_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, dtype == F64)
    n, lead, ns = _trailing(rng, m)
    rms = rng.random() < 0.5
    shape = (n, max(1, math.prod(lead)), *ns)
    return SampleInput("fuzz", n, (m.randn(*shape), m.maybe(rng.random() < 0.5, *shape), math.prod(ns),
                                   m.maybe(rng.random() < 0.5, n, *ns, shift=1.0),
                                   m.maybe(rng.random() < 0.5, n, *ns), rng.choice((1e-6, 1e-3)), rms))


def _member_norm(s: torch.Tensor, d: int, eps: float, rms: bool) -> torch.Tensor:
    rows = s.reshape(-1, d)
    return F.rms_norm(rows, (d,), None, eps) if rms else F.layer_norm(rows, (d,), None, None, eps)


def fused_norm_ref(x, r, d, w, b, eps, rms=False):
    y = _member_norm(x + r if r is not None else x, d, eps, rms)
    if w is not None:
        y = y * w.reshape(d)
    if b is not None:
        y = y + b.reshape(d)
    return y.reshape(x.shape)


def fused_norm_backward_samples(dtype, rg):
    m = Maker("fused_norm_backward", dtype, False)
    yield SampleInput("ln-full-mask", 2, (m.randn(2, 4, 5), m.randn(2, 4, 5), m.randn(2, 4, 5), 5, m.pos(2, 5),
                                          1e-5, False, [True, True, True]), aot=True)
    yield SampleInput("rms-dx-only", 3, (m.randn(3, 2, 6), m.randn(3, 2, 6), None, 6, None, 1e-6, True,
                                         [True, False, False]), aot=True)
    yield SampleInput("ln-2dims-no-weight", 2, (m.randn(2, 3, 2, 2), m.randn(2, 3, 2, 2), None, 4, None, 1e-5, False,
                                                [True, True, True]))
    yield SampleInput("rms-weight-grads-only", 2, (m.randn(2, 1, 3), m.randn(2, 1, 3), m.randn(2, 1, 3), 3,
                                                   m.pos(2, 3), 1e-5, True, [False, True, True]))


def fused_norm_backward_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, False)
    n, lead, ns = _trailing(rng, m)
    if math.prod(ns) < 3:  # rows of 1-2 values: x_hat = +-1, the gradient is all cancellation
        ns = [*ns, 3]
    shape = (n, max(1, math.prod(lead)), *ns)
    return SampleInput("fuzz", n, (m.randn(*shape), m.randn(*shape), m.maybe(rng.random() < 0.5, *shape),
                                   math.prod(ns), m.maybe(rng.random() < 0.5, n, *ns, shift=1.0),
                                   rng.choice((1e-6, 1e-3)), rng.random() < 0.5,
                                   [rng.random() < 0.8, rng.random() < 0.8, rng.random() < 0.8]))


def fused_norm_backward_ref(dy, x, r, d, w, eps, rms, mask):
    s = (x + r if r is not None else x).detach().requires_grad_()
    wm = w.detach().reshape(d).requires_grad_() if w is not None else None
    y = _member_norm(s, d, eps, rms)
    y = y * wm if wm is not None else y
    gs, gw = torch.autograd.grad(y, [s, wm] if wm is not None else [s], dy.reshape(-1, d)) + (None,) * (wm is None)
    dx = gs.reshape(x.shape) if mask[0] else None
    dw = gw.reshape(w.shape) if mask[1] and w is not None else None
    db = dy.reshape(-1, d).sum(0).reshape(w.shape if w is not None else (d,)) if mask[2] else None
    return dx, dw, db


# ---- fused_batch_norm: batch_norm's training kernel, one packed activation [B, C, *] with
# per-channel tensors [C]; every channel is independent, so a sample is one "member" (n=1) and
# the per-channel arguments are whole (same). Rows of >= 16 values per (sample, channel) take the
# CPU kernel, shorter ones and non-contiguous inputs ATen's native_batch_norm.
def _whole(out, i, s):
    return out


def fused_batch_norm_samples(dtype, rg):
    m = Maker("fused_batch_norm", dtype, rg)
    yield SampleInput("kernel-tail", 1, (m.randn(2, 3, 5, 7, scale=2.0, shift=1.0), m.pos(3), m.randn(3), 1e-5),
                      packed={0: 3}, same=frozenset({1, 2}), aot=True)
    yield SampleInput("kernel-no-affine-3d", 1, (m.randn(3, 4, 16), None, None, 1e-3), packed={0: 4})
    yield SampleInput("kernel-weight-only-B1", 1, (m.randn(1, 2, 2, 3, 4), m.pos(2), None, 1e-5),
                      packed={0: 2}, same=frozenset({1}))
    # (not gradcheck samples: test_gradcheck takes the smallest, and the kernel's is the one to check)
    yield SampleInput("short-rows", 1, (m.randn(4, 3, 2), m.pos(3), m.randn(3), 1e-5), packed={0: 3},
                      same=frozenset({1, 2}), gradcheck=False)
    yield SampleInput("channels-last", 1, (m.randn(2, 3, 4, 5, layout="channels_last"), m.pos(3), m.randn(3), 1e-5),
                      packed={0: 3}, same=frozenset({1, 2}), gradcheck=False)


def fused_batch_norm_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, dtype == F64)
    b, c = rng.randint(1, 3), rng.randint(1, 5)
    spatial = [rng.randint(1, 9) for _ in range(rng.randint(1, 3))]
    if b * math.prod(spatial) == 1:
        spatial[0] = 2
    x = m.randn(b, c, *spatial, layout=rng.choice(("contiguous", "contiguous", "sliced")), scale=rng.choice((1.0, 5.0)))
    return SampleInput("fuzz", 1, (x, m.pos(c) if rng.random() < 0.7 else None, m.maybe(rng.random() < 0.7, c),
                                   rng.choice((1e-5, 1e-3))), packed={0: c}, same=frozenset({1, 2}))


def _channel_dims(x):
    return [0, *range(2, x.dim())]


def fused_batch_norm_ref(x, w, b, eps):
    var, mean = torch.var_mean(x.detach(), _channel_dims(x), correction=0)
    return (F.batch_norm(x, None, None, w, b, True, 0.0, eps), mean, torch.rsqrt(var + eps),
            x.detach().var(_channel_dims(x), correction=1))


def _bn_backward_args(m, x, w, eps, mask):
    var, mean = torch.var_mean(x, _channel_dims(x), correction=0)
    return (m.randn(*x.shape), x, w, mean, torch.rsqrt(var + eps), eps, mask)


def fused_batch_norm_backward_samples(dtype, rg):
    m = Maker("fused_batch_norm_backward", dtype, False)
    yield SampleInput("kernel-full-mask", 1, _bn_backward_args(m, m.randn(2, 3, 4, 5), m.pos(3), 1e-5, [True] * 3),
                      same=frozenset(range(5)), aot=True)
    yield SampleInput("kernel-no-weight-dx-only", 1, _bn_backward_args(m, m.randn(3, 2, 17), None, 1e-3,
                                                                       [True, False, False]), same=frozenset(range(5)))
    yield SampleInput("kernel-param-grads-only", 1, _bn_backward_args(m, m.randn(1, 4, 4, 4), m.pos(4), 1e-5,
                                                                      [False, True, True]), same=frozenset(range(5)))
    yield SampleInput("short-rows", 1, _bn_backward_args(m, m.randn(5, 3, 3), m.pos(3), 1e-5, [True] * 3),
                      same=frozenset(range(5)))


def fused_batch_norm_backward_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, False)
    b, c = rng.randint(1, 3), rng.randint(1, 5)
    spatial = [rng.randint(2, 9) for _ in range(rng.randint(1, 3))]
    x = m.randn(b, c, *spatial, layout=rng.choice(("contiguous", "contiguous", "sliced")))
    return SampleInput("fuzz", 1, _bn_backward_args(m, x, m.pos(c) if rng.random() < 0.7 else None,
                                                    rng.choice((1e-5, 1e-3)), [rng.random() < 0.8 for _ in range(3)]),
                       same=frozenset(range(5)))


def fused_batch_norm_backward_ref(dy, x, w, mean, invstd, eps, mask):
    xl = x.detach().requires_grad_()
    wl = (w if w is not None else torch.ones_like(mean)).detach().requires_grad_()
    y = F.batch_norm(xl, None, None, wl, None, True, 0.0, eps)
    dx, dw = torch.autograd.grad(y, [xl, wl], dy)
    return dx if mask[0] else None, dw if mask[1] else None, dy.sum(_channel_dims(x)) if mask[2] else None


# ---- attention ------------------------------------------------------------------------------
def _qkv(m: Maker, b, h, hkv, lq, lk, e, ev, grad=None):
    return (m.randn(b, h, lq, e, scale=2.0, grad=grad), m.randn(b, hkv, lk, e, grad=grad),
            m.randn(b, hkv, lk, ev, grad=grad))


def attention_samples(dtype, rg):
    m = Maker("attention", dtype, rg)
    yield SampleInput("gqa", 2, (*_qkv(m, 2, 4, 2, 7, 9, 8, 12),), {"enable_gqa": True})
    yield SampleInput("causal", 2, (*_qkv(m, 2, 4, 4, 7, 9, 8, 8),), {"is_causal": True}, aot=True)
    yield SampleInput("gqa-causal", 2, (*_qkv(m, 2, 4, 2, 7, 9, 8, 12),), {"is_causal": True, "enable_gqa": True})
    yield SampleInput("float-mask-scale", 3, (*_qkv(m, 3, 2, 2, 3, 5, 4, 4),),
                      {"attn_mask": m.randn(3, 1, 3, 5, grad=False), "scale": 0.5}, aot=True)
    mask = (torch.rand(1, 2, 4, 4, generator=m.g, device="cpu") < 0.7) | torch.eye(4, dtype=torch.bool)  # no row fully masked
    yield SampleInput("bool-mask-B1", 1, (*_qkv(m, 1, 2, 2, 4, 4, 3, 3), mask))


def attention_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, dtype == F64)
    n, hkv = rng.randint(1, 3), rng.randint(1, 2)
    h = hkv * rng.randint(1, 2)
    e = rng.randint(1, 5)
    kw = {"is_causal": rng.random() < 0.5, "enable_gqa": h != hkv}
    if rng.random() < 0.5:
        kw["scale"] = rng.choice((0.3, 1.0))
    return SampleInput("fuzz", n, _qkv(m, n, h, hkv, rng.randint(1, 6), rng.randint(1, 6), e, rng.randint(1, 5)), kw)


def attention_ref(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)


def small_attention_samples(dtype, rg):
    m = Maker("small_attention", dtype, False)
    yield SampleInput("gqa-scale", 2, (*_qkv(m, 2, 4, 2, 7, 9, 8, 12), False), {"scale": 0.5}, aot=True)
    yield SampleInput("causal-gqa", 2, (*_qkv(m, 2, 4, 2, 7, 9, 8, 12), True), {"scale": 0.5}, aot=True)
    yield SampleInput("causal-B1-long-query", 1, (*_qkv(m, 1, 1, 1, 6, 3, 2, 5), True))


def small_attention_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, False)
    n, hkv = rng.randint(1, 3), rng.randint(1, 2)
    h = hkv * rng.randint(1, 2)
    return SampleInput("fuzz", n, (*_qkv(m, n, h, hkv, rng.randint(1, 6), rng.randint(1, 6), rng.randint(1, 5),
                                         rng.randint(1, 5)), rng.random() < 0.5),
                       {"scale": rng.choice((None, 0.3))})


def small_attention_ref(q, k, v, is_causal=False, *, scale=None):
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                          enable_gqa=q.shape[-3] != k.shape[-3])


# ---- prelu ----------------------------------------------------------------------------------
def prelu_samples(dtype, rg):
    m = Maker("prelu", dtype, rg)
    yield SampleInput("one-slope", 2, (m.randn(2, 4, 3, 5), m.randn(2, 1, scale=0.5)), aot=True)
    yield SampleInput("per-channel-packed", 3, (m.randn(2, 6, 4), m.randn(3, 2, scale=0.5)), {"packed_input": True},
                      packed={0: 2})
    yield SampleInput("shared-B1-2d", 2, (m.randn(2, 1, 3, layout="shared"), m.randn(2, 3, scale=0.5)))


def prelu_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, dtype == F64)
    n, b, c = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 3)
    packed = rng.random() < 0.5
    x = _conv_input(m, n, b, c, _spatial(rng, 0, 2), packed, rng.choice(("contiguous", "sliced")))
    return SampleInput("fuzz", n, (x, m.randn(n, rng.choice((1, c)), scale=0.5)), {"packed_input": packed},
                       packed={0: c} if packed else {})


def prelu_ref(x, w, *, packed_input=False):
    return F.prelu(x, w)


# ---- embeddings -----------------------------------------------------------------------------
def embedding_samples(dtype, rg):
    m = Maker("embedding", dtype, rg)
    # scale_grad_by_freq scales the weight gradient on purpose (and padding_idx zeroes a used row's):
    # not the derivative, so not a gradcheck sample (F.embedding fails gradcheck there too)
    yield SampleInput("padding-sgbf", 3, (m.randn(3, 8, 3), m.ints(8, 3, 2, 4), 2, True, False), aot=True,
                      gradcheck=False)
    yield SampleInput("shared-int32", 2, (m.randn(2, 5, 2), m.ints(5, 2, 3, layout="shared", dtype=torch.int32)))
    yield SampleInput("scalar-index-N1", 1, (m.randn(1, 4, 3), m.ints(4, 1), -1, False, False))


def embedding_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, dtype == F64)
    n, v, d = rng.randint(1, 4), rng.randint(1, 6), rng.randint(1, 3)
    shape = [rng.randint(1, 3) for _ in range(rng.randint(0, 2))]
    return SampleInput("fuzz", n, (m.randn(n, v, d), m.ints(v, n, *shape, layout=rng.choice(NFIRST_LAYOUTS),
                                                            dtype=rng.choice((torch.int64, torch.int32))),
                                   rng.choice((-1, -1, *range(v))), rng.random() < 0.5, False))


def embedding_ref(w, idx, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    return F.embedding(idx, w, None if padding_idx == -1 else padding_idx, scale_grad_by_freq=scale_grad_by_freq)


MODES = {0: "sum", 1: "mean", 2: "max"}


def embedding_bag_samples(dtype, rg):
    m = Maker("embedding_bag", dtype, rg)
    yield SampleInput("mean-shared-offsets-padding", 3, (m.randn(3, 8, 3), m.ints(8, 3, 6), torch.tensor([0, 2, 5]),
                                                         False, 1, False, None, False, 3), same={2}, aot=True)
    # scale_grad_by_freq: not the derivative on purpose, not a gradcheck sample
    yield SampleInput("sum-fixed-bags-psw-sgbf", 2, (m.randn(2, 5, 2), m.ints(5, 2, 3, 2), None, True, 0, False,
                                                     m.randn(2, 3, 2), False, -1), gradcheck=False)
    yield SampleInput("sum-fixed-bags-psw", 2, (m.randn(2, 4, 2), m.ints(4, 2, 2, 3), None, False, 0, False,
                                                m.randn(2, 2, 3), False, -1))
    yield SampleInput("max-per-member-offsets-last", 2, (m.randn(2, 6, 3), m.ints(6, 2, 5),
                                                         torch.tensor([[0, 1, 5], [0, 3, 5]]), False, 2, False, None,
                                                         True, -1))
    yield SampleInput("sum-expanded-offsets-int32-B1", 2, (m.randn(2, 4, 2), m.ints(4, 2, 3, dtype=torch.int32),
                                                           torch.tensor([0], dtype=torch.int32).expand(2, 1), False,
                                                           0, False, None, False, -1))


def embedding_bag_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, dtype == F64)
    n, v, d = rng.randint(1, 4), rng.randint(1, 6), rng.randint(1, 3)
    mode = rng.choice((0, 1, 2))
    idt = rng.choice((torch.int64, torch.int32))
    sgbf = mode != 2 and rng.random() < 0.5
    b = rng.randint(1, 3)
    same, last = set(), False
    if rng.random() < 0.4:
        idx, off = m.ints(v, n, b, rng.randint(1, 3), dtype=idt), None
        shape = tuple(idx.shape)
    else:
        t = rng.randint(0, 6)
        last = rng.random() < 0.5

        def draw():
            o = [0] + sorted(rng.randint(0, t) for _ in range(b - 1))
            return o + [t] if last else o
        form = rng.choice(("shared", "per_member", "expanded"))
        if form == "per_member":
            off = torch.tensor([draw() for _ in range(n)], dtype=idt)
        else:
            off = torch.tensor(draw(), dtype=idt)
            if form == "shared":
                same = {2}
            else:
                off = off.expand(n, -1)
        idx = m.ints(v, n, t, dtype=idt)
        shape = (n, t)
    psw = m.randn(*shape) if mode == 0 and rng.random() < 0.5 else None
    return SampleInput("fuzz", n, (m.randn(n, v, d), idx, off, sgbf, mode, False, psw, last,
                                   rng.choice((-1, -1, *range(v)))), same=frozenset(same))


def embedding_bag_ref(w, idx, offsets=None, scale_grad_by_freq=False, mode=0, sparse=False, per_sample_weights=None,
                      include_last_offset=False, padding_idx=-1):
    return F.embedding_bag(idx, w, offsets, mode=MODES[mode], scale_grad_by_freq=scale_grad_by_freq,
                           per_sample_weights=per_sample_weights, include_last_offset=include_last_offset,
                           padding_idx=None if padding_idx == -1 else padding_idx)


def embedding_renorm_samples(dtype, rg):
    m = Maker("embedding_renorm_", dtype, False)
    yield SampleInput("l2", 3, (m.randn(3, 8, 3, scale=3.0), m.ints(8, 3, 5), 1.0, 2.0), aot=True)
    yield SampleInput("linf-shared-indices", 2, (m.randn(2, 4, 2, scale=3.0), m.ints(4, 2, 2, 3, layout="shared"),
                                                 0.5, math.inf))
    yield SampleInput("l1-N1", 1, (m.randn(1, 3, 4, scale=3.0), m.ints(3, 1, 2), 2.0, 1.0))


def embedding_renorm_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, False)
    n, v, d = rng.randint(1, 4), rng.randint(1, 6), rng.randint(1, 3)
    shape = [rng.randint(1, 3) for _ in range(rng.randint(1, 2))]
    return SampleInput("fuzz", n, (m.randn(n, v, d, scale=1.5), m.ints(v, n, *shape, layout=rng.choice(NFIRST_LAYOUTS)),
                                   rng.choice((0.5, 1.0, 2.0)), rng.choice((1.0, 2.0, 3.0, math.inf))))


def embedding_renorm_ref(w, idx, max_norm, norm_type):
    with torch.no_grad():
        return torch.embedding_renorm_(w, idx, max_norm, norm_type)


# ---- recurrent ------------------------------------------------------------------------------
RNN_MODES = ("LSTM", "GRU", "RNN_TANH", "RNN_RELU")
GATES = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}


def _rnn(m: Maker, desc, n, mode, *, t=3, b=2, i=3, h=4, layers=1, bidirectional=False, batch_first=False,
         has_biases=True, proj=0, states=True, strategy="auto", dropout=0.0, train=False, aot=False) -> SampleInput:
    dirs = 2 if bidirectional else 1
    h_out = proj or h
    g = GATES[mode] * h
    params = []
    for layer in range(layers):
        in_l = i if layer == 0 else h_out * dirs
        for _ in range(dirs):
            params += [m.randn(n, g, in_l, scale=0.4), m.randn(n, g, h_out, scale=0.4)]
            if has_biases:
                params += [m.randn(n, g, scale=0.2), m.randn(n, g, scale=0.2)]
            if proj:
                params.append(m.randn(n, proj, h, scale=0.4))
    x = m.randn(n, b, t, i) if batch_first else m.randn(n, t, b, i)
    hx = []
    if states:
        hx = [m.randn(n, layers * dirs, b, h_out, scale=0.5)]
        if mode == "LSTM":
            hx.append(m.randn(n, layers * dirs, b, h, scale=0.5))
    # Note [wide::rnn]: the loop strategy's parallel backward (MembersInParallel) is not twice
    # differentiable, so its samples stay out of gradcheck (gradgradcheck runs there too).
    return SampleInput(desc, n, (x, hx, params, mode, layers, bidirectional, batch_first, dropout, train, has_biases,
                                 proj), {"strategy": strategy}, gradcheck=strategy != "loop", aot=aot)


def rnn_samples(dtype, rg):
    m = Maker("rnn", dtype, rg)
    yield _rnn(m, "lstm-states", 2, "LSTM", t=2, aot=True)
    yield _rnn(m, "gru-2layers-bidir-zeros", 2, "GRU", layers=2, bidirectional=True, states=False, t=2)
    yield _rnn(m, "lstm-proj-batch_first-B1", 3, "LSTM", proj=2, batch_first=True, b=1, h=3)
    yield _rnn(m, "rnn_tanh-loop", 3, "RNN_TANH", strategy="loop")
    yield _rnn(m, "rnn_relu-no-bias-dropout-eval", 2, "RNN_RELU", has_biases=False, layers=2, dropout=0.5)
    yield _rnn(m, "lstm-loop-bidir-train", 2, "LSTM", bidirectional=True, strategy="loop", train=True, t=2)


def rnn_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, dtype == F64)
    mode, h = rng.choice(RNN_MODES), rng.randint(1, 3)
    return _rnn(m, "fuzz", rng.randint(1, 3), mode, t=rng.randint(1, 3), b=rng.randint(1, 2), i=rng.randint(1, 3),
                h=h, layers=rng.randint(1, 2), bidirectional=rng.random() < 0.5,
                batch_first=rng.random() < 0.5, has_biases=rng.random() < 0.7,
                # nn.LSTM requires proj_size < hidden_size (so does ATen's lstm, by the states' shapes)
                proj=rng.choice((0, 0, 1)) if mode == "LSTM" and h > 1 else 0, states=rng.random() < 0.6,
                strategy=rng.choice(WIDE_OPS["rnn"].choices), train=rng.random() < 0.5)


_RNN_OPS = {"LSTM": torch.lstm, "GRU": torch.gru, "RNN_TANH": torch.rnn_tanh, "RNN_RELU": torch.rnn_relu}


def rnn_ref(x, hx, params, mode, num_layers, bidirectional, batch_first, dropout, train, has_biases, proj_size=0, *,
            strategy="auto"):
    dirs = 2 if bidirectional else 1
    b = x.shape[0 if batch_first else 1]
    h = params[0].shape[0] // GATES[mode]
    if not hx:
        hx = [x.new_zeros(num_layers * dirs, b, proj_size or h)]
        if mode == "LSTM":
            hx.append(x.new_zeros(num_layers * dirs, b, h))
    if mode == "LSTM":
        out, h_n, c_n = torch.lstm(x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)
        return out, [h_n, c_n]
    out, h_n = _RNN_OPS[mode](x, hx[0], params, has_biases, num_layers, dropout, train, bidirectional, batch_first)
    return out, [h_n]


def _cell(m: Maker, desc, n, mode, *, b=2, i=3, h=4, batched=True, states=True, biases=(True, True), aot=False):
    g = GATES[mode] * h
    lead = (n, b) if batched else (n,)
    hx = []
    if states:
        hx = [m.randn(*lead, h, scale=0.5)] + ([m.randn(*lead, h, scale=0.5)] if mode == "LSTM" else [])
    return SampleInput(desc, n, (m.randn(*lead, i), hx, m.randn(n, g, i, scale=0.4), m.randn(n, g, h, scale=0.4),
                                 m.maybe(biases[0], n, g, scale=0.2), m.maybe(biases[1], n, g, scale=0.2)),
                       {"mode": mode}, aot=aot)


def rnn_cell_samples(dtype, rg):
    m = Maker("rnn_cell", dtype, rg)
    yield _cell(m, "lstm", 2, "LSTM", aot=True)
    yield _cell(m, "gru-zeros", 2, "GRU", states=False, i=6, h=5)
    yield _cell(m, "gru-b_hh-only", 3, "GRU", biases=(False, True))
    yield _cell(m, "rnn_tanh-unbatched", 2, "RNN_TANH", batched=False)
    yield _cell(m, "rnn_relu-b_ih-only-B1-N1", 1, "RNN_RELU", b=1, biases=(True, False))


def rnn_cell_fuzz(rng, dtype):
    m = Maker(rng.random(), dtype, dtype == F64)
    return _cell(m, "fuzz", rng.randint(1, 3), rng.choice(RNN_MODES), b=rng.randint(1, 3), i=rng.randint(1, 4),
                 h=rng.randint(1, 4), batched=rng.random() < 0.7, states=rng.random() < 0.6,
                 biases=(rng.random() < 0.7, rng.random() < 0.7))


_CELL_OPS = {"LSTM": torch.lstm_cell, "GRU": torch.gru_cell, "RNN_TANH": torch.rnn_tanh_cell,
             "RNN_RELU": torch.rnn_relu_cell}


def rnn_cell_ref(x, hx, w_ih, w_hh, b_ih=None, b_hh=None, *, mode):
    unbatched = x.dim() == 1
    if unbatched:
        x, hx = x.unsqueeze(0), [s.unsqueeze(0) for s in hx]
    if not hx:
        hx = [x.new_zeros(x.shape[0], w_hh.shape[1])] * (2 if mode == "LSTM" else 1)
    if (b_ih is None) != (b_hh is None):
        # the same cell with a zero bias for the missing one: ATen's fused CUDA cells take both
        # biases or neither (one alone is dropped, or fails with "sym_strides() called on an
        # undefined Tensor")
        b_ih, b_hh = [b if b is not None else torch.zeros_like(b_ih if b_hh is None else b_hh) for b in (b_ih, b_hh)]
    if mode == "LSTM":
        out = list(torch.lstm_cell(x, hx, w_ih, w_hh, b_ih, b_hh))
    else:
        out = [_CELL_OPS[mode](x, hx[0], w_ih, w_hh, b_ih, b_hh)]
    return [o.squeeze(0) for o in out] if unbatched else out


# ---- optimizer steps ------------------------------------------------------------------------
def _opt(m: Maker, n):
    def t(shape=(3, 4)):
        return m.randn(n, *shape, grad=False)

    def sq(shape=(3, 4)):
        return m.pos(n, *shape, lo=0.0, grad=False)

    def hp(lo, hi):
        return torch.linspace(lo, hi, n, dtype=torch.float64)

    def one(v):
        return torch.tensor([v], dtype=torch.float64)
    return t, sq, hp, one


# Where each step op's hyperparameters start (they run to the end of the positional arguments).
HPARAMS_FROM = {"sgd_step": 3, "adam_step": 6, "rmsprop_step": 6, "adagrad_step": 4}


def _opt_sample(op, desc, n, args, kwargs, aot=False):
    """A step op's sample; its ``[1]`` hyperparameters are shared: every member reads the one value."""
    same = frozenset(k for k in range(HPARAMS_FROM[op], len(args)) if args[k].shape == (1,))
    return SampleInput(desc, n, args, kwargs, same=same, aot=aot)


def _opt_samples(op, dtype):
    """A step op's sample maker and the makers of :func:`_opt` for its hand-written samples (N=3)."""
    return functools.partial(_opt_sample, op), _opt(Maker(op, dtype, False), 3)


def _opt_fuzz(op, rng, dtype):
    """What a step op's fuzz case starts from: its sample maker, N (1-3), one parameter shape (0-1
    dims of 1-3) and the makers of :func:`_opt`, all drawn from ``rng``."""
    m = Maker(rng.random(), dtype, False)
    n = rng.randint(1, 4)
    shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(0, 2)))
    return functools.partial(_opt_sample, op), n, shape, _opt(m, n)


def sgd_step_samples(dtype, rg):
    sample = functools.partial(_opt_sample, "sgd_step")
    m = Maker("sgd_step", dtype, False)
    t, _, hp, one = _opt(m, 3)
    yield sample("nesterov-per-member", 3,
                 (t(), t(), t(), hp(0.01, 0.1), hp(0, 0.01), hp(0.5, 0.9), one(0.0)), {"nesterov": True}, aot=True)
    yield sample("maximize-no-buffer", 3,
                 (t(), t(), None, one(0.1), one(0.0), one(0.0), one(0.0)), {"maximize": True}, aot=True)
    yield sample("init-buffer-mixed-momentum-dampening", 3,
                 (t(), t(), t(), one(0.05), one(1e-3), torch.tensor([0.0, 0.9, 0.5], dtype=torch.float64),
                  hp(0.0, 0.2)), {"init_buffer": True})
    t1, _, _, one1 = _opt(m, 1)
    yield sample("N1-1d", 1, (t1((5,)), t1((5,)), t1((5,)), one1(0.1), one1(0.01), one1(0.9), one1(0.1)), {})


def sgd_step_fuzz(rng, dtype):
    sample, n, shape, (t, _, hp, one) = _opt_fuzz("sgd_step", rng, dtype)
    if rng.random() < 0.2:  # wc.optim.SGD passes no buffer only when no member has momentum
        nesterov, momentum, damp, buf = False, one(0.0), hp(0.0, 0.3), None
    else:
        nesterov = rng.random() < 0.3
        momentum = hp(0.1, 0.9) if nesterov or rng.random() < 0.5 else one(rng.choice((0.0, 0.9)))
        damp, buf = one(0.0) if nesterov else hp(0.0, 0.3), t(shape)
    return sample("fuzz", n, (t(shape), t(shape), buf, hp(0.01, 0.1), hp(0.0, 0.01), momentum, damp),
                  {"nesterov": nesterov, "maximize": rng.random() < 0.3,
                   "init_buffer": buf is not None and rng.random() < 0.3})


def sgd_step_ref(p, g, buf, lr, wd, momentum, dampening, *, nesterov=False, maximize=False, init_buffer=False):
    mom = float(momentum)
    assert buf is not None or mom == 0, "sgd_step samples pass a momentum buffer whenever a member has momentum"
    bufs = [None if (buf is None or init_buffer) else buf]
    optim_sgd.sgd([p], [g], bufs, foreach=False, weight_decay=float(wd), momentum=mom, lr=float(lr),
                  dampening=float(dampening), nesterov=nesterov and mom > 0, maximize=maximize)
    if buf is not None and init_buffer and mom != 0:
        buf.copy_(bufs[0])


def adam_step_samples(dtype, rg):
    sample, (t, sq, hp, one) = _opt_samples("adam_step", dtype)
    step = lambda: torch.zeros(3)  # noqa: E731
    yield sample("amsgrad-adamw-per-member", 3,
                 (t(), t(), t(), sq(), sq(), step(), hp(1e-3, 1e-2), one(0.9), hp(0.99, 0.999), one(1e-8),
                  hp(0, 0.1)), {"amsgrad": True, "decoupled_weight_decay": True}, aot=True)
    yield sample("plain", 3,
                 (t(), t(), t(), sq(), None, step(), one(1e-3), one(0.9), one(0.999), one(1e-8), one(0.0)), {},
                 aot=True)
    yield sample("later-step-maximize-l2", 3,
                 (t(), t(), t(), sq(), None, torch.tensor([3.0, 7.0, 1.0]), hp(1e-3, 1e-2), hp(0.8, 0.9),
                  one(0.999), one(1e-6), one(1e-2)), {"maximize": True})


def adam_step_fuzz(rng, dtype):
    sample, n, shape, (t, sq, hp, one) = _opt_fuzz("adam_step", rng, dtype)
    amsgrad = rng.random() < 0.5
    steps = torch.tensor([float(rng.randint(0, 5)) for _ in range(n)])
    return sample("fuzz", n,
                  (t(shape), t(shape), t(shape), sq(shape), sq(shape) if amsgrad else None, steps, hp(1e-3, 1e-2),
                   hp(0.8, 0.9), hp(0.99, 0.999), one(1e-8), hp(0.0, 0.1)),
                  {"amsgrad": amsgrad, "decoupled_weight_decay": rng.random() < 0.5, "maximize": rng.random() < 0.3})


def adam_step_ref(p, g, exp_avg, exp_avg_sq, max_exp_avg_sq, step, lr, beta1, beta2, eps, wd, *,
                  decoupled_weight_decay=False, amsgrad=False, maximize=False):
    optim_adam.adam([p], [g], [exp_avg], [exp_avg_sq], [max_exp_avg_sq] if amsgrad else [], [step.reshape(())],
                    foreach=False, decoupled_weight_decay=decoupled_weight_decay, amsgrad=amsgrad,
                    beta1=float(beta1), beta2=float(beta2), lr=float(lr), weight_decay=float(wd), eps=float(eps),
                    maximize=maximize)


def rmsprop_step_samples(dtype, rg):
    sample, (t, sq, hp, one) = _opt_samples("rmsprop_step", dtype)
    step = lambda: torch.zeros(3)  # noqa: E731
    yield sample("centered-per-member-momentum", 3,
                 (t(), t(), sq() + 1, t() * 0.1, t(), step(), hp(1e-3, 1e-2), one(0.99), one(1e-8), one(0.0),
                  hp(0.0, 0.9)), {"centered": True}, aot=True)
    yield sample("plain-maximize-wd", 3,
                 (t(), t(), sq(), None, None, step(), one(1e-2), hp(0.9, 0.99), one(1e-8), hp(0.0, 0.1), one(0.0)),
                 {"maximize": True})


def rmsprop_step_fuzz(rng, dtype):
    sample, n, shape, (t, sq, hp, one) = _opt_fuzz("rmsprop_step", rng, dtype)
    centered, momentum = rng.random() < 0.5, rng.random() < 0.5
    return sample("fuzz", n,
                  (t(shape), t(shape), sq(shape) + 1, t(shape) * 0.1 if centered else None,
                   t(shape) if momentum else None, torch.zeros(n), hp(1e-3, 1e-2), hp(0.9, 0.99), one(1e-8),
                   hp(0.0, 0.1), hp(0.0, 0.9) if momentum else one(0.0)),
                  {"centered": centered, "maximize": rng.random() < 0.3})


def rmsprop_step_ref(p, g, square_avg, grad_avg, momentum_buffer, step, lr, alpha, eps, wd, momentum, *,
                     centered=False, maximize=False):
    mom = float(momentum)
    optim_rmsprop.rmsprop([p], [g], [square_avg], [grad_avg] if centered else [],
                          [momentum_buffer] if mom > 0 else [], [step.reshape(())], foreach=False,
                          maximize=maximize, lr=float(lr), alpha=float(alpha), eps=float(eps),
                          weight_decay=float(wd), momentum=mom, centered=centered)


def adagrad_step_samples(dtype, rg):
    sample, (t, sq, hp, one) = _opt_samples("adagrad_step", dtype)
    yield sample("maximize-per-member", 3,
                 (t(), t(), sq(), torch.zeros(3), hp(0.01, 0.1), hp(0, 0.1), one(0.0), one(1e-10)),
                 {"maximize": True}, aot=True)
    yield sample("later-step-wd", 3,
                 (t(), t(), sq(), torch.tensor([2.0, 0.0, 5.0]), one(0.1), one(0.01), hp(0.0, 0.1), one(1e-10)), {})


def adagrad_step_fuzz(rng, dtype):
    sample, n, shape, (t, sq, hp, one) = _opt_fuzz("adagrad_step", rng, dtype)
    steps = torch.tensor([float(rng.randint(0, 4)) for _ in range(n)])
    return sample("fuzz", n,
                  (t(shape), t(shape), sq(shape), steps, hp(0.01, 0.1), hp(0.0, 0.1), hp(0.0, 0.1), one(1e-10)),
                  {"maximize": rng.random() < 0.3})


def adagrad_step_ref(p, g, state_sum, step, lr, lr_decay, wd, eps, *, maximize=False):
    optim_adagrad.adagrad([p], [g], [state_sum], [step.reshape(())], foreach=False, lr=float(lr),
                          weight_decay=float(wd), lr_decay=float(lr_decay), eps=float(eps), maximize=maximize)


def _opt_output(out, i, s):
    return None


# --------------------------------------------------------------------------------------------
# The database
# --------------------------------------------------------------------------------------------
def conv_fuzz(rng, dtype):
    return _conv_fuzz(rng, dtype, transposed=False)


def conv_transpose_fuzz(rng, dtype):
    return _conv_fuzz(rng, dtype, transposed=True)


def _identity_member(x):
    """to_packed, to_channels_first: member i's channels of the packed result are member i's input."""
    return x


def _to_nfirst_member(p, n):
    """to_nfirst: member i of the N-first view is member i's channels of the packed input."""
    return p


_NO_GRAD = {"differentiable": False}
_PACKED = {"member_output": member_packed}
_STEP = {"member_output": _opt_output, "differentiable": False}

OPS: list[OpInfo] = [
    OpInfo("linear", linear_samples, linear_fuzz, linear_ref, nograd_samples=4),
    OpInfo("to_packed", to_packed_samples, to_packed_fuzz, _identity_member, **_PACKED),
    OpInfo("to_nfirst", to_nfirst_samples, to_nfirst_fuzz, _to_nfirst_member),
    OpInfo("to_channels_first", to_channels_first_samples, to_channels_first_fuzz, _identity_member, **_PACKED),
    OpInfo("conv", conv_samples, conv_fuzz, conv_ref, **_PACKED),
    OpInfo("conv_transpose", conv_transpose_samples, conv_transpose_fuzz, conv_transpose_ref, **_PACKED),
    OpInfo("batch_norm", batch_norm_samples, batch_norm_fuzz, batch_norm_ref, **_PACKED),
    OpInfo("instance_norm", instance_norm_samples, instance_norm_fuzz, instance_norm_ref, **_PACKED),
    OpInfo("group_norm", group_norm_samples, group_norm_fuzz, group_norm_ref, **_PACKED),
    OpInfo("group_norm_nfirst", group_norm_nfirst_samples, _nfirst_group_norm_fuzz, nfirst_group_norm_ref,
           nograd_samples=4),
    OpInfo("fused_group_norm", fused_group_norm_samples, _nfirst_group_norm_fuzz, nfirst_group_norm_ref, **_NO_GRAD),
    OpInfo("layer_norm", layer_norm_samples, layer_norm_fuzz, layer_norm_ref, nograd_samples=4),
    OpInfo("rms_norm", rms_norm_samples, rms_norm_fuzz, rms_norm_ref, nograd_samples=3),
    OpInfo("add_layer_norm", add_layer_norm_samples, add_layer_norm_fuzz, add_layer_norm_ref, nograd_samples=3),
    OpInfo("fused_norm", fused_norm_samples, fused_norm_fuzz, fused_norm_ref, nograd_samples=4),
    # its outputs are gradients: the gradient tolerance
    OpInfo("fused_norm_backward", fused_norm_backward_samples, fused_norm_backward_fuzz, fused_norm_backward_ref,
           tolerances={(F32, "output"): tolerance(F32, "grad"), (F64, "output"): tolerance(F64, "grad")},
           **_NO_GRAD),
    OpInfo("fused_batch_norm", fused_batch_norm_samples, fused_batch_norm_fuzz, fused_batch_norm_ref,
           member_output=_whole),
    OpInfo("fused_batch_norm_backward", fused_batch_norm_backward_samples, fused_batch_norm_backward_fuzz,
           fused_batch_norm_backward_ref, member_output=_whole,
           tolerances={(F32, "output"): tolerance(F32, "grad"), (F64, "output"): tolerance(F64, "grad")},
           **_NO_GRAD),
    # gradgradcheck: PyTorch has no "derivative for
    # aten::_scaled_dot_product_flash_attention_for_cpu_backward"
    OpInfo("attention", attention_samples, attention_fuzz, attention_ref, gradgradcheck=False, nograd_samples=5),
    OpInfo("small_attention", small_attention_samples, small_attention_fuzz, small_attention_ref, **_NO_GRAD),
    OpInfo("prelu", prelu_samples, prelu_fuzz, prelu_ref, **_PACKED),
    OpInfo("embedding", embedding_samples, embedding_fuzz, embedding_ref),
    OpInfo("embedding_renorm_", embedding_renorm_samples, embedding_renorm_fuzz, embedding_renorm_ref, **_NO_GRAD),
    # gradgradcheck: PyTorch has no "derivative for '_embedding_bag_backward'"
    OpInfo("embedding_bag", embedding_bag_samples, embedding_bag_fuzz, embedding_bag_ref, gradgradcheck=False),
    # the loop strategy is not twice differentiable (Note [wide::rnn]): its samples say gradcheck=False
    OpInfo("rnn", rnn_samples, rnn_fuzz, rnn_ref),
    OpInfo("rnn_cell", rnn_cell_samples, rnn_cell_fuzz, rnn_cell_ref),
    OpInfo("sgd_step", sgd_step_samples, sgd_step_fuzz, sgd_step_ref, **_STEP),
    OpInfo("adam_step", adam_step_samples, adam_step_fuzz, adam_step_ref, **_STEP),
    OpInfo("rmsprop_step", rmsprop_step_samples, rmsprop_step_fuzz, rmsprop_step_ref, **_STEP),
    OpInfo("adagrad_step", adagrad_step_samples, adagrad_step_fuzz, adagrad_step_ref, **_STEP),
]
OP_DB: dict[str, OpInfo] = {op.name: op for op in OPS}

# Schemas that are not tensor operators (build facts, allocator and ISA controls): no samples, no
# reference; test_op_db calls the read-only ones (the allocator and ISA have their own tests).
# name -> what it is.
UTILITY_OPS: dict[str, str] = {
    "_build_info": "build facts of the loaded library (a string)",
    "_caching_scope": "enter/leave the wide caching allocator's scope on this thread",
    "_cache_stats": "the caching allocator's statistics (six ints)",
    "_cache_control": "the caching allocator's limit / release",
    "_cpu_capability": "the hand-written CPU kernels' instruction set (a string)",
    "_optim_cpu_capability": "the same, under its first name (an alias of _cpu_capability)",
}
