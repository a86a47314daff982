"""Per-member early stopping for :class:`~wide_compiler.integrations.lightning.WideLightningModule`."""

from __future__ import annotations

import logging
import math
from typing import Any

import lightning.pytorch as pl

from .module import WideLightningModule

__all__ = ["MemberEarlyStopping"]

log = logging.getLogger(__name__)


class MemberEarlyStopping(pl.Callback):
    """Lightning's ``EarlyStopping``, per member of a :class:`WideLightningModule`: after each
    validation epoch, member ``i`` whose ``monitor`` (``member_<i>/<monitor>``) has not improved by
    more than ``min_delta`` for ``patience`` validation epochs is stopped
    (:meth:`WideLightningModule.stop_member`: its weights and optimizer state are frozen from
    then on); the run stops when every member has. The decisions are the ones
    ``lightning.pytorch.callbacks.EarlyStopping`` takes for that member trained alone.

    Example:
        >>> es = MemberEarlyStopping(monitor="val_loss", patience=3)
        >>> es.patience, es.mode
        (3, 'min')
    """

    def __init__(self, monitor: str = "val_loss", min_delta: float = 0.0, patience: int = 3,
                 mode: str = "min", check_finite: bool = True, verbose: bool = False) -> None:
        super().__init__()
        if mode not in ("min", "max"):
            raise ValueError(f"MemberEarlyStopping: mode must be 'min' or 'max', got {mode!r}")
        if patience < 0:
            raise ValueError("MemberEarlyStopping: patience must be >= 0")
        self.monitor, self.min_delta, self.patience, self.mode = monitor, abs(float(min_delta)), patience, mode
        self.check_finite, self.verbose = check_finite, verbose
        self.wait_count: list[int] = []
        self.best_score: list[float] = []
        self.stopped_epoch: list[int] = []

    @property
    def state_key(self) -> str:
        return f"MemberEarlyStopping{{'monitor': {self.monitor!r}, 'mode': {self.mode!r}}}"

    def _init(self, n: int) -> None:
        if len(self.wait_count) != n:
            inf = math.inf if self.mode == "min" else -math.inf
            self.wait_count, self.best_score, self.stopped_epoch = [0] * n, [inf] * n, [-1] * n

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != "fit":
            return
        if not isinstance(pl_module, WideLightningModule):
            raise TypeError("MemberEarlyStopping: the module is not a WideLightningModule; use "
                            "lightning's EarlyStopping for one model")
        values = pl_module.member_metrics.get(self.monitor)
        if values is None:
            raise RuntimeError(f"MemberEarlyStopping: no per-member {self.monitor!r} was logged in "
                               f"validation_step (per-member metrics: {sorted(pl_module.member_metrics)})")
        self._init(pl_module.n)
        for i in range(pl_module.n):
            if bool(pl_module.member_stopped[i]):
                continue
            current = float(values[i])
            stop = False
            if self.check_finite and not math.isfinite(current):
                stop = True
            elif (current + self.min_delta < self.best_score[i] if self.mode == "min"
                  else current - self.min_delta > self.best_score[i]):
                self.best_score[i], self.wait_count[i] = current, 0
            else:
                self.wait_count[i] += 1
                stop = self.wait_count[i] >= self.patience
            if stop:
                pl_module.stop_member(i)
                self.stopped_epoch[i] = trainer.current_epoch
                if self.verbose:
                    log.info("member %d stopped at epoch %d (%s = %s)", i, trainer.current_epoch,
                             self.monitor, current)
        if bool(pl_module.member_stopped.all()):
            trainer.should_stop = True

    def state_dict(self) -> dict[str, Any]:
        return {"wait_count": list(self.wait_count), "best_score": list(self.best_score),
                "stopped_epoch": list(self.stopped_epoch), "patience": self.patience}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.wait_count = list(state_dict["wait_count"])
        self.best_score = list(state_dict["best_score"])
        self.stopped_epoch = list(state_dict["stopped_epoch"])
