"""Per-member constants x input sizes (issue 44, item 2; Note [Every configuration's guards] in
fx/constants.py): a forward whose Python branch reads an input size and a per-member constant
together gives each configuration of the constants its own guards, and the wide graph runs only
where every configuration's hold. At each size every member computes what it computes alone
(outputs, shapes, input gradients), or the call is refused naming the member whose branch differs:
never member 0's branch for another member. Each form: N=3, float64, train and eval, at the
sample's size and at others, in the sequence and in the batch dim."""
from __future__ import annotations

import pickle

import pytest
import torch
import wide_compiler as wc
from support import DEVICE, LinearModel
from wide_compiler.fx.constants import ConstantPlan, conjoin_guards

FAST = wc.WideConfig.fast()
OK = None  # the call runs, each member right


class SeqScale(LinearModel):  # the probe's F7: the sequence length times the constant
    fields = ("s",)

    def forward(self, x):
        h = self.fc(x)
        return h * self.s if h.shape[1] * self.s < 2 else h.tanh() * self.s


class BatchScale(LinearModel):  # F7b: the batch (dynamic from the first capture) times the constant
    fields = ("s",)

    def forward(self, x):
        h = self.fc(x)
        return h * self.s if x.shape[0] * self.s <= 1 else h.tanh()


class MinLen(LinearModel):  # F7c: a constant read only by a size test
    fields = ("min_len",)

    def forward(self, x):
        h = self.fc(x)
        return h * 2 if h.shape[1] >= self.min_len else h - 1


class RoundedLen(LinearModel):  # F7c: an int computed from the constant
    fields = ("s",)

    def forward(self, x):
        h = self.fc(x)
        return h * 2 if h.shape[1] > round(10 * self.s) else h - 1


class MinBatch(LinearModel):  # F7c: the batch against the constant
    fields = ("s",)

    def forward(self, x):
        h = self.fc(x)
        return h * 2 if h.shape[0] >= self.s else h - 1


class Ratio(LinearModel):  # F7c: the branch changes the output's shape
    fields = ("s",)

    def forward(self, x):
        h = self.fc(x)
        T = h.shape[1]
        return h[:, : T // 2] if T / self.s > 3 else h


def _members(cls, values):
    torch.manual_seed(0)
    return [cls(v).double() for v in values]


def _call(wide, models, x, train):
    """Each member of ``wide`` against itself alone on its slice of ``x``: output (shape and
    values) and, in train mode, the gradient of its input."""
    wide.train(train)
    for m in models:
        m.train(train)
    xw = x.clone().requires_grad_(train)
    y = wide(xw)
    if train:
        (y ** 2).sum().backward()
    for i, m in enumerate(models):
        xi = x[i].clone().requires_grad_(train)
        yi = m(xi)
        assert y[i].shape == yi.shape, f"member {i}: shape {tuple(y[i].shape)}, alone {tuple(yi.shape)}"
        torch.testing.assert_close(y[i], yi, rtol=1e-9, atol=1e-9, msg=lambda s, i=i: f"member {i}: {s}")
        if train:
            (yi ** 2).sum().backward()
            torch.testing.assert_close(xw.grad[i], xi.grad, rtol=1e-9, atol=1e-9,
                                       msg=lambda s, i=i: f"member {i} input grad: {s}")


def _sweep(cls, values, sample, calls, train, config=FAST):
    """Compile ``cls`` members with ``values`` on ``sample`` (one member's shape), then call at each
    ``(shape, expected)`` of ``calls`` in order: ``OK`` (each member right) or the index of the
    member the refusal must name (its branch differs from member 0's there)."""
    models = _members(cls, values)
    wide = wc.compile(models, torch.randn(*sample, dtype=torch.float64), config=config)
    for k, (shape, expected) in enumerate(calls):
        x = torch.randn(len(values), *shape, dtype=torch.float64, generator=torch.Generator(DEVICE).manual_seed(k))
        if expected is OK:
            _call(wide, models, x, train)
        else:
            with pytest.raises(ValueError, match=rf"member {expected}\b") as err:
                _call(wide, models, x, train)
            assert f"member {expected}'s constants" in str(err.value), str(err.value)  # the guard it failed
    return wide


MODES = pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])


