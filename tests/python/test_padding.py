"""Size sweeps fused by padding (``wc.compile(..., pad=True)``, Note [Padded members]).

Every sweep is compared with training each member alone: float64, 20 steps of Adam with a
learning rate and a weight decay per member; outputs (each member's own part), parameters,
optimizer state and buffers after the run, and the padding itself (zero in the parameters and in
the optimizer state). Refusals name the op and the line.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import wide_compiler as wc
from torch import nn
from wide_compiler.errors import ArchitectureMismatchError, UnsupportedOperationError
from support import DEVICE

FAST = wc.WideConfig.fast()
DT = torch.float64


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(12, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, hidden // 2)
        self.head = nn.Linear(hidden // 2, 3)

    def forward(self, x):
        h = F.gelu(self.norm(self.fc1(x)))
        return self.head(torch.sigmoid(self.fc2(h)) * h.mean(-1, keepdim=True))


class CNN(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(3, c, 3, padding=1)
        self.bn = nn.BatchNorm2d(c)
        self.c2 = nn.Conv2d(c, 2 * c, 3, padding=1)
        self.gn = nn.GroupNorm(4, 2 * c)
        self.fc = nn.Linear(2 * c, 5)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.c1(x))), 2)
        x = F.relu(self.gn(self.c2(x)))
        return self.fc(x.mean((2, 3)))


class Tabular(nn.Module):
    """One embedding per categorical column, concatenated with the numeric features."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.e1, self.e2 = nn.Embedding(10, dim), nn.Embedding(7, dim)
        self.mlp = nn.Sequential(nn.Linear(2 * dim + 3, 16), nn.ReLU(), nn.Linear(16, 2))

    def forward(self, idx, num):
        return self.mlp(torch.cat([self.e1(idx[:, 0]), self.e2(idx[:, 1]), num], 1))


class Encoder(nn.Module):
    """A transformer encoder layer whose number of heads, head dim (so its width) and feed-forward
    size are swept. No biases: the key bias of attention has a gradient of exactly zero in theory,
    rounding noise in practice, which Adam normalises into steps of size lr in any direction,
    different for any two summation orders."""

    def __init__(self, heads: int, head_dim: int, ffn: int) -> None:
        super().__init__()
        d = heads * head_dim
        self.inp = nn.Linear(6, d)
        self.enc = nn.TransformerEncoderLayer(d, heads, ffn, dropout=0.0, batch_first=True, bias=False)
        self.out = nn.Linear(d, 2)

    def forward(self, x):
        return self.out(self.enc(self.inp(x)).mean(1))


class Recurrent(nn.Module):
    """A 2-layer bidirectional LSTM whose hidden size is swept."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.rnn = nn.LSTM(6, hidden, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * hidden, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def _mlp_members():  # the smallest, a middle and the largest hidden size, 2 seeds each (the cost
    # of a padded compile grows with the members: each is captured)
    torch.manual_seed(0)
    return [MLP(h).to(DT) for h in (32, 96, 256) for _ in range(2)]


SWEEPS = {
    "mlp": (_mlp_members, lambda g, n: (torch.randn(n, 6, 12, generator=g, dtype=DT),)),
    "cnn": (lambda: [CNN(c).to(DT) for c in (4, 8, 12, 8)],
            lambda g, n: (torch.randn(n, 3, 3, 8, 8, generator=g, dtype=DT),)),
    "tabular": (lambda: [Tabular(d).to(DT) for d in (2, 4, 6, 3)],
                lambda g, n: (torch.randint(0, 7, (n, 5, 2), generator=g),
                              torch.randn(n, 5, 3, generator=g, dtype=DT))),
    "lstm": (lambda: [Recurrent(h).to(DT) for h in (4, 8, 6)],
             lambda g, n: (torch.randn(n, 3, 5, 6, generator=g, dtype=DT),)),
    # Two members each (a padded compile captures every member in both modes: a transformer
    # layer's captures were most of these cases' time), each member padded in one dim and the
    # largest in the other: heads 3 padded to 4 with the larger feed-forward size, ...
    "encoder_heads": (lambda: [Encoder(h, 4, f).to(DT) for h, f in ((3, 48), (4, 32))],
                      lambda g, n: (torch.randn(n, 3, 5, 6, generator=g, dtype=DT),)),
    # ... and head dim 6 (not a power of two) padded to 8, with the larger feed-forward size
    "encoder_head_dim": (lambda: [Encoder(2, e, f).to(DT) for e, f in ((6, 32), (8, 16))],
                lambda g, n: (torch.randn(n, 3, 5, 6, generator=g, dtype=DT),)),
}


def _outside(t, lay, i):
    """The entries of member ``i``'s padded tensor ``t`` outside its layout (all must be zero)."""
    own = torch.ones((), dtype=torch.bool)
    for d, v in lay.items():
        own = own & v[i].view([-1 if k == d else 1 for k in range(t.dim())])
    return t.masked_fill(own.expand_as(t), 0)


