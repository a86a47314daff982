"""Size sweeps fused by padding, tried as a user would (issue 44, padding): each member of a
padded wide model computes exactly what it computes alone (float64), or the compile, the call or
the load refuses clearly, naming the member and what differs. One test per defect found by the
probe: kernel-size sweeps, the router's padded group, index bounds of a padded vocabulary,
loading a state dict of other member sizes, a norm right after a norm, and swept heads.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
import wide_compiler as wc
import wide_compiler.router.padding as wc_router_padding
from support import Call, cpu_only
from torch import nn
from wide_compiler.errors import UnsupportedOperationError

FAST = wc.WideConfig.fast()
DT = torch.float64


def _same_as_alone(wide, models, xs, *, grads=True):
    """Each member's output, input gradient and parameter gradients equal the member's own."""
    x = xs.clone().requires_grad_(grads)
    outs = wide.member_outputs(wide(x))
    if grads:
        sum(o.square().sum() for o in outs).backward()
    params = dict(wide.named_parameters())
    for i, m in enumerate(models):
        ref = copy.deepcopy(m)
        xi = xs[i].clone().requires_grad_(grads)
        want = ref(xi)
        torch.testing.assert_close(outs[i], want, rtol=1e-9, atol=1e-10, msg=f"member {i} output")
        if not grads:
            continue
        want.square().sum().backward()
        torch.testing.assert_close(x.grad[i], xi.grad, rtol=1e-9, atol=1e-10, msg=f"member {i} input grad")
        for name, q in ref.named_parameters():
            got = wide._pad.member_slice(params[name].grad[i], wide._pad.state_layouts[name], i)
            torch.testing.assert_close(got, q.grad, rtol=1e-9, atol=1e-10, msg=f"member {i} {name}.grad")
        for name, q in wide.member(i).named_parameters():
            assert torch.equal(q, dict(m.named_parameters())[name]), f"member({i}).{name}"


# (conv class, per-member (kernel_size, kwargs), one member's input shape)
KERNEL_SWEEPS = {
    "conv2d_same": (nn.Conv2d, [(3, dict(padding="same")), (5, dict(padding="same"))], (2, 3, 7, 7)),
    "conv2d_half": (nn.Conv2d, [(5, dict(padding=2)), (3, dict(padding=1)), (1, dict(padding=0))], (2, 3, 7, 7)),
    "conv1d_half_stride2": (nn.Conv1d, [(3, dict(padding=1, stride=2)), (5, dict(padding=2, stride=2))], (2, 3, 9)),
    "conv1d_even_same": (nn.Conv1d, [(2, dict(padding="same")), (4, dict(padding="same"))], (2, 3, 9)),
    "conv1d_dilated": (nn.Conv1d, [(3, dict(padding=2, dilation=2)), (5, dict(padding=4, dilation=2))], (2, 3, 11)),
    "conv2d_rect": (nn.Conv2d, [((1, 3), dict(padding=(0, 1))), ((3, 5), dict(padding=(1, 2)))], (2, 3, 6, 6)),
    "conv_transpose2d": (nn.ConvTranspose2d, [(3, dict(padding=1, stride=2, output_padding=1)),
                                              (5, dict(padding=2, stride=2, output_padding=1))], (2, 3, 4, 4)),
}


@pytest.mark.parametrize("sweep", list(KERNEL_SWEEPS))
def test_a_kernel_size_sweep_runs_each_member_with_its_own_padding(sweep):
    """A smaller kernel centred in the largest, with the common padding, is each member's own
    convolution (Note [Kernel-size sweeps]); it used to be placed as a prefix under member 0's
    padding (off by 1-2, or the wrong output shape)."""
    conv, members, shape = KERNEL_SWEEPS[sweep]
    torch.manual_seed(0)
    models = [Call(conv(3, 4, k, **kw)).to(DT) for k, kw in members]
    wide = wc.compile(models, torch.randn(shape, dtype=DT), pad=True, config=FAST)
    _same_as_alone(wide, models, torch.randn(len(models), *shape, dtype=DT))


def test_a_kernel_size_sweep_that_padding_cannot_centre_is_refused_naming_member_and_module():
    """Kernel 3 with padding 0 and kernel 5 with padding 2 at stride 3 give outputs of one shape,
    but no placement of the smaller kernel computes member 0's convolution: refused."""
    torch.manual_seed(0)
    models = [Call(nn.Conv1d(3, 4, 3, padding=0, stride=3)).to(DT),
              Call(nn.Conv1d(3, 4, 5, padding=2, stride=3)).to(DT)]
    assert models[0](torch.randn(2, 3, 9, dtype=DT)).shape == models[1](torch.randn(2, 3, 9, dtype=DT)).shape
    with pytest.raises(UnsupportedOperationError, match=r"module 'fn'.*kernel_size differ.*member 1.*padding"):
        wc.compile(models, torch.randn(2, 3, 9, dtype=DT), pad=True, config=FAST)


