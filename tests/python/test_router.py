"""WideRouter: towers grouped by program, each group one WideModel; checked tower by tower
against every tower called alone (outputs, parameter gradients, buffers), train and eval."""
from __future__ import annotations

import copy
import pickle
import re
import warnings

import pytest
import torch
import wide_compiler as wc
from torch import nn
from wide_compiler.router import Tower, WideRouter
from wide_compiler.testing import assert_close, make_members

from support import DEVICE
from support import router_with_refs as build  # a router over the towers, and reference copies of them

FAST = wc.WideConfig.fast()


class MLPTower(Tower):
    def __init__(self, hidden: int = 8) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, hidden), nn.GELU(), nn.Linear(hidden, 3))

    def forward(self, x, mask=None):
        y = self.net(x)
        return y if mask is None else y * mask


class NormTower(Tower):
    """A second architecture, with buffers (BatchNorm running statistics)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x, mask=None):
        y = self.out(torch.relu(self.bn(self.fc(x))))
        return y if mask is None else y * mask


class SignTower(Tower):
    """Differs from its inverse only in a Python constant read in forward."""

    def __init__(self, sign: int) -> None:
        super().__init__()
        self.sign = sign
        self.fc = nn.Linear(6, 3)

    def forward(self, x, mask=None):
        y = self.sign * self.fc(x)
        return y if mask is None else y * mask


class BranchyTower(Tower):
    """Data-dependent Python control flow: torch.export cannot capture it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x, mask=None):
        y = self.fc(x)
        if y.sum() > 0:
            y = -y
        return y if mask is None else y * mask


def mixed_towers() -> dict[str, nn.Module]:
    torch.manual_seed(0)
    towers = {f"a{i}": MLPTower(8) for i in range(3)}
    towers.update({f"b{i}": MLPTower(16) for i in range(2)})
    towers.update({f"n{i}": NormTower() for i in range(2)})
    towers["s0"] = SignTower(+1)
    return towers


