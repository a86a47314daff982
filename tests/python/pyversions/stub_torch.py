"""Import ``wide_compiler.fx.hook_writes`` where torch is not installed (another Python than the
project's, for test_python_versions.py): a stand-in ``torch`` with the few names those modules
touch when imported, and the two packages without their ``__init__`` (which needs the real one).
Only the bytecode reading is exercised; nothing calls into torch."""
from __future__ import annotations

import importlib
import pathlib
import sys
import types

ROOT = pathlib.Path(__file__).resolve().parents[3] / "python" / "wide_compiler"


class _Names(types.ModuleType):
    """A module whose every attribute is a new empty class (what isinstance checks need)."""

    def __getattr__(self, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        cls = type(name, (), {})
        setattr(self, name, cls)
        return cls


def load() -> types.ModuleType:
    """``wide_compiler.fx.hook_writes`` over the stand-in torch."""
    torch = _Names("torch")
    torch.__file__ = "/nonexistent/torch/__init__.py"
    torch.is_grad_enabled = lambda: True
    torch.is_inference_mode_enabled = lambda: False
    nn, modules, module = _Names("torch.nn"), _Names("torch.nn.modules"), _Names("torch.nn.modules.module")
    torch.nn, nn.modules, modules.module = nn, modules, module
    for name in ("torch.fx", "torch.utils", "torch.utils._pytree", "torch._C", "torch.overrides", "torch.export"):
        sys.modules[name] = _Names(name)
    sys.modules.update({"torch": torch, "torch.nn": nn, "torch.nn.modules": modules, "torch.nn.modules.module": module})
    for name, path in (("wide_compiler", ROOT), ("wide_compiler.fx", ROOT / "fx")):
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(path)]
        sys.modules[name] = pkg
    return importlib.import_module("wide_compiler.fx.hook_writes")
