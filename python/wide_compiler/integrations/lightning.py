"""Train N fused copies of a ``LightningModule`` with an unchanged ``lightning.Trainer``.

:class:`WideLightningModule` takes N instances of YOUR ``LightningModule`` (one per member: its
own initial weights and its own hyperparameters) and fuses them into ONE ``LightningModule``
that any ``lightning.Trainer`` trains: one forward, one backward and one fused optimizer step per
batch for all N members, and member ``i`` ends up exactly where ``Trainer.fit`` takes that module
trained alone on the same batches.

* **Your steps run fused.** Each member's ``training_step`` (train mode) and ``validation_step``
  (eval mode) are captured and widened (:func:`wide_compiler.compile`): the loss becomes N
  per-member losses, and every tensor the step logs with ``self.log`` becomes N values.
* **Per-member hyperparameters reach the optimizer.** ``configure_optimizers`` calls each
  member's own ``configure_optimizers`` and fuses the N ``torch.optim`` optimizers (SGD, Adam,
  AdamW, RMSprop, Adagrad) and schedulers (StepLR, MultiStepLR, ExponentialLR,
  CosineAnnealingLR, LinearLR, ReduceLROnPlateau) into one :mod:`wide_compiler.optim` optimizer
  and scheduler with one value per member. Or override ``configure_optimizers`` in a subclass and
  return ``wc.optim`` objects yourself.
* **Per-member metrics.** Every key Lightning makes of a value a member logs (``train_loss``;
  ``train_loss_step`` and ``train_loss_epoch`` when logged ``on_step`` and ``on_epoch``) is
  ``member_<i>/`` + that key, in the callback, logger and progress-bar metrics, so a callback
  can monitor ``member_0/train_loss``; at the end of each validation epoch ``val_loss`` itself
  is the best member's value (``monitor``/``mode``) and ``best_member`` its index, so
  Lightning's own ``ModelCheckpoint``/``EarlyStopping`` act on the best member.
* **Per-member early stopping** (:class:`MemberEarlyStopping`): a stopped member's parameters,
  buffers and optimizer state stop changing (exactly: no moment drift, no weight decay) while
  the others go on; the run ends when every member has stopped (or at ``max_epochs``).
* **Checkpoints** are Lightning's own: the wide parameters, the ``wc.optim`` optimizer and
  scheduler states, which members stopped, the last per-member metrics and the early-stopping
  state; ``trainer.fit(wide, ckpt_path=...)`` continues every member where it was.
  :func:`load_member` reads one member from a checkpoint into an ordinary module.
* **Export**: :meth:`WideLightningModule.member` / :meth:`~WideLightningModule.best_member` give
  an ordinary instance of your class (its own hyperparameters) with that member's weights.
* **DDP** (``strategy="ddp"``, also ``"ddp_spawn"``): the data axis, as for any module; each
  member's gradient is the mean over the processes, as for that member trained alone under DDP.

Step values of training metrics are logged on the Trainer's logging steps
(``log_every_n_steps``) and the last step of each epoch, epoch values once per epoch (Note
[Per-member metric keys]): Lightning's ``self.log`` costs about a millisecond per key, and a
fused step has N keys per name. Random ops (dropout)
draw an independent mask per member, not the numbers that member's own run would draw: such
members train as well, but not bit for bit like their separate runs.

What cannot be per member is refused, naming the key and the member: members whose
hyperparameters change the architecture, a ``training_step`` that returns something other than
a loss, a step that reads a hyperparameter that differs between members, optimizer flags that
differ, and ``Trainer`` settings that would be shared silently (``precision="16-mixed"``: ONE
GradScaler for all members; a sharded strategy; a ``Trainer`` argument among a member's
hyperparameters with different values).

Lightning is optional: ``pip install "wide_compiler[lightning]"`` (tested with lightning 2.6.6);
``import wide_compiler`` never imports this module.

Example:
    >>> import torch, torch.nn.functional as F, lightning as L
    >>> from wide_compiler.integrations.lightning import WideLightningModule
    >>> class Regressor(L.LightningModule):
    ...     def __init__(self, lr=1e-2):
    ...         super().__init__()
    ...         self.save_hyperparameters()
    ...         self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    ...     def forward(self, x):
    ...         return self.net(x)
    ...     def training_step(self, batch, batch_idx):
    ...         x, y = batch
    ...         loss = F.mse_loss(self(x), y)
    ...         self.log("train_loss", loss)
    ...         return loss
    ...     def configure_optimizers(self):
    ...         return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
    >>> x, y = torch.randn(64, 4), torch.randn(64, 1)
    >>> wide = WideLightningModule([Regressor(lr=lr) for lr in (1e-3, 1e-2, 1e-1)], (x[:16], y[:16]))
    >>> data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    >>> trainer = L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False,
    ...                     enable_progress_bar=False, enable_model_summary=False)
    >>> trainer.fit(wide, data)
    >>> type(wide.member(2)).__name__, wide.member(2).hparams.lr
    ('Regressor', 0.1)
"""

