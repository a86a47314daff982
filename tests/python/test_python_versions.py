"""The bytecode readings (fx/hook_writes.py) on every Python the machine has: each version's
compiler emits other instructions for one line (3.12 loads a method with LOAD_ATTR, 3.13 two
locals with LOAD_FAST_LOAD_FAST), and on the GPU machine's Python 3.12 a hook's method calls
(``self.items.append(out)``) were not read as writes. The other interpreters have no torch: they
read the same hooks over a stand-in (tests/python/pyversions), and must read what this one reads."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import wide_compiler.fx.hook_writes as hook_writes
from pyversions import hook_cases
from support import cpu_only

HERE = os.path.dirname(os.path.abspath(__file__))


def _interpreters() -> list[str]:
    """Other CPython interpreters of 3.11 and later on this machine (pyenv's, or on PATH)."""
    found = {}
    for path in [*glob.glob(os.path.expanduser("~/.pyenv/versions/3.1[1-9]*/bin/python3")),
                 *glob.glob("/usr/bin/python3.1[1-9]"), *glob.glob("/usr/local/bin/python3.1[1-9]")]:
        try:
            version = subprocess.run([path, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                                     text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            continue
        if version and version != str(sys.version_info[:2]):
            found.setdefault(version, path)
    return sorted(found.values())


def test_this_python_reads_every_hook_write():
    """What each hook of hook_cases writes, read here (a write missed is a hook compiled wrongly)."""
    got = hook_cases.readings(hook_writes)
    assert got["recorder"][1] == ["self.items"] and got["counted.hook"][1] == ["self.n"]
    assert got["counted.via_method"][1] == ["self.last"] and got["partial"][1] == ["store"]
    assert got["nested"][1] == ["self.d"] and got["helper"][3] == ["record_into(table)"]
    assert got["global"][0] == ["G"] and got["global list"][0] == ["FEATS"] and got["in place"][0] == ["BUF"]
    assert got["comprehension"][0] == ["FEATS"]
    assert got["pure"] == [[], [], "", []]
    assert {"CFG", "STATS", "seen"} <= set(got["forward's writes"])


@cpu_only  # other interpreters in subprocesses, reading code: nothing of a device
@pytest.mark.parametrize("python", _interpreters() or [None])
def test_every_python_reads_what_this_one_reads(python):
    if python is None:
        pytest.skip("no other Python 3.11+ interpreter on this machine")
    run = subprocess.run([python, os.path.join(HERE, "pyversions", "hook_cases.py")], capture_output=True, text=True,
                         timeout=120, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout) == json.loads(json.dumps(hook_cases.readings(hook_writes)))
