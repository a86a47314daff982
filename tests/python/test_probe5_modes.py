"""Modes, padding and hooks found silently wrong by an independent probe (issue 44, probe 5: F15,
F11, F7, F17, F10). Each case either works exactly or is refused with what, where and why, before
anything of the user's changes."""
from __future__ import annotations

import pytest
import torch
import wide_compiler as wc
from torch import nn
from wide_compiler.errors import ArchitectureMismatchError

FAST = wc.WideConfig.fast()


def _bn_members(n: int = 2) -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2)) for _ in range(n)]


# ---------------------------------------------------------------- F15: a submodule in another mode
@pytest.mark.parametrize("setup, where", [
    (lambda m: (m.train(), m[1].eval()), r"submodule '1' \(BatchNorm1d\) is in eval mode, but the member "
                                         r"\(Sequential\) is in train mode"),
    (lambda m: (m.eval(), m[2].train()), r"submodule '2' \(Dropout\) is in train mode, but the member "
                                         r"\(Sequential\) is in eval mode"),
], ids=["frozen-bn", "mc-dropout"])
def test_submodule_in_another_mode_refused_before_capture(setup, where):
    models = _bn_members()
    for m in models:
        setup(m)
    before = [m[1].running_mean.clone() for m in models]
    with pytest.raises(ArchitectureMismatchError, match=r"member 0: " + where):
        wc.compile(models, torch.randn(5, 4), config=FAST)
    with pytest.raises(ArchitectureMismatchError, match=where):  # the trust check is no way around it
        wc.testing.check_compile(models, torch.randn(5, 4), config=FAST)
    assert all(torch.equal(b, m[1].running_mean) for b, m in zip(before, models))


def test_submodule_in_another_mode_refused_with_pad():
    models = [nn.Sequential(nn.Linear(4, h), nn.BatchNorm1d(h), nn.Linear(h, 2)) for h in (4, 6)]
    for m in models:
        m.train()
        m[1].eval()
    with pytest.raises(ArchitectureMismatchError, match=r"submodule '1' \(BatchNorm1d\) is in eval mode"):
        wc.compile(models, torch.randn(5, 4), pad=True, config=FAST)


def test_submodule_in_another_mode_that_reads_no_mode_compiles():
    # a head added after model.eval() is in train mode and reads no mode: the wide model is exact
    models = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()).eval() for _ in range(2)]
    for m in models:
        m.append(nn.Linear(4, 2))
    assert models[0][2].training and not models[0].training
    wide = wc.compile(models, torch.randn(5, 4), config=FAST)
    x = torch.randn(2, 5, 4)
    for i, m in enumerate(models):
        torch.testing.assert_close(wide(x)[i], m(x[i]))


# ---------------------------------------------------------------- F11: a padded model's state
SCALE = 1.0
CFG = {"act": "relu"}


class _Reads(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(4, h), nn.Linear(h, 3)

    def forward(self, x):
        h = self.fc(x) * SCALE
        return self.out(h.relu() if CFG["act"] == "relu" else h.sigmoid())


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_padded_model_refuses_changed_globals(training):
    global SCALE
    torch.manual_seed(0)
    models = [_Reads(h).double().train(training) for h in (4, 6)]
    wide = wc.compile(models, torch.randn(5, 4, dtype=torch.float64), pad=True, config=FAST).train(training)
    x = torch.randn(2, 5, 4, dtype=torch.float64)
    try:
        for change, undo, what in [(lambda: globals().__setitem__("SCALE", 3.0), lambda: globals().__setitem__(
                "SCALE", 1.0), r"SCALE, which the members' code reads, is 3.0 now, captured as 1.0"),
                (lambda: CFG.__setitem__("act", "x"), lambda: CFG.__setitem__("act", "relu"), r"CFG")]:
            change()
            with pytest.raises(ValueError, match=r"pad=True: .*" + what + r".*compile again"):
                wide(x)
            undo()
            outs = wide.member_outputs(wide(x))
            for i, m in enumerate(models):
                torch.testing.assert_close(outs[i], m(x[i]), rtol=1e-10, atol=1e-12)
    finally:
        SCALE, CFG["act"] = 1.0, "relu"


# ---------------------------------------------------------------- F7: a global full backward hook
def _double_linear_grads(m, grad_input, grad_output):
    return tuple(g * 2 if g is not None else None for g in grad_input) if isinstance(m, nn.Linear) else None


def test_global_backward_hook_refused_in_train_at_compile_and_at_call():
    from torch.nn.modules import module as torch_module

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)) for _ in range(2)]
    handle = torch_module.register_module_full_backward_hook(_double_linear_grads)
    try:
        with pytest.raises(wc.WideCompileError, match=r"global module backward hook .*_global_backward_hooks"):
            wc.compile(models, torch.randn(5, 4), config=FAST)
    finally:
        handle.remove()
    wide = wc.compile(models, torch.randn(5, 4), config=FAST)
    x = torch.randn(2, 5, 4)
    wide(x)
    handle = torch_module.register_module_full_backward_hook(_double_linear_grads)
    try:  # registered after compiling: the call that would run without it refuses
        with pytest.raises(ValueError, match=r"global module hooks .*capturing the train graph .* failed: "
                                             r"WideCompileError: .*global module backward hook"):
            wide(x)
    finally:
        handle.remove()
    torch.testing.assert_close(wide(x)[1], models[1](x[1]))


