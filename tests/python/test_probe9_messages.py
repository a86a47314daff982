"""Probe 9 of issue 44: the messages of findings P9-3, P9-4, P9-10 and P9-12, each a test that
failed before its fix (what, where, why, what to do; never a misleading cause).

P9-3: a capture needed inside torch.func.vmap/grad was reported as a forward torch.export cannot
capture ("Expected FakeTensor") with advice to restructure it (Note [No capture under a torch.func
transform] in wide_compiler/model_calls.py). P9-4: a padded model's own explanation of a size it
cannot take came wrapped in the generic export failure and its advice. P9-10: a size outside the
range export recorded for a size test said each member "fails or runs another branch". P9-12: a
non-tensor where the sample had a tensor said the model "was compiled with None"."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import wide_compiler as wc

FAST = wc.WideConfig.fast()
N = 3


def _mlps() -> list[nn.Module]:
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1)).double() for _ in range(N)]


def test_p9_3_a_capture_under_vmap_says_to_call_once_outside_the_transform():
    members = _mlps()
    wide = wc.compile(copy.deepcopy(members), torch.randn(5, 6, dtype=torch.float64), config=FAST)
    x = torch.randn(N, 4, 6, dtype=torch.float64)
    params = {k: v.detach() for k, v in wide.named_parameters()}

    def loss(p, xb):  # the per-sample-gradient recipe: a batch of 1 per member
        return functional_call(wide, p, (xb.unsqueeze(1),)).sum()

    with pytest.raises(ValueError) as e:
        vmap(grad(loss), in_dims=(None, 1))(params, x)
    message = str(e.value)
    assert "no graph can be captured under a torch.func transform" in message, message
    assert "Call the wide model once outside the transform" in message, message
    assert "input 'input': [3, 1, 6]" in message, message
    assert "could not capture" not in message and "make the forward exportable" not in message, message

    wide(torch.randn(N, 1, 6, dtype=torch.float64))  # as the message says: then the transform runs
    grads = vmap(grad(loss), in_dims=(None, 1))(params, x)
    for i, m in enumerate(members):
        for b in range(x.shape[1]):
            m.zero_grad()
            m(x[i, b:b + 1]).sum().backward()
            for name, p in m.named_parameters():
                torch.testing.assert_close(grads[name][b][i], p.grad, rtol=1e-12, atol=1e-12)


class _BatchNormed(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.fc, self.bn, self.out = nn.Linear(6, c), nn.BatchNorm1d(c), nn.Linear(c, 2)

    def forward(self, x):
        return self.out(self.bn(self.fc(x)))


def test_p9_4_a_padded_model_called_with_a_batch_of_1_says_only_why():
    torch.manual_seed(0)
    members = [_BatchNormed(c) for c in (3, 9)]
    wide = wc.compile(copy.deepcopy(members), torch.randn(4, 6), pad=True, config=FAST).eval()
    with pytest.raises(ValueError) as e:
        wide(torch.randn(2, 1, 6))
    message = str(e.value)
    assert message.startswith("wide_compiler: pad=True: dim 0 of input 0 is 1"), message
    assert "compile the members without pad=True" in message, message
    for wrapped in ("could not capture", "make the forward exportable", "capturing the eval graph", "torch.cond"):
        assert wrapped not in message, message


class _Threshold(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.fc, self.kind = nn.Linear(4, 4), kind

    def forward(self, x):
        b, t, _ = x.shape
        h = self.fc(x)
        return h * 2 if (t >= 5 if self.kind == "length" else b <= 6) else torch.tanh(h)


@pytest.mark.parametrize("kind, shape, where, side", [
    ("length", (2, 1), "input 'x' dim 2 is 1, but the captured graph holds for sizes 5 or more", "under 5"),
    ("batch", (8, 30), "input 'x' dim 1 is 8, but the captured graph holds for sizes up to 6", "over 6"),
])
def test_p9_10_a_size_outside_a_tested_range_is_refused_saying_a_member_may_branch(kind, shape, where, side):
    torch.manual_seed(0)
    members = [_Threshold(kind).double() for _ in range(N)]
    wide = wc.compile(copy.deepcopy(members), torch.randn(2, 30, 4, dtype=torch.float64), config=FAST)
    x = torch.randn(N, *shape, 4, dtype=torch.float64)
    for i, m in enumerate(members):
        m(x[i])  # each member runs there: the message must not say it fails
    with pytest.raises(ValueError) as e:
        wide(x)
    message = str(e.value)
    assert where in message, message
    assert "each member fails" not in message, message
    assert "a member may take another branch" in message, message
    assert f"for sizes {side}, compile a separate wide model with a sample whose dim" in message, message


@pytest.fixture(scope="module")
def linear_wide():
    torch.manual_seed(0)
    return wc.compile([nn.Linear(4, 4) for _ in range(N)], torch.randn(2, 4), config=FAST)


@pytest.mark.parametrize("value, got", [
    (1.0, "got the float 1.0"),
    (np.arange(24, dtype=np.float32).reshape(3, 2, 4) + 0.5, "got a numpy.ndarray of shape [3, 2, 4] (float32)"),
])
def test_p9_12_a_non_tensor_where_the_sample_had_a_tensor_says_a_tensor_is_needed(linear_wide, value, got):
    with pytest.raises(ValueError) as e:
        linear_wide(value)
    message = str(e.value)
    assert "input 'input' must be a tensor [3, B, 4] (N-first" in message, message
    assert got in message and "torch.as_tensor" in message, message
    assert "compiled with None" not in message and "compile again for another value" not in message, message
    assert "23.5" not in message, message  # an array's contents are not printed


def test_p9_12_a_nested_list_of_numbers_is_told_to_become_a_tensor(linear_wide):
    with pytest.raises(ValueError, match=r"positional input 0 is a list of 3 .*in the sample it is a tensor "
                                         r"\[2, 4\].*torch\.as_tensor"):
        linear_wide([[[1.0] * 4] * 2] * N)
