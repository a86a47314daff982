"""wide_compiler.integrations.lightning: N members of a LightningModule trained by one unchanged
lightning.Trainer end where each member ends trained alone by lightning.Trainer (float64, 1e-6
relative or better): weights, optimizer state, learning rates, per-member early stopping,
checkpoint restore, the best member's export, DDP over 2 CPU processes (gloo), and the errors."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

L = pytest.importorskip("lightning", reason="lightning is not installed (pip install 'wide_compiler[lightning]')")
wcl = pytest.importorskip("wide_compiler.integrations.lightning")
import wide_compiler as wc  # noqa: E402
from wide_compiler.bench._integrations_child import regressor_class  # noqa: E402
from support import DEVICE

ROOT = Path(__file__).resolve().parents[2]
N = 4
#: The tests train the same regressor members: they check the fused module, not the capture, so one
#: compile cache per module stores each graph once and the later tests load it (conftest's
#: module_compile_cache; a cache hit is the fresh compile bit for bit: test_compile_cache.py).
pytestmark = pytest.mark.usefixtures("module_compile_cache")


@pytest.fixture(autouse=True)
def _quiet():
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*litlogger.*")
        yield


# One member: docs/integrations.md's MLP regressor whose hyperparameters only configure_optimizers reads
# (options here: hidden, optimizer, step_size, gamma, amsgrad); `benchmark integrations` trains it too.
Regressor = regressor_class()


CONFIGS = [dict(lr=3e-3, weight_decay=0.0), dict(lr=1e-2, weight_decay=1e-2, gamma=0.7),
           dict(lr=3e-2, weight_decay=0.1, step_size=2), dict(lr=1e-1, weight_decay=0.0, gamma=0.9)]

g = torch.Generator(DEVICE).manual_seed(0)
X = torch.randn(160, 4, generator=g, dtype=torch.float64)
Y = torch.sin(X[:, :1]) + 0.1 * torch.randn(160, 1, generator=g, dtype=torch.float64)
XV, YV = X[:48] + 0.05, Y[:48]


def loaders(batch_size=24):
    train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, Y), batch_size=batch_size)
    val = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(XV, YV), batch_size=20)
    return train, val


def member(i, configs=CONFIGS, cls=Regressor):
    torch.manual_seed(1000 + i)
    return cls(**configs[i]).double()


def trainer(**kw):
    args = dict(max_epochs=6, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=1)
    args.update(kw)
    return L.Trainer(**args)


def wide_module(configs=CONFIGS, **kw):
    train, _ = loaders()
    return wcl.WideLightningModule([member(i, configs) for i in range(len(configs))], next(iter(train)), **kw)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def assert_member_matches(wide, wide_trainer, i, single, single_trainer, tol=1e-6):
    """Member i of the fused run == the member trained alone: weights, optimizer state, lr."""
    got = wide.member(i).state_dict()
    for k, v in single.state_dict().items():
        assert rel(got[k], v) <= tol, (i, k, rel(got[k], v))
    ref = single_trainer.optimizers[0].state_dict()
    mine = wide_trainer.optimizers[0].member_state_dict(i)
    assert mine["state"].keys() == ref["state"].keys()
    for p, st in ref["state"].items():
        assert mine["state"][p].keys() == st.keys(), (i, p)
        for key, v in st.items():
            assert rel(mine["state"][p][key].to(torch.float64), v.to(torch.float64)) <= tol, (i, p, key)
    assert mine["param_groups"][0]["lr"] == pytest.approx(ref["param_groups"][0]["lr"], rel=1e-12)


def fit_single(i, configs=CONFIGS, callbacks=(), **kw):
    single = member(i, configs)
    t = trainer(callbacks=list(callbacks), **kw)
    t.fit(single, *loaders())
    return single, t


# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["deferred", "switched", "compiled"])
def test_members_match_single_lightning_runs(how, monkeypatch):
    """N=4, AdamW + StepLR per member, per-member gradient clipping: 7 batches x 6 epochs. By
    default a fit this short runs each member's own steps (Note [Running the members until
    compiling pays]); with a compile made to look free both graphs are compiled after their
    measured calls, mid-fit; compiled: at construction."""
    from wide_compiler import model_deferred

    if how == "switched":
        for name in ("COLD_SECONDS", "COLD_SECONDS_PER_MODULE", "WARM_SECONDS"):
            monkeypatch.setattr(model_deferred, name, 0.0)
    wide = wide_module(**({"config": wc.WideConfig.fast()} if how == "compiled" else {}))
    t = trainer(gradient_clip_val=0.5, log_every_n_steps=1)
    t.fit(wide, *loaders())
    assert t.global_step == 42
    assert wide.wide.compiled_modes() == ([] if how == "deferred" else ["train", "eval"])
    for i in range(N):
        single, ts = fit_single(i, gradient_clip_val=0.5)
        assert_member_matches(wide, t, i, single, ts)
        assert float(wide.member_metrics["val_loss"][i]) == pytest.approx(float(ts.callback_metrics["val_loss"]),
                                                                          rel=1e-6)
    metrics = t.callback_metrics
    for i in range(N):
        assert f"member_{i}/val_loss" in metrics and f"member_{i}/train_loss" in metrics
    best = wide.best_member_index
    assert int(metrics["best_member"]) == best
    assert float(metrics["val_loss"]) == pytest.approx(float(wide.member_metrics["val_loss"].min()))


def test_float32_members_under_precision_64_true():
    def member32(i):
        torch.manual_seed(1000 + i)
        return Regressor(**CONFIGS[i])

    wide = wcl.WideLightningModule([member32(i) for i in range(N)], (X[:24].float(), Y[:24].float()))
    t = trainer(max_epochs=2, precision="64-true")
    t.fit(wide, *loaders())
    single = member32(1)
    ts = trainer(max_epochs=2, precision="64-true")
    ts.fit(single, *loaders())
    assert_member_matches(wide, t, 1, single, ts)


class Logs(Regressor):
    """A member that logs the ways Lightning names differently: on_step+on_epoch (forked into
    _step/_epoch), on_epoch only, on_step only, prog_bar, reduce_fx="sum", logger=False, and
    validation metrics per epoch and per step."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        loss = F.mse_loss(out, y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        self.log("train_mae", (out - y).abs().mean(), on_step=False, on_epoch=True, prog_bar=True)
        self.log("train_max", (out - y).abs().max(), prog_bar=True)             # training_step: on_step
        self.log("train_sum", loss, on_step=True, on_epoch=True, reduce_fx="sum", prog_bar=True)
        self.log("train_quiet", loss * 2, on_step=True, on_epoch=True, logger=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        out = self(x)
        self.log("val_loss", F.mse_loss(out, y))                                 # validation_step: on_epoch
        self.log("val_mae", (out - y).abs().mean(), on_step=True, on_epoch=True, prog_bar=True)
        self.log("val_max", (out - y).abs().max(), on_step=True, on_epoch=False)


class Snapshots(L.pytorch.Callback):
    """The three metric dicts of the Trainer after every training batch, training epoch and
    validation epoch."""

    def __init__(self):
        self.seen = []

    def _take(self, where, trainer):
        self.seen.append((where, {name: {k: float(v) for k, v in getattr(trainer, name).items()}
                                  for name in ("callback_metrics", "logged_metrics", "progress_bar_metrics")}))

    def on_train_batch_end(self, trainer, *args):
        self._take(f"batch {trainer.global_step}", trainer)

    def on_train_epoch_end(self, trainer, *args):
        self._take(f"train epoch {trainer.current_epoch}", trainer)

    def on_validation_end(self, trainer, *args):
        if not trainer.sanity_checking:
            self._take(f"validation {trainer.current_epoch}", trainer)


def _member_view(metrics, i):
    """Member i's keys of the fused run's metrics, without the member_<i>/ prefix."""
    prefix = f"member_{i}/"
    return {k[len(prefix):]: v for k, v in metrics.items() if k.startswith(prefix)}


@pytest.mark.parametrize("every, more", [(1, {}), (4, {}), (2, dict(accumulate_grad_batches=2, max_steps=6))])
def test_metric_keys_are_lightnings_for_each_member(tmp_path, every, more):
    """Every per-member key is member_<i>/ + the key Lightning gives that member trained alone, in
    callback_metrics, logged_metrics and progress_bar_metrics, with its value: after every batch
    when every step is a logging step (log_every_n_steps=1), and at the end of every epoch
    whatever log_every_n_steps is (also with gradient accumulation, and max_steps ending an epoch
    early)."""
    configs = CONFIGS[:2]
    kw = dict(max_epochs=2, log_every_n_steps=every, num_sanity_val_steps=1, **more)
    wide = wcl.WideLightningModule([member(i, configs, cls=Logs) for i in range(2)], next(iter(loaders()[0])))
    fused = Snapshots()
    trainer(callbacks=[fused], logger=L.pytorch.loggers.CSVLogger(tmp_path / "w"), **kw).fit(wide, *loaders())
    for i in range(2):
        alone = Snapshots()
        trainer(callbacks=[alone], logger=L.pytorch.loggers.CSVLogger(tmp_path / f"{i}"), **kw).fit(
            member(i, configs, cls=Logs), *loaders())
        assert [w for w, _ in fused.seen] == [w for w, _ in alone.seen]
        for (where, got), (_, want) in zip(fused.seen, alone.seen):
            if every != 1 and where.startswith("batch"):
                continue         # step values between logging steps: the fused run writes them on logging steps
            for name in want:
                mine = _member_view(got[name], i)
                theirs = {k: v for k, v in want[name].items() if k not in ("epoch", "step")}
                assert mine.keys() == theirs.keys(), (where, name, sorted(mine), sorted(theirs))
                for k, v in theirs.items():
                    assert mine[k] == pytest.approx(v, rel=1e-6), (where, name, k)
    end = fused.seen[-1][1]["callback_metrics"]
    assert {"member_0/train_loss", "member_0/train_loss_step", "member_0/train_loss_epoch"} <= end.keys()
    assert not {k for k in end if "/" not in k} - {"val_loss", "best_member"}


def test_callbacks_monitor_a_members_training_metric(tmp_path):
    """ModelCheckpoint and EarlyStopping monitoring member_0/train_loss (logged on_step and
    on_epoch) act as they do on train_loss for member 0 trained alone."""
    configs = [dict(lr=3e-1, step_size=100), dict(lr=1e-3, step_size=100)]

    def callbacks(key, where):
        return [L.pytorch.callbacks.EarlyStopping(monitor=key, patience=1, min_delta=1e-2),
                L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path / where, monitor=key, save_top_k=1)]

    wide = wcl.WideLightningModule([member(i, configs, cls=Logs) for i in range(2)], next(iter(loaders()[0])))
    cw = callbacks("member_0/train_loss", "w")
    tw = trainer(max_epochs=10, callbacks=cw, enable_checkpointing=True)
    tw.fit(wide, loaders()[0])
    ca = callbacks("train_loss", "a")
    ta = trainer(max_epochs=10, callbacks=ca, enable_checkpointing=True)
    ta.fit(member(0, configs, cls=Logs), loaders()[0])
    assert ta.current_epoch < 10, "the test is meaningful: member 0 alone stops early"
    assert tw.current_epoch == ta.current_epoch and cw[0].stopped_epoch == ca[0].stopped_epoch
    assert float(cw[1].best_model_score) == pytest.approx(float(ca[1].best_model_score), rel=1e-6)
    assert Path(cw[1].best_model_path).name == Path(ca[1].best_model_path).name


