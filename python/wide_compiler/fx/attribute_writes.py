"""What a member's forward writes into its own modules' Python attributes during the capture.

Note [A forward that writes its module's attributes]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A forward may keep state across calls in plain attributes of its modules: a step counter
(``self.step += 1`` for a warm-up weight), the hidden state of truncated BPTT
(``self.hidden = h.detach()``), a list it appends to. Each member alone then computes another
program at every call. The exported graph runs the capture's values for ever and writes nothing
back (export bakes a Python number, and a tensor attribute is a constant to it), so the wide
model would be silently wrong from its second call on. Registered buffers are different: export
captures an in-place update or a reassignment of one as a graph output, and the wide model carries
it per member (those are not looked at here).

So the capture looks at every module's ``__dict__`` (its plain attributes: not parameters,
buffers, submodules, hooks or ``training``) before export runs the forward and at the end of
each run of the root's forward (export puts its own copies back before it returns): another
object (a tensor, a new list), another number or string, a tensor written in place (its version
counter moved), or a list, dict or set whose items changed, is a write. A write is harmful when
the forward reads the old value first (a counter, a carried state); scratch state that every
call sets before reading it (transformers' Funnel sets ``self.seq_len`` at the start of each
forward) is not. To tell them apart, a copy of member 0 runs eagerly twice on the capture's
inputs: as it is, and with each written attribute replaced by a stand-in that arithmetic,
method calls and item access keep a stand-in (so a call counter or a history list that only
feeds itself runs through) and any use that could reach an output raises (a comparison, a
conversion, a length, a torch op); an error or other outputs mean the old value is read. A flag set once (``absent``/False to True:
transformers installs its output-capturing hooks on a first call so) is accepted where a second
run computes the same outputs as the first (judged on the capture's inputs: the one place this
check samples). Otherwise the capture is refused naming the module, the attribute and the
change, with what to do instead (a registered buffer updated in place, which the wide model
keeps per member; or the state passed in and returned). The attributes, and the hooks the
forward installed, are put back at the end: the captured module (a copy of member 0) is left
as it was (a tensor written in place excepted). A write on a path the capture's call does not take (a
cache refilled only at longer inputs) is seen when a call takes it: that call's capture refuses.

The same holds one level down and more: a module may keep its state in a plain object it holds
(``self.state.step += 1`` on a dataclass, a ``SimpleNamespace`` or an instance of the user's own
class; ``self.state.seen.append(...)``; such objects inside a list, tuple or dict attribute).
:func:`held_objects` finds them (at most ``_MAX_DEPTH`` steps below a module's attribute and
``_MAX_HELD`` objects: instances of classes of the standard library, torch, numpy or an installed
package are not looked into, their writes being the library's bookkeeping, a logger's cache); their
``__dict__`` is compared as a module's is, a write is named by its path (``self.state.step of the
root``), judged by the same runs (the stand-in replaces the held object's attribute) and put back at
exit. :func:`~wide_compiler.fx.sample_check.attributes_kept` puts them back the same way after a
member ran in place (probe 8 of issue 44: P8-3, P8-4).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import inspect
import logging
import os
import sys
import types
import warnings
from typing import Any

import torch
from torch import nn

from ..errors import WideCompileError

log = logging.getLogger("wide_compiler.fx.capture")

__all__ = ["AttributeWrites", "held_objects", "put_back_held"]

# nn.Module's own bookkeeping in __dict__: not state the forward computes with
_MODULE_KEYS = frozenset({"_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", "training",
                          "_backward_pre_hooks", "_backward_hooks", "_is_full_backward_hook", "_forward_hooks",
                          "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
                          "_forward_pre_hooks_with_kwargs", "_state_dict_hooks", "_state_dict_pre_hooks",
                          "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks", "forward"})
_SCALARS = (int, float, complex, bool, str, bytes, type(None))
_ABSENT = object()
# what torch's recurrent layers rewrite from their parameters (export swaps them): the flat weight lists
_RNN_KEYS = frozenset({"_flat_weights", "_flat_weights_names", "_all_weights", "_flat_weight_refs"})


_MAX_DEPTH = 4  # steps (attributes, items) below a module's attribute looked into for held objects
_MAX_HELD = 256  # held objects looked at per model
_MAX_ITEMS = 64  # items of a list, tuple or dict looked through for held objects
_SITE = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)
_LIBRARIES = frozenset({"builtins", "torch", "numpy", "wide_compiler", "typing"})
_NOT_HELD = (nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType, types.MethodType,
             types.BuiltinFunctionType, functools.partial)

Step = tuple[str, Any]  # ("attr", name) or ("item", key)


def _held(v: Any) -> bool:
    """Whether ``v`` is an object whose attributes are state a forward may keep (Note [A forward
    that writes its module's attributes]): a namespace, or an instance of the user's own class
    with a ``__dict__`` (a dataclass among them); not a module, tensor, class, function, nor an
    object of the standard library's, torch's, numpy's or an installed package's classes (a
    transformers config, a dataclass too, is the library's: its lazily set ``problem_type``).

    >>> import types
    >>> _held(types.SimpleNamespace(step=0)), _held([1]), _held(torch.nn.Linear(1, 1))
    (True, False, False)
    """
    if isinstance(v, (types.SimpleNamespace, argparse.Namespace)):
        return True
    if isinstance(v, _NOT_HELD) or not isinstance(getattr(v, "__dict__", None), dict):
        return False
    module = type(v).__module__ or ""
    if module.partition(".")[0] in _LIBRARIES or module.partition(".")[0] in sys.stdlib_module_names:
        return False
    file = getattr(sys.modules.get(module), "__file__", None) or ""
    return not any(d in file for d in _SITE)  # a library's (transformers' configs are dataclasses): its own


def held_objects(roots: list[tuple[str, nn.Module]]) -> list[tuple[str, tuple[Step, ...], Any]]:
    """The plain objects the modules ``roots`` (``(path, module)``) hold, as ``(module path, steps
    from the module, object)``, each once (Note [A forward that writes its module's attributes]).

    >>> import types
    >>> m = torch.nn.Linear(1, 1)
    >>> m.state = types.SimpleNamespace(step=0, inner=[types.SimpleNamespace(n=1)])
    >>> [(p, s) for p, s, _ in held_objects([("", m)])]
    [('', (('attr', 'state'),)), ('', (('attr', 'state'), ('attr', 'inner'), ('item', 0)))]
    """
    out: list[tuple[str, tuple[Step, ...], Any]] = []
    seen: set[int] = set()

    def walk(path: str, steps: tuple[Step, ...], v: Any) -> None:
        if len(steps) > _MAX_DEPTH or len(out) >= _MAX_HELD:
            return
        if type(v) in (list, tuple) and len(v) <= _MAX_ITEMS:
            for i, x in enumerate(v):
                walk(path, (*steps, ("item", i)), x)
        elif type(v) is dict and len(v) <= _MAX_ITEMS:
            for k, x in list(v.items()):
                walk(path, (*steps, ("item", k)), x)
        elif id(v) not in seen and _held(v):
            seen.add(id(v))
            out.append((path, steps, v))
            for k, x in list(vars(v).items()):
                walk(path, (*steps, ("attr", k)), x)

    for path, m in roots:
        for k, v in list(vars(m).items()):
            if k not in _skipped(m):
                walk(path, (("attr", k),), v)
    return out


def put_back_held(saved: list[tuple[Any, dict[str, tuple[Any, Any]]]]) -> None:
    """Put back held objects' attributes (``saved``: ``(object, {name: (value, _contents(value))})``
    taken before): attributes added since are removed, rebound ones get their old object, lists,
    dicts and sets their old contents."""
    for obj, attrs in saved:
        now = vars(obj)
        for k in [k for k in now if k not in attrs]:
            del now[k]
        for k, (v, items) in attrs.items():
            _put_back_contents(v, items)
            now[k] = v


def _put_back_contents(v: Any, items: Any) -> None:
    if isinstance(items, list) and isinstance(v, list):
        v[:] = items
    elif isinstance(items, (dict, set)) and isinstance(v, (dict, set)):
        v.clear()
        v.update(items)  # type: ignore[arg-type]


def _snapshot(obj: Any) -> dict[str, tuple[Any, Any]]:
    return {k: (v, _contents(v)) for k, v in vars(obj).items()}


def _expr(steps: tuple[Step, ...]) -> str:
    """``self.state.seen`` / ``self.st['a'].n``: where a write is, read from its module."""
    return "self" + "".join(f".{k}" if kind == "attr" else f"[{k!r}]" for kind, k in steps)


def _follow(m: nn.Module, steps: tuple[Step, ...]) -> Any:
    obj: Any = m
    for kind, k in steps:
        obj = vars(obj)[k] if kind == "attr" else obj[k]
    return obj


def _skipped(m: nn.Module) -> frozenset[str]:
    return _MODULE_KEYS | _RNN_KEYS if isinstance(m, nn.RNNBase) else _MODULE_KEYS


def _contents(v: Any) -> Any:
    """A shallow copy of a mutable container's items (compared by identity), a tensor's version
    counter (moved by an in-place write), else None."""
    if isinstance(v, torch.Tensor):
        return v._version
    if isinstance(v, list):
        return list(v)
    if isinstance(v, dict):
        return dict(v)
    if isinstance(v, set):
        return set(v)
    return None


def _same(before: Any, items: Any, after: Any) -> bool:
    if isinstance(before, _SCALARS) or isinstance(after, _SCALARS):
        return type(before) is type(after) and (before == after or before != before)  # NaN stays NaN
    if before is not after:
        return False
    now = _contents(after)
    if items is None or now is None:
        return True
    if isinstance(after, torch.Tensor):
        return items == now
    if isinstance(items, dict):
        return items.keys() == now.keys() and all(items[k] is now[k] for k in items)
    if isinstance(items, set):
        return items == now
    return len(items) == len(now) and all(a is b for a, b in zip(items, now))


def _shown(v: Any) -> str:
    # a tensor the capture wrote is a FakeTensor (or another subclass): shown as the user sees it
    kind = "Tensor" if isinstance(v, torch.Tensor) else type(v).__name__
    text = repr(v) if isinstance(v, _SCALARS) else f"a {kind}"
    return text if len(text) <= 60 else text[:57] + "..."


# Note [A buffer rebound in forward]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A forward may rebind a registered buffer instead of updating it in place:
# ``self.running_mean = (1 - m) * self.running_mean + m * mean`` in a hand-written BatchNorm or
# EMA codebook, ``self.step = self.step + 1``. torch.export records that as an update of the buffer
# only for the root module's own buffers: in a submodule the graph writes nothing back, so the
# wide model's statistics never moved (probe 9 of issue 44, P9-22: a hand-written BatchNorm's
# running mean stayed 0, eval 0.4 off). A buffer rebound to another shape or dtype (a history
# grown with ``torch.cat``, an integer counter made float by ``+ 0.5``) cannot be kept in the
# wide model's fixed ``[N, ...]`` state either: the write-back broadcast into the old buffer and
# kept nothing (P9-16, 0.5-1.1 off from the second call); and a buffer registered at the first
# call of the forward (a lazy buffer) left the graph with a value of the wrong rank (P9-17, an
# internal error). So the capture records, at the end of each forward, the buffers whose object
# changed and refuses those three (a root buffer rebound with its shape and dtype, which export
# records, is kept), saying what to write instead; the buffers are put back as registered.


class AttributeWrites:
    """Around one export of ``model``: records what the forward wrote into plain attributes of
    its modules (seen at the end of each call of the root's forward: export puts the modules
    back before it returns), puts them back at exit, and :meth:`check` then refuses (Note [A
    forward that writes its module's attributes])."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.before: list[tuple[str, nn.Module, dict[str, tuple[Any, Any]]]] = []
        # the plain objects the modules hold: (module path, steps to the object, object, its attributes)
        self.held: list[tuple[str, tuple[Step, ...], Any, dict[str, tuple[Any, Any]]]] = []
        # (module path, steps to the attribute written) -> (module class, was, now)
        self.writes: dict[tuple[str, tuple[Step, ...]], tuple[str, str, str]] = {}
        self.saved_forward: Any = None
        self.hooks: list[tuple[dict, dict]] = []
        # Note [A buffer rebound in forward]: each module's buffers as registered, and what the
        # forward rebound or registered: (module path, buffer name) -> (was, now)
        self.buffers: list[tuple[str, nn.Module, dict[str, Any]]] = []
        self.rebound: dict[tuple[str, str], tuple[Any, Any]] = {}

    def __enter__(self) -> AttributeWrites:
        self.before = [(name, m, {k: (v, _contents(v)) for k, v in vars(m).items() if k not in _skipped(m)})
                       for name, m in self.model.named_modules(remove_duplicate=True)]
        self.held = [(path, steps, obj, _snapshot(obj))
                     for path, steps, obj in held_objects([(name, m) for name, m, _ in self.before])]
        # hooks the forward installs on a first call (transformers' output capturing) go too
        self.hooks = [(d, dict(d)) for _, m in self.model.named_modules() for k, d in vars(m).items()
                      if k.startswith("_") and "hooks" in k and isinstance(d, dict)]
        self.buffers = [(path, m, dict(m._buffers)) for path, m, _ in self.before]
        self.saved_forward = vars(self.model).get("forward", _ABSENT)
        inner = self.model.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            # Note [A buffer rebound in forward]: the buffers as this call starts (export has swapped
            # in its own by then)
            start = [(path, m, dict(m._buffers)) for path, m, _ in self.buffers]
            out = inner(*args, **kwargs)
            self._compare(restore=False)
            for path, m, was in start:
                for name, t in m._buffers.items():
                    if t is not was.get(name, _ABSENT):
                        self.rebound.setdefault((path, name), (was.get(name, _ABSENT), t))
            return out

        # what export reads to bind the inputs: the bound forward's parameters (not __wrapped__,
        # which a decorated forward's bound method passes on to the function, self included)
        with contextlib.suppress(ValueError, TypeError):  # no signature to read: export reads the wrapper's
            forward.__signature__ = inspect.signature(inner)  # type: ignore[attr-defined]
        object.__setattr__(self.model, "forward", forward)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.saved_forward is _ABSENT:
            del self.model.__dict__["forward"]
        else:
            object.__setattr__(self.model, "forward", self.saved_forward)
        self._compare(restore=True)
        for _, m, was in self.buffers:  # the buffers as registered (export puts back only those it records)
            if m._buffers.keys() != was.keys() or any(m._buffers[k] is not v for k, v in was.items()):
                m._buffers.clear()
                m._buffers.update(was)
        for d, items in self.hooks:
            if d.keys() != items.keys():
                d.clear()
                d.update(items)

    def _compare(self, restore: bool) -> None:
        """At the end of a forward: record the writes. At exit (``restore``): put the attributes
        back, recording nothing (export has put back its own copies of them by then)."""
        classes = {path: type(m).__name__ for path, m, _ in self.before}
        for path, m, attrs in self.before:
            self._compare_one(path, (), m, attrs, _skipped(m), classes[path], restore)
        for path, steps, obj, attrs in self.held:
            self._compare_one(path, steps, obj, attrs, frozenset(), classes.get(path, "?"), restore)

    def _compare_one(self, path: str, steps: tuple[Step, ...], owner: Any, attrs: dict[str, tuple[Any, Any]],
                     skipped: frozenset[str], cls: str, restore: bool) -> None:
        """One module's or held object's attributes (``owner``, at ``steps`` from module ``path``)."""
        now = vars(owner)
        for k in set(now) - set(attrs) - skipped:
            if restore:
                del now[k]
            else:
                self.writes.setdefault((path, (*steps, ("attr", k))), (cls, "absent", _shown(now[k])))
        for k, (v, items) in attrs.items():
            after = now.get(k, _ABSENT)
            if _same(v, items, after):
                continue
            if not restore:
                self.writes.setdefault((path, (*steps, ("attr", k))), (
                    cls, _shown(v), "deleted" if after is _ABSENT else _shown(after)))
                continue
            _put_back_contents(v, items)
            if isinstance(owner, nn.Module):
                object.__setattr__(owner, k, v)
            else:
                now[k] = v

    def check_buffers(self, mutated: set[str]) -> None:
        """Note [A buffer rebound in forward]: refuse a buffer the forward registered, rebound to
        another shape or dtype, or rebound where the graph does not write it (``mutated``: the
        buffers the graph writes, by their full names: export writes a root buffer rebound with
        its shape and dtype back, a submodule's not)."""
        for (path, name), (was, now) in self.rebound.items():
            full = f"{path}.{name}" if path else name
            where = f"buffer {name!r} of {f'`{path}`' if path else 'the root'}"
            if was is _ABSENT:
                why = ("registers it at its first call (the member before compiling did not have it): run each "
                       "member once before compiling, or register it in __init__")
            elif not isinstance(was, torch.Tensor) or not isinstance(now, torch.Tensor):
                why = f"sets it from {_shown(was)} to {_shown(now)}"
            elif was.shape != now.shape or was.dtype != now.dtype:
                why = (f"rebinds it from {was.dtype} {list(was.shape)} to {now.dtype} {list(now.shape)} (a growing "
                       "history, a cast): the wide model keeps each member's state in fixed [N, ...] tensors of "
                       "the capture's shapes and dtypes, so it would keep the old one. Keep the buffer's shape and "
                       "dtype (a fixed-size ring buffer with a count), or pass the state in and return it")
            elif full not in mutated:
                why = ("rebinds it (self.x = ...), which torch.export records only for the root module's own "
                       "buffers (as a write into it), so the wide model would never update it. Update it in place instead "
                       "(with torch.no_grad(): self.x.copy_(new), or self.x.mul_(m).add_(...))")
            else:
                continue
            raise WideCompileError(
                f"wide_compiler: member 0's forward writes the {where}: it {why} (Note [A buffer rebound in "
                "forward] in wide_compiler/fx/attribute_writes.py).")

    def check(self, args: tuple, kwargs: dict) -> None:
        """Raise :class:`WideCompileError` naming the writes whose old value the forward reads
        (run on ``args``/``kwargs``), if there are any."""
        if not self.writes:
            return
        if not _reads_what_it_wrote(self.model, args, kwargs, self.writes):
            self._warn_unfollowed()
            return
        writes = [(path, cls, steps, was, now) for (path, steps), (cls, was, now) in self.writes.items()]
        shown = "; ".join(f"{_expr(steps)} of {f'`{path}`' if path else 'the root'} ({cls}): {was} -> {now}"
                          for path, cls, steps, was, now in writes[:4])
        more = f" (and {len(writes) - 4} more)" if len(writes) > 4 else ""
        raise WideCompileError(
            f"wide_compiler: member 0's forward writes Python attributes of its modules (or of objects they "
            f"hold): {shown}{more}. "
            "Each member alone keeps that state across calls (a counter, a carried hidden state, a "
            "cache), and computes with its new value at the next call; the captured graph would run "
            "the capture's value at every call and write nothing back, so the wide model would be "
            "wrong from its second call on.\n"
            "What to do: keep such state in a registered buffer updated in place "
            "(self.register_buffer('step', torch.zeros((), dtype=torch.long)); self.step.add_(1)), "
            "which the wide model carries per member; or pass the state in as an input and return the "
            "new one (Note [A forward that writes its module's attributes] in "
            "wide_compiler/fx/attribute_writes.py).")


    def _warn_unfollowed(self) -> None:
        """Note [State that feeds nothing]: warn of the writes a compiled graph does not follow."""
        kept = [(path, cls, steps, was, now) for (path, steps), (cls, was, now) in self.writes.items()
                if was != "absent" and not (was in ("False", "None") and now == "True")]
        if not kept:
            return
        shown = "; ".join(f"{_expr(steps)} of {f'`{path}`' if path else 'the root'} ({cls}): {was} -> {now}"
                          for path, cls, steps, was, now in kept[:4])
        warnings.warn(
            f"wide_compiler: member 0's forward writes Python attributes that feed none of its outputs: {shown}. "
            "The compiled wide model computes every output exactly but does not run those writes, so "
            "member(i), unfuse() and write_back() hold their values at compile, not each member's count "
            "since (Note [State that feeds nothing] in wide_compiler/fx/attribute_writes.py). Keep such state "
            "in a registered buffer updated in place (self.step.add_(1)) to have it per member.", stacklevel=2)


# Note [State that feeds nothing]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# A write whose old value no output reads (a call counter, a history list) is accepted: the
# outputs are every member's. But the compiled graph does not run it, so the attribute keeps the
# capture's value in the wide model's template, and member(i), unfuse() and write_back() hand that
# back where each member alone would hold its count (probe 20 of issue 44, P20-2; a deferred model
# carries them until it compiles: Note [Attributes a deferred member's forward changed] in
# model_constants.py). The capture warns, naming the attributes; a flag set on a first call
# (absent or False to True: transformers' hooks) and an attribute the call creates are not warned of.


class _Unread:
    """Stands for a written attribute's old value in the second run of
    :func:`_reads_what_it_wrote`: arithmetic on it, its methods and items give another such
    value (a counter incremented, a list appended to: state that only feeds itself), and any use
    that could reach an output (a comparison, a conversion, a length, a torch op) raises."""

    def _used(self, *args: Any, **kwargs: Any) -> Any:
        raise _ReadBeforeWrite

    def _again(self, *args: Any, **kwargs: Any) -> _Unread:
        return _Unread()

    def _set(self, *args: Any) -> None:
        pass

    __bool__ = __len__ = __iter__ = __index__ = __int__ = __float__ = __complex__ = __format__ = _used
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __contains__ = __torch_function__ = _used
    __getattr__ = __getitem__ = __call__ = __neg__ = __pos__ = __abs__ = _again
    __add__ = __radd__ = __iadd__ = __sub__ = __rsub__ = __isub__ = __mul__ = __rmul__ = __imul__ = _again
    __truediv__ = __rtruediv__ = __floordiv__ = __rfloordiv__ = __mod__ = __pow__ = __matmul__ = _again
    __setitem__ = __delitem__ = _set
    __hash__ = None  # type: ignore[assignment]


class _ReadBeforeWrite(Exception):
    pass


def _reads_what_it_wrote(model: nn.Module, args: tuple, kwargs: dict,
                         writes: dict[tuple[str, tuple[Step, ...]], tuple[str, str, str]]) -> bool:
    """Whether the forward reads an attribute it writes before writing it (a counter, a carried
    state), rather than only writing it first and reading its own write (scratch state set up at
    the start of every call: transformers' Funnel sets ``self.seq_len`` so), or setting a flag
    once (transformers' ``_output_capturing_hooks_installed``): a copy of ``model`` runs as it is
    (twice where every write sets a flag: the second run must give the same outputs) and once with
    every written attribute made a value any use of which raises; the attributes are read first
    if that run raises or gives other outputs (Note [A forward that writes its module's
    attributes])."""
    import copy

    from torch.utils._pytree import tree_flatten

    def run(twin: nn.Module) -> Any:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(0)
            return tree_flatten(twin(*args, **kwargs))[0]

    def same(a: list, b: list) -> bool:
        def one(a: Any, b: Any) -> bool:
            if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
                return a.shape == b.shape and a.dtype == b.dtype and (torch.equal(a, b) or (
                    a.is_floating_point() and bool(torch.isclose(a, b, 0, 0, equal_nan=True).all())))
            return a is b or a == b
        return len(a) == len(b) and all(one(x, y) for x, y in zip(a, b))

    try:
        twin = copy.deepcopy(model)
        plain = run(twin)
        if all(was in ("absent", "False") and now == "True" for _, was, now in writes.values()):
            return not same(plain, run(twin))  # flags set once: the next call computes the same
        twin = copy.deepcopy(model)
        modules = dict(twin.named_modules(remove_duplicate=False))
        for path, steps in writes:
            object.__setattr__(_follow(modules[path], steps[:-1]), steps[-1][1], _Unread())
        return not same(plain, run(twin))
    except Exception as e:  # noqa: BLE001 -- any failure of a run: taken as a read (a refusal, never a wrong result)
        log.debug("wide_compiler: the runs that tell a read from a write failed (%s: %s)", type(e).__name__, e)
        return True
