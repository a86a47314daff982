"""``WideConfig(defer=True)``: each member runs its own program on its slices of the stacked tensors
until compiling pays (Note [Running the members until compiling pays] in model_deferred.py).
Every test compares with N separate members, in float64."""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from torch import nn

import wide_compiler as wc
from wide_compiler import model_deferred
from support import DEVICE, cpu_only

N = 3
DEFER = wc.WideConfig.fast().replace(defer=True)


class Net(nn.Module):
    """Linear -> BatchNorm -> ReLU -> Linear whose last layer is tied to a second name, with a
    dict output holding a tensor and a shared non-tensor value, and a keyword input."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 2)
        self.head = self.out  # tied: one stacked tensor under both names

    def forward(self, x, *, scale):
        h = torch.relu(self.bn(self.fc(x)))
        return {"y": self.head(h) * scale, "h": h, "tag": "net"}


def deferred(given, dtype=torch.float64, **kw):
    """``given`` compiled with ``defer``, on a sample [5, 4] with its ``scale``."""
    return wc.compile(given, torch.randn(5, 4, dtype=dtype), config=kw.pop("config", DEFER),
                      sample_kwargs={"scale": torch.ones(5, 1, dtype=dtype)}, **kw)


def run(model, x):
    """``model`` (wide or a member) on ``x`` with a scale of ones."""
    return model(x, scale=torch.ones(*x.shape[:-1], 1, dtype=x.dtype))


def members(seed=0, cls=Net):
    torch.manual_seed(seed)
    return [cls().double() for _ in range(N)]


def sgd_steps(wide, refs, steps, lrs=(0.01, 0.02, 0.03), seed=1):
    """``steps`` SGD steps of the wide model and of each member alone on the same data."""
    opt = wc.optim.SGD(wide.parameters(), lr=list(lrs), momentum=0.9)
    ref_opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m, lr in zip(refs, lrs)]
    g = torch.Generator(DEVICE).manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(N, 5, 4, generator=g, dtype=torch.float64)
        s = torch.rand(N, 5, 1, generator=g, dtype=torch.float64)
        out = wide(x, scale=s)
        (out["y"].square().sum() + out["h"].sum()).backward()
        opt.step()
        opt.zero_grad()
        for i, (m, o) in enumerate(zip(refs, ref_opts)):
            r = m(x[i], scale=s[i])
            (r["y"].square().sum() + r["h"].sum()).backward()
            o.step()
            o.zero_grad()


def assert_state_matches(wide, refs, tol=1e-12):
    sd = wide.state_dict()
    for i, m in enumerate(refs):
        for k, v in m.state_dict().items():
            assert torch.allclose(sd[k][i].double(), v.double(), atol=tol, rtol=0), (i, k)


@cpu_only
def test_members_run_their_own_programs_exactly():
    """Outputs (a dict with a non-tensor value), input and parameter gradients, a tied weight and
    BatchNorm's running statistics after train steps; then eval mode; nothing compiled."""
    given = members()
    refs = copy.deepcopy(given)
    wide = deferred(given)
    wide.expect_calls(train_calls=10, eval_calls=10)
    x = torch.randn(N, 5, 4, dtype=torch.float64, requires_grad=True)
    out = run(wide, x)
    assert out["tag"] == "net" and out["y"].shape == (N, 5, 2)
    out["y"].sum().backward()
    xr = x.detach().clone().requires_grad_(True)
    for i, m in enumerate(refs):
        r = run(m, xr[i])
        assert torch.equal(out["y"][i], r["y"]) and torch.equal(out["h"][i], r["h"])
        r["y"].sum().backward()
        assert torch.equal(wide.get_parameter("fc.weight").grad[i], m.fc.weight.grad)
        assert torch.equal(wide.get_parameter("out.weight").grad[i], m.out.weight.grad)
    assert torch.equal(x.grad, xr.grad)
    for m in refs:
        m.zero_grad()
    wide.zero_grad()
    sgd_steps(wide, refs, 4)
    assert_state_matches(wide, refs, tol=0)
    wide.eval()
    x = torch.randn(N, 1, 4, dtype=torch.float64)  # a batch of 1 (eval BatchNorm takes it)
    out = run(wide, x)
    for i, m in enumerate(refs):
        assert torch.equal(out["y"][i], run(m.eval(), x[i])["y"])
    assert wide.compiled_modes() == []


