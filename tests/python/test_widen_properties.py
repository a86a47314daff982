"""Property tests of the widen pass's shape-op and dim-taking rules (tracker issue 3).

Hypothesis draws a member shape and the op arguments (permutations, dims written positive or
negative, reshape targets, slices, cat dims, reduction dims with keepdim, broadcast shapes of
per-member parameters); the wide model must equal the N separate members (outputs, input grads,
parameter grads). Each example compiles one small model that applies 1-3 drawn ops to the same
activation, so the suite stays quick. Runs are derandomized (reproducible in CI);
``WIDE_PROPERTY_EXAMPLES=K`` runs K random examples per property instead.
"""
from __future__ import annotations

import math
import os

import torch
import wide_compiler as wc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from wide_compiler.testing import check_equivalence

N = 3
FAST_STRICT = wc.WideConfig.fast().replace(strict=True)  # every op needs a rule; no timing


def compile_wide(models, sample):
    return wc.compile(models, sample, config=FAST_STRICT)
# WIDE_PROPERTY_EXAMPLES=500 explores more (and randomly) when hunting for bugs.
_EXAMPLES = os.environ.get("WIDE_PROPERTY_EXAMPLES")
PROPERTY_SETTINGS = settings(
    max_examples=int(_EXAMPLES or 20), deadline=None, derandomize=_EXAMPLES is None, print_blob=True,
    # The conftest's autouse fixtures (cache dir, dtype guard) are safe to share between examples.
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


class Prop(nn.Module):
    """h = x * w + b with per-member w (the member's full feature shape) and b; returns fn(h, x)."""

    def __init__(self, shape, fn):
        super().__init__()
        self.fn = fn
        self.w = nn.Parameter(torch.randn(shape[1:]) if len(shape) > 1 else torch.randn(()))
        self.b = nn.Parameter(torch.randn(shape[-1]))

    def forward(self, x):
        return self.fn(x * self.w + self.b, x)


def check_property(shape, fn, *, call_batch: int | None = None, seed: int = 0):
    """Compile N members of Prop(shape, fn) (strict: every op needs a rule) and compare them on
    per-member inputs of ``shape`` (batch changed to ``call_batch`` when given)."""
    torch.manual_seed(seed)
    models = [Prop(shape, fn) for _ in range(N)]
    wide = compile_wide(models, torch.randn(*shape))
    x_input = next(i for i in wide._graph_for(wide.training).inputs if i.kind == "user")
    if x_input.member_shape and x_input.member_shape[0] is not None:
        call_batch = None  # export fixed the batch (reshape(2, -1) of a batch of 2): the sample's
    call = tuple(shape) if call_batch is None or len(shape) < 2 else (call_batch, *shape[1:])
    per_member = [torch.randn(*call) for _ in range(N)]
    return check_equivalence(wide, models, per_member).wide_output


# --- strategies ---------------------------------------------------------------------------
# Member shapes [B, d1, ...]: the batch B is dim 0 (dynamic); feature dims are 2..4 so that no
# size-1 dim is squeezed away by accident.
shapes = st.lists(st.integers(2, 4), min_size=1, max_size=4).map(tuple)


def dim_of(draw, rank: int, *, extra: int = 0) -> int:
    """A dim index of a rank-``rank`` tensor (``extra`` more for stack/unsqueeze), written
    positive or negative."""
    d = draw(st.integers(0, rank - 1 + extra))
    return d - (rank + extra) if draw(st.booleans()) else d


# --- properties -----------------------------------------------------------------------------
@PROPERTY_SETTINGS
@given(shape=shapes, data=st.data())
def test_permute_and_transpose(shape, data):
    r = len(shape)
    perm = data.draw(st.permutations(range(r)))
    perm = [p - r if data.draw(st.booleans()) else p for p in perm]
    d0, d1 = dim_of(data.draw, r), dim_of(data.draw, r)
    src, dst = dim_of(data.draw, r), dim_of(data.draw, r)
    fn = lambda h, x: (h.permute(*perm), h.transpose(d0, d1), h.movedim(src, dst))
    check_property(shape, fn, call_batch=shape[0] + 1)


def _factorizations(draw, total: int) -> list[int]:
    """A random list of factors whose product is ``total`` (with 1s sprinkled in)."""
    sizes, rest = [], total
    while rest > 1:
        divisors = [d for d in range(2, rest + 1) if rest % d == 0]
        d = draw(st.sampled_from(divisors))
        sizes.append(d)
        rest //= d
    if draw(st.booleans()):
        sizes.insert(draw(st.integers(0, len(sizes))), 1)
    return sizes


@PROPERTY_SETTINGS
@given(shape=shapes.filter(lambda s: len(s) >= 2), data=st.data())
def test_reshape_view_flatten_unflatten(shape, data):
    r = len(shape)
    rest = _factorizations(data.draw, math.prod(shape[1:]))
    pos = data.draw(st.integers(0, len(rest)))
    batch_as = data.draw(st.sampled_from(["-1", "size0"]))
    method = data.draw(st.sampled_from(["reshape", "view"]))
    start = data.draw(st.integers(0, r - 1))
    end = data.draw(st.integers(start, r - 1))
    start_w = start - r if data.draw(st.booleans()) else start
    end_w = end - r if data.draw(st.booleans()) else end
    ud = data.draw(st.integers(1, r - 1))  # unflatten a feature dim into (2?, rest)
    factors = _factorizations(data.draw, shape[ud]) or [1]
    ud_w = ud - r if data.draw(st.booleans()) else ud

    def fn(h, x):
        target = list(rest)
        target.insert(pos, -1 if batch_as == "-1" else x.size(0))
        return (getattr(h, method)(*target), h.flatten(start_w, end_w),
                h.unflatten(ud_w, factors))

    check_property(shape, fn, call_batch=shape[0] + 2)


@PROPERTY_SETTINGS
@given(shape=shapes, data=st.data())
def test_slicing_narrow_select(shape, data):
    r = len(shape)
    d = data.draw(st.integers(0, r - 1))
    size = shape[d] if d > 0 else 2  # the batch may change: slice it within its smallest size
    start = data.draw(st.integers(-size, size - 1))
    stop = data.draw(st.one_of(st.none(), st.integers(-size, size)))
    step = data.draw(st.integers(1, 3))
    ellipsis = data.draw(st.booleans())
    nd = data.draw(st.integers(0, r - 1))
    nsize = shape[nd] if nd > 0 else 2
    nstart = data.draw(st.integers(0, nsize - 1))
    nlen = data.draw(st.integers(0, nsize - nstart))
    nd_w = nd - r if data.draw(st.booleans()) else nd
    sd = dim_of(data.draw, r)
    index = data.draw(st.integers(-min(shape[sd % r], 2) if sd % r == 0 else -shape[sd % r],
                                  (min(shape[sd % r], 2) if sd % r == 0 else shape[sd % r]) - 1))

    def fn(h, x):
        if ellipsis:
            key = (Ellipsis, slice(start, stop, step)) + (slice(None),) * (r - 1 - d)
        else:
            key = (slice(None),) * d + (slice(start, stop, step),)
        return h[key], h.narrow(nd_w, nstart, nlen), h.select(sd, index), h[..., None, :]

    check_property(shape, fn, call_batch=max(2, shape[0]) + 1 if shape[0] >= 2 else None)


@PROPERTY_SETTINGS
@given(shape=shapes, data=st.data())
def test_cat_stack_split_chunk_unbind(shape, data):
    r = len(shape)
    cd, sd = dim_of(data.draw, r), dim_of(data.draw, r, extra=1)
    pd = data.draw(st.integers(1, r - 1)) if r > 1 else 0
    pd_w = pd - r if data.draw(st.booleans()) else pd
    split = data.draw(st.integers(1, shape[pd]))
    chunks = data.draw(st.integers(1, shape[pd]))
    ud = data.draw(st.integers(1, r - 1)) if r > 1 else 0

    def fn(h, x):
        return (torch.cat([h, x * 3, h * h], cd), torch.stack([h, x], sd),
                h.split(split, pd_w), h.chunk(chunks, pd_w), h.unbind(ud))

    check_property(shape, fn, call_batch=None if r == 1 else shape[0] + 1)


REDUCTIONS = {
    # name: (callable(h, dims, keepdim), dims kind): "list" = several dims or None, "one" = one int,
    # "one-or-none" = one int or None
    "sum": (lambda h, d, k: h.sum() if d is None else h.sum(d, keepdim=k), "list"),
    "mean": (lambda h, d, k: h.mean() if d is None else h.mean(d, keepdim=k), "list"),
    "amax": (lambda h, d, k: h.amax(() if d is None else d, keepdim=k), "list"),
    "amin": (lambda h, d, k: h.amin(() if d is None else d, keepdim=k), "list"),
    "var": (lambda h, d, k: h.var(d, keepdim=k), "list"),
    "std-biased": (lambda h, d, k: h.std(d, correction=0, keepdim=k), "list"),
    "logsumexp": (lambda h, d, k: torch.logsumexp(h, d, keepdim=k), "list-not-none"),
    "norm": (lambda h, d, k: torch.linalg.vector_norm(h, 2, d, keepdim=k), "list"),
    "argmax": (lambda h, d, k: h.argmax(d, keepdim=k), "one-or-none"),
    "argmin": (lambda h, d, k: h.argmin(d, keepdim=k), "one-or-none"),
    "max-dim": (lambda h, d, k: h.max(d, keepdim=k), "one"),
    "prod": (lambda h, d, k: h.prod(d, keepdim=k), "one"),
    "softmax": (lambda h, d, k: h.softmax(d), "one"),
    "log_softmax": (lambda h, d, k: h.log_softmax(d), "one"),
    "cumsum": (lambda h, d, k: h.cumsum(d), "one"),
    "flip": (lambda h, d, k: h.flip(d), "list-not-none"),
    "roll": (lambda h, d, k: h.roll(2, d), "one"),
    "squeeze-unsqueeze": (lambda h, d, k: h.unsqueeze(d).squeeze(d), "one"),
    "sort": (lambda h, d, k: h.sort(d, descending=k), "one"),
}


@PROPERTY_SETTINGS
@given(shape=shapes, data=st.data())
def test_reductions_and_dim_ops(shape, data):
    r = len(shape)
    ops = data.draw(st.lists(st.sampled_from(sorted(REDUCTIONS)), min_size=1, max_size=3))
    drawn = []
    for name in ops:
        fn, kind = REDUCTIONS[name]
        keepdim = data.draw(st.booleans())
        if kind == "one" or (kind == "one-or-none" and data.draw(st.booleans())):
            dims = dim_of(data.draw, r)
        elif kind == "one-or-none" or (kind == "list" and data.draw(st.booleans())):
            dims = None
        else:
            chosen = data.draw(st.lists(st.integers(0, r - 1), min_size=1, max_size=r, unique=True))
            dims = [d - r if data.draw(st.booleans()) else d for d in chosen]
        drawn.append((name, fn, dims, keepdim))

    def model_fn(h, x):
        return {f"{k}:{name}{dims}{keepdim}": fn(h, dims, keepdim)
                for k, (name, fn, dims, keepdim) in enumerate(drawn)}

    check_property(shape, model_fn, call_batch=None if r == 1 else shape[0] + 1)


BINARY_OPS = {"add": torch.add, "mul": torch.mul, "sub": torch.sub, "div": torch.div,
              "maximum": torch.maximum, "where": lambda a, b: torch.where(a > 0, a, b)}


class Bcast(nn.Module):
    """h = x * w + b, then ``op`` between h and a per-member parameter q of shape ``pshape``."""

    def __init__(self, shape, pshape, op, param_first, reduce_back):
        super().__init__()
        self.w = nn.Parameter(torch.randn(shape[1:]) if len(shape) > 1 else torch.randn(()))
        self.b = nn.Parameter(torch.randn(shape[-1]))
        self.q = nn.Parameter(torch.randn(pshape))
        self.op, self.param_first, self.reduce_back = op, param_first, reduce_back

    def forward(self, x):
        h = x * self.w + self.b
        a, b = (self.q, h) if self.param_first else (h, self.q)
        if self.op == "div":
            b = b.abs() + 0.5
        out = BINARY_OPS[self.op](a, b)
        if self.reduce_back:  # activation-vs-activation broadcasting too
            out = out - out.mean(dim=-1, keepdim=True)
        return out


@PROPERTY_SETTINGS
@given(shape=shapes, data=st.data())
def test_broadcasting_against_per_member_parameters(shape, data):
    """A per-member parameter whose shape broadcasts against the activation: it covers the last
    k dims (some set to 1; never the batch's size), with an extra leading dim when k covers all
    dims (the result then has more dims than the activation), on either side of the op."""
    r = len(shape)
    k = data.draw(st.integers(0, r))
    suffix = [1 if data.draw(st.booleans()) else s for s in shape[r - k:]]
    if k == r:
        suffix[0] = 1  # the batch dim
    lead = data.draw(st.lists(st.integers(2, 3), max_size=1)) if k == r else []
    pshape = tuple(lead + suffix)
    op = data.draw(st.sampled_from(sorted(BINARY_OPS)))
    param_first, reduce_back = data.draw(st.booleans()), data.draw(st.booleans())
    torch.manual_seed(0)
    models = [Bcast(shape, pshape, op, param_first, reduce_back) for _ in range(N)]
    wide = compile_wide(models, torch.randn(*shape))
    call = shape if r == 1 else (shape[0] + 1, *shape[1:])
    per_member = [torch.randn(*call) for _ in range(N)]
    check_equivalence(wide, models, per_member)
