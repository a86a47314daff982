"""Probe 16 of issue 44 (an independent re-run of the adversarial probe): each finding as a test
that failed before its fix (P15-2, a false refusal of probe 15, is in test_constants_sizes.py)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import wide_compiler as wc

FAST = wc.WideConfig.fast()
WIDTHS = (4, 8, 12)


class Offset(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.a = nn.Linear(6, h)
        self.register_buffer("offset", torch.zeros(h))

    def forward(self, x):
        return (self.a(x) + self.offset).sum(-1, keepdim=True)


class NormThenLayerNorm(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(6, h), nn.BatchNorm1d(h, affine=False), nn.Linear(h, 3)

    def forward(self, x):
        h = self.bn(self.a(x))
        return self.b(F.layer_norm(h, (h.shape[-1],)))


def _edit_buffers(model, value):
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith(("offset", "running_mean")):
                b.fill_(value)


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("cls", [Offset, NormThenLayerNorm])
def test_a_buffer_written_by_hand_has_its_padding_zeroed_at_the_next_call(cls, train):
    """P16-7: ``b.fill_(v)`` over a padded model's buffers filled their padding, which a sum or a
    LayerNorm over the padded dim then counted (2.2-5.6 off), silently. Now the padding is zeroed
    at the next call, as for a parameter written by hand (Note [Writes into the padding])."""
    torch.manual_seed(0)
    members = [cls(h).double() for h in WIDTHS]
    refs = copy.deepcopy(members)
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    wide = wc.compile(members, x[0], pad=True, config=FAST).train(train)
    for r in refs:
        r.train(train)
    wide(x)  # a call first: its own buffer updates are not writes by hand
    for r, xi in zip(refs, x):
        r(xi)
    for k, value in enumerate((0.7, -0.3)):
        _edit_buffers(wide, value)
        for r in refs:
            _edit_buffers(r, value)
        out = wide(x)
        for i, r in enumerate(refs):
            torch.testing.assert_close(out[i], r(x[i]), rtol=1e-9, atol=1e-9, msg=lambda s, i=i, k=k: f"{k}, {i}: {s}")
        for i, r in enumerate(refs):  # each member's own values are the ones written
            mine = dict(wide.member(i).named_buffers())
            for name, own in r.named_buffers():
                torch.testing.assert_close(mine[name], own, rtol=1e-9, atol=1e-9)


def test_a_padded_state_saved_after_a_buffer_write_loads():
    """P16-6: after ``running_var.fill_(1)`` over the buffers the model's own ``state_dict()`` was
    refused by its ``load_state_dict`` (padding not zero), though the model computed each member
    exactly. ``state_dict()`` now zeroes written padding first."""
    torch.manual_seed(0)

    def cnn(c):
        return nn.Sequential(nn.Conv2d(3, c, 3, padding=1), nn.BatchNorm2d(c), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                             nn.Flatten(), nn.Linear(c, 2))

    wide = wc.compile([cnn(c) for c in (4, 8)], torch.randn(2, 3, 8, 8), pad=True, config=FAST)
    wide(torch.randn(2, 4, 3, 8, 8))
    with torch.no_grad():
        for name, b in wide.named_buffers():
            if name.endswith("running_var"):
                b.fill_(1.0)
    state = copy.deepcopy(wide.state_dict())
    assert state["1.running_var"][0, 4:].eq(0).all()  # member 0's padding (its own 4 channels are 1)
    assert state["1.running_var"][0, :4].eq(1).all()
    wide.load_state_dict(state)
    fresh = wc.compile([cnn(c) for c in (4, 8)], torch.randn(2, 3, 8, 8), pad=True, config=FAST)
    fresh.load_state_dict(state)
    x = torch.randn(2, 2, 3, 8, 8)
    torch.testing.assert_close(fresh.eval()(x), wide.eval()(x))


class SigmoidSum(nn.Module):  # sigmoid(0) = 0.5: padded units that hold weights would count
    def __init__(self, h):
        super().__init__()
        self.a, self.b = nn.Linear(6, h), nn.Linear(h, 3)

    def forward(self, x):
        h = self.a(x)
        return self.b(torch.tanh(h)) + torch.sigmoid(h).sum(-1, keepdim=True)


def _explored(seed=0):
    """A padded model after one call and an explore move over its parameters (no call since)."""
    torch.manual_seed(seed)
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    wide = wc.compile([SigmoidSum(h).double() for h in WIDTHS], x[0], pad=True, config=FAST).eval()
    wide(x)
    with torch.no_grad():
        for p in wide.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return wide, x


def test_a_program_exported_right_after_a_parameter_write_is_the_models():
    """P16-9: ``export()`` right after ``p.add_(noise)`` over the parameters (no call in between)
    traced the written padding: the exported program was 2.06 off each member, silently."""
    wide, x = _explored()
    program = wide.export(None, x).module()
    got = program(x)
    for i in range(3):
        torch.testing.assert_close(got[i], wide.member(i).eval()(x[i]), rtol=1e-9, atol=1e-9)


def test_a_state_saved_right_after_a_parameter_write_loads_into_a_model_of_the_same_sizes():
    """P16-8: a ``state_dict()`` right after an explore move was refused by a padded model of the
    same sizes (padding not zero)."""
    wide, x = _explored()
    state = copy.deepcopy(wide.state_dict())
    fresh, _ = _explored(seed=1)
    fresh.load_state_dict(state)
    torch.testing.assert_close(fresh(x), wide(x), rtol=1e-12, atol=1e-12)


CLASSES = (3, 5, 7)


def _classifiers():
    torch.manual_seed(0)
    members = [nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, c)).double() for c in CLASSES]
    x = torch.randn(3, 6, 4, dtype=torch.float64)
    y = torch.stack([torch.randint(0, 3, (6,)) for _ in CLASSES])
    want = torch.stack([F.cross_entropy(m(x[i]) * 2, y[i]) for i, m in enumerate(members)])
    return wc.compile(copy.deepcopy(members), x[0], pad=True, config=FAST), x, y, want


@pytest.mark.parametrize("op", [lambda o: o * 2, lambda o: o.clone() * 2, lambda o: o[..., :] * 2, lambda o: o[..., :]],
                         ids=["scale", "clone", "slice-scale", "slice"])
def test_member_losses_refuses_an_op_of_a_padded_output_that_keeps_its_shape(op):
    """P16-5: ``member_losses(F.cross_entropy, out * 2, y)`` on a padded class sweep counted each
    narrower member's padded classes (0.86 off, wrong gradients), silently: an op drops the mark."""
    wide, x, y, _ = _classifiers()
    out = wide(x)
    with pytest.raises(ValueError, match="computed by an op from the output of a padded model"):
        wc.optim.member_losses(F.cross_entropy, op(out), y)


