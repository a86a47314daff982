"""Probe 9 findings on the API around a wide model (each test fails before its fix):

- P9-20: ``torch.nn.utils.clip_grad_norm_`` (and ``clip_grads_with_norm_``, ``get_total_norm``) over
  a wide model's parameters took ONE norm over all members, silently; refused now, pointing to
  ``wc.optim.clip_grad_norm_`` (Note [torch's norm clipping over a wide model], torch_guards.py).
- P9-21: ``compile(model, sample, n=K)`` left a raw ``nn.Parameter`` no ``reset_parameters()``
  covers the same in all K members, silently; refused now, naming it (Note [One model and n=K]).
- P9-24: a member's top-level submodule named ``_per_member`` with a per-member constant: a bare
  ``KeyError`` at the first call; a clear refusal at compile now.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import wide_compiler as wc
from wide_compiler.errors import UnsupportedOperationError, WideCompileError

FAST = wc.WideConfig.fast()


def _wide_with_grads(n: int = 3):
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)) for _ in range(n)]
    wide = wc.compile(copy.deepcopy(models), torch.randn(5, 4), config=FAST)
    x = torch.randn(n, 5, 4) * torch.tensor([1.0, 10.0, 100.0][:n]).view(n, 1, 1)
    wide(x).square().sum().backward()
    return wide


def _grads(wide):
    return [p.grad.clone() for p in wide.parameters()]


# -- P9-20 ----------------------------------------------------------------------------------
@pytest.mark.parametrize("call", [
    lambda ps: torch.nn.utils.clip_grad_norm_(ps, 1.0),
    lambda ps: torch.nn.utils.clip_grad_norm_(parameters=ps, max_norm=1.0),
    lambda ps: torch.nn.utils.clip_grad.clip_grad_norm_(ps, 1.0),
    lambda ps: torch.nn.utils.clip_grads_with_norm_(ps, 1.0, torch.tensor(5.0)),
], ids=["clip_grad_norm_", "keywords", "clip_grad.clip_grad_norm_", "clip_grads_with_norm_"])
def test_torch_norm_clipping_of_wide_parameters_refused(call):
    wide = _wide_with_grads()
    before = _grads(wide)
    with pytest.raises(UnsupportedOperationError, match=r"(?s)ONE norm over all.*wide_compiler\.optim\.clip_grad_norm_"):
        call(wide.parameters())
    assert all(torch.equal(p.grad, b) for p, b in zip(wide.parameters(), before))  # nothing changed


def test_torch_clip_grad_norm_imported_before_compile_refused():
    import torch.nn.utils.clip_grad as cg

    original = getattr(cg.clip_grad_norm_, "_wide_compiler_wraps", cg.clip_grad_norm_)  # as imported at start
    wide = _wide_with_grads()
    with pytest.raises(UnsupportedOperationError, match="ONE norm"):
        original(wide.parameters(), 1.0)  # reaches the module's _clip_grads_with_norm_, which refuses


def test_torch_get_total_norm_of_wide_gradients_refused():
    wide = _wide_with_grads()
    with pytest.raises(UnsupportedOperationError, match=r"get_total_norm.*(?s:.*)member_grad_norms"):
        torch.nn.utils.get_total_norm([p.grad for p in wide.parameters()])


def test_torch_clipping_of_wide_and_plain_parameters_refused():
    wide = _wide_with_grads()
    head = nn.Linear(2, 1)
    head(torch.randn(3, 2)).sum().backward()
    with pytest.raises(UnsupportedOperationError, match=r"together with 2 tensor"):
        torch.nn.utils.clip_grad_norm_([*wide.parameters(), *head.parameters()], 1.0)


def test_torch_clipping_unchanged_for_plain_parameters_and_value_clipping():
    wide = _wide_with_grads()  # the wrappers are installed
    torch.manual_seed(1)
    m = nn.Linear(4, 3)
    m(torch.randn(5, 4) * 100).sum().backward()
    before = [p.grad.clone() for p in m.parameters()]
    expected_total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in before]))
    assert torch.equal(torch.nn.utils.get_total_norm([p.grad for p in m.parameters()]), expected_total)
    total = torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    assert torch.equal(total, expected_total)
    coef = torch.clamp(1.0 / (expected_total + 1e-6), max=1.0)
    assert all(torch.equal(p.grad, g * coef) for p, g in zip(m.parameters(), before))
    torch.nn.utils.clip_grad_value_(wide.parameters(), 0.5)  # elementwise: allowed
    assert max(float(p.grad.abs().max()) for p in wide.parameters()) <= 0.5


def test_per_member_clipping_still_exact():
    wide = _wide_with_grads()
    norms = wc.optim.clip_grad_norm_(wide.parameters(), 1.0)
    assert norms.shape == (3,)


# -- P9-21 ----------------------------------------------------------------------------------
class _RawParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))  # no reset_parameters() draws it again
        self.fc = nn.Linear(4, 4)
        self.emb = nn.Embedding(5, 4)

    def forward(self, x):
        return self.fc(x) @ self.w + self.emb.weight[:1]


class _RandomBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("b", torch.randn(4))
        self.cls = nn.Parameter(torch.zeros(4))  # a constant: what every fresh model has, fine
        self.norm = nn.LayerNorm(4)  # reset to ones/zeros, the model's values too: fine

    def forward(self, x):
        return self.norm(self.fc(x) + self.b + self.cls)


def test_n_k_parameter_no_reset_covers_refused():
    torch.manual_seed(0)
    m = _RawParameter()
    before = copy.deepcopy(m.state_dict())
    with pytest.raises(ValueError, match=r"(?s)parameter\(s\) w again.*list of 3 models.*reset_parameters\(\)"):
        wc.compile(m, torch.randn(2, 4), n=3, config=FAST)
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in before.items())  # the model is untouched


def test_n_k_buffer_no_reset_covers_warned_and_reset_ones_pass():
    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        wide = wc.compile(_RandomBuffer(), torch.randn(2, 4), n=3, config=FAST)
    msgs = [str(x.message) for x in w if "n=3" in str(x.message)]
    assert len(msgs) == 1 and "buffer(s) b" in msgs[0], msgs
    weight = dict(wide.named_parameters())["fc.weight"]
    assert not torch.equal(weight[0], weight[1])  # reset: independent


def test_n_k_model_all_reset_no_warning():
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        wc.compile(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2)), torch.randn(2, 4), n=2,
                   config=FAST)


# -- P9-24 ----------------------------------------------------------------------------------
class _NamedPerMember(nn.Module):
    def __init__(self, t):
        super().__init__()
        self.bias = t
        self._per_member = nn.Linear(4, 4)

    def forward(self, x):
        return self._per_member(x) * self.bias


def test_submodule_named_per_member_refused():
    with pytest.raises(WideCompileError, match=r"'_per_member'.*rename it"):
        wc.compile([_NamedPerMember(0.5), _NamedPerMember(2.0)], torch.randn(2, 4), config=FAST)
