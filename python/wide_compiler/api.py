"""The user API: :func:`compile` and the layout helpers."""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .config import WideConfig
from .errors import ValidationError, WideCompileError
from .fx.compilation import aliases, stack_members
from .layouts import layout_of, tag_layout
from .model import WideModel, outside_inference_mode, refuse_reserved_names
from .model_deferred import deferred_members
from .torch_guards import note_wide_parameters

__all__ = ["WideBuilder", "compile", "pack", "stack", "unpack", "unstack"]

log = logging.getLogger(__name__)


def _plain_module(m: nn.Module, i: int) -> nn.Module:
    """Member ``i`` as ``torch.export`` can capture it: a ``torch.compile``'d module's original
    (the wrapper holds the same parameters); a scripted module or one with lazy modules not yet
    run is refused, saying what to pass instead."""
    orig = getattr(m, "_orig_mod", None)
    if isinstance(orig, nn.Module) and type(m).__name__ == "OptimizedModule":
        log.info("wide_compiler.compile: member %d is torch.compile'd: its original module is fused", i)
        m = orig
    if isinstance(m, torch.jit.ScriptModule):
        raise TypeError(f"wide_compiler.compile: member {i} is a TorchScript module ({type(m).__name__}), which "
                        "torch.export cannot capture; pass the nn.Module it was scripted from")
    lazy = [name for name, t in [*m.named_parameters(), *m.named_buffers()]
            if isinstance(t, nn.parameter.UninitializedTensorMixin)]
    if lazy:
        raise ValueError(f"wide_compiler.compile: member {i} has lazy modules not yet initialised ({', '.join(lazy[:3])}"
                         f"{', ...' if len(lazy) > 3 else ''}): run each member once on a sample input first, "
                         "which gives them their sizes")
    return m


