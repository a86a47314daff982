"""Member tiles (Note [Member tiles] in fx/tiling.py): the wide graph run on chunks of members
computes what every member computes alone (outputs, input and parameter gradients, buffers,
train and eval, own and shared inputs), whatever the chunks; folds stay cached; a tile that
cannot apply is not used, and says so."""
from __future__ import annotations

import copy
import logging
import pickle

import pytest
import torch
import torch.nn.functional as F
import wide_compiler as wc
from torch import nn
from wide_compiler import testing, zoo
from wide_compiler.fx import fold, tiling

N = 5


def _tiled(k: int) -> wc.WideConfig:
    return wc.WideConfig.fast().replace(member_tile=k)


class _PerMemberSlope(nn.Module):
    def __init__(self, slope: float) -> None:
        super().__init__()
        self.fc1, self.fc2, self.slope = nn.Linear(6, 16), nn.Linear(16, 3), slope

    def forward(self, x):
        return self.fc2(F.leaky_relu(self.fc1(x), self.slope))


class _TwoOutputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.bn, self.head = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.Linear(6, 2)

    def forward(self, x):
        h = F.relu(self.bn(self.conv(x)))
        return {"features": h, "logits": self.head(h.mean((2, 3)))}


class _Recurrent(nn.Module):
    def __init__(self, cell: type) -> None:
        super().__init__()
        self.rnn, self.head = cell(5, 8, num_layers=2, batch_first=True), nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


CASES = {
    "resnet (BatchNorm, eval fold)": (lambda: zoo.ResNetTiny(width=4, classes=3, pool=False), (2, 3, 12, 12)),
    "mobilenet (depthwise)": (lambda: zoo.mobilenet(width=4, classes=3), (2, 3, 12, 12)),
    "mlp": (lambda: zoo.MLP(8, 16, 3), (7, 8)),
    "encoder layer (attention)": (lambda: zoo.encoder_layer(8, 2, 16), (3, 5, 8)),
    "lstm": (lambda: _Recurrent(nn.LSTM), (3, 4, 5)),
    "gru": (lambda: _Recurrent(nn.GRU), (3, 4, 5)),
    "two outputs": (_TwoOutputs, (2, 3, 6, 6)),
}


# Every case with chunks of 2 (N=5: chunks of 2, 2 and 1, so a short last chunk and a chunk of one
# member), and the cheapest case also with chunks of 1 (every member alone) and of 3 (3 and 2): the
# chunking is the same code for every model, the graph's ops are what differs between the cases.
TILINGS = [(case, 2) for case in CASES] + [("mlp", 1), ("mlp", 3)]


@pytest.mark.parametrize("case, k", TILINGS, ids=[f"{c}-{k}" for c, k in TILINGS])
def test_a_tiled_graph_matches_the_members_in_train_and_eval(case, k):
    make, shape = CASES[case]
    torch.manual_seed(k)
    models = [make() for _ in range(N)]
    wide, report = testing.check_compile(models, torch.randn(*shape), config=_tiled(k))
    for mode in (True, False):
        wg = wide._graph_for(mode)
        assert wg.member_tile == k and wg.tiled is not None, (case, mode)
    assert all(not isinstance(r, str) for r in report.values()), report


def test_per_member_constants_are_split_with_the_members():
    torch.manual_seed(0)
    models = [_PerMemberSlope(s) for s in (0.01, 0.1, 0.2, 0.3, 0.5)]
    wide, _ = testing.check_compile(models, torch.randn(4, 6), config=_tiled(2))
    assert wide.per_member_constants and wide._graph_for(True).member_tile == 2


def test_tabular_two_inputs_one_of_them_integer():
    torch.manual_seed(0)
    models = [zoo.Tabular() for _ in range(N)]
    idx, num = torch.randint(0, 10, (6, 2)), torch.randn(6, 3)
    wide, _ = testing.check_compile(models, (idx, num), config=_tiled(2), shared=False,
                                    inputs=[(torch.randint(0, 10, (6, 2)), torch.randn(6, 3)) for _ in models])
    assert wide._graph_for(False).member_tile == 2


def test_training_steps_update_each_member_as_alone():
    """Five SGD steps with momentum on the tiled train graph: parameters and BatchNorm running
    statistics equal each member trained alone."""
    torch.manual_seed(0)
    models = [zoo.ResNetTiny(width=4, classes=3, pool=False) for _ in range(N)]
    alone = copy.deepcopy(models)
    wide = wc.compile(models, torch.randn(2, 3, 12, 12), config=_tiled(2))
    opt = torch.optim.SGD(wide.parameters(), lr=0.05, momentum=0.9)
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in alone]
    for _ in range(5):
        x, t = torch.randn(N, 2, 3, 12, 12), torch.randn(N, 2, 3)
        opt.zero_grad()
        F.mse_loss(wide(x), t, reduction="sum").backward()
        opt.step()
        for i, (m, o) in enumerate(zip(alone, opts)):
            o.zero_grad()
            F.mse_loss(m(x[i]), t[i], reduction="sum").backward()
            o.step()
    for name, t in wide.state_dict().items():
        testing.assert_members_close(t, [m.state_dict()[name] for m in alone], what=name)