def test_a_run_that_pays_compiles_and_continues_exactly(monkeypatch):
    """The train graph is compiled at the first call after the measured ones where the calls left
    pay for it, on the same stacked tensors (the optimizer keeps its state): still every member."""
    given = members(1)
    refs = copy.deepcopy(given)
    wide = deferred(given)
    wide.expect_calls(train_calls=10 ** 9, eval_calls=None)
    sgd_steps(wide, refs, model_deferred.MEASURED_CALLS)
    assert wide.compiled_modes() == []
    sgd_steps(wide, refs, 1)  # one optimizer only in each sgd_steps: compare the steps of this call alone
    assert wide.compiled_modes() == ["train"]
    assert_state_matches(wide, refs)
    wide.eval()  # eval_calls unknown: its first call compiles
    assert wide.compiled_modes() == ["train"]
    x = torch.randn(N, 5, 4, dtype=torch.float64)
    out = run(wide, x)
    assert wide.compiled_modes() == ["train", "eval"]
    for i, m in enumerate(refs):
        assert torch.allclose(out["y"][i], run(m.eval(), x[i])["y"], atol=1e-12, rtol=0)


def test_without_an_expectation_the_first_call_compiles():
    wide = deferred(members())
    assert wide.compiled_modes() == []
    run(wide, torch.randn(N, 5, 4, dtype=torch.float64))
    assert wide.compiled_modes() == ["train"]


def test_what_cannot_defer_compiles_at_once():
    """One member, per-member constants (a swept dropout p), pad=True: compiled at construction."""
    x = torch.randn(5, 4)
    assert wc.compile([nn.Linear(4, 2)], x, config=DEFER).compiled_modes() == ["train"]
    sweep = [nn.Sequential(nn.Linear(4, 4), nn.Dropout(p)) for p in (0.1, 0.2)]
    assert wc.compile(sweep, x, config=DEFER).compiled_modes() == ["train"]
    widths = [nn.Sequential(nn.Linear(4, h), nn.ReLU(), nn.Linear(h, 2)) for h in (3, 5)]
    assert wc.compile(widths, x, config=DEFER, pad=True).compiled_modes() == ["train"]
    same = [nn.Linear(4, 2) for _ in range(2)]
    assert wc.compile(same, x, config=DEFER, validate=True).compiled_modes() == ["train"]


def test_state_dicts_and_member_operations_before_a_compile():
    """A deferred model has the compiled model's state dict keys; load_state_dict, member(i),
    unfuse, write_back and copy_member_weights work on its stacked tensors, and its calls follow."""
    wide = deferred(members(2))
    wide.expect_calls(train_calls=0, eval_calls=0)
    compiled = deferred(members(3), config=wc.WideConfig.fast())
    assert wide.state_dict().keys() == compiled.state_dict().keys()
    wide.load_state_dict(compiled.state_dict())
    wide.copy_member_weights(src=2, dst=0)
    x = torch.randn(N, 5, 4, dtype=torch.float64)
    wide.eval()
    out = run(wide, x)["y"]
    ones = wide.unfuse()
    targets = members(9)
    wide.write_back(targets)
    for i, src in enumerate((2, 1, 2)):
        want = run(compiled.member(src).eval(), x[i])["y"]
        for m in (wide.member(i).eval(), ones[i], targets[i].eval()):
            assert torch.allclose(run(m, x[i])["y"], want, atol=1e-12, rtol=0)
        assert torch.allclose(out[i], want, atol=1e-12, rtol=0)
    assert wide.compiled_modes() == []


def test_conversions_copies_and_pickles():
    """``.float()`` before the first compile (the member checks of that compile run in float32),
    deepcopy and pickle of a deferred model: each computes its members."""
    given = members(4)
    wide = deferred(given).float()
    x = torch.randn(N, 5, 4)
    want = [run(m.float(), x[i])["y"] for i, m in enumerate(copy.deepcopy(given))]
    for other in (copy.deepcopy(wide), pickle.loads(pickle.dumps(wide))):
        other.expect_calls(train_calls=0)
        got = run(other, x)["y"]
        assert other.compiled_modes() == []
        assert all(torch.allclose(got[i], want[i], atol=1e-6) for i in range(N))
    got = run(wide, x)["y"]  # no expectation: compiles, in float32
    assert wide.compiled_modes() == ["train"]
    assert all(torch.allclose(got[i], want[i], atol=1e-5) for i in range(N))


def test_users_members_are_not_changed():
    given = members(5)
    before = [{k: v.clone() for k, v in m.state_dict().items()} for m in given]
    params = [[id(p) for p in m.parameters()] for m in given]
    wide = deferred(given)
    wide.expect_calls(train_calls=10)
    sgd_steps(wide, copy.deepcopy(given), 3)
    for m, sd, ids in zip(given, before, params):
        assert [id(p) for p in m.parameters()] == ids and m.training
        assert all(torch.equal(v, sd[k]) for k, v in m.state_dict().items())
        assert all(p.grad is None for p in m.parameters())


