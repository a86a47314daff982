"""wide_compiler.blocks: Flux-style member blocks and their hand-built wide forms.

Every wide block is checked against N separate member blocks (different random weights, every
parameter perturbed so norm scales differ too) with check_equivalence: outputs, input gradients
(rope table included) and parameter gradients, member by member."""
from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest
import torch
import wide_compiler as wc
from torch import nn
from wide_compiler import blocks as wb
from wide_compiler.errors import ArchitectureMismatchError
from support import DEVICE
from wide_compiler.testing import (
    assert_trees_members_close,
    check_equivalence,
    stack_inputs,
)


def perturbed(m: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator(DEVICE).manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return m


def sizes(seed: int, **fixed) -> SimpleNamespace:
    """Random (reproducible) sizes; ``fixed`` overrides some."""
    r = random.Random(seed)
    s = {"n": r.randint(1, 4), "b": r.randint(1, 3), "heads": r.randint(1, 3), "head_dim": r.choice([2, 4, 6]),
         "t": r.randint(1, 5), "t_txt": r.randint(1, 4), "ratio": r.choice([1.0, 1.5, 2.0]),
         "qkv_bias": r.random() < 0.5}
    s.update(fixed)
    s["d"] = s["heads"] * s["head_dim"]
    return SimpleNamespace(**s)


def pe_table(s: SimpleNamespace, t: int, g: torch.Generator) -> torch.Tensor:
    """Flux's form [B, 1, T, head_dim/2, 2, 2] at random (non-integer) positions."""
    return wb.rope(10 * torch.rand(s.b, t, generator=g), s.head_dim).unsqueeze(1)


def rand(g: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=g)


# name -> (member class, wide class, member kwargs(s), member inputs(s, g) with the rope table last or None)
CASES = {
    "mlp": (wb.MLP, wb.WideMLP, lambda s: {"hidden_size": s.d, "mlp_ratio": s.ratio},
            lambda s, g: (rand(g, s.b, s.t, s.d),)),
    "attention": (wb.Attention, wb.WideAttention,
                  lambda s: {"hidden_size": s.d, "num_heads": s.heads, "qkv_bias": s.qkv_bias},
                  lambda s, g: (rand(g, s.b, s.t, s.d), pe_table(s, s.t, g))),
    "joint": (wb.JointAttention, wb.WideJointAttention,
              lambda s: {"hidden_size": s.d, "num_heads": s.heads, "qkv_bias": s.qkv_bias},
              lambda s, g: (rand(g, s.b, s.t_txt, s.d), rand(g, s.b, s.t, s.d), pe_table(s, s.t_txt + s.t, g))),
    "double": (wb.DoubleStreamBlock, wb.WideDoubleStreamBlock,
               lambda s: {"hidden_size": s.d, "num_heads": s.heads, "mlp_ratio": s.ratio, "qkv_bias": s.qkv_bias},
               lambda s, g: (rand(g, s.b, s.t, s.d), rand(g, s.b, s.t_txt, s.d), rand(g, s.b, s.d),
                             pe_table(s, s.t_txt + s.t, g))),
    "single": (wb.SingleStreamBlock, wb.WideSingleStreamBlock,
               lambda s: {"hidden_size": s.d, "num_heads": s.heads, "mlp_ratio": s.ratio},
               lambda s, g: (rand(g, s.b, s.t, s.d), rand(g, s.b, s.d), pe_table(s, s.t, g))),
}
HAS_PE = [k for k in CASES if k != "mlp"]

# The wide double-stream block takes its two streams by keyword (a positional pair is refused:
# blocks.py, Note [double-stream argument order]); its inputs are passed by name, to the members
# alike.
KEYWORDS = {"double": ("img", "txt", "vec", "pe")}


def call(name: str, block: nn.Module, args: tuple):
    """``block(*args)``, by keyword where the case's block wants it."""
    names = KEYWORDS.get(name)
    return block(**dict(zip(names, args))) if names else block(*args)


def equivalence(name: str, wide, ms, xs, *, shared: bool = False):
    """check_equivalence of per-member inputs ``xs`` (one member's with ``shared``), passed by
    keyword where the case's block wants it."""
    names = KEYWORDS.get(name)
    if names is None:
        return check_equivalence(wide, ms, xs, shared=shared)
    if shared:
        return check_equivalence(wide, ms, (), kwargs=dict(zip(names, xs)), shared=True)
    return check_equivalence(wide, ms, [()] * len(xs), kwargs=[dict(zip(names, x)) for x in xs])


def members(name: str, s: SimpleNamespace, seed: int = 0, dtype=torch.float32) -> list[nn.Module]:
    member, _, kwargs, _ = CASES[name]
    torch.manual_seed(seed)
    return [perturbed(member(**kwargs(s)).to(dtype), seed * 100 + i) for i in range(s.n)]


def inputs(name: str, s: SimpleNamespace, seed: int = 0) -> list[tuple]:
    g = torch.Generator(DEVICE).manual_seed(seed)
    return [CASES[name][3](s, g) for _ in range(s.n)]


class WithPE(nn.Module):
    """``block(*args, pe)`` with one fixed rope table: a member-shaped table shared by the members."""

    def __init__(self, block: nn.Module, pe: torch.Tensor | None, names: tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.block, self.pe, self.names = block, pe, names

    def forward(self, *args):
        if self.names:  # by keyword (KEYWORDS)
            return self.block(**dict(zip(self.names, (*args, self.pe))))
        return self.block(*args, self.pe)


# --- equivalence -----------------------------------------------------------------------------
MODES = ("own", "shared", "shared_pe", "no_pe")


def check(name: str, s: SimpleNamespace, mode: str, seed: int = 0, strategy: str = "auto"):
    ms = members(name, s, seed)
    wide = CASES[name][1].from_modules(ms, strategy=strategy)
    xs = inputs(name, s, seed)
    if mode == "own":         # per-member inputs; the wide block gets an N-first rope table
        return equivalence(name, wide, ms, xs)
    if mode == "shared":      # one input for all: x.expand(N, ...) everywhere, rope table too
        return equivalence(name, wide, ms, xs[0], shared=True)
    pe = xs[0][-1] if mode == "shared_pe" else None  # per-member inputs, one member-shaped table / none
    names = KEYWORDS.get(name)
    return check_equivalence(WithPE(wide, pe, names), [WithPE(m, pe, names) for m in ms], [x[:-1] for x in xs])


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("name", "mode"), [(name, mode) for name in CASES for mode in MODES
                                            if name in HAS_PE or mode in ("own", "shared")])
def test_wide_block_matches_members(name, mode, seed):
    report = check(name, sizes(seed), mode, seed)
    assert report["param_grad"] is not None and report["input_grad"] is not None


@pytest.mark.parametrize("name", list(CASES))
def test_batch_of_one_and_one_token(name):
    check(name, sizes(7, b=1, t=1, t_txt=1), "own")
    check(name, sizes(8, b=1, n=1), "own")


@pytest.mark.parametrize("strategy", wb.STRATEGIES)
def test_strategies(strategy):
    check("double", sizes(3, n=3), "own", strategy=strategy)
    wide = wb.WideDoubleStreamBlock.from_modules(members("double", sizes(3)), strategy=strategy)
    assert wide.strategy == wide.img_attn.qkv.strategy == wide.img_mlp.fc2.strategy == strategy


def test_rope_is_a_complex_rotation():
    pos, x = 10 * torch.rand(2, 5), torch.randn(2, 3, 5, 8)
    pe = wb.rope(pos, 8, theta=100.0)                                            # [2, 5, 4, 2, 2]
    angle = pos[..., None].double() * 100.0 ** (-torch.arange(0, 8, 2).double() / 8)
    turn = torch.polar(torch.ones_like(angle), angle).cfloat()[:, None]                 # e^(i pos omega)
    want = torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (4, 2)).contiguous()) * turn).flatten(-2)
    torch.testing.assert_close(wb.apply_rope(x, pe[:, None]), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="even"):
        wb.rope(pos, 5)


