"""An Optuna study whose trials train 8 at a time, fused into one wide model.

Each trial suggests a learning rate, a weight decay and a hidden size for an MLP on a built-in
task (three interleaved spirals). wide_compiler.integrations.optuna.optimize asks the study for
trials, groups them by architecture (hidden size), trains each group of up to 8 as ONE wide
model (one fused AdamW step per batch for all), reports every member's validation loss to its
own trial each step, and lets Optuna's MedianPruner prune members one by one (a pruned member is
frozen, the others go on). The best trial is trained again alone to show it is the same model.

    python examples/optuna_sweep.py [--trials 16] [--members 8] [--steps 40]
    python examples/optuna_sweep.py --measure --members 16 --steps 300  # fused vs one trial per model
"""
from __future__ import annotations

import argparse
import time

import optuna
import torch
import torch.nn.functional as F
from torch import nn

import wide_compiler as wc
from wide_compiler.zoo import spirals
from wide_compiler.integrations.optuna import optimize


X, Y = spirals(4096)
X_VAL, Y_VAL = spirals(512, seed=1)
BATCH = 128


def batch(step: int):
    idx = torch.randint(0, len(X), (BATCH,), generator=torch.Generator().manual_seed(step))
    return X[idx], Y[idx]


def mlp(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(2, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                         nn.Linear(hidden, 3))


def build(trial, hidden_choices=(32, 64)) -> nn.Module:
    """ONE member from its trial: every suggest_* call is here."""
    trial.suggest_float("lr", 1e-4, 3e-1, log=True)
    trial.suggest_float("weight_decay", 1e-6, 1e-1, log=True)
    return mlp(trial.suggest_categorical("hidden", list(hidden_choices)))


def train_step(run) -> torch.Tensor:
    """One step for ALL members of the fused run; returns each member's validation loss [N]."""
    x, y = batch(run.step)                                   # the same batch for every member
    losses = wc.optim.member_losses(F.cross_entropy, run.model(x.expand(run.n, *x.shape)), y,
                                    shared_target=True)
    run.optimizer.zero_grad()
    losses.sum().backward()
    run.optimizer.step()
    with torch.no_grad():
        return wc.optim.member_losses(F.cross_entropy, run.model(X_VAL.expand(run.n, *X_VAL.shape)),
                                      Y_VAL, shared_target=True)


def make_optimizer(params, hp):
    return wc.optim.AdamW(params, lr=hp["lr"], weight_decay=hp["weight_decay"])


def objective(trial, steps: int, hidden_choices=(32, 64)) -> float:
    """The same training, one trial at a time: an ordinary Optuna objective."""
    torch.manual_seed(trial.number)
    model = build(trial, hidden_choices)
    opt = torch.optim.AdamW(model.parameters(), lr=trial.params["lr"],
                            weight_decay=trial.params["weight_decay"])
    for step in range(steps):
        x, y = batch(step)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            val = F.cross_entropy(model(X_VAL), Y_VAL).item()
        trial.report(val, step)
        if trial.should_prune():
            raise optuna.TrialPruned()
    return val


def measure(members: int, steps: int) -> None:
    """Wall time of N trials as N ordinary Optuna trials against one fused run (one
    architecture, no pruning, so both do the same work)."""
    torch.set_num_threads(1)
    sampler = lambda: optuna.samplers.RandomSampler(seed=0)  # noqa: E731
    study = optuna.create_study(sampler=sampler(), pruner=optuna.pruners.NopPruner())
    t0 = time.perf_counter()
    study.optimize(lambda t: objective(t, steps, (64,)), n_trials=members)
    single = time.perf_counter() - t0
    study_f = optuna.create_study(sampler=sampler(), pruner=optuna.pruners.NopPruner())
    t0 = time.perf_counter()
    optimize(study_f, lambda t: build(t, (64,)), train_step, n_trials=members, n_members=members,
             n_steps=steps, optimizer=make_optimizer, sample_input=X[:BATCH])
    fused = time.perf_counter() - t0
    print(f"{members} trials x {steps} steps, MLP 2-64-64-3, 1 thread: one Optuna trial per model "
          f"{single:.2f} s, fused {fused:.2f} s (compile included): {single / fused:.1f}x")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=16)
    ap.add_argument("--members", type=int, default=8, help="members per fused run")
    ap.add_argument("--steps", type=int, default=40, help="steps (batches) per trial")
    ap.add_argument("--measure", action="store_true", help="wall time, fused vs one trial per model")
    args = ap.parse_args()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if args.measure:
        measure(args.members, args.steps)
        return
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0),
                                pruner=optuna.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=10))
    t0 = time.perf_counter()
    optimize(study, build, train_step, n_trials=args.trials, n_members=args.members,
             n_steps=args.steps, optimizer=make_optimizer, sample_input=X[:BATCH])
    wall = time.perf_counter() - t0
    states = [t.state.name for t in study.trials]
    print(f"{len(states)} trials in {wall:.1f} s: {states.count('COMPLETE')} complete, "
          f"{states.count('PRUNED')} pruned")
    best = study.best_trial
    print(f"best trial {best.number}: val_loss {best.value:.4f} {best.params}")
    # the best trial, trained again alone as an ordinary Optuna objective: the same result
    again = objective(optuna.trial.FixedTrial(best.params, best.number), args.steps)
    print(f"best trial trained alone: val_loss {again:.4f}")


if __name__ == "__main__":
    main()
