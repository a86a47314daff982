"""The member checks: are N members the same program, so that one wide model can run them all?

Three checks, from cheap to thorough (the pipeline, fx/pipeline.py, runs the first before the
capture and the others after it, as ``WideConfig.run_members`` / ``trace_members`` ask):

- :func:`check_members` (here) compares the modules themselves (class, module tree, training mode,
  hyperparameters and other attributes, hooks, parameter and buffer names, shapes, dtypes,
  devices) and returns the *per-member constants*: float attributes that may differ (Note
  [Per-member constants] in fx/constants.py).
- ``check_run_members`` (fx/member_runs.py) runs every member once on the sample and compares the
  ATen ops each runs.
- ``check_traced_members`` (fx/member_runs.py) captures every member with ``torch.export`` and
  compares its program with member 0's.

Errors are :class:`~wide_compiler.errors.ArchitectureMismatchError` naming the member, what
differs and, where known, the user's source line. Nothing of the user's changes.
"""
from __future__ import annotations

import copy
import logging
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..errors import ArchitectureMismatchError, UnsupportedOperationError
from .hook_writes import _hook_code, refuse_writing_hooks
from .state_reads import same_value

__all__ = ["check_members", "check_modes", "parameter_hook_refusal", "with_constants"]

log = logging.getLogger(__name__)

# nn.Module internals every module has; they are not hyperparameters.
_MODULE_INTERNALS = frozenset(nn.Module().__dict__) | {"_compiled_call_impl"}
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_state_dict_hooks", "_load_state_dict_pre_hooks")


_NUMBERS = (bool, int, float, complex)


def _same(a: Any, b: Any, depth: int = 0) -> bool:
    """Whether two attribute values of members are interchangeable (recursing into containers,
    function closures and plain objects without ``__eq__``)."""
    if depth > 8:
        return True
    if isinstance(a, weakref.ref) and isinstance(b, weakref.ref):  # e.g. nn.RNN's _flat_weight_refs
        return _same(a(), b(), depth + 1)
    if isinstance(a, nn.Parameter) and isinstance(b, nn.Parameter):
        # A parameter held as a plain attribute (nn.RNN's _flat_weights) is per-member state,
        # stacked like any parameter: compare what stacking needs, never the values.
        return (a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
                and a.requires_grad == b.requires_grad)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and a.device == b.device and torch.equal(a, b))
    if isinstance(a, nn.Module) or isinstance(b, nn.Module):
        return type(a) is type(b)  # each member's own submodule: its structure is checked elsewhere
    if hasattr(a, "__func__") and hasattr(a, "__self__"):  # bound methods
        return getattr(b, "__func__", None) is a.__func__ and _same(a.__self__, getattr(b, "__self__", None), depth + 1)
    if callable(a) and hasattr(a, "__code__"):  # functions and lambdas: code, closure, defaults
        if getattr(b, "__code__", None) != a.__code__:
            return False

        def cells(f):
            out = []
            for c in f.__closure__ or ():
                try:
                    out.append(c.cell_contents)
                except ValueError:  # an empty cell
                    out.append(None)
            return out

        return (_same(cells(a), cells(b), depth + 1) and _same(a.__defaults__, b.__defaults__, depth + 1)
                and _same(a.__kwdefaults__, b.__kwdefaults__, depth + 1))
    if isinstance(a, _NUMBERS) and isinstance(b, _NUMBERS):  # 1 is not 1.0 nor True, -0.0 not 0.0, nan is nan
        return same_value(a, b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y, depth + 1) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], depth + 1) for k in a)
    if type(a) is type(b) and type(a).__eq__ is object.__eq__:
        # Plain objects: compare their state as pickling sees it, which includes state kept
        # outside __dict__ (functools.partial's func/args/keywords, __slots__).
        sa, sb = _state(a), _state(b)
        if sa is not None and sb is not None:
            return _same(sa, sb, depth + 1)
    try:
        return bool(a == b)
    except Exception:
        return repr(a) == repr(b)


def _state(v: Any) -> Any:
    """An object's state for comparison: its ``__reduce_ex__`` arguments and state (the callable
    itself, a class, is compared by the type check), else ``vars(v)``, else None."""
    try:
        reduced = v.__reduce_ex__(4)
    except Exception:  # objects that refuse to pickle
        reduced = None
    if isinstance(reduced, tuple) and len(reduced) >= 2:
        return list(reduced[1:3])
    return vars(v) if hasattr(v, "__dict__") else None