def test_sgd_and_shared_flags_per_member():
    configs = [dict(lr=1e-2 * (i + 1), weight_decay=1e-3 * i, optimizer="SGD") for i in range(N)]
    wide = wide_module(configs)
    t = trainer(max_epochs=3)
    t.fit(wide, *loaders())
    for i in (0, 3):
        single, ts = fit_single(i, configs, max_epochs=3)
        assert_member_matches(wide, t, i, single, ts)


def test_member_early_stopping_matches_lightning_early_stopping():
    configs = [dict(lr=1e-3, step_size=100), dict(lr=2e-2, step_size=100), dict(lr=3e-1, step_size=100),
               dict(lr=1e-1, step_size=100)]
    es = dict(monitor="val_loss", patience=1, min_delta=1e-3)
    wide = wide_module(configs)
    callback = wcl.MemberEarlyStopping(**es)
    t = trainer(max_epochs=10, callbacks=[callback])
    t.fit(wide, *loaders())
    stopped_at = []
    for i in range(N):
        single, ts = fit_single(i, configs, callbacks=[L.pytorch.callbacks.EarlyStopping(**es)], max_epochs=10)
        assert_member_matches(wide, t, i, single, ts)
        stopped_at.append(ts.current_epoch if ts.should_stop else None)
        assert bool(wide.member_stopped[i]) == ts.should_stop
    # the test is meaningful: some member stopped while others went on
    assert any(e is not None for e in stopped_at) and len(set(stopped_at)) > 1, stopped_at


