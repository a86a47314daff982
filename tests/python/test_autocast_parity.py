"""Autocast parity, op by op, from ATen's own lists: for every op that ATen's CPU autocast casts
(the ops with a kernel for the ``AutocastCPU`` dispatch key, read from the dispatcher at run
time: its lower-precision, float32 and promote lists) and that a widen rule handles, the wide
form under ``torch.autocast("cpu", torch.bfloat16)`` returns each member's dtype and values
(bfloat16 tolerance for a bfloat16 result, float32's for a float32 one: a float32 result
computed from values rounded to bfloat16 where the member's were not is caught).

The ops ATen does not list whose wide form is built of listed ops (``mv``, ``dot``, ``vdot``: a
batched matmul), and the listed and unlisted ops that reach the per-op fallback (``addmv``,
``addbmm``, ``addr``), are cases too; where the member raises (mixed dtypes), the wide model
must too. Each op runs on a float32 activation and on a bfloat16 one (``x @ I``, which autocast
computes in bfloat16: a listed op's casts differ between them), and takes a parameter operand
where it has one (the issue-44 cases: ``addmm(bias, x, weight)``).

Note [wide autocast] in csrc/wide/ops/autocast.cpp covers the wide ops' kernels; Note [Autocast
parity of widened ops] in fx/rules/matmul.py the aten-level forms."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
import wide_compiler as wc
from torch import nn
from wide_compiler.fx.table import RULES
from wide_compiler.testing import assert_members_close

N = 2
BF16 = torch.bfloat16
FAST = wc.WideConfig.fast()
aten = torch.ops.aten


def aten_cpu_autocast_ops() -> set[str]:
    """The ops ATen's CPU autocast casts, as ``"aten::name"`` / ``"aten::name.overload"``: those
    with a kernel registered for the AutocastCPU key (every other op falls through it)."""
    return set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"))


def _schema_name(op) -> str | None:
    schema = getattr(op, "_schema", None)
    if schema is None:
        return None
    return schema.name + (f".{schema.overload_name}" if schema.overload_name else "")


def listed_rule_ops() -> dict[str, object]:
    """``{"aten::name[.overload]": RULES key}`` for the rule-table rows ATen's CPU autocast lists."""
    listed = aten_cpu_autocast_ops()
    return {name: op for op in RULES if (name := _schema_name(op)) in listed}


@dataclasses.dataclass(frozen=True)
class Case:
    fn: Callable  # (module, x) -> output; the module holds `p` (and `q`), parameters
    shape: tuple  # one member's input
    params: dict  # name -> shape
    reaches: tuple = ()  # RULES keys the case must reach (the op itself when it is a row)


class _Op(nn.Module):
    def __init__(self, case: Case, lowp: bool):
        super().__init__()
        self.case, self.lowp = case, lowp
        for name, shape in case.params.items():
            setattr(self, name, nn.Parameter(torch.randn(shape) / max(shape[-1], 1) ** 0.5))
        if lowp:  # x @ I: bfloat16 under autocast (matmul is listed), float32 outside
            self.eye = nn.Parameter(torch.eye(case.shape[-1]))

    def forward(self, x):
        return self.case.fn(self, torch.matmul(x, self.eye) if self.lowp else x)


