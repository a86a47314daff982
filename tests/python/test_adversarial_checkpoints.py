"""Adversarial checkpoints and writes (issue 24): per-member checkpoints (``wide_compiler.distributed``)
whose ``index.json`` or member files were edited, planted or crafted; writes into planted
symlinks, unwritable paths and directories (``save_members``, ``WideModel.export``, Ray Tune
population checkpoints); member state dicts holding non-tensors; and the errors of the Ray
integration's member operations. Each case: the error names what, where and why, and nothing
was changed (or, for a crafted file, no code ran)."""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
from fractions import Fraction
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import wide_compiler as wc
import wide_compiler.distributed as wcd
from torch import nn

FAST = wc.WideConfig.fast()
N = 4


def make(i: int, *, seed: int = 0, width: int = 8) -> nn.Module:
    torch.manual_seed(seed + i)
    return nn.Sequential(nn.Linear(3, width), nn.Tanh(), nn.BatchNorm1d(width), nn.Linear(width, 2))


def wide(seed: int = 0, width: int = 8) -> wc.WideModel:
    return wc.compile([make(i, seed=seed, width=width) for i in range(N)], torch.randn(5, 3), config=FAST)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    for k, v in before.items():
        assert torch.equal(after[k], v), f"{k} changed"


@contextlib.contextmanager
def refused_unchanged(model: nn.Module, match: str):
    """The block must raise a ValueError matching ``match`` and leave ``model``'s state as it was."""
    before = snapshot(model)
    with pytest.raises(ValueError, match=match):
        yield
    assert_unchanged(model, before)


def assert_loads_of_member_1_refused(directory: Path, model: nn.Module, members_match: str, member_match: str) -> None:
    """Member 1's file in ``directory`` is refused by load_members (which leaves ``model`` as it
    was) with ``members_match``, and by load_member with ``member_match``."""
    with refused_unchanged(model, members_match):
        wcd.load_members(model, directory)
    with pytest.raises(ValueError, match=member_match):
        wcd.load_member(directory, 1)


def edit_index(directory: Path, **changes) -> None:
    path = directory / "index.json"
    index = json.loads(path.read_text())
    index.update(changes)
    path.write_text(json.dumps(index))


@pytest.fixture
def two_checkpoints(tmp_path):
    """Checkpoints "a" (seed 0) and "other" (seed 50) of the same architecture, and a model
    (seed 100) to load them into."""
    wcd.save_members(wide(seed=0), tmp_path / "a")
    wcd.save_members(wide(seed=50), tmp_path / "other")
    return tmp_path / "a", tmp_path / "other", wide(seed=100)


def unwritable_directory(tmp_path: Path) -> Path:
    """A directory this process cannot create files in (root ignores permission bits: /sys,
    where nobody can create regular files)."""
    if os.geteuid() != 0:
        d = tmp_path / "read_only"
        d.mkdir()
        d.chmod(0o555)
        return d
    return Path("/sys")


# ------------------------------------------------------------------------------------------------
# load_members: index.json entries stay inside the checkpoint directory
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["../other/member_000001.pt", "ABSOLUTE", "./member_000001.pt",
                                   "member_000002.pt"])
def test_load_members_refuses_index_entries_naming_other_files(two_checkpoints, entry):
    a, other, model = two_checkpoints
    index = json.loads((a / "index.json").read_text())
    files = list(index["files"])
    files[1] = str(other / "member_000001.pt") if entry == "ABSOLUTE" else entry
    edit_index(a, files=files)
    assert_loads_of_member_1_refused(a, model, r"member 1's file is listed as .*save_members names it "
                                               r"'member_000001.pt'", "member 1's file is listed as")


def test_load_members_refuses_a_member_file_symlinked_outside_the_directory(two_checkpoints):
    a, other, model = two_checkpoints
    (a / "member_000001.pt").unlink()
    (a / "member_000001.pt").symlink_to(other / "member_000001.pt")
    assert_loads_of_member_1_refused(a, model, r"member_000001.pt \(member 1\) is a symlink to .*outside the "
                                               r"checkpoint directory", "outside the checkpoint directory")


