"""Per-member constants are proved for every member, not sampled (issue 44, items 2 and 6; Note
[Per-member constants] in fx/constants.py): every distinct configuration of the members' float
attributes is traced, a tensor made from one inside a forward is per member, and checkpoints,
``member(i)`` and ``copy_member_weights`` carry the constants."""
from __future__ import annotations

import copy
import datetime
import os

import pytest
import torch
import torch.nn.functional as F
import wide_compiler as wc
import wide_compiler.distributed as wcd
from support import LinearModel, all_to_eval
from torch import nn
from wide_compiler import testing

FAST = wc.WideConfig.fast()


def _made(cls, values, seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return [cls(v).to(dtype) for v in values]


def _check(wide, models, x):
    """Each member of ``wide`` computes what its model computes alone (float64: tight)."""
    y = wide(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(y[i], m(x[i]), rtol=1e-9, atol=1e-9, msg=lambda s, i=i: f"member {i}: {s}")


# --- every configuration traced ---------------------------------------------------------------
class ZeroBranch(LinearModel):
    fields = ("s",)

    def forward(self, x):
        h = self.fc(x)
        return h * self.s if self.s != 0 else torch.tanh(h)


def test_a_branch_taken_only_by_the_last_of_twelve_members_is_refused_naming_it():
    """s = 0 is neither the smallest nor the largest value, and 11 other configurations come first."""
    ss = [0.1 * (k + 1) * (-1) ** k for k in range(11)] + [0.0]
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 11: s is 0\.0, member 0 has 0\.1"):
        wc.compile(_made(ZeroBranch, ss), torch.randn(3, 4, dtype=torch.float64), config=FAST)


class Window(LinearModel):
    fields = ("p",)

    def forward(self, x):
        h = self.fc(x)
        return h * self.p if 0.2 < self.p < 0.5 else h - self.p


def test_a_window_test_on_a_constant_is_refused_for_the_member_inside_it():
    ps = [0.05, 0.9, 0.1, 0.8, 0.15, 0.7, 0.6, 0.65, 0.75, 0.85, 0.55, 0.3]  # only the last inside
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 11: p is 0\.3"):
        wc.compile(_made(Window, ps), torch.randn(3, 4, dtype=torch.float64), config=FAST)


class Rounded(LinearModel):
    fields = ("s",)

    def forward(self, x):
        return self.fc(x) * round(self.s, 2)


def test_an_argument_computed_from_a_constant_is_right_for_every_member():
    """round(s, 2) is s itself for every member but the last (s has three decimals there, and it
    is neither the smallest nor the largest): its argument must be its own round(s, 2), not s."""
    ss = [0.1, 0.9, 0.05, 0.8, 0.3, 0.7, 0.4, 0.6, 0.45, 0.55, 0.35, 0.123]
    models = _made(Rounded, ss)
    wide = wc.compile(models, torch.randn(3, 4, dtype=torch.float64), config=FAST)
    _check(wide, models, torch.randn(len(ss), 5, 4, dtype=torch.float64))


def test_sixteen_distinct_members_fuse_and_match():
    slopes = [0.01 * (k + 1) for k in range(16)]
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(s), nn.Linear(8, 2)).double() for s in slopes]
    wide = wc.compile(models, torch.randn(3, 4, dtype=torch.float64), config=FAST)
    assert wide.fallbacks == [] and wide.per_member_constants == {"1.negative_slope": slopes}
    _check(wide, models, torch.randn(16, 5, 4, dtype=torch.float64))


class Scaled(LinearModel):
    linears, fields = {"fc": (6, 6)}, ("temperature",)

    def forward(self, x):
        h = x + self.fc(x) * (2 * self.temperature)  # an argument computed from the constant
        return torch.softmax(h / self.temperature, dim=-1)