def test_clear_errors():
    wide = deferred(members())
    wide.expect_calls(train_calls=5)
    with pytest.raises(ValueError, match="N-first"):
        run(wide, torch.randn(5, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="keywords \\[\\] were given, the sample has \\['scale'\\]"):
        wide(torch.randn(N, 5, 4, dtype=torch.float64))

    class Ragged(nn.Module):  # member 1 returns another shape: a wide model cannot stack it
        def __init__(self, k):
            super().__init__()
            self.k = k
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x)[: self.k + 2]

    # (k differs: a per-member constant, which compiles at once; so the attribute is set after)
    ragged = wc.compile([Ragged(0) for _ in range(2)], torch.randn(5, 4), config=wc.WideConfig.fast().replace(defer=True))
    ragged._deferred.members[1].k = 1
    ragged.expect_calls(train_calls=5)
    with pytest.raises(ValueError, match="member 1's output 0 is \\[3, 4\\] where member 0's is \\[2, 4\\]"):
        ragged(torch.randn(2, 5, 4))
    with pytest.raises(ValueError, match="defer"):
        wc.WideConfig(defer="yes")
    with pytest.raises(ValueError, match="calls"):
        wide.expect_calls(train_calls=-1)
    compiled = torch.compile(wide, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match="no train graph yet"):
        run(compiled, torch.randn(N, 5, 4, dtype=torch.float64))