class _ConvTower(wc.Tower):
    def __init__(self, k):
        super().__init__()
        self.c = nn.Conv2d(3, 4, k, padding=k // 2)

    def forward(self, x):
        return self.c(x).relu().sum((-1, -2))


def test_the_router_keeps_a_padded_kernel_sweep_only_exactly(monkeypatch):
    """The router's padded group of a kernel-size sweep: the timing says padded is faster (made
    so here), and every tower's output is its own."""
    monkeypatch.setattr(wc_router_padding, "time_interleaved", lambda fns, **kw: {"padded": 1.0, "by_size": 2.0})
    torch.manual_seed(0)
    towers = {f"t{i}": _ConvTower(k).to(DT) for i, k in enumerate((3, 3, 5))}
    router = wc.WideRouter(config=FAST, pad=True)
    for name, t in towers.items():
        router.register_tower(name, copy.deepcopy(t))
    x = torch.randn(2, 3, 6, 6, dtype=DT)
    router.prepare_for_compile(x)
    (verdict,) = router.pad_decisions.values()
    assert verdict.startswith("padded"), verdict
    out = router.wide_forward(x)
    for name, t in towers.items():
        torch.testing.assert_close(out[name], t(x), rtol=1e-9, atol=1e-10, msg=name)
        torch.testing.assert_close(router[name](x), t(x), rtol=1e-9, atol=1e-10, msg=f"{name} alone")
    # a tower alone runs on views of the wide weight (its 3x3 kernel centred in the 5x5): its
    # gradient reaches the wide parameter there, and only there
    (wide,) = router.groups.values()
    router["t0"](x).sum().backward()
    g = wide.c.weight.grad
    assert bool(g[0, :, :, 1:4, 1:4].ne(0).any())
    assert not g[0, :, :, 0].any() and not g[0, :, :, 4].any() and not g[1:].any()


class _Vocab(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.e = nn.Embedding(v, 4)

    def forward(self, idx):
        return self.e(idx)


@cpu_only  # on CUDA an index out of range is a device-side assert, which ends the process's CUDA context
def test_an_index_past_a_members_own_vocabulary_raises_as_the_member_does():
    """Member 0 has 5 rows, member 1 has 10: index 7 raises IndexError for member 0 (it used to
    read a zero row of the padding) naming the member, its table and its index."""
    torch.manual_seed(0)
    models = [_Vocab(5).to(DT), _Vocab(10).to(DT)]
    wide = wc.compile(models, torch.tensor([1, 2]), pad=True, config=FAST)
    ok = torch.tensor([[0, 4, 4], [0, 7, 9]])
    for i, o in enumerate(wide.member_outputs(wide(ok))):
        torch.testing.assert_close(o, models[i](ok[i]))
    with pytest.raises(IndexError):
        models[0](torch.tensor([1, 7]))
    with pytest.raises(IndexError, match=r"member 0: index 7 .*'e\.weight' \(5 rows\)"):
        wide(torch.tensor([[1, 7], [1, 7]]))
    with pytest.raises(IndexError, match=r"member 1: index 10 .*'e\.weight' \(10 rows\)"):
        wide(torch.tensor([[1, 2], [1, 10]]))
    with pytest.raises(IndexError, match=r"member 1: index -1 "):
        wide(torch.tensor([[1, 2], [1, -1]]))


def _sweep(sizes):
    torch.manual_seed(0)
    return [nn.Sequential(nn.Linear(4, h), nn.ReLU(), nn.Linear(h, 2)).to(DT) for h in sizes]


def test_load_state_dict_refuses_other_member_sizes_and_nonzero_padding_before_changing_anything():
    wide = wc.compile(_sweep((3, 6)), torch.randn(2, 4, dtype=DT), pad=True, config=FAST)
    other = wc.compile(_sweep((6, 3)), torch.randn(2, 4, dtype=DT), pad=True, config=FAST)
    before = copy.deepcopy(wide.state_dict())
    x = torch.randn(2, 5, 4, dtype=DT)
    want = wide(x)
    sd = other.state_dict()  # the same padded shapes, other member sizes
    assert all(sd[k].shape == v.shape for k, v in before.items())
    with pytest.raises(ValueError, match=r"member 0 has '0\.weight' of shape \[6, 4\]; this model's member 0 has "
                                         r"\[3, 4\]"):
        wide.load_state_dict(sd)
    # without the recorded sizes (a plain dict): the padding is not zero
    with pytest.raises(ValueError, match=r"'0\.weight' is not zero in the padding of member 0"):
        wide.load_state_dict(dict(sd))
    # this model's own state with the padding changed by hand, also with assign=True
    mine = {k: v.clone() for k, v in before.items()}
    mine["2.weight"][0, :, 5] = 1.0
    for assign in (False, True):
        with pytest.raises(ValueError, match=r"'2\.weight' is not zero in the padding of member 0 \(outside its "
                                             r"own \[2, 3\]\)"):
            wide.load_state_dict(mine, assign=assign)
    for k, v in wide.state_dict().items():
        assert torch.equal(v, before[k]), k
    torch.testing.assert_close(wide(x), want)
    # inside a larger module: refused the same way
    holder = nn.ModuleDict({"wide": wide})
    with pytest.raises(ValueError, match="is not zero in the padding"):
        holder.load_state_dict({f"wide.{k}": v for k, v in mine.items()})
    # its own state (metadata included) still loads, through torch.save too
    import io

    buf = io.BytesIO()
    torch.save(wide.state_dict(), buf)
    buf.seek(0)
    again = wc.compile(_sweep((3, 6)), torch.randn(2, 4, dtype=DT), pad=True, config=FAST)
    again.load_state_dict(torch.load(buf, weights_only=True))
    torch.testing.assert_close(again(x), want)
    for i, m in enumerate(again.unfuse()):
        torch.testing.assert_close(m(x[i]), want[i])


class _TwoNorms(nn.Module):
    def __init__(self, h, first, then):
        super().__init__()
        self.fc = nn.Linear(4, h)
        self.n1 = first(h)
        self.n2 = nn.LayerNorm(h) if then == "layer_norm" else None

    def forward(self, x):
        y = self.n1(self.fc(x))
        return self.n2(y) if self.n2 is not None else torch.softmax(y, -1)


@pytest.mark.parametrize("first,then", [(nn.LayerNorm, "layer_norm"), (nn.RMSNorm, "layer_norm"),
                                        (nn.LayerNorm, "softmax"), (nn.RMSNorm, "softmax")])
def test_a_norm_or_softmax_right_after_a_norm_over_a_padded_dim(first, then):
    """The second op reads the first's decomposition (it used to crash with KeyError: 'val')."""
    torch.manual_seed(0)
    models = [_TwoNorms(h, first, then).to(DT) for h in (3, 6)]
    wide = wc.compile(models, torch.randn(2, 4, dtype=DT), pad=True, config=FAST)
    _same_as_alone(wide, models, torch.randn(2, 5, 4, dtype=DT))


class _Heads(nn.Module):
    def __init__(self, heads, encoder=False):
        super().__init__()
        d = 4 * heads
        self.inp = nn.Linear(6, d)
        self.att = (nn.TransformerEncoderLayer(d, heads, 16, dropout=0.0, batch_first=True) if encoder
                    else nn.MultiheadAttention(d, heads, batch_first=True))

    def forward(self, x):
        y = self.inp(x)
        return (self.att(y) if isinstance(self.att, nn.TransformerEncoderLayer)
                else self.att(y, y, y, need_weights=False)[0]).sum(-1)


@pytest.mark.parametrize("encoder", [False, True], ids=["mha", "encoder_layer"])
def test_a_heads_sweep_at_one_head_dim_matches_every_member(encoder):
    """Heads (2, 3) at head dim 4: the packed in-projection's 24 of 36 rows are a box of
    [3, 12] only as [2, 12], not the member's [3, 8]; it used to be refused with an internal
    message ("the padding of dim 2 does not match the sizes [3, 3]")."""
    torch.manual_seed(0)
    models = [_Heads(h, encoder).to(DT) for h in (2, 3)]
    wide = wc.compile(models, torch.randn(2, 7, 6, dtype=DT), pad=True, config=FAST)
    _same_as_alone(wide, models, torch.randn(2, 3, 7, 6, dtype=DT))


@pytest.mark.parametrize("heads", [(2, 5), (5, 2)])
def test_a_heads_sweep_whose_heads_equal_a_sample_size_matches_every_member(heads):
    """5 heads and a sample of sequence length 5: export shares batch * heads with length *
    batch in that member (one size node where the other member has two); the programs are
    aligned through the places the sizes are read (Note [Aligning sizes computed in Python]).
    It used to be refused as a program that "differs in more than sizes"."""
    torch.manual_seed(0)
    models = [_Heads(h).to(DT) for h in heads]
    wide = wc.compile(models, torch.randn(2, 5, 6, dtype=DT), pad=True, config=FAST)
    _same_as_alone(wide, models, torch.randn(2, 3, 5, 6, dtype=DT))


def test_a_heads_sweep_with_one_head_is_refused_saying_why():
    """One head: no batch * heads to pad (its attention reads the batch size itself)."""
    models = [_Heads(h).to(DT) for h in (1, 3)]
    with pytest.raises(UnsupportedOperationError, match=r"member 1 runs the same ops as member 0 .*one attention "
                                                        r"head"):
        wc.compile(models, torch.randn(2, 7, 6, dtype=DT), pad=True, config=FAST)


class _OtherDims(nn.Module):
    """A padded width and an unpadded [B, 3, 3] tensor reduced or transposed over ``self.d``:
    a dim that differs between members is another program, not another size."""

    def __init__(self, h, d, how):
        super().__init__()
        self.fc, self.g, self.d, self.how = nn.Linear(4, h), nn.Linear(4, 9), d, how

    def forward(self, x):
        z = self.g(x).view(-1, 3, 3)
        z = {"mean": lambda: z.mean(self.d), "sum": lambda: z.sum(self.d), "amax": lambda: z.amax(self.d),
             "transpose": lambda: z.transpose(self.d, 2)[:, 0]}[self.how]()
        return self.fc(x).sum(-1, keepdim=True) + z


@pytest.mark.parametrize("how", ["mean", "sum", "amax", "transpose"])
def test_members_that_reduce_or_permute_other_dims_are_refused(how):
    """The shapes agree, so this used to run member 0's dims for every member."""
    models = [_OtherDims(3, 1, how).to(DT), _OtherDims(5, 2, how).to(DT)]
    with pytest.raises(UnsupportedOperationError, match=r"member 1 passes the dims \[.*2.*\] where member 0 passes"):
        wc.compile(models, torch.randn(2, 4, dtype=DT), pad=True, config=FAST)


# --- the padded program's assumptions (Note [A padded program's assumptions]) -------------------
class SizeBranch(nn.Module):
    """A forward whose program depends on the input's sizes: ``body`` picks how."""

    def __init__(self, hidden: int, body) -> None:
        super().__init__()
        self.fc, self.out, self.body = nn.Linear(3, hidden), nn.Linear(hidden, 2), body

    def forward(self, x):
        return self.body(self, x)


SIZE_BRANCHES = {
    "T parity": lambda s, x: s.out(s.fc(x)) * (1.0 if x.shape[1] % 2 else 2.0),
    "pad T to a multiple of 4": lambda s, x: F.pad(s.out(s.fc(x)), (0, 0, 0, (-x.shape[1]) % 4)),
    "batch parity": lambda s, x: s.out(s.fc(x)) + (1.0 if x.shape[0] % 2 else -1.0),
    "T > 8": lambda s, x: s.out(s.fc(x)) if x.shape[1] > 8 else s.out(s.fc(x).relu()),
    "sum over T / T": lambda s, x: s.out(s.fc(x)).sum(1) / x.shape[1],
}


@pytest.mark.parametrize("body", list(SIZE_BRANCHES), ids=list(SIZE_BRANCHES))
def test_a_padded_program_runs_only_at_the_sizes_it_was_captured_for(body):
    """The padded program is the members' programs captured at the sample's sizes: at another
    sequence length or a batch its guards exclude, each call matches every member or is refused
    naming the assumption (it ran the sample's branch: 0.5-2 off, or the wrong output shape)."""
    torch.manual_seed(0)
    models = [SizeBranch(h, SIZE_BRANCHES[body]).double() for h in (2, 5)]
    wide = wc.compile(models, torch.randn(4, 6, 3, dtype=torch.float64), config=FAST, pad=True)
    for training in (False, True):
        wide.train(training)
        for m in models:
            m.train(training)
        for batch, t in ((4, 6), (3, 6), (2, 6), (4, 5), (4, 9), (4, 1), (1, 6)):
            x = torch.randn(2, batch, t, 3, dtype=torch.float64)
            try:
                outs = wide.member_outputs(wide(x))
            except ValueError as e:
                assert "pad=True" in str(e) and ("holds only where" in str(e) or "fixed at capture" in str(e)), e
                continue
            for i, m in enumerate(models):
                torch.testing.assert_close(outs[i], m(x[i]), msg=lambda s, i=i: f"B={batch} T={t} member {i}: {s}")


def test_a_padded_batch_parity_guard_refuses_an_odd_batch_and_keeps_even_ones():
    torch.manual_seed(0)
    models = [SizeBranch(h, SIZE_BRANCHES["batch parity"]).double() for h in (2, 5)]
    wide = wc.compile(models, torch.randn(4, 6, 3, dtype=torch.float64), config=FAST, pad=True)
    for batch in (4, 6, 2):
        x = torch.randn(2, batch, 6, 3, dtype=torch.float64)
        torch.testing.assert_close(wide.member_outputs(wide(x))[1], models[1](x[1]))
    with pytest.raises(ValueError, match=r"pad=True: the padded train program .* holds only where "
                                         r"\(L\['x'\]\.size\(\)\[0\] % 2\) == 0"):
        wide(torch.randn(2, 3, 6, 3, dtype=torch.float64))


def test_a_group_norm_over_a_2d_input_with_padded_channels():
    """GroupNorm over [B, C] (no spatial dims) in a channel sweep: it crashed the compile with an
    internal IndexError (the padded form flattened dims from 2 on)."""
    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(4, c), nn.GroupNorm(2, c)).double() for c in (2, 4, 6)]
    wide = wc.compile(models, torch.randn(3, 4, dtype=torch.float64), config=FAST, pad=True)
    _same_as_alone(wide, models, torch.randn(3, 5, 4, dtype=torch.float64))


