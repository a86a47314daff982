"""The compile cache keys the program a module runs, not only its class: two padded sweeps
(pad=True) of one class whose forwards take other Python branches on a plain attribute are two
entries (the padded members are graph modules whose generated code is the program; the cache key
once read only their class, so the second sweep ran the first sweep's graph)."""
from __future__ import annotations

import pytest
import torch
import wide_compiler as wc
from support import cache_entries
from torch import nn

FAST = wc.WideConfig.fast()


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
    assert len(cache_entries(cache_dir)) >= 2


def test_a_padded_sweep_compiled_again_is_a_hit(cache_dir):
    """The program's text is stable: the same padded sweep compiled twice uses one entry."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 3)
    members = [Branchy("exp", 3), Branchy("exp", 5)]
    wc.compile(members, x[0], config=FAST, pad=True)
    entries = cache_entries(cache_dir)
    wide = wc.compile(members, x[0], config=FAST, pad=True)
    assert cache_entries(cache_dir) == entries
    torch.testing.assert_close(wide(x)[1], members[1](x[1]))


_EXEC_SOURCE = """
import torch
from torch import nn


class Made(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return {body}
"""


def _made_by_exec(body: str) -> type:
    """A class made by exec() in a namespace without ``__name__`` (as generated code often is): its
    ``__module__`` says ``builtins``."""
    namespace: dict = {}
    exec(compile(_EXEC_SOURCE.format(body=body), "<generated>", "exec"), namespace)  # noqa: S102 -- the test's own source
    assert namespace["Made"].__module__ == "builtins"
    return namespace["Made"]


def test_classes_made_by_exec_are_keyed_by_their_code(cache_dir):
    """A class whose ``__module__`` is a library's name but which does not live there is the user's:
    its code is keyed (the cache took such classes for builtins' and keyed none of their code, so
    the model fuzzer's generated programs of one structure shared entries: wrong outputs and
    shapes)."""
    torch.manual_seed(0)
    x = torch.randn(2, 4, 3)
    for body in ("self.fc(x).relu()", "self.fc(x).sum(-1)", "self.fc(x) * 2"):
        made = _made_by_exec(body)
        members = [made() for _ in range(2)]
        wide = wc.compile(members, x[0], config=FAST)
        out = wide(x)
        for i, m in enumerate(members):
            torch.testing.assert_close(out[i], m(x[i]), msg=lambda s, body=body, i=i: f"{body} member {i}: {s}")


def _scaled(self, x, k):
    return self.fc(x) * k


def test_a_partialmethod_forward_is_keyed_by_its_bound_arguments(cache_dir, monkeypatch):
    """``forward = functools.partialmethod(f, k=...)``: k is part of the program (the second
    compile loaded the first's graph)."""
    import functools

    class Bound(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

    x = torch.randn(2, 4, 3)
    for k in (2.0, 4.0):
        monkeypatch.setattr(Bound, "forward", functools.partialmethod(_scaled, k=k), raising=False)
        members = [Bound(), Bound()]
        out = wc.compile(members, x[0], config=FAST)(x)
        for i, m in enumerate(members):
            torch.testing.assert_close(out[i], m(x[i]), msg=lambda s, k=k, i=i: f"k={k} member {i}: {s}")
