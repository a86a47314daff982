"""N fused copies of a transformers model trained by one ``transformers.Trainer``.

:class:`WideTrainer` is a ``transformers.Trainer`` whose model is N members of one architecture
(N seeds, N learning rates, N weight decays, ...) fused into one
:class:`~wide_compiler.WideModel`: one forward, one backward and one fused optimizer step per
batch for all N, and member ``i`` ends up where a plain ``Trainer`` takes that model trained
alone with member ``i``'s arguments on the same batches. Dropout draws its own masks per
member, not the ones that plain run draws: with dropout > 0 a member trains as that run would
with another dropout stream, not bit for bit (train both with dropout 0 to compare them exactly).

* **Members.** ``model=`` is a list of N ``PreTrainedModel`` instances (member ``i``'s initial
  weights), or a :class:`WideTransformersModel` (e.g. from
  :meth:`WideTransformersModel.from_config` with N seeds).
* **Per-member arguments.** ``args=`` is one ``TrainingArguments`` (shared) or N of them, one per
  member (:func:`member_arguments` makes them from one). What may differ between members:
  ``learning_rate``, ``weight_decay``, ``adam_beta1``, ``adam_beta2``, ``adam_epsilon``,
  ``max_grad_norm``, ``optim_args``, ``lr_scheduler_type``, ``lr_scheduler_kwargs`` and
  ``warmup_steps``; any other argument that differs is an error naming the key and the member.
* **Optimizer and schedules.** The ``Trainer``'s optimizer (``optim``: ``adamw_torch``,
  ``adamw_torch_fused``, ``sgd``, ``adagrad``, ``rmsprop``) with its decay / no-decay parameter
  groups becomes one :mod:`wide_compiler.optim` optimizer with each member's values; each
  member's learning rate follows the ``Trainer``'s own schedule (``get_scheduler``) built with that
  member's learning rate, warm-up and schedule type; gradients are clipped per member
  (:func:`wide_compiler.optim.clip_grad_norm_`).
* **Logs.** ``loss_member_<i>``, ``grad_norm_member_<i>`` and ``learning_rate_member_<i>`` next to
  ``loss``, ``grad_norm`` and ``learning_rate`` (which are the means over members); evaluation
  gives ``eval_loss_member_<i>`` and, with ``compute_metrics``, ``eval_<metric>_member_<i>``
  (``compute_metrics`` and ``preprocess_logits_for_metrics`` are called once per member with that
  member's predictions, as for one model; ``eval_<metric>`` is the mean over members).
* **Saving.** ``save_model(dir)`` (and every checkpoint) writes ``dir/member_<i>/`` with
  ``save_pretrained``: each loads with ``AutoModel*.from_pretrained`` as an ordinary model.
  ``train(resume_from_checkpoint=...)`` resumes every member from such a checkpoint.

Data: the data collator gives ONE batch and every member sees it (each with its own weights).
Per-member data is not supported by this ``Trainer`` integration (use :mod:`wide_compiler.optim`
with your own loop for that).

What cannot be per member is refused with an error naming the key (and the member): members
whose configs differ in anything but initialisation and label names (their architecture or
their forward would differ), ``fp16`` (one ``GradScaler`` would be shared by all members),
``load_best_model_at_end`` / ``save_strategy="best"`` (one checkpoint for all members),
``label_smoothing_factor``, ``gradient_checkpointing``, ``lr_scheduler_type`` ``reduce_lr_on_plateau``
or ``greedy`` (stepped with one metric), DeepSpeed / FSDP, and several GPUs in one process.

transformers is optional: ``pip install "wide_compiler[transformers]"`` (tested with transformers
5.23.0 and accelerate 1.15.0, which the ``Trainer`` needs); ``import wide_compiler`` never imports
this module.

Example:
    >>> import tempfile, torch, transformers
    >>> from wide_compiler.integrations.transformers import (WideTrainer, WideTransformersModel,
    ...                                                      member_arguments)
    >>> config = transformers.BertConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...     num_hidden_layers=1, num_attention_heads=2, num_labels=2, hidden_dropout_prob=0.0,
    ...     attention_probs_dropout_prob=0.0)
    >>> model = WideTransformersModel.from_config(
    ...     transformers.BertForSequenceClassification, config, seeds=[0, 1, 2])
    >>> g = torch.Generator().manual_seed(0)
    >>> data = [{"input_ids": torch.randint(3, 32, (8,), generator=g), "labels": k % 2} for k in range(32)]
    >>> args = member_arguments(transformers.TrainingArguments(
    ...     output_dir=tempfile.mkdtemp(), max_steps=4, per_device_train_batch_size=8,
    ...     logging_steps=2, report_to=[], disable_tqdm=True, use_cpu=True, save_strategy="no"),
    ...     learning_rate=[1e-4, 1e-3, 1e-2])
    >>> trainer = WideTrainer(model=model, args=args, train_dataset=data)
    >>> trainer.remove_callback(transformers.PrinterCallback)     # no printed logs here
    >>> _ = trainer.train()
    >>> sorted(k for k in trainer.state.log_history[-2] if k.startswith("loss_member"))
    ['loss_member_0', 'loss_member_1', 'loss_member_2']
    >>> type(trainer.model.member(2)).__name__
    'BertForSequenceClassification'
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import inspect
import logging
import os
import sys
import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from ..config import WideConfig
from ._common import check_one_class, installed, require
from ._optimizers import SUPPORTED, fuse_optimizers

__all__ = ["WideTrainer", "WideTransformersModel", "member_arguments", "transformers_available"]

INSTALL_HINT = ('wide_compiler.integrations.transformers needs transformers and accelerate: pip install '
                '"transformers==5.23.0" "accelerate==1.15.0" (or pip install "wide_compiler[transformers]")')

_NAME = "wide_compiler.integrations.transformers"

log = logging.getLogger(__name__)

# TrainingArguments that may take one value per member; every other one is shared.
PER_MEMBER_ARGUMENTS = ("learning_rate", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon",
                        "max_grad_norm", "optim_args", "lr_scheduler_type", "lr_scheduler_kwargs",
                        "warmup_steps")

# Config keys that may differ between the members of one fused run: read at initialisation or
# only saved with the model, never by the forward.
_CONFIG_FREE_KEYS = frozenset({"initializer_range", "initializer_factor", "init_std", "_name_or_path",
                               "name_or_path", "transformers_version", "architectures", "_commit_hash",
                               "id2label", "label2id", "use_cache"})

# implementation choices of torch.optim that do not change the maths
_IMPLEMENTATION_KWARGS = ("fused", "foreach", "capturable", "differentiable")


def transformers_available() -> bool:
    """Whether ``transformers`` and ``accelerate`` (which its ``Trainer`` needs) are installed,
    checked without importing them."""
    return installed("transformers", "accelerate")


def _require_transformers() -> Any:
    return require("transformers", INSTALL_HINT, "accelerate")  # the Trainer needs accelerate


_transformers = _require_transformers()


# -- members ---------------------------------------------------------------------------------------
def _config_differences(configs: Sequence[Any]) -> None:
    """Raise naming the first config key (and member) whose value differs from member 0's."""
    from ..errors import ArchitectureMismatchError

    _refuse_differences(configs, _CONFIG_FREE_KEYS, lambda i, key, a, b: ArchitectureMismatchError(
        f"{_NAME}: member {i}'s config has {key}={b!r} but member 0's has {key}={a!r}; the members "
        f"of one fused run must share every config key that shapes the model or its forward (only "
        f"{sorted(_CONFIG_FREE_KEYS)} may differ). Train members with other {key!r} in another run."),
        absent="<absent>")