def sample(batch: int = 5, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(DEVICE).manual_seed(seed)
    return torch.randn(batch, 6, generator=g), (torch.rand(batch, 1, generator=g) > 0.3).float()


def tower_tensors(router: WideRouter, name: str) -> dict[str, torch.Tensor]:
    """Tower ``name``'s live parameters and buffers: its rows of the wide tensors when grouped."""
    for key, members in router._members.items():
        if name in members:
            wide, i = router.groups[key], members.index(name)
            params, buffers = wide._member_names()
            return {p: wide._stacked(p)[i] for p in (*params, *buffers)}
    mod = router._modules[name]
    return dict([*mod.named_parameters(), *mod.named_buffers()])


def tower_grads(router: WideRouter, name: str) -> dict[str, torch.Tensor | None]:
    for key, members in router._members.items():
        if name in members:
            wide, i = router.groups[key], members.index(name)
            return {p: None if wide._stacked(p).grad is None else wide._stacked(p).grad[i]
                    for p in wide._member_names()[0]}
    return {p: t.grad for p, t in router._modules[name].named_parameters()}


def check_call(router, refs, inputs: dict[str, tuple], kwargs: dict, names=None, grads=True) -> dict:
    """Run the router (shared or per-tower inputs) and every selected tower alone; compare outputs,
    parameter gradients of a fixed random cotangent, and buffers."""
    names = list(names or router.tower_names)
    shared = len({id(v) for v in inputs.values()}) == 1
    args = next(iter(inputs.values())) if shared else ({n: inputs[n] for n in names},)
    router.zero_grad(set_to_none=True)
    outs = router.wide_forward(*args, tower_names=names, **kwargs)
    assert list(outs) == names
    g = torch.Generator(DEVICE).manual_seed(7)
    cot = {n: torch.randn(outs[n].shape, generator=g) for n in names}
    if grads:
        sum((outs[n] * cot[n]).sum() for n in names).backward()
    for n in names:
        ref = refs[n]
        ref.zero_grad(set_to_none=True)
        want = ref(*inputs[n], **kwargs)
        assert_close(outs[n], want, msg=f"output of tower {n}")
        if grads:
            (want * cot[n]).sum().backward()
            got = tower_grads(router, n)
            for p, t in ref.named_parameters():
                assert got[p] is not None, f"tower {n}: no gradient for {p}"
                assert_close(got[p], t.grad, kind="grad", msg=f"grad of {n}.{p}")
        live = tower_tensors(router, n)
        for b, t in ref.named_buffers():
            assert_close(live[b], t, kind="buffer", msg=f"buffer {n}.{b}")
    return outs


def test_homogeneous_shared_inputs_train_and_eval():
    router, refs = build({f"t{i}": m for i, m in enumerate(make_members(lambda: MLPTower(8), 4))})
    x, mask = sample()
    router.prepare_for_compile(x, mask=mask)
    assert router.group_members() == {"t0": ["t0", "t1", "t2", "t3"]}
    assert isinstance(router.groups["t0"], wc.WideModel)
    shared = (x,)
    check_call(router, refs, {n: shared for n in refs}, {"mask": mask})
    x7, mask7 = sample(batch=7, seed=3)  # another batch size: the batch dim is dynamic
    check_call(router, refs, {n: (x7,) for n in refs}, {"mask": mask7})
    router.eval()
    [r.eval() for r in refs.values()]
    assert not router.groups["t0"].training
    check_call(router, refs, {n: shared for n in refs}, {"mask": mask}, grads=False)


def test_mixed_architectures_grouped_by_program_train_and_eval():
    router, refs = build(mixed_towers())
    x, mask = sample()
    router.prepare_for_compile(x, mask=mask)
    assert router.group_members() == {"a0": ["a0", "a1", "a2"], "b0": ["b0", "b1"], "n0": ["n0", "n1"],
                                      "s0": ["s0"]}
    assert sorted(router.groups) == ["a0", "b0", "n0"]
    shared = (x,)
    for step in range(2):  # twice: BatchNorm running statistics accumulate per tower
        check_call(router, refs, {n: shared for n in refs}, {"mask": mask})
    router.eval()
    [r.eval() for r in refs.values()]
    check_call(router, refs, {n: shared for n in refs}, {"mask": mask}, grads=False)
    text = router.report()
    assert "wide 'a0'" in text and "singleton 's0'" in text


def test_per_tower_inputs():
    router, refs = build(mixed_towers())
    x, mask = sample()
    router.prepare_for_compile(x, mask=mask)
    per = {n: (sample(seed=10 + k)[0],) for k, n in enumerate(refs)}
    check_call(router, refs, per, {"mask": mask})


def test_inverse_pair_never_shares_one_program():
    torch.manual_seed(0)
    towers = {"pos0": SignTower(+1), "neg0": SignTower(-1), "pos1": SignTower(+1), "neg1": SignTower(-1)}
    router, refs = build(towers)
    x, mask = sample()
    router.prepare_for_compile(x, mask=mask)
    assert router.group_members() == {"pos0": ["pos0", "pos1"], "neg0": ["neg0", "neg1"]}
    check_call(router, refs, {n: (x,) for n in refs}, {"mask": mask})
    # the same weights under both signs: outputs are exact negatives
    with torch.no_grad():
        router.groups["neg0"].fc.weight.copy_(router.groups["pos0"].fc.weight)
        router.groups["neg0"].fc.bias.copy_(router.groups["pos0"].fc.bias)
        outs = router.wide_forward(x, mask=mask)
    torch.testing.assert_close(outs["neg0"], -outs["pos0"])


def test_other_input_structure_runs_member_by_member_with_one_warning():
    router, refs = build(mixed_towers())
    x, mask = sample()
    router.prepare_for_compile(x, mask=mask)
    with pytest.warns(UserWarning, match="compiled for other inputs") as record:
        check_call(router, refs, {n: (x,) for n in refs}, {})  # no mask: not the compiled structure
    assert len([w for w in record if "WideRouter" in str(w.message)]) == 3  # one per wide group
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_call(router, refs, {n: (x,) for n in refs}, {})


def test_tensor_only_structure_against_keywords_and_tensor_subclasses():
    """A router prepared with one positional tensor (the structure check's fast path) still
    tells a call with a keyword apart (one warning per group, correct outputs), and takes a
    tensor subclass (an nn.Parameter) as the same structure, with no warning."""
    torch.manual_seed(0)
    router, refs = build({f"t{i}": MLPTower() for i in range(4)})
    x, mask = sample()
    router.prepare_for_compile(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shared = (nn.Parameter(x.clone()),)
        check_call(router, refs, {n: shared for n in refs}, {})
    with pytest.warns(UserWarning, match="compiled for other inputs"):
        check_call(router, refs, {n: (x,) for n in refs}, {"mask": mask})


def test_subset_of_towers():
    router, refs = build(mixed_towers())
    x, mask = sample()
    router.prepare_for_compile(x, mask=mask)
    before = {n: {k: v.clone() for k, v in tower_tensors(router, n).items()} for n in ("n1", "a2")}
    names = ["n0", "a0", "a1", "s0", "b0", "b1"]  # parts of groups a and n, all of group b
    check_call(router, refs, {n: (x,) for n in refs}, {"mask": mask}, names=names)
    for n in ("n1", "a2"):  # unselected towers: untouched buffers, no gradient
        for k, v in tower_tensors(router, n).items():
            torch.testing.assert_close(v, before[n][k], rtol=0, atol=0)
        assert all(g is None or not g.any() for g in tower_grads(router, n).values())
    with pytest.raises(KeyError, match="not a tower"):
        router.wide_forward(x, mask=mask, tower_names=["nope"])


def test_parameters_unique_optimizer_step_and_write_back():
    towers = mixed_towers()
    originals = dict(towers)
    router, refs = build(towers)
    x, mask = sample()
    router.prepare_for_compile(x, mask=mask)
    params = list(router.parameters())
    assert len({id(p) for p in params}) == len(params)
    assert sum(p.numel() for p in params) == sum(p.numel() for r in refs.values() for p in r.parameters())
    opt = torch.optim.SGD(router.parameters(), lr=0.1)
    ref_opts = {n: torch.optim.SGD(r.parameters(), lr=0.1) for n, r in refs.items()}
    w_before = router.groups["a0"].get_parameter("net.0.weight").detach().clone()
    for _ in range(2):
        opt.zero_grad()
        outs = router.wide_forward(x, mask=mask)
        sum(o.square().sum() for o in outs.values()).backward()
        opt.step()
        for n, r in refs.items():
            ref_opts[n].zero_grad()
            r(x, mask=mask).square().sum().backward()
            ref_opts[n].step()
    assert not torch.equal(router.groups["a0"].get_parameter("net.0.weight"), w_before)
    # the grouped originals are stale until write_back, which updates them in place
    weight_obj = originals["a1"].net[0].weight
    assert not torch.allclose(originals["a1"].net[0].weight, refs["a1"].net[0].weight)
    router.write_back()
    assert originals["a1"].net[0].weight is weight_obj
    fresh = router.unfuse()
    for n, ref in refs.items():
        for k, t in [*ref.named_parameters(), *ref.named_buffers()]:
            assert_close(originals[n].get_parameter(k) if k in dict(ref.named_parameters())
                         else originals[n].get_buffer(k), t, msg=f"write_back {n}.{k}")
            got = dict([*fresh[n].named_parameters(), *fresh[n].named_buffers()])[k]
            assert_close(got, t, msg=f"unfuse {n}.{k}")
    assert fresh["a1"] is not originals["a1"]
    with pytest.raises(AttributeError, match="fused into the WideModel"):
        router.a1  # noqa: B018


def test_state_dict_round_trip():
    router, _ = build(mixed_towers())
    x, mask = sample()
    router.prepare_for_compile(x, mask=mask)
    router.eval()
    want = router.wide_forward(x, mask=mask)
    torch.manual_seed(123)  # other weights, same structure
    other, _ = build({n: type(t)(*([t.sign] if isinstance(t, SignTower) else
                                   [t.net[0].out_features] if isinstance(t, MLPTower) else []))
                      for n, t in mixed_towers().items()})
    with pytest.raises(ValueError, match="prepare_for_compile"):
        other.load_state_dict(router.state_dict())
    other.prepare_for_compile(x, mask=mask)
    other.load_state_dict(router.state_dict())
    other.eval()
    got = other.wide_forward(x, mask=mask)
    for n in want:
        torch.testing.assert_close(got[n], want[n])


def test_a_router_pickled_before_the_split_into_modules_still_loads():
    """Before the package was split into modules by concern, a pickle of a router (torch.save of a
    whole router, here with a fused tower's view and labelled towers) named its classes
    wide_compiler.router.<class>, private ones too; such a pickle still loads and runs the same."""
    torch.manual_seed(0)
    towers = {"m0": MLPTower(), "m1": MLPTower(), "n": NormTower()}
    for name, tower in towers.items():
        tower.name = name
    router, _ = build(towers)
    x, mask = sample()
    router.eval().prepare_for_compile(x, mask=mask)
    view = router["m1"]
    # protocol 2 names a class as b"c<module>\n<name>\n": rewritten to the module of before the split
    data = re.sub(rb"cwide_compiler\.router\.\w+\n", b"cwide_compiler.router\n", pickle.dumps(router, protocol=2))
    for cls in (b"WideRouter", b"_FusedTowerView", b"_TowerLabel"):
        assert b"cwide_compiler.router\n" + cls + b"\n" in data
    loaded = pickle.loads(data)
    assert loaded.group_members() == router.group_members() == {"m0": ["m0", "m1"], "n": ["n"]}
    assert loaded["n"].name == "n" and loaded.unfuse()["m1"].name == "m1"
    assert_close(loaded["m1"](x, mask=mask), view(x, mask=mask))


def test_compile_failure_warns_once_and_falls_back():
    torch.manual_seed(0)
    towers = {"br0": BranchyTower(), "br1": BranchyTower(), "m0": MLPTower(), "m1": MLPTower()}
    router, refs = build(towers)
    x, mask = sample()
    with pytest.warns(UserWarning, match=r"\['br0', 'br1'\].*could not be fused") as record:
        router.prepare_for_compile(x, mask=mask)
    assert len([w for w in record if "WideRouter" in str(w.message)]) == 1
    assert list(router.groups) == ["m0"]  # the other group is still wide
    assert list(router.fallbacks) == [("br0", "br1")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no second warning on later calls
        check_call(router, refs, {n: (x,) for n in refs}, {"mask": mask})
        check_call(router, refs, {n: (-x,) for n in refs}, {"mask": mask})
    assert "fallback, one by one 'br0'" in router.report()


def test_lazy_grouping_warns_in_training_and_registration():
    torch.manual_seed(0)
    router = WideRouter(config=FAST)
    for i in range(2):
        router.attach(f"t{i}", MLPTower())
    router.attach("head", nn.Linear(3, 1))
    router.register_tower("extra", MLPTower())
    assert router.discover_towers() == ["extra", "t0", "t1"]
    x, _ = sample()
    with pytest.warns(UserWarning, match="Create the optimizer after"):
        router.wide_forward(x)
    assert router.group_members() == {"extra": ["extra", "t0", "t1"]}
    assert {id(p) for p in router.head.parameters()} <= {id(p) for p in router.parameters()}
    with torch.no_grad():
        router.groups["extra"].get_parameter("net.0.bias").add_(1.0)
    router.unregister_tower("extra")  # writes back and ungroups
    assert router.tower_names == ["t0", "t1"] and not router.groups
    torch.testing.assert_close(router.t0.net[0].bias, router.unfuse()["t0"].net[0].bias)
    router.eval()
    outs = router.wide_forward(x)
    assert sorted(outs) == ["t0", "t1"] and list(router.groups) == ["t0"]
    torch.testing.assert_close(outs["t1"], router.unfuse()["t1"](x), rtol=1e-5, atol=1e-5)
    with pytest.raises(KeyError):
        router.register_tower("missing")
    with pytest.raises(ValueError, match="taken"):
        router.attach("groups", nn.Linear(1, 1))


def test_tensor_shared_outside_a_group_is_never_untied():
    torch.manual_seed(0)
    towers = {"a0": MLPTower(), "a1": MLPTower(), "n0": NormTower()}
    towers["n0"].fc = towers["a0"].net[0]  # a0 and n0 share one Linear
    router, _ = build(towers)
    x, mask = sample()
    with pytest.warns(UserWarning, match=r"\['a0', 'a1'\].*shares its tensor"):
        router.prepare_for_compile(x, mask=mask)
    assert not router.groups
    outs = router.wide_forward(x, mask=mask)
    torch.testing.assert_close(outs["n0"], towers["n0"](x, mask=mask))
    torch.testing.assert_close(outs["a0"], towers["a0"](x, mask=mask))


def test_to_reaches_the_groups_and_state_has_membership():
    router, refs = build(mixed_towers())
    x, mask = sample()
    router.prepare_for_compile(x, mask=mask)
    assert router.state_dict()["_extra_state"]["groups"]["a0"] == ["a0", "a1", "a2"]
    router.to(torch.float64)
    assert all(p.dtype == torch.float64 for p in router.parameters())
    outs = router.wide_forward(x.double(), mask=mask.double())
    for n, ref in refs.items():
        torch.testing.assert_close(outs[n], ref.double()(x.double(), mask=mask.double()))


def test_compiled_router_matches_each_tower_with_no_graph_break():
    """compile(): prepare + torch.compile(fullgraph=True) of every group (a graph break would be
    an error); outputs, gradients and buffers tower by tower, train then eval."""
    torch.compiler.reset()  # earlier tests compiled WideModel.forward for their own models
    router, refs = build(mixed_towers())
    x, mask = sample()
    assert router.compile(x, mask=mask, options={"backend": "eager"}) is router
    assert sorted(router._compiled) == ["a0", "b0", "n0"]
    check_call(router, refs, {n: (x,) for n in refs}, {"mask": mask})
    router.eval()
    [r.eval() for r in refs.values()]
    check_call(router, refs, {n: (x,) for n in refs}, {"mask": mask}, grads=False)


# -- the router guide's API (issue 24) ----------------------------------------------------------
class NamedSignTower(Tower):
    """Reads its own name in forward: a program that depends on the name."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.fc = nn.Linear(6, 3)

    def forward(self, x):
        y = self.fc(x)
        return -y if self.name.startswith("neg") else y


def test_named_router_and_towers_auto_discover_and_repr():
    router = WideRouter("collective", auto_discover=True, config=FAST)
    router.attach("head", nn.Linear(3, 1))
    t = router.attach("t0", MLPTower())
    assert router.tower_names == ["t0"] and t.name is None
    router.auto_discover = False
    router.attach("t1", MLPTower())
    assert router.tower_names == ["t0"]
    assert router.discover_towers() == ["t0", "t1"]
    assert "name='collective'" in repr(router)
    assert "t0" in router and "groups" not in router and "nope" not in router
    with pytest.raises(TypeError, match="name must be a string"):
        WideRouter(FAST)  # config is a keyword argument
    with pytest.raises(TypeError, match="name must be a string"):
        Tower(3)


def test_tower_names_do_not_split_groups_unless_forward_reads_them():
    x, _ = sample()
    for run_members in (True, False):
        router = WideRouter(auto_discover=True, config=FAST.replace(run_members=run_members))
        for n in ("pos0", "neg0", "pos1"):
            router.attach(n, NamedSignTower(n))
        refs = {n: copy.deepcopy(router[n]) for n in router.tower_names}
        router.eval()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # run_members=False: the compile refuses, with a warning
            outs = router.wide_forward(x)
        assert not router.groups, f"run_members={run_members}: towers reading their names were fused"
        for n, ref in refs.items():
            torch.testing.assert_close(outs[n], ref(x))
    router = WideRouter(auto_discover=True, config=FAST)  # names not read: one group
    for n in ("a", "b"):
        router.attach(n, NormTower())
        router[n].name = n
    router.prepare_for_compile(x)
    assert router.group_members() == {"a": ["a", "b"]} and router.unfuse()["b"].name == "b"


def test_getitem_views_follow_the_tower_and_write_its_rows():
    router, refs = build(mixed_towers())
    x, mask = sample()
    router.prepare_for_compile(x, mask=mask)
    head = router.attach("head", nn.Linear(3, 1))
    assert router["head"] is head and router["s0"] is router.s0  # singleton: the module itself
    view = router["a1"]
    assert router["a1"] is view and "member 1 of router.groups['a0']" in repr(view)
    torch.testing.assert_close(view(x, mask=mask), refs["a1"](x, mask=mask))
    new = MLPTower(8).state_dict()
    view.load_state_dict(new)
    torch.testing.assert_close(router.unfuse()["a1"].net[0].weight, new["net.0.weight"])
    with pytest.raises(AttributeError, match=r"router.unfuse\(\)\['a1'\]"):
        view.net  # noqa: B018
    with pytest.raises(AttributeError, match=r"router\['a1'\] \(a live view\)"):
        router.a1  # noqa: B018
    router.unregister_tower("s0")  # ungroups: the view now calls the live module
    assert "not fused" in repr(view)
    torch.testing.assert_close(view(x, mask=mask), router.a1(x, mask=mask))


def test_optimizers_made_right_are_never_refused():
    router, refs = build(mixed_towers())
    x, mask = sample()
    router.prepare_for_compile(x, mask=mask)
    opt = torch.optim.Adam(router.parameters(), lr=1e-3)
    sum(o.sum() for o in router.wide_forward(x, mask=mask).values()).backward()
    opt.step()  # made after grouping: fine
    alone = router.unfuse()["a0"]
    alone_opt = torch.optim.SGD(alone.parameters(), lr=0.1)
    alone(x).sum().backward()
    alone_opt.step()  # a fresh copy trains on its own
    towers = {n: router._tower(n) for n in router.tower_names}
    stale = torch.optim.SGD(towers["a0"].parameters(), lr=0.1)
    towers["a0"](x).sum().backward()
    with pytest.raises(RuntimeError, match="no longer the router's live parameters"):
        stale.step()
    del router, opt
    import gc
    gc.collect()
    stale.step()  # the router is gone: the tower module is the user's own again


def test_compile_options_and_sample_keywords():
    class ModeTower(Tower):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x, mode: str = "plain"):
            return self.fc(x) * (2 if mode == "double" else 1)

    torch.compiler.reset()
    router = WideRouter(config=FAST)
    for i in range(2):
        router.register_tower(f"m{i}", ModeTower())
    x, _ = sample()
    with pytest.raises(TypeError, match="mode= is ambiguous"):
        router.compile(x, mode="double")
    router.compile(x, mode="double", options={"backend": "eager"})  # options given: mode is a sample input
    assert router._structures["m0"][1][-1] == ("value", "double")
    ref = copy.deepcopy(router.unfuse()["m1"])
    torch.testing.assert_close(router.wide_forward(x, mode="double")["m1"], ref(x, mode="double"))


def test_prepare_for_compile_with_a_device_groups_at_the_first_call():
    router, refs = build(mixed_towers())
    router.prepare_for_compile(torch.device(DEVICE))
    assert not router.groups
    router.prepare_for_compile(str(DEVICE))
    x, mask = sample()
    router.eval()
    outs = router.wide_forward(x, mask=mask)
    assert sorted(router.groups) == ["a0", "b0", "n0"]
    for n, ref in refs.items():
        torch.testing.assert_close(outs[n], ref.eval()(x, mask=mask))