def test_load_members_index_n_must_be_an_int(two_checkpoints):
    a, _, model = two_checkpoints
    edit_index(a, n=str(N))
    with pytest.raises(ValueError, match=r"'n' \(the number of members\) must be an int >= 1; got '4' \(str\)"):
        wcd.load_members(model, a)


def test_load_members_short_files_list(two_checkpoints):
    a, _, model = two_checkpoints
    index = json.loads((a / "index.json").read_text())
    edit_index(a, files=index["files"][:2])
    with pytest.raises(ValueError, match=r"'files' must list the checkpoint's 4 member files .* got 2 entries"):
        wcd.load_members(model, a)
    with pytest.raises(ValueError, match="'files' must list"):
        wcd.load_member(a, 3)


# ------------------------------------------------------------------------------------------------
# load_members: every file checked before anything changes
# ------------------------------------------------------------------------------------------------
def _replace_member_file(directory: Path, i: int, model_sd: dict, optimizer_sd=None) -> None:
    torch.save({"format": wcd.FORMAT, "version": wcd.FORMAT_VERSION, "member": i, "model": model_sd,
                "optimizer": optimizer_sd}, directory / f"member_{i:06d}.pt")


def test_load_members_checks_every_member_file_before_changing_anything(two_checkpoints):
    a, _, model = two_checkpoints
    narrow = wide(seed=7, width=5).member_state_dict(2)        # member 2's shapes disagree with index.json
    _replace_member_file(a, 2, narrow)
    # unchanged: members 0 and 1 were not written before member 2's file was refused
    with refused_unchanged(model, r"member_000002.pt \(member 2\): '0.weight' is \[5, 3\] "
                                  r"torch.float32, but index.json records \[8, 3\]"):
        wcd.load_members(model, a)


def test_load_members_refuses_a_member_file_of_another_dtype(two_checkpoints):
    a, _, model = two_checkpoints
    sd = {k: (v.double() if v.is_floating_point() else v) for k, v in wide(seed=3).member_state_dict(3).items()}
    _replace_member_file(a, 3, sd)                             # today: silently cast on copy
    with refused_unchanged(model, r"\(member 3\): '0.weight' is \[8, 3\] torch.float64, but "
                                  r"index.json records \[8, 3\] torch.float32"):
        wcd.load_members(model, a)


def test_load_members_checks_every_members_optimizer_state_before_changing_anything(tmp_path):
    src = wide(seed=0)
    opt = wc.optim.Adam(src.parameters(), lr=[0.1, 0.2, 0.3, 0.4])
    src(torch.randn(N, 5, 3)).sum().backward()
    opt.step()
    wcd.save_members(src, tmp_path / "c", opt)
    path = tmp_path / "c" / "member_000002.pt"
    payload = torch.load(path, weights_only=True)
    payload["optimizer"]["param_groups"][0]["lr"] = -1.0      # an invalid hyperparameter in member 2
    torch.save(payload, path)
    model = wide(seed=100)
    opt_b = wc.optim.Adam(model.parameters(), lr=0.01)
    before, lr = snapshot(model), opt_b.param_groups[0]["lr"].clone()
    with pytest.raises(ValueError, match=r"member 2 in .*saved hyperparameters do not fit the "
                                         r"optimizer .*invalid lr -1.0"):
        wcd.load_members(model, tmp_path / "c", opt_b)
    assert_unchanged(model, before)
    assert torch.equal(opt_b.param_groups[0]["lr"], lr) and not opt_b.state   # optimizer untouched