def _describe(v: Any) -> str:
    if isinstance(v, weakref.ref):
        return f"a weak reference to {_describe(v())}"
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, (weakref.ref, nn.Parameter)) for x in v):
        return "[" + ", ".join(_describe(x) for x in v) + "]"
    if isinstance(v, nn.Parameter):
        return f"a parameter {list(v.shape)} {v.dtype}{'' if v.requires_grad else ' (requires_grad=False)'}"
    if callable(v) and hasattr(v, "__code__"):
        return f"function {v.__qualname__} (code, closure constants or defaults differ)"
    if (type(v).__eq__ is object.__eq__ and type(v).__repr__ is object.__repr__ and hasattr(v, "__dict__")
            and not isinstance(v, type)):
        return f"{type(v).__name__}({', '.join(f'{k}={_describe(x)}' for k, x in vars(v).items())})"
    if isinstance(v, torch.Tensor):
        values = v.detach().flatten()[:6].tolist() if v.device.type != "meta" else "?"
        return f"a tensor {list(v.shape)} {v.dtype} starting {values}"
    if isinstance(v, torch.Size):
        return str(list(v))
    return repr(v) if not callable(v) else getattr(v, "__qualname__", repr(v))


def _module_class(m: nn.Module) -> type:
    """A module's class; for a parametrized module (``weight_norm``, ``spectral_norm``, which
    create a class per instance) the original class: its parametrizations are submodules, checked
    like any other."""
    if torch.nn.utils.parametrize.is_parametrized(m):
        return type(m).__bases__[0]
    return type(m)


# Note [Submodules in another mode than their member]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A wide model has one mode per graph: ``wide.train()`` and ``wide.eval()`` choose the train or
# the eval program, as torch's ``train()``/``eval()`` set every submodule of a member to one mode.
# A member whose submodule is in another mode than the member itself (``m.train(); m[1].eval()``:
# a frozen BatchNorm while fine-tuning; ``m.eval(); m[2].train()``: Monte Carlo dropout) is a
# third program, which the wide model could neither capture as the user has it nor keep across
# its own train()/eval() (torch's would reset the submodule). So it is refused at compile, before
# any capture, naming the member, the submodule and both modes. A submodule in another mode is
# harmless where no code that could read its mode does: neither its own classes (and those of the
# modules under it) nor the classes of the modules above it name ``training`` (nn.Module's own
# methods aside). A ``nn.Linear`` head added after ``model.eval()`` is in train mode and reads no
# mode, so it is let through; a BatchNorm, a Dropout, or any user code reading ``.training`` is not.
def _code_names(code: Any, depth: int = 0) -> set[str]:
    names = set(code.co_names)
    if depth < 8:
        for c in code.co_consts:
            if hasattr(c, "co_names"):
                names |= _code_names(c, depth + 1)
    return names


_READS_MODE: dict[type, bool] = {}


def _reads_mode(cls: type) -> bool:
    """Whether code of ``cls`` (its classes up to nn.Module, not nn.Module's own) names ``training``."""
    if cls not in _READS_MODE:
        found = False
        for klass in cls.__mro__:
            if klass in (nn.Module, object):
                continue
            for v in vars(klass).values():
                fn = getattr(v, "__func__", v)
                fn = getattr(fn, "fget", fn)
                code = getattr(fn, "__code__", None)
                if code is not None and "training" in _code_names(code):
                    found = True
        _READS_MODE[cls] = found
    return _READS_MODE[cls]