def _opt_state_close(wide, opt, refs, ref_opts):
    names = [name for name, _ in wide.named_parameters()]
    info = wide._pad
    for i, ro in enumerate(ref_opts):
        got, want = opt.member_state_dict(i)["state"], ro.state_dict()["state"]
        assert got.keys() == want.keys()
        for pid, st in want.items():
            lay = info.state_layouts[names[pid]]
            for key, value in st.items():
                if not isinstance(value, torch.Tensor) or value.dim() == 0:
                    continue
                mine, own = got[pid][key], info.member_slice(got[pid][key], lay, i)
                torch.testing.assert_close(own, value, rtol=1e-9, atol=1e-11, msg=f"member {i} {names[pid]} state {key}")
                # outside the member's layout: zero
                assert not _outside(mine, lay, i).any(), f"member {i} {names[pid]} {key}: padding"


@pytest.mark.parametrize("sweep", list(SWEEPS))
def test_a_size_sweep_trains_like_each_member_alone(sweep):
    make, inputs = SWEEPS[sweep]
    models = make()
    n = len(models)
    before = [copy.deepcopy(m.state_dict()) for m in models]
    refs = [copy.deepcopy(m).train() for m in models]
    g = torch.Generator(DEVICE).manual_seed(0)
    sample = tuple(t[0] for t in inputs(g, n))
    wide = wc.compile(models, sample, pad=True, config=FAST)
    assert isinstance(wide, wc.PaddedWideModel)
    lrs = [1e-3 * (1 + i % 3) for i in range(n)]
    wds = [0.01 * (i % 2) for i in range(n)]
    opt = wc.optim.Adam(wide.parameters(), lr=lrs, weight_decay=wds)
    ref_opts = [torch.optim.Adam(r.parameters(), lr=lr, weight_decay=wd) for r, lr, wd in zip(refs, lrs, wds)]
    for step in range(20):
        xs = inputs(g, n)
        outs = wide.member_outputs(wide(*xs))
        opt.zero_grad()
        sum(o.square().mean() for o in outs).backward()
        opt.step()
        for i, (r, o) in enumerate(zip(refs, ref_opts)):
            want = r(*(x[i] for x in xs))
            torch.testing.assert_close(outs[i], want, rtol=1e-9, atol=1e-10, msg=f"step {step} member {i} output")
            o.zero_grad()
            want.square().mean().backward()
            o.step()
    for i, r in enumerate(refs):
        got = wide.member_state_dict(i)
        for name, t in r.state_dict().items():
            torch.testing.assert_close(got[name], t, rtol=1e-9, atol=1e-10, msg=f"member {i} {name}")
    _opt_state_close(wide, opt, refs, ref_opts)
    # the padding of every padded parameter is still zero
    for name, p in wide.named_parameters():
        lay = wide._pad.state_layouts[name]
        for i in range(n):
            assert not _outside(p[i].detach(), lay, i).any(), f"{name}: padding of member {i} moved"
    # eval mode, and members back at their own sizes
    wide.eval()
    xs = inputs(g, n)
    outs = wide.member_outputs(wide(*xs))
    for i, (m, r) in enumerate(zip(wide.unfuse(), refs)):
        assert type(m) is type(r)
        r.eval()
        torch.testing.assert_close(m(*(x[i] for x in xs)), r(*(x[i] for x in xs)), rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(outs[i], r(*(x[i] for x in xs)), rtol=1e-9, atol=1e-10)
    # the user's models were not touched
    for m, sd in zip(models, before):
        for name, t in m.state_dict().items():
            assert torch.equal(t, sd[name])


def test_members_of_one_size_compile_as_without_padding():
    models = [nn.Linear(4, 3) for _ in range(3)]
    wide = wc.compile(models, torch.randn(2, 4), pad=True, config=FAST)
    assert type(wide) is wc.WideModel


def test_summary_reports_the_padding_overhead():
    models = [nn.Sequential(nn.Linear(4, h), nn.ReLU(), nn.Linear(h, 2)) for h in (4, 12)]
    wide = wc.compile(models, torch.randn(2, 4), pad=True, config=FAST)
    lines = wide.summary().splitlines()
    head = next(k for k, line in enumerate(lines) if line.startswith("padded members:"))
    assert "+" in lines[head]
    per = {line.split()[0]: line for line in lines[head + 1:]}
    assert set(per) == {"0.weight", "0.bias", "2.weight"}
    assert "(members [4, 4], [12, 4])" in per["0.weight"] and "+50% elements" in per["0.weight"]
    o = wide._pad.overhead()
    assert o["padded"] > o["own"]


def test_an_output_whose_width_differs_is_padded_and_cut_per_member():
    torch.manual_seed(0)
    models = [nn.Linear(4, k) for k in (2, 5)]
    wide = wc.compile(models, torch.randn(3, 4), pad=True, config=FAST)
    x = torch.randn(2, 3, 4)
    out = wide(x)
    assert out.shape == (2, 3, 5)
    assert torch.equal(out[0, :, 2:], torch.zeros(3, 3))
    for i, (o, m) in enumerate(zip(wide.member_outputs(out), models)):
        torch.testing.assert_close(o, m(x[i]))


def test_without_pad_a_size_difference_says_how_to_fuse_it_and_the_builder_pads():
    models = [nn.Sequential(nn.Linear(4, h), nn.ReLU(), nn.Linear(h, 2)) for h in (3, 6)]
    with pytest.raises(ArchitectureMismatchError, match=r"0\.out_features is 6, member 0 has 3; .*pad=True"):
        wc.compile(models, torch.randn(2, 4), config=FAST)
    wide = wc.WideBuilder(models).with_sample(torch.randn(2, 4)).with_config(FAST).pad().build()
    assert isinstance(wide, wc.PaddedWideModel)


def test_members_that_differ_in_more_than_sizes_are_refused():
    models = [nn.Sequential(nn.Linear(4, 8), nn.ReLU()), nn.Sequential(nn.Linear(4, 16), nn.Tanh())]
    with pytest.raises(ArchitectureMismatchError, match=r"pad=True: member 1 runs .*tanh"):
        wc.compile(models, torch.randn(2, 4), pad=True, config=FAST)


def test_attention_weights_over_padded_heads_are_refused_naming_the_line():
    """need_weights=True averages the attention weights over heads: a mean over padded heads
    folded into the batch, which no static mask can cover (the batch size varies)."""
    class Heads(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.inp = nn.Linear(6, 4 * h)
            self.att = nn.MultiheadAttention(4 * h, h, batch_first=True)

        def forward(self, x):
            y = self.inp(x)
            out, weights = self.att(y, y, y, need_weights=True)
            return out.sum(-1) + weights.sum(-1)

    with pytest.raises(UnsupportedOperationError, match=r"pad=True: .*test_padding.py"):
        wc.compile([Heads(2), Heads(4)], torch.randn(2, 5, 6), pad=True, config=FAST)


def test_division_by_a_padded_value_is_refused():
    class Div(nn.Module):
        def __init__(self, h):
            super().__init__()
            self.a, self.b = nn.Linear(4, h), nn.Linear(4, h)

        def forward(self, x):
            return self.a(x) / self.b(x)

    with pytest.raises(UnsupportedOperationError, match=r"division by a padded value"):
        wc.compile([Div(3), Div(5)], torch.randn(2, 4), pad=True, config=FAST)


class Head(wc.Tower):
    """``Linear(4, h)`` then ``fn`` of its output (a module-level function: every member's)."""

    def __init__(self, h, fn):
        super().__init__()
        self.a, self.fn = nn.Linear(4, h), fn

    def forward(self, x):
        return self.fn(self.a(x))


def _exp_sum_and_softmax_max(y):
    return torch.exp(y).sum(-1) + torch.softmax(y, -1).amax(-1)


def _rsqrt(y):  # rsqrt(0) = inf in the padding, and no padding rule: refused
    return torch.rsqrt(y.abs() + 1)


def test_a_nonzero_function_of_the_padding_is_masked():
    """exp(0) = 1 in the padding: masked, so the next layer's sum over it is exact."""
    torch.manual_seed(0)
    models = [Head(3, _exp_sum_and_softmax_max), Head(7, _exp_sum_and_softmax_max)]
    wide = wc.compile(models, torch.randn(2, 4), pad=True, config=FAST)
    x = torch.randn(2, 5, 4)
    for i, m in enumerate(models):
        torch.testing.assert_close(wide(x)[i], m(x[i]))


def _small_sweep():
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(4, h), nn.LayerNorm(h), nn.ReLU(), nn.Linear(h, 2)) for h in (3, 6, 6)]