# ------------------------------------------------------------------------------------------------
# save_members / export: unpredictable temporary names, no symlink followed, errors naming the path
# ------------------------------------------------------------------------------------------------
def test_save_members_never_writes_through_a_planted_symlink(tmp_path, monkeypatch):
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    d = tmp_path / "ckpt"
    d.mkdir()
    names = [f"member_{i:06d}.pt" for i in range(N)] + ["index.json"]
    for name in names:                          # the final names, and the temporary names of old
        (d / name).symlink_to(victim)           # (".member_000000.pt.tmp<pid>", predictable)
        (d / f".{name}.tmp{os.getpid()}").symlink_to(victim)
    planted = []
    real_open = os.open

    def racing_open(path, flags, *args, **kwargs):  # an attacker who guesses the exact next name
        p = Path(os.fsdecode(path))
        if p.parent == d and not p.exists() and len(planted) < 8:
            p.symlink_to(victim)
            planted.append(p)
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", racing_open)
    model = wide(seed=0)
    wcd.save_members(model, d)
    monkeypatch.undo()
    assert victim.read_bytes() == b"precious"
    assert planted, "the writer opened no new file in the checkpoint directory with os.open"
    for name in names:
        assert (d / name).is_file() and not (d / name).is_symlink()
    other = wide(seed=9)
    wcd.load_members(other, d)
    assert torch.equal(other.get_parameter("0.weight"), model.get_parameter("0.weight"))


def test_save_members_into_an_unwritable_directory_names_it(tmp_path):
    d = unwritable_directory(tmp_path)
    with pytest.raises(OSError, match=rf"save_members: cannot write {d}/member_000000.pt: cannot "
                                      rf"create a file in {d}"):
        wcd.save_members(wide(), d)


def test_save_members_onto_a_file_names_it(tmp_path):
    f = tmp_path / "a_file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError, match=rf"save_members: {f} exists and is not a directory"):
        wcd.save_members(wide(), f)
    assert f.read_text() == "x"


def test_export_onto_a_directory_or_into_an_unwritable_one_names_the_path(tmp_path):
    model = wc.compile([nn.Linear(3, 2) for _ in range(2)], torch.randn(4, 3), config=FAST)
    with pytest.raises(IsADirectoryError, match=rf"export: cannot write {tmp_path}: it is a directory"):
        model.export(tmp_path)
    d = unwritable_directory(tmp_path)
    with pytest.raises(OSError, match=rf"export: cannot write {d}/wide.pt2"):
        model.export(d / "wide.pt2")
    with pytest.raises(FileNotFoundError, match=rf"export: cannot write {tmp_path}/no/wide.pt2: its "
                                                rf"directory {tmp_path}/no does not exist"):
        model.export(tmp_path / "no" / "wide.pt2")


def test_export_replaces_a_symlink_at_its_path_instead_of_writing_through_it(tmp_path):
    model = wc.compile([nn.Linear(3, 2) for _ in range(2)], torch.randn(4, 3), config=FAST)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    (tmp_path / "wide.pt2").symlink_to(victim)
    model.export(tmp_path / "wide.pt2")
    assert victim.read_bytes() == b"precious" and not (tmp_path / "wide.pt2").is_symlink()
    x = torch.randn(2, 4, 3)
    assert torch.allclose(torch.export.load(tmp_path / "wide.pt2").module()(x), model.eval()(x))


# ------------------------------------------------------------------------------------------------
# load_member_state_dict: non-tensor values and unsafe casts name the key and the member
# ------------------------------------------------------------------------------------------------
def test_load_member_state_dict_with_a_list_value_names_the_key_and_member():
    model = wide()
    sd = model.member_state_dict(1)
    before = snapshot(model)
    bad = {**sd, "0.weight": sd["0.weight"].tolist()}
    with pytest.raises(TypeError, match=r"member 1: '0.weight' is a list .*expected a tensor of shape \[8, 3\]"):
        model.load_member_state_dict(1, bad)
    sharded = wcd.shard([make(i) for i in range(N)], torch.randn(5, 3), config=FAST)
    with pytest.raises(TypeError, match=r"member 2: '3.bias' is a str"):
        sharded.load_member_state_dict(2, {**sd, "3.bias": "zeros"})
    with pytest.raises(TypeError, match=r"member 1: '2.num_batches_tracked' is torch.float32, which "
                                        r"does not cast safely to the member's torch.int64"):
        model.load_member_state_dict(1, {**sd, "2.num_batches_tracked": torch.tensor(2.5)})
    assert_unchanged(model, before)