def check_modes(models: Sequence[nn.Module]) -> None:
    """Raise :class:`ArchitectureMismatchError` when a member has a submodule in another train/eval
    mode than the member itself where code may read it (Note [Submodules in another mode than
    their member]): the wide model has one mode for all its modules.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> m = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).train()
        >>> _ = m[1].eval()
        >>> check_modes([m])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        wide_compiler.errors.ArchitectureMismatchError: member 0: submodule '1' (BatchNorm1d) is in eval mode...
    """
    for i, model in enumerate(models):
        top = model.training
        named = list(model.named_modules(remove_duplicate=False))
        for path, sub in named:
            if sub.training == top:
                continue
            prefix = f"{path}."
            related = [m for p, m in named if p == path or p.startswith(prefix)
                       or path.startswith(f"{p}.") or p == ""]
            readers = sorted({type(m).__name__ for m in related if _reads_mode(type(m))})
            if not readers:
                continue
            mode, other = ("train", "eval") if sub.training else ("eval", "train")
            raise ArchitectureMismatchError(
                f"member {i}: submodule '{path}' ({type(sub).__name__}) is in {mode} mode, but the member "
                f"({type(model).__name__}) is in {other} mode, and code there reads the mode "
                f"({', '.join(readers)}). A wide model runs all its modules in one mode (wide.train() / "
                f"wide.eval() set every module's, as torch's train()/eval() do), so it cannot keep this "
                f"submodule's. What to do: compile members whose modules are all in one mode (call "
                f"{'m.train()' if top else 'm.eval()'} or {'m.eval()' if top else 'm.train()'} on each member "
                f"last), and make a mode that must not follow it part of the code: a frozen BatchNorm as a "
                f"module that always uses its running statistics (torchvision.ops.FrozenBatchNorm2d), dropout "
                f"that always drops as F.dropout(x, p, training=True) (Note [Submodules in another mode than "
                f"their member] in fx/member_checks.py)")


def check_members(models: Sequence[nn.Module]) -> dict[str, tuple]:
    """Raise :class:`ArchitectureMismatchError` unless every member is the same program as
    member 0: class, module tree and types, training mode, hyperparameters and other non-tensor
    attributes, hooks, and parameter/buffer names, shapes, dtypes, devices and requires_grad.

    Returns the *per-member constants*: module attributes that are Python numbers, at least one
    of them a float, and differ between members (``nn.Dropout.p``, ``nn.LeakyReLU.negative_slope``,
    ``LayerNorm.eps``, a user's ``self.temperature``), as ``{attribute path: (value of member 0,
    ..., value of member N-1)}``. They are not refused here: the compiler traces the program with
    them changed and makes the ops that read them per member, or refuses naming them (Note
    [Per-member constants] in fx/constants.py). Integers (possibly sizes), booleans (flags) and
    anything else that differs are refused.

    What is not compared by value, and why: ``nn.Module``'s own bookkeeping (``_parameters``,
    ``_modules``, hook dicts, ...: checked structurally instead); parameters held as plain
    attributes (``nn.RNN._flat_weights``) and weak references to them (``_flat_weight_refs``),
    which are each member's own weights (compared by shape, dtype, device, requires_grad);
    submodules held as attributes (compared by type; their contents are checked as modules).
    A submodule in another mode than its member is refused (:func:`check_modes`)."""
    from ..torch_guards import watch_torch_optimizers

    watch_torch_optimizers()  # Note [torch.optim optimizers that mix members] (torch_guards.py): once per process
    _check_no_sharing(models)
    _check_no_overlap(models)
    _check_same_ties(models)
    check_modes(models)
    for i, model in enumerate(models):  # before anything runs a member (Note [Hooks that write outside themselves])
        refuse_writing_hooks(model, i)
    _refuse_parameter_hooks(models)
    ref = models[0]
    ref_modules = list(ref.named_modules(remove_duplicate=False))
    floats: dict[str, tuple[str, str]] = {}  # attribute path -> (module path, attribute)
    shapes = [{k: tuple(v.shape) for k, v in m.state_dict().items() if isinstance(v, torch.Tensor)} for m in models]
    for i, model in enumerate(models[1:], start=1):
        def fail(what: str, got: Any, want: Any) -> None:
            ints = type(got) is int and type(want) is int
            if what.endswith(".shape") or ints and shapes[i] != shapes[0]:
                hint = "; members that differ only in sizes fuse padded: compile(..., pad=True)"
            elif ints:  # the tensors' sizes agree: this integer is no size padding could follow
                hint = ("; the members' tensors have the same sizes, so this integer is not a size padding could "
                        "follow (pad=True pads tensors only): members must agree on it, or, for a multiplier, make "
                        f"it a float ({what.rsplit('.', 1)[-1]} = {float(got)!r}), which may differ per member "
                        "(Note [Per-member constants] in fx/constants.py)")
            else:
                hint = ""
            raise ArchitectureMismatchError(
                f"member {i}: {what} is {_describe(got)}, member 0 has {_describe(want)}{hint}")

        mods = list(model.named_modules(remove_duplicate=False))
        for (name0, m0), (name, m) in zip(ref_modules, mods):
            where = name or f"the model ({type(m0).__name__})"
            if name != name0:
                fail("the module tree", f"'{name}'", f"'{name0}' at that position")
            if _module_class(m) is not _module_class(m0):
                got, want = type(m).__name__, type(m0).__name__
                if got == want:  # two classes of one name: say so (a class defined again, fx tracing)
                    got, want = (f"{t.__module__}.{t.__qualname__} (another class of that name: a class defined again, "
                                 "or made per module as torch.fx.symbolic_trace does; members must be instances of "
                                 "one class)" if t is type(m) else f"{t.__module__}.{t.__qualname__}"
                                 for t in (type(m), type(m0)))
                fail(f"type of {where}", got, want)
            if m.training != m0.training:
                fail(f"{name}.training" if name else "training", m.training, m0.training)
            keys = (set(m.__dict__) | set(m0.__dict__)) - _MODULE_INTERNALS
            for key in sorted(keys, key=lambda k: (k.startswith("_"), k)):  # configuration first
                prefix = f"{name}.{key}" if name else key
                if key not in m.__dict__ or key not in m0.__dict__:
                    fail(f"attribute {prefix}", "present" if key in m.__dict__ else "absent",
                         "present" if key in m0.__dict__ else "absent")
                if not _same(m.__dict__[key], m0.__dict__[key]):
                    if _is_float_constant(m.__dict__[key], m0.__dict__[key]):
                        floats[prefix] = (name, key)
                        continue
                    fail(prefix, m.__dict__[key], m0.__dict__[key])
            for hooks in _HOOK_DICTS:
                n_got, n_want = len(getattr(m, hooks, {})), len(getattr(m0, hooks, {}))
                if n_got != n_want:
                    fail(f"number of {hooks} on {where}", n_got, n_want)
        if len(mods) != len(ref_modules):
            fail("the number of submodules", len(mods), len(ref_modules))
        for kind, named in (("parameter", "named_parameters"), ("buffer", "named_buffers")):
            got = dict(getattr(model, named)())
            want = dict(getattr(ref, named)())
            if got.keys() != want.keys():
                fail(f"the set of {kind}s", sorted(got), sorted(want))
            for name, t0 in want.items():
                t = got[name]
                for attr in ("shape", "dtype", "device", "requires_grad"):
                    if getattr(t, attr) != getattr(t0, attr):
                        fail(f"{name}.{attr}", getattr(t, attr), getattr(t0, attr))
    constants = {}
    for prefix, (path, key) in floats.items():
        values = tuple(m.get_submodule(path).__dict__[key] for m in models)
        bad = next((j for j, v in enumerate(values) if not _is_float_constant(v, values[0])
                    and not _same(v, values[0])), None)
        if bad is not None:  # say 0.5 for member 1 but 2 (an int) for member 2 and 3 for member 0
            raise ArchitectureMismatchError(
                f"member {bad}: {prefix} is {_describe(values[bad])}, member 0 has {_describe(values[0])}")
        constants[prefix] = values
    return constants