def test_twelve_members_that_fuse_legitimately_still_compile_and_match_in_train_and_eval():
    ts = [0.5 + 0.25 * k for k in range(12)]
    models = _made(Scaled, ts)
    wide = wc.compile(models, torch.randn(3, 6, dtype=torch.float64), config=FAST)
    assert wide.fallbacks == []
    x = torch.randn(12, 4, 6, dtype=torch.float64)
    _check(wide, models, x)
    all_to_eval(wide, models)
    _check(wide, models, x)


def test_members_sharing_a_configuration_share_one_trace(monkeypatch):
    from wide_compiler.fx import constants as constants_module

    traced = []
    real = constants_module.with_constants
    monkeypatch.setattr(constants_module, "with_constants",
                        lambda model, constants, j, **kw: traced.append(j) or real(model, constants, j, **kw))
    ts = [0.5, 1.0, 0.5, 1.0, 2.0, 2.0]
    models = _made(Scaled, ts)
    wide = wc.compile(models, torch.randn(3, 6, dtype=torch.float64), config=FAST.replace(run_members=False))
    assert sorted(traced) == [1, 4]  # configurations 1.0 and 2.0; 0.5 is member 0's own capture
    _check(wide, models, torch.randn(6, 4, 6, dtype=torch.float64))


# --- a tensor made from a constant inside a forward --------------------------------------------
class FromTensor(LinearModel):
    fields = ("s",)
    make = staticmethod(lambda s, h: torch.tensor(s))

    def forward(self, x):
        h = self.fc(x)
        return h * self.make(self.s, h)


class FromAsTensor(FromTensor):
    make = staticmethod(lambda s, h: torch.as_tensor(s, dtype=h.dtype))


class FromNewTensor(FromTensor):
    make = staticmethod(lambda s, h: h.new_tensor(s))


class FromFull(FromTensor):
    make = staticmethod(lambda s, h: torch.full((4,), s, dtype=h.dtype))


@pytest.mark.parametrize("cls", [FromTensor, FromAsTensor, FromNewTensor, FromFull],
                         ids=["tensor", "as_tensor", "new_tensor", "full"])