@cpu_only
def test_threads_share_a_deferred_model():
    """Calls from two threads at once (each member's copy is swapped per call, under a lock)."""
    given = members(6)
    refs = copy.deepcopy(given)
    wide = deferred(given).eval()
    wide.expect_calls(eval_calls=10)
    xs = [torch.randn(N, 5, 4, dtype=torch.float64) for _ in range(8)]
    results: dict[int, torch.Tensor] = {}

    def call(k):
        with torch.no_grad():
            results[k] = run(wide, xs[k])["y"]

    threads = [threading.Thread(target=call, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, x in enumerate(xs):
        for i, m in enumerate(refs):
            assert torch.equal(results[k][i], run(m.eval(), x[i])["y"])


def test_a_nan_in_one_member_stays_there():
    given = members(7)
    with torch.no_grad():
        given[1].fc.weight[0, 0] = float("nan")
    wide = deferred(given)
    wide.expect_calls(train_calls=3)
    y = run(wide, torch.randn(N, 5, 4, dtype=torch.float64))["y"]
    assert torch.isnan(y[1]).any() and not torch.isnan(y[0]).any() and not torch.isnan(y[2]).any()


def test_a_buffer_assigned_anew_in_the_forward():
    """``self.seen = self.seen + x.shape[0]`` (a new tensor each call): each member's slice of the
    stacked buffer holds what the member alone holds; a parameter assigned anew is refused."""

    class Counting(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)
            self.register_buffer("seen", torch.zeros(()))

        def forward(self, x):
            self.seen = self.seen + x.shape[0]
            return self.fc(x) * self.seen

    torch.manual_seed(8)
    given = [Counting() for _ in range(2)]
    refs = copy.deepcopy(given)
    wide = wc.compile(given, torch.randn(5, 4), config=DEFER)
    wide.expect_calls(train_calls=5)
    for batch in (5, 3):
        x = torch.randn(2, batch, 4)
        y = wide(x)
        for i, m in enumerate(refs):
            assert torch.equal(y[i], m(x[i]))
    assert wide.get_buffer("seen").tolist() == [8.0, 8.0] and wide.compiled_modes() == []

    class Replacing(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(4))

        def forward(self, x):
            self.w = nn.Parameter(self.w.detach() * 2)
            return x * self.w

    wide = wc.compile([Replacing() for _ in range(2)], torch.randn(5, 4), config=DEFER)
    wide.expect_calls(train_calls=5)
    with pytest.raises(wc.UnsupportedOperationError, match="member 0's forward assigned 'w' anew"):
        wide(torch.randn(2, 5, 4))
    assert torch.equal(wide.w, torch.ones(2, 4))  # nothing changed


def test_a_compile_that_pays_but_fails_leaves_the_members_running(monkeypatch, caplog):
    """A forward the compiler refuses (a branch on a value: no capture) runs its members' own
    programs until the compile pays; then the failed compile is logged once and the members go
    on, exact, instead of the run ending there. Without an expectation the error raises."""

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            y = self.fc(x)
            return y if y.sum() > 0 else -y

    for name in ("COLD_SECONDS", "COLD_SECONDS_PER_MODULE", "WARM_SECONDS"):
        monkeypatch.setattr(model_deferred, name, 0.0)
    torch.manual_seed(9)
    given = [Branchy() for _ in range(2)]
    wide = wc.compile(copy.deepcopy(given), torch.randn(5, 4), config=DEFER)
    wide.expect_calls(train_calls=100)
    with caplog.at_level("WARNING", logger="wide_compiler.model"):
        for _ in range(4):
            x = torch.randn(2, 5, 4)
            y = wide(x)
            for i, m in enumerate(given):
                assert torch.equal(y[i], m(x[i]))
    assert wide.compiled_modes() == []
    assert sum("cannot be compiled" in r.getMessage() for r in caplog.records) == 1
    fresh = wc.compile(copy.deepcopy(given), torch.randn(5, 4), config=DEFER)
    with pytest.raises(Exception):
        fresh(torch.randn(2, 5, 4))


class Recurrent(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.r = getattr(nn, kind)(4, 6, num_layers=2, bidirectional=True, batch_first=True)
        self.o = nn.Linear(12, 2)

    def forward(self, x):
        return self.o(self.r(x)[0])


@pytest.mark.parametrize("kind", ["GRU", "LSTM", "RNN"])
def test_recurrent_members_train_across_the_switch(kind, monkeypatch):
    """P14-1 (probe 14): a call with the slots swapped left an RNN copy's flat weights on dead
    slices, and the first compile's member checks refused the members as different architectures
    (the training run died at the switch). Trained by SGD across the switch: every member exact."""
    for name in ("COLD_SECONDS", "COLD_SECONDS_PER_MODULE", "WARM_SECONDS"):
        monkeypatch.setattr(model_deferred, name, 0.0)
    torch.manual_seed(10)
    given = [Recurrent(kind).double() for _ in range(3)]
    refs = copy.deepcopy(given)
    wide = wc.compile(copy.deepcopy(given), torch.randn(2, 5, 4, dtype=torch.float64), config=DEFER)
    wide.expect_calls(train_calls=100)
    opt = wc.optim.SGD(wide.parameters(), lr=[0.05, 0.1, 0.2])
    ref_opts = [torch.optim.SGD(m.parameters(), lr=lr) for m, lr in zip(refs, (0.05, 0.1, 0.2))]
    for _ in range(model_deferred.MEASURED_CALLS + 2):
        x = torch.randn(3, 2, 5, 4, dtype=torch.float64)
        wide(x).square().sum().backward()
        opt.step()
        opt.zero_grad()
        for i, (m, o) in enumerate(zip(refs, ref_opts)):
            m(x[i]).square().sum().backward()
            o.step()
            o.zero_grad()
    assert wide.compiled_modes() == ["train"]
    assert_state_matches(wide, refs, tol=1e-10)


def test_a_forward_writing_into_a_shared_input():
    """P15-3 (probe 15): a forward that writes into its input (``x.mul_(2)``), called with one input
    shared by every member (``x.expand(N, ...)``): members 1 and 2 computed on member 0's writes
    (3.1 and 10.1 off). Each member now gets its own copy of a shared input: exact, input
    gradients summed over the members, the caller's tensor unchanged."""

    class Scaling(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 2)

        def forward(self, x):
            x = x * 1.0
            x.mul_(2)
            return self.fc(x)

    class InPlace(Scaling):
        def forward(self, x):
            x.mul_(2)
            return self.fc(x)

    torch.manual_seed(11)
    given = [InPlace() for _ in range(3)]
    wide = wc.compile(copy.deepcopy(given), torch.randn(5, 4), config=DEFER)
    wide.expect_calls(train_calls=5)
    x = torch.randn(5, 4)
    kept = x.clone()
    with torch.no_grad():
        y = wide(x.expand(3, 5, 4))
        for i, m in enumerate(given):
            assert torch.equal(y[i], m(kept.clone()))
    assert torch.equal(x, kept)
    grads = [Scaling() for _ in range(3)]
    wide = wc.compile(copy.deepcopy(grads), torch.randn(5, 4), config=DEFER)
    wide.expect_calls(train_calls=5)
    xg = x.clone().requires_grad_(True)
    wide(xg.expand(3, 5, 4)).sum().backward()
    xr = x.clone().requires_grad_(True)
    sum(m(xr).sum() for m in grads).backward()
    assert torch.allclose(xg.grad, xr.grad, atol=1e-6)