def test_member_losses_warns_about_a_padded_output_changed_without_a_graph_and_takes_the_op_inside():
    wide, x, y, want = _classifiers()
    out = wide(x)
    with pytest.warns(UserWarning, match="the shape of a padded model's output"):
        wc.optim.member_losses(F.cross_entropy, out.detach() * 2, y)
    got = wc.optim.member_losses(lambda o, t: F.cross_entropy(o * 2, t), out, y)  # what the messages advise
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    got.sum().backward()
    reduced = wc.optim.member_losses(F.mse_loss, wide(x).sum(-1), torch.zeros(3, 6, dtype=torch.float64))
    assert reduced.shape == (3,)  # another shape (the padded dim reduced): no refusal


class InPlaceBlock(nn.Module):
    """Linear -> an in-place activation -> Linear, with an in-place residual: torchvision's
    ResNet block pattern (``relu_``, ``out += identity``) over a swept width."""

    def __init__(self, h, act):
        super().__init__()
        self.a, self.b, self.c, self.act = nn.Linear(6, h), nn.Linear(h, h), nn.Linear(h, 3), act

    def forward(self, x):
        h = self.act(self.a(x))
        out = self.b(h)
        out += h
        out.mul_(0.5)
        return self.c(self.act(out))


@pytest.mark.parametrize("act", [lambda: nn.ReLU(inplace=True), lambda: nn.SiLU(inplace=True),
                                 lambda: nn.ReLU6(inplace=True), lambda: nn.Hardswish(inplace=True),
                                 lambda: nn.ELU(inplace=True)], ids=["relu_", "silu_", "relu6_", "hardswish_", "elu_"])