def test_a_tensor_made_from_a_constant_in_the_forward_is_per_member(cls):
    ss = [0.5, 2.0, -1.0]
    models = _made(cls, ss, dtype=torch.float32)
    wide = wc.compile(models, torch.randn(3, 4), config=FAST)
    x = torch.randn(3, 5, 4)
    y = wide(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(y[i], m(x[i]), rtol=1e-6, atol=1e-6)
    assert wide.per_member_constants == {"s": ss}


class FromVector(LinearModel):
    fields = ("s",)

    def forward(self, x):
        return self.fc(x) + torch.tensor([self.s, 1.0, 2.0, self.s])


def test_a_vector_made_from_a_constant_is_per_member_or_refused_never_member_0s():
    ss = [0.5, 2.0]
    models = _made(FromVector, ss, dtype=torch.float32)
    try:
        wide = wc.compile(models, torch.randn(3, 4), config=FAST)
    except wc.ArchitectureMismatchError as e:
        assert "member 1: s is 2.0, member 0 has 0.5" in str(e) and "tensor" in str(e)
        return
    x = torch.randn(2, 5, 4)
    y = wide(x)
    for i, m in enumerate(models):
        torch.testing.assert_close(y[i], m(x[i]), rtol=1e-6, atol=1e-6)


# --- checkpoints, member(i), copy_member_weights -----------------------------------------------
def _leaky(s):
    return nn.Sequential(nn.Linear(4, 8), nn.LeakyReLU(s), nn.Linear(8, 2))


class Doubled(LinearModel):
    fields = ("s",)

    def forward(self, x):
        return F.leaky_relu(self.fc(x), 2 * self.s)  # read through a derived argument


@pytest.mark.parametrize("kind", ["direct", "derived"])
def test_load_members_sets_the_per_member_constants(tmp_path, kind):
    make = _leaky if kind == "direct" else Doubled
    torch.manual_seed(0)
    a_models = [make(s).double() for s in (0.1, 0.2, 0.3, 0.4)]
    a = wc.compile(a_models, torch.randn(3, 4, dtype=torch.float64), config=FAST)
    wcd.save_members(a, tmp_path)
    # the receiver was compiled from the same configurations, in another order
    b = wc.compile([make(s).double() for s in (0.4, 0.3, 0.2, 0.1)], torch.randn(3, 4, dtype=torch.float64),
                   config=FAST)
    wcd.load_members(b, tmp_path)
    assert b.per_member_constants == a.per_member_constants
    _check(b, a_models, torch.randn(4, 5, 4, dtype=torch.float64))
    for i in range(4):
        _check_module(b.member(i), a_models[i])


def _check_module(got, want):
    x = torch.randn(5, 4, dtype=torch.float64)
    torch.testing.assert_close(got(x), want(x), rtol=1e-12, atol=1e-12)


def test_load_members_refuses_constants_the_receiver_cannot_represent(tmp_path):
    torch.manual_seed(0)
    a = wc.compile([_leaky(s) for s in (0.1, 0.2)], torch.randn(3, 4), config=FAST)
    wcd.save_members(a, tmp_path)
    shared = wc.compile([_leaky(0.5) for _ in range(2)], torch.randn(3, 4), config=FAST)
    before = copy.deepcopy(shared.state_dict())
    with pytest.raises(ValueError, match=r"1\.negative_slope"):
        wcd.load_members(shared, tmp_path)
    assert all(torch.equal(v, shared.state_dict()[k]) for k, v in before.items())  # nothing changed
    # a configuration the receiver never proved (a derived argument or a branch could differ)
    other = wc.compile([Doubled(s) for s in (0.7, 0.8)], torch.randn(3, 4), config=FAST)
    wcd.save_members(wc.compile([Doubled(s) for s in (0.1, 0.2)], torch.randn(3, 4), config=FAST), tmp_path)
    with pytest.raises(ValueError, match=r"member 0.*s = 0\.1.*not.*compiled"):
        wcd.load_members(other, tmp_path)
    assert other.per_member_constants == {"s": [0.7, 0.8]}


def test_load_members_into_a_model_of_the_same_shared_value_is_fine(tmp_path):
    torch.manual_seed(0)
    a_models = [_leaky(0.3) for _ in range(2)]
    a = wc.compile(a_models, torch.randn(3, 4), config=FAST)
    wcd.save_members(a, tmp_path)
    b = wc.compile([_leaky(0.3) for _ in range(2)], torch.randn(3, 4), config=FAST)
    wcd.load_members(b, tmp_path)
    x = torch.randn(2, 5, 4)
    testing.assert_members_close(b(x), [m(xi) for m, xi in zip(a_models, x)])


def test_a_checkpoint_of_shared_constants_refuses_a_receiver_with_per_member_ones(tmp_path):
    """The saver's members all had slope 0.3: the receiver's per-member slopes would be kept
    silently; refused (or set), never silently kept."""
    torch.manual_seed(0)
    a_models = [_leaky(0.3) for _ in range(2)]
    wcd.save_members(wc.compile(a_models, torch.randn(3, 4), config=FAST), tmp_path)
    b = wc.compile([_leaky(s) for s in (0.3, 0.6)], torch.randn(3, 4), config=FAST)
    try:
        wcd.load_members(b, tmp_path)
    except ValueError as e:
        assert "1.negative_slope" in str(e)
        return
    x = torch.randn(2, 5, 4)
    testing.assert_members_close(b(x), [m(xi) for m, xi in zip(a_models, x)])


def test_copy_member_weights_copies_the_constants_and_their_derived_arguments():
    torch.manual_seed(0)
    models = [Doubled(s).double() for s in (0.1, 0.2, 0.3)]
    wide = wc.compile(models, torch.randn(3, 4, dtype=torch.float64), config=FAST)
    wide.copy_member_weights(2, 0)
    assert wide.per_member_constants == {"s": [0.3, 0.2, 0.3]}
    assert wide.member(0).s == 0.3
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    _check(wide, [models[2], models[1], models[2]], x)
    # the eval graph, compiled after the copy, is planned for the members' constants as they are now
    wide.eval()
    _check(wide, [m.eval() for m in (models[2], models[1], models[2])], x)


class ModeScaled(LinearModel):
    fields = ("s",)

    def forward(self, x):
        h = self.fc(x)
        return h * (2 * self.s) if self.training else h * (3 * self.s)  # node 'mul' in both graphs


def test_the_train_and_eval_graphs_keep_their_own_derived_arguments():
    models = _made(ModeScaled, [0.5, 1.0, 1.5])
    wide = wc.compile(models, torch.randn(3, 4, dtype=torch.float64), config=FAST)
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    _check(wide, models, x)
    all_to_eval(wide, models)
    _check(wide, models, x)


def test_load_member_constants_reads_what_was_saved(tmp_path):
    torch.manual_seed(0)
    wcd.save_members(wc.compile([Doubled(s) for s in (0.1, 0.25)], torch.randn(3, 4), config=FAST), tmp_path)
    assert wcd.checkpoints.load_member_constants(tmp_path, 1)["s"] == 0.25


class IntOrFloat(LinearModel):
    fields = ("s",)

    def forward(self, x):
        return self.fc(x) + x.long() * (1 if self.s == 0 else self.s)  # int math for member 0 only


def test_a_constant_that_turns_int_math_into_float_math_is_refused():
    with pytest.raises(wc.ArchitectureMismatchError, match=r"member 1: s is 0\.5, member 0 has 0\.0.*int64"):
        wc.compile([IntOrFloat(0.0), IntOrFloat(0.5)], torch.randn(3, 4), config=FAST)


def test_the_plan_names_members_outside_the_proved_configurations():
    """The check a guard or load_state_dict can run (ConstantPlan.unproved)."""
    torch.manual_seed(0)
    wide = wc.compile([Doubled(s) for s in (0.1, 0.2)], torch.randn(3, 4), config=FAST)
    plan = wide._compile(True).constant_plan  # the plan of the model's train graph
    assert plan.configurations == 2 and plan.unproved(wide) == {}
    with torch.no_grad():
        wide.get_buffer("_per_member.s")[1] = 0.7
    assert plan.unproved(wide) == {1: {"s": 0.7}}


# --- across ranks (two spawned gloo processes, as tests/python/test_distributed.py) ---------------
def _entry(rank, world, init_file, fn_names):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))  # a hang guard, as in test_distributed.py
    try:
        for fn_name in fn_names:  # one world for every case (a spawned world costs ~15 s)
            globals()[fn_name](rank, world)
    finally:
        dist.destroy_process_group()


