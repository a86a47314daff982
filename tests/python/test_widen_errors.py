"""Never silently wrong (tracker issue 3, DESIGN §4): members that are not the same program are
rejected, ops with no rule run through a correct, reported per-member fallback (or raise under
strict=True), random ops draw per member, and an unexportable forward fails with export's reason
and advice.
"""
from __future__ import annotations

import copy
import dataclasses
import inspect
import re
import warnings

import pytest
import torch
import wide_compiler as wc
from support import LinearModel
from torch import nn
from wide_compiler.testing import check_equivalence, make_members

FAST = wc.WideConfig.fast()  # no timing at compile time



def compile_wide(models, sample, *, strict: bool = True, config: wc.WideConfig = FAST, **kwargs):
    return wc.compile(models, sample, config=config.replace(strict=strict or config.strict), **kwargs)

THIS_FILE = "test_widen_errors.py"


def marked_line(fn, marker: str) -> int:
    """The line number of the source line of ``fn`` that carries ``# marker``."""
    lines, start = inspect.getsourcelines(fn)
    return start + next(k for k, line in enumerate(lines) if f"# {marker}" in line)


# ---------------------------------------------------------------------------------------------
# Members that differ
# ---------------------------------------------------------------------------------------------
class Signed(LinearModel):
    linears, fields = {"fc": (5, 3)}, ("sign",)

    def forward(self, x):
        return self.fc(x).softmax(dim=1) * self.sign


def test_a_python_attribute_that_differs_is_a_mismatch():
    models = [Signed(1), Signed(1), Signed(1), Signed(-1)]
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 3: sign is -1, member 0 has 1") as info:
        compile_wide(models, torch.randn(4, 5))
    assert isinstance(info.value, ValueError)
    # Equal attributes are fine, and the members are really run (not member 0 for all).
    good = [Signed(-1) for _ in range(3)]
    wide = compile_wide(good, torch.randn(4, 5))
    check_equivalence(wide, good, [torch.randn(6, 5) for _ in range(3)])


@dataclasses.dataclass
class Settings:
    name: str
    sign: float = dataclasses.field(compare=False)  # not part of equality: invisible to the check


class HiddenSign(nn.Module):
    """The member's sign lives in a config object whose __eq__ ignores it: only the traced
    programs differ."""

    def __init__(self, sign):
        super().__init__()
        self.fc = nn.Linear(5, 3)
        self.settings = Settings("run", sign)

    def forward(self, x):
        return self.fc(x) * self.settings.sign  # HIDDEN-SIGN


def test_trace_members_catches_a_difference_only_the_trace_shows():
    models = [HiddenSign(1.0), HiddenSign(1.0), HiddenSign(-1.0)]
    assert models[0].settings == models[2].settings  # the attribute check cannot tell them apart
    with pytest.raises(wc.ArchitectureMismatchError) as info:
        compile_wide(models, torch.randn(4, 5), config=FAST.replace(trace_members=True, run_members=False))
    msg = str(info.value)
    assert "member 2" in msg and "traced program" in msg, msg
    assert "node 'mul'" in msg, msg  # names the node ...
    assert f"{THIS_FILE}:{marked_line(HiddenSign.forward, 'HIDDEN-SIGN')}" in msg, msg  # ... and line
    assert "-1.0" in msg and "1.0" in msg, msg


def test_running_the_members_catches_it_by_default_and_names_the_line():
    models = [HiddenSign(1.0), HiddenSign(1.0), HiddenSign(-1.0)]
    with pytest.raises(wc.ArchitectureMismatchError) as info:
        compile_wide(models, torch.randn(4, 5))
    msg = str(info.value)
    assert "member 2: its forward runs a different program" in msg, msg
    assert f"{THIS_FILE}:{marked_line(HiddenSign.forward, 'HIDDEN-SIGN')}" in msg, msg
    assert "-1.0" in msg and "1.0" in msg, msg


def test_trace_members_passes_on_identical_programs():
    models = make_members(lambda: HiddenSign(2.0), 3)
    wide = compile_wide(models, torch.randn(4, 5), config=FAST.replace(trace_members=True))
    check_equivalence(wide, models, [torch.randn(6, 5) for _ in range(3)])
    # The debug and safe presets trace members too.
    assert wc.WideConfig.debug().trace_members and wc.WideConfig.safe().trace_members


# ---------------------------------------------------------------------------------------------
# Ops with no rule: per-member fallback, reported; strict=True raises
# ---------------------------------------------------------------------------------------------
class NoRule(LinearModel):
    linears = {"fc": (5, 4)}

    def forward(self, x):
        h = self.fc(x)
        a = torch.cdist(h, h)  # CDIST
        b = torch.kron(h, torch.ones(2, 1))  # KRON
        c = torch.linalg.det(h.view(-1, 2, 2))  # DET
        d = torch.special.erfinv(torch.tanh(h) * 0.9)  # ERFINV
        return a.sum(-1) + c.unsqueeze(-1), b, d


NO_RULE_OPS = {"aten.cdist": "CDIST", "aten.kron": "KRON", "aten.linalg_det": "DET",
               "aten.special_erfinv": "ERFINV"}


def _fallback_warnings(record, op):
    return [str(w.message) for w in record if re.search(rf"{re.escape(op)}\b", str(w.message))]