def test_stopped_member_is_frozen_exactly():
    """After stop_member(i), member i's weights and AdamW state (moments, step) do not change at
    all (no moment drift, no weight decay) while the others keep training; member i equals the
    member trained alone for as many epochs as it trained."""
    configs = [dict(lr=1e-2, weight_decay=0.1, step_size=100)] * N
    seen = {}

    class StopAt(L.pytorch.Callback):
        def on_train_epoch_end(self, trainer, wide):
            if trainer.current_epoch == 1:
                wide.stop_member(1)
                seen["w"] = wide.member(1).state_dict()
                seen["s"] = trainer.optimizers[0].member_state_dict(1)["state"]
                seen["other"] = wide.member(2).state_dict()

    wide = wide_module(configs)
    t = trainer(max_epochs=5, callbacks=[StopAt()])
    t.fit(wide, *loaders())
    for k, v in wide.member(1).state_dict().items():
        assert torch.equal(v, seen["w"][k]), k
    now = t.optimizers[0].member_state_dict(1)["state"]
    for p, st in seen["s"].items():
        for key, v in st.items():
            assert torch.equal(now[p][key], v), (p, key)
    assert all(not torch.equal(v, seen["other"][k]) for k, v in wide.member(2).state_dict().items())
    single, ts = fit_single(1, configs, max_epochs=2)
    got = wide.member(1).state_dict()
    for k, v in single.state_dict().items():
        assert rel(got[k], v) <= 1e-6, k
    assert not t.should_stop or t.current_epoch == 5