def test_member_operations_work_at_each_members_own_size():
    models = _small_sweep()
    wide = wc.compile(models, torch.randn(2, 4), pad=True, config=FAST)
    x = torch.randn(3, 5, 4)
    # member(i) and write_back: own class, own sizes, identity kept
    assert wide.member(0)[0].weight.shape == (3, 4)
    with torch.no_grad():
        wide.get_parameter("0.weight").mul_(2)
    w0 = models[0][0].weight
    wide.write_back(models)
    assert models[0][0].weight is w0 and models[0][0].weight.shape == (3, 4)
    for i, m in enumerate(models):
        torch.testing.assert_close(wide(x)[i], m(x[i]))
    # load_member_state_dict: a fresh model of member 1's size; the padding stays zero
    fresh = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.ReLU(), nn.Linear(6, 2))
    wide.load_member_state_dict(1, fresh.state_dict())
    torch.testing.assert_close(wide(x)[1], fresh(x[1]))
    with pytest.raises(ValueError, match="own size"):
        wide.load_member_state_dict(0, fresh.state_dict())  # member 0 is 3 wide
    # copying weights between members: same size only
    wide.copy_member_weights(1, 2)
    torch.testing.assert_close(wide(x)[2], fresh(x[2]))
    with pytest.raises(ValueError, match="differ in size"):
        wide.copy_member_weights(1, 0)