def _refuse_differences(objects: Sequence[Any], free: Collection[str],
                        error: Callable[[int, str, Any, Any], Exception], absent: Any = None) -> None:
    """Compare the ``to_dict()`` of every member's object (its config, its TrainingArguments) with
    member 0's, key by key in sorted order, the keys in ``free`` aside (a missing key reads as
    ``absent``); at the first difference raise ``error(member, key, member 0's value, its value)``."""
    ref = objects[0].to_dict()
    for i, obj in enumerate(objects[1:], start=1):
        d = obj.to_dict()
        for key in sorted(set(ref) | set(d)):
            a, b = ref.get(key, absent), d.get(key, absent)
            if key not in free and a != b:
                raise error(i, key, a, b)


def _dynamic_shapes(kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Every dim of every tensor input left to ``torch.export`` (``Dim.AUTO``): batch sizes and
    sequence lengths vary between batches, dims the model fixes are specialised."""
    from torch.export import Dim

    def spec(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return {d: Dim.AUTO for d in range(v.dim())} if v.dim() else None
        return tree_map(lambda _: None, v)
    return {k: spec(v) for k, v in kwargs.items()}


def _flat_class(cls: type, keys: Sequence[str]) -> type:
    """A subclass of ``cls`` whose ``forward`` shows ``torch.export`` one keyword parameter per
    input key: export cannot match a ``dynamic_shapes`` entry to an input that a ``**kwargs``
    parameter collects (the Trainer's ``num_items_in_batch``). Calls go to ``cls.forward``."""
    P = inspect.Parameter

    def forward(self: nn.Module, **kwargs: Any) -> Any:
        return cls.forward(self, **kwargs)

    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [P("self", P.POSITIONAL_OR_KEYWORD)] + [P(k, P.KEYWORD_ONLY) for k in keys])
    sub = type(cls.__name__, (cls,), {"forward": forward, "__module__": cls.__module__,
                                      "__qualname__": cls.__qualname__, "_wide_base": cls})
    return sub


@contextlib.contextmanager
def _quiet_fallbacks() -> Any:
    """The per-member vmap fallback of an op without a wide rule (a model's loss, typically) is
    correct; inside the Trainer it is logged at debug level rather than warned at every capture."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        if "runs through a per-member" in str(w.message):
            log.debug("%s", w.message)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)


def _signature(kwargs: Mapping[str, Any]) -> tuple:
    """What a call's inputs must share with the sample of the graph that runs them."""
    out = []
    for k in sorted(kwargs):
        v = kwargs[k]
        if isinstance(v, torch.Tensor):
            out.append((k, "tensor", v.dim(), v.dtype))
        else:
            flat, spec = tree_flatten(v)
            out.append((k, str(spec), tuple((t.dim(), t.dtype) if isinstance(t, torch.Tensor) else repr(t)
                                            for t in flat)))
    return tuple(out)


class WideTransformersModel(nn.Module):
    """N ``PreTrainedModel`` members of one architecture as one module for :class:`WideTrainer`.

    Called like one member (``model(input_ids=..., labels=...)``, one batch shared by every member)
    it returns the member's output type with every tensor N-first (``loss`` is ``[N]``). The
    graphs are captured and widened on the first call with each set of input keys; batch sizes and
    sequence lengths may change between calls. Parameters are the stacked ``[N, ...]`` tensors of a
    :class:`~wide_compiler.WideModel` (``self.wide``), built by :meth:`build` from one batch.

    Args:
        members: N ``PreTrainedModel`` instances of one class whose configs agree on every key
            that shapes the model (initialisation keys and label names may differ).
        wide_config: :class:`~wide_compiler.WideConfig` of the fused graphs (default
            ``WideConfig.fast()``).
    """

    def __init__(self, members: Sequence[nn.Module], *, wide_config: WideConfig | None = None) -> None:
        super().__init__()
        members = list(members)
        check_one_class(members, _transformers.PreTrainedModel, _NAME, "a transformers PreTrainedModel")
        _config_differences([m.config for m in members])
        self.n = len(members)
        object.__setattr__(self, "_members", members)       # not submodules: their weights are stale
        object.__setattr__(self, "_graphs", {})              # signature -> WideModel sharing self.wide's tensors
        self._wide_config = wide_config or WideConfig.fast()
        self.wide: nn.Module | None = None
        first = members[0]
        self.config = first.config
        self.main_input_name = getattr(first, "main_input_name", "input_ids")
        self.loss_type = getattr(first, "loss_type", None)
        if hasattr(first, "accepts_loss_kwargs"):
            self.accepts_loss_kwargs = first.accepts_loss_kwargs
        else:
            self.accepts_loss_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD
                                           for p in inspect.signature(first.forward).parameters.values())

    @classmethod
    def from_config(cls, model_class: Any, config: Any, *, seeds: Sequence[int],
                    wide_config: WideConfig | None = None, dtype: torch.dtype | None = None) -> WideTransformersModel:
        """N members ``model_class(config)`` (or ``model_class.from_config(config)`` for an
        ``AutoModel*`` class), member ``i`` initialised under ``torch.manual_seed(seeds[i])`` (so it
        can be built again alone the same way); the global RNG is left as it was."""
        members = []
        for s in seeds:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(int(s))
                own_class = isinstance(model_class, type) and issubclass(model_class, _transformers.PreTrainedModel)
                m = model_class(config) if own_class else model_class.from_config(config)
            members.append(m.to(dtype) if dtype is not None else m)
        return cls(members, wide_config=wide_config)

    @property
    def members(self) -> list[nn.Module]:
        """The member modules as given (their weights are NOT kept up to date: see :meth:`member`)."""
        return list(self._members)

    # -- building ------------------------------------------------------------------------------
    def _member_kwargs(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """One member's sample: two rows of each batched tensor (a size-1 dim would be fixed)."""
        def cut(t: Any) -> Any:
            return t[:2].clone() if isinstance(t, torch.Tensor) and t.dim() else t
        return {k: tree_map(cut, v) for k, v in kwargs.items()}

    def _compile(self, kwargs: Mapping[str, Any]) -> nn.Module:
        from ..api import compile as wide_compile

        sample = self._member_kwargs(kwargs)
        with torch.random.fork_rng(devices=[]), _quiet_fallbacks():
            base = type(self._members[0])
            flat = _flat_class(base, list(sample))
            for m in self._members:          # the fused model's template (a copy) keeps the subclass
                m.__class__ = flat
            try:
                return wide_compile(self._members, (), sample_kwargs=sample, config=self._wide_config,
                                    dynamic_shapes=_dynamic_shapes(sample))
            finally:
                for m in self._members:
                    m.__class__ = base

    def build(self, sample: Mapping[str, Any]) -> None:
        """Stack the members' weights into ``self.wide`` and capture the graph of ``sample`` (one
        batch as the data collator gives it). Done once; :class:`WideTrainer` calls it."""
        if self.wide is not None:
            return
        device = next(iter(self._members[0].parameters())).device
        sample = {k: tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, v)
                  for k, v in sample.items()}
        self.wide = self._compile(sample)
        self._graphs[_signature(sample)] = self.wide

    def _graph(self, kwargs: Mapping[str, Any]) -> nn.Module:
        if self.wide is None:
            self.build(kwargs)
        key = _signature(kwargs)
        g = self._graphs.get(key)
        if g is None:      # other input keys (eval without labels, ...): another graph, same tensors
            log.info("%s: capturing a graph for inputs %s", _NAME, sorted(kwargs))
            g = self._compile(kwargs)
            owner = self.wide
            with torch.no_grad():
                for name, _ in list(g.named_parameters(remove_duplicate=False)):
                    path, _, attr = name.rpartition(".")
                    g.get_submodule(path)._parameters[attr] = owner.get_parameter(name)
                for name, _ in list(g.named_buffers(remove_duplicate=False)):
                    path, _, attr = name.rpartition(".")
                    try:
                        g.get_submodule(path)._buffers[attr] = owner.get_buffer(name)
                    except AttributeError:
                        pass      # a constant of this graph only
            self._graphs[key] = g
        if g.training != self.training:
            with torch.random.fork_rng(devices=[]), _quiet_fallbacks():
                g.train(self.training)        # captures that mode's graph on first use
        return g

    # -- running ---------------------------------------------------------------------------------
    def train(self, mode: bool = True) -> WideTransformersModel:
        """Train/eval mode; the fused graph of a mode is captured on the first switch to it."""
        with torch.random.fork_rng(devices=[]), _quiet_fallbacks():
            return super().train(mode)

    def forward(self, **kwargs: Any) -> Any:
        """One member's keyword inputs (one batch, shared by every member); N-first outputs."""
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        g = self._graph(kwargs)
        n = self.n
        shared = {k: tree_map(lambda t: t.unsqueeze(0).expand(n, *t.shape) if isinstance(t, torch.Tensor) else t, v)
                  for k, v in kwargs.items()}
        return g(**shared)

    # -- members out -----------------------------------------------------------------------------
    def member(self, i: int) -> nn.Module:
        """Member ``i`` as an ordinary model of its class with its current weights and its own
        config (``save_pretrained`` / ``from_pretrained`` as usual)."""
        if self.wide is None:
            return copy.deepcopy(self._members[i])
        m = self.wide.member(i)
        m.__class__ = getattr(type(m), "_wide_base", type(m))     # not the capture's view (_flat_class)
        m.config = copy.deepcopy(self._members[i].config)
        if hasattr(m, "generation_config") and hasattr(self._members[i], "generation_config"):
            m.generation_config = copy.deepcopy(self._members[i].generation_config)
        return m

    def save_pretrained(self, save_directory: str | os.PathLike, **kwargs: Any) -> list[str]:
        """``member(i).save_pretrained(save_directory/member_<i>)`` for every member; returns the
        directories."""
        out = []
        for i in range(self.n):
            path = os.path.join(os.fspath(save_directory), f"member_{i}")
            self.member(i).save_pretrained(path, **kwargs)
            out.append(path)
        return out