def test_in_place_activations_and_residuals_are_padded_as_their_out_of_place_forms(act):
    """P16-1: pad=True refused ``relu_``, ``silu_`` and ``out += identity`` (every stock torchvision
    ResNet, EfficientNet, ShuffleNet width sweep), though they keep zero padding zero
    (Note [In-place ops on padded values] in fx/padding_rules.py)."""
    torch.manual_seed(0)
    members = [InPlaceBlock(h, act()).double() for h in WIDTHS]
    refs = copy.deepcopy(members)
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    wide = wc.compile(members, x[0], pad=True, config=FAST)
    opt = torch.optim.SGD(wide.parameters(), lr=0.1, momentum=0.9)
    ref_opts = [torch.optim.SGD(r.parameters(), lr=0.1, momentum=0.9) for r in refs]
    for train in (True, False, True):
        wide.train(train)
        out = wide.member_outputs(wide(x))
        for i, r in enumerate(refs):
            own = r.train(train)(x[i])
            torch.testing.assert_close(out[i], own, rtol=1e-9, atol=1e-9)
            if train:
                ref_opts[i].zero_grad()
                own.square().sum().backward()
                ref_opts[i].step()
        if train:
            opt.zero_grad()
            sum(o.square().sum() for o in out).backward()
            opt.step()
    for i, r in enumerate(refs):
        for (name, p), q in zip(wide.member(i).named_parameters(), r.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-9, atol=1e-9, msg=lambda s, name=name: f"{i} {name}: {s}")


class ShiftInPlace(nn.Module):
    def __init__(self, h, write):
        super().__init__()
        self.a, self.b, self.write = nn.Linear(6, h), nn.Linear(h, 3), write

    def forward(self, x):
        h = self.a(x)
        self.write(h)
        return self.b(h.sum(-1, keepdim=True) * h)


@pytest.mark.parametrize("write", [lambda h: h.add_(1.0), lambda h: F.hardtanh(h, 0.2, 0.8, inplace=True),
                                   lambda h: h.sigmoid_()], ids=["add_ scalar", "hardtanh_ 0.2-0.8", "sigmoid_"])
def test_an_in_place_op_that_writes_into_the_padding_is_refused(write):
    """What a mask after could not take back from the input's later uses (here ``h.sum(-1)``)."""
    members = [ShiftInPlace(h, write) for h in WIDTHS]
    with pytest.raises(wc.UnsupportedOperationError, match="in place"):
        wc.compile(members, torch.randn(5, 6), pad=True, config=FAST)


class SpareNorm(nn.Module):
    def __init__(self, h, spare):
        super().__init__()
        self.a, self.b, self.spare = nn.Linear(6, h), nn.Linear(h, 3), spare

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))  # self.spare never runs


def test_an_unused_module_with_a_wide_form_of_its_own_does_not_stop_padding():
    """P16-4: a spare ``BatchNorm1d(momentum=None)`` that the forward never calls made pad=True
    refuse the members (the module runs whole when used: still refused then, test_probe10.py)."""
    members = [SpareNorm(h, nn.BatchNorm1d(4, momentum=None)).double() for h in WIDTHS]
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    wide = wc.compile(copy.deepcopy(members), x[0], pad=True, config=FAST)
    out = wide.member_outputs(wide(x))
    for i, m in enumerate(members):
        torch.testing.assert_close(out[i], m(x[i]), rtol=1e-12, atol=1e-12)
    assert [m.spare.momentum for m in wide.unfuse()] == [None] * 3