def test_copies_pickles_and_state_dicts_keep_the_padding():
    import pickle

    models = _small_sweep()
    wide = wc.compile(models, torch.randn(2, 4), pad=True, config=FAST)
    x = torch.randn(3, 5, 4)
    want = wide(x)
    for other in (copy.deepcopy(wide), pickle.loads(pickle.dumps(wide))):
        assert isinstance(other, wc.PaddedWideModel)
        torch.testing.assert_close(other(x), want)
        assert [m[0].out_features for m in other.unfuse()] == [3, 6, 6]
    # the masks are not state: a state_dict holds the padded parameters and buffers only
    sd = wide.state_dict()
    assert not any("_wc_pad" in k for k in sd)
    again = wc.compile(_small_sweep(), torch.randn(2, 4), pad=True, config=FAST)
    again.load_state_dict(sd)
    torch.testing.assert_close(again(x), want)


def test_torch_compile_fullgraph_of_a_padded_model():
    models = _small_sweep()
    wide = wc.compile(models, torch.randn(2, 4), pad=True, config=FAST).eval()
    x = torch.randn(3, 5, 4)
    with torch.no_grad():
        torch.testing.assert_close(torch.compile(wide, fullgraph=True, backend="eager")(x), wide(x))


SCALE = 2.0


class _ReadsAGlobal(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.lin = nn.Linear(4, h)

    def forward(self, x):
        return self.lin(x) * SCALE


def test_torch_compile_of_a_padded_model_refuses_a_changed_global_as_eager_does(monkeypatch):
    """Note [The state a padded program was captured with] under torch.compile(fullgraph=True): a
    global the members read, changed after compiling, is refused as in an eager call (the compiled
    model ran the program of the old value, silently: found by the fuzzer's torch.compile round)."""
    models = [_ReadsAGlobal(h) for h in (3, 5)]
    wide = wc.compile(models, torch.randn(2, 4), pad=True, config=FAST)
    compiled = torch.compile(wide, fullgraph=True, backend="eager")
    x = torch.randn(2, 3, 4)
    outs = wide.member_outputs(compiled(x))
    for i, m in enumerate(models):
        torch.testing.assert_close(outs[i], m(x[i]))
    monkeypatch.setitem(globals(), "SCALE", 3.0)  # the global the members' forward reads
    with pytest.raises(ValueError, match="SCALE, which the members' code reads, is 3.0 now, captured as 2.0"):
        wide(x)
    with pytest.raises(Exception, match="SCALE, which the members' code reads, is 3.0 now, captured as 2.0"):
        compiled(x)


def test_torch_compile_of_a_padded_model_with_a_padded_reduction_refuses_autocast():
    """Note [A padded reduction runs in float32 or float64] under torch.compile too: a padded
    LayerNorm under autocast is refused, not run with counts in bfloat16."""
    models = [nn.Sequential(nn.Linear(4, h), nn.LayerNorm(h)) for h in (3, 5)]
    wide = wc.compile(models, torch.randn(2, 4), pad=True, config=FAST)
    compiled = torch.compile(wide, fullgraph=True, backend="eager")
    x = torch.randn(2, 3, 4)
    compiled(x)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16), pytest.raises(Exception, match="padded reduction"):
        compiled(x)