def test_run_ends_when_every_member_stopped():
    wide = wide_module()
    callback = wcl.MemberEarlyStopping(monitor="val_loss", patience=2, min_delta=100.0)
    t = trainer(max_epochs=10, callbacks=[callback])
    t.fit(wide, *loaders())
    assert bool(wide.member_stopped.all()) and t.current_epoch == 3   # epochs 0, 1, 2 of 10
    assert callback.stopped_epoch == [2] * N


def test_checkpoint_restore_continues_exactly(tmp_path):
    es = dict(monitor="val_loss", patience=1, min_delta=1e-3)
    configs = [dict(lr=1e-3, step_size=2), dict(lr=3e-1, step_size=100), dict(lr=3e-2), dict(lr=1e-1, gamma=0.8)]
    full = wide_module(configs)
    tf = trainer(max_epochs=6, callbacks=[wcl.MemberEarlyStopping(**es)])
    tf.fit(full, *loaders())

    first = wide_module(configs)
    ckpt = L.pytorch.callbacks.ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0)
    t1 = trainer(max_epochs=3, callbacks=[wcl.MemberEarlyStopping(**es), ckpt], enable_checkpointing=True)
    t1.fit(first, *loaders())
    resumed = wide_module(configs)
    t2 = trainer(max_epochs=6, callbacks=[wcl.MemberEarlyStopping(**es)], enable_checkpointing=False)
    t2.fit(resumed, *loaders(), ckpt_path=str(tmp_path / "last.ckpt"))

    assert torch.equal(resumed.member_stopped, full.member_stopped)
    for k, v in full.state_dict().items():
        if isinstance(v, torch.Tensor):
            assert torch.allclose(resumed.state_dict()[k], v, rtol=1e-12, atol=0), k
    a, b = tf.optimizers[0].state_dict(), t2.optimizers[0].state_dict()
    for p, st in a["state"].items():
        for key, v in st.items():
            assert torch.allclose(b["state"][p][key], v, rtol=1e-12, atol=0), (p, key)
    assert torch.equal(a["param_groups"][0]["lr"], b["param_groups"][0]["lr"])
    assert torch.equal(resumed.member_metrics["val_loss"], full.member_metrics["val_loss"])
    # one member straight from the checkpoint file, into an ordinary module (no fused model)
    plain = wcl.load_member(tmp_path / "last.ckpt", 2, member(2, configs))
    for k, v in first.member(2).state_dict().items():
        assert torch.equal(plain.state_dict()[k], v), k