def test_members_whose_input_widths_differ_are_refused_naming_the_member():
    """Linear(h, 4) with h = 3, 5 takes inputs of other widths: padding cannot fuse that; the
    refusal names member 1 and its own error (it blamed export: "make the forward exportable")."""
    models = [nn.Sequential(nn.Linear(h, 4), nn.ReLU(), nn.Linear(4, 2)) for h in (3, 5)]
    with pytest.raises(wc.ArchitectureMismatchError, match=r"pad=True: member 1 fails on the sample .*"
                                                          r"must take inputs of the same sizes"):
        wc.compile(models, torch.randn(2, 3), pad=True, config=FAST)


class _Recurrent(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.rnn = nn.LSTM(3, hidden, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0].sum(1)


def test_a_pickled_padded_model_trains_and_runs_as_the_original():
    """pickle makes the padded programs again from the members (a GraphModule's pickle traces its
    code again: BatchNorm's num_batches_tracked then never advanced, and a padded LSTM failed to
    load with an internal tracing error)."""
    import pickle

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(5, h), nn.BatchNorm1d(h)).to(DT) for h in (2, 5)]
    wide = pickle.loads(pickle.dumps(wc.compile(models, torch.randn(4, 5, dtype=DT), pad=True, config=FAST)))
    refs = copy.deepcopy(models)
    for _ in range(3):
        x = torch.randn(2, 4, 5, dtype=DT)
        outs = wide.member_outputs(wide(x))
        for i, ref in enumerate(refs):
            torch.testing.assert_close(outs[i], ref(x[i]))
    for i, ref in enumerate(refs):
        for name, t in ref.state_dict().items():
            torch.testing.assert_close(wide.member_state_dict(i)[name], t, msg=name)
    rnns = [_Recurrent(h).to(DT) for h in (2, 4)]
    wide = pickle.loads(pickle.dumps(wc.compile(rnns, torch.randn(2, 3, 3, dtype=DT), pad=True, config=FAST)))
    _same_as_alone(wide, rnns, torch.randn(2, 2, 3, 3, dtype=DT))


def test_a_padded_model_pickled_before_the_split_into_modules_still_loads():
    """Before fx/padding.py was split by concern, a pickle of a padded model named its padded
    members, what padding did and their assumptions wide_compiler.fx.padding.<class>; such a
    pickle still loads and runs the same."""
    import pickle
    import re

    torch.manual_seed(0)
    models = [nn.Sequential(nn.Linear(5, h), nn.Tanh(), nn.Linear(h, 3)).to(DT) for h in (2, 4)]
    wide = wc.compile(models, torch.randn(4, 5, dtype=DT), pad=True, config=FAST)
    # protocol 2 names a class as b"c<module>\n<name>\n": rewritten to the module of before the split
    data = re.sub(rb"cwide_compiler\.fx\.padded_members\n", b"cwide_compiler.fx.padding\n",
                  pickle.dumps(wide, protocol=2))
    for cls in (b"PaddedMember", b"PadInfo", b"Assumptions"):
        assert b"cwide_compiler.fx.padding\n" + cls + b"\n" in data
    loaded = pickle.loads(data)
    x = torch.randn(2, 4, 5, dtype=DT)
    torch.testing.assert_close(loaded(x), wide(x), rtol=0, atol=0)
    _same_as_alone(loaded, models, x)
