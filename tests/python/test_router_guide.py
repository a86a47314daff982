"""The router guide's code (../shared/reference/router_guide.md) runs as written: its Basic
Pattern, Tower Registration (auto and manual), Inverse Pairs, Selective Execution, With Attention
Mask and Compilation sections, with the guide's own class, router and tower names. Each is
checked tower by tower against the same towers run alone (outputs, and gradients where the guide
trains).

The guide imports ``WideRouter``/``BaseTower`` from its own package; here they are
``wide_compiler.router.WideRouter`` and ``wide_compiler.router.Tower``. The guide leaves
``MyTower``, ``MyFusion``, ``Fusion`` and ``FibonacciTower`` to the user: they are defined below.
Compilation's Option 3 (``CompileRouter``) is another library's class and is not covered.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import Tensor, nn
from wide_compiler.router import Tower as BaseTower
from wide_compiler.router import CompileRouter, WideRouter
from wide_compiler.testing import assert_close
from support import DEVICE

DIM = 16


# -- the user's modules the guide refers to ------------------------------------------------------
class MyTower(BaseTower):
    def __init__(self, name: str, dim: int) -> None:
        super().__init__(name)
        self.net = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        y = self.net(x)
        return y if mask is None else y * mask


class MyFusion(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, opinions: dict[str, Tensor]) -> Tensor:
        return self.proj(torch.stack(list(opinions.values())).mean(0))


Fusion = MyFusion


class FibonacciTower(BaseTower):
    """Scales its input by normalised Fibonacci numbers; ``sign`` makes the inverse tower."""

    def __init__(self, name: str, dim: int, sign: int = +1) -> None:
        super().__init__(name)
        self.sign = sign
        fib = [1.0, 1.0]
        while len(fib) < dim:
            fib.append(fib[-1] + fib[-2])
        self.register_buffer("fib", torch.tensor(fib[:dim]) / fib[dim - 1])
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.sign * self.proj(x * self.fib)


# -- Basic Pattern (verbatim) -------------------------------------------------------------------
class MyCollective(WideRouter):
    def __init__(self, num_towers: int, dim: int):
        super().__init__('my_collective', auto_discover=True)

        # Attach towers
        for i in range(num_towers):
            self.attach(f'tower_{i}', MyTower(f'tower_{i}', dim))

        # Attach fusion (not a tower)
        self.attach('fusion', MyFusion(dim))

        # Discover towers before compile
        self.discover_towers()

    def forward(self, x: Tensor) -> Tensor:
        # wide_forward executes all registered towers
        opinions = self.wide_forward(x)  # Dict[str, Tensor]

        # Fuse opinions your way
        return self['fusion'](opinions)


# -- helpers ------------------------------------------------------------------------------------
def alone(router: WideRouter, x: Tensor, names=None, **kwargs) -> dict[str, Tensor]:
    """Every (selected) tower of a never-grouped router, run as itself."""
    return {n: router[n](x, **kwargs) for n in (names or router.tower_names)}


def data(batch: int = 8, seed: int = 0) -> Tensor:
    return torch.randn(batch, DIM, generator=torch.Generator(DEVICE).manual_seed(seed))


def seeded_with_reference(make) -> tuple[WideRouter, WideRouter, Tensor]:
    """``make()`` under seed 0, a deep copy of it that is never grouped (each tower runs as
    itself: the reference), and the data."""
    torch.manual_seed(0)
    router = make()
    return router, copy.deepcopy(router), data()


# -- Basic Pattern ------------------------------------------------------------------------------
def test_basic_pattern_matches_every_tower_alone_and_trains_the_same():
    torch.manual_seed(0)
    collective = MyCollective(4, DIM)
    ref = copy.deepcopy(collective)  # never grouped: each tower runs as itself
    assert collective.name == "my_collective"
    assert collective.tower_names == ["tower_0", "tower_1", "tower_2", "tower_3"]  # fusion is no tower
    assert collective["tower_2"].name == "tower_2" and isinstance(collective["fusion"], MyFusion)
    x = data()
    with pytest.warns(UserWarning, match="Create the optimizer after"):  # grouped at the first call
        y = collective(x)
    assert collective.group_members() == {"tower_0": ["tower_0", "tower_1", "tower_2", "tower_3"]}
    assert_close(y, ref["fusion"](alone(ref, x)), msg="MyCollective output")

    # one optimizer step, made after the first call, equals the towers trained alone
    opt = torch.optim.SGD(collective.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        opt.zero_grad()
        collective(x).square().mean().backward()
        opt.step()
        ref_opt.zero_grad()
        ref["fusion"](alone(ref, x)).square().mean().backward()
        ref_opt.step()
    x2 = data(seed=1)
    assert_close(collective(x2), ref["fusion"](alone(ref, x2)), msg="after two SGD steps")
    fresh = collective.unfuse()
    for n in ref.tower_names:
        for (k, got), (_, want) in zip(fresh[n].named_parameters(), ref[n].named_parameters()):
            assert_close(got, want, msg=f"{n}.{k} after training")


def test_basic_pattern_self_getitem_reaches_heads_and_live_views_of_fused_towers():
    torch.manual_seed(0)
    collective = MyCollective(3, DIM)
    x = data()
    collective.prepare_for_compile(x)
    view = collective["tower_1"]  # fused: a live view on the wide parameters
    assert_close(view(x), collective.wide_forward(x)["tower_1"])
    view(x).sum().backward()  # trains the wide parameters, row 1 only
    grad = collective.groups["tower_0"].get_parameter("net.0.weight").grad
    assert grad[1].abs().sum() > 0 and grad[0].abs().sum() == 0 and grad[2].abs().sum() == 0
    sd = view.state_dict()
    assert torch.equal(sd["net.0.weight"], collective.unfuse()["tower_1"].net[0].weight)
    with pytest.raises(RuntimeError, match=r"optimizer over router.parameters\(\)"):
        view.parameters()
    with pytest.raises(KeyError, match="no attached component 'nope'"):
        collective["nope"]


# -- Tower Registration -------------------------------------------------------------------------
def test_tower_registration_auto_discovery():
    class MyCollective(WideRouter):
        def __init__(self):
            super().__init__('collective', auto_discover=True)
            self.attach('tower_a', MyTower('tower_a', DIM))  # Auto-registered
            assert self.tower_names == ['tower_a']            # (as it comes)
            self.attach('fusion', Fusion(DIM))    # Not a tower, ignored
            self.discover_towers()

    torch.manual_seed(0)
    collective = MyCollective()
    assert collective.tower_names == ["tower_a"]
    x = data()
    collective.eval()
    assert_close(collective.wide_forward(x)["tower_a"], collective["tower_a"](x))


def test_tower_registration_manual():
    class MyCollective(WideRouter):
        def __init__(self):
            super().__init__('collective', auto_discover=False)
            self.attach('tower_a', MyTower('tower_a', DIM))
            assert self.tower_names == []            # not registered by attach
            self.register_tower('tower_a')  # Explicit

    torch.manual_seed(0)
    collective = MyCollective()
    assert collective.tower_names == ["tower_a"]
    x = data()
    ref = copy.deepcopy(collective["tower_a"])
    collective.eval()
    assert_close(collective.wide_forward(x)["tower_a"], ref(x))


# -- Inverse Pairs ------------------------------------------------------------------------------
class InversePairCollective(WideRouter):
    def __init__(self, dim: int):
        super().__init__('pairs', auto_discover=True)

        # Positive and negative towers
        self.attach('fib_pos', FibonacciTower('fib_pos', dim, sign=+1))
        self.attach('fib_neg', FibonacciTower('fib_neg', dim, sign=-1))

        self.discover_towers()

    def forward(self, x):
        opinions = self.wide_forward(x)
        # Combine inverse perspectives
        return opinions['fib_pos'] - opinions['fib_neg']


def test_inverse_pairs():
    pairs, ref, x = seeded_with_reference(lambda: InversePairCollective(DIM))
    pairs.eval()
    y = pairs(x)
    # the two signs are two programs: never one wide model running one sign for both
    assert pairs.group_members() == {"fib_pos": ["fib_pos"], "fib_neg": ["fib_neg"]}
    assert_close(y, ref["fib_pos"](x) - ref["fib_neg"](x))
    with torch.no_grad():  # the same weights under both signs: the inverse perspective exactly
        pairs["fib_neg"].load_state_dict(pairs["fib_pos"].state_dict())
    torch.testing.assert_close(pairs(x), 2 * pairs["fib_pos"](x))


def test_inverse_pairs_of_several_towers_fuse_by_sign():
    class InversePairs(WideRouter):
        def __init__(self, dim: int):
            super().__init__('pairs', auto_discover=True)
            for k in range(2):
                self.attach(f'fib_pos{k}', FibonacciTower(f'fib_pos{k}', dim, sign=+1))
                self.attach(f'fib_neg{k}', FibonacciTower(f'fib_neg{k}', dim, sign=-1))
            self.discover_towers()

    pairs, ref, x = seeded_with_reference(lambda: InversePairs(DIM))
    pairs.eval()
    outs = pairs.wide_forward(x)
    assert pairs.group_members() == {"fib_pos0": ["fib_pos0", "fib_pos1"], "fib_neg0": ["fib_neg0", "fib_neg1"]}
    for n, want in alone(ref, x).items():
        assert_close(outs[n], want, msg=n)


# -- Selective Execution ------------------------------------------------------------------------
class FusingCollective(MyCollective):
    """Selective Execution and With Attention Mask call ``self.fuse(opinions)``, which the guide
    leaves to the user: here, its fusion head."""

    def fuse(self, opinions):
        return self['fusion'](opinions)


class SelectiveCollective(FusingCollective):
    def forward(self, x, use_towers=None):
        # Execute subset of towers
        opinions = self.wide_forward(x, tower_names=use_towers)
        return self.fuse(opinions)


class MaskedCollective(FusingCollective):  # With Attention Mask, below
    def forward(self, x, mask=None):
        opinions = self.wide_forward(x, mask=mask)
        return self.fuse(opinions)


def test_selective_execution():
    collective, ref, x = seeded_with_reference(lambda: SelectiveCollective(4, DIM))
    collective.prepare_for_compile(x)
    use = ["tower_0", "tower_2"]
    y = collective(x, use_towers=use)
    assert_close(y, ref["fusion"](alone(ref, x, use)), msg="subset")
    y.sum().backward()
    grad = collective.groups["tower_0"].get_parameter("net.0.weight").grad
    assert grad[0].abs().sum() > 0 and grad[2].abs().sum() > 0
    assert grad[1].abs().sum() == 0 and grad[3].abs().sum() == 0  # unselected towers: untouched
    assert_close(collective(x), ref["fusion"](alone(ref, x)), msg="use_towers=None: every tower")


# -- With Attention Mask ------------------------------------------------------------------------
def test_with_attention_mask():
    collective, ref, x = seeded_with_reference(lambda: MaskedCollective(3, DIM))
    mask = (torch.rand(8, 1, generator=torch.Generator(DEVICE).manual_seed(2)) > 0.4).float()
    collective.prepare_for_compile(x, mask=mask)
    assert_close(collective(x, mask=mask), ref["fusion"](alone(ref, x, mask=mask)), msg="masked")
    x7, mask7 = data(7, seed=3), torch.ones(7, 1)  # another batch size
    assert_close(collective(x7, mask=mask7), ref["fusion"](alone(ref, x7, mask=mask7)), msg="batch 7")
    with pytest.warns(UserWarning, match="compiled for other inputs"):  # mask=None: other structure
        y = collective(x)
    assert_close(y, ref["fusion"](alone(ref, x)), msg="mask=None")


# -- Compilation --------------------------------------------------------------------------------
class Model(nn.Module):
    """``model.collective`` of the guide's Option 1."""

    def __init__(self) -> None:
        super().__init__()
        self.collective = MyCollective(4, DIM)

    def forward(self, x):
        return self.collective(x)