def test_best_member_export():
    wide = wide_module()
    t = trainer(max_epochs=3)
    t.fit(wide, *loaders())
    best = wide.best_member_index
    assert best == int(wide.member_metrics["val_loss"].argmin())
    model = wide.best_member()
    assert type(model) is Regressor and model.hparams.lr == CONFIGS[best]["lr"]
    with torch.no_grad():
        expected = wide.wide.member_state_dict(best)
        for k, v in model.state_dict().items():
            assert torch.equal(v, expected["lm." + k])
        val = F.mse_loss(model.eval()(XV), YV)
    assert float(val) == pytest.approx(float(wide.member_metrics["val_loss"][best]), rel=1e-9)
    # the exported member trains on as an ordinary LightningModule
    trainer(max_epochs=1).fit(model, *loaders())


def test_test_step_runs_per_member():
    class WithTest(Regressor):
        def test_step(self, batch, batch_idx):
            x, y = batch
            self.log("test_loss", F.mse_loss(self(x), y))

        def predict_step(self, batch, batch_idx):
            return self(batch[0])

    wide = wcl.WideLightningModule([member(i, cls=WithTest) for i in range(N)], next(iter(loaders()[0])))
    t = trainer(max_epochs=1)
    t.fit(wide, *loaders())
    out = t.test(wide, loaders()[1], verbose=False)[0]
    with torch.no_grad():
        for i in range(N):
            assert out[f"member_{i}/test_loss"] == pytest.approx(float(F.mse_loss(wide.member(i)(XV), YV)), rel=1e-6)
        preds = t.predict(wide, loaders()[1])
        assert len(preds) == 3 and len(preds[0]) == N        # per batch: N member predictions
        assert torch.equal(preds[0][2], wide.member(2).predict_step((XV[:20], YV[:20]), 0))


def test_model_with_loss_members():
    def build(i):
        torch.manual_seed(i)
        return wcl.ModelWithLoss(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(),
                                                     torch.nn.Linear(8, 1)).double(),
                                 F.mse_loss, optimizer="Adam", lr=1e-3 * 3 ** i, betas=(0.8, 0.99))
    wide = wcl.WideLightningModule([build(i) for i in range(N)], next(iter(loaders()[0])))
    t = trainer(max_epochs=2)
    t.fit(wide, *loaders())
    single = build(2)
    ts = trainer(max_epochs=2)
    ts.fit(single, *loaders())
    assert_member_matches(wide, t, 2, single, ts)
    assert t.optimizers[0].member_hyperparameters(2)["betas"] == (0.8, 0.99)