def test_a_second_compile_after_a_refused_one_works_and_models_are_untouched():
    good = _small_sweep()
    before = copy.deepcopy(good[0].state_dict())

    with pytest.raises(UnsupportedOperationError):
        wc.compile([Head(2, _rsqrt), Head(3, _rsqrt)], torch.randn(2, 4), pad=True, config=FAST)
    wide = wc.compile(good, torch.randn(2, 4), pad=True, config=FAST)
    x = torch.randn(3, 5, 4)
    torch.testing.assert_close(wide(x)[0], good[0](x[0]))
    for k, v in good[0].state_dict().items():
        assert torch.equal(v, before[k])


def test_a_nan_in_one_member_stays_in_that_member():
    models = _small_sweep()
    wide = wc.compile(models, torch.randn(2, 4), pad=True, config=FAST)
    x = torch.randn(3, 5, 4)
    x[1, 0, 0] = float("nan")
    out = wide(x)
    assert torch.isnan(out[1, 0]).all() and not torch.isnan(out[0]).any() and not torch.isnan(out[2]).any()


class _Width(wc.Tower):
    """``Linear(4, h) -> norm(h) -> ReLU -> Linear(h, 2)`` (LayerNorm unless told)."""

    def __init__(self, h, norm=nn.LayerNorm):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, h), norm(h), nn.ReLU(), nn.Linear(h, 2))

    def forward(self, x):
        return self.net(x)


def test_the_router_measures_one_padded_group_against_groups_by_size_and_says_which():
    torch.manual_seed(0)
    router = wc.WideRouter(config=FAST, pad=True)
    towers = {f"t{i}": _Width(h) for i, h in enumerate((8, 8, 16))}  # two of one size, one other
    for name, t in towers.items():
        router.register_tower(name, copy.deepcopy(t))
    x = torch.randn(5, 4)
    router.prepare_for_compile(x)
    (names, verdict), = router.pad_decisions.items()
    assert list(names) == list(towers) and verdict.split(":")[0] in ("padded", "by size")
    assert "sizes of" in router.report() and "measured" in router.report()
    out = router.wide_forward(x)
    for name, t in towers.items():
        torch.testing.assert_close(out[name], t(x))
        torch.testing.assert_close(router[name](x), t(x))  # a tower alone, on the wide tensors
    # training through the router, then back to the towers at their own sizes
    opt = torch.optim.SGD(router.parameters(), lr=0.1)
    sum(o.sum() for o in router.wide_forward(x).values()).backward()
    opt.step()
    fresh = router.unfuse()
    assert [fresh[n].net[0].out_features for n in towers] == [8, 8, 16]
    router.write_back()
    for n in towers:
        torch.testing.assert_close(router.wide_forward(x)[n], fresh[n](x))


