"""The README's example programs for the distributed integration and the width sweep run as
documented (shortened with their own flags to the least that prints what is checked: one PBT
round, one training step; their cost is the processes and the compiles, not the steps): torchrun
of examples/distributed_pbt.py over 2 gloo processes (a subprocess with a time bound), and
examples/width_sweep.py as ``__main__`` in this process. examples/ray_sweep.py runs in
test_ray.py, on that file's Ray instance (a second Ray start here cost more than the sweep)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], tmp_path: Path, timeout: int = 900) -> str:  # a hang guard, not a time limit
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "python"))
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


#: What a gloo process prints when it aborts at interpreter exit, after destroy_process_group and
#: after every line of its work: a race in PyTorch's shutdown (a C++ thread destroyed while
#: joinable; pytorch#190489), about one run in ten here on 2026-11-30, with this session's code and the
#: one before it alike. One such run is run again; any other failure, or a second one, stands.
EXIT_RACE = "terminate called without an active exception"


def test_distributed_pbt_under_torchrun(tmp_path):
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            str(ROOT / "examples" / "distributed_pbt.py"), "--members", "8", "--steps", "20", "--interval", "20",
            "--save", str(tmp_path / "ckpt")]
    try:
        out = _run(args, tmp_path)
    except AssertionError as e:
        if EXIT_RACE not in str(e) or "done in" not in str(e):
            raise
        out = _run(args, tmp_path)
    assert "best" in out.lower()
    assert (tmp_path / "ckpt" / "index.json").exists()


def test_width_sweep_trains_members_of_different_widths_as_one(tmp_path, monkeypatch, capsys):
    """Run as a script (``__main__``, its own argument parsing) in this process: it sets nothing
    process-wide but the seed, and a fresh interpreter's imports cost more than the run."""
    import runpy

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["width_sweep.py", "--steps", "1"])
    runpy.run_path(str(ROOT / "examples" / "width_sweep.py"), run_name="__main__")
    out = capsys.readouterr().out
    assert out.startswith("padded members:")
    assert out.count("width ") >= 8 and "best: width" in out
