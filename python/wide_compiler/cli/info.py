"""``python -m wide_compiler info``: what this install runs on, for bug reports. It imports torch
and the C++ core (``wide_compiler._C``) and nothing else of the package, so it answers in about
the time of ``import torch``.
"""
from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

import torch

from .. import _C, _version  # noqa: F401  (_C: loads libwide, which registers torch.ops.wide.*)
from .._version import __version__

__all__ = ["run"]


def _registered_ops() -> list[tuple[str, list[str], list[str]]]:
    """(name, schemas, dispatch keys with a kernel) of every ``wide::`` operator."""
    keys = ("CompositeImplicitAutograd", "CompositeExplicitAutograd", "CPU", "CUDA", "Meta",
            "Autograd", "AutogradCPU")
    out = []
    for name in sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("wide::")):
        schemas = []
        packet = getattr(torch.ops.wide, name.split("::", 1)[1], None)
        if packet is not None:
            for ov in packet.overloads():
                schemas.append(str(getattr(packet, ov)._schema))
        has = [k for k in keys if torch._C._dispatch_has_kernel_for_dispatch_key(name, k)]
        out.append((name, schemas, has))
    return out


def run(args: argparse.Namespace) -> int:
    """Print the versions, the machine, the C++ core's build info and every ``wide::`` operator."""
    print(f"wide_compiler {__version__}  ({Path(_version.__file__).parent})")
    print(f"torch {torch.__version__}  (debug={torch.version.debug}, "
          f"cuda={torch.version.cuda or 'none'})")
    print(f"python {platform.python_version()}  ({sys.executable})")
    print(f"platform {platform.platform()}")
    print(f"threads: {torch.get_num_threads()} intra-op, {torch.get_num_interop_threads()} "
          f"inter-op")
    print(f"cpu capability (torch kernels): {torch.backends.cpu.get_cpu_capability()}")
    print(f"mkldnn: {torch.backends.mkldnn.is_available()}, mkl: {torch.backends.mkl.is_available()}"
          f", openmp: {torch.backends.openmp.is_available()}")
    print()
    print("C++ core (torch.ops.wide._build_info()):")
    try:
        info = torch.ops.wide._build_info()
    except Exception as e:  # noqa: BLE001 (the library did not load: say so, keep going)
        print(f"  unavailable: {type(e).__name__}: {e}")
    else:
        for line in info.rstrip().splitlines():
            print(f"  {line}")
    print()
    ops = _registered_ops()
    print(f"registered operators ({len(ops)}):")
    for name, schemas, keys in ops:
        print(f"  {name}  [{', '.join(keys) or 'no kernel'}]")
        for s in schemas:
            print(f"    {s}")
    return 0