def test_a_padded_router_group_where_padding_is_refused_stays_grouped_by_size():
    router = wc.WideRouter(config=FAST, pad=True)
    for i, h in enumerate((3, 3, 5, 5)):
        router.register_tower(f"t{i}", Head(h, _rsqrt))
    router.prepare_for_compile(torch.randn(2, 4))
    assert router.group_members() == {"t0": ["t0", "t1"], "t2": ["t2", "t3"]}
    (verdict,) = router.pad_decisions.values()
    assert verdict.startswith("by size (padding refused")


# Probes: every op a padded value may meet. Each either compiles and matches every member, or is
# refused naming the op -- never silently wrong.
PROBES = {
    "softmax_padded_dim": lambda y: torch.softmax(y, -1) * 3,
    "log_softmax_padded_dim": lambda y: torch.log_softmax(y, -1),
    "softmax_over_batch": lambda y: torch.softmax(y, 0),
    "log_softmax_over_batch": lambda y: torch.log_softmax(y, 0),
    "amax": lambda y: y.amax(-1),
    "max_dim": lambda y: y.max(-1).values,
    "min_over_padded": lambda y: y.amin(-1),
    "sigmoid": torch.sigmoid,
    "add_one": lambda y: y + 1,
    "mean_times": lambda y: y.mean(-1, keepdim=True) * y,
    "layer_norm": lambda y: F.layer_norm(y, y.shape[-1:]),
    "cat": lambda y: torch.cat([y, torch.tanh(y)], -1),
    "expand_sum": lambda y: y.unsqueeze(1).expand(-1, 3, -1).sum(1),
    "gram": lambda y: y.t() @ y,
    "cumsum": lambda y: torch.cumsum(y, -1),
    "normalize": lambda y: F.normalize(y, dim=-1),
    "var": lambda y: y.var(-1),
    "where_positive": lambda y: torch.where(y > 0, y, torch.zeros_like(y)),
    "exp_sum": lambda y: torch.exp(y).sum(-1),
    "clamp": lambda y: y.clamp(min=0.1),
}


@pytest.mark.parametrize("probe", list(PROBES))
def test_an_op_on_padded_values_is_exact_or_refused(probe):
    torch.manual_seed(0)
    models = [Head(h, PROBES[probe]) for h in (3, 5, 4)]
    try:
        wide = wc.compile(models, torch.randn(6, 4), pad=True, config=FAST)
    except UnsupportedOperationError as e:
        assert "pad=True" in str(e) and "test_padding.py" in str(e), str(e)
        return
    x = torch.randn(3, 6, 4, requires_grad=True)
    outs = wide.member_outputs(wide(x))
    for i, m in enumerate(models):
        xi = x[i].detach().clone().requires_grad_()
        want = m(xi)
        torch.testing.assert_close(outs[i], want, msg=f"{probe}: member {i} output")
        g = torch.autograd.grad(outs[i].sum(), x, retain_graph=True)[0][i]
        torch.testing.assert_close(g, torch.autograd.grad(want.sum(), xi)[0], msg=f"{probe}: member {i} input grad")


def test_checkpoints_hold_each_member_at_its_own_size(tmp_path):
    import wide_compiler.distributed as wcd

    models = _small_sweep()
    wide = wc.compile(models, torch.randn(2, 4), pad=True, config=FAST)
    opt = wc.optim.Adam(wide.parameters(), lr=[1e-3, 2e-3, 3e-3])
    x = torch.randn(3, 5, 4)
    wide(x).square().sum().backward()
    opt.step()
    wcd.save_members(wide, tmp_path, opt)
    # any member loads into an ordinary module of its own size, with a torch.optim state
    plain = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.ReLU(), nn.Linear(3, 2))
    plain.load_state_dict(wcd.load_member(tmp_path, 0))
    torch.testing.assert_close(plain(x[0]), wide(x)[0])
    torch.optim.Adam(plain.parameters(), lr=1e-3).load_state_dict(wcd.load_member_optimizer(tmp_path, 0))
    assert wcd.load_member_optimizer(tmp_path, 1)["state"][0]["exp_avg"].shape == (6, 4)
    # and the whole population into a fresh padded model and optimizer
    again = wc.compile(_small_sweep(), torch.randn(2, 4), pad=True, config=FAST)
    opt2 = wc.optim.Adam(again.parameters())
    wcd.load_members(again, tmp_path, opt2)
    torch.testing.assert_close(again(x), wide(x))
    for (name, p), (_, q) in zip(wide.named_parameters(), again.named_parameters()):
        torch.testing.assert_close(opt2.state[q]["exp_avg"], opt.state[p]["exp_avg"], msg=name)