class MaybeResidual(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.a, self.b, self.res = nn.Linear(6, 6), nn.Linear(6, h), h == 4

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.res:
            h = h + x
        return self.b(h)


def test_members_whose_programs_part_are_refused_naming_where():
    """P16-2: the refusal said only "member 1 runs 10 graph nodes, member 0 runs 11" (torchvision's
    mobilenet_v2 at two widths: 522 and 523), naming no op, module or line."""
    with pytest.raises(wc.ArchitectureMismatchError, match=r"they part at node \d+, where member 1 runs aten\.linear"
                                                           r".* in module 'b' .* member 0 runs aten\.add\.Tensor .*h = h \+ x"):
        wc.compile([MaybeResidual(h) for h in (4, 8)], torch.randn(5, 6), pad=True, config=FAST)


class TwoBranches(nn.Module):
    def __init__(self, h1, h2):
        super().__init__()
        self.a, self.b, self.o = nn.Linear(5, h1), nn.Linear(5, h2), nn.Linear(h1 + h2, 2)

    def forward(self, z):
        return self.o(torch.cat([self.a(z), self.b(z)], -1))


def test_a_cat_of_parts_swept_in_opposite_directions_is_refused_saying_why():
    """P16-3: widths (4, 6) and (8, 3) were refused as "internal: the padding of dim 1 does not
    match the sizes [10, 11]"; parts swept together run (exact)."""
    with pytest.raises(wc.UnsupportedOperationError, match=r"aten\.cat.*swept in different directions.* 14 wide"):
        wc.compile([TwoBranches(4, 6), TwoBranches(8, 3)], torch.randn(4, 5), pad=True, config=FAST)
    members = [TwoBranches(4, 3).double(), TwoBranches(8, 6).double()]
    z = torch.randn(2, 4, 5, dtype=torch.float64)
    wide = wc.compile(copy.deepcopy(members), z[0], pad=True, config=FAST)
    for i, m in enumerate(members):
        torch.testing.assert_close(wide(z)[i], m(z[i]), rtol=1e-12, atol=1e-12)


class HalfBatchBranch(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.a, self.b = nn.Linear(6, h), nn.Linear(h, 3)

    def forward(self, x):
        h = self.a(x)
        if x.shape[0] * 0.5 > 1:  # export's guard: 0.5*torch.sym_float(L['x'].size()[0]) > 1.0
            h = torch.tanh(h)
        return self.b(h)


def test_a_padded_programs_guard_that_calls_torch_is_checked():
    """The fuzzer's fourth stream (generate(17, fourth=True)): a guard of export's that calls
    ``torch.sym_float`` was evaluated without ``torch`` in scope, and the members were refused with
    a NameError."""
    members = [HalfBatchBranch(h).double() for h in WIDTHS]
    x = torch.randn(3, 4, 6, dtype=torch.float64)
    wide = wc.compile(copy.deepcopy(members), x[0], pad=True, config=FAST)
    out = wide.member_outputs(wide(x))
    for i, m in enumerate(members):
        torch.testing.assert_close(out[i], m(x[i]), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="pad=True: the padded train program"):
        wide(torch.randn(3, 2, 6, dtype=torch.float64))  # a batch where the branch is not the sample's


def test_member_padded_refuses_an_output_of_other_sizes_than_the_samples():
    members = [nn.Sequential(nn.Conv2d(3, c, 1, stride=2), nn.Flatten()).double() for c in (4, 6)]
    x = torch.randn(2, 3, 6, 6, dtype=torch.float64)
    wide = wc.compile(copy.deepcopy(members), x, pad=True, config=FAST)
    assert wide.member_padded(0, members[0](x), output=0).shape == (2, 6 * 9)
    with pytest.raises(ValueError, match="runs at the sample's sizes but the batch"):
        wide.member_padded(0, members[0](torch.randn(2, 3, 9, 9, dtype=torch.float64)), output=0)
