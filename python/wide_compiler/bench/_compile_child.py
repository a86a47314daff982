"""One measurement of ``benchmark compile`` in a fresh process: ``python -m
wide_compiler.bench._compile_child '<json spec>'`` prints the JSON of
:func:`wide_compiler.bench.compile.compile_times` (a module of its own: run as ``__main__``, the
target's module would register the target twice)."""
from __future__ import annotations

import json
import sys

from .compile import compile_times

if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    print(json.dumps(compile_times(spec["what"], spec["name"], spec["size"], spec["n"], spec["cache_dir"],
                                   spec.get("config", "default"))))