# -- arguments ----------------------------------------------------------------------------------------
def member_arguments(args: Any, **per_member: Sequence[Any]) -> list[Any]:
    """N copies of ``TrainingArguments`` ``args``, copy ``i`` with the ``i``-th value of each keyword:
    ``member_arguments(args, learning_rate=[1e-4, 1e-3], weight_decay=[0.0, 0.01])``. Keys must be
    among :data:`PER_MEMBER_ARGUMENTS`; every list has one value per member."""
    if not per_member:
        raise ValueError(f"{_NAME}: member_arguments: give at least one per-member keyword, e.g. "
                         "learning_rate=[...]")
    lengths = {k: len(v) for k, v in per_member.items()}
    for k in per_member:
        if k not in PER_MEMBER_ARGUMENTS:
            raise ValueError(f"{_NAME}: member_arguments: {k!r} cannot differ between members; per-member "
                             f"arguments are {list(PER_MEMBER_ARGUMENTS)}")
    if len(set(lengths.values())) != 1:
        raise ValueError(f"{_NAME}: member_arguments: every keyword needs one value per member; got lengths "
                         f"{lengths}")
    n = next(iter(lengths.values()))
    return [dataclasses.replace(args, **{k: v[i] for k, v in per_member.items()}) for i in range(n)]


