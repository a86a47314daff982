"""One member's steps as a module (what :func:`wide_compiler.compile` fuses), and the checks of
the members handed to :class:`~wide_compiler.integrations.lightning.WideLightningModule`: one class,
hooks a fused run can honour, steps that return a loss and read no hyperparameter that differs
between members."""

from __future__ import annotations

import copy
import inspect
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ...errors import ArchitectureMismatchError
from .._common import check_one_class

__all__ = ["NAME", "BatchLayout", "Recorder", "Steps", "check_members", "config_difference", "hparams",
           "member_of", "plain", "probe_steps", "shadowed_attributes", "short", "split_batch"]

NAME = "wide_compiler.integrations.lightning"

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


def short(v: Any, limit: int = 60) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------------------
# One member's steps as a module: what wide_compiler.compile fuses
# ------------------------------------------------------------------------------------------------
class Recorder:
    """Stands in for ``LightningModule.log`` / ``log_dict`` while a step runs: keeps every
    logged tensor (by name) and the logging options of each name."""

    def __init__(self) -> None:
        self.values: dict[str, Any] = {}
        self.options: dict[str, dict[str, Any]] = {}

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise TypeError(f"{NAME}: self.log({name!r}, ...) with positional options; pass them "
                            "as keywords (prog_bar=..., on_step=...)")
        self.values[name] = value
        self.options[name] = kwargs

    def log_dict(self, dictionary: Mapping[str, Any], *args: Any, **kwargs: Any) -> None:
        for name, value in dictionary.items():
            self.log(name, value, *args, **kwargs)


class BatchLayout:
    """The structure and constants of a batch; immutable, so copies share it (a deepcopy of a
    TreeSpec warns in torch 2.13)."""

    def __init__(self, spec: Any, constants: list) -> None:
        self.spec, self.constants = spec, tuple(constants)

    def __deepcopy__(self, memo: dict) -> BatchLayout:
        return self


class Steps(nn.Module):
    """Member ``lm``'s ``training_step`` (train mode) or ``validation_step`` (eval mode) on the
    tensors of a batch: returns ``{"loss": loss, "log/<name>": value, ...}``."""

    def __init__(self, lm: pl.LightningModule, layout: BatchLayout) -> None:
        super().__init__()
        self.lm = lm
        self._layout = layout

    def forward(self, *tensors: torch.Tensor) -> dict[str, torch.Tensor]:
        batch = _rebuild(self._layout.spec, self._layout.constants, tensors)
        rec = Recorder()
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


