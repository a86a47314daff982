"""The float32 trust check (issue 44, item 8): ``check_compile`` judges a float32 model against a
float64 run of its members, and the wide model passes when its error is within NOISE_FACTOR of the
members' own float32 error (Note [The float64 reference] in wide_compiler/_equivalence/reference.py).

It passes on stock-size float32 models in train and eval mode, where the old fixed tolerances fail
(a correct ResNet-18's own float32 logits sit ~3e-3 from the exact ones in train mode), and fails,
naming the member and the tensor, when a defect of 1e-3 is injected."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from torch import nn

import wide_compiler as wc
from wide_compiler import _equivalence, testing, zoo
from support import cpu_only

FAST = wc.WideConfig.fast()
IMAGE = (2, 3, 32, 32)  # batch 2 of 32x32 images: the last stage of a ResNet-18 has 1x1 planes


def _hf(name: str, **config):
    tf = pytest.importorskip("transformers")
    model, cfg = {"resnet": (tf.ResNetForImageClassification, tf.ResNetConfig),
                  "mobilenet_v2": (tf.MobileNetV2ForImageClassification, tf.MobileNetV2Config),
                  "efficientnet": (tf.EfficientNetForImageClassification, tf.EfficientNetConfig)}[name]
    return lambda: model(cfg(**config))


# Built from configs, nothing downloaded (torchvision cannot be installed beside the pinned torch).
# The stock configuration, dropout and drop-connect included (train mode is compared with every
# draw fixed: Note [Fixed draws in the trust check]), except EfficientNet:
# EfficientNetConfig() is B7 (64M parameters, 200 s for this check), so B0's coefficients are given
# -- the efficientnet_b0 of the issue. ResNet-18 is the zoo's (torchvision's layout; transformers'
# ResNet of the same architecture would check the same ops again at 20 s more); only it is checked on
# shared inputs too, the others on per-member inputs (train and eval): every configuration is
# another float32-against-float64 comparison of 10-40 s on a busy 2-core machine.
OWN_INPUTS_ONLY = {"hf-mobilenet_v2", "hf-efficientnet-b0"}
STOCK = {
    "zoo.ResNet18": zoo.ResNet18,
    "hf-mobilenet_v2": _hf("mobilenet_v2"),
    "hf-efficientnet-b0": _hf("efficientnet", width_coefficient=1.0, depth_coefficient=1.0, hidden_dim=1280),
}


@pytest.mark.parametrize("name", STOCK)
def test_stock_float32_models_pass_in_train_and_eval(name):
    factory = STOCK[name]
    torch.manual_seed(0)
    models = [factory() for _ in range(2)]
    x = torch.randn(IMAGE)
    own_only = name in OWN_INPUTS_ONLY
    wide, report = testing.check_compile(models, x, config=FAST, shared=False if own_only else (False, True))
    assert sorted(report) == (["eval/own", "train/own"] if own_only else
                              ["eval/own", "eval/shared", "train/own", "train/shared"])
    for key, rep in report.items():
        assert not isinstance(rep, str), (key, rep)  # compared, not skipped
        assert rep.reference == "float64" and rep.fallback is None
        for kind in ("output", "input_grad", "param_grad", "buffer"):
            assert rep.wide_error[kind] is not None and rep.own_error[kind] is not None, (key, kind)
    if name == "zoo.ResNet18":
        # Note [A float32 judgement that cannot tell]: in train mode its last stage's 1x1 planes over
        # two values make its own float32 gradients as far off as their size; those tensors were
        # judged again in float64 (test_probe9.py: a defect there is caught so), eval needed none
        for key in ("train/own", "train/shared"):
            rep = report[key]
            assert rep.blind and rep.float64_recheck is not None, key
            assert "checked again with the wide model and members in float64" in str(rep)
        assert report["eval/own"].float64_recheck is None
        assert next(wide.parameters()).dtype == torch.float32
        # The old fixed tolerances fail on this correct model: in train mode the logits (on the
        # CPU; the input gradients on a GPU) of the wide model and of its member differ by ~1e-3,
        # as the member's own differ from float64.
        _, per_member = testing.member_inputs(x, 2)
        with pytest.raises(AssertionError, match=r"member \d differs .*rtol=1e-05"):
            testing.check_equivalence(wide, models, per_member, training=True, rtol=1e-5, atol=1e-5,
                                      what="train output")


#: The tests below compile the same ResNet-18 (width 16) members, 7 times in all; they check the
#: trust check and validation on the wide model, not its capture: one capture per mode is stored
#: and loaded by the others (conftest's module_compile_cache).
RESNET16_CACHE = pytest.mark.usefixtures("module_compile_cache")


def _perturb_member_1(name: str, relative: float, monkeypatch):
    """Make check_compile's compile return a wide model whose member 1 reads ``name`` off by
    ``relative``: what a wide rule that is slightly wrong for one member would do."""
    real = testing.wide_compile

    def broken_compile(*args, **kwargs):
        wide = real(*args, **kwargs)
        with torch.no_grad():
            dict(wide.named_parameters())[name][1].mul_(1 + relative)
        return wide

    monkeypatch.setattr(testing, "wide_compile", broken_compile)


@RESNET16_CACHE
@pytest.mark.parametrize("relative", [0.0, 1e-3], ids=["none", "1e-3"])
def test_a_1e_3_defect_in_one_member_fails_and_names_the_member_and_the_tensor(relative, monkeypatch):
    """A ResNet-18 in train mode on these inputs is so ill-conditioned that its own logits are 1e-3
    off; a defect of 1e-3 in one weight of one member is still caught (the running mean right
    behind it moves 40 times as far as the members' own rounding), and without it the check passes."""
    torch.manual_seed(0)
    models = [zoo.ResNet18(width=16) for _ in range(2)]
    _perturb_member_1("layer3.0.conv1.weight", relative, monkeypatch)
    if not relative:
        testing.check_compile(models, torch.randn(IMAGE), config=FAST)
        return
    with pytest.raises(AssertionError) as err:
        testing.check_compile(models, torch.randn(IMAGE), config=FAST)
    msg = str(err.value)
    assert re.match(r"(train|eval)/(own|shared)[: ]", msg), msg  # the check
    assert "member 1 differs from its own model" in msg, msg  # the member
    # the tensor: the output, or a gradient or buffer by name
    assert re.search(r"(output|grad of [\w.]+|buffer [\w.]+): member 1 differs", msg), msg
    assert "against a float64 run" in msg and "members' own float32 error" in msg, msg


@RESNET16_CACHE
def test_a_1e_3_defect_in_one_members_gradient_fails(monkeypatch):
    """A backward that is wrong for one member only (its gradient of one weight 1e-3 off, the
    forward right) is caught by the gradient comparison, nudged reruns and all."""
    real = testing.wide_compile

    def broken_compile(*args, **kwargs):
        wide = real(*args, **kwargs)
        scale = torch.ones(2, 1, 1, 1, 1)
        scale[1] += 1e-3
        dict(wide.named_parameters())["layer3.0.conv1.weight"].register_hook(lambda g: g * scale)
        return wide

    monkeypatch.setattr(testing, "wide_compile", broken_compile)
    torch.manual_seed(0)
    models = [zoo.ResNet18(width=16) for _ in range(2)]
    with pytest.raises(AssertionError, match=r"^eval/own: grad of layer3\.0\.conv1\.weight: member 1 differs"):
        testing.check_compile(models, torch.randn(IMAGE), config=FAST, modes=("eval",), shared=False)


def test_swapped_member_weights_fail():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 3)) for _ in range(3)]
    wide = wc.compile(models, torch.randn(4, 5), config=FAST)
    with torch.no_grad():
        w = dict(wide.named_parameters())["2.weight"]
        w[[0, 2]] = w[[2, 0]].clone()
    with pytest.raises(AssertionError, match=r"output: member 0 differs .*against a float64 run"):
        testing.check_equivalence(wide, models, torch.randn(3, 4, 5))