# Note [One model and n=K]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# ``compile(model, sample, n=K)`` makes K copies of ``model`` and calls every ``reset_parameters()``
# in each, so that the K members start independently. A tensor no ``reset_parameters()`` draws
# again (a raw ``nn.Parameter``: a ViT's cls token or position embedding, a custom weight; a buffer
# filled at random in ``__init__``) would be copied: the same in all K members (probe 9, P9-21).
# A parameter or floating-point buffer with the same values, not all equal, in the first two
# copies, each reset after the other (the random stream moves between them), was not drawn again
# (a constant such as LayerNorm's ones or a zero token is what a fresh construction gives too; the
# model is not what the copies are compared with: a seed set before the model was made and again
# before compiling makes the first copy's draws the model's own). Parameters are refused, naming them,
# as a model with no reset_parameters() at all is. Buffers are only warned about: a buffer with the
# same values in every fresh model (a sinusoidal position table, a causal mask) is common and
# right, a buffer drawn at random is rare, and the two cannot be told apart. The model itself is
# never changed.
def _not_reinitialised(model: nn.Module, copy_: nn.Module, which: str) -> list[str]:
    """Names of ``model``'s parameters (``which="parameters"``) or floating buffers that ``copy_``
    holds with the same non-constant values (Note [One model and n=K])."""
    def named(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
        return list(m.named_parameters() if which == "parameters" else m.named_buffers())

    left = []
    for (name, t), (_, c) in zip(named(model), named(copy_)):
        if (isinstance(t, nn.parameter.UninitializedTensorMixin) or t.is_meta or t.numel() < 2
                or not (t.is_floating_point() or t.is_complex())):
            continue
        with torch.no_grad():
            flat = t.detach().reshape(-1)
            if torch.equal(c.detach(), t.detach()) and not bool((flat == flat[0]).all()):
                left.append(name)
    return left


def _reinitialised_copies(model: nn.Module, n: int) -> list[nn.Module]:
    """K copies of ``model``, each with every ``reset_parameters()`` called (Note [One model and n=K])."""
    copies = []
    for k in range(n):
        m = copy.deepcopy(model)
        reset = [sub for sub in m.modules() if callable(getattr(sub, "reset_parameters", None))]
        if not reset and any(True for _ in m.parameters()):
            raise ValueError(
                f"wide_compiler.compile(model, n={n}): {type(model).__name__} has parameters but no "
                "submodule with reset_parameters(), so independent members cannot be made; pass a "
                "list of models instead")
        for sub in reset:
            sub.reset_parameters()
        if k == 1:  # two copies reset one after the other: what was drawn again differs between them
            _check_all_reset(copies[0], m, n, type(model).__name__)
        copies.append(m)
    return copies


def _check_all_reset(first: nn.Module, second: nn.Module, n: int, name: str) -> None:
    """Refuse a parameter, and warn about a buffer, that no reset_parameters() draws again: the
    same non-constant values in the first two copies, each reset after the other (a seed set
    before the model was made and again before compiling would make the first copy's draws the
    model's own, so the model is not what they are compared with; Note [One model and n=K])."""
    def names(xs: list[str]) -> str:
        return ", ".join(xs[:6]) + (f", ... ({len(xs)} in all)" if len(xs) > 6 else "")

    params = _not_reinitialised(first, second, "parameters")
    if params:
        raise ValueError(
            f"wide_compiler.compile(model, n={n}): no reset_parameters() of {name} draws "
            f"the parameter(s) {names(params)} again, so all {n} members would start with the model's same "
            f"values (not independently). Pass a list of {n} models made as you make one (each draws its "
            f"own), or give the module holding them a reset_parameters() that initialises them")
    buffers = _not_reinitialised(first, second, "buffers")
    if buffers:
        import warnings

        warnings.warn(
            f"wide_compiler.compile(model, n={n}): no reset_parameters() of {name} sets the "
            f"buffer(s) {names(buffers)}, so all {n} members hold the model's values. Right for a buffer "
            f"every fresh model has the same (a position table, a mask); a buffer drawn at random is the same "
            f"in all members: pass a list of {n} models instead", UserWarning, stacklevel=4)


def compile(  # noqa: A001 (the natural name; torch.compile is reached as torch.compile)
    models: nn.Module | Sequence[nn.Module],
    sample_input: torch.Tensor | tuple,
    *,
    n: int | None = None,
    validate: bool = False,
    strict: bool = False,
    config: WideConfig | None = None,
    sample_kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
    compile_model: bool = False,
    compile_options: dict[str, Any] | None = None,
    pad: bool = False,
) -> WideModel:
    """Fuse N models of one architecture into one :class:`WideModel`.

    Member 0 is captured with ``torch.export`` (non-strict, batch dim dynamic), every member is
    checked to be the same program, parameters and buffers are stacked into ``[N, ...]``
    ``nn.Parameter``s, and every op is rewritten into its wide form; each wide op's strategy is
    measured on the sample shapes (see :class:`WideConfig`).

    Args:
        models: the N members, or ONE model with ``n=K`` for K members re-initialised
            independently with ``reset_parameters()`` (the model itself is left untouched).
        sample_input: ONE member's input, without the member dim: a tensor, or a tuple of
            positional inputs (tensors, nested lists/tuples/dicts of tensors, or Python values,
            which are baked in). Member 0 runs on it first, so a sample it cannot take raises
            :class:`WideCompileError` with PyTorch's own error (real sizes) and a hint.
        n: number of members when ``models`` is a single module.
        validate: run the sample through the wide model and every member (on copies; nothing is
            modified) and raise :class:`ValidationError` if a member's outputs or buffers differ
            (also ``config.validate``); a train graph with random ops (dropout) is compared with
            every draw fixed to one value on both sides (or in eval mode, where a draw cannot be
            fixed, and a log message says so).
        strict: raise for an op with no wide rule instead of running it through the per-member
            fallback (also ``config.strict``).
        config: :class:`WideConfig` (default ``WideConfig.default()``).
        sample_kwargs: keyword inputs of one member (tensors are N-first at call time too).
        dynamic_shapes: passed to ``torch.export.export``; default: dim 0 of every input with at
            least 2 dims is a dynamic batch dimension (for a ``forward(*args)`` or
            ``forward(x, **kwargs)`` too: each input the sample gives is described by itself),
            and every other size follows the calls: a call with a new size in another dim (a
            sequence length, an image size) captures that mode's graph again with the dim
            dynamic, once (logged at INFO), unless the forward fixes it (a ``Linear`` over it),
            which raises a ``ValueError`` naming the size and the line. Given explicitly, the
            sizes are exactly as given (no recapture). ``summary()`` lists the dynamic dims.
        compile_model: return ``torch.compile(wide_model, **compile_options)``.
        compile_options: keyword arguments of ``torch.compile`` (``mode``, ``fullgraph``, ...).
        pad: fuse members that differ only in sizes (hidden widths, channels, embedding dims,
            feed-forward sizes, heads) by padding every tensor to the largest member's size,
            exactly: the padding stays zero in the forward, the backward and the optimizer
            steps, and an op where padding could change a result is refused (Note [Padded
            members] in fx/padding.py). Returns a :class:`PaddedWideModel`; members of one
            size compile as without it.

    Raises:
        ArchitectureMismatchError: members differ (the message names the member and the first
            difference).
        UnsupportedOperationError: an op has no wide form (names the op and the source line).

    Example:
        >>> import torch, wide_compiler as wc
        >>> mlp = lambda: torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
        >>> models = [mlp() for _ in range(8)]
        >>> wide = wc.compile(models, torch.randn(10, 16))
        >>> xs = torch.randn(8, 10, 16)                  # member i gets xs[i]
        >>> wide(xs).shape
        torch.Size([8, 10, 4])
        >>> x = torch.randn(10, 16)                      # one input for all members
        >>> torch.allclose(wide(x.expand(8, *x.shape))[3], models[3](x), atol=1e-5)
        True
        >>> members = wide.unfuse()                      # 8 ordinary nn.Sequential
    """
    config = config or WideConfig.default()
    config = config.replace(validate=validate or config.validate, strict=strict or config.strict)
    if isinstance(models, nn.Module):
        if n is None:
            raise ValueError("wide_compiler.compile: got one model; pass n=K to make K independent "
                             "members, or a list of models")
        if n < 1:
            raise ValueError(f"wide_compiler.compile: expected n >= 1, got {n}")
        members = _reinitialised_copies(models, n)
    else:
        members = list(models)
        if not members:
            raise ValueError("wide_compiler.compile: expected at least one model, got an empty list")
        for i, m in enumerate(members):
            if not isinstance(m, nn.Module):
                raise TypeError(f"wide_compiler.compile: member {i} is a {type(m).__name__}, "
                                "expected an nn.Module")
        members = [_plain_module(m, i) for i, m in enumerate(members)]
        if n is not None and n != len(members):
            raise ValueError(f"wide_compiler.compile: n={n} but {len(members)} models were given")
    refuse_reserved_names(members)
    args = sample_input if isinstance(sample_input, tuple) else (sample_input,)
    with outside_inference_mode():  # the stacked state made inside it could never train
        # a sample made inside inference mode: an ordinary copy (the members run on it with gradients)
        args, sample_kwargs = tree_map(_ordinary, (args, sample_kwargs))
        padded = None
        if pad:
            from .fx.padding import pad_members  # Note [The compiler imported when it compiles] (fx/compilation.py)
            from .padded import PaddedWideModel

            padded = pad_members(members, args, sample_kwargs)
        if padded is not None:
            originals, (members, info) = members, padded
        # Compile (the pipeline of fx/pipeline.py: checks, capture, widen, strategies, the stacked
        # state), then hold the result in the model.
        # Note [Running the members until compiling pays] (model_deferred.py): no capture yet
        stacked = (stack_members(members, args, sample_kwargs, config=config, dynamic_shapes=dynamic_shapes)
                   if config.defer and padded is None and not config.validate and not compile_model else None)
        if stacked is not None:
            wide = WideModel._from_compilation(stacked, deferred=deferred_members(members, aliases))
        else:
            from .fx.pipeline import compile_members

            wide = WideModel._from_compilation(compile_members(members, args, sample_kwargs, config=config,
                                                               dynamic_shapes=dynamic_shapes))
        if padded is not None:
            wide = PaddedWideModel._padded(wide, info, originals)
        note_wide_parameters(wide)  # Note [torch's norm clipping over a wide model] (torch_guards.py)
        if config.validate:  # a padded model against the user's own members (not their padded copies)
            _validate(wide, originals if padded is not None else members, args, sample_kwargs or {}, config)
    if not compile_model:
        return wide
    compiled = torch.compile(wide, **(compile_options or {}))
    compiled.__class__ = _compiled_wide_model()  # checks inputs before entering the compiled region
    return compiled


def _ordinary(x: Any) -> Any:
    """An inference tensor (made inside ``torch.inference_mode``) as an ordinary copy; else ``x``."""
    return x.clone() if isinstance(x, torch.Tensor) and x.is_inference() else x


@functools.cache
def _compiled_wide_model() -> type:
    """The class of ``torch.compile`` of a WideModel, made at its first use: defining it at import
    would import torch._dynamo (seconds), which a compile that loads its graphs from the compile
    cache never needs."""
    import torch._dynamo

    class _CompiledWideModel(torch._dynamo.eval_frame.OptimizedModule):
        """``torch.compile`` of a WideModel whose calls check their inputs first, in eager Python: a
        wrong input raises the WideModel's own error, never a torch.compile tracing failure."""

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            self._orig_mod.check_inputs(*args, **kwargs)
            return super().__call__(*args, **kwargs)

    return _CompiledWideModel


class WideBuilder:
    """Step-by-step construction of a wide model, for people who prefer it to keyword arguments.

    Example:
        >>> import torch, wide_compiler as wc
        >>> models = [torch.nn.Linear(4, 2) for _ in range(3)]
        >>> wide = (wc.WideBuilder(models).with_sample(torch.randn(5, 4)).validate()
        ...         .with_config(wc.WideConfig.fast()).build())
        >>> wide(torch.randn(3, 5, 4)).shape
        torch.Size([3, 5, 2])
    """

    def __init__(self, models: nn.Module | Sequence[nn.Module], *, n: int | None = None) -> None:
        self._models, self._n = models, n
        self._args: tuple | None = None
        self._kwargs: dict[str, Any] = {}
        self._options: dict[str, Any] = {}

    def with_sample(self, *args: Any, **kwargs: Any) -> WideBuilder:
        """One member's inputs, positional and keyword."""
        self._args, self._kwargs = args, kwargs
        return self

    def with_config(self, config: WideConfig) -> WideBuilder:
        self._options["config"] = config
        return self

    def with_dynamic_shapes(self, dynamic_shapes: Any) -> WideBuilder:
        self._options["dynamic_shapes"] = dynamic_shapes
        return self

    def pad(self, enabled: bool = True) -> WideBuilder:
        """Fuse members that differ only in sizes by padding (``compile(..., pad=True)``)."""
        self._options["pad"] = enabled
        return self

    def validate(self, enabled: bool = True) -> WideBuilder:
        """Check every member's output against its own model after compiling."""
        self._options["validate"] = enabled
        return self

    def strict(self, enabled: bool = True) -> WideBuilder:
        """Raise for ops with no wide rule instead of falling back."""
        self._options["strict"] = enabled
        return self

    def compile(self, **torch_compile_options: Any) -> WideBuilder:
        """Wrap the result in ``torch.compile`` with these options (``mode=...``, ``fullgraph=...``)."""
        self._options.update(compile_model=True, compile_options=torch_compile_options)
        return self

    def build(self) -> WideModel:
        if self._args is None:
            raise ValueError("WideBuilder: call .with_sample(...) with one member's input before .build()")
        return compile(self._models, self._args, n=self._n, sample_kwargs=self._kwargs, **self._options)


def _validate(wide: WideModel, members: Sequence[nn.Module], args: tuple, kwargs: dict,
              config: WideConfig) -> None:
    """Every member's outputs and buffers on its own (perturbed) sample and on the shared sample,
    through :func:`wide_compiler.testing.check_equivalence`: a float32 model against a float64
    run of its members (Note [The float64 reference] in _equivalence/reference.py) while ``config.rtol``
    and ``config.atol`` keep their defaults; with either changed, within those, fixed.

    Nothing is modified: members run on deep copies and the wide model's buffers are restored.
    A train graph with random ops (dropout...) is compared with every draw fixed to one value on
    both sides (Note [Fixed draws in the trust check] in _equivalence/draws.py), or in eval mode
    where a draw cannot be fixed."""
    # wide_compiler.testing's comparisons, which sit below api (Note [The harness in two layers])
    from . import _equivalence as testing
    from ._equivalence.draws import fixed_draws

    n = len(members)
    training = wide.training
    random = testing.random_ops(wide, training) if training else []
    fixed = (config.rtol, config.atol) != (WideConfig.rtol, WideConfig.atol)  # the defaults
    rtol, atol = (config.rtol, config.atol) if fixed else (None, None)
    _, per_member = testing.member_inputs((args, kwargs), n, seed=0, scale=0.01)
    checks = (("its own input", [a for a, _ in per_member], [k for _, k in per_member], False),
              ("the shared sample", args, kwargs, True))

    def run(training: bool) -> None:
        for label, inputs, kw, shared in checks:
            try:
                testing.check_equivalence(wide, members, inputs, kwargs=kw, shared=shared, grads=False,
                                          training=training, rtol=rtol, atol=atol,
                                          equal_nan=True)
            except AssertionError as e:
                mode = "train" if training else "eval"
                raise ValidationError(f"wide_compiler: validate ({mode} mode, on {label}): {e}") from None

    try:
        with fixed_draws(bool(random)) as unfixed:
            run(training)
    except ValidationError:
        if not unfixed:
            raise
    if unfixed:
        log.info("wide_compiler: validate: the train graph draws random numbers with %s, which the check "
                 "cannot fix to one value on both sides, so the members are compared in eval mode (on copies)",
                 ", ".join(sorted(unfixed)))
        training = False
        run(training)
    log.info("wide_compiler: validated %d members (%s mode)", n, "train" if training else "eval")


# --- layout helpers (API boundary only; see DESIGN §3) --------------------------------------


def stack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """N per-member tensors -> one N-first tensor ``[N, ...]``.

    >>> import torch, wide_compiler as wc
    >>> wc.stack([torch.zeros(2, 3), torch.ones(2, 3)]).shape
    torch.Size([2, 2, 3])
    """
    tensors = list(tensors)
    if not tensors:
        raise ValueError("wide_compiler.stack: expected at least one tensor")
    for i, t in enumerate(tensors):
        if t.shape != tensors[0].shape:
            raise ValueError(f"wide_compiler.stack: member {i} has shape {list(t.shape)}, "
                             f"member 0 has {list(tensors[0].shape)}")
    return torch.stack(tensors)


def unstack(t: torch.Tensor) -> list[torch.Tensor]:
    """One N-first tensor -> the list of its N members (views).

    A channel-packed tensor (from :func:`pack` or a :attr:`WideModel.packed` call) is refused:
    its dim 0 is the batch, so :func:`unpack` is the helper for it.

    >>> import torch, wide_compiler as wc
    >>> len(wc.unstack(torch.zeros(4, 2, 3)))
    4
    """
    if t.dim() < 1:
        raise ValueError("wide_compiler.unstack: expected a tensor with a member dim, got a 0-dim tensor")
    if layout_of(t) == "packed":
        raise ValueError("wide_compiler.unstack: this tensor is channel-packed [B, N*C, ...] (it came from "
                         "pack() or a wide.packed call): use wide_compiler.unpack(t, n)")
    return list(t.unbind(0))


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """N per-member tensors ``[B, C, ...]`` -> one channel-packed tensor ``[B, N*C, ...]`` (member
    i owns channels ``[i*C, (i+1)*C)``).

    >>> import torch, wide_compiler as wc
    >>> wc.pack([torch.zeros(2, 3, 5), torch.ones(2, 3, 5)]).shape
    torch.Size([2, 6, 5])
    """
    tensors = list(tensors)
    if not tensors:
        raise ValueError("wide_compiler.pack: expected at least one tensor")
    for i, t in enumerate(tensors):
        if t.dim() < 2 or t.shape != tensors[0].shape:
            raise ValueError(f"wide_compiler.pack: expected tensors [B, C, ...] of one shape; member "
                             f"{i} has {list(t.shape)}, member 0 has {list(tensors[0].shape)}")
    return tag_layout(torch.cat(tensors, dim=1), "packed")


def unpack(t: torch.Tensor, n: int, *, assume_packed: bool = False) -> list[torch.Tensor]:
    """A channel-packed tensor ``[B, N*C, ...]`` -> the list of N member tensors ``[B, C, ...]``.

    Never a silent wrong split: an N-first tensor (a :class:`WideModel` output, tagged as such) is
    refused with a pointer to :func:`unstack`, and so is an untagged tensor whose dim 0 equals
    ``n``, which could be either layout; pass ``assume_packed=True`` when you know it is packed.

    >>> import torch, wide_compiler as wc
    >>> [x.shape[1] for x in wc.unpack(torch.zeros(2, 6, 5), 3)]
    [2, 2, 2]
    >>> wc.unpack(torch.zeros(3, 6, 5), 3)
    Traceback (most recent call last):
    ...
    ValueError: wide_compiler.unpack: dim 0 of this [3, 6, 5] tensor is n=3, so it may be N-first [N, ...] (use wide_compiler.unstack(t) or t[i]) rather than packed [B, N*C, ...]; if it is packed, pass assume_packed=True
    """
    if t.dim() < 2 or n < 1 or t.shape[1] % n:
        raise ValueError(f"wide_compiler.unpack: expected [B, N*C, ...] with dim 1 divisible by "
                         f"n={n}, got {list(t.shape)}")
    layout = layout_of(t)
    if layout == "nfirst":
        raise ValueError("wide_compiler.unpack: this tensor is N-first [N, ...] (a WideModel output): member i "
                         "is t[i]; use wide_compiler.unstack(t) for the list, or wide.packed(...) to get "
                         "packed outputs")
    if layout is None and t.shape[0] == n and not assume_packed:
        raise ValueError(f"wide_compiler.unpack: dim 0 of this {list(t.shape)} tensor is n={n}, so it may be "
                         f"N-first [N, ...] (use wide_compiler.unstack(t) or t[i]) rather than packed "
                         f"[B, N*C, ...]; if it is packed, pass assume_packed=True")
    return list(t.chunk(n, dim=1))