# --- construction, unfuse, refusals ----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(CASES))
def test_unfuse_round_trip(name, dtype):
    s = sizes(4, n=3)
    ms = members(name, s, dtype=dtype)
    wide = CASES[name][1].from_modules(ms, strategy="loop")
    back = wide.unfuse()
    assert len(back) == 3 and all(type(b) is CASES[name][0] for b in back)
    for i, (m, b) in enumerate(zip(ms, back)):
        for (k, v), (k2, v2) in zip(m.state_dict().items(), b.state_dict().items(), strict=True):
            assert k == k2 and v.dtype == v2.dtype == dtype and torch.equal(v, v2), f"member {i}: {k}"
            assert v2.data_ptr() != wide.state_dict()[k].data_ptr(), "unfuse must copy"
    again = type(wide).from_modules(back, strategy=wide.strategy)
    assert again.state_dict().keys() == wide.state_dict().keys()
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in wide.state_dict().items())
    x = [t.to(dtype) for t in stack_inputs(inputs(name, s))]
    torch.testing.assert_close(call(name, again, x), call(name, wide, x), rtol=0, atol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_constructor_makes_independent_members(name):
    s = sizes(5, n=3)
    wide = CASES[name][1](3, **CASES[name][2](s))
    assert wide.n == 3 and wide.hidden_size == s.d and wide.strategy == "auto"
    first = next(iter(wide.parameters()))
    assert first.shape[0] == 3 and not torch.equal(first[0], first[1])
    equivalence(name, wide, wide.unfuse(), inputs(name, s))


@pytest.mark.parametrize("name", list(CASES))
def test_members_not_mutated(name):
    s = sizes(6, n=2)
    ms = members(name, s)
    before = [copy.deepcopy(m.state_dict()) for m in ms]
    wide = CASES[name][1].from_modules(ms)
    out = call(name, wide, stack_inputs(inputs(name, s)))
    sum(o.sum() for o in (out if isinstance(out, tuple) else (out,))).backward()
    with torch.no_grad():
        for p in wide.parameters():
            p.add_(1.0)
    for m, b in zip(ms, before):
        assert m.training and all(p.grad is None for p in m.parameters())
        assert all(torch.equal(v, b[k]) for k, v in m.state_dict().items())


@pytest.mark.parametrize("name", list(CASES))
def test_mismatched_members_refused(name):
    member, wide_cls, kwargs, _ = CASES[name]
    s = sizes(0, heads=2, head_dim=6, ratio=2.0)
    base = kwargs(s)
    for attr, value in (("hidden_size", 16), ("num_heads", 3), ("mlp_ratio", 1.0), ("qkv_bias", not s.qkv_bias)):
        if attr in base:
            ms = [member(**base), member(**base), member(**dict(base, **{attr: value}))]
            with pytest.raises(ArchitectureMismatchError, match=rf"member 2: {attr} is {value}, member 0 has"):
                wide_cls.from_modules(ms)
    with pytest.raises(ArchitectureMismatchError, match=rf"member 1: expected {member.__name__}, got Linear"):
        wide_cls.from_modules([member(**base), nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="at least one"):
        wide_cls.from_modules([])


def test_mismatched_submodule_named():
    ms = members("double", sizes(0, n=2))
    ms[1].img_mlp.fc1 = nn.Linear(ms[1].hidden_size, 3)
    with pytest.raises(ArchitectureMismatchError, match=r"img_mlp: fc1: member 1: out_features is 3"):
        wb.WideDoubleStreamBlock.from_modules(ms)
    ms[1].img_mlp.fc1, ms[1].img_mlp.act = ms[0].img_mlp.fc1, nn.GELU()
    with pytest.raises(ArchitectureMismatchError, match=r"img_mlp: act: member 1: GELU"):
        wb.WideDoubleStreamBlock.from_modules(ms)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_strategy_refused(name):
    member, wide_cls, kwargs, _ = CASES[name]
    kw = kwargs(sizes(0))
    with pytest.raises(ValueError, match=rf"{wide_cls.__name__}: expected strategy .* got 'nonsense'"):
        wide_cls.from_modules([member(**kw)], strategy="nonsense")
    with pytest.raises(ValueError, match="'nonsense'"):
        wide_cls(2, **kw, strategy="nonsense")
    with pytest.raises(ValueError, match="n >= 1"):
        wide_cls(0, **kw)


# --- the automatic path agrees with the hand-built one ---------------------------------------
class Tiny(nn.Module):
    """A double-stream block followed by a single-stream block over [txt, img], as in Flux."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.dbl = wb.DoubleStreamBlock(d, heads, mlp_ratio=2.0, qkv_bias=True)
        self.single = wb.SingleStreamBlock(d, heads, mlp_ratio=2.0)

    def forward(self, img, txt, vec, pe):
        img, txt = self.dbl(img, txt, vec, pe)
        return self.single(torch.cat((txt, img), dim=-2), vec, pe)


def test_compile_matches_hand_built_blocks():
    s = sizes(9, n=3, b=2, heads=2, head_dim=4)
    torch.manual_seed(0)
    ms = [perturbed(Tiny(s.d, s.heads), i) for i in range(s.n)]
    g = torch.Generator(DEVICE).manual_seed(0)
    img, txt, vec = rand(g, s.n, s.b, s.t, s.d), rand(g, s.n, s.b, s.t_txt, s.d), rand(g, s.n, s.b, s.d)
    pe = pe_table(s, s.t_txt + s.t, g)
    wide = wc.compile(ms, (img[0], txt[0], vec[0], pe), config=wc.WideConfig.fast())
    got = wide(img, txt, vec, pe.expand(s.n, *pe.shape))
    dbl = wb.WideDoubleStreamBlock.from_modules([m.dbl for m in ms])
    single = wb.WideSingleStreamBlock.from_modules([m.single for m in ms])
    i2, t2 = dbl(img=img, txt=txt, vec=vec, pe=pe)
    want = single(torch.cat((t2, i2), dim=-2), vec, pe)
    torch.testing.assert_close(got, want)
    assert_trees_members_close(want, [m(img[i], txt[i], vec[i], pe) for i, m in enumerate(ms)])