def test_the_report_carries_and_prints_both_errors():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))
              for _ in range(3)]
    _, report = testing.check_compile(models, torch.randn(10, 6), config=FAST)
    rep = report["train/own"]
    assert rep.reference == "float64"
    text = str(rep)
    for kind in ("output", "input grad", "param grad", "buffer"):
        assert re.search(rf"{kind} \d\.\de[-+]\d\d / \d\.\de[-+]\d\d", text), text
    assert rep.wide_error["output"] <= _equivalence.NOISE_FACTOR * max(
        rep.own_error["output"], 1e-6)
    assert rep["output"] is not None  # the keys: the difference from the members, as before


def test_float64_models_keep_the_direct_comparison():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double() for _ in range(2)]
    wide = wc.compile(models, torch.randn(4, 5, dtype=torch.float64), config=FAST)
    xs = torch.randn(2, 4, 5, dtype=torch.float64)
    rep = testing.check_equivalence(wide, models, xs)
    assert rep.reference == "fixed" and "float64 run" not in str(rep)
    assert str(rep).startswith("2 members, max abs err: output ")
    with torch.no_grad():
        dict(wide.named_parameters())["2.weight"][1].mul_(1 + 1e-8)
    with pytest.raises(AssertionError, match=r"output: member 1 differs .*rtol=1e-10"):
        testing.check_equivalence(wide, models, xs)


def test_explicit_tolerances_mean_the_fixed_check():
    torch.manual_seed(0)
    models = [nn.Linear(4, 3) for _ in range(2)]
    wide = wc.nn.WideLinear.from_modules(models)
    rep = testing.check_equivalence(wide, models, torch.randn(2, 5, 4), rtol=1e-5, atol=1e-5)
    assert rep.reference == "fixed" and rep.wide_error["output"] is None


