"""N ``PreTrainedModel`` members of one architecture as one module
(:class:`WideTransformersModel`): the members' checks, the graphs' capture (one per set of input
keys, sharing one set of wide tensors) and the members out again."""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from ...config import WideConfig
from .._common import check_one_class
from .common import NAME, hf, refuse_differences

__all__ = ["WideTransformersModel"]

log = logging.getLogger(__name__)

# Config keys that may differ between the members of one fused run: read at initialisation or
# only saved with the model, never by the forward.
_CONFIG_FREE_KEYS = frozenset({"initializer_range", "initializer_factor", "init_std", "_name_or_path",
                               "name_or_path", "transformers_version", "architectures", "_commit_hash",
                               "id2label", "label2id", "use_cache"})


def _config_differences(configs: Sequence[Any]) -> None:
    """Raise naming the first config key (and member) whose value differs from member 0's."""
    from ...errors import ArchitectureMismatchError

    refuse_differences(configs, _CONFIG_FREE_KEYS, lambda i, key, a, b: ArchitectureMismatchError(
        f"{NAME}: member {i}'s config has {key}={b!r} but member 0's has {key}={a!r}; the members "
        f"of one fused run must share every config key that shapes the model or its forward (only "
        f"{sorted(_CONFIG_FREE_KEYS)} may differ). Train members with other {key!r} in another run."),
        absent="<absent>")

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
            ``WideConfig.fast().replace(defer=True)``: a run compiles only when its length, which
            :class:`WideTrainer` gives :meth:`expect_calls`, earns the capture back; until then
            each member runs its own program on its slices of the fused weights, exactly).
    """

    def __init__(self, members: Sequence[nn.Module], *, wide_config: WideConfig | None = None) -> None:
        super().__init__()
        members = list(members)
        check_one_class(members, hf.PreTrainedModel, NAME, "a transformers PreTrainedModel")
        _config_differences([m.config for m in members])
        self.n = len(members)
        object.__setattr__(self, "_members", members)       # not submodules: their weights are stale
        object.__setattr__(self, "_graphs", {})              # signature -> WideModel sharing self.wide's tensors
        self._wide_config = wide_config or WideConfig.fast().replace(defer=True)
        self._expected: dict[str, int | None] = {}  # WideModel.expect_calls of every graph
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
                own_class = isinstance(model_class, type) and issubclass(model_class, hf.PreTrainedModel)
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
        from ...api import compile as wide_compile

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
            log.info("%s: capturing a graph for inputs %s", NAME, sorted(kwargs))
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
            g.expect_calls(**self._expected)
        if g.training != self.training:
            with torch.random.fork_rng(devices=[]), _quiet_fallbacks():
                g.train(self.training)        # captures that mode's graph on first use
        return g

    def expect_calls(self, *, train_calls: int | None = None, eval_calls: int | None = None) -> None:
        """:meth:`wide_compiler.WideModel.expect_calls` of every fused graph, built or to come."""
        self._expected = {"train_calls": train_calls, "eval_calls": eval_calls}
        for g in self._graphs.values():
            g.expect_calls(**self._expected)

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