# Note [Hooks on a member's parameters]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A hook on a member's parameter (``p.register_hook(lambda g: g * mask)``: gradient-mask pruning,
# clipping by hook; ``p.register_post_accumulate_grad_hook``: optimizer-in-backward, zeroing) runs
# in that member's backward. The wide model's parameters are new tensors (each stacks one
# parameter of every member) and the capture runs a copy of member 0, which has no hooks (a deep
# copy drops them), so no wide backward would run them: the gradients would be the un-hooked ones,
# silently (probe 6 of issue 44, F6; and wc.testing.check_compile, comparing copies, would agree).
# They cannot be honoured exactly in general: a hook is Python that may read its member's own
# parameter or state through its closure, which the wide model does not update. So a train-mode
# compile is refused naming the member, the parameter and the hook, before anything runs; an
# eval-mode one warns (its forward values are the members') and the wide model keeps the refusal:
# ``wide.train()`` raises it (WideModel._compile), as a train-mode compile would. The way out is
# to put the hook on the wide model's parameter, which holds every member's slice along dim 0.
def _refuse_parameter_hooks(models: Sequence[nn.Module]) -> None:
    """Raise :class:`~wide_compiler.errors.UnsupportedOperationError` when a train-mode member has
    a gradient hook on a parameter (``Tensor.register_hook``, ``register_post_accumulate_grad_hook``),
    naming the member, parameter and hook; warn for eval-mode members (Note [Hooks on a member's
    parameters]).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> m = nn.Linear(2, 2)
        >>> _ = m.weight.register_hook(lambda g: g * 0.5)
        >>> _refuse_parameter_hooks([m])  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        wide_compiler.errors.UnsupportedOperationError: wide_compiler: member 0's parameter 'weight' has a gradient hook...
    """
    found = parameter_hook_refusal(models)
    if found is None:
        return
    message, training = found
    if not training:
        log.warning("%s (it compiles in eval mode: its forward values are the members'; a backward through "
                    "it would not run the hook, and wide.train() is refused)", message.split("\n")[0])
        return
    raise UnsupportedOperationError(message)


