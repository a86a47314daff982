"""The fused module: N members of one ``LightningModule`` class trained as ONE ``LightningModule``
(:class:`WideLightningModule`), and :func:`load_member` (one member from its checkpoint)."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.data import extract_batch_size
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from ... import optim as wc_optim
from ...config import WideConfig
from ...errors import ArchitectureMismatchError
from .capture import (NAME, BatchLayout, Recorder, Steps, check_members, config_difference, hparams, member_of,
                      plain, probe_steps, shadowed_attributes, short, split_batch)
from .metrics import MemberLogging, epoch_ends_here, last_training_step, levels, should_update_logs
from .optimizers import fuse_configuration, monitor_of

__all__ = ["WideLightningModule", "load_member"]


# ------------------------------------------------------------------------------------------------
# The fused module
# ------------------------------------------------------------------------------------------------
class WideLightningModule(MemberLogging, pl.LightningModule):
    """N members (instances of one ``LightningModule`` class) trained as ONE ``LightningModule``.

    Args:
        members: the N modules, each with its own initial weights and hyperparameters
            (``Regressor(lr=lr)`` per learning rate, ``Regressor()`` under N seeds...). They
            must share the architecture; hyperparameters may differ where only
            ``configure_optimizers`` reads them (a step that reads one that differs is refused).
        sample_batch: one batch as the training dataloader yields it (the structure is fixed;
            the batch size may change). Tensors in it are inputs; other leaves are constants.
        monitor, mode: the per-member metric (as the members log it in ``validation_step``) and
            ``"min"``/``"max"``: what ranks the members (``best_member``).
        config: the :class:`~wide_compiler.WideConfig` of the fused model (default
            ``WideConfig.fast().replace(defer=True)``: a fit compiles the fused steps only when
            its length earns the capture back; until then each member runs its own steps on its
            slices of the fused weights, exactly).
        skip_member_hooks: the members' own batch/epoch/fit hooks (``on_train_batch_end``...) are
            not run by the fused run, so members that override one are refused, unless this is
            True (for hooks that only report): then a warning names them.

    Every batch is given to all members (``x.expand(N, ...)``: no copy). ``training_step`` returns
    the sum of the N member losses, so member ``i``'s gradient is exactly its own. Lightning's
    ``gradient_clip_val`` clips each member's gradient norm separately
    (:func:`wide_compiler.optim.clip_grad_norm_`). The fused steps are captured once: a step that
    computes with ``batch_idx``, ``self.global_step`` or ``self.current_epoch`` is refused. The
    members' own hooks other than the steps and ``configure_optimizers`` are not run (refused
    unless ``skip_member_hooks=True``; hooks that shape the optimization are always refused). ``test_step``/``predict_step``
    run member by member (:meth:`member`), logged as ``member_<i>/<name>``.

    Attributes:
        member_metrics: ``{name: tensor [N]}``, the last validation epoch's per-member values.
        member_stopped: bool buffer ``[N]``, the members stopped by :class:`MemberEarlyStopping`.
    """

    def __init__(self, members: Sequence[pl.LightningModule], sample_batch: Any, *,
                 monitor: str = "val_loss", mode: str = "min", config: WideConfig | None = None,
                 skip_member_hooks: bool = False) -> None:
        super().__init__()
        import wide_compiler as wc

        members = list(members)
        check_members(members, skip_member_hooks)
        if mode not in ("min", "max"):
            raise ValueError(f"WideLightningModule: mode must be 'min' or 'max', got {mode!r}")
        self.n = len(members)
        self.monitor, self.mode = monitor, mode
        self.member_metrics: dict[str, torch.Tensor] = {}
        object.__setattr__(self, "_members", members)  # not submodules: the wide model holds the weights
        tensors, spec, constants = split_batch(sample_batch)
        if not tensors:
            raise TypeError(f"WideLightningModule: sample_batch has no tensor ({short(sample_batch)})")
        self._n_tensors, self._constants = len(tensors), constants
        self._has_validation_step = is_overridden("validation_step", members[0], pl.LightningModule)
        self._train_options, self._val_options, reads = probe_steps(members, sample_batch)
        self._val_step_logged = any(levels(o, training=False)[0] for o in self._val_options.values())
        # Hyperparameters the steps do not read (checked) may differ: the members are compiled
        # with member 0's values of them, then given their own back.
        shadow = shadowed_attributes(members, reads)
        mismatch = None
        try:
            for i, attrs in shadow.items():
                for k in attrs:
                    members[i].__dict__[k] = members[0].__dict__[k]
            layout = BatchLayout(spec, constants)
            steps = [Steps(m, layout) for m in members]
            for s in steps:
                s.train(True)
            self.wide = wc.compile(steps, tuple(tensors), config=config or WideConfig.fast().replace(defer=True))
        except ArchitectureMismatchError as e:
            mismatch = e
        finally:
            for i, attrs in shadow.items():
                members[i].__dict__.update(attrs)
        if mismatch is not None:
            i = member_of(mismatch)
            raise ArchitectureMismatchError(
                f"WideLightningModule: member {i}'s configuration changes the architecture "
                f"({config_difference(members, i)}): {mismatch}. The members of one fused run must "
                "share the architecture; fuse members that differ in it in separate runs") from mismatch
        self.register_buffer("member_stopped", torch.zeros(self.n, dtype=torch.bool))
        self._val_sums: dict[str, torch.Tensor] = {}
        self._train_sums: dict[str, torch.Tensor] = {}
        self._val_count = self._train_count = 0
        self._train_epoch_logged = False
        self._frozen: list | None = None
        self._plateau_monitors: dict[int, str] = {}

    # -- members ------------------------------------------------------------------------------
    @property
    def members(self) -> list[pl.LightningModule]:
        """The N member modules as given (their weights are the initial ones: see :meth:`member`)."""
        return list(self._members)

    def member(self, i: int) -> pl.LightningModule:
        """Member ``i`` as an ordinary instance of the members' class: a copy of the module given
        as member ``i`` (its hyperparameters) with member ``i``'s current weights and buffers."""
        i = self.wide._check_member_index(i)
        m = copy.deepcopy(self._members[i])
        sd = self.wide.member_state_dict(i)
        m.load_state_dict({k[3:]: v for k, v in sd.items() if k.startswith("lm.")})
        return m

    @property
    def best_member_index(self) -> int:
        """The member with the best last validation value of ``monitor`` (NaN is the worst)."""
        values = self.member_metrics.get(self.monitor)
        if values is None:
            have = sorted(self.member_metrics) or "none yet"
            raise RuntimeError(f"WideLightningModule: no per-member {self.monitor!r} yet (logged: "
                               f"{have}); run a validation epoch first, or set monitor=")
        v = values.detach().to("cpu", torch.float64)
        key = torch.where(torch.isnan(v), torch.full_like(v, math.inf), v if self.mode == "min" else -v)
        return int(key.argmin())

    def best_member(self) -> pl.LightningModule:
        """:meth:`member` of :attr:`best_member_index`."""
        return self.member(self.best_member_index)

    # -- the fused steps ----------------------------------------------------------------------
    def _inputs(self, batch: Any) -> list[torch.Tensor]:
        tensors, spec, constants = split_batch(batch)
        if len(tensors) != self._n_tensors or [v for _, v in constants] != [v for _, v in self._constants]:
            raise ValueError(f"WideLightningModule: the batch has {len(tensors)} tensors and the "
                             f"constants {short([v for _, v in constants])}; sample_batch had "
                             f"{self._n_tensors} tensors and {short([v for _, v in self._constants])}: "
                             "the fused steps were captured for that structure")
        return [t.expand(self.n, *t.shape) for t in tensors]

    def forward(self, batch: Any) -> dict[str, torch.Tensor]:
        """The fused step on ``batch``: ``{"loss": [N], "log/<name>": [N], ...}`` (train mode:
        ``training_step``; eval mode: ``validation_step``)."""
        return self.wide(*self._inputs(batch))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        out = self(batch)
        losses = out["loss"]
        if losses.shape != (self.n,):
            raise RuntimeError(f"WideLightningModule: expected {self.n} per-member losses, got a "
                               f"tensor of shape {list(losses.shape)}")
        if self._train_options:
            bs = extract_batch_size(batch)
            self._accumulate(self._train_sums, self._train_options, out, bs, training=True)
            self._train_count += bs
            if should_update_logs(self.trainer) or last_training_step(self.trainer):
                self._log_members(self._train_options, out, training=True, phase="step", batch_size=bs)
        return losses.sum()

    def test_step(self, batch: Any, batch_idx: int, *args: Any) -> None:
        self._member_by_member("test_step", batch, batch_idx, *args)

    def predict_step(self, batch: Any, batch_idx: int, *args: Any) -> list:
        return [m.predict_step(batch, batch_idx, *args) for m in self._eval_members()]

    def _eval_members(self) -> list[pl.LightningModule]:
        cache = getattr(self, "_eval_cache", None)
        if cache is None:
            cache = [self.member(i).to(self.device).eval() for i in range(self.n)]
            object.__setattr__(self, "_eval_cache", cache)
        return cache

    def on_test_epoch_start(self) -> None:
        object.__setattr__(self, "_eval_cache", None)

    def on_predict_epoch_start(self) -> None:
        object.__setattr__(self, "_eval_cache", None)

    def _member_by_member(self, step: str, batch: Any, batch_idx: int, *args: Any) -> None:
        for i, m in enumerate(self._eval_members()):
            rec = Recorder()
            m.__dict__["log"], m.__dict__["log_dict"] = rec.log, rec.log_dict
            try:
                getattr(m, step)(batch, batch_idx, *args)
            finally:
                del m.__dict__["log"], m.__dict__["log_dict"]
            for name, v in rec.values.items():
                self.log(f"member_{i}/{name}", v, **{k: o for k, o in rec.options[name].items()
                                                     if k != "prog_bar"})

    # -- Trainer checks ------------------------------------------------------------------------
    def setup(self, stage: str) -> None:
        trainer = self.trainer
        precision = str(getattr(trainer, "precision", "32-true"))
        if getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise ValueError(
                f"WideLightningModule: lightning.Trainer(precision={precision!r}) scales the gradients "
                "of all members with ONE GradScaler (one member's overflow would skip every member's "
                "step); it cannot be per member. Use '32-true', '64-true', 'bf16-mixed' or 'bf16-true'")
        strategy = type(trainer.strategy).__name__
        if strategy not in ("SingleDeviceStrategy", "DDPStrategy"):
            raise ValueError(
                f"WideLightningModule: lightning.Trainer(strategy=...) gave {strategy}; the fused "
                "members run under a single device or DDP (the data axis) only")

    def on_fit_start(self) -> None:
        """The fit's length for the fused model (``WideConfig(defer=True)``, the default here:
        Note [Running the members until compiling pays] in model_deferred.py): its training steps
        (Lightning's ``estimated_stepping_batches`` times the accumulated batches), and as many
        validation steps at most. A fit too short to earn a capture back never captures."""
        steps = self.trainer.estimated_stepping_batches
        calls = (int(steps) * max(int(self.trainer.accumulate_grad_batches), 1)
                 if isinstance(steps, (int, float)) and math.isfinite(steps) else None)
        self.wide.expect_calls(train_calls=calls, eval_calls=calls)

    # -- optimization --------------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        """The members' own ``configure_optimizers`` fused: one ``wc.optim`` optimizer whose
        hyperparameters are the N members' values, and one ``wc.optim.lr_scheduler`` scheduler
        per scheduler of the members (same Lightning config: interval, frequency, monitor)."""
        return fuse_configuration(self)

    def configure_gradient_clipping(self, optimizer: Any, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Lightning's ``gradient_clip_val``, per member: each member's gradient norm (or values)
        clipped on its own, as when that member is trained alone."""
        if gradient_clip_val is None or gradient_clip_val == 0:
            return
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if gradient_clip_algorithm in (None, "norm"):
            wc_optim.clip_grad_norm_(params, gradient_clip_val)
        elif gradient_clip_algorithm == "value":
            wc_optim.clip_grad_value_(params, gradient_clip_val)
        else:
            raise ValueError(f"WideLightningModule: gradient_clip_algorithm={gradient_clip_algorithm!r}")

    def lr_scheduler_step(self, scheduler: Any, metric: Any) -> None:
        if isinstance(scheduler, wc_optim.lr_scheduler.ReduceLROnPlateau):
            key = self._plateau_monitors.get(id(scheduler)) or monitor_of(self.trainer, scheduler)
            values = self.member_metrics.get(key)
            if values is None:
                raise RuntimeError(f"WideLightningModule: ReduceLROnPlateau monitors {key!r}, which "
                                   f"no member has logged in validation (per-member metrics: "
                                   f"{sorted(self.member_metrics)})")
            scheduler.step(values)
        elif metric is None:
            scheduler.step()
        else:
            scheduler.step(metric)

    # -- stopped members: frozen exactly --------------------------------------------------------
    def stop_member(self, i: int) -> None:
        """Freeze member ``i``: from the next batch on, its parameters, buffers and optimizer
        state no longer change (the others train on)."""
        self.member_stopped[self.wide._check_member_index(i)] = True

    def _member_tensors(self) -> list[torch.Tensor]:
        ts = list(self.wide.parameters()) + [b for b in self.wide.buffers() if b.dim() and b.shape[0] == self.n]
        opt = self._wide_optimizer()
        if opt is not None:
            ts += [t for _, t in opt._member_tensors()]
        return ts

    def _wide_optimizer(self) -> Any:
        try:
            opts = self.trainer.optimizers
        except RuntimeError:
            return None
        return next((o for o in opts if isinstance(o, wc_optim.WideOptimizer)), None)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._frozen = None
        idx = self.member_stopped.nonzero().flatten()
        if len(idx):
            self._frozen = [(t, idx, t[idx].detach().clone()) for t in self._member_tensors()]

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._frozen:
            with torch.no_grad():
                for t, idx, saved in self._frozen:
                    t[idx] = saved
        self._frozen = None
        if self._train_sums and not self._train_epoch_logged and epoch_ends_here(self.trainer):
            self._log_train_epoch()

    # -- checkpoints ---------------------------------------------------------------------------
    # The per-member metrics travel in the state_dict (extra state): checkpoints, and the weights
    # that ddp_spawn sends back to the main process, carry them.
    def get_extra_state(self) -> dict[str, Any]:
        return {"member_metrics": {k: v.tolist() for k, v in self.member_metrics.items()}}

    def set_extra_state(self, state: Any) -> None:
        metrics = state.get("member_metrics", {}) if isinstance(state, Mapping) else {}
        for k, v in metrics.items():
            if len(v) != self.n:
                raise ValueError(f"WideLightningModule: saved per-member {k!r} has {len(v)} values; "
                                 f"this module has {self.n} members")
        self.member_metrics = {k: torch.tensor(v, dtype=torch.float64) for k, v in metrics.items()}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["wide_compiler"] = {
            "n": self.n, "monitor": self.monitor, "mode": self.mode,
            "member_hparams": [{k: v for k, v in hparams(m).items() if plain(v)} for m in self._members],
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state = checkpoint.get("wide_compiler")
        if state is not None and state["n"] != self.n:
            raise ValueError(f"WideLightningModule: the checkpoint holds {state['n']} members, this "
                             f"module {self.n}")


def load_member(checkpoint: Any, i: int, module: nn.Module) -> nn.Module:
    """Member ``i`` of a :class:`WideLightningModule` checkpoint (a Lightning ``.ckpt`` path or the
    loaded dict) loaded into ``module``, an ordinary instance of the members' class; no fused
    model is built. Returns ``module``.

    Example:
        >>> import torch
        >>> ckpt = {"state_dict": {"wide.lm.weight": torch.arange(6.).reshape(3, 2), "member_stopped": torch.zeros(3)}}
        >>> m = torch.nn.Module(); m.weight = torch.nn.Parameter(torch.zeros(2))
        >>> load_member(ckpt, 1, m).weight.tolist()
        [2.0, 3.0]
    """
    if not isinstance(checkpoint, Mapping):
        checkpoint = torch.load(checkpoint, map_location="cpu", weights_only=True)
    sd = checkpoint.get("state_dict", checkpoint)
    prefix = "wide.lm."
    stacked = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    if not stacked:
        raise ValueError(f"{NAME}.load_member: no '{prefix}*' keys: not a WideLightningModule checkpoint")
    n = next(iter(stacked.values())).shape[0]
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
        raise IndexError(f"{NAME}.load_member: member {i!r} out of range for a checkpoint of {n} members")
    module.load_state_dict({k: v[i] for k, v in stacked.items()})
    return module
