"""wide_compiler.integrations.ray: one Ray Tune trial trains N fused members.

Checks: a fused trial's per-member results are N separate trainings' results, N results per
report, member-level ASHA stops (and refills) the members it should, member-level PBT copies and
perturbs as Ray's PBT does, and a checkpointed trial continues identically (in-process, and under
Tune after an injected failure)."""
from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

tune = pytest.importorskip("ray.tune", reason='ray[tune] is not installed (pip install "ray[tune]")')

import ray  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import wide_compiler as wc  # noqa: E402
from torch import nn  # noqa: E402
from wide_compiler.integrations import ray as wcray  # noqa: E402

N = 4
_g = torch.Generator().manual_seed(0)
X_TRAIN, Y_TRAIN = torch.randn(64, 3, generator=_g), torch.randn(64, 1, generator=_g)
X_VAL, Y_VAL = torch.randn(32, 3, generator=_g), torch.randn(32, 1, generator=_g)


def build_model(config):
    return nn.Sequential(nn.Linear(3, config.get("hidden", 8)), nn.Tanh(),
                         nn.Linear(config.get("hidden", 8), 1))


def sgd(params, hp):
    return wc.optim.SGD(params, lr=hp["lr"], momentum=hp["momentum"])


def adam(params, hp):
    return wc.optim.Adam(params, lr=hp["lr"])


def full_batch_step(pop):
    """Deterministic: full batch, validation loss after the update."""
    n = pop.n
    losses = wc.optim.member_losses(F.mse_loss, pop.model(X_TRAIN.expand(n, *X_TRAIN.shape)),
                                    Y_TRAIN, shared_target=True)
    pop.optimizer.zero_grad()
    losses.sum().backward()
    pop.optimizer.step()
    with torch.no_grad():
        val = wc.optim.member_losses(F.mse_loss, pop.model(X_VAL.expand(n, *X_VAL.shape)), Y_VAL,
                                     shared_target=True)
    return {"loss": val, "train_loss": losses.detach()}


def minibatch_step(pop):
    """Per-member minibatches drawn from pop.generator (saved in checkpoints)."""
    idx = torch.randint(0, len(X_TRAIN), (pop.n, 16), generator=pop.generator)
    losses = wc.optim.member_losses(F.mse_loss, pop.model(X_TRAIN[idx]), Y_TRAIN[idx])
    pop.optimizer.zero_grad()
    losses.sum().backward()
    pop.optimizer.step()
    with torch.no_grad():
        val = wc.optim.member_losses(F.mse_loss, pop.model(X_VAL.expand(pop.n, *X_VAL.shape)), Y_VAL,
                                     shared_target=True)
    return {"loss": val}


def separate_training(config, seed, iterations):
    """What one member does trained alone with torch.optim: its validation losses per iteration."""
    torch.manual_seed(seed)
    model = build_model(config)
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=config["momentum"])
    out = []
    for _ in range(iterations):
        loss = F.mse_loss(model(X_TRAIN), Y_TRAIN)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            out.append(F.mse_loss(model(X_VAL), Y_VAL).item())
    return out, model


SPACE = {"lr": tune.loguniform(1e-3, 3e-1), "momentum": tune.uniform(0.0, 0.9)}


def population(n=N, *, scheduler=None, optimizer=sgd, budget=None, configs=None, max_iterations=6,
               space=SPACE, seed=0):
    return wcray.Population.create(
        build_model, optimizer, sample_input=torch.randn(2, 3), n_members=n, metric="loss",
        mode="min", max_iterations=max_iterations, member_space=space, member_configs=configs,
        num_member_samples=budget, scheduler=scheduler, seed=seed)


def member_params(pop, i):
    return [t.clone() for t in pop.model.member_state_dict(i).values()]


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b))


