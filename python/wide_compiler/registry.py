"""User-supplied wide forms of modules: ``@wide_compiler.register(ModuleType)``.

A registered module is kept whole through capture: export sees one opaque custom op
(``wide_compiler::opaque_module``) where the module is called, so its forward may be anything
(data-dependent control flow included), and the widen pass replaces that op by a call of the
user's wide module, built with ``WideCls.from_modules([member_0_module, ...])``.
When to register a wide form, and what it costs: Note [Capture special cases] in fx/capture.py.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
import sys
import threading
import weakref
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = ["register", "registered_wide_form"]

_REGISTRY: dict[type | str, type] = {}  # module class, or a class name (the 0.x string form)
# key -> member 0's module, run for shape inference only during capture. Weak: the module is owned
# by the _OpaqueCall standing in for it (in the WideModel's capture template), so it lives exactly
# as long as the wide model that may capture again.
_OPAQUE: weakref.WeakValueDictionary[str, nn.Module] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


def register(module_type: type[nn.Module] | str) -> Callable[[type], type]:
    """Register the wide form of ``module_type``; used by :func:`wide_compiler.compile`.

    ``module_type`` is the module class, or its class name as a string (WideCompiler 0.x's form,
    ``@register("Scale")``: it matches any module whose class, or a base class, has that name;
    a registered class wins over a name).

    The wide class must provide ``from_modules(cls, modules) -> wide module`` (a classmethod taking
    the N member modules), ``forward(*inputs)`` on N-first tensors returning N-first tensors, and
    ``unfuse() -> list[module_type]``. The module's inputs must be tensors; sizes of its outputs
    equal to the traced batch size are taken to be that (dynamic) batch size.

    Example:
        >>> import torch, wide_compiler as wc
        >>> class Scale(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.s = torch.nn.Parameter(torch.rand(()))
        ...     def forward(self, x):
        ...         return x * self.s if self.s > 0.5 else x   # data-dependent: export cannot trace
        >>> @wc.register(Scale)
        ... class WideScale(torch.nn.Module):
        ...     def __init__(self, s):
        ...         super().__init__()
        ...         self.s = torch.nn.Parameter(s)
        ...     @classmethod
        ...     def from_modules(cls, modules):
        ...         return cls(torch.stack([m.s.detach() for m in modules]))
        ...     def forward(self, x):               # x: [N, B, ...]
        ...         s = torch.where(self.s > 0.5, self.s, torch.ones_like(self.s))
        ...         return x * s.view(-1, *([1] * (x.dim() - 1)))
        ...     def unfuse(self):
        ...         out = [Scale() for _ in range(self.s.shape[0])]
        ...         for m, s in zip(out, self.s.detach()):
        ...             m.s.data.copy_(s)
        ...         return out
        >>> models = [torch.nn.Sequential(torch.nn.Linear(3, 3), Scale()) for _ in range(4)]
        >>> wide = wc.compile(models, torch.randn(2, 3), config=wc.WideConfig.fast())
        >>> x = torch.randn(4, 2, 3)
        >>> torch.allclose(wide(x)[1], models[1](x[1]), atol=1e-6)
        True
    """
    named = isinstance(module_type, str)
    if not (named and module_type.isidentifier()) and not (
            isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"wide_compiler.register: expected an nn.Module subclass or its class name, "
                        f"got {module_type!r}")
    label = module_type if named else module_type.__name__

    def deco(wide_cls: type) -> type:
        for needed in ("from_modules", "unfuse", "forward"):
            if not callable(getattr(wide_cls, needed, None)):
                raise TypeError(f"wide_compiler.register({label}): {wide_cls.__name__} "
                                f"has no {needed}(); a wide form needs from_modules, forward and unfuse")
        _REGISTRY[module_type] = wide_cls
        return wide_cls

    return deco


def registered_wide_form(module: nn.Module) -> type | None:
    """The wide class registered for ``type(module)`` (exact type first, then base classes), or
    a built-in one for modules torch.export cannot capture (see :func:`_builtin_wide_form`)."""
    mro = type(module).__mro__
    for key in (*mro, *(cls.__name__ for cls in mro)):
        if key in _REGISTRY:
            return _REGISTRY[key]
    return _builtin_wide_form(module)


def _builtin_wide_form(module: nn.Module) -> type | None:
    """BatchNorm with ``momentum=None`` (a cumulative average) computes its update factor as
    ``1 / float(num_batches_tracked)`` in Python, a data-dependent value export cannot trace: it
    is kept whole and run by ``wc.nn.WideBatchNorm*d``, which computes the same factor per call.
    Another library's module whose forward calls a custom autograd.Function gets the form of
    ``wc.nn.library_forms`` (transformers' BloomGelu), which runs that function's own backward."""
    from . import nn as wide_nn
    from .nn.library_forms import library_wide_form

    forms = {nn.BatchNorm1d: wide_nn.WideBatchNorm1d, nn.BatchNorm2d: wide_nn.WideBatchNorm2d,
             nn.BatchNorm3d: wide_nn.WideBatchNorm3d}
    form = forms.get(type(module))
    if form is None:
        return library_wide_form(module)
    return form if module.momentum is None and module.track_running_stats else None


def registered_paths(model: nn.Module) -> list[str]:
    """Paths of the outermost submodules with a registered wide form (never the root)."""
    paths: list[str] = []
    for name, mod in model.named_modules():
        if name and registered_wide_form(mod) is not None and not any(name.startswith(p + ".") for p in paths):
            paths.append(name)
    return paths


def _as_list(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (tuple, list)) else [out]


_RUNNING = threading.local()  # .depth: registered modules' own forwards running in this thread


@contextlib.contextmanager
def _running_registered() -> Iterator[None]:
    """Around a registered module's forward run during capture (for its outputs' shapes): its
    Python is not captured (the wide form runs its own at every call), so what it calls (a custom
    autograd.Function, a hook, a flag it reads) is none of the capture's business: the capture's
    watch (fx/export_watch.py) asks :func:`running_registered` and records nothing meanwhile."""
    _RUNNING.depth = getattr(_RUNNING, "depth", 0) + 1
    try:
        yield
    finally:
        _RUNNING.depth -= 1


def running_registered() -> bool:
    """Whether a registered module's own forward is running in this thread (during a capture)."""
    return getattr(_RUNNING, "depth", 0) > 0


# Note [Registering the opaque op cheaply]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# torch.library looks up the module that registers a fake kernel (inspect.getmodule of this
# frame), which the first time in a process maps every module in sys.modules to its file: 28 ms
# with torch and Lightning loaded, a fifth of a 3-member, 10-step Lightning fit that never compiles
# (Note [Running the members until compiling pays] in model_deferred.py). inspect keeps that map
# in inspect.modulesbyfile; this file's entry, which the scan would find, is put there first.
inspect.modulesbyfile.setdefault(inspect.getabsfile(sys._getframe(0)), __name__)


@torch.library.custom_op("wide_compiler::opaque_module", mutates_args=())
def opaque_module(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """One member's registered module, opaque to export (see module docstring)."""
    with _running_registered():
        return [t.clone() for t in _as_list(_OPAQUE[key](*inputs))]


@opaque_module.register_fake
def _opaque_module_fake(key: str, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    # Shapes by running member 0's module on zeros of the traced (hint) sizes, outside fake mode;
    # output sizes equal to a symbolic input size's hint become that symbol.
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def hint(s):
        return int(s.node.hint) if isinstance(s, torch.SymInt) else int(s)

    symbols = {hint(s): s for x in inputs for s in x.shape if isinstance(s, torch.SymInt)}
    with unset_fake_temporarily(), torch.no_grad():
        real = [torch.zeros([hint(s) for s in x.shape], dtype=x.dtype, device=x.device) for x in inputs]
        with _running_registered():
            outs = _as_list(_OPAQUE[key](*real))
    return [inputs[0].new_empty([symbols.get(d, d) for d in o.shape], dtype=o.dtype) for o in outs]


class _OpaqueCall(nn.Module):
    """Stands in for a registered module during capture."""

    def __init__(self, key: str, path: str, module: nn.Module) -> None:
        super().__init__()
        self.key, self.path = key, path
        object.__setattr__(self, "module", module)  # not a submodule: export must not see into it

    def forward(self, *args, **kwargs):
        if kwargs or not all(isinstance(a, torch.Tensor) for a in args):
            raise TypeError(f"wide_compiler: the registered module at '{self.path}' must be called with "
                            "positional tensor arguments only")
        _OPAQUE[self.key] = self.module  # (again: a deep copy of the template owns a copy)
        out = torch.ops.wide_compiler.opaque_module(self.key, list(args))
        return out[0] if len(out) == 1 else tuple(out)


def opaque_template(template: nn.Module, paths: list[str], *,
                    forms: Callable[[nn.Module], nn.Module] | None = None,
                    memo: dict | None = None) -> tuple[nn.Module, dict[str, str]]:
    """A copy of ``template`` for capture: registered submodules are opaque calls, and ``forms``
    (the caller's: model.py passes ``fx.forms.apply_capture_forms``; this module sits below fx and
    imports nothing of it) is applied in place to the copy first, so modules with a capture form
    use it; returns the copy and the mapping key -> path. ``memo``: the ``copy.deepcopy`` memo of
    the copy (the caller's tensors for the template's, not cloned)."""
    copy_ = copy.deepcopy(template, memo)
    if forms is not None:
        copy_ = forms(copy_)
    keys = {}
    for path in paths:
        key = f"m{next(_KEYS)}"
        copy_.set_submodule(path, _OpaqueCall(key, path, copy.deepcopy(template.get_submodule(path)).eval()))
        keys[key] = path
    return copy_, keys


def template_tensors(template: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer a capture template runs with: its own, and those of the
    registered modules it calls opaquely (held outside its submodules, so export never sees into
    them). A conversion of the template converts them all (``wide.double()`` left a
    ``BatchNorm(momentum=None)``'s in float32: every capture then failed, probe 19 of issue 44)."""
    out = [*template.parameters(), *template.buffers()]
    for m in template.modules():
        if isinstance(m, _OpaqueCall):
            out += [*m.module.parameters(), *m.module.buffers()]
    return out


def call_registered(root: nn.Module, path: str, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """Run the wide form at ``root.<path>`` (called from the wide graph)."""
    return _as_list(root.get_submodule(path)(*inputs))