def test_ops_without_a_rule_fall_back_correctly_warn_once_and_are_reported():
    n = 3
    models = make_members(NoRule, n)
    with pytest.warns(UserWarning) as record:
        wide = compile_wide(models, torch.randn(4, 5), strict=False)
    fallbacks = wide.fallbacks
    report = wide.report()
    for op, marker in NO_RULE_OPS.items():
        line = f"{THIS_FILE}:{marked_line(NoRule.forward, marker)}"
        texts = _fallback_warnings(record, op)
        assert len(texts) == 1, f"{op}: expected ONE warning, got {texts}"
        assert line in texts[0] and "fallback" in texts[0] and "strict=True" in texts[0], texts[0]
        entries = [fb for fb in fallbacks if fb["op"].startswith(op + ".")]
        assert len(entries) == 1, (op, fallbacks)
        assert line in entries[0]["source"] and entries[0]["how"] in ("vmap", "loop"), entries[0]
        assert entries[0]["node"] in report and op in report and line in report, report
    assert f"fallbacks: {len(fallbacks)}" in report
    # Correct per member (outputs, input and parameter gradients), in train and eval.
    for training in (True, False):
        wide.train(training)
        for m in models:
            m.train(training)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the eval graph warns again
            check_equivalence(wide, models, [torch.randn(4, 5) for _ in range(n)])
    assert {fb["op"].rsplit(".", 1)[0] for fb in wide.fallbacks} >= set(NO_RULE_OPS)
    # torch.export fixes the batch at 4 for kron: another batch is refused, never run on a graph
    # specialised to the sample's batch.
    with pytest.raises(ValueError, match=r"expected N-first \[3, 4, 5\].*fixed at capture"):
        wide(torch.randn(n, 6, 5))


class OneNoRule(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(5, 4)

    def forward(self, x):
        h = self.fc(x).softmax(dim=1)
        return torch.cdist(h, h * 2)  # STRICT-LINE


@pytest.mark.parametrize("how", ["argument", "config", "builder"])
def test_strict_raises_naming_the_op_node_and_source_line(how):
    models = make_members(OneNoRule, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # strict never warns-and-continues
        with pytest.raises(wc.UnsupportedOperationError) as info:
            if how == "argument":
                wc.compile(models, torch.randn(4, 5), config=FAST, strict=True)
            elif how == "config":
                wc.compile(models, torch.randn(4, 5), config=FAST.replace(strict=True))
            else:
                wc.WideBuilder(models).with_sample(torch.randn(4, 5)).with_config(FAST).strict().build()
    msg = str(info.value)
    assert isinstance(info.value, wc.WideCompileError)
    assert "aten.cdist" in msg and "node 'cdist'" in msg and "strict" in msg, msg
    assert f"{THIS_FILE}:{marked_line(OneNoRule.forward, 'STRICT-LINE')}" in msg, msg
    assert "return torch.cdist(h, h * 2)" in msg, msg


def test_not_strict_is_the_default():
    models = make_members(OneNoRule, 2)
    with pytest.warns(UserWarning, match=rf"aten\.cdist.*{THIS_FILE}:"):
        wide = wc.compile(models, torch.randn(4, 5), config=FAST)
    assert [fb["op"] for fb in wide.fallbacks] == ["aten.cdist.default"]
    check_equivalence(wide, models, [torch.randn(6, 5) for _ in range(2)])


class RandPerm(LinearModel):
    linears = {"fc": (5, 8)}

    def forward(self, x):
        h = self.fc(x)
        return h[:, torch.randperm(8)]  # RANDPERM


def test_a_random_op_without_a_rule_draws_per_member():
    torch.manual_seed(0)
    model = RandPerm()
    models = [copy.deepcopy(model) for _ in range(4)]  # identical members
    with pytest.warns(UserWarning) as record:  # randperm, and the per-member index it feeds
        wide = compile_wide(models, torch.randn(4, 5), strict=False)
    assert len(_fallback_warnings(record, "aten.randperm")) == 1
    assert any(fb["op"].startswith("aten.randperm") for fb in wide.fallbacks)
    x = torch.randn(6, 5)
    out = wide(x.expand(4, *x.shape))
    ref = model.fc(x).detach()
    for i in range(4):
        # Each member's output is a column permutation of its own fc(x) ...
        assert torch.allclose(out[i].sort(dim=1).values, ref.sort(dim=1).values, atol=1e-5), i
        cols = [int((ref - out[i][:, [j]]).abs().sum(0).argmin()) for j in range(8)]
        assert sorted(cols) == list(range(8)), (i, cols)
    # ... and the permutations are drawn independently (4 members, 8! permutations).
    assert len({tuple(out[i][0].tolist()) for i in range(4)}) > 1, "every member drew the same permutation"


# ---------------------------------------------------------------------------------------------
# An unexportable forward
# ---------------------------------------------------------------------------------------------
class DataDependent(LinearModel):
    linears = {"fc": (5, 3)}

    def forward(self, x):
        h = self.fc(x)
        if h.sum() > 0:  # DATA-DEPENDENT
            return h
        return -h


def test_export_failure_keeps_exports_reason_and_gives_advice():
    with pytest.raises(wc.WideCompileError) as info:
        compile_wide([DataDependent(), DataDependent()], torch.randn(4, 5))
    msg = str(info.value)
    assert not isinstance(info.value, wc.UnsupportedOperationError)
    assert "torch.export could not capture DataDependent" in msg, msg
    assert re.search(r"data.dependent", msg, re.IGNORECASE), msg  # export's own reason, kept whole
    assert "What to do" in msg and "torch.cond" in msg, msg
    assert info.value.__cause__ is not None  # export's exception is chained
    assert f"line {marked_line(DataDependent.forward, 'DATA-DEPENDENT')}" in msg or \
        "if h.sum() > 0" in msg, msg