def test_integer_results_stay_exact():
    """An integer output leaf (an argmax) is compared exactly with the float32 member, beside the
    float leaf judged against float64."""

    class Both(nn.Module):
        def __init__(self, layer):
            super().__init__()
            self.layer = layer

        def forward(self, x):
            y = self.layer(x)
            return y, y.argmax(-1)

    torch.manual_seed(0)
    layers = [nn.Linear(4, 3) for _ in range(2)]
    wide_layer = wc.nn.WideLinear.from_modules(layers)

    def wide(x, shift=0):
        y = wide_layer(x)
        return y, y.argmax(-1) + shift

    params = {"layer.weight": wide_layer.weight, "layer.bias": wide_layer.bias}
    members = [Both(layer) for layer in layers]
    xs = torch.randn(2, 5, 4)
    rep = testing.check_equivalence(wide, members, xs, wide_params=params, wide_buffers={})
    assert rep.reference == "float64"
    with pytest.raises(AssertionError, match=r"output\[1\]: member 0 differs .*rtol=0, atol=0"):
        testing.check_equivalence(lambda x: wide(x, shift=1), members, xs, wide_params=params,
                                  wide_buffers={})


class _Float32Only(nn.Linear):
    """A layer with no float64 kernel (as on MPS, or a custom op registered for float32 only)."""

    def forward(self, x):
        if x.dtype == torch.float64:
            raise RuntimeError("\"addmm_impl\" not implemented for 'Double'")
        return super().forward(x)


def test_members_that_cannot_run_in_float64_fall_back_with_a_clear_message(caplog):
    torch.manual_seed(0)
    models = [nn.Sequential(_Float32Only(4, 6), nn.Tanh(), nn.Linear(6, 2)) for _ in range(2)]
    with caplog.at_level(logging.WARNING, logger="wide_compiler.testing"):
        _, report = testing.check_compile(models, torch.randn(3, 4), config=FAST)
    for rep in report.values():
        assert rep.reference == "fixed"
        assert "member 0 cannot run in float64 (RuntimeError" in rep.fallback
        assert "fixed tolerances: member 0 cannot run in float64" in str(rep)
    assert any("compared with fixed float32 tolerances" in r.getMessage() for r in caplog.records)


@cpu_only  # the member's own flip comes from the CPU GEMM's order; cuBLAS's FMAs make 1e-8 exactly
def test_a_flip_at_a_kink_is_rounding_not_a_defect(monkeypatch):
    """Member: relu(1 - 1 + 1e-8) sums to 1e-8 in float32 as in float64; the "wide" program sums
    in another order, (1 + 1e-8) - 1 = 0 in float32, and lands on the other side of ReLU's kink:
    its gradient loses a whole term where the member's own error is 0. Legitimate rounding; the
    nudged runs of the member show it (Note [The float64 reference])."""
    layers = [nn.Linear(3, 1, bias=False) for _ in range(2)]
    with torch.no_grad():
        for layer in layers:
            layer.weight.fill_(1.0)
    models = [nn.Sequential(layer, nn.ReLU()) for layer in layers]

    class Reordered(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.stack([layer.weight.detach() for layer in layers]))

        def forward(self, x):  # x: [N, B, 3]
            w = self.weight[:, None, :, :]  # [N, 1, 1, 3]
            return torch.relu((x[..., 0:1] * w[..., 0] + x[..., 2:3] * w[..., 2]) + x[..., 1:2] * w[..., 1])

    wide = Reordered()
    xs = torch.tensor([[1.0, -1.0, 1e-8]]).expand(2, 1, 3).contiguous()
    assert wide(xs).eq(0).all() and models[0](xs[0]).gt(0).all()  # the flip
    call = dict(wide_params={"0.weight": wide.weight}, wide_buffers={})
    monkeypatch.setattr(_equivalence.reference, "RESAMPLES", 0)  # where the check reads it
    with pytest.raises(AssertionError, match=r"output: member 0 differs"):
        testing.check_equivalence(wide, models, xs, **call)
    monkeypatch.undo()
    for inputs, shared in ((xs, False), (xs[0], True)):  # shared: the input gradient is a sum
        rep = testing.check_equivalence(wide, models, inputs, shared=shared, **call)
        for kind in ("output", "input_grad", "param_grad"):
            assert rep.own_error[kind] >= rep.wide_error[kind] / _equivalence.NOISE_FACTOR > 0, kind


@RESNET16_CACHE
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_validate_judges_float32_against_float64(training):
    """compile(validate=True) passes on a ResNet-18 (outputs and buffers, in the models' mode), and
    with the config's tolerances changed from their defaults it is the fixed check."""
    torch.manual_seed(0)
    models = [zoo.ResNet18(width=16).train(training) for _ in range(2)]
    wc.compile(models, torch.randn(IMAGE), config=FAST, validate=True)
    with pytest.raises(wc.ValidationError, match=r"rtol=1e-09"):
        wc.compile(models, torch.randn(IMAGE), config=FAST.replace(rtol=1e-9, atol=1e-9), validate=True)