def fresh_model_with_reference() -> tuple[Model, WideRouter, Tensor]:
    """Options 1 and 3: dynamo reset, the guide's ``Model`` under seed 0, a never-grouped copy of
    its collective (the reference) and the data."""
    torch.compiler.reset()
    model, ref, x = seeded_with_reference(Model)
    return model, ref.collective, x


def test_compilation_option_1_explicit_preparation():
    model, ref, x = fresh_model_with_reference()

    # Option 1: Explicit preparation
    model.collective.prepare_for_compile()
    model = torch.compile(model, mode='reduce-overhead')

    model.eval()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        y = model(x)
    assert not [w for w in record if "WideRouter" in str(w.message)]  # eval: grouped silently
    assert model.collective.group_members() == {"tower_0": ["tower_0", "tower_1", "tower_2", "tower_3"]}
    assert_close(y, ref["fusion"](alone(ref, x)), msg="compiled model")
    assert_close(model(x), ref["fusion"](alone(ref, x)), msg="compiled model, second call")


def test_compilation_option_2_widerouters_compile_method():
    torch.compiler.reset()
    collective, ref, x = seeded_with_reference(lambda: MyCollective(4, DIM))

    # Option 2: Use WideRouter's compile method
    compiled_collective = collective.compile(mode='reduce-overhead')

    assert compiled_collective is collective
    with pytest.warns(UserWarning, match="Create the optimizer after"):  # training mode, grouped now
        y = compiled_collective(x)
    assert sorted(collective._compiled) == ["tower_0"]  # the group is torch.compile'd
    assert_close(y, ref["fusion"](alone(ref, x)), msg="compiled collective")
    opt = torch.optim.SGD(compiled_collective.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for model, o, fwd in ((compiled_collective, opt, compiled_collective), (ref, ref_opt, None)):
        o.zero_grad()
        out = fwd(x) if fwd is not None else ref["fusion"](alone(ref, x))
        out.square().mean().backward()
        o.step()
    assert_close(compiled_collective(x), ref["fusion"](alone(ref, x)), msg="after a step")


def test_compilation_optimizer_made_before_the_first_call_is_refused_at_step():
    """The guide's order prepare_for_compile() -> optimizer -> first call: grouping at that call
    replaces the parameters, so the optimizer's step says how to fix it (never trains nothing)."""
    torch.manual_seed(0)
    collective = MyCollective(2, DIM)
    collective.prepare_for_compile()
    opt = torch.optim.Adam(collective.parameters(), lr=1e-3)
    collective.eval()  # a sanity check in eval mode groups too
    collective(data())
    collective.train()
    collective(data()).sum().backward()
    with pytest.raises(RuntimeError, match=r"Create the optimizer after grouping.*prepare_for_compile"):
        opt.step()


def test_compilation_option_3_and_integration_with_compilerouter():
    model, ref, x = fresh_model_with_reference()

    # Option 3: With CompileRouter (call prepare first)
    model.collective.prepare_for_compile()  # ← Don't forget this!
    compiler = CompileRouter.from_module(model)
    compiler.compile_towers()               # the Integration section's step
    model = compiler.compile(mode='reduce-overhead')

    model.eval()
    y = model(x)
    assert model.collective.group_members() == {"tower_0": ["tower_0", "tower_1", "tower_2", "tower_3"]}
    assert sorted(model.collective._compiled) == ["tower_0"]  # compile_towers: the group is compiled
    assert_close(y, ref["fusion"](alone(ref, x)), msg="CompileRouter model")
    with pytest.raises(ValueError, match="holds no WideRouter"):
        CompileRouter.from_module(nn.Linear(2, 2)).compile_towers()