class _Residual(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.stem, self.conv, self.bn = nn.Conv2d(3, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.fc = nn.Linear(c, 4)

    def forward(self, x):
        h = F.relu(self.stem(x))
        h = F.relu(h + self.bn(self.conv(h)))
        return self.fc(F.adaptive_avg_pool2d(h, 1).flatten(1))


class _Generator(nn.Module):  # DCGAN-style, the feature count swept
    def __init__(self, c):
        super().__init__()
        self.net = nn.Sequential(nn.ConvTranspose2d(6, 2 * c, 4, 1, 0), nn.BatchNorm2d(2 * c), nn.ReLU(),
                                 nn.ConvTranspose2d(2 * c, c, 4, 2, 1), nn.BatchNorm2d(c), nn.ReLU(),
                                 nn.ConvTranspose2d(c, 3, 4, 2, 1), nn.Tanh())

    def forward(self, z):
        return self.net(z)


class _Depthwise(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.pw, self.dw, self.fc = nn.Conv2d(3, c, 1), nn.Conv2d(c, c, 3, padding=1, groups=c), nn.Linear(c, 2)

    def forward(self, x):
        return self.fc(F.relu(self.dw(F.relu(self.pw(x)))).mean((2, 3)))


class _GRU(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.rnn, self.fc = nn.GRU(6, h, batch_first=True), nn.Linear(h, 2)

    def forward(self, x):
        return self.fc(self.rnn(x)[1][0])


MODELS = {
    "residual_bn": (_Residual, (4, 8, 6), (2, 3, 8, 8)),
    "dcgan_generator": (_Generator, (4, 8), (2, 6, 1, 1)),
    "depthwise": (_Depthwise, (4, 8), (2, 3, 8, 8)),
    "gru_hidden": (_GRU, (4, 8, 5), (2, 5, 6)),
    "batchnorm1d_mlp": (lambda h: nn.Sequential(nn.Linear(8, h), nn.BatchNorm1d(h), nn.ReLU(), nn.Linear(h, 2)),
                        (4, 8, 6), (5, 8)),
    "rmsnorm": (lambda h: nn.Sequential(nn.Linear(8, h), nn.RMSNorm(h), nn.SiLU(), nn.Linear(h, 2)), (4, 8), (5, 8)),
}


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", list(MODELS))
def test_more_sweeps_match_every_member(name, training):
    """Outputs, input gradients and parameter gradients of each member, train and eval mode."""
    make, sizes, shape = MODELS[name]
    torch.manual_seed(0)
    models = [make(s).to(DT).train(training) for s in sizes]
    refs = [copy.deepcopy(m) for m in models]
    wide = wc.compile(models, torch.randn(shape, dtype=DT), pad=True, config=FAST)
    x = torch.randn(len(sizes), *shape, dtype=DT, requires_grad=True)
    outs = wide.member_outputs(wide(x))
    sum(o.square().sum() for o in outs).backward()
    params = dict(wide.named_parameters())
    for i, r in enumerate(refs):
        xi = x[i].detach().clone().requires_grad_()
        want = r(xi)
        torch.testing.assert_close(outs[i], want, rtol=1e-9, atol=1e-10)
        want.square().sum().backward()
        torch.testing.assert_close(x.grad[i], xi.grad, rtol=1e-9, atol=1e-10)
        for pname, q in r.named_parameters():
            got = wide._pad.member_slice(params[pname].grad[i], wide._pad.state_layouts[pname], i)
            torch.testing.assert_close(got, q.grad, rtol=1e-9, atol=1e-10, msg=f"{name}: member {i} {pname}.grad")
        for bname, b in r.named_buffers():
            torch.testing.assert_close(wide.member_state_dict(i)[bname], b, msg=f"{name}: member {i} {bname}")


def test_the_routers_measurement_changes_no_tower_and_times_training_steps():
    """Grouping measures in the router's mode: a training router times forward + backward; the
    timing's calls leave every running statistic, gradient and RNG state as it was."""
    torch.manual_seed(0)
    towers = {f"t{i}": _Width(h, nn.BatchNorm1d) for i, h in enumerate((4, 4, 8, 6))}
    router = wc.WideRouter(config=FAST, pad=True).train()
    for name, t in towers.items():
        router.register_tower(name, copy.deepcopy(t))
    lone = router._modules["t3"]
    lone.net[0].weight.grad = torch.ones_like(lone.net[0].weight)
    x = torch.randn(5, 4)
    state = torch.random.get_rng_state()
    router.prepare_for_compile(x)
    assert torch.equal(torch.random.get_rng_state(), state)
    (verdict,) = router.pad_decisions.values()
    assert "per training step" in verdict
    groups = router.group_members()
    if "t3" in groups and groups["t3"] == ["t3"]:  # by size: the singleton is the user's module
        assert torch.equal(lone.net[0].weight.grad, torch.ones_like(lone.net[0].weight))
        assert torch.equal(lone.net[1].running_mean, towers["t3"].net[1].running_mean)
    out = router.wide_forward(x)
    for name, t in towers.items():  # first real step: same batch statistics as each tower alone
        torch.testing.assert_close(out[name], t(x))
    for i, (name, t) in enumerate(towers.items()):
        torch.testing.assert_close(router[name].state_dict()["net.1.running_mean"], t.net[1].running_mean)


def test_the_padding_gets_no_gradient_whatever_copies_or_reloads_the_parameters():
    """A loss that reads the padded part of an output sends gradient into the padding; the
    parameters' gradient masks stop it, also on copies, pickles, .double(), a state_dict loaded
    with assign=True and a parameter set by hand (which replace the Parameter objects)."""
    import pickle

    torch.manual_seed(0)
    models = [nn.Linear(4, k) for k in (2, 5)]
    base = wc.compile(models, torch.randn(3, 4), pad=True, config=FAST)
    assign = wc.compile([nn.Linear(4, k) for k in (2, 5)], torch.randn(3, 4), pad=True, config=FAST)
    assign.load_state_dict(base.state_dict(), assign=True)
    by_hand = copy.deepcopy(base)
    by_hand.weight = nn.Parameter(by_hand.weight.detach().clone())  # a new Parameter object, set by hand
    for wide in (base, copy.deepcopy(base), pickle.loads(pickle.dumps(base)), copy.deepcopy(base).double(), assign,
                 by_hand):
        dtype = next(wide.parameters()).dtype
        wide.zero_grad()
        wide(torch.randn(2, 3, 4, dtype=dtype)).sum().backward()  # the raw padded output, padding included
        g = wide.weight.grad
        assert torch.equal(g[0, 2:], torch.zeros_like(g[0, 2:])) and bool(g[1].ne(0).all())
        assert torch.equal(wide.bias.grad[0, 2:], torch.zeros(3, dtype=dtype))


def test_a_new_sequence_length_on_a_padded_model_says_the_sizes_are_the_samples():
    """A padded model's program is made at the sample's sizes; a call at another length is
    refused saying so, not that each member takes only the sample's length (each member alone
    takes any length)."""
    torch.manual_seed(0)
    models = [Encoder(2, hd, 16).to(DT) for hd in (2, 4)]
    wide = wc.compile(models, torch.randn(2, 5, 6, dtype=DT), pad=True, config=FAST)
    x = torch.randn(2, 2, 7, 6, dtype=DT)
    assert all(m(x[i]).shape == (2, 2) for i, m in enumerate(models))  # each member alone takes 7
    with pytest.raises(ValueError, match=r"padded model \(pad=True\).*Compile with a sample of the size") as e:
        wide(x)
    assert "each member takes only" not in str(e.value)
    assert torch.allclose(wide(x[:, :, :5])[1], models[1](x[1, :, :5]))  # the sample's length still runs