# ------------------------------------------------------------------------------------------------
# Ray integration: member operations name the member; metrics; checkpoints run no code
# ------------------------------------------------------------------------------------------------
def _population(**kwargs):
    pytest.importorskip("ray.tune", reason='ray[tune] is not installed (pip install "ray[tune]")')
    from wide_compiler.integrations import ray as wcray

    configs = [{"lr": 0.01 * (i + 1), "momentum": 0.5} for i in range(N)]
    return wcray.Population.create(
        lambda c: nn.Linear(3, 1), lambda params, hp: wc.optim.SGD(params, lr=hp["lr"], momentum=hp["momentum"]),
        sample_input=torch.randn(2, 3), n_members=N, metric="loss", max_iterations=4,
        member_configs=configs, seed=0, **kwargs)


def _step(pop):
    x = torch.randn(N, 8, 3)
    losses = wc.optim.member_losses(F.mse_loss, pop.model(x), torch.zeros(N, 8, 1))
    pop.optimizer.zero_grad()
    losses.sum().backward()
    pop.optimizer.step()
    return {"loss": losses.detach()}


def test_population_set_hyperparameters_names_the_member_it_was_given():
    pop = _population()
    with pytest.raises(ValueError, match=r"member 1's configuration .*invalid lr -0.5 for member 1") as e:
        pop.set_hyperparameters(1, lr=-0.5)
    assert "member 0" not in str(e.value)
    assert pop.configs[1]["lr"] == 0.02


def test_population_member_operations_refuse_slots_out_of_range():
    pop = _population()
    with pytest.raises(IndexError, match=r"exploit\(0, 7\): dst: member 7 out of range for a population of N=4"):
        pop.exploit(0, 7)
    with pytest.raises(IndexError, match=r"exploit\(-1, 0\): src: member -1 out of range"):
        pop.exploit(-1, 0)
    with pytest.raises(IndexError, match=r"set_hyperparameters\(4, ...\): member 4 out of range"):
        pop.set_hyperparameters(4, lr=0.1)
    with pytest.raises(IndexError, match=r"restart\(9\): member 9 out of range"):
        pop.restart(9)
    with pytest.raises(IndexError, match=r"stop\('a'\): member 'a' out of range"):
        pop.stop("a")


@pytest.mark.parametrize("metric, message", [
    (["a", "b", "c", "d"], r"metric 'loss' with a str \('a'\) for member 0; expected one real number"),
    (["1", "2", "3", "4"], r"metric 'loss' with a str \('1'\) for member 0"),   # today: accepted
    ("abcd", r"metric 'loss' as a str \('abcd'\); expected one real number per member \(4\)"),
    ([0.1, 0.2, None, 0.4], r"metric 'loss' with a NoneType \(None\) for member 2"),
])
def test_population_train_step_returning_non_numbers_names_the_metric_and_type(metric, message):
    pop = _population()
    with pytest.raises(TypeError, match=message):
        pop.step(lambda p: {"loss": metric})
    assert pop.iteration == 0


