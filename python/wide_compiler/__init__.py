"""wide_compiler: run N models of one architecture as ONE wide model.

>>> import torch, wide_compiler as wc
>>> models = [torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
...           for _ in range(4)]
>>> wide = wc.compile(models, torch.randn(3, 8))
>>> wide(torch.randn(4, 3, 8)).shape
torch.Size([4, 3, 2])

The public names below are imported when first used (Note [Lazy package root]).
"""

# Note [Lazy package root]
# ~~~~~~~~~~~~~~~~~~~~~~~~
# `python -m wide_compiler --help` runs this file first, and the command line must answer without
# importing torch (seconds). So the root imports nothing heavy: every public name is imported on
# first use (PEP 562 `__getattr__`; `from wide_compiler import X`, `wc.X`, `dir(wc)` and
# `__all__` behave as before).
#
# What the eager root did besides binding names is load the C++ core: `wide_compiler._C`, whose
# library registers every `torch.ops.wide.*` operator (it needs libtorch loaded first). Any
# module of the package may call those operators, and none imports the root (.importlinter), so
# the core is loaded before any submodule of the package runs: `_CoreFirst`, a finder ahead of
# the others in `sys.meta_path`, wraps the submodule's own loader (`_WithCore`) to load the core
# (torch, then `_C`) first. The torch-free modules (`_TORCH_FREE`: the command line's parser,
# the version) do not trigger it. And `torch.ops.wide` stays registered in any process that
# imported torch and wide_compiler, in either order, for code that calls the operators directly
# or loads an exported program: `import wide_compiler` loads the core at once when torch is
# already imported (cheap then), and otherwise torch's own loader is wrapped the same way, to
# load the core right after torch has run. Each module gets its own loader back before it runs.
# The package root's type keeps `wc.analyze` the function (`_Root`).
# Nothing else happens at import: no registration outside the package's own tables (the widen
# rules, the opaque-module op) and no logging configuration.

import importlib as _importlib
import sys as _sys
import types as _types

from ._version import __version__  # the one source of the version (pyproject.toml reads it too)

#: public name -> (its module, its name there; None: the module itself).
_PUBLIC = {
    "AnalysisReport": ("analyze_report", "AnalysisReport"),
    "ArchitectureMismatchError": ("errors", "ArchitectureMismatchError"),
    "Tower": ("router", "Tower"),
    "UnsupportedOperationError": ("errors", "UnsupportedOperationError"),
    "ValidationError": ("errors", "ValidationError"),
    "WideBuilder": ("api", "WideBuilder"),
    "WideCompileError": ("errors", "WideCompileError"),
    "WideConfig": ("config", "WideConfig"),
    "WideModel": ("model", "WideModel"),
    "PaddedWideModel": ("padded", "PaddedWideModel"),
    "WideRouter": ("router", "WideRouter"),
    "allocator": ("allocator", None),
    "amp": ("amp", None),
    "analyze": ("analyze", "analyze"),  # the function, not its module (as in the eager root)
    "blocks": ("blocks", None),
    "compile": ("api", "compile"),
    "distributed": ("distributed", None),
    "functional": ("functional", None),
    "nn": ("nn", None),
    "optim": ("optim", None),
    "pack": ("api", "pack"),
    "register": ("registry", "register"),
    "stack": ("api", "stack"),
    "testing": ("testing", None),
    "tune_cpu_allocator": ("allocator", "tune_cpu_allocator"),
    "unpack": ("api", "unpack"),
    "unstack": ("api", "unstack"),
}
#: Modules that run without torch: importing them does not load the core (Note [Lazy package root]).
#: The command line's parser is here; its commands (wide_compiler.cli.info, ...) load the core.
_TORCH_FREE = frozenset(f"{__name__}.{m}" for m in ("__main__", "_version", "_C", "cli", "cli.parser",
                                                    "cli.inputs"))

__all__ = [*_PUBLIC, "cmake_prefix_path"]


def _load_core() -> None:
    """Import torch, then ``wide_compiler._C`` (registers ``torch.ops.wide.*``); once per process."""
    if _CORE not in _sys.modules:
        import torch  # noqa: F401  (libtorch before libwide)

        _importlib.import_module("._C", __name__)