from __future__ import annotations

import copy
import inspect
import logging
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

INSTALL_HINT = ('wide_compiler.integrations.lightning needs Lightning: pip install "lightning==2.6.6" '
                '(or pip install "wide_compiler[lightning]")')

try:
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.data import extract_batch_size
    from lightning.pytorch.utilities.model_helpers import is_overridden
except ImportError as e:  # pragma: no cover - exercised only without lightning
    raise ImportError(INSTALL_HINT) from e

from .. import optim as wc_optim
from ..config import WideConfig
from ..errors import ArchitectureMismatchError
from ._common import check_one_class
from ._optimizers import fuse_optimizers

__all__ = ["MemberEarlyStopping", "ModelWithLoss", "WideLightningModule", "load_member"]

log = logging.getLogger(__name__)

_NAME = "wide_compiler.integrations.lightning"

# Member hooks that shape the optimization: a fused run cannot run them per member.
_REFUSED_HOOKS = ("optimizer_step", "optimizer_zero_grad", "configure_gradient_clipping", "backward",
                  "on_before_backward", "on_after_backward", "on_before_optimizer_step",
                  "lr_scheduler_step", "manual_backward")
# Member hooks that the fused run does not call (a warning names them).
_SKIPPED_HOOKS = ("on_train_batch_start", "on_train_batch_end", "on_train_epoch_start",
                  "on_train_epoch_end", "on_validation_epoch_start", "on_validation_epoch_end",
                  "on_validation_batch_start", "on_validation_batch_end", "on_fit_start", "on_fit_end",
                  "on_save_checkpoint", "on_load_checkpoint", "setup", "teardown")

# nn.Module / LightningModule bookkeeping in a member's __dict__: never a hyperparameter.
_INTERNAL_ATTRS = {"training", "_parameters", "_buffers", "_non_persistent_buffers_set", "_modules",
                   "_backward_pre_hooks", "_backward_hooks", "_is_full_backward_hook",
                   "_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called",
                   "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_state_dict_hooks",
                   "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
                   "_load_state_dict_post_hooks", "_trainer", "_fabric", "_current_fx_name",
                   "_param_requires_grad_state", "_metric_attributes", "_compiler_ctx",
                   "_fabric_optimizers", "_device_mesh", "_log_hyperparams", "_hparams_name"}