# ------------------------------------------------------------------------------------------------
# Without a Ray cluster: the population and the member schedulers
# ------------------------------------------------------------------------------------------------
def test_population_members_equal_separate_trainings():
    pop = population(max_iterations=5)
    reports = []
    while not pop.done:
        reports.append(pop.step(full_batch_step))
    assert len(reports) == 5
    for i in range(N):
        expected, model = separate_training(pop.configs[i], pop.seeds[i], 5)
        got = [r["members"][str(i)]["loss"] for r in reports]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-6)
        for a, b in zip(pop.model.member_state_dict(i).values(), model.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    best = min(range(N), key=lambda i: reports[-1]["members"][str(i)]["loss"])
    assert reports[-1]["loss"] == reports[-1]["members"][str(best)]["loss"]
    assert [r["status"] for r in pop.finished] == ["completed"] * N


def test_member_asha_stops_the_members_below_each_rung_cutoff():
    # The metric is a fixed per-member "quality" so the expected decisions are known exactly;
    # the members still train, so freezing is checked on real weights.
    quality = [0.5, 0.1, 0.8, 0.3, 0.7, 0.2, 0.6, 0.4]
    configs = [{"lr": 0.05, "momentum": 0.0, "q": q} for q in quality]

    def step(pop):
        full_batch_step(pop)
        return {"loss": [c["q"] for c in pop.configs]}

    asha = wcray.MemberASHA(grace_period=1, reduction_factor=2)
    pop = population(8, scheduler=asha, configs=configs, max_iterations=4)
    assert asha.milestones(4) == [1, 2]
    pop.step(step)                                                   # rung 1: median cutoff 0.45
    assert pop.active == [q < 0.45 for q in quality]
    stopped_weights = {i: member_params(pop, i) for i in range(8) if not pop.active[i]}
    running_before = member_params(pop, 1)
    pop.step(step)                                                   # rung 2: 0.1 0.3 0.2 0.4 -> 0.25
    assert [i for i in range(8) if pop.active[i]] == [1, 5]
    for i, w in stopped_weights.items():                             # frozen: weights kept
        assert same(member_params(pop, i), w)
    assert not same(member_params(pop, 1), running_before)           # still training
    while not pop.done:
        pop.step(step)
    status = {r["id"]: (r["status"], r["iterations"]) for r in pop.finished}
    assert status == {0: ("stopped", 1), 2: ("stopped", 1), 4: ("stopped", 1), 6: ("stopped", 1),
                      3: ("stopped", 2), 7: ("stopped", 2), 1: ("completed", 4), 5: ("completed", 4)}
    assert pop.best["id"] == 1 and pop.best["value"] == 0.1
    assert asha.rungs == {1: quality, 2: [0.1, 0.3, 0.2, 0.4]}    # recorded per rung, slot order


def test_member_asha_restarts_stopped_slots_with_new_samples():
    asha = wcray.MemberASHA(grace_period=1, reduction_factor=2)
    pop = population(N, scheduler=asha, budget=10, optimizer=adam, max_iterations=4)
    pop.step(full_batch_step)
    assert pop.started > N                                           # stopped slots refilled
    for ev in [e for e in pop.events if e["event"] == "restart"]:
        i = ev["slot"]
        assert pop.ages[i] == 0 and pop.active[i] and pop.member_ids[i] == ev["id"]
        assert pop.optimizer.member_hyperparameters(i)["lr"] == pytest.approx(pop.configs[i]["lr"])
        torch.manual_seed(pop.seeds[i])
        fresh = build_model(pop.configs[i]).state_dict()             # re-initialised weights
        assert same(member_params(pop, i), list(fresh.values()))
        for p in pop.optimizer.param_groups[0]["params"]:            # zeroed optimizer state
            st = pop.optimizer.state[p]
            assert float(st["exp_avg"][i].abs().sum()) == 0 and float(st["step"][i]) == 0
    while not pop.done:
        pop.step(full_batch_step)
    assert pop.started == 10 and len(pop.finished) == 10
    assert sorted(r["id"] for r in pop.finished) == list(range(10))
    assert len({r["config"]["lr"] for r in pop.finished}) == 10      # ten different samples


def test_member_pbt_exploits_the_top_and_perturbs_hyperparameters():
    configs = [{"lr": lr, "momentum": 0.5} for lr in (0.003, 0.1, 0.001, 0.03)]
    pbt = wcray.MemberPBT(perturbation_interval=2, hyperparam_mutations={"lr": SPACE["lr"]},
                          resample_probability=0.0, quantile_fraction=0.25, seed=3)
    pop = population(N, scheduler=pbt, configs=configs, max_iterations=6)
    pop.step(full_batch_step)
    assert not [e for e in pop.events if e["event"] == "exploit"]    # not yet at the interval
    orig_step, snapshot = pop.scheduler.on_iteration, {}

    def spy(p):                                                      # state just before PBT acts
        snapshot.update(params={i: member_params(p, i) for i in range(N)},
                        order=sorted(range(N), key=lambda i: p.last[i]["loss"]),
                        hp={i: p.optimizer.member_hyperparameters(i) for i in range(N)})
        orig_step(p)

    pop.scheduler.on_iteration = spy
    pop.step(full_batch_step)
    (ev,) = [e for e in pop.events if e["event"] == "exploit"]
    best, worst = snapshot["order"][0], snapshot["order"][-1]
    assert (ev["src"], ev["slot"]) == (best, worst)
    assert same(member_params(pop, worst), snapshot["params"][best])         # exploit: weights
    for p in pop.optimizer.param_groups[0]["params"]:                        # ... optimizer state
        buf = pop.optimizer.state[p]["momentum_buffer"]
        assert torch.equal(buf[worst], buf[best])
    factor = pop.configs[worst]["lr"] / snapshot["hp"][best]["lr"]            # explore: lr * 1.2|0.8
    assert factor == pytest.approx(1.2) or factor == pytest.approx(0.8)
    assert pop.optimizer.member_hyperparameters(worst)["lr"] == pytest.approx(pop.configs[worst]["lr"])
    assert pop.optimizer.member_hyperparameters(worst)["momentum"] == snapshot["hp"][best]["momentum"]
    for i in set(range(N)) - {worst}:                                        # the others untouched
        assert same(member_params(pop, i), snapshot["params"][i])
        assert pop.optimizer.member_hyperparameters(i) == snapshot["hp"][i]


def test_population_checkpoint_restore_is_bit_exact(tmp_path):
    def make():
        return population(N, optimizer=adam, scheduler=wcray.MemberPBT(
            perturbation_interval=2, hyperparam_mutations={"lr": SPACE["lr"]}), max_iterations=8, seed=5)

    a = make()
    for _ in range(3):
        a.step(minibatch_step)
    a.save(tmp_path)
    rest_a = [a.step(minibatch_step) for _ in range(5)]
    torch.manual_seed(123)                                           # restore resets torch's RNG too
    b = wcray.Population.from_state(
        wcray.load_checkpoint(tmp_path), build_model, adam, sample_input=torch.randn(2, 3),
        scheduler=wcray.MemberPBT(perturbation_interval=2, hyperparam_mutations={"lr": SPACE["lr"]}),
        max_iterations=8, member_space=SPACE)
    rest_b = [b.step(minibatch_step) for _ in range(5)]
    assert rest_a == rest_b and a.done and b.done and b.restores == [3]
    for i in range(N):
        assert same(member_params(a, i), member_params(b, i))
    assert a.events == b.events and a.configs == b.configs
    sa, sb = a.optimizer.state_dict(), b.optimizer.state_dict()
    for k in sa["state"]:
        for name, t in sa["state"][k].items():
            assert torch.equal(t, sb["state"][k][name])


def log_sgd(params, hp):
    """A factory that renames and transforms its keys: nothing is named like SGD's arguments."""
    return wc.optim.SGD(params, lr=[10 ** x for x in hp["log_lr"]], momentum=hp["mom"])


LOG_SPACE = {"log_lr": tune.uniform(-3, -1), "mom": tune.uniform(0.0, 0.9)}


def test_renamed_and_transformed_keys_reach_the_optimizer():
    pop = population(optimizer=log_sgd, space=LOG_SPACE)
    hp = pop.optimizer.member_hyperparameters
    pop.set_hyperparameters(0, log_lr=-2.0)
    assert hp(0)["lr"] == pytest.approx(0.01) and pop.configs[0]["log_lr"] == -2.0
    pop.optimizer.set_member_hyperparameters(0, lr=0.5)             # e.g. a schedule
    pop.set_hyperparameters(0, mom=0.25)                             # pushes what mom changes only
    assert hp(0)["momentum"] == 0.25 and hp(0)["lr"] == 0.5
    pop.restart(1, config={"log_lr": -1.5, "mom": 0.3})
    assert hp(1)["lr"] == pytest.approx(10 ** -1.5) and hp(1)["momentum"] == 0.3
    pbt = wcray.MemberPBT(perturbation_interval=1, resample_probability=1.0, seed=1,
                          hyperparam_mutations={"log_lr": lambda rng: float(rng.uniform(-3, -1))})
    pop = population(optimizer=log_sgd, space=LOG_SPACE, scheduler=pbt)
    pop.step(full_batch_step)
    (ev,) = [e for e in pop.events if e["event"] == "exploit"]
    assert ev["config"]["log_lr"] != ev["old_config"]["log_lr"]
    hp = pop.optimizer.member_hyperparameters
    for i in range(N):
        assert hp(i)["lr"] == pytest.approx(10 ** pop.configs[i]["log_lr"])
        assert hp(i)["momentum"] == pytest.approx(pop.configs[i]["mom"])


def test_mutation_callables_get_the_seeded_numpy_generator():
    def run():
        pbt = wcray.MemberPBT(perturbation_interval=1, resample_probability=1.0,
                              hyperparam_mutations={"lr": lambda rng: float(rng.uniform(1e-3, 1e-1))})
        pop = population(scheduler=pbt, seed=4)
        for _ in range(3):
            pop.step(full_batch_step)
        return [e["config"]["lr"] for e in pop.events if e["event"] == "exploit"]

    first = run()
    assert len(first) == 3 and first == run()


def test_invalid_hyperparameters_change_nothing():
    pop = population()
    config, hp = dict(pop.configs[0]), pop.optimizer.member_hyperparameters(0)
    with pytest.raises(ValueError, match="lr"):
        pop.set_hyperparameters(0, lr=-1.0)
    assert pop.configs[0] == config and pop.optimizer.member_hyperparameters(0) == hp


def test_pbt_mutation_key_missing_from_the_configs_is_refused_at_the_first_iteration():
    pbt = wcray.MemberPBT(perturbation_interval=4, hyperparam_mutations={"wd": [0.0, 1e-4]})
    pop = population(scheduler=pbt)
    with pytest.raises(ValueError, match="wd.*member_space"):
        pop.step(full_batch_step)


def test_frozen_slots_refuse_exploit_and_final_reports_are_consistent():
    configs = [{"lr": 0.05, "momentum": 0.0, "q": q} for q in (0.1, 0.9, 0.2, 0.8)]

    def step(pop):
        full_batch_step(pop)
        return {"loss": [c["q"] for c in pop.configs]}

    pop = population(scheduler=wcray.MemberASHA(grace_period=1, reduction_factor=2),
                     configs=configs, max_iterations=3)
    report = pop.step(step)                                          # slots 1 and 3 stopped, frozen
    assert [report["members"][str(i)]["active"] for i in range(N)] == [1, 0, 1, 0]
    assert report["members_active"] == 2
    with pytest.raises(ValueError, match="frozen"):
        pop.exploit(0, 1)
    while not pop.done:
        report = pop.step(step)
    assert report["members_active"] == 0
    assert [report["members"][str(i)]["active"] for i in range(N)] == [0] * N


def test_restoring_another_trials_checkpoint_takes_its_config_and_own_generators(tmp_path):
    def restore(**kw):
        return wcray.Population.from_state(
            wcray.load_checkpoint(tmp_path), build_model, sgd, sample_input=torch.randn(2, 3),
            max_iterations=6, member_space={"lr": SPACE["lr"]}, **kw)

    a = wcray.Population.create(
        build_model, sgd, sample_input=torch.randn(2, 3), n_members=N, metric="loss",
        max_iterations=6, member_space={"lr": SPACE["lr"]}, trial_config={"momentum": 0.5},
        seed=5, trial_id="a")
    for _ in range(2):
        a.step(minibatch_step)
    a.save(tmp_path)
    assert wcray.load_checkpoint(tmp_path)["trial_id"] == "a"
    same_trial = restore(trial_id="a", trial_config={"momentum": 0.5}, seed=5)
    b = restore(trial_id="b", trial_config={"momentum": 0.7}, seed=5)   # Tune PBT: perturbed
    assert torch.equal(same_trial.generator.get_state(), a.generator.get_state())
    assert not torch.equal(b.generator.get_state(), a.generator.get_state())
    assert b.rng.getstate() != a.rng.getstate() and b.trial_id == "b"
    for i in range(N):
        assert same(member_params(b, i), member_params(a, i))
        assert b.configs[i] == {**a.configs[i], "momentum": 0.7}
        assert b.optimizer.member_hyperparameters(i)["momentum"] == 0.7
        assert b.optimizer.member_hyperparameters(i)["lr"] == a.optimizer.member_hyperparameters(i)["lr"]
    assert b.trial_config == {"momentum": 0.7}
    with pytest.raises(ValueError, match="hidden"):
        restore(trial_id="c", trial_config={"momentum": 0.5, "hidden": 16})


@pytest.fixture(scope="module")
def fresh_imports(tmp_path_factory) -> subprocess.CompletedProcess:
    """One fresh interpreter for the two tests of what the integration imports (a fresh process
    each cost an import of torch and wide_compiler each): it imports the integration, prints
    ``ray_available()`` and whether ``ray`` got imported; then, with a ``ray`` that fails to import
    put first on ``sys.path`` (as where Ray is not installed: the real one was never imported, so
    the import finds this one), calls ``fused_trainable`` and prints its ImportError."""
    fake = tmp_path_factory.mktemp("no_ray")
    (fake / "ray.py").write_text("raise ModuleNotFoundError('No module named ray', name='ray')\n")
    code = ("import sys\n"
            "import wide_compiler.integrations.ray as r\n"
            "print('AVAILABLE', r.ray_available(), 'ray' in sys.modules)\n"
            f"sys.path.insert(0, {str(fake)!r})\n"
            "try:\n"
            "    r.fused_trainable(None, None, optimizer=None, sample_input=None, metric='m', max_iterations=1)\n"
            "except ImportError as e:\n"
            "    print('ERROR', e)\n"
            "print('IMPORTED', 'ray' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)  # a hang guard
    assert out.returncode == 0, out.stderr
    return out


def test_ray_available_does_not_import_ray(fresh_imports):
    assert "AVAILABLE True False" in fresh_imports.stdout, fresh_imports.stdout  # available, not imported


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match="grid_search"):
        wcray.sample_member_config({"lr": tune.grid_search([0.1, 0.2])}, None)
    with pytest.raises(ValueError, match="one value per member"):
        pop = population(max_iterations=2)
        pop.step(lambda p: {"loss": 1.0})
    with pytest.raises(ValueError, match="both trial-level"):
        wcray.Population.create(build_model, sgd, sample_input=torch.randn(2, 3), n_members=2,
                                metric="loss", member_space=SPACE, trial_config={"lr": 0.1})


def test_missing_ray_raises_an_import_error_naming_the_install(fresh_imports):
    lines = fresh_imports.stdout.splitlines()
    error = next((line for line in lines if line.startswith("ERROR ")), "")
    assert 'pip install "ray[tune]"' in error, fresh_imports.stdout
    assert "IMPORTED False" in lines, fresh_imports.stdout  # the failed import left no `ray` behind


# ------------------------------------------------------------------------------------------------
# Under Ray Tune
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ray_local():
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers can't import tests
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


# Note [One Tuner for the Tune tests]: each Tuner.fit starts an experiment and a trial actor (a
# fresh worker process that imports torch and wide_compiler), which costs more than the training; so
# the Tune tests' two trials run in ONE Tuner (a grid of two cases, side by side on the module's two
# CPUs), each test checking its own trial's result. A trial's failure is injected into its own case
# only; the Tuner allows one failure, which only the flaky case uses.
def _plain_case():
    return dict(trainable=wcray.fused_trainable(
        build_model, full_batch_step, optimizer=sgd, sample_input=torch.randn(2, 3), metric="loss",
        n_members=N, member_space=SPACE, max_iterations=5, checkpoint_every=0),
        config={"hidden": 6, "seed": 11})


def _flaky_case(marker):
    def flaky_step(pop):
        if pop.iteration == 3 and not os.path.exists(marker):        # after the checkpoint at 2
            with open(marker, "w") as f:
                f.write("x")
            raise RuntimeError("injected failure")
        return minibatch_step(pop)

    return dict(trainable=wcray.fused_trainable(
        build_model, flaky_step, optimizer=adam, sample_input=torch.randn(2, 3), metric="loss",
        n_members=N, member_space=SPACE, max_iterations=6, checkpoint_every=2),
        config={"seed": 21})


@pytest.fixture(scope="module")
def tune_results(ray_local, tmp_path_factory):
    """Both Tune tests' trials, run by one Tuner (Note [One Tuner for the Tune tests]): the trial
    result of each case, and the flaky case's failure marker."""
    tmp = tmp_path_factory.mktemp("tune")
    marker = tmp / "failed_once"
    cases = {"plain": _plain_case(), "flaky": _flaky_case(str(marker))}
    trainables = {name: c["trainable"] for name, c in cases.items()}
    configs = {name: c["config"] for name, c in cases.items()}

    def trainable(config):  # the case's own trial config, as its param_space gave it before
        return trainables[config["case"]](dict(configs[config["case"]]))

    tuner = tune.Tuner(
        trainable, param_space={"case": tune.grid_search(list(cases))},
        tune_config=tune.TuneConfig(num_samples=1),
        run_config=tune.RunConfig(storage_path=str(tmp), name="t", verbose=0,
                                  stop={"time_total_s": 1800},  # a hang guard; max_iterations ends it
                                  failure_config=tune.FailureConfig(max_failures=1)))  # the flaky case's
    grid = tuner.fit()
    assert not grid.errors, grid.errors
    results = {r.config["case"]: r for r in grid}
    assert set(results) == set(cases), results
    return results, marker


def test_tune_trial_reports_n_results_equal_to_separate_trainings(tune_results):
    result = tune_results[0]["plain"]
    df = result.metrics_dataframe
    assert len(df) == 5                                              # one report per iteration
    for i in range(N):
        assert df[f"members/{i}/loss"].notna().all()                 # ... each with N results
        config = {"hidden": 6, "lr": df[f"members/{i}/config/lr"].iloc[0],
                  "momentum": df[f"members/{i}/config/momentum"].iloc[0]}
        expected, model = separate_training(config, int(df[f"members/{i}/seed"].iloc[0]), 5)
        torch.testing.assert_close(torch.tensor(df[f"members/{i}/loss"].tolist()),
                                   torch.tensor(expected), rtol=1e-5, atol=1e-6)
    last = [df[f"members/{i}/loss"].iloc[-1] for i in range(N)]
    assert result.metrics["loss"] == min(last) and result.metrics["members_finished"] == N
    best = wcray.best_model(result.checkpoint, build_model)
    i = last.index(min(last))
    _, model = separate_training({"hidden": 6, "lr": df[f"members/{i}/config/lr"].iloc[0],
                                  "momentum": df[f"members/{i}/config/momentum"].iloc[0]},
                                 int(df[f"members/{i}/seed"].iloc[0]), 5)
    for a, b in zip(best.state_dict().values(), model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_tune_trial_restored_after_a_failure_continues_identically(tune_results):
    results, marker = tune_results
    result = results["flaky"]
    assert marker.exists()
    restored = wcray.load_checkpoint(result.checkpoint)
    ref = population(N, optimizer=adam, max_iterations=6, seed=21)
    while not ref.done:
        ref.step(minibatch_step)
    assert restored["restores"] == [2]                               # continued from iteration 2
    assert restored["trial_id"] == result.metrics["trial_id"]
    assert restored["configs"] == ref.configs and restored["iteration"] == 6
    for i in range(N):
        for a, b in zip(restored["members"][i].values(), member_params(ref, i)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert wcray.load_checkpoint(results["plain"].checkpoint)["restores"] == []  # the failure was its own


def test_ray_sweep_example_runs_as_documented(ray_local, monkeypatch, capsys):
    """examples/ray_sweep.py run as a script (``__main__``: its trainables pickled by value, as
    ``python examples/ray_sweep.py`` pickles them), shortened with its own flags to one trial of 4
    members and 4 iterations (the member-level ASHA, the best member unfused). It runs on this
    module's Ray instance: its own ``ray.init`` is checked to ask for the same one (2 CPUs, no
    dashboard), instead of starting a second instance in a fresh process (test_examples.py ran it
    so: a second Ray start and imports of torch and Ray, more than the sweep)."""
    inits = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: inits.append(kwargs))
    monkeypatch.setattr(ray, "shutdown", lambda: inits.append("shutdown"))
    monkeypatch.setattr(sys, "argv", ["ray_sweep.py", "--trials", "1", "--members", "4", "--iterations", "4"])
    runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "ray_sweep.py"), run_name="__main__")
    assert inits == [dict(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False),
                     "shutdown"], inits
    out = capsys.readouterr().out
    assert "1 trials x 4 fused members (asha)" in out and "best: val_loss" in out, out
    assert "best member unfused: Sequential" in out, out