def parameter_hook_refusal(models: Sequence[nn.Module]) -> tuple[str, bool] | None:
    """``(message, training)`` for the first member with a gradient hook on a parameter (Note
    [Hooks on a member's parameters]): the refusal's text and that member's mode; None without."""
    for i, model in enumerate(models):
        for name, p in model.named_parameters():
            found = [(kind, h) for kind, table in (("gradient hook (Tensor.register_hook)", "_backward_hooks"),
                                                   ("post-accumulate-grad hook (register_post_accumulate_grad_hook)",
                                                    "_post_accumulate_grad_hooks"))
                     for h in (getattr(p, table, None) or {}).values()
                     if not type(h).__module__.startswith("wide_compiler.")]  # a padded model's gradient masks
            if not found:
                continue
            kind, hook = found[0]
            code = _hook_code(hook)
            what = (f"member {i}'s parameter {name!r} has a {kind}, "
                    f"{getattr(hook, '__qualname__', type(hook).__name__)}"
                    + (f" at {code.co_filename}:{code.co_firstlineno}" if code is not None else "")
                    + (f" (and {len(found) - 1} more)" if len(found) > 1 else ""))
            return (
                f"wide_compiler: {what}. The wide model's parameters are its own tensors (each stacks one parameter "
                "of every member) and no wide backward runs a member's parameter hooks: its gradients would be the "
                "ones without the hook (Note [Hooks on a member's parameters] in fx/member_checks.py).\n"
                "What to do: remove the hooks before compiling (keep the handle register_hook returns and call "
                "handle.remove()), and register the hook on the wide model's parameter instead, which holds every "
                f"member's slice along dim 0 (wide.get_parameter({name!r}).register_hook(lambda g: g * mask) with "
                "mask stacked per member); or compile in eval mode.", model.training)
    return None


def _is_float_constant(a: Any, b: Any) -> bool:
    """Whether two differing attribute values can be a per-member constant: numbers, not
    booleans, at least one a float (two differing ints may be sizes and are refused)."""
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    return number(a) and number(b) and (isinstance(a, float) or isinstance(b, float))


def with_constants(model: nn.Module, constants: dict[str, tuple], i: int, *, copy_model: bool = True) -> nn.Module:
    """``model`` (a deep copy unless ``copy_model=False``) with every per-member constant set to
    member ``i``'s value (``constants`` as :func:`check_members` returns them)."""
    out = copy.deepcopy(model) if copy_model else model
    for prefix, values in constants.items():
        path, _, key = prefix.rpartition(".")
        setattr(out.get_submodule(path) if path else out, key, values[i])
    return out