def _short(v: Any, limit: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------------------
# One member's steps as a module: what wide_compiler.compile fuses
# ------------------------------------------------------------------------------------------------
class _Recorder:
    """Stands in for ``LightningModule.log`` / ``log_dict`` while a step runs: keeps every
    logged tensor (by name) and the logging options of each name."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.options: dict[str, dict[str, Any]] = {}

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError(f"{_NAME}: self.log({name!r}, ...) with positional options; pass them "
                            "as keywords (prog_bar=..., on_step=...)")
        self.values[name] = value
        self.options[name] = kwargs

    def log_dict(self, dictionary: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        for name, value in dictionary.items():
            self.log(name, value, *args, **kwargs)


class _BatchLayout:
    """The structure and constants of a batch; immutable, so copies share it (a deepcopy of a
    TreeSpec warns in torch 2.13)."""

    def __init__(self, spec: Any, constants: list) -> None:
        self.spec, self.constants = spec, tuple(constants)

    def __deepcopy__(self, memo: dict) -> _BatchLayout:
        return self


class _Steps(nn.Module):
    """Member ``lm``'s ``training_step`` (train mode) or ``validation_step`` (eval mode) on the
    tensors of a batch: returns ``{"loss": loss, "log/<name>": value, ...}``."""

    def __init__(self, lm: pl.LightningModule, layout: _BatchLayout) -> None:
        super().__init__()
        self.lm = lm
        self._layout = layout

    def forward(self, *tensors: torch.Tensor) -> dict[str, torch.Tensor]:
        batch = _rebuild(self._layout.spec, self._layout.constants, tensors)
        rec = _Recorder()
        lm = self.lm
        lm.__dict__["log"], lm.__dict__["log_dict"] = rec.log, rec.log_dict
        try:
            out = lm.training_step(batch, 0) if self.training else lm.validation_step(batch, 0)
        finally:
            del lm.__dict__["log"], lm.__dict__["log_dict"]
        result: dict[str, torch.Tensor] = {}
        if self.training:
            result["loss"] = out["loss"] if isinstance(out, Mapping) else out
        for name, value in rec.values.items():
            if isinstance(value, torch.Tensor):
                result["log/" + name] = value.detach().reshape(())
        if not result:  # a validation_step that logs no tensor: keep one output
            result["log/"] = torch.zeros(())
        return result


def _split_batch(batch: Any) -> tuple[list[torch.Tensor], Any, list]:
    """The tensors of a batch, its structure, and its non-tensor leaves (by position)."""
    leaves, spec = tree_flatten(batch)
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    constants = [(k, x) for k, x in enumerate(leaves) if not isinstance(x, torch.Tensor)]
    return tensors, spec, constants


def _rebuild(spec: Any, constants: list, tensors: Sequence[torch.Tensor]) -> Any:
    leaves: list[Any] = []
    it = iter(tensors)
    const = dict(constants)
    for k in range(spec.num_leaves):
        leaves.append(const[k] if k in const else next(it))
    return tree_unflatten(leaves, spec)


# ------------------------------------------------------------------------------------------------
# What a member's step reads: hyperparameters that differ between members must not be read
# ------------------------------------------------------------------------------------------------
class _ReadRecorder:
    """While active, records the attributes read on ``lm`` itself and the keys read from its
    ``hparams`` (by swapping in a recording subclass of its class / of its ``_hparams``)."""

    def __init__(self, lm: pl.LightningModule) -> None:
        self.lm, self.attrs, self.hparams = lm, set(), set()

    def __enter__(self) -> _ReadRecorder:
        lm, attrs, keys = self.lm, self.attrs, self.hparams
        cls = type(lm)

        def getattribute(obj: Any, name: str) -> Any:
            if obj is lm:
                attrs.add(name)
            return object.__getattribute__(obj, name)

        self._cls = cls
        lm.__class__ = type(cls.__name__, (cls,), {"__getattribute__": getattribute})
        hp = lm.__dict__.get("_hparams")
        self._hp = hp
        if hp is not None:
            class _HP(type(hp)):  # type: ignore[misc]
                def __getitem__(self, k: Any) -> Any:
                    keys.add(k)
                    return super().__getitem__(k)

                def __getattr__(self, k: str) -> Any:
                    keys.add(k)
                    return super().__getattr__(k)

                def get(self, k: Any, default: Any = None) -> Any:
                    keys.add(k)
                    return super().get(k, default)
            lm.__dict__["_hparams"] = _HP(hp)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.lm.__class__ = self._cls
        if self._hp is not None:
            self.lm.__dict__["_hparams"] = self._hp


def _hparams(lm: pl.LightningModule) -> dict[str, Any]:
    hp = lm.__dict__.get("_hparams")
    return dict(hp) if hp is not None else {}


def _differs(a: Any, b: Any) -> bool:
    try:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                        and a.shape == b.shape and bool((a == b).all()))
        return bool(a != b)
    except Exception:  # objects that cannot be compared: treat as different
        return a is not b


def _config_difference(members: Sequence[pl.LightningModule], i: int) -> str:
    """Member ``i``'s hyperparameters that differ from member 0's, in words."""
    h0, hi = _hparams(members[0]), _hparams(members[i])
    diff = [f"{k}={_short(hi.get(k))} (member 0: {_short(h0.get(k))})"
            for k in sorted(set(h0) | set(hi), key=str) if _differs(h0.get(k), hi.get(k))]
    return ", ".join(diff) if diff else "no hyperparameter differs (compare how the members were built)"


# ------------------------------------------------------------------------------------------------
# The fused module
# ------------------------------------------------------------------------------------------------
class WideLightningModule(pl.LightningModule):
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
            ``WideConfig.fast()``).

    Every batch is given to all members (``x.expand(N, ...)``: no copy). ``training_step`` returns
    the sum of the N member losses, so member ``i``'s gradient is exactly its own. Lightning's
    ``gradient_clip_val`` clips each member's gradient norm separately
    (:func:`wide_compiler.optim.clip_grad_norm_`). ``batch_idx`` is 0 inside the fused steps; the
    members' own hooks other than the steps and ``configure_optimizers`` are not run (a warning
    names them; hooks that shape the optimization are refused). ``test_step``/``predict_step``
    run member by member (:meth:`member`), logged as ``member_<i>/<name>``.

    Attributes:
        member_metrics: ``{name: tensor [N]}``, the last validation epoch's per-member values.
        member_stopped: bool buffer ``[N]``, the members stopped by :class:`MemberEarlyStopping`.
    """

    def __init__(self, members: Sequence[pl.LightningModule], sample_batch: Any, *,
                 monitor: str = "val_loss", mode: str = "min", config: WideConfig | None = None) -> None:
        super().__init__()
        import wide_compiler as wc

        members = list(members)
        _check_members(members)
        if mode not in ("min", "max"):
            raise ValueError(f"WideLightningModule: mode must be 'min' or 'max', got {mode!r}")
        self.n = len(members)
        self.monitor, self.mode = monitor, mode
        self.member_metrics: dict[str, torch.Tensor] = {}
        object.__setattr__(self, "_members", members)  # not submodules: the wide model holds the weights
        tensors, spec, constants = _split_batch(sample_batch)
        if not tensors:
            raise TypeError(f"WideLightningModule: sample_batch has no tensor ({_short(sample_batch)})")
        self._n_tensors, self._constants = len(tensors), constants
        self._has_validation_step = is_overridden("validation_step", members[0], pl.LightningModule)
        self._train_options, self._val_options = self._probe(members, sample_batch)
        self._val_step_logged = any(_levels(o, training=False)[0] for o in self._val_options.values())
        # Hyperparameters the steps do not read (checked) may differ: the members are compiled
        # with member 0's values of them, then given their own back.
        shadow = self._shadowed_attributes(members)
        mismatch = None
        try:
            for i, attrs in shadow.items():
                for k in attrs:
                    members[i].__dict__[k] = members[0].__dict__[k]
            layout = _BatchLayout(spec, constants)
            steps = [_Steps(m, layout) for m in members]
            for s in steps:
                s.train(True)
            self.wide = wc.compile(steps, tuple(tensors), config=config or WideConfig.fast())
        except ArchitectureMismatchError as e:
            mismatch = e
        finally:
            for i, attrs in shadow.items():
                members[i].__dict__.update(attrs)
        if mismatch is not None:
            i = _member_of(mismatch)
            raise ArchitectureMismatchError(
                f"WideLightningModule: member {i}'s configuration changes the architecture "
                f"({_config_difference(members, i)}): {mismatch}. The members of one fused run must "
                "share the architecture; fuse members that differ in it in separate runs") from mismatch
        self.register_buffer("member_stopped", torch.zeros(self.n, dtype=torch.bool))
        self._val_sums: dict[str, torch.Tensor] = {}
        self._train_sums: dict[str, torch.Tensor] = {}
        self._val_count = self._train_count = 0
        self._train_epoch_logged = False
        self._frozen: list | None = None
        self._plateau_monitors: dict[int, str] = {}

    # -- construction checks ------------------------------------------------------------------
    def _probe(self, members: list, sample_batch: Any) -> tuple[dict, dict]:
        """Run member 0's steps once, eagerly, on a copy: check what ``training_step`` returns,
        record the logged names and options, and which attributes / hyperparameters the steps
        read."""
        lm = copy.deepcopy(members[0])
        rec = _Recorder()
        lm.__dict__["log"], lm.__dict__["log_dict"] = rec.log, rec.log_dict
        reads = _ReadRecorder(lm)
        name = type(lm).__name__
        with torch.no_grad(), reads:
            lm.train()
            out = lm.training_step(sample_batch, 0)
            loss = out.get("loss") if isinstance(out, Mapping) else out
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
                got = (f"a tensor of shape {list(loss.shape)} ({loss.dtype})" if isinstance(loss, torch.Tensor)
                       else f"a dict without a tensor 'loss' (keys {sorted(out)})" if isinstance(out, Mapping)
                       else f"{type(out).__name__} {_short(out)}")
                raise TypeError(
                    f"WideLightningModule: {name}.training_step returned {got} for member 0; expected "
                    "the member's loss: a scalar floating-point tensor (or a dict with one under 'loss'). "
                    "The fused step turns it into N per-member losses; skipping a batch (None) or "
                    "returning outputs cannot be done per member")
            train_opts = dict(rec.options)
            train_logged = dict(rec.values)
            rec.values.clear(), rec.options.clear()
            val_opts: dict[str, dict] = {}
            if is_overridden("validation_step", lm, pl.LightningModule):
                lm.eval()
                lm.validation_step(sample_batch, 0)
                val_opts = dict(rec.options)
                val_logged = dict(rec.values)
            else:
                val_logged = {}
        for where, logged in (("training_step", train_logged), ("validation_step", val_logged)):
            for k, v in logged.items():
                if not isinstance(v, torch.Tensor):
                    warnings.warn(f"WideLightningModule: {name}.{where} logs {k!r} as a "
                                  f"{type(v).__name__}, not a tensor: it is not logged per member in "
                                  "the fused run (log a tensor)", stacklevel=3)
                elif v.numel() != 1:
                    raise ValueError(f"WideLightningModule: {name}.{where} logs {k!r} with shape "
                                     f"{list(v.shape)}; expected one number per member")
        for opts in (train_opts, val_opts):
            for k, o in opts.items():
                fx = o.get("reduce_fx", "mean")
                if fx not in ("mean", "sum", torch.mean, torch.sum):
                    raise ValueError(f"WideLightningModule: {name} logs {k!r} with reduce_fx={fx!r}; "
                                     "the fused run aggregates per member with 'mean' or 'sum' only")
        self._reads = (reads.attrs, reads.hparams)
        return ({k: o for k, o in train_opts.items() if isinstance(train_logged[k], torch.Tensor)},
                {k: o for k, o in val_opts.items() if isinstance(val_logged[k], torch.Tensor)})

    def _shadowed_attributes(self, members: list) -> dict[int, dict[str, Any]]:
        """Member attributes (on the LightningModule itself) that differ from member 0's: their
        original values, by member. The steps must not read them (checked here): the fused
        graph is member 0's program, so a value read there would be member 0's for all."""
        attrs_read, hparams_read = self._reads
        name = type(members[0]).__name__
        out: dict[int, dict[str, Any]] = {}
        m0 = members[0].__dict__
        h0 = _hparams(members[0])
        for i, m in enumerate(members[1:], start=1):
            hi = _hparams(m)
            for k in sorted(set(h0) | set(hi), key=str):
                if k in hparams_read and _differs(h0.get(k), hi.get(k)):
                    raise ValueError(
                        f"WideLightningModule: member {i}: {name}'s training/validation step reads "
                        f"hparams[{k!r}], which is {_short(hi.get(k))} for member {i} and "
                        f"{_short(h0.get(k))} for member 0; the fused step is one program for all "
                        "members. Per-member hyperparameters may only be read by "
                        "configure_optimizers (or fuse members that differ in it in separate runs)")
            diff = {}
            for k, v in m.__dict__.items():
                if k in _INTERNAL_ATTRS or isinstance(v, (nn.Module, torch.Tensor)) or k not in m0:
                    continue
                if _differs(v, m0[k]):
                    if k in attrs_read and k != "_hparams":
                        raise ValueError(
                            f"WideLightningModule: member {i}: {name}'s training/validation step "
                            f"reads self.{k}, which is {_short(v)} for member {i} and {_short(m0[k])} "
                            "for member 0; the fused step is one program for all members. "
                            "Per-member hyperparameters may only be read by configure_optimizers")
                    diff[k] = v
            if diff:
                out[i] = diff
        return out

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
        tensors, spec, constants = _split_batch(batch)
        if len(tensors) != self._n_tensors or [v for _, v in constants] != [v for _, v in self._constants]:
            raise ValueError(f"WideLightningModule: the batch has {len(tensors)} tensors and the "
                             f"constants {_short([v for _, v in constants])}; sample_batch had "
                             f"{self._n_tensors} tensors and {_short([v for _, v in self._constants])}: "
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
            if _should_update_logs(self.trainer) or _last_training_step(self.trainer):
                self._log_members(self._train_options, out, training=True, phase="step", batch_size=bs)
        return losses.sum()

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
            if training and not _levels(opts, training=True)[1]:
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
        if not self._train_epoch_logged:     # the epoch ended where _epoch_ends_here could not tell
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
            rec = _Recorder()
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

    # -- optimization --------------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        """The members' own ``configure_optimizers`` fused: one ``wc.optim`` optimizer whose
        hyperparameters are the N members' values, and one ``wc.optim.lr_scheduler`` scheduler
        per scheduler of the members (same Lightning config: interval, frequency, monitor)."""
        return _fuse_optimizers(self)

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
            key = self._plateau_monitors.get(id(scheduler)) or _monitor_of(self.trainer, scheduler)
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
        if self._train_sums and not self._train_epoch_logged and _epoch_ends_here(self.trainer):
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
            "member_hparams": [{k: v for k, v in _hparams(m).items() if _plain(v)} for m in self._members],
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
        raise ValueError(f"{_NAME}.load_member: no '{prefix}*' keys: not a WideLightningModule checkpoint")
    n = next(iter(stacked.values())).shape[0]
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
        raise IndexError(f"{_NAME}.load_member: member {i!r} out of range for a checkpoint of {n} members")
    module.load_state_dict({k: v[i] for k, v in stacked.items()})
    return module


def _should_update_logs(trainer: Any) -> bool:
    """Whether Lightning writes step-level metrics to the logger at this step."""
    try:
        return bool(trainer._logger_connector.should_update_logs)
    except AttributeError:  # another Lightning version: every step
        return True


def _last_training_step(trainer: Any) -> bool:
    """Whether this training step is the last of its epoch (or of the fit)."""
    try:
        loop = trainer.fit_loop.epoch_loop
        return bool(loop._num_ready_batches_reached()
                    or (loop.max_steps >= 0 and trainer.global_step + 1 >= loop.max_steps))
    except AttributeError:  # another Lightning version: every step is
        return True


def _epoch_ends_here(trainer: Any) -> bool:
    """Whether the training epoch ends after the batch that just ran (read after its optimizer
    step; False where that cannot be told: a callback's stop, another Lightning version)."""
    try:
        loop = trainer.fit_loop.epoch_loop
        return bool(loop._num_ready_batches_reached() or (loop.max_steps >= 0 and trainer.global_step >= loop.max_steps))
    except AttributeError:
        return False


def _levels(opts: Mapping[str, Any], *, training: bool) -> tuple[bool, bool]:
    """``(on_step, on_epoch)`` of a value logged with ``opts`` in ``training_step`` (training) or
    ``validation_step``, with Lightning's defaults for that hook."""
    on_step, on_epoch = opts.get("on_step"), opts.get("on_epoch")
    return (training if on_step is None else bool(on_step),
            (not training) if on_epoch is None else bool(on_epoch))


def _lightning_keys(name: str, opts: Mapping[str, Any], *, training: bool, phase: str) -> list[tuple[str, bool, bool]]:
    """``(key, logger, prog_bar)`` for each key Lightning makes of a value logged as ``name`` with
    ``opts``, at a step (``phase="step"``) or at the end of an epoch: Note [Per-member metric keys]."""
    on_step, on_epoch = _levels(opts, training=training)
    if not (on_step if phase == "step" else on_epoch):
        return []
    logger, prog_bar = bool(opts.get("logger", True)), bool(opts.get("prog_bar", False))
    if not (on_step and on_epoch):
        return [(name, logger, prog_bar)]
    keys = [(f"{name}_{phase}", logger, prog_bar)]
    if training or phase == "epoch":     # callbacks see `name` (validation: at the end of the epoch only)
        keys.append((name, False, False))
    return keys


def _plain(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def _member_of(e: Exception) -> int:
    import re
    m = re.search(r"member (\d+)", str(e))
    return int(m.group(1)) if m else 0


def _check_members(members: list) -> None:
    check_one_class(members, pl.LightningModule, "WideLightningModule", "a lightning.pytorch.LightningModule "
                    "(or wrap a model and a loss in ModelWithLoss)", mismatch=ArchitectureMismatchError)
    for i, m in enumerate(members):
        if not m.automatic_optimization:
            raise ValueError(f"WideLightningModule: member {i} ({type(m).__name__}) sets "
                             "automatic_optimization=False; the fused run uses Lightning's automatic "
                             "optimization (one fused optimizer step for all members)")
    m0 = members[0]
    name = type(m0).__name__
    if not is_overridden("training_step", m0, pl.LightningModule):
        raise TypeError(f"WideLightningModule: {name} has no training_step")
    refused = [h for h in _REFUSED_HOOKS if is_overridden(h, m0, pl.LightningModule)]
    if refused:
        raise ValueError(f"WideLightningModule: {name} overrides {', '.join(refused)}; the fused run "
                         "optimizes all members in one step and cannot run a member's own version "
                         "(per-member gradient clipping is built in: Trainer(gradient_clip_val=...))")
    skipped = [h for h in _SKIPPED_HOOKS if is_overridden(h, m0, pl.LightningModule)]
    if skipped:
        warnings.warn(f"WideLightningModule: {name} overrides {', '.join(skipped)}, which the fused "
                      "run does not call per member", stacklevel=3)
    trainer_args = set(inspect.signature(pl.Trainer.__init__).parameters) - {"self"}
    h0 = _hparams(m0)
    for i, m in enumerate(members[1:], start=1):
        hi = _hparams(m)
        for k in sorted(trainer_args & (set(h0) | set(hi))):
            if _differs(h0.get(k), hi.get(k)):
                raise ValueError(
                    f"WideLightningModule: member {i}: hyperparameter {k!r} is {_short(hi.get(k))}, "
                    f"member 0 has {_short(h0.get(k))}; {k!r} is a lightning.Trainer argument, ONE "
                    "value for the whole fused run (the Trainer's). Train members that differ in it "
                    "in separate fused runs")


# ------------------------------------------------------------------------------------------------
# configure_optimizers: N torch.optim configurations -> one wc.optim configuration
# ------------------------------------------------------------------------------------------------
def _monitor_of(trainer: Any, scheduler: Any) -> str | None:
    for c in trainer.lr_scheduler_configs:
        if c.scheduler is scheduler:
            return c.monitor
    return None


def _fuse_optimizers(wide_lm: WideLightningModule) -> Any:
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
    if cls is S.ReduceLROnPlateau:
        for i, s in enumerate(scheds):
            if len(set(s.min_lrs)) != 1:
                raise ValueError(f"WideLightningModule: member {i}'s ReduceLROnPlateau has one min_lr "
                                 "per param group; the fused one takes one per member")
        return W.ReduceLROnPlateau(optimizer, mode=_same_flag(scheds, "mode"), factor=each("factor"),
                                   patience=each("patience"), threshold=each("threshold"),
                                   threshold_mode=_same_flag(scheds, "threshold_mode"),
                                   cooldown=each("cooldown"), min_lr=[s.min_lrs[0] for s in scheds],
                                   eps=each("eps"))
    raise TypeError(f"WideLightningModule: the members' lr scheduler {cls.__name__} has no fused "
                    "per-member form here; supported: StepLR, MultiStepLR, ExponentialLR, "
                    "CosineAnnealingLR, LinearLR, ReduceLROnPlateau (or override configure_optimizers "
                    "in a WideLightningModule subclass and return wide_compiler.optim.lr_scheduler objects)")


# ------------------------------------------------------------------------------------------------
# Per-member early stopping
# ------------------------------------------------------------------------------------------------
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


# ------------------------------------------------------------------------------------------------
# A model and a loss as a LightningModule
# ------------------------------------------------------------------------------------------------
class ModelWithLoss(pl.LightningModule):
    """A plain model and a loss as a ``LightningModule`` (one member): ``batch = (x, y)``,
    ``training_step`` logs ``train_loss``, ``validation_step`` logs ``val_loss``, and
    ``configure_optimizers`` builds ``torch.optim.<optimizer>(lr=lr, **optimizer_kwargs)``.

    Example:
        >>> import torch, torch.nn.functional as F
        >>> m = ModelWithLoss(torch.nn.Linear(3, 1), F.mse_loss, optimizer="SGD", lr=0.1, momentum=0.9)
        >>> type(m.configure_optimizers()).__name__
        'SGD'
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[..., torch.Tensor], *,
                 optimizer: str = "Adam", lr: float = 1e-3, **optimizer_kwargs: Any) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["model", "loss_fn"])
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, x: Any) -> Any:
        return self.model(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = self.loss_fn(self.model(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", self.loss_fn(self.model(x), y))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = dict(self.hparams)
        name = hp.pop("optimizer")
        cls = getattr(torch.optim, name, None)
        if cls is None:
            raise ValueError(f"ModelWithLoss: torch.optim has no optimizer {name!r}")
        hp.update(hp.pop("optimizer_kwargs", {}))
        return cls(self.parameters(), **hp)
