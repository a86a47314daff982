"""wide_compiler.integrations.optuna: a study's trials trained N at a time, fused. Every trial
must end exactly where the same trial ends in an ordinary Optuna study (one model per trial,
torch.optim): same parameters, values, intermediate values, states, weights and optimizer state."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import wide_compiler as wc

optuna = pytest.importorskip("optuna")
from wide_compiler.integrations import optuna as wcoptuna  # noqa: E402

optuna.logging.set_verbosity(optuna.logging.WARNING)
TrialState = optuna.trial.TrialState
ROOT = Path(__file__).resolve().parents[2]
SEED = 100
N_STEPS = 30

g = torch.Generator().manual_seed(0)
X = torch.randn(64, 3, generator=g, dtype=torch.float64)
Y = (X[:, :1] * X[:, 1:2]).sin() + 0.1 * X[:, 2:]


def build(trial):
    trial.suggest_float("lr", 1e-3, 3e-1, log=True)
    trial.suggest_float("wd", 1e-5, 1e-1, log=True)
    h = trial.suggest_categorical("hidden", [4, 8])          # an architecture key
    return torch.nn.Sequential(torch.nn.Linear(3, h), torch.nn.Tanh(),
                               torch.nn.Linear(h, 1)).double()


def batch(step):
    idx = torch.randperm(64, generator=torch.Generator().manual_seed(step))[:32]
    return X[idx], Y[idx]


def train_step(run):
    x, y = batch(run.step)
    losses = wc.optim.member_losses(F.mse_loss, run.model(x.expand(run.n, *x.shape)), y,
                                    shared_target=True)
    run.optimizer.zero_grad()
    losses.sum().backward()
    run.optimizer.step()
    return losses.detach()


def make_optimizer(params, hp):
    return wc.optim.Adam(params, lr=hp["lr"], weight_decay=hp["wd"])


class EveryThirdPruner(optuna.pruners.BasePruner):
    """Prunes trials 1, 4, 7, ... after their 8th report: deterministic per trial, so fused and
    sequential studies prune the same trials at the same steps."""

    def prune(self, study, trial):
        return trial.number % 3 == 1 and trial.last_step is not None and trial.last_step >= 7


def sequential(pruner, n_trials):
    """The reference: an ordinary Optuna study, one model and one torch.optim.Adam per trial."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=7), pruner=pruner)
    saved = {}

    def objective(trial):
        torch.manual_seed(SEED + trial.number)
        model = build(trial)
        opt = torch.optim.Adam(model.parameters(), lr=trial.params["lr"], weight_decay=trial.params["wd"])
        try:
            for step in range(N_STEPS):
                x, y = batch(step)
                loss = F.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                trial.report(loss.item(), step)
                if trial.should_prune():
                    raise optuna.TrialPruned()
            return loss.item()
        finally:
            saved[trial.number] = (model.state_dict(), opt.state_dict())

    study.optimize(objective, n_trials=n_trials)
    return study, saved


def fused(pruner, n_trials, n_members=4):
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=7), pruner=pruner)
    saved, runs = {}, {}

    def done(run, i, frozen):
        saved[frozen.number] = (run.model.member_state_dict(i), run.optimizer.member_state_dict(i))
        runs[frozen.number] = run

    trials = wcoptuna.optimize(study, build, train_step, n_trials=n_trials, n_members=n_members,
                               n_steps=N_STEPS, optimizer=make_optimizer, sample_input=X[:2],
                               seed=SEED, on_member_done=done)
    return study, trials, saved, runs


def _close(a, b, tol=1e-10):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape
    assert float((a - b).abs().max()) <= tol * max(float(b.abs().max()), 1e-12), (a, b)


def test_fused_study_matches_sequential_study():
    n_trials = 9
    ref, ref_saved = sequential(EveryThirdPruner(), n_trials)
    study, trials, saved, runs = fused(EveryThirdPruner(), n_trials)
    assert [t.number for t in trials] == list(range(n_trials))
    states = [t.state for t in study.trials]
    assert TrialState.PRUNED in states and TrialState.COMPLETE in states
    for a, b in zip(study.trials, ref.trials):
        assert a.number == b.number and a.state == b.state and a.params == b.params
        assert a.user_attrs["wide_seed"] == SEED + a.number
        _close(a.value, b.value)
        assert sorted(a.intermediate_values) == sorted(b.intermediate_values)
        _close(list(a.intermediate_values.values()), list(b.intermediate_values.values()))
        # weights and optimizer state of the member = the trial trained alone
        (w, o), (rw, ro) = saved[a.number], ref_saved[b.number]
        for k in rw:
            _close(w[k], rw[k])
        for pid, st in ro["state"].items():
            for k, v in st.items():
                _close(o["state"][pid][k], v)
    # a run holds one architecture: trials of both hidden sizes ran, never in one run
    for run in {id(r): r for r in runs.values()}.values():
        assert len({t.params["hidden"] for t in run.trials}) == 1
    assert {t.params["hidden"] for t in study.trials} == {4, 8}