class _CoreFirst:
    """The ``sys.meta_path`` finder of Note [Lazy package root]: finds nothing itself; it hands on
    the spec the finders after it give for a module of the package (not ``_TORCH_FREE``) or for
    torch, its loader wrapped to load the core before the module runs or right after torch. It
    stays in ``sys.meta_path`` (removing it while the import system walks that list would skip
    the next finder); once the core is loaded it only looks the name up in ``sys.modules``."""

    @staticmethod
    def find_spec(fullname: str, path: object = None, target: object = None) -> object:
        if _CORE in _sys.modules:
            return None
        if fullname == "torch":
            return _spec_with_core(fullname, path, target, before=False)
        if fullname.startswith(_PREFIX) and fullname not in _TORCH_FREE:
            return _spec_with_core(fullname, path, target, before=True)
        return None


def _spec_with_core(fullname: str, path: object, target: object, *, before: bool) -> object:
    """The spec of the finders after ours, its loader a :class:`_WithCore`; None where none finds
    the module (the import fails as it would). The core is loaded by the loader, not here: the
    import system holds its global lock while it asks the finders, and torch takes seconds."""
    for finder in _sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if finder is _CoreFirst or find is None:
            continue
        spec = find(fullname, path, target)
        if spec is None:
            continue
        if hasattr(spec.loader, "exec_module"):
            spec.loader = _WithCore(spec.loader, before)
        elif before:  # a loader of the old protocol: load the core now
            _load_core()
        return spec
    return None


class _WithCore:
    """A module's own loader, with the core loaded before the module runs (``before``: a module of
    the package) or after it (torch); the module gets its own loader back first."""

    def __init__(self, loader: object, before: bool) -> None:
        self._loader, self._before = loader, before

    def create_module(self, spec: object) -> object:
        return self._loader.create_module(spec)

    def exec_module(self, module: object) -> None:
        module.__spec__.loader = module.__loader__ = self._loader
        if self._before:
            _load_core()
        self._loader.exec_module(module)
        if not self._before:
            try:
                _load_core()
            except Exception:  # noqa: BLE001,S110 (torch works without it; the package's next import raises it)
                pass

    def __getattr__(self, name: str) -> object:
        return getattr(self._loader, name)


_PREFIX, _CORE = f"{__name__}.", f"{__name__}._C"


if "torch" in _sys.modules:
    _load_core()
elif _CoreFirst not in _sys.meta_path:
    _sys.meta_path.insert(0, _CoreFirst)


def __getattr__(name: str) -> object:
    if name in _PUBLIC:
        where, attr = _PUBLIC[name]
        module = _importlib.import_module(f".{where}", __name__)
        value = module if attr is None else getattr(module, attr)
    elif name == "cmake_prefix_path":
        #: The CMake prefix of the installed C++ package (headers, libwide,
        #: WideCompilerConfig.cmake), for ``cmake -DCMAKE_PREFIX_PATH=...`` and
        #: ``find_package(WideCompiler)``; like ``torch.utils.cmake_prefix_path``, which it finds by
        #: itself (README: "The C++ API").
        import os

        _load_core()
        value = os.path.join(os.path.dirname(_sys.modules[_CORE].__file__), "share", "cmake")
    elif not name.startswith("__"):
        # Any submodule by attribute (`wc.fx`, `wc.measure`), as when the root imported them all.
        try:
            value = _importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


class _Root(_types.ModuleType):
    """The package root's type: importing the submodule ``wide_compiler.analyze`` does not rebind
    ``wide_compiler.analyze``, the function (the import system sets a parent's attribute to each
    submodule it loads; the eager root rebound it to the function afterwards)."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in _SHADOWED and isinstance(value, _types.ModuleType):
            value = getattr(value, _PUBLIC[name][1])
        super().__setattr__(name, value)

    def __reduce__(self) -> tuple:
        # By reference, as cloudpickle pickles a module (its table matches types.ModuleType exactly,
        # not this subclass): a function that names `wc` stays picklable (Ray Tune's trainables).
        return _importlib.import_module, (self.__name__,)


#: Public functions named like their module: the function keeps the name.
_SHADOWED = frozenset(n for n, (where, attr) in _PUBLIC.items() if n == where and attr is not None)
_sys.modules[__name__].__class__ = _Root