def _value(v: Any) -> Any:
    """An enum argument (``OptimizerNames.SGD``) as the string a user writes (``"sgd"``)."""
    return getattr(v, "value", v)


def _check_arguments(all_args: Sequence[Any]) -> None:
    """Every argument outside PER_MEMBER_ARGUMENTS must be the same for every member, and the
    shared ones must be ones a fused run can honour."""
    _refuse_differences(all_args, PER_MEMBER_ARGUMENTS, lambda i, key, ref, value: ValueError(
        f"{_NAME}: TrainingArguments.{key} is {value!r} for member {i} but {ref!r} for member 0; it cannot "
        f"be per member in one fused run (one Trainer loop drives all members; per-member arguments are "
        f"{list(PER_MEMBER_ARGUMENTS)})"))
    a = all_args[0]
    refuse = [
        ("fp16", a.fp16, "one GradScaler would be shared by all members (one member's overflow would skip "
                         "every member's step); use bf16 or float32"),
        ("load_best_model_at_end", a.load_best_model_at_end, "the Trainer keeps ONE best checkpoint for all "
                                                             "members; choose per member from eval_*_member_<i>"),
        ("save_strategy", _value(a.save_strategy) == "best",
         "'best' saves on ONE metric for all members"),
        ("label_smoothing_factor", a.label_smoothing_factor != 0, "the label smoother reads N-first outputs "
                                                                  "as one model's; not supported"),
        ("gradient_checkpointing", a.gradient_checkpointing, "not supported by fused members"),
        ("neftune_noise_alpha", a.neftune_noise_alpha is not None, "its noise hook needs one model's input "
                                                                 "embeddings; not supported"),
        ("deepspeed", bool(a.deepspeed), "not supported by fused members"),
        ("fsdp", bool(a.fsdp), "not supported by fused members"),
    ]
    for key, bad, why in refuse:
        if bad:
            raise ValueError(f"{_NAME}: TrainingArguments.{key}={getattr(a, key)!r} is not supported: {why}")
    for i, m in enumerate(all_args):
        kind = _value(m.lr_scheduler_type)
        if kind in ("reduce_lr_on_plateau", "greedy"):
            raise ValueError(f"{_NAME}: TrainingArguments.lr_scheduler_type={kind!r} (member {i}) is stepped with "
                             "one metric for the whole run; not supported (use a schedule of the step count)")
    if a.n_gpu > 1:
        raise ValueError(f"{_NAME}: {a.n_gpu} GPUs in one process (DataParallel) are not supported; run one "
                         "process per device (torch.distributed) or set CUDA_VISIBLE_DEVICES")