def _conv(cls, *args, **kwargs):
    class Conv(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = cls(*args, **kwargs)

        def forward(self, x):
            return self.conv(x)

    return Conv


# The ops of ATen's CPU list that the widen rules handle (checked complete below), then the others.
CASES: dict[str, Case] = {
    "aten::addmm": Case(lambda m, x: torch.addmm(m.q, x, m.p), (3, 4), {"p": (4, 5), "q": (5,)}),
    "aten::baddbmm": Case(lambda m, x: torch.baddbmm(m.q, x, m.p, beta=0.5, alpha=2.0), (2, 3, 4),
                          {"p": (2, 4, 5), "q": (3, 5)}),
    "aten::bmm": Case(lambda m, x: torch.bmm(x, m.p), (2, 3, 4), {"p": (2, 4, 5)}),
    "aten::mm": Case(lambda m, x: torch.mm(x, m.p), (3, 4), {"p": (4, 5)}),
    "aten::matmul": Case(lambda m, x: torch.matmul(x, m.p), (2, 3, 4), {"p": (4, 5)}),
    "aten::linear": Case(lambda m, x: F.linear(x, m.p, m.q), (3, 4), {"p": (5, 4), "q": (5,)}),
    "aten::prelu": Case(lambda m, x: F.prelu(x, m.p), (2, 3, 4), {"p": (3,)}),
    "aten::scaled_dot_product_attention": Case(
        lambda m, x: F.scaled_dot_product_attention(x, x * m.p, x), (2, 3, 4), {"p": (4,)}),
    "aten::conv1d": Case(lambda m, x: F.conv1d(x, m.p, m.q), (2, 3, 6), {"p": (4, 3, 3), "q": (4,)}),
    "aten::conv1d.padding": Case(lambda m, x: F.conv1d(x, m.p, padding="same"), (2, 3, 6), {"p": (4, 3, 3)}),
    "aten::conv2d": Case(lambda m, x: F.conv2d(x, m.p, m.q), (2, 3, 5, 5), {"p": (4, 3, 3, 3), "q": (4,)}),
    "aten::conv2d.padding": Case(lambda m, x: F.conv2d(x, m.p, padding="same"), (2, 3, 5, 5),
                                 {"p": (4, 3, 3, 3)}),
    "aten::conv3d": Case(lambda m, x: F.conv3d(x, m.p), (1, 2, 4, 4, 4), {"p": (3, 2, 2, 2, 2)}),
    "aten::conv3d.padding": Case(lambda m, x: F.conv3d(x, m.p, padding="same"), (1, 2, 4, 4, 4),
                                 {"p": (3, 2, 3, 3, 3)}),
    "aten::conv_transpose1d": Case(lambda m, x: F.conv_transpose1d(x, m.p, m.q), (2, 3, 5),
                                   {"p": (3, 4, 3), "q": (4,)}),
    "aten::conv_transpose2d.input": Case(lambda m, x: F.conv_transpose2d(x, m.p), (2, 3, 4, 4), {"p": (3, 4, 3, 3)}),
    "aten::conv_transpose3d.input": Case(lambda m, x: F.conv_transpose3d(x, m.p), (1, 2, 3, 3, 3),
                                         {"p": (2, 3, 2, 2, 2)}),
    "aten::avg_pool3d": Case(lambda m, x: F.avg_pool3d(x * m.p, 2), (1, 2, 4, 4, 4), {"p": (4,)}),
    "aten::max_pool3d": Case(lambda m, x: F.max_pool3d(x * m.p, 2), (1, 2, 4, 4, 4), {"p": (4,)}),
    "aten::adaptive_avg_pool3d": Case(lambda m, x: F.adaptive_avg_pool3d(x * m.p, 2), (1, 2, 4, 4, 4), {"p": (4,)}),
    "aten::adaptive_max_pool3d": Case(lambda m, x: F.adaptive_max_pool3d(x * m.p, 2), (1, 2, 4, 4, 4), {"p": (4,)}),
    "aten::prod": Case(lambda m, x: (x * m.p).prod(), (3, 4), {"p": (4,)}),
    "aten::prod.dim_int": Case(lambda m, x: (x * m.p).prod(-1), (3, 4), {"p": (4,)}),
    "aten::cat": Case(lambda m, x: torch.cat([x, m.p.expand(3, 2)], dim=-1), (3, 4), {"p": (2,)}),
    "aten::stack": Case(lambda m, x: torch.stack([x, m.p.expand(3, 4)]), (3, 4), {"p": (4,)}),
    "aten::index_copy": Case(lambda m, x: x.index_copy(0, torch.tensor([2, 0]), m.p), (3, 4), {"p": (2, 4)}),
    # not listed on the CPU: the member computes in its inputs' dtype
    "aten::mv": Case(lambda m, x: torch.mv(m.p, x), (4,), {"p": (3, 4)}),
    "aten::dot": Case(lambda m, x: torch.dot(x, m.p), (4,), {"p": (4,)}),
    "aten::vdot": Case(lambda m, x: torch.vdot(x, m.p), (4,), {"p": (4,)}),
    "aten::outer": Case(lambda m, x: torch.outer(x, m.p), (4,), {"p": (3,)}),
    "aten::einsum": Case(lambda m, x: torch.einsum("bij,jk->bik", x, m.p), (2, 3, 4), {"p": (4, 5)}),
    # reach the per-op fallback (no rule): listed (addbmm) and not (addmv, addr)
    "aten::addmv": Case(lambda m, x: torch.addmv(m.q, m.p, x), (4,), {"p": (3, 4), "q": (3,)}),
    "aten::addbmm": Case(lambda m, x: torch.addbmm(m.q, x, m.p), (2, 3, 4), {"p": (2, 4, 5), "q": (3, 5)}),
    "aten::addr": Case(lambda m, x: torch.addr(m.q, x, m.p), (4,), {"p": (3,), "q": (4, 3)}),
}


def test_every_listed_op_with_a_rule_has_a_case():
    """ATen's CPU autocast list, intersected with the rule table, is covered: a new rule row for a
    listed op (or an op newly listed by ATen) fails here until it has a case."""
    listed = listed_rule_ops()
    assert "aten::addmm" in listed and "aten::conv2d" in listed, sorted(listed)  # the list was read
    missing = sorted(set(listed) - set(CASES))
    assert not missing, f"ops ATen's CPU autocast casts that a widen rule handles, with no case here: {missing}"


def _rule_row(name: str):
    packet, _, overload = name.removeprefix("aten::").partition(".")
    op = getattr(getattr(aten, packet), overload or "default")
    return op if op in RULES else None


def _members(case: Case, lowp: bool) -> list[nn.Module]:
    out = []
    for i in range(N):
        torch.manual_seed(10 + i)
        out.append(_Op(case, lowp))
    return out


@pytest.mark.parametrize("lowp", [False, True], ids=["f32_activation", "bf16_activation"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_wide_form_under_autocast_matches_the_member(name, lowp):
    case = CASES[name]
    models = _members(case, lowp)
    torch.manual_seed(0)
    wide = wc.compile(models, torch.randn(case.shape), config=FAST.replace(strict=False))
    row = _rule_row(name)
    if row is not None:
        assert row in wide._graph_for(wide.training).rules_used, f"{name}: the case no longer reaches its rule"
    xs = torch.randn(N, *case.shape)
    with torch.autocast("cpu", dtype=BF16):
        try:
            refs = [m(xs[i]) for i, m in enumerate(models)]
        except RuntimeError as e:  # an unlisted op given mixed dtypes: the member alone raises
            with pytest.raises(RuntimeError):
                wide(xs)
            assert "dtype" in str(e) or "type" in str(e), e
            return
        out = wide(xs)
    assert out.dtype == refs[0].dtype, f"{name}: the wide form returns {out.dtype}, the member {refs[0].dtype}"
    # each result at its own dtype's tolerance: a float32 result rounded to bfloat16 on the way fails
    assert_members_close(out, refs, what=f"{name} under autocast")