def _cross_rank_copy(rank, world):
    def make(i):
        torch.manual_seed(i)
        return Doubled((0.1, 0.3, 0.2, 0.1)[i]).double()

    sharded = wcd.shard(make, torch.randn(3, 4, dtype=torch.float64), n=4, config=FAST)
    wcd.copy_member_weights(sharded, 0, 2)  # rank 1 holds member 3 with s = 0.1: a proved configuration
    if rank == 1:
        assert sharded.wide.per_member_constants == {"s": [0.1, 0.1]}
        x = torch.randn(2, 5, 4, dtype=torch.float64)
        torch.testing.assert_close(sharded(x)[0], make(0)(x[0]), rtol=1e-12, atol=1e-12)
    refused = r"member 3: its constants in member 1 \(rank 0\) \(s = 0\.3\) are not a configuration"
    with pytest.raises(ValueError, match=refused):
        wcd.copy_member_weights(sharded, 1, 3)  # s = 0.3 was never on rank 1: refused on both ranks


def _cross_rank_copy_then_new_size(rank, world):
    """Probe 4's F2 across ranks: a call at a new size after the copy traces the copied constants
    (it traced member 0's compile-time ones and refused 'member 0: s is 1.5, member 0 has 1.5')."""
    from test_constants_edits import Branchy

    values = (0.5, 1.5, 2.0, 1.5)  # rank 0: members 0, 1; rank 1: members 2, 3

    def make(i):
        torch.manual_seed(i)
        return Branchy(values[i]).double()

    sharded = wcd.shard(make, torch.randn(2, 4, 3, dtype=torch.float64), n=4, config=FAST)
    wcd.copy_member_weights(sharded, 3, 0)  # rank 0's local member 0 takes s = 1.5 from rank 1
    x = torch.randn(2, 2, 2, 3, dtype=torch.float64)  # T = 2: both of rank 0's members now multiply
    if rank == 0:
        assert sharded.wide.per_member_constants == {"s": [1.5, 1.5]}
        with torch.no_grad():
            out = sharded(x)
            for local, ref in enumerate([make(3), make(1)]):
                torch.testing.assert_close(out[local], ref(x[local]), rtol=1e-12, atol=1e-12)


