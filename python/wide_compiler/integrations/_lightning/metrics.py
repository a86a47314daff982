"""Per-member metrics of :class:`~wide_compiler.integrations.lightning.WideLightningModule`: the
values the members log, aggregated per member over an epoch and logged under the keys Lightning
gives each member alone (Note [Per-member metric keys])."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from lightning.pytorch.utilities.data import extract_batch_size

__all__ = ["MemberLogging", "epoch_ends_here", "last_training_step", "levels", "should_update_logs"]


class MemberLogging:
    """The metric hooks of :class:`~wide_compiler.integrations.lightning.WideLightningModule` (a
    mixin before ``LightningModule``). It reads the module's ``n``, ``monitor``, its logging
    options (``_train_options``, ``_val_options``: ``{name: self.log keywords}``) and
    ``_has_validation_step``, and keeps the epoch sums (``_train_sums``, ``_val_sums``), counts
    and :attr:`member_metrics`."""

    # Note [Per-member metric keys]
    # A value a member logs as `name` is logged as `member_<i>/<key>` for every key Lightning itself
    # makes of `name` for that member trained alone (result.py, _ResultCollection.metrics): logged
    # on_step and on_epoch, it is `name_step` (logger, progress bar) and `name` (callbacks) at a
    # step, `name_epoch` (logger, progress bar) and `name` (callbacks) at the end of the epoch;
    # logged at one level only, it is `name`; `logger=` and `prog_bar=` are the member's. The
    # values are this module's own: Lightning's self.log costs about a millisecond per key and call
    # and a fused step has N keys per name, so the epoch values are aggregated here (N values per
    # name, one reduction under DDP) and logged once per epoch (training: in on_train_batch_end of
    # the epoch's last batch, so that the callbacks' on_train_epoch_end sees them as it would for a
    # member alone; validation: in on_validation_epoch_end, so callbacks see them from
    # on_validation_end on), and training step values are logged on the Trainer's logging steps
    # and on the last step of each epoch (in between, callbacks see the last logged step's
    # values). Validation step values (rarely logged) are logged at every step, as Lightning
    # writes them.
    def _log_members(self, options: dict, values: Mapping[str, torch.Tensor], *, training: bool, phase: str,
                     batch_size: int | None = None) -> None:
        """Log ``values`` (``{name: [N]}``, ``phase`` "step" or "epoch") under the keys of Note
        [Per-member metric keys]."""
        groups: dict[tuple[bool, bool], dict[str, torch.Tensor]] = {}
        for name, opts in options.items():
            v = values.get(name if phase == "epoch" else "log/" + name)
            if v is None:
                continue
            v = v.detach()
            for key, logger, prog_bar in _lightning_keys(name, opts, training=training, phase=phase):
                groups.setdefault((logger, prog_bar), {}).update({f"member_{i}/{key}": v[i] for i in range(self.n)})
        for (logger, prog_bar), logged in groups.items():
            if phase == "step":
                self.log_dict(logged, on_step=True, on_epoch=False, logger=logger, prog_bar=prog_bar,
                              batch_size=batch_size)
            else:
                self._log_epoch(logged, logger=logger, prog_bar=prog_bar)

    # Per-member metrics are aggregated here (N values per name), not by self.log: Lightning's
    # logging costs about a millisecond per key and call, N keys per name and step.
    def _accumulate(self, sums: dict, options: dict, out: dict, bs: int, *, training: bool) -> None:
        """Add a step's values to the epoch sums: in training, of the names logged on_epoch; in
        validation, of every name (:attr:`member_metrics` holds them all)."""
        for name, opts in options.items():
            if training and not levels(opts, training=True)[1]:
                continue
            v = out["log/" + name].detach().to(torch.float64)
            add = v * bs if opts.get("reduce_fx", "mean") in ("mean", torch.mean) else v
            sums[name] = sums[name] + add if name in sums else add

    def _epoch_values(self, sums: dict, options: dict, count: int) -> dict[str, torch.Tensor]:
        """Per-member epoch values ``[N]`` (summed over the processes under DDP)."""
        if not sums:
            return {}
        names = sorted(sums)
        packed = torch.cat([torch.stack([sums[k] for k in names]).reshape(-1),
                            torch.tensor([float(count)], dtype=torch.float64, device=sums[names[0]].device)])
        if self.trainer.world_size > 1:
            packed = self.trainer.strategy.reduce(packed, reduce_op="sum")
        total, count_all = packed[:-1].reshape(len(names), self.n), packed[-1]
        return {name: total[k] / count_all if options[name].get("reduce_fx", "mean") in ("mean", torch.mean)
                else total[k] for k, name in enumerate(names)}

    def on_train_epoch_start(self) -> None:
        self._train_sums, self._train_count, self._train_epoch_logged = {}, 0, False

    def on_train_epoch_end(self) -> None:
        if not self._train_epoch_logged:     # the epoch ended where epoch_ends_here could not tell
            self._log_train_epoch()

    def _log_train_epoch(self) -> None:
        """The training epoch's per-member values, logged once per epoch: after its last batch
        (where the callbacks' ``on_train_epoch_end`` sees them, as for a member alone), or else in
        ``on_train_epoch_end``."""
        self._train_epoch_logged = True
        values = self._epoch_values(self._train_sums, self._train_options, self._train_count)
        self._log_members(self._train_options, values, training=True, phase="epoch")

    def on_validation_epoch_start(self) -> None:
        self._val_sums, self._val_count = {}, 0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if not self._has_validation_step:
            return
        out = self(batch)
        bs = extract_batch_size(batch)
        self._accumulate(self._val_sums, self._val_options, out, bs, training=False)
        self._val_count += bs
        if self._val_step_logged:
            self._log_members(self._val_options, out, training=False, phase="step", batch_size=bs)

    def on_validation_epoch_end(self) -> None:
        metrics = self._epoch_values(self._val_sums, self._val_options, self._val_count)
        if not metrics or self.trainer.sanity_checking:
            return
        self.member_metrics = {k: v.detach().cpu() for k, v in metrics.items()}
        self._log_members(self._val_options, metrics, training=False, phase="epoch")
        if self.monitor in metrics:
            best = self.best_member_index
            self._log_epoch({self.monitor: metrics[self.monitor][best],
                             "best_member": torch.tensor(float(best), dtype=torch.float64)})

    def _log_epoch(self, logged: dict[str, torch.Tensor], *, logger: bool = True, prog_bar: bool = False) -> None:
        """Log epoch values that are already the same on every process (reduced above): no
        per-key collective, and no warning asking for one."""
        if not logged:
            return
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*sync_dist=True.*")
            self.log_dict(logged, on_step=False, on_epoch=True, logger=logger, prog_bar=prog_bar, batch_size=1)


def should_update_logs(trainer: Any) -> bool:
    """Whether Lightning writes step-level metrics to the logger at this step."""
    try:
        return bool(trainer._logger_connector.should_update_logs)
    except AttributeError:  # another Lightning version: every step
        return True


def last_training_step(trainer: Any) -> bool:
    """Whether this training step is the last of its epoch (or of the fit)."""
    try:
        loop = trainer.fit_loop.epoch_loop
        return bool(loop._num_ready_batches_reached()
                    or (loop.max_steps >= 0 and trainer.global_step + 1 >= loop.max_steps))
    except AttributeError:  # another Lightning version: every step is
        return True


def epoch_ends_here(trainer: Any) -> bool:
    """Whether the training epoch ends after the batch that just ran (read after its optimizer
    step; False where that cannot be told: a callback's stop, another Lightning version)."""
    try:
        loop = trainer.fit_loop.epoch_loop
        return bool(loop._num_ready_batches_reached() or (loop.max_steps >= 0 and trainer.global_step >= loop.max_steps))
    except AttributeError:
        return False


def levels(opts: Mapping[str, Any], *, training: bool) -> tuple[bool, bool]:
    """``(on_step, on_epoch)`` of a value logged with ``opts`` in ``training_step`` (training) or
    ``validation_step``, with Lightning's defaults for that hook."""
    on_step, on_epoch = opts.get("on_step"), opts.get("on_epoch")
    return (training if on_step is None else bool(on_step),
            (not training) if on_epoch is None else bool(on_epoch))


def _lightning_keys(name: str, opts: Mapping[str, Any], *, training: bool, phase: str) -> list[tuple[str, bool, bool]]:
    """``(key, logger, prog_bar)`` for each key Lightning makes of a value logged as ``name`` with
    ``opts``, at a step (``phase="step"``) or at the end of an epoch: Note [Per-member metric keys]."""
    on_step, on_epoch = levels(opts, training=training)
    if not (on_step if phase == "step" else on_epoch):
        return []
    logger, prog_bar = bool(opts.get("logger", True)), bool(opts.get("prog_bar", False))
    if not (on_step and on_epoch):
        return [(name, logger, prog_bar)]
    keys = [(f"{name}_{phase}", logger, prog_bar)]
    if training or phase == "epoch":     # callbacks see `name` (validation: at the end of the epoch only)
        keys.append((name, False, False))
    return keys