@MODES
def test_a_branch_on_the_length_times_a_constant_follows_every_member(train):
    """s = 0.1, 0.2, 0.3 at T = 4: all multiply. T = 8: member 2 (2.4) takes tanh alone; T = 12:
    members 1 and 2; T = 25: all take tanh again, so a graph is captured for it and runs."""
    _sweep(SeqScale, (0.1, 0.2, 0.3), (2, 4, 4),
           [((2, 4, 4), OK), ((2, 5, 4), OK), ((2, 8, 4), 2), ((2, 6, 4), OK), ((2, 12, 4), 1), ((2, 25, 4), OK),
            ((2, 4, 4), OK)], train)


@MODES
def test_a_branch_on_the_batch_times_a_constant_follows_every_member_at_the_first_capture(train):
    """The batch is dynamic from the first capture: member 0's guard (0.1 B <= 1) alone let B = 4
    run member 0's branch for member 2 (0.3 B > 1)."""
    _sweep(BatchScale, (0.1, 0.2, 0.3), (2, 4),
           [((2, 4), OK), ((3, 4), OK), ((4, 4), 2), ((6, 4), 1), ((11, 4), OK), ((3, 4), OK)], train)


@MODES
def test_a_constant_read_only_by_a_length_test_guards_every_member(train):
    _sweep(MinLen, (3.0, 5.0, 4.0), (2, 8, 4),
           [((2, 8, 4), OK), ((2, 6, 4), OK), ((2, 5, 4), OK), ((2, 4, 4), 1), ((2, 3, 4), 1), ((2, 8, 4), OK)], train)


@MODES
def test_an_int_computed_from_a_constant_in_a_length_test_guards_every_member(train):
    _sweep(RoundedLen, (0.3, 0.5, 0.4), (2, 8, 4),
           [((2, 8, 4), OK), ((2, 6, 4), OK), ((2, 5, 4), 1), ((2, 4, 4), 1)], train)


@MODES
def test_a_batch_test_against_a_constant_guards_every_member(train):
    _sweep(MinBatch, (3.0, 5.0, 4.0), (6, 4),
           [((6, 4), OK), ((5, 4), OK), ((4, 4), 1), ((3, 4), 1), ((7, 4), OK)], train)


@MODES
def test_a_branch_that_changes_the_output_shape_never_gives_a_member_another_shape(train):
    """T / s > 3 slices for every member at T = 8 and 12; at T = 6, 5 and 4 member 1 (s = 2) keeps
    the whole sequence (member 0's slice gave it shape (2, 2, 4) for (2, 5, 4))."""
    _sweep(Ratio, (1.0, 2.0, 1.5), (2, 8, 4),
           [((2, 8, 4), OK), ((2, 12, 4), OK), ((2, 7, 4), OK), ((2, 6, 4), 1), ((2, 5, 4), 1), ((2, 4, 4), 1)], train)


def test_the_safe_configuration_guards_every_member_too():
    """WideConfig.safe() (every member traced, validated, strict; without tuning here) ran member
    0's branch for member 2 as the fast configuration did."""
    _sweep(SeqScale, (0.1, 0.2, 0.3), (2, 4, 4), [((2, 4, 4), OK), ((2, 8, 4), 2), ((2, 6, 4), OK)], True,
           config=wc.WideConfig.safe().replace(tune=False))


def test_each_configurations_guard_is_shown_with_it_and_members_sharing_one_add_nothing():
    models = _members(SeqScale, (0.1, 0.3, 0.1))  # two configurations
    wide = wc.compile(models, torch.randn(2, 4, 4, dtype=torch.float64), config=FAST)
    _call(wide, models, torch.randn(3, 2, 5, 4, dtype=torch.float64), True)  # T made dynamic
    shown = wide._graph_for(True).guards.describe().splitlines()
    mine = [s for s in shown if "constants:" in s]
    assert mine == ["0.3*torch.sym_float(x.size()[1]) < 2.0 (member 1's constants: s = 0.3)"], shown


def test_a_compile_cache_hit_keeps_every_configurations_guards(cache_dir, monkeypatch):
    """The cache keeps the conjoined guards (the plan's per-probe guards are not pickled)."""
    from wide_compiler.fx import pipeline

    models = _members(BatchScale, (0.1, 0.2, 0.3))
    sample = torch.randn(2, 4, dtype=torch.float64)
    fresh = wc.compile(models, sample, config=FAST)

    def no_plan(*args, **kwargs):
        raise AssertionError("a configuration was traced: not a hit")

    with monkeypatch.context() as m:
        m.setattr(pipeline, "plan_constants", no_plan)
        wide = wc.compile(models, sample, config=FAST)
    assert wide._graph_for(True).guards.describe() == fresh._graph_for(True).guards.describe()
    assert "member 2's constants: s = 0.3" in wide._graph_for(True).guards.describe()
    with pytest.raises(ValueError, match=r"member 2\b"):
        _call(wide, models, torch.randn(3, 4, 4, dtype=torch.float64), True)