def test_the_fold_is_computed_once_for_all_members_and_never_stale(monkeypatch):
    torch.manual_seed(0)
    models = [zoo.ResNetTiny(width=4, classes=3, pool=False).eval() for _ in range(N)]
    wide = wc.compile(models, torch.randn(2, 3, 12, 12), config=_tiled(2))
    calls = []
    real = fold.folded_conv_params
    monkeypatch.setattr(fold, "folded_conv_params", lambda *a: calls.append(a[0].shape) or real(*a))
    x = torch.randn(N, 2, 3, 12, 12)
    with torch.no_grad():
        wide(x)
        first = len(calls)
        wide(x)
    assert first > 0 and len(calls) == first, "a steady loop recomputes no fold"
    assert all(shape[0] == N for shape in calls), "folds run on all members, not per chunk"
    # stale never: a weight changed through load_state_dict, then .to(float64)
    state = wide.state_dict()
    state["stem.0.weight"] = state["stem.0.weight"] * 2
    wide.load_state_dict(state)
    for i, m in enumerate(models):
        m.stem[0].weight.data.mul_(2)
    with torch.no_grad():
        testing.assert_members_close(wide(x), [m(x[i]) for i, m in enumerate(models)], what="after load_state_dict")
        wide.to(torch.float64)
        x64 = x.double()
        testing.assert_members_close(wide(x64), [m.double()(x64[i]) for i, m in enumerate(models)],
                                     what="after .to(float64)")


def test_new_sizes_keep_the_tile_and_torch_compile_runs_it():
    torch.manual_seed(0)
    models = [zoo.ResNetTiny(width=4, classes=3, pool=False).eval() for _ in range(N)]
    wide = wc.compile(models, torch.randn(2, 3, 12, 12), config=_tiled(2)).eval()
    for shape in ((3, 3, 12, 12), (2, 3, 16, 16)):  # a new batch, then a new image size (captured again)
        x = torch.randn(N, *shape)
        with torch.no_grad():
            testing.assert_members_close(wide(x), [m(x[i]) for i, m in enumerate(models)], what=str(shape))
        assert wide._graph_for(False).member_tile == 2
    compiled = torch.compile(wide, fullgraph=True)
    x = torch.randn(N, 2, 3, 16, 16)
    with torch.no_grad():
        testing.assert_members_close(compiled(x), [m(x[i]) for i, m in enumerate(models)], what="torch.compile")


def test_copies_and_pickles_run_tiled_and_alike():
    torch.manual_seed(0)
    models = [zoo.MLP(8, 16, 3) for _ in range(N)]
    wide = wc.compile(models, torch.randn(4, 8), config=_tiled(2))
    x = torch.randn(N, 4, 8)
    want = wide(x)
    for other in (copy.deepcopy(wide), pickle.loads(pickle.dumps(wide))):
        torch.testing.assert_close(other(x), want)
        assert other._graph_for(True).member_tile == 2


def test_nan_in_one_member_stays_in_that_member():
    torch.manual_seed(0)
    models = [zoo.ResNetTiny(width=4, classes=3, pool=False) for _ in range(N)]
    wide = wc.compile(models, torch.randn(2, 3, 12, 12), config=_tiled(2))
    x = torch.randn(N, 2, 3, 12, 12)
    x[3, 0, 0, 0, 0] = float("nan")
    out = wide(x)
    assert out[3].isnan().any() and not out[[0, 1, 2, 4]].isnan().any()


def test_member_tile_0_or_at_least_n_does_not_tile():
    models = [zoo.MLP(8, 16, 3) for _ in range(N)]
    for k in (0, N, N + 3):
        wide = wc.compile(models, torch.randn(4, 8), config=_tiled(k))
        assert wide._graph_for(True).member_tile == 0 and wide._graph_for(True).tiled is None


def test_a_graph_that_draws_random_numbers_is_not_tiled_and_says_why(caplog):
    models = [nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Linear(16, 2)) for _ in range(N)]
    with caplog.at_level(logging.WARNING, logger="wide_compiler.fx.tiling"):
        wide = wc.compile(models, torch.randn(4, 8), config=_tiled(2))
    assert wide._graph_for(True).member_tile == 0
    assert "member_tile=2" in caplog.text and "random ops draw" in caplog.text and "dropout" in caplog.text
    assert wide._graph_for(False).member_tile == 2  # eval: dropout draws nothing


@pytest.mark.parametrize("bad", [-1, True, 1.5, "4"])
def test_config_refuses_a_bad_member_tile(bad):
    with pytest.raises(ValueError, match="member_tile"):
        wc.WideConfig(member_tile=bad)