def test_subclass_returning_wc_optim_objects():
    import wide_compiler as wc

    lrs = [1e-2, 3e-2, 1e-1, 3e-1]

    class MyWide(wcl.WideLightningModule):
        def configure_optimizers(self):
            opt = wc.optim.SGD(self.parameters(), lr=lrs, momentum=0.9)
            return {"optimizer": opt, "lr_scheduler": wc.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=[3, 4, 5, 6])}

    class Cosine(Regressor):
        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
            return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4)}

    wide = MyWide([member(i, cls=Regressor) for i in range(N)], next(iter(loaders()[0])))
    t = trainer(max_epochs=3)
    t.fit(wide, *loaders())
    single = member(1, [dict(lr=lr) for lr in lrs], Cosine)
    ts = trainer(max_epochs=3)
    ts.fit(single, *loaders())
    assert_member_matches(wide, t, 1, single, ts)


def test_reduce_lr_on_plateau_per_member():
    class Plateau(Regressor):
        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=self.hparams.gamma, patience=0)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}}

    configs = [dict(lr=3e-1, gamma=0.5), dict(lr=1e-1, gamma=0.2), dict(lr=1e-3, gamma=0.5), dict(lr=5e-1, gamma=0.1)]
    wide = wcl.WideLightningModule([member(i, configs, Plateau) for i in range(N)], next(iter(loaders()[0])))
    t = trainer(max_epochs=5)
    t.fit(wide, *loaders())
    lrs = []
    for i in range(N):
        single = member(i, configs, Plateau)
        ts = trainer(max_epochs=5)
        ts.fit(single, *loaders())
        assert_member_matches(wide, t, i, single, ts)
        lrs.append(ts.optimizers[0].param_groups[0]["lr"])
    assert len(set(lrs)) == N  # each member reduced on its own metric


def test_reduce_lr_on_plateau_with_a_min_lr_per_param_group():
    """Two members, two param groups (N equals the number of groups, where a flat list of min_lrs
    reads both ways): the fused scheduler gets one entry per group, each member's values."""
    class Grouped(Regressor):
        def configure_optimizers(self):
            opt = torch.optim.SGD([{"params": self.net[0].parameters()}, {"params": self.net[2].parameters()}],
                                  lr=self.hparams.lr)
            sched = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.1, patience=0,
                                                               min_lr=[self.hparams.lr / 4, self.hparams.lr / 2])
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "monitor": "val_loss"}}

    configs = [dict(lr=1e-1), dict(lr=4e-2)]
    wide = wcl.WideLightningModule([member(i, configs, Grouped) for i in range(2)], next(iter(loaders()[0])))
    t = trainer(max_epochs=4)
    t.fit(wide, *loaders())
    for i in range(2):
        single = member(i, configs, Grouped)
        ts = trainer(max_epochs=4)
        ts.fit(single, *loaders())
        assert_member_matches(wide, t, i, single, ts)
        fused = t.lr_scheduler_configs[0].scheduler
        assert [float(fused.min_lrs[k][i]) for k in range(2)] == pytest.approx(ts.lr_scheduler_configs[0].scheduler.min_lrs)


# -- bad input ------------------------------------------------------------------------------------
def test_architecture_change_is_refused_naming_key_and_member():
    configs = [dict(lr=1e-2), dict(lr=1e-2), dict(lr=1e-2, hidden=32), dict(lr=1e-2)]
    with pytest.raises(Exception, match=r"member 2.*hidden=32 \(member 0: 16\)"):
        wide_module(configs)