# ---------------------------------------------------------------- F17: a hook that records
FEATS: list[list] = [[], []]


@pytest.mark.parametrize("pad", [False, True], ids=["same-size", "padded"])
def test_recording_hook_refused_before_anything_runs(pad):
    from torch.nn.modules import module as torch_module

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, h), nn.Tanh(), nn.Linear(h, 2)) for h in ((4, 6) if pad else (4, 4))]
    for i, m in enumerate(models):
        m[0].register_forward_hook(lambda mod, inp, out, i=i: FEATS[i].append(out.detach()))
    with pytest.raises(wc.WideCompileError, match=r"member 0's module '0' \(Linear\) has a forward hook \(.*<lambda> at "
                                                  r".*test_probe5_modes.py:\d+\) that writes into state outside "
                                                  r"it \(FEATS\)"):
        wc.compile(models, torch.randn(5, 4), pad=pad, config=FAST)
    assert FEATS == [[], []]  # nothing of the user's was changed (no placeholder tensor left there)
    seen = {"n": 0}

    def count(mod, inp):
        seen["n"] += 1

    plain = [nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)]
    wide = wc.compile(plain, torch.randn(5, 4), config=FAST)
    handle = torch_module.register_module_forward_pre_hook(count)
    try:  # a global one registered after compiling: refused at the call, before its capture runs it
        with pytest.raises(ValueError, match=r"global module hooks \(torch.nn.modules.module._global_forward_pre_hooks, "
                                             r"run by every module\) hold a forward pre hook .*writes into state "
                                             r"outside it \(seen\)"):
            wide(torch.randn(2, 5, 4))
    finally:
        handle.remove()
    assert seen["n"] == 0


def test_hook_that_returns_a_new_output_compiles():
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)) for _ in range(2)]
    for m in models:
        m[0].register_forward_hook(lambda mod, inp, out: out * 2)
    wide = wc.compile(models, torch.randn(5, 4), config=FAST)
    x = torch.randn(2, 5, 4)
    torch.testing.assert_close(wide(x)[1], models[1](x[1]))


# ---------------------------------------------------------------- F10: an int that is no size
class _IntScale(nn.Module):
    def __init__(self, h: int, k: int) -> None:
        super().__init__()
        self.fc, self.out, self.k = nn.Linear(4, h), nn.Linear(h, 3), k

    def forward(self, x):
        return self.out(self.fc(x) * self.k)


def test_differing_int_with_pad_does_not_say_use_pad():
    with pytest.raises(ArchitectureMismatchError, match=r"member 1: k is 2, member 0 has 1; the members' tensors "
                                                        r"have the same sizes, so this integer is not a size") as e:
        wc.compile([_IntScale(4, 1), _IntScale(4, 2)], torch.randn(5, 4), pad=True, config=FAST)
    assert "pad=True)" not in str(e.value)
    with pytest.raises(wc.WideCompileError, match=r"integer arguments differ between members") as e:
        wc.compile([_IntScale(4, 1), _IntScale(6, 2)], torch.randn(5, 4), pad=True, config=FAST)
    assert "size arguments" not in str(e.value)