def split_batch(batch: Any) -> tuple[list[torch.Tensor], Any, list]:
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
    ``hparams`` (by swapping in a recording subclass of its class / of its ``hparams``)."""

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


def hparams(lm: pl.LightningModule) -> dict[str, Any]:
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


def config_difference(members: Sequence[pl.LightningModule], i: int) -> str:
    """Member ``i``'s hyperparameters that differ from member 0's, in words."""
    h0, hi = hparams(members[0]), hparams(members[i])
    diff = [f"{k}={short(hi.get(k))} (member 0: {short(h0.get(k))})"
            for k in sorted(set(h0) | set(hi), key=str) if _differs(h0.get(k), hi.get(k))]
    return ", ".join(diff) if diff else "no hyperparameter differs (compare how the members were built)"


def probe_steps(members: list, sample_batch: Any) -> tuple[dict, dict, tuple[set, set]]:
    """Run member 0's steps once, eagerly, on a copy: check what ``training_step`` returns,
    record the logged names and options, and which attributes / hyperparameters the steps
    read. Returns the logging options of the tensors ``training_step`` and ``validation_step``
    log (by name) and the attributes and ``hparams`` keys they read."""
    lm = copy.deepcopy(members[0])
    rec = Recorder()
    lm.__dict__["log"], lm.__dict__["log_dict"] = rec.log, rec.log_dict
    reads = _ReadRecorder(lm)
    name = type(lm).__name__
    batch_idx = _BatchIndex()
    with torch.no_grad(), reads:
        lm.train()
        out = lm.training_step(sample_batch, batch_idx)
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
            got = (f"a tensor of shape {list(loss.shape)} ({loss.dtype})" if isinstance(loss, torch.Tensor)
                   else f"a dict without a tensor 'loss' (keys {sorted(out)})" if isinstance(out, Mapping)
                   else f"{type(out).__name__} {short(out)}")
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
            lm.validation_step(sample_batch, batch_idx)
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
    counters = sorted(reads.attrs & _TRAINER_COUNTERS) + (["batch_idx"] if batch_idx.used else [])
    if counters:
        raise ValueError(
            f"WideLightningModule: {name}'s training/validation step reads "
            f"{' and '.join(c if c == 'batch_idx' else 'self.' + c for c in counters)}, which the Trainer "
            "advances as it trains; the "
            "fused step is captured once and would keep the value it had then (0) for the whole fit, where "
            "each member alone sees the live counter (a warm-up or annealing weight would never move). "
            "Train such members each with its own Trainer, or make the weight a constant of the step")
    return ({k: o for k, o in train_opts.items() if isinstance(train_logged[k], torch.Tensor)},
            {k: o for k, o in val_opts.items() if isinstance(val_logged[k], torch.Tensor)},
            (reads.attrs, reads.hparams))


# the LightningModule properties that change during a fit (read by a step: baked at its capture)
_TRAINER_COUNTERS = frozenset({"global_step", "current_epoch"})


class _BatchIndex(int):
    """The ``batch_idx`` (0) that :func:`probe_steps` gives a step: records whether the step
    computes with it (arithmetic, a comparison, formatting); passed on untouched, it is not read."""

    used = False

    def _read(name: str) -> Any:  # noqa: N805 -- builds the methods below
        def method(self: _BatchIndex, *args: Any) -> Any:
            self.used = True
            return getattr(int, name)(self, *args)
        return method

    for _name in ("__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__add__", "__radd__", "__sub__",
                  "__rsub__", "__mul__", "__rmul__", "__mod__", "__rmod__", "__floordiv__", "__truediv__",
                  "__pow__", "__bool__", "__index__", "__int__", "__float__", "__format__", "__hash__"):
        locals()[_name] = _read(_name)
    del _name, _read

def shadowed_attributes(members: list, reads: tuple[set, set]) -> dict[int, dict[str, Any]]:
    """Member attributes (on the LightningModule itself) that differ from member 0's: their
    original values, by member. The steps must not read them (``reads``, from
    :func:`probe_steps`; checked here): the fused graph is member 0's program, so a value read
    there would be member 0's for all."""
    attrs_read, hparams_read = reads
    name = type(members[0]).__name__
    out: dict[int, dict[str, Any]] = {}
    m0 = members[0].__dict__
    h0 = hparams(members[0])
    for i, m in enumerate(members[1:], start=1):
        hi = hparams(m)
        for k in sorted(set(h0) | set(hi), key=str):
            if k in hparams_read and _differs(h0.get(k), hi.get(k)):
                raise ValueError(
                    f"WideLightningModule: member {i}: {name}'s training/validation step reads "
                    f"hparams[{k!r}], which is {short(hi.get(k))} for member {i} and "
                    f"{short(h0.get(k))} for member 0; the fused step is one program for all "
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
                        f"reads self.{k}, which is {short(v)} for member {i} and {short(m0[k])} "
                        "for member 0; the fused step is one program for all members. "
                        "Per-member hyperparameters may only be read by configure_optimizers")
                diff[k] = v
        if diff:
            out[i] = diff
    return out


def plain(v: Any) -> bool:
    return v is None or isinstance(v, (bool, int, float, str))


def member_of(e: Exception) -> int:
    m = re.search(r"member (\d+)", str(e))
    return int(m.group(1)) if m else 0


def check_members(members: list, skip_member_hooks: bool = False) -> None:
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
    if skipped and not skip_member_hooks:
        raise ValueError(f"WideLightningModule: {name} overrides {', '.join(skipped)}, which the fused run "
                         "does not call per member: what they do to a member (clip its weights, change a "
                         "hyperparameter, save state) would not happen, and the members would train apart "
                         "from how each trains alone. Pass skip_member_hooks=True if they only report (log, "
                         "print) and may be skipped, or move what they report to a Trainer callback")
    if skipped:
        warnings.warn(f"WideLightningModule: {name} overrides {', '.join(skipped)}, which the fused "
                      "run does not call per member (skip_member_hooks=True)", stacklevel=3)
    trainer_args = set(inspect.signature(pl.Trainer.__init__).parameters) - {"self"}
    h0 = hparams(m0)
    for i, m in enumerate(members[1:], start=1):
        hi = hparams(m)
        for k in sorted(trainer_args & (set(h0) | set(hi))):
            if _differs(h0.get(k), hi.get(k)):
                raise ValueError(
                    f"WideLightningModule: member {i}: hyperparameter {k!r} is {short(hi.get(k))}, "
                    f"member 0 has {short(h0.get(k))}; {k!r} is a lightning.Trainer argument, ONE "
                    "value for the whole fused run (the Trainer's). Train members that differ in it "
                    "in separate fused runs")
