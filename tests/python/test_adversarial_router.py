"""Adversarial cases for WideRouter (issue 24): each was silently wrong or an unclear error.

* an optimizer made from ``router.parameters()`` before grouping trained nothing, without a word
  when grouping happened in eval mode (and with only a warning in train mode);
* a Parameter registered on the router and also used by a tower was untied by grouping;
* towers of one group given per-tower inputs of different batch sizes raised a bare
  ``torch.stack`` error.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import wide_compiler as wc
from torch import nn
from wide_compiler.router import Tower, WideRouter

FAST = wc.WideConfig.fast()


class Lin(Tower):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x)


def router_of(n: int = 3) -> WideRouter:
    torch.manual_seed(0)
    router = WideRouter(config=FAST)
    for i in range(n):
        router.attach(f"t{i}", Lin())
    router.attach("head", nn.Linear(3, 1))
    router.discover_towers()
    return router


def loss(router: WideRouter, x: torch.Tensor) -> torch.Tensor:
    return sum(router.head(o).square().mean() for o in router.wide_forward(x).values())


# -- an optimizer holding parameters grouping replaced -----------------------------------------
def test_stale_optimizer_after_eval_mode_grouping_raises_at_step():
    router = router_of()
    opt = torch.optim.SGD(router.parameters(), lr=0.1)  # before grouping
    x = torch.randn(5, 4)
    router.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a sanity check in eval mode: nothing to warn about yet
        router.wide_forward(x)         # groups: the towers' parameters are now the wide ones
    router.train()
    opt.zero_grad()
    loss(router, x).backward()
    with pytest.raises(RuntimeError, match=r"towers \['t0', 't1', 't2'\].*prepare_for_compile\(sample_input\)"):
        opt.step()


def test_stale_optimizer_after_train_mode_grouping_raises_at_step_not_only_warns():
    router = router_of()
    opt = torch.optim.Adam(router.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    with pytest.warns(UserWarning, match="Create the optimizer after"):
        loss(router, x).backward()
    with pytest.raises(RuntimeError, match="stepping it would train nothing"):
        opt.step()


def test_stale_optimizer_after_regrouping_raises_at_step():
    router = router_of()
    x = torch.randn(5, 4)
    router.prepare_for_compile(x)
    opt = torch.optim.SGD(router.parameters(), lr=0.1)  # the wide parameters
    router.register_tower("t3", Lin())  # ungroups: the next call groups anew, with new parameters
    with pytest.warns(UserWarning, match="Create the optimizer after"):
        loss(router, x).backward()
    with pytest.raises(RuntimeError, match="ungrouped"):
        opt.step()


# -- a Parameter of the router also used by a tower ----------------------------------------------
class Scaled(Tower):
    """Reads a scale it does not register (a reference to the router's parameter)."""

    def __init__(self, scale: nn.Parameter) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        object.__setattr__(self, "scale", scale)

    def forward(self, x):
        return self.fc(x) * self.scale


class RegScaled(Tower):
    """Registers the scale it is given as its own parameter."""

    def __init__(self, scale: nn.Parameter) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.scale = scale

    def forward(self, x):
        return self.fc(x) * self.scale


class SharedScale(WideRouter):
    """A scale registered on the router; tower t0 uses it too (t1, t2 have their own)."""

    def __init__(self, tower: type) -> None:
        super().__init__(config=FAST)
        self.scale = nn.Parameter(torch.full((3,), 2.0))
        for i in range(3):
            self.attach(f"t{i}", tower(self.scale if i == 0 else nn.Parameter(torch.full((3,), 2.0))))
        self.discover_towers()

    def forward(self, x):  # the router uses its scale too
        return sum(o.sum() for o in self.wide_forward(x).values()) * self.scale.mean()


@pytest.mark.parametrize("tower", [Scaled, RegScaled], ids=["plain_attribute", "registered"])
def test_router_parameter_used_by_a_tower_stays_tied_after_grouping(tower):
    torch.manual_seed(0)
    router = SharedScale(tower)
    ref = copy.deepcopy(router)  # trained eagerly, tower by tower
    x = torch.randn(5, 4)
    if tower is RegScaled:
        with pytest.warns(UserWarning, match=r"shares its tensor .*the router itself.*untie"):
            router.prepare_for_compile(x)
    else:  # each tower reads its own unregistered Parameter: not one program (Note [Tensors held outside the member])
        router.prepare_for_compile(x)
        assert not router.groups
    opt = torch.optim.SGD(router.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    opt.zero_grad()
    router(x).backward()
    opt.step()
    ref_opt.zero_grad()
    (sum(ref.get_submodule(n)(x).sum() for n in ref.tower_names) * ref.scale.mean()).backward()
    ref_opt.step()
    got = router.wide_forward(x)
    for n in ref.tower_names:
        torch.testing.assert_close(got[n], ref.get_submodule(n)(x), msg=f"tower {n} after one SGD step")
    torch.testing.assert_close(router.scale, ref.scale)


def test_plain_attribute_parameter_shared_by_the_towers_of_a_group_is_not_untied():
    torch.manual_seed(0)
    shared = nn.Parameter(torch.full((3,), 2.0))
    router = WideRouter(config=FAST)
    for i in range(3):
        router.attach(f"t{i}", Scaled(shared))
    router.discover_towers()
    x = torch.randn(5, 4)
    with pytest.warns(UserWarning, match=r"share one Parameter \[3\]"):
        router.prepare_for_compile(x)
    assert not router.groups
    router.wide_forward(x)["t1"].sum().backward()
    assert shared.grad is not None and shared.grad.abs().sum() > 0  # trained, as the towers alone


# -- per-tower inputs of different shapes ----------------------------------------------------------
def test_per_tower_inputs_of_different_batch_sizes_name_towers_shapes_and_why():
    router = router_of(2)
    router.prepare_for_compile(torch.randn(5, 4))
    with pytest.raises(ValueError, match=r"towers \['t0', 't1'\] are one group.*stacks their per-tower "
                                         r"inputs.*args\[0\] differ \('t0': \[5, 4\].*'t1': \[7, 4\]"):
        router.wide_forward({"t0": torch.randn(5, 4), "t1": torch.randn(7, 4)})


def test_per_tower_keyword_inputs_of_different_dtypes_are_named():
    torch.manual_seed(0)

    class Masked(Tower):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x, mask):
            return self.fc(x) * mask

    router = WideRouter(config=FAST)
    for i in range(2):
        router.register_tower(f"m{i}", Masked())
    x = torch.randn(5, 4)
    router.prepare_for_compile(x, torch.ones(5, 1))
    with pytest.raises(ValueError, match=r"args\[1\] differ \('m0': \[5, 1\] torch.float32.*'m1': \[5, 1\] "
                                         r"torch.float64"):
        router.wide_forward({"m0": (x, torch.ones(5, 1)), "m1": (x, torch.ones(5, 1, dtype=torch.float64))})