class _RunsCode:
    """Pickles as a call to open(marker, "w"): loading it with pickle creates the marker file."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_ray_load_checkpoint_never_runs_code_from_a_crafted_file(tmp_path):
    pytest.importorskip("ray.tune", reason='ray[tune] is not installed (pip install "ray[tune]")')
    from wide_compiler.integrations import ray as wcray

    marker = tmp_path / "code_ran"
    torch.save({"format": 1, "members": [], "configs": [_RunsCode(str(marker))]},
               tmp_path / wcray.CHECKPOINT_FILE)
    with pytest.raises(ValueError, match=r"safe load \(torch.load\(weights_only=True\)\) refuses.*"
                                         r"allow_pickle=True"):
        wcray.load_checkpoint(tmp_path)
    assert not marker.exists()


def test_ray_checkpoints_are_plain_data_read_with_weights_only(tmp_path, monkeypatch):
    pytest.importorskip("ray.tune", reason='ray[tune] is not installed (pip install "ray[tune]")')
    from wide_compiler.integrations import ray as wcray

    pop = _population()
    pop.configs[0]["shape"] = (2, 3)                           # a tuple: comes back a tuple
    pop.step(_step)
    pop.save(tmp_path)
    raw = torch.load(tmp_path / wcray.CHECKPOINT_FILE, weights_only=True)   # no pickled objects
    assert set(raw) == {"format", "version", "state", "tensors"}
    calls = []
    real_load = torch.load

    def recording_load(*args, **kwargs):
        calls.append(kwargs.get("weights_only"))
        return real_load(*args, **kwargs)

    monkeypatch.setattr(torch, "load", recording_load)
    state = wcray.load_checkpoint(tmp_path)
    assert calls == [True]
    expected = pop.state_dict()
    assert state["configs"] == expected["configs"] and state["configs"][0]["shape"] == (2, 3)
    assert state["rng"] == expected["rng"] and state["np_rng"] == expected["np_rng"]
    assert state["optimizer"]["state"].keys() == expected["optimizer"]["state"].keys()  # int keys
    for a, b in zip(state["members"], expected["members"]):
        assert all(torch.equal(a[k], b[k]) for k in b)


def test_ray_checkpoint_save_refuses_non_plain_configuration_values(tmp_path):
    pop = _population()
    pop.configs[2]["act"] = nn.ReLU
    with pytest.raises(TypeError, match=r"cannot checkpoint the population state\['configs'\]\[2\]"
                                        r"\['act'\]: .*ReLU.*plain values only"):
        pop.save(tmp_path)


def test_ray_old_pickled_checkpoints_need_an_explicit_opt_in(tmp_path):
    pytest.importorskip("ray.tune", reason='ray[tune] is not installed (pip install "ray[tune]")')
    from wide_compiler.integrations import ray as wcray

    pop = _population()
    pop.step(_step)
    state = pop.state_dict()
    state["configs"][1]["ratio"] = Fraction(1, 3)             # a value only pickle can hold
    torch.save(state, tmp_path / wcray.CHECKPOINT_FILE)        # how version 1 wrote checkpoints
    with pytest.raises(ValueError, match="allow_pickle=True"):
        wcray.load_checkpoint(tmp_path)
    loaded = wcray.load_checkpoint(tmp_path, allow_pickle=True)
    assert loaded["configs"][1]["ratio"] == Fraction(1, 3)
    assert wcray.best_member(loaded)["slot"] in range(N)


def test_ray_old_plain_checkpoints_still_load_safely(tmp_path):
    pytest.importorskip("ray.tune", reason='ray[tune] is not installed (pip install "ray[tune]")')
    from wide_compiler.integrations import ray as wcray

    pop = _population()
    pop.step(_step)
    torch.save(pop.state_dict(), tmp_path / wcray.CHECKPOINT_FILE)   # version 1, plain values
    state = wcray.load_checkpoint(tmp_path)
    assert state["configs"] == pop.configs and state["iteration"] == 1


def test_population_save_replaces_a_symlink_instead_of_writing_through_it(tmp_path):
    """Population.save writes atomically too: a symlink at the checkpoint file is replaced."""
    pytest.importorskip("ray.tune", reason='ray[tune] is not installed (pip install "ray[tune]")')
    from wide_compiler.integrations import ray as wcray

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    d = Path(tempfile.mkdtemp(dir=tmp_path))
    (d / wcray.CHECKPOINT_FILE).symlink_to(victim)
    (d / f"{wcray.CHECKPOINT_FILE}.tmp").symlink_to(victim)
    _population().save(d)
    assert victim.read_bytes() == b"precious" and not (d / wcray.CHECKPOINT_FILE).is_symlink()
    assert wcray.load_checkpoint(d)["n"] == N