def test_training_step_must_return_a_loss():
    class Outputs(Regressor):
        def training_step(self, batch, batch_idx):
            x, _ = batch
            return self(x)

    with pytest.raises(TypeError, match=r"Outputs.training_step returned a tensor of shape \[24, 1\].*loss"):
        wcl.WideLightningModule([member(i, cls=Outputs) for i in range(N)], next(iter(loaders()[0])))

    class Nothing(Regressor):
        def training_step(self, batch, batch_idx):
            return None

    with pytest.raises(TypeError, match="NoneType"):
        wcl.WideLightningModule([member(i, cls=Nothing) for i in range(N)], next(iter(loaders()[0])))


def test_step_reading_a_per_member_hyperparameter_is_refused():
    class Weighted(Regressor):
        def __init__(self, lr=1e-2, l2=0.0, **kw):
            super().__init__(lr=lr, **kw)
            self.save_hyperparameters()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self(x), y) + self.hparams.l2 * self.net[0].weight.square().sum()

    configs = [dict(l2=0.0), dict(l2=0.0), dict(l2=0.0), dict(l2=1e-3)]
    with pytest.raises(ValueError, match=r"member 3.*hparams\['l2'\]"):
        wcl.WideLightningModule([member(i, configs, Weighted) for i in range(N)], next(iter(loaders()[0])))
    # the same value for every member: fine
    wcl.WideLightningModule([member(i, [dict(l2=1e-3)] * N, Weighted) for i in range(N)], next(iter(loaders()[0])))


def test_step_reading_a_per_member_attribute_is_refused():
    class Scaled(Regressor):
        def __init__(self, lr=1e-2, scale=1.0):
            super().__init__(lr=lr)
            self.scale = scale

        def training_step(self, batch, batch_idx):
            return self.scale * super().training_step(batch, batch_idx)

    configs = [dict(), dict(scale=2.0), dict(), dict()]
    with pytest.raises(ValueError, match=r"member 1: Scaled's training/validation step reads self.scale"):
        wcl.WideLightningModule([member(i, configs, Scaled) for i in range(N)], next(iter(loaders()[0])))


def test_trainer_argument_in_member_hyperparameters_is_refused():
    class Accumulating(Regressor):
        def __init__(self, lr=1e-2, accumulate_grad_batches=1):
            super().__init__(lr=lr)
            self.save_hyperparameters()

    configs = [dict(), dict(accumulate_grad_batches=4), dict(), dict()]
    with pytest.raises(ValueError, match=r"member 1: hyperparameter 'accumulate_grad_batches' is 4.*Trainer"):
        wcl.WideLightningModule([member(i, configs, Accumulating) for i in range(N)], next(iter(loaders()[0])))


def test_shared_flag_differing_is_refused():
    configs = [dict(optimizer="Adam"), dict(optimizer="Adam", amsgrad=True), dict(optimizer="Adam"), dict(optimizer="Adam")]
    wide = wide_module(configs)
    with pytest.raises(ValueError, match=r"member 1's Adam has amsgrad=True, member 0 has False"):
        trainer(max_epochs=1).fit(wide, *loaders())