# -- learning-rate schedules --------------------------------------------------------------------------
class _MemberSchedules:
    """The Trainer's schedule of each member (``transformers.get_scheduler`` with member ``i``'s
    ``lr_scheduler_type``, learning rate, warm-up and kwargs), each on a stand-in optimizer whose
    learning rates are copied into the wide optimizer's param groups (as ``[N]`` tensors)."""

    def __init__(self, optimizer: Any, all_args: Sequence[Any], num_training_steps: int) -> None:
        self.optimizer = optimizer
        self.schedulers = []
        for i, a in enumerate(all_args):
            dummy = torch.nn.Parameter(torch.zeros(()))
            groups = [{"params": [dummy] if k == 0 else [torch.nn.Parameter(torch.zeros(()))],
                       "lr": float(g["lr"][i])} for k, g in enumerate(optimizer.param_groups)]
            stand_in = torch.optim.SGD(groups, lr=a.learning_rate)
            self.schedulers.append(_transformers.get_scheduler(
                a.lr_scheduler_type, optimizer=stand_in, num_warmup_steps=a.get_warmup_steps(num_training_steps),
                num_training_steps=num_training_steps, scheduler_specific_kwargs=a.lr_scheduler_kwargs))
            stand_in._opt_called = True      # it never steps: the wide optimizer does
        self._copy()

    def _copy(self) -> None:
        for gi, g in enumerate(self.optimizer.param_groups):
            g["lr"] = torch.tensor([s.optimizer.param_groups[gi]["lr"] for s in self.schedulers], dtype=torch.float64)

    def step(self) -> None:
        for s in self.schedulers:
            s.step()
        self._copy()

    def member_lrs(self) -> list[float]:
        """Each member's learning rate of param group 0 now."""
        return [float(s.get_last_lr()[0]) for s in self.schedulers]

    def get_last_lr(self) -> list[float]:
        """Per param group, the mean over members (what a ``Trainer`` log shows as ``learning_rate``)."""
        return [sum(lrs) / len(lrs) for lrs in zip(*(s.get_last_lr() for s in self.schedulers))]

    def state_dict(self) -> dict[str, Any]:
        return {"schedulers": [s.state_dict() for s in self.schedulers]}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        for s, st in zip(self.schedulers, state["schedulers"]):
            s.load_state_dict(st)
            for g, lr in zip(s.optimizer.param_groups, s.get_last_lr()):   # as a loaded optimizer's would be
                g["lr"] = lr
        self._copy()


# -- the Trainer ---------------------------------------------------------------------------------------