def test_conjoined_guards_hold_only_where_each_does_and_the_plan_pickles_without_them():
    from wide_compiler.fx.guards import Guards

    def guards(code, shown, **kw):
        return Guards(1, (torch.float32,), ((2, {}),), ("x",), code, shown, **kw)

    base = guards(("s[0][1] >= 2", "s[0][1] < 20"), ("x.size()[1] >= 2", "x.size()[1] < 20"))
    probe = guards(("s[0][1] >= 2", "s[0][1] < 7"), ("x.size()[1] >= 2", "x.size()[1] < 7"),
                   flags=((("are_deterministic_algorithms_enabled", ()), False),))
    fixed = Guards(1, (torch.float32,), ((2, {0: 3}),), ("x",), (), ())  # a probe that fixed dim 0
    both = conjoin_guards(base, [("member 2's constants: s = 0.3", probe), ("member 1's constants: s = 0.2", fixed)])
    assert both.shown[2:] == ("x.size()[1] < 7 (member 2's constants: s = 0.3)",
                              "x.size()[0] == 3 (member 1's constants: s = 0.2)")
    assert both.flags == probe.flags
    x = torch.zeros(1, 3, 6)
    assert both.holds((x,)) and base.holds((x,))
    assert not both.holds((torch.zeros(1, 3, 8),)) and base.holds((torch.zeros(1, 3, 8),))
    assert not both.holds((torch.zeros(1, 4, 6),))
    assert "member 2's constants" in both.failed((torch.zeros(1, 3, 8),))
    assert conjoin_guards(base, [("member 1's constants: s = 0.2", base)]) is base
    plan = ConstantPlan({"s": (0.1, 0.3)}, probe_guards=[("member 1's constants: s = 0.3", probe)])
    assert pickle.loads(pickle.dumps(plan)).probe_guards == []


@MODES
def test_a_length_test_against_constants_from_a_sample_of_length_one_follows_every_member(train):
    """Probe 15 of issue 44, P15-2 (Note [Per-member constants a size meets] in model_calls.py): a
    sample of T = 1 is recaptured at T = 2 (export specialises 1), where members 0 and 1 (3.0, 2.0)
    differ, so a call at T = 10, where every member takes the same branch, was refused. It is now
    captured at its own size and runs; a size where members differ is still refused, naming the
    member."""
    models = _members(MinLen, (3.0, 2.0, 4.0))
    wide = wc.compile(models, torch.randn(2, 1, 4, dtype=torch.float64), config=FAST)
    for k, (T, expected) in enumerate([(1, OK), (10, OK), (2, 1), (3, 2), (12, OK), (10, OK), (1, OK)]):
        x = torch.randn(3, 2, T, 4, dtype=torch.float64, generator=torch.Generator(DEVICE).manual_seed(k))
        if expected is OK:
            _call(wide, models, x, train)
        else:
            with pytest.raises(ValueError, match=rf"member {expected}\b.*min_len"):
                _call(wide, models, x, train)


class LengthOverConstant(LinearModel):  # probe 12, P12-6: a size and a constant in one Python number
    fields = ("c",)

    def forward(self, x):
        h = self.fc(x)
        return h * (h.shape[1] / self.c) + h * (h.shape[1] ** -0.5 / self.c)


@MODES
def test_a_size_divided_by_a_constant_runs_at_every_size(train):
    """P12-6: ``h * (T / self.c)`` ran at the sample's T and was refused at every other (the
    recapture with T dynamic has no per-member form for a Python division of a size by a
    constant); each new T is now captured at its own size (Note [Per-member constants a size
    meets] in model_calls.py)."""
    _sweep(LengthOverConstant, (0.6, 1.1, 2.3), (2, 5, 4),
           [((2, 5, 4), OK), ((2, 7, 4), OK), ((2, 3, 4), OK), ((2, 7, 4), OK), ((2, 5, 4), OK)], train)