def test_fp16_mixed_precision_is_refused():
    from lightning.pytorch.plugins.precision import MixedPrecision

    wide = wide_module()
    fp16 = MixedPrecision(precision="16-mixed", device="cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"precision='16-mixed'.*ONE GradScaler"):
        trainer(max_epochs=1, plugins=[fp16]).fit(wide, *loaders())


# -- DDP: the data axis over 2 CPU processes (gloo) ------------------------------------------------
DDP_SCRIPT = r'''
import json, logging, sys, warnings, torch, torch.nn.functional as F, lightning as L
warnings.filterwarnings("ignore"); logging.getLogger("lightning").setLevel(logging.ERROR)
sys.path.insert(0, sys.argv[2])
from test_lightning import CONFIGS, member, loaders, rel, N
from wide_compiler.integrations.lightning import WideLightningModule

def trainer():
    return L.Trainer(max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, accelerator="cpu", devices=2,
                     strategy="ddp", gradient_clip_val=0.5)

wide = WideLightningModule([member(i) for i in range(N)], next(iter(loaders()[0])))
t = trainer(); t.fit(wide, *loaders())
errors = []
for i in range(N):
    single = member(i); ts = trainer(); ts.fit(single, *loaders())
    got = wide.member(i).state_dict()
    w = max(rel(got[k], v) for k, v in single.state_dict().items())
    ref, mine = ts.optimizers[0].state_dict(), t.optimizers[0].member_state_dict(i)
    s = max(rel(mine["state"][p][k].double(), v.double()) for p, st in ref["state"].items() for k, v in st.items())
    errors.append([w, s])
if t.global_rank == 0:
    json.dump({"errors": errors, "world": t.world_size, "steps": t.global_step}, open(sys.argv[1], "w"))
'''


def test_ddp_two_cpu_processes(tmp_path):
    script = tmp_path / "ddp_run.py"
    script.write_text(DDP_SCRIPT)
    out = tmp_path / "result.json"
    # each rank compiles afresh, as without the module's compile cache (pytestmark)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "python"), WIDE_COMPILE_CACHE="0")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                           str(script), str(out), str(Path(__file__).parent)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)  # a hang guard
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world"] == 2 and result["steps"] == 12   # 160 rows / 2 ranks / 24 per batch -> 4 x 3
    for i, (w, s) in enumerate(result["errors"]):
        assert w <= 1e-6 and s <= 1e-6, (i, w, s)


def test_example_runs(tmp_path, monkeypatch, capsys):
    """examples/lightning_ensemble.py run as a script (``__main__``, its own argument parsing) with
    ``--epochs 1``, in this process: a fresh interpreter cost its imports of torch and Lightning,
    more than the run. The script's process-wide settings (one thread, Lightning's log level) are
    put back after it; its files go to tmp_path."""
    import runpy

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning_ensemble.py", "--epochs", "1"])
    threads, level = torch.get_num_threads(), logging.getLogger("lightning").level
    try:
        runpy.run_path(str(ROOT / "examples" / "lightning_ensemble.py"), run_name="__main__")
    finally:
        torch.set_num_threads(threads)
        logging.getLogger("lightning").setLevel(level)
    out = capsys.readouterr().out
    assert "best member" in out.lower() and out.count("member ") >= 8, out  # one line per member


def test_the_steps_are_rank_checked_on_meta_tensors(monkeypatch):
    """mse_loss has no widen rule: its vmap fallback asked torch.is_autocast_enabled("meta"), which
    raises, so the rank check of every step with it left the meta run for the slow fake run
    (Note [Rank check on meta tensors] in fx/widen.py; issue 45: the short fused fit)."""
    from wide_compiler.fx import widen

    ran = []
    monkeypatch.setattr(widen, "_fake_run", lambda *args, **kwargs: ran.append(1))
    wide = wide_module(CONFIGS[:2])
    wide.eval()  # the validation step's graph
    assert not ran
    x, y = next(iter(loaders()[0]))
    want = torch.stack([F.mse_loss(member(i)(x), y) for i in range(2)])
    torch.testing.assert_close(wide((x, y))["log/val_loss"], want)


def test_the_integrations_benchmark_runs_the_same_training_fused_and_sequential(tmp_path):
    """benchmark integrations (issue 45) times a fused fit against the members' own fits: both
    train the same members on the same batches (same final weights), or the timing compares
    different work."""
    from wide_compiler.bench import _integrations_child as child
    from wide_compiler.bench import integrations as target

    fused, alone = str(tmp_path / "fused.pt"), str(tmp_path / "alone.pt")
    got = child.one_run("lightning", True, 2, 3, fused)
    child.one_run("lightning", False, 2, 3, alone)
    assert set(got) == {"seconds", "import_s", "cpu_s"} and got["seconds"] > 0
    assert target._max_abs_err(fused, alone) < 1e-5