def test_measured_tiles_are_kept_only_when_faster_and_cached(monkeypatch, tmp_path):
    """The measured path: candidates forced to [2] and no budget (a busy machine must not end the
    measuring before the tiles); whatever the machine measures, the model
    matches its members, summary() gives the outcome, and a second compile reads it from the
    cache without running the graphs."""
    monkeypatch.setattr(tiling, "tile_candidates", lambda n, act, cache: [2])
    torch.manual_seed(0)
    models = [zoo.ResNetTiny(width=4, classes=3, pool=False).eval() for _ in range(N)]
    config = wc.WideConfig(tune_after_runs=0, cache_dir=str(tmp_path), tune_budget_s=None)  # never cut short by a busy machine
    wide, _ = testing.check_compile(models, torch.randn(2, 3, 12, 12), config=config, modes=("eval",))
    line = wide.summary().splitlines()[3]
    assert "member tiles: " in line and "untiled " in line and "by 2 " in line, line
    assert wide._graph_for(False).member_tile in (0, 2)
    runs = []
    monkeypatch.setattr(tiling, "alternating_runs", lambda *a: runs.append(a) or ({}, False))
    again = wc.compile(models, torch.randn(2, 3, 12, 12), config=config)
    assert runs == [] and "member tiles (cached)" in again.summary()
    assert again._graph_for(False).member_tile == wide._graph_for(False).member_tile


def test_tile_candidates_follow_the_working_set():
    assert tiling.tile_candidates(16, 512 << 10, 2 << 20) == [4, 8]
    assert tiling.tile_candidates(64, 512 << 10, 2 << 20) == [4, 8]
    assert tiling.tile_candidates(16, 4 << 20, 2 << 20) == []  # one member outgrows the cache
    assert tiling.tile_candidates(4, 64 << 10, 2 << 20) == []  # all members fit: nothing to tile
    assert tiling.chunk_sizes(7, 3) == [3, 3, 1]


def test_threads_calling_one_tiled_model_each_get_their_members_results():
    from support import run_in_threads

    torch.manual_seed(0)
    models = [zoo.ResNetTiny(width=4, classes=3, pool=False).eval() for _ in range(N)]
    wide = wc.compile(models, torch.randn(2, 3, 12, 12), config=_tiled(2)).eval()
    xs = [torch.randn(N, 2, 3, 12, 12) for _ in range(4)]
    with torch.no_grad():
        want = [torch.stack([m(x[i]) for i, m in enumerate(models)]) for x in xs]

    def call(k: int) -> None:
        with torch.no_grad():
            for _ in range(3):
                torch.testing.assert_close(wide(xs[k]), want[k], rtol=1e-4, atol=1e-5)

    assert run_in_threads(call, len(xs)) == []


def test_a_padded_size_sweep_runs_tiled_and_trains_alike():
    """Members of different widths padded to the widest (Note [Padded members]), in tiles of 2:
    the padding's per-member tensors split with their members. Outputs match, and after two SGD
    steps each member, taken back at its own width, equals the member trained alone."""
    torch.manual_seed(0)
    models = [zoo.MLP(8, h, 3) for h in (8, 16, 24, 32, 12)]
    alone = copy.deepcopy(models)
    wide = wc.compile(models, torch.randn(4, 8), pad=True, config=_tiled(2))
    assert wide._graph_for(True).member_tile == 2
    opt = torch.optim.SGD(wide.parameters(), lr=0.1)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in alone]
    for _ in range(2):
        x = torch.randn(N, 4, 8)
        out = wide(x)
        testing.assert_members_close(out, [m(x[i]) for i, m in enumerate(alone)], what="outputs")
        opt.zero_grad()
        out.square().sum().backward()
        opt.step()
        for i, (m, o) in enumerate(zip(alone, opts)):
            o.zero_grad()
            m(x[i]).square().sum().backward()
            o.step()
    for i, m in enumerate(alone):
        for (name, p), (_, q) in zip(m.named_parameters(), wide.member(i).named_parameters()):
            torch.testing.assert_close(q, p.detach(), rtol=1e-5, atol=1e-6, msg=f"member {i} {name}")


def test_a_router_group_honours_member_tile():
    class Tower(wc.Tower):
        def __init__(self, name: str) -> None:
            super().__init__(name)
            self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))

        def forward(self, x):
            return self.net(x)

    router = wc.WideRouter("tiles", auto_discover=True, config=_tiled(2))
    for i in range(5):
        router.attach(f"t{i}", Tower(f"t{i}"))
    x = torch.randn(3, 4)
    outs = router.wide_forward(x)
    assert [g._graph_for(True).member_tile for g in router.groups.values()] == [2]
    for name, y in outs.items():
        torch.testing.assert_close(y, router[name](x), rtol=1e-5, atol=1e-6)


def test_a_tile_that_cannot_be_built_runs_untiled_and_says_so(monkeypatch, caplog):
    def broken(*a, **k):
        raise RuntimeError("planted")

    monkeypatch.setattr(tiling, "build_tiled", broken)
    models = [zoo.MLP(8, 16, 3) for _ in range(N)]
    with caplog.at_level(logging.WARNING, logger="wide_compiler.fx.tiling"):
        wide = wc.compile(models, torch.randn(4, 8), config=_tiled(2))
    assert wide._graph_for(True).member_tile == 0 and wide._graph_for(True).tiled is None
    assert "runs untiled" in caplog.text and "planted" in caplog.text
    x = torch.randn(N, 4, 8)
    testing.assert_members_close(wide(x), [m(x[i]) for i, m in enumerate(models)], what="untiled")