def _check_no_sharing(models: Sequence[nn.Module]) -> None:
    """Members own their modules and tensors: one object reachable from two members (the same
    model passed twice, a submodule or parameter shared between members) would be untied by
    stacking and written back from one member only, so it is refused."""
    owner: dict[int, tuple[int, str]] = {}
    for i, model in enumerate(models):
        named = [*model.named_modules(remove_duplicate=False),
                 *model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        seen_here: set[int] = set()
        for name, obj in named:
            key = id(obj)
            if key in seen_here:
                continue  # tied inside one member: that member's own business
            seen_here.add(key)
            if key in owner:
                j, name_j = owner[key]
                what = "the same model object" if not name and not name_j else (
                    f"one {type(obj).__name__} object ('{name_j or 'the model'}' of member {j}, "
                    f"'{name or 'the model'}' of member {i})")
                raise ArchitectureMismatchError(
                    f"member {i} and member {j} share {what}: members must be independent copies "
                    "(stacking would untie them and write_back would keep one member's values); "
                    "pass copy.deepcopy(model) for each member")
            owner[key] = (i, name)


# Note [State tensors that overlap]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Two parameters or buffers may be views of one memory: ``register_buffer("lo", full[:4])`` beside
# ``register_buffer("full", full)``; a write through one is seen through the other. The wide model
# stacks each into its own ``[N, ...]`` tensor, so the tie is lost: a forward updating ``lo`` in place
# left ``full`` unchanged (probe 9 of issue 44, P9-9: 0.36 off, and ``member(0).lo`` no longer a view).
# So parameters and buffers of a member whose memory overlaps are refused, naming both (the same
# tensor registered twice, a tied weight, stays allowed: it is one tensor to stack); so is memory
# shared between members (untied by stacking, as a shared object is). Views of one storage that do
# not overlap (cuDNN's flattened RNN weights) are two tensors and fine.
def _span(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(storage, first byte, end byte) of the memory ``t`` can reach, or None (no plain storage)."""
    if t.layout != torch.strided or t.numel() == 0 or t.device.type == "meta":
        return None
    try:
        base = t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 -- a tensor subclass without storage: not compared
        return None
    size = t.element_size()
    first = t.storage_offset() * size
    extent = 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride()))
    return base, first, first + extent * size


def _check_no_overlap(models: Sequence[nn.Module]) -> None:
    """Note [State tensors that overlap]: refuse parameters and buffers whose memory overlaps
    another's (in one member, or across members)."""
    by_storage: dict[int, list[tuple[int, int, int, str, int]]] = {}  # storage -> (first, end, member, what, id)
    for i, model in enumerate(models):
        seen: set[int] = set()
        for kind, named in (("parameter", model.named_parameters), ("buffer", model.named_buffers)):
            for name, t in named(remove_duplicate=False):
                if id(t) in seen:
                    continue  # the same tensor twice (tied): one tensor to stack
                seen.add(id(t))
                span = _span(t)
                if span is None:
                    continue
                storage, first, end = span
                for f, e, j, other, tid in by_storage.get(storage, ()):  # other: "buffer 'full'"
                    if f < end and first < e and tid != id(t):
                        if j == i:
                            raise ArchitectureMismatchError(
                                f"member {i}'s {kind} {name!r} shares memory with its {other} (a view of it, or "
                                "both of one tensor): a write through one changes the other, which the wide "
                                "model cannot keep (it stacks each into its own [N, ...] tensor). Register one "
                                "of them and compute the other in forward (e.g. self.full[:4]), or register "
                                "independent tensors (.clone())")
                        raise ArchitectureMismatchError(
                            f"member {i}'s {kind} {name!r} shares memory with member {j}'s {other}: members "
                            "must be independent copies (stacking would untie them); pass copy.deepcopy(model) "
                            "for each member")
                by_storage.setdefault(storage, []).append((first, end, i, f"{kind} {name!r}", id(t)))


# Note [Members tied alike]
# ~~~~~~~~~~~~~~~~~~~~~~~~~
# Which paths of a member reach one and the same module or tensor is part of its program:
# ``self.active = self.a if use_a else self.b`` (an architecture choice in a sweep) gives members
# the same module paths and parameter names, and the graph of member 0 wires ``active`` to ``a``
# for every member (probe 9 of issue 44, P9-23: member 1, whose ``active`` is its ``b``, 0.39 off;
# a router grouped such towers too). Every member must tie alike: the same paths reach one
# module (or parameter, or buffer) as in member 0, else it is refused naming the path and what it
# reaches in each. (The compile cache key holds the same ties: fx/cache_key.py.)
def _ties(model: nn.Module) -> dict[str, str]:
    """Each path (module, parameter or buffer) that reaches an object an earlier path reached ->
    that earlier path."""
    first: dict[int, str] = {}
    ties = {}
    named = [*model.named_modules(remove_duplicate=False), *model.named_parameters(remove_duplicate=False),
             *model.named_buffers(remove_duplicate=False)]
    for path, obj in named:
        seen = first.setdefault(id(obj), path)
        if seen != path:
            ties[path] = seen
    return ties


def _check_same_ties(models: Sequence[nn.Module]) -> None:
    """Note [Members tied alike]."""
    want = _ties(models[0])
    for i, model in enumerate(models[1:], start=1):
        got = _ties(model)
        if got == want:
            continue
        path = next(p for p in sorted(set(got) | set(want)) if got.get(p) != want.get(p))

        def says(ties: dict[str, str]) -> str:
            return f"is its {ties[path]!r}" if path in ties else "is its own (reached by no other path)"

        raise ArchitectureMismatchError(
            f"member {i}: {path!r} {says(got)}, member 0's {says(want)}: the members are wired differently "
            "(which paths reach one module or tensor is part of the program); compile members wired alike, or "
            "one wide model per wiring")