class WideTrainer(_transformers.Trainer):
    """A ``transformers.Trainer`` for N fused members (see the module docstring).

    ``WideTrainer(model=members_or_wide_model, args=args_or_N_args, ...)`` takes every other
    ``Trainer`` argument unchanged (datasets, ``data_collator``, ``processing_class``,
    ``compute_metrics``, ``callbacks``, ...). ``sample=``: one batch as the data collator gives
    it, to build the fused model from (default: the first two items of the train dataset, or of
    the eval dataset, collated). ``wide_config=``: the :class:`~wide_compiler.WideConfig` when
    ``model`` is a list.

    ``trainer.model`` is the :class:`WideTransformersModel`; ``trainer.model.member(i)`` is member
    ``i`` as an ordinary model; ``trainer.member_args[i]`` its ``TrainingArguments``.
    """

    def __init__(self, model: Any = None, args: Any = None, *trainer_args: Any, sample: Any = None,
                 wide_config: WideConfig | None = None, **trainer_kwargs: Any) -> None:
        if trainer_kwargs.get("model_init") is not None:
            raise ValueError(f"{_NAME}: model_init is not supported; build the members (or "
                             "WideTransformersModel.from_config with seeds) and pass model=")
        if isinstance(model, (list, tuple)):
            model = WideTransformersModel(model, wide_config=wide_config)
        if not isinstance(model, WideTransformersModel):
            raise TypeError(f"{_NAME}: WideTrainer needs model= a list of N PreTrainedModel members or a "
                            f"WideTransformersModel, got {type(model).__name__}")
        n = model.n
        if args is None:
            raise ValueError(f"{_NAME}: pass args= (one TrainingArguments, or one per member)")
        all_args = list(args) if isinstance(args, (list, tuple)) else [args] * n
        if len(all_args) != n:
            raise ValueError(f"{_NAME}: got {len(all_args)} TrainingArguments for {n} members; give one "
                             "(shared) or exactly one per member")
        for i, a in enumerate(all_args):
            if not isinstance(a, _transformers.TrainingArguments):
                raise TypeError(f"{_NAME}: args for member {i} is a {type(a).__name__}; expected "
                                "transformers.TrainingArguments")
        _check_arguments(all_args)
        self.member_args = all_args
        # the loop's arguments: shared ones, and the largest clip norm so that the Trainer clips
        # whenever any member does (members without clipping get an infinite norm)
        shared = dataclasses.replace(all_args[0], max_grad_norm=max(a.max_grad_norm for a in all_args))
        self._member_loss: torch.Tensor | None = None
        self._member_tr_loss = torch.zeros(n, dtype=torch.float64)
        self._member_last_logged = 0
        self._member_grad_norm: torch.Tensor | None = None
        self._member_lr: list[float] | None = None
        self._eval_losses: list[torch.Tensor] | None = None
        user_metrics = trainer_kwargs.pop("compute_metrics", None)
        user_preprocess = trainer_kwargs.pop("preprocess_logits_for_metrics", None)
        if trainer_kwargs.get("compute_loss_func") is not None:
            raise ValueError(f"{_NAME}: compute_loss_func is not supported; the members' own losses "
                             "(outputs.loss) are used")
        opts = trainer_kwargs.get("optimizers", (None, None))
        if opts is not None and any(o is not None for o in opts):
            raise ValueError(f"{_NAME}: optimizers= is not supported; the optimizer and schedules are built "
                             "per member from the TrainingArguments")
        if trainer_kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise ValueError(f"{_NAME}: optimizer_cls_and_kwargs is not supported; set optim/optim_args")
        super().__init__(model, shared, *trainer_args,
                         compute_metrics=self._per_member_metrics(user_metrics) if user_metrics else None,
                         preprocess_logits_for_metrics=(self._per_member_preprocess(user_preprocess)
                                                        if user_preprocess else None),
                         **trainer_kwargs)
        first = model._members[0]
        if self.args.label_names is None:
            self.label_names = _transformers.utils.find_labels(type(first))
        self.can_return_loss = _transformers.utils.can_return_loss(type(first))
        for m in model._members:       # what Trainer.__init__ does to its model's config
            m.config.use_cache = self.args.use_cache
            m.to(self.args.device)
        if model.wide is None:
            with torch.random.fork_rng(devices=[]):
                model.build(self._prepare_inputs(sample if sample is not None else self._sample_batch()))

    # -- building ----------------------------------------------------------------------------
    def _sample_batch(self) -> dict[str, Any]:
        ds = self.train_dataset if self.train_dataset is not None else self.eval_dataset
        if isinstance(ds, Mapping):
            ds = next(iter(ds.values()))
        if ds is None or not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
            raise ValueError(f"{_NAME}: cannot take a sample batch from the datasets (none, or not "
                             "map-style); pass sample= (one batch as the data collator gives it)")
        collate = self.data_collator
        if _transformers.utils.is_datasets_available():
            import datasets
            if isinstance(ds, datasets.Dataset):
                ds = self._remove_unused_columns(ds, description="training")
            else:
                collate = self._get_collator_with_removed_columns(collate, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        return dict(collate([ds[k] for k in range(min(2, len(ds)))]))

    def _set_signature_columns_if_needed(self) -> None:
        if self._signature_columns is None:
            first = self.model._members[0]
            self._signature_columns = list(inspect.signature(first.forward).parameters)
            self._signature_columns += list({"label", "label_ids", *self.label_names})

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        """Resume: every member's weights from ``checkpoint/member_<i>/`` (what :meth:`_save`
        writes); the Trainer then loads the optimizer, schedules, RNG and loop state as usual."""
        wide = self.model
        cls = getattr(type(wide._members[0]), "_wide_base", type(wide._members[0]))
        dtype = next(iter(wide.parameters())).dtype
        for i in range(wide.n):
            path = os.path.join(resume_from_checkpoint, f"member_{i}")
            if not os.path.isdir(path):
                raise ValueError(f"{_NAME}: cannot resume from {resume_from_checkpoint}: it has no member_{i}/ "
                                 f"directory (a WideTrainer checkpoint of {wide.n} members has member_0/ ... "
                                 f"member_{wide.n - 1}/)")
            loaded = cls.from_pretrained(path, dtype=dtype)
            wide.wide.load_member_state_dict(i, loaded.state_dict())

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        # torch.optim.Optimizer.load_state_dict (run once by accelerate's optimizer wrapper) adds a
        # 'differentiable' default that wide_compiler.optim does not save, so a second load (this
        # one) would be refused as another optimizer's state: drop it (wc.optim never reads it).
        opt = getattr(self.optimizer, "optimizer", self.optimizer)
        if opt is not None and "differentiable" not in type(opt)._flags:
            opt.defaults.pop("differentiable", None)
        super()._load_optimizer_and_scheduler(checkpoint)

    # -- optimizer and schedules -------------------------------------------------------------
    def create_optimizer(self, model: Any = None) -> Any:
        if self.optimizer is not None:
            return self.optimizer
        wide = self.model
        first = wide._members[0]
        decay = set(self.get_decay_parameter_names(first))
        optimizers = []
        for i, (a, m) in enumerate(zip(self.member_args, wide._members)):
            cls, kw = _transformers.Trainer.get_optimizer_cls_and_kwargs(a, first)
            if cls not in SUPPORTED:
                raise ValueError(f"{_NAME}: TrainingArguments.optim={_value(a.optim)!r} (member {i}) builds "
                                 f"{cls.__module__}.{cls.__name__}; supported: adamw_torch, adamw_torch_fused, "
                                 "sgd, adagrad, rmsprop")
            # member i's optimizer as a plain Trainer builds it (Trainer.create_optimizer: decay and
            # no-decay groups), less the implementation choices that do not change the maths
            params = [(name, p) for name, p in m.named_parameters() if p.requires_grad]
            groups = [{"params": [p for name, p in params if name in decay], "weight_decay": a.weight_decay},
                      {"params": [p for name, p in params if name not in decay], "weight_decay": 0.0}]
            optimizers.append(cls([g for g in groups if g["params"]],
                                  **{k: v for k, v in kw.items() if k not in _IMPLEMENTATION_KWARGS}))
        self.optimizer = fuse_optimizers(optimizers, wide._members, wide.wide.get_parameter, owner=_NAME)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        if self.lr_scheduler is None:
            self.lr_scheduler = _MemberSchedules(optimizer or self.optimizer, self.member_args,
                                                 num_training_steps)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _get_learning_rate(self) -> float:
        if isinstance(self.lr_scheduler, _MemberSchedules):
            self._member_lr = self.lr_scheduler.member_lrs()
            return sum(self._member_lr) / len(self._member_lr)
        return super()._get_learning_rate()

    def _clip_grad_norm(self, model: Any) -> torch.Tensor:
        import wide_compiler.optim as wopt

        # a member without clipping: a bound no norm reaches (the scale is exactly 1)
        max_norm = [a.max_grad_norm if a.max_grad_norm > 0 else sys.float_info.max for a in self.member_args]
        norms = wopt.clip_grad_norm_([p for p in self.model.parameters() if p.grad is not None], max_norm,
                                     n=self.model.n)
        self._member_grad_norm = norms.detach().to("cpu", torch.float64)
        return norms.detach().mean()

    # -- losses -------------------------------------------------------------------------------
    def compute_loss(self, model: Any, inputs: Any, return_outputs: bool = False,
                     num_items_in_batch: Any = None) -> Any:
        if isinstance(num_items_in_batch, int):      # an input of the fused graph: a tensor
            num_items_in_batch = torch.tensor(num_items_in_batch, device=self.args.device)
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
        n = self.model.n
        if not isinstance(loss, torch.Tensor) or loss.shape != (n,):
            raise ValueError(f"{_NAME}: the fused model returned a loss of shape "
                             f"{list(getattr(loss, 'shape', []))}; expected one loss per member [{n}] "
                             "(does the batch hold the labels?)")
        self._member_loss = loss.detach()
        # training: the sum (each member's gradient is its own loss's); evaluation: the mean
        total = loss.sum() if model.training else loss.mean()
        return (total, outputs) if return_outputs else total

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        self._member_loss = None
        loss = super().training_step(model, inputs, num_items_in_batch)
        per = self._member_loss.to("cpu", torch.float64)
        scaled_for_ga = (self.loss_is_scaled_for_ga if getattr(self, "loss_is_scaled_for_ga", None) is not None
                         else (self.model_accepts_loss_kwargs and num_items_in_batch is not None))
        if not scaled_for_ga:
            per = per / self.current_gradient_accumulation_steps
        if self.args.logging_nan_inf_filter:
            bad = ~torch.isfinite(per)
            steps = 1 + self.state.global_step - self._member_last_logged
            per = torch.where(bad, self._member_tr_loss / steps, per)
        self._member_tr_loss += per
        return loss / self.model.n

    # -- logs ---------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        n = self.model.n
        if "loss" in logs and not any(k.startswith("eval_") for k in logs):
            steps = max(self.state.global_step - self._member_last_logged, 1)
            values = (self._member_tr_loss / steps).tolist()
            self._member_tr_loss.zero_()
            self._member_last_logged = self.state.global_step
            logs.update({f"loss_member_{i}": values[i] for i in range(n)})
            if "grad_norm" in logs and self._member_grad_norm is not None:
                logs.update({f"grad_norm_member_{i}": float(self._member_grad_norm[i]) for i in range(n)})
            if "learning_rate" in logs and self._member_lr is not None:
                logs.update({f"learning_rate_member_{i}": self._member_lr[i] for i in range(n)})
        super().log(logs, start_time)

    # -- evaluation ---------------------------------------------------------------------------
    def prediction_step(self, model: Any, inputs: Any, prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> Any:
        self._member_loss = None
        loss, logits, labels = super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if loss is not None and self._member_loss is not None and self._eval_losses is not None:
            self._eval_losses.append(self._member_loss.to("cpu", torch.float64))
            self._eval_batch_sizes.append(_transformers.trainer_pt_utils.find_batch_size(inputs))
        if logits is not None:      # member dim last: the loop concatenates (and pads) batch-first
            logits = tree_map(lambda t: t.movedim(0, -1) if isinstance(t, torch.Tensor) and t.dim() else t,
                              logits)
        return loss, logits, labels

    def evaluation_loop(self, dataloader: Any, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> Any:
        self._eval_losses, self._eval_batch_sizes = [], []
        try:
            out = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                          metric_key_prefix)
        finally:
            losses, sizes = self._eval_losses, self._eval_batch_sizes
            self._eval_losses = None
        if losses:
            # as the Trainer does for one model: each batch's loss once per example in it
            # (accelerate's gather_for_metrics keeps the last batch's real size)
            per = torch.cat([loss.unsqueeze(0).expand(size if size is not None else 1, -1)
                             for loss, size in zip(losses, sizes)])     # [examples, N]
            for i in range(self.model.n):
                col = per[:, i]
                finite = torch.isfinite(col)
                if self.args.logging_nan_inf_filter and finite.any():
                    col = col[finite]
                out.metrics[f"{metric_key_prefix}_loss_member_{i}"] = col.mean().item()
        return out

    def _per_member_metrics(self, fn: Callable) -> Callable:
        def per_member(pred: Any, **kwargs: Any) -> dict[str, float]:
            n = self.model.n
            results = []
            for i in range(n):
                preds = tree_map(lambda a: a[..., i], pred.predictions)
                results.append(fn(_transformers.EvalPrediction(
                    predictions=preds, label_ids=pred.label_ids,
                    losses=getattr(pred, "losses", None), inputs=getattr(pred, "inputs", None)), **kwargs) or {})
            out: dict[str, float] = {}
            for key in results[0]:
                values = [r.get(key) for r in results]
                for i, v in enumerate(values):
                    out[f"{key}_member_{i}"] = v
                if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
                    out[key] = sum(values) / n
            return out
        return per_member

    def _per_member_preprocess(self, fn: Callable) -> Callable:
        def per_member(logits: Any, labels: Any) -> Any:
            outs = [fn(tree_map(lambda t: t[..., i], logits), labels) for i in range(self.model.n)]
            flat = [tree_flatten(o) for o in outs]
            return tree_unflatten([torch.stack(ts, dim=-1) for ts in zip(*(f[0] for f in flat))], flat[0][1])
        return per_member

    # -- saving ------------------------------------------------------------------------------
    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        logger_dirs = self.model.save_pretrained(output_dir)
        for i, path in enumerate(logger_dirs):
            if self.processing_class is not None:
                self.processing_class.save_pretrained(path)
            torch.save(self.member_args[i], os.path.join(path, _transformers.trainer.TRAINING_ARGS_NAME))
        torch.save(self.args, os.path.join(output_dir, _transformers.trainer.TRAINING_ARGS_NAME))