def test_copy_member_weights_across_ranks_carries_the_constants(tmp_path):
    """Across two gloo ranks: the copied constants are the receiver's, a configuration the
    receiving rank never proved is refused, and a later call at a new size traces the copy."""
    import torch.multiprocessing as mp

    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        cases = ("_cross_rank_copy", "_cross_rank_copy_then_new_size")
        mp.start_processes(_entry, args=(2, str(tmp_path / "init"), cases), nprocs=2, join=True, start_method="spawn")
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved


# --- Note [Per-member constants at the call] (model.py) ------------------------------------------


class _Derived(nn.Module):
    """Reads its constant directly (``* (1 - p)`` is computed from the buffer) and through Python
    arithmetic (``round(p, 1)``: a derived argument, traced per configuration)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.p = p

    def forward(self, x):
        return self.lin(x) * (1 - self.p) + round(self.p, 1)


def _derived_sweep():
    torch.manual_seed(0)
    members = [_Derived(p).double() for p in (0.1, 0.25, 0.4)]
    wide = wc.compile(members, torch.randn(2, 4, dtype=torch.float64), config=wc.WideConfig.fast())
    return members, wide


def _max_err(wide, members, x):
    y = wide(x)
    return max((y[i] - m(x[i])).abs().max().item() for i, m in enumerate(members))


def test_writing_a_constant_buffer_moves_the_derived_arguments_with_it():
    members, wide = _derived_sweep()
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    assert _max_err(wide, members, x) < 1e-12
    with torch.no_grad():
        wide.get_buffer("_per_member.p")[1] = 0.4  # member 2's configuration, proved at compile time
    members[1].p = 0.4
    assert _max_err(wide, members, x) < 1e-12  # round(p, 1) follows: 0.4, not member 1's old 0.2
    state = wide.state_dict()
    state["_per_member.p"] = torch.tensor([0.25, 0.1, 0.4], dtype=torch.float64)
    wide.load_state_dict(state)
    members[0].p, members[1].p = 0.25, 0.1
    assert _max_err(wide, members, x) < 1e-12


def test_a_constant_no_compile_proved_is_refused_at_the_call():
    members, wide = _derived_sweep()
    x = torch.randn(3, 2, 4, dtype=torch.float64)
    with torch.no_grad():
        wide.get_buffer("_per_member.p")[1] = 0.33
    with pytest.raises(ValueError, match=r"member 1's per-member constants \(p = 0\.33\) are not a configuration"):
        wide(x)
    with torch.no_grad():
        wide.get_buffer("_per_member.p")[1] = 0.25  # back to a proved one: runs again
    assert _max_err(wide, members, x) < 1e-12


class Leaky(LinearModel):
    fields = ("s",)

    def forward(self, x):
        return F.leaky_relu(self.fc(x), self.s)  # the attribute itself as the argument


@pytest.mark.parametrize("cls", [Rounded, Leaky], ids=["derived", "attribute"])
@pytest.mark.parametrize("target", [torch.float32, torch.bfloat16])
def test_to_a_narrower_dtype_keeps_the_compiled_configurations(cls, target):
    """``.to(dtype)`` rounds the per-member constant buffers (0.01 -> 0.00999999977 in float32): the
    rounded values are still the compiled configurations (every call was refused as unproved), the
    members compute as their own ``.to(dtype)`` copies, and ``unfuse()`` gives the original
    Python constants back."""
    ss = [0.01, 0.1, 0.123]
    models = _made(cls, ss)
    wide = wc.compile(models, torch.randn(3, 4, dtype=torch.float64), config=FAST).to(target)
    x = torch.randn(len(ss), 5, 4, dtype=target)
    y = wide(x)
    tol = {"rtol": 1e-5, "atol": 1e-6} if target == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for i, m in enumerate(models):
        torch.testing.assert_close(y[i], copy.deepcopy(m).to(target)(x[i]), **tol, msg=lambda s, i=i: f"member {i}: {s}")
    assert [m.s for m in wide.unfuse()] == ss
    assert wide.per_member_constants == {"s": ss}  # Python numbers: not rounded by .to(dtype)
    wide.load_state_dict(wide.state_dict())
    wide.double()  # and back (0.01 came back as 0.00999999977648, refused at every call)
    x = x.double()
    y = wide(x)
    for i, m in enumerate(models):  # each member through the same round trip
        torch.testing.assert_close(y[i], copy.deepcopy(m).to(target).double()(x[i]), rtol=1e-9, atol=1e-9)
    assert wide.per_member_constants == {"s": ss}


def test_per_member_celu_alpha_gradient_is_the_members_own_in_float64():
    """ATen's celu gradient scales by 1 / alpha rounded to float32 (its value by 1 / alpha): a
    per-member alpha of 0.3 gave a float64 input gradient 4e-8 off the member's own."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, 16), nn.CELU(a)).double() for a in (1.0, 0.3, 2.7)]
    wide = wc.compile(models, torch.randn(5, 4, dtype=torch.float64), config=FAST)
    assert wide.per_member_constants
    x = (torch.randn(3, 50, 4, dtype=torch.float64) * 1e-3).requires_grad_()
    wide(x).sum().backward()
    for i, m in enumerate(models):
        xi = x[i].detach().clone().requires_grad_()
        torch.testing.assert_close(wide(x)[i], m(xi), rtol=0, atol=1e-15)
        m(xi).sum().backward()
        torch.testing.assert_close(x.grad[i], xi.grad, rtol=1e-13, atol=1e-15, msg=lambda s, i=i: f"member {i}: {s}")


def test_a_strict_load_with_other_keys_changes_nothing():
    """A state dict of members whose constant differs (a ``_per_member`` key) into a model where it
    is shared: refused, as nn.Module refuses it, but before any weight is written (nn.Module
    loads what it can first: new weights with the old constants)."""
    swept = wc.compile(_made(Leaky, [0.1, 0.2]), torch.randn(3, 4, dtype=torch.float64), config=FAST)
    shared = wc.compile(_made(Leaky, [0.1, 0.1], seed=1), torch.randn(3, 4, dtype=torch.float64), config=FAST)
    before = copy.deepcopy(shared.state_dict())
    with pytest.raises(RuntimeError, match=r"nothing was loaded: missing key\(s\): \[\], unexpected key\(s\): "
                                           r"\['_per_member\.s'\]"):
        shared.load_state_dict(swept.state_dict())
    assert all(torch.equal(v, shared.state_dict()[k]) for k, v in before.items())
    shared.load_state_dict(swept.state_dict(), strict=False)  # not strict: nn.Module's own rules
