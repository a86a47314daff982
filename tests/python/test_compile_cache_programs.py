"""The compile cache keys the program a module runs, not only its class: two padded sweeps
(pad=True) of one class whose forwards take other Python branches on a plain attribute are two
entries (the padded members are graph modules whose generated code is the program; the cache key
once read only their class, so the second sweep ran the first sweep's graph)."""
from __future__ import annotations

import pytest
import torch
import wide_compiler as wc
from torch import nn

FAST = wc.WideConfig.fast()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """The compile cache on, in a directory of this test's own (the suite runs with it off)."""
    monkeypatch.setenv("WIDE_COMPILE_CACHE", "1")
    monkeypatch.setenv("WIDE_COMPILER_CACHE_DIR", str(tmp_path))
    return tmp_path


class Branchy(nn.Module):
    def __init__(self, kind, h: int) -> None:
        super().__init__()
        self.fc = nn.Linear(3, h)
        self.kind = kind

    def forward(self, x):
        t = self.fc(x)
        if callable(self.kind):
            return self.kind(t).sum(-1)
        return t.exp().sum(-1) if self.kind == "exp" else (t + 1).sum(-1)


@pytest.mark.parametrize("kinds", [("exp", "plus1"), (torch.exp, torch.cos),
                                   (lambda t: t * 2, lambda t: t * 3)], ids=["str", "builtin", "lambda"])
def test_padded_sweeps_that_branch_apart_are_two_entries(cache_dir, kinds):
    torch.manual_seed(0)
    x = torch.randn(2, 4, 3)
    for kind in kinds:
        members = [Branchy(kind, 3), Branchy(kind, 5)]
        wide = wc.compile(members, x[0], config=FAST, pad=True)
        out = wide(x)
        for i, m in enumerate(members):
            torch.testing.assert_close(out[i], m(x[i]), msg=lambda s, kind=kind, i=i: f"{kind} member {i}: {s}")
    assert len(list((cache_dir / "compiled").iterdir())) >= 2


def test_a_padded_sweep_compiled_again_is_a_hit(cache_dir):
    """The program's text is stable: the same padded sweep compiled twice uses one entry."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 3)
    members = [Branchy("exp", 3), Branchy("exp", 5)]
    wc.compile(members, x[0], config=FAST, pad=True)
    entries = sorted((cache_dir / "compiled").iterdir())
    wide = wc.compile(members, x[0], config=FAST, pad=True)
    assert sorted((cache_dir / "compiled").iterdir()) == entries
    torch.testing.assert_close(wide(x)[1], members[1](x[1]))
