"""The members' own ``configure_optimizers`` fused: one :mod:`wide_compiler.optim` optimizer
(:func:`wide_compiler.integrations._optimizers.fuse_optimizers`) and one
:mod:`wide_compiler.optim.lr_scheduler` scheduler per scheduler of the members, with Lightning's
scheduler configuration (interval, frequency, monitor)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ... import optim as wc_optim
from .._optimizers import fuse_optimizers

if TYPE_CHECKING:
    from .module import WideLightningModule

__all__ = ["fuse_configuration", "monitor_of"]


def monitor_of(trainer: Any, scheduler: Any) -> str | None:
    for c in trainer.lr_scheduler_configs:
        if c.scheduler is scheduler:
            return c.monitor
    return None


def fuse_configuration(wide_lm: WideLightningModule) -> Any:
    from lightning.pytorch.core.optimizer import _configure_optimizers, _configure_schedulers_automatic_opt

    members = wide_lm._members
    confs = []
    for i, m in enumerate(members):
        trainer = m.__dict__.get("_trainer")
        m._trainer = wide_lm.trainer if wide_lm._trainer is not None else None  # hooks may read self.trainer
        try:
            raw = m.configure_optimizers()
        finally:
            m._trainer = trainer
        if raw is None:
            raise ValueError(f"WideLightningModule: member {i}'s configure_optimizers returned None")
        opts, scheds, monitor = _configure_optimizers(raw)
        if len(opts) != 1:
            raise ValueError(f"WideLightningModule: member {i}'s configure_optimizers returned "
                             f"{len(opts)} optimizers; the fused run takes one (multiple optimizers "
                             "need manual optimization)")
        confs.append((opts[0], _configure_schedulers_automatic_opt(scheds, monitor)))

    optimizer = fuse_optimizers([opt for opt, _ in confs], members,
                                lambda name: wide_lm.wide.get_parameter("lm." + name), owner="WideLightningModule",
                                alternative="or override configure_optimizers in a WideLightningModule subclass "
                                            "and return wide_compiler.optim objects")

    # schedulers
    n_sched = len(confs[0][1])
    out_scheds = []
    for i, (_, scheds) in enumerate(confs):
        if len(scheds) != n_sched:
            raise ValueError(f"WideLightningModule: member {i} has {len(scheds)} lr schedulers, "
                             f"member 0 {n_sched}")
    for k in range(n_sched):
        cfgs = [c[1][k] for c in confs]
        for i, c in enumerate(cfgs):
            for key in ("interval", "frequency", "monitor", "strict", "name"):
                if getattr(c, key) != getattr(cfgs[0], key):
                    raise ValueError(f"WideLightningModule: member {i}'s lr scheduler config has "
                                     f"{key}={getattr(c, key)!r}, member 0 has {getattr(cfgs[0], key)!r}; "
                                     "Lightning steps one scheduler for the fused run")
        sched = _fuse_scheduler([c.scheduler for c in cfgs], optimizer)
        entry = {"scheduler": sched, "interval": cfgs[0].interval, "frequency": cfgs[0].frequency,
                 "strict": cfgs[0].strict}
        if cfgs[0].name is not None:
            entry["name"] = cfgs[0].name
        if isinstance(sched, wc_optim.lr_scheduler.ReduceLROnPlateau):
            entry.update(monitor=cfgs[0].monitor, reduce_on_plateau=True)
            wide_lm._plateau_monitors[id(sched)] = cfgs[0].monitor
        out_scheds.append(entry)
    if not out_scheds:
        return optimizer
    return {"optimizer": optimizer, "lr_scheduler": out_scheds[0]} if len(out_scheds) == 1 else \
        ([optimizer], out_scheds)


def _same_flag(scheds: list, attr: str) -> Any:
    vals = [getattr(s, attr) for s in scheds]
    for i, v in enumerate(vals):
        if v != vals[0]:
            raise ValueError(f"WideLightningModule: member {i}'s {type(scheds[i]).__name__} has "
                             f"{attr}={v!r}, member 0 has {vals[0]!r}; one value for the fused run")
    return vals[0]


def _fuse_scheduler(scheds: list, optimizer: Any) -> Any:
    S = torch.optim.lr_scheduler
    W = wc_optim.lr_scheduler
    cls = type(scheds[0])
    for i, s in enumerate(scheds):
        if type(s) is not cls:
            raise ValueError(f"WideLightningModule: member {i}'s lr scheduler is {type(s).__name__}, "
                             f"member 0's {cls.__name__}")
        if getattr(s, "last_epoch", 0) not in (0,) and cls is not S.ReduceLROnPlateau:
            raise ValueError(f"WideLightningModule: member {i}'s {cls.__name__} has already stepped "
                             f"(last_epoch={s.last_epoch}); create it fresh in configure_optimizers")

    def each(attr: str) -> list:
        return [getattr(s, attr) for s in scheds]

    if cls is S.StepLR:
        return W.StepLR(optimizer, step_size=each("step_size"), gamma=each("gamma"))
    if cls is S.MultiStepLR:
        return W.MultiStepLR(optimizer, [sorted(s.milestones.elements()) for s in scheds], gamma=each("gamma"))
    if cls is S.ExponentialLR:
        return W.ExponentialLR(optimizer, gamma=each("gamma"))
    if cls is S.CosineAnnealingLR:
        return W.CosineAnnealingLR(optimizer, T_max=each("T_max"), eta_min=each("eta_min"))
    if cls is S.LinearLR:
        return W.LinearLR(optimizer, start_factor=each("start_factor"), end_factor=each("end_factor"),
                          total_iters=each("total_iters"))
    if cls is S.ReduceLROnPlateau:  # min_lr: one entry per param group, each the members' values
        min_lr = [[s.min_lrs[k] for s in scheds] for k in range(len(optimizer.param_groups))]
        return W.ReduceLROnPlateau(optimizer, mode=_same_flag(scheds, "mode"), factor=each("factor"),
                                   patience=each("patience"), threshold=each("threshold"),
                                   threshold_mode=_same_flag(scheds, "threshold_mode"),
                                   cooldown=each("cooldown"), min_lr=min_lr, eps=each("eps"))
    raise TypeError(f"WideLightningModule: the members' lr scheduler {cls.__name__} has no fused "
                    "per-member form here; supported: StepLR, MultiStepLR, ExponentialLR, "
                    "CosineAnnealingLR, LinearLR, ReduceLROnPlateau (or override configure_optimizers "
                    "in a WideLightningModule subclass and return wide_compiler.optim.lr_scheduler objects)")