def test_pruned_members_stop_changing():
    pruner = optuna.pruners.MedianPruner(n_startup_trials=0, n_warmup_steps=3)
    study, trials, saved, runs = fused(pruner, 8)
    pruned = [t.number for t in trials if t.state == TrialState.PRUNED]
    assert pruned, [t.state for t in trials]
    for k in pruned:
        run = runs[k]
        i = [t.number for t in run.trials].index(k)
        w, o = saved[k]                       # taken when it was pruned
        now = run.model.member_state_dict(i)  # after its run ended
        assert all(torch.equal(now[key], w[key]) for key in w)
        for pid, st in run.optimizer.member_state_dict(i)["state"].items():
            for key, v in st.items():
                assert torch.equal(torch.as_tensor(v), torch.as_tensor(o["state"][pid][key]))
        t = study.trials[k]
        assert t.value == t.intermediate_values[t.last_step]      # Optuna's rule for pruned trials
        assert t.last_step < N_STEPS - 1


def test_architecture_attributes_group_runs():
    """A dropout rate is an attribute of the program: trials with different rates never share a
    run (one member would otherwise run with another's rate)."""
    def build_dropout(trial):
        p = trial.suggest_categorical("p", [0.0, 0.5])
        trial.suggest_float("lr", 1e-3, 1e-1, log=True)
        return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Dropout(p), torch.nn.Linear(4, 1)).double()

    members = {}

    def done(run, i, frozen):
        members[frozen.number] = {t.params["p"] for t in run.trials}

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=3),
                                pruner=optuna.pruners.NopPruner())
    wcoptuna.optimize(study, build_dropout, train_step, n_trials=8, n_members=3, n_steps=2,
                      optimizer=lambda ps, hp: wc.optim.SGD(ps, lr=hp["lr"]), sample_input=X[:2],
                      on_member_done=done)
    assert all(len(ps) == 1 for ps in members.values())
    assert {t.params["p"] for t in study.trials} == {0.0, 0.5}
    assert all(t.state == TrialState.COMPLETE for t in study.trials)


def test_missing_parameter_names_the_member():
    def build_cond(trial):
        if trial.number % 2:
            trial.suggest_float("momentum", 0.0, 0.9)
        trial.suggest_float("lr", 1e-3, 1e-1)
        return torch.nn.Linear(3, 1).double()

    study = optuna.create_study()
    with pytest.raises(KeyError, match=r"member 0 \(trial 0\) has no parameter 'momentum'"):
        wcoptuna.optimize(study, build_cond, train_step, n_trials=2, n_members=2, n_steps=2,
                          sample_input=X[:2],
                          optimizer=lambda ps, hp: wc.optim.SGD(ps, lr=hp["lr"], momentum=hp["momentum"]))
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.FAIL]
    with pytest.raises(KeyError, match=r"member 0 \(trial 0\) has no parameter 'momentum'"):
        wcoptuna.optimize(optuna.create_study(), build_cond, train_step, n_trials=2, n_members=2,
                          n_steps=2, sample_input=X[:2], optimizer=lambda ps, hp: wc.optim.SGD(
                              ps, lr=hp["lr"], momentum=hp.get("momentum", 0.0)))


def test_bad_train_step_and_build():
    study = optuna.create_study()
    with pytest.raises(ValueError, match="one real value per member"):
        wcoptuna.optimize(study, build, lambda run: torch.zeros(3), n_trials=2, n_members=2,
                          n_steps=2, sample_input=X[:2], optimizer=make_optimizer)
    assert all(t.state == TrialState.FAIL for t in study.trials)
    # a caught failure fails that run's trials and goes on
    study = optuna.create_study()
    wcoptuna.optimize(study, build, lambda run: torch.zeros(3), n_trials=2, n_members=2,
                      n_steps=2, sample_input=X[:2], optimizer=make_optimizer, catch=(ValueError,))
    assert all(t.state == TrialState.FAIL for t in study.trials)
    with pytest.raises(TypeError, match="expected an nn.Module"):
        wcoptuna.optimize(optuna.create_study(), lambda t: "model", train_step, n_trials=1,
                          n_steps=1, sample_input=X[:2], optimizer=make_optimizer)
    with pytest.raises(ValueError, match="single-objective"):
        wcoptuna.optimize(optuna.create_study(directions=["minimize", "minimize"]), build,
                          train_step, n_trials=1, n_steps=1, sample_input=X[:2],
                          optimizer=make_optimizer)


def test_nan_final_value_fails_the_trial():
    def build_fixed(trial):
        trial.suggest_float("lr", 1e-3, 1e-1)
        return torch.nn.Linear(3, 1).double()

    study = optuna.create_study()
    wcoptuna.optimize(study, build_fixed, lambda run: [float("nan"), 1.0], n_trials=2, n_members=2,
                      n_steps=1, sample_input=X[:2],
                      optimizer=lambda ps, hp: wc.optim.SGD(ps, lr=hp["lr"]))
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.COMPLETE]


def test_example_runs(tmp_path, monkeypatch, capsys):
    """examples/optuna_sweep.py run as a script (``__main__``, its own argument parsing) with
    ``--trials 4 --members 4 --steps 10``, in this process: a fresh interpreter cost its imports of
    torch and Optuna, more than the run. Optuna's log level, which the script sets, is put back."""
    import runpy

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["optuna_sweep.py", "--trials", "4", "--members", "4", "--steps", "10"])
    verbosity = optuna.logging.get_verbosity()
    try:
        runpy.run_path(str(ROOT / "examples" / "optuna_sweep.py"), run_name="__main__")
    finally:
        optuna.logging.set_verbosity(verbosity)
    out = capsys.readouterr().out
    assert "4 trials in" in out and "best trial" in out and "best trial trained alone" in out, out
