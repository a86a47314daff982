"""Probe 5's state reads (Note [State a forward reads] in fx/state_reads.py): a numpy array global,
an environment variable, a functools.partial global, a custom autograd.Function's forward, another
module of the user's reached through an import inside forward or sys.modules. Each is guarded
(a change after compiling captures again: the wide model gives each member's own result) or named
in the warning at capture.
"""

from __future__ import annotations

import functools
import logging
import os
import sys

import numpy as np
import pytest
import torch

import wide_compiler as wc
from support import LinearModel, cpu_only
from wide_compiler.fx.code_reads import globals_read

N = 2
FAST = wc.WideConfig.fast()
NP = np.ones(4)
PART = functools.partial(torch.mul, other=1.0)
SCALE = 1.0


def _check(wide, members, x):
    out = wide(x)
    for i, m in enumerate(members):
        torch.testing.assert_close(out[i], m(x[i]), rtol=1e-12, atol=1e-12, msg=lambda s, i=i: f"member {i}: {s}")


def _compile(cls):
    torch.manual_seed(0)
    members = [cls().double() for _ in range(N)]
    return wc.compile(members, torch.randn(3, 4, dtype=torch.float64), config=FAST), members


class _Numpy(LinearModel):
    def forward(self, x):
        return self.fc(x) * torch.from_numpy(NP)


def test_a_numpy_array_global_is_named_at_capture(caplog):
    with caplog.at_level(logging.WARNING, logger="wide_compiler"):
        globals_read(_Numpy())
    assert "reads test_probe5_state.NP, mutable" in caplog.text


class _Env(LinearModel):
    def forward(self, x):
        h = self.fc(x)
        a = h.relu() if os.environ.get("WC_PROBE5_ACT", "relu") == "relu" else h.tanh()
        return a * (2.0 if os.getenv("WC_PROBE5_K") else 1.0) + ("WC_PROBE5_IN" in os.environ)


def test_an_environment_variable_read_is_guarded(monkeypatch):
    for key in ("WC_PROBE5_ACT", "WC_PROBE5_K", "WC_PROBE5_IN"):
        monkeypatch.delenv(key, raising=False)
    wide, members = _compile(_Env)
    x = torch.randn(N, 3, 4, dtype=torch.float64)
    _check(wide, members, x)
    for key, value in (("WC_PROBE5_ACT", "tanh"), ("WC_PROBE5_K", "1"), ("WC_PROBE5_IN", "")):
        monkeypatch.setenv(key, value)
        _check(wide, members, x)


class _Partial(LinearModel):
    def forward(self, x):
        return PART(self.fc(x))


def test_a_partial_global_is_named_at_capture(caplog):
    with caplog.at_level(logging.WARNING, logger="wide_compiler"):
        globals_read(_Partial())
    assert "reads test_probe5_state.PART, mutable" in caplog.text


class _Fn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * SCALE

    @staticmethod
    def backward(ctx, g):
        return g * SCALE


class _UsesFn(LinearModel):
    def forward(self, x):
        return _Fn.apply(self.fc(x))


def test_a_global_read_in_a_custom_functions_forward_is_guarded():
    assert ("test_probe5_state", "", "SCALE", 1.0) in globals_read(_UsesFn())[0]


CFGMOD = '''
X = 1.0
'''


class _LocalImport(LinearModel):
    def forward(self, x):
        import p5cfgmod as c

        return self.fc(x) * c.X


class _FromImport(LinearModel):
    def forward(self, x):
        from p5cfgmod import X

        return self.fc(x) * X


class _SysModules(LinearModel):
    def forward(self, x):
        return self.fc(x) * sys.modules["p5cfgmod"].X


@pytest.mark.parametrize("cls", [_LocalImport, _FromImport, _SysModules])
def test_a_global_of_a_module_imported_inside_forward_is_guarded(cls, tmp_path, monkeypatch):
    (tmp_path / "p5cfgmod.py").write_text(CFGMOD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "p5cfgmod", raising=False)
    import p5cfgmod

    assert ("p5cfgmod", "", "X", 1.0) in globals_read(cls())[0]
    if cls is _LocalImport:  # and end to end: a change after compiling captures again
        wide, members = _compile(cls)
        x = torch.randn(N, 3, 4, dtype=torch.float64)
        monkeypatch.setattr(p5cfgmod, "X", 3.0)
        _check(wide, members, x)


MASK = torch.ones(4, dtype=torch.float64)


class _Mask(LinearModel):
    def forward(self, x):
        return self.fc(x) * MASK


# CPU only: inside torch.compile the check is torch._assert_async on the tensor's device; on a GPU a
# failed one is a device-side assert, which ends the process's CUDA context (guide: On CUDA)
@cpu_only
def test_a_global_tensor_is_checked_inside_torch_compile_fullgraph(monkeypatch):
    # Dynamo's cache of WideModel.forward is shared by every wide model the process compiled: past
    # its recompile limit a call runs eagerly (captures again: right, but not the traced check)
    torch._dynamo.reset()
    monkeypatch.setattr(sys.modules[__name__], "MASK", torch.ones(4, dtype=torch.float64))
    wide, members = _compile(_Mask)
    x = torch.randn(N, 3, 4, dtype=torch.float64)
    compiled = torch.compile(wide, fullgraph=True, backend="eager")
    out = compiled(x)
    for i, m in enumerate(members):
        torch.testing.assert_close(out[i], m(x[i]), rtol=1e-12, atol=1e-12)
    MASK.mul_(2)  # changed in place after the trace: never the old values
    with pytest.raises(RuntimeError, match="test_probe5_state.MASK, a tensor the members' code reads"):
        compiled(x)
    _check(wide, members, x)  # eager: a graph for the new values


TABLE = {"w": [1.0, torch.ones(1)]}  # not plain: named at capture, not guarded


class _Table(LinearModel):
    def forward(self, x):
        return self.fc(x) * TABLE["w"][0]


def test_a_compile_cache_hit_names_what_is_not_guarded_again(cache_dir, caplog):
    from wide_compiler.fx import pipeline

    torch.manual_seed(0)
    members = [_Table().double() for _ in range(N)]
    wc.compile(members, torch.randn(3, 4, dtype=torch.float64), config=FAST)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="wide_compiler"), \
            pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "capture", lambda *a, **k: pytest.fail("captured: the compile cache missed"))
        wc.compile(members, torch.randn(3, 4, dtype=torch.float64), config=FAST)
    assert "reads test_probe5_state.TABLE, mutable" in caplog.text
    assert "loaded from the compile cache" in caplog.text


class _Gelu(LinearModel):
    def forward(self, x):
        return _F.gelu(self.fc(x))  # torch.nn.functional as a global of this module


_F = torch.nn.functional


def test_a_torch_function_patched_after_compiling_is_followed(monkeypatch):
    wide, members = _compile(_Gelu)
    x = torch.randn(N, 3, 4, dtype=torch.float64)
    monkeypatch.setattr(torch.nn.functional, "gelu", torch.tanh)
    _check(wide, members, x)
