"""Shared fixtures. The equivalence checks and the tolerance table (with its justification) are
the public module :mod:`wide_compiler.testing`; tests import them from there."""
from __future__ import annotations

import os
import random
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from support import DEVICE as TEST_DEVICE


# --------------------------------------------------------------------------------------------
# Fixtures
# --------------------------------------------------------------------------------------------
@pytest.fixture
def seed() -> int:
    """Seed torch and random so every test is reproducible; returns the seed."""
    value = 1234
    torch.manual_seed(value)
    random.seed(value)
    return value


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache_dir_for_the_session(tmp_path_factory):
    """As _isolated_cache_dir below, for what runs before a test's own fixtures: a module- or
    session-scoped fixture is set up before the function-scoped ones, so it compiled with the
    compile cache on, in ~/.cache (its result then depended on what earlier runs had stored there)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("WIDE_COMPILER_CACHE_DIR", str(tmp_path_factory.mktemp("wide_cache_session")))
    mp.setenv("WIDE_COMPILE_CACHE", "0")
    yield
    mp.undo()


@pytest.fixture(scope="session")
def _cache_dirs(tmp_path_factory):
    """The folder of every test's own cache directory (_isolated_cache_dir)."""
    return tmp_path_factory.mktemp("wide_caches")


@pytest.fixture(autouse=True)
def _isolated_cache_dir(_cache_dirs, monkeypatch):
    """Point the tuning cache at a temporary directory: tests never touch ~/.cache. The compile
    cache is off (tests compile what they mean to compile, and storing every graph costs time);
    tests/python/test_compile_cache.py turns it on.

    The directory is made by ``tempfile.mkdtemp`` in one folder of the session, not by
    ``tmp_path_factory.mktemp``: that numbers its directories by listing every entry of the base
    temporary folder at each call, so one per test cost time growing with the square of the tests
    run (3,000 tests on a worker: ~25 s on a busy 2-core machine, and every ``tmp_path`` after them
    listed those 3,000 entries too)."""
    cache = Path(tempfile.mkdtemp(prefix="wide_cache", dir=_cache_dirs))
    monkeypatch.setenv("WIDE_COMPILER_CACHE_DIR", str(cache))
    monkeypatch.setenv("WIDE_COMPILE_CACHE", "0")
    return cache


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """The compile cache on, in a directory of this test's own (the compile cache tests)."""
    monkeypatch.setenv("WIDE_COMPILE_CACHE", "1")
    monkeypatch.setenv("WIDE_COMPILER_CACHE_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def module_cache_dir(tmp_path_factory):
    """The directory of module_compile_cache (one per test module), for a module-scoped fixture
    that compiles the same members (it turns the cache on for itself: see test_hf_trainer.py)."""
    return tmp_path_factory.mktemp("module_compile_cache")


@pytest.fixture
def module_compile_cache(module_cache_dir, monkeypatch):
    """The compile cache on, in one directory per test module: tests of one module that compile
    the same members (to check something else than the capture: the trust check, validation)
    capture each mode once, and the later ones load it (a cache hit is the fresh compile bit for
    bit: test_compile_cache.py). Use it with ``@pytest.mark.usefixtures("module_compile_cache")``."""
    monkeypatch.setenv("WIDE_COMPILE_CACHE", "1")
    monkeypatch.setenv("WIDE_COMPILER_CACHE_DIR", str(module_cache_dir))
    return module_cache_dir


@pytest.fixture(autouse=True)
def _default_dtype_guard():
    """Fail loudly if a test leaks a changed default dtype into the next one."""
    before = torch.get_default_dtype()
    yield
    after = torch.get_default_dtype()
    torch.set_default_dtype(before)
    assert after == before, f"test changed the default dtype from {before} to {after}"


# --------------------------------------------------------------------------------------------
# The device the suite runs on (Note [The device-generic suite])
# --------------------------------------------------------------------------------------------
# Note [The device-generic suite]
# ``WIDE_TEST_DEVICE=cuda pytest tests/python`` runs the suite on a GPU: every tensor and module a
# test makes without naming a device is made there (``torch.set_default_device``), so the tests
# need no device argument of their own. What is the CPU's alone is skipped there: a test marked
# ``cpu_only`` (``support.cpu_only``: the C++ CPU kernels, thread counts, OpenMP, the CPU's tuning
# tables, CPU autocast), and the files of CPU_ONLY_FILES. Float32 is compared in true float32
# there: TF32 (cuDNN's default for convolutions and RNNs) rounds to 10-bit mantissas, so a
# grouped convolution and N separate ones would differ at ~1e-3 for the wide model and the loop
# alike. cuDNN is off in the tests of the suite (not in DEVICE_AWARE_FILES, which run with it as
# users do): PyTorch cannot compute some references through it (a cuDNN RNN has no backward in
# eval mode, its batch norm backward fails without a weight), and the first GPU run failed ~50
# tests on those references alone. ``WIDE_TEST_FAILURES=FILE`` appends each failure's report to
# FILE as it happens (a GPU run that is cut off at its time limit still says what failed).
#
# Note [A kernel fault ends its worker]
# A CUDA kernel that faults (a misaligned address, an illegal access) leaves its process's CUDA
# context unusable, and CUDA reports the fault at a later call, often in a later test: a GPU run
# of 2026-11-30 failed ~480 tests of one worker after one fault, none of them its cause. So each
# test on CUDA ends by waiting for its kernels; a fault there is this test's, and its worker ends
# at once (pytest-xdist starts another and names the test as the one that crashed it; a run
# without workers reports it as the test's teardown error). The test's id goes to FILE.faulted
# too: tools/cuda_check.sh runs those again, one process each, with CUDA_LAUNCH_BLOCKING=1, where
# the traceback points at the kernel's launch.
#: Whether tests make their tensors on TEST_DEVICE by default (``WIDE_TEST_DEVICE=cpu`` checks
#: the mechanism itself on a machine without a GPU).
ON_DEFAULT_DEVICE = "WIDE_TEST_DEVICE" in os.environ

#: Files that test what only the CPU has, run their work in processes of their own (the README,
#: examples, CLI, benchmarks, Ray, Optuna, torch.distributed on gloo), or train with trainers
#: pinned to the CPU (Lightning's accelerator="cpu", transformers' use_cpu=True): skipped when the
#: suite runs on another device.
CPU_ONLY_FILES = (
    "test_readme.py", "test_examples.py", "test_cli.py", "test_bench_registry.py", "test_bench_vision.py",
    "test_ray.py", "test_optuna.py", "test_distributed.py", "test_compile_speed.py", "test_allocator.py",
    "test_lightning.py", "test_hf_trainer.py",
)
#: Files that place their tensors themselves (the op database draws its samples on the CPU and
#: moves them to WIDE_TEST_DEVICE; test_cuda.py names "cuda"): no default device in their tests.
DEVICE_AWARE_FILES = ("test_op_db.py", "test_cuda.py")


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_only: tests what only the CPU has (skipped on "
                            "WIDE_TEST_DEVICE=cuda; Note [The device-generic suite])")
    # Two shared cores: keep intra-op threads modest so parallel sessions stay usable.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(min(2, torch.get_num_threads()))
    if ON_DEFAULT_DEVICE:  # module- and session-scoped fixtures make theirs there too
        torch.set_default_device(TEST_DEVICE)
    if TEST_DEVICE.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(autouse=True)
def _on_the_test_device(request):
    """Make the test's tensors on the test device (the default device is thread-local: set again
    for each test, in the thread that runs it); none in DEVICE_AWARE_FILES."""
    if not ON_DEFAULT_DEVICE:
        yield
        return
    aware = request.node.path.name in DEVICE_AWARE_FILES
    torch.set_default_device(None if aware else TEST_DEVICE)
    with torch.backends.cudnn.flags(enabled=aware, deterministic=False, benchmark=False, allow_tf32=False):
        yield
    torch.set_default_device(TEST_DEVICE)
    if TEST_DEVICE.type == "cuda":
        _check_the_context(request.node.nodeid)


def _check_the_context(nodeid: str) -> None:
    """Note [A kernel fault ends its worker]: wait for the test's kernels; if one faulted, say
    which test launched it and end this process."""
    try:
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 (torch.AcceleratorError, or RuntimeError on older torch)
        report = f"\n===== {nodeid} (a CUDA kernel of this test faulted; its worker ends)\n{e}\n"
        path = os.environ.get("WIDE_TEST_FAILURES")
        if path:
            with open(path, "a") as f:
                f.write(report)
            with open(path + ".faulted", "a") as f:
                f.write(nodeid + "\n")
        sys.stderr.write(report)
        sys.stderr.flush()
        if os.environ.get("PYTEST_XDIST_WORKER"):  # alone (the CUDA_LAUNCH_BLOCKING rerun) it reports
            os._exit(3)
        raise


def pytest_runtest_logreport(report):
    path = os.environ.get("WIDE_TEST_FAILURES")
    if path and report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(path, "a") as f:
            f.write(f"\n===== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


# The test files that take longest (``pytest --durations=0``; seconds on a 2-core machine), longest
# first. pytest-xdist's ``--dist loadfile`` hands out whole files in collection order when given
# ``--no-loadscope-reorder`` (the Makefile does): these go first, so that the run ends on short
# files instead of one long file running alone on one worker while the other is idle.
# The files of two full runs' per-test times (junit) that were heavy in both but missing here ran in
# alphabetical order after these, test_widen_properties and test_vision_models among the last: they
# are ranked here too, so that the run ends on short files.
HEAVY_FIRST = (  # busy-machine seconds per file, issue 46's run: 990, 450, 425, 380, ... 50
    "test_real_models.py", "test_ray.py", "test_bench_vision.py", "test_padding.py", "test_dynamic_sizes.py",
    "test_op_db.py", "test_cli.py", "test_examples.py", "test_trust_check.py", "test_distributed.py",
    "test_padding_adversarial.py", "test_random_ops.py", "test_hf_trainer.py", "test_bench_registry.py",
    "test_fuzz_models.py", "test_tiling.py", "test_widen_rules.py", "test_attention_models.py", "test_norm.py",
    "test_lightning.py", "test_compile.py", "test_attention_dropout_sweep.py", "test_rule_coverage.py",
    "test_constants_proved.py", "test_fuzz_ops.py", "test_widen_properties.py", "test_vision_models.py",
    "test_blocks.py", "test_analyze.py", "test_nn_seed_modules.py", "test_rnn.py",
)


def pytest_collection_modifyitems(config, items):
    """The files of HEAVY_FIRST first, in its order; the rest after them in their own order. Off
    the CPU, the tests of CPU_ONLY_FILES and those marked ``cpu_only`` are skipped (before any of
    their fixtures runs). ``WIDE_TEST_ONLY=FILE`` keeps only the tests whose ids FILE lists (one a
    line; a GPU run of the tests an earlier one failed: ids hold spaces and brackets that a
    command line would split)."""
    rank = {name: k for k, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
    only = os.environ.get("WIDE_TEST_ONLY")
    if only:
        wanted = {line.strip() for line in Path(only).read_text().splitlines() if line.strip()}
        config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in wanted])
        items[:] = [item for item in items if item.nodeid in wanted]
    if TEST_DEVICE.type != "cpu":
        skip = pytest.mark.skip(reason=f"tests the CPU alone (not run on {TEST_DEVICE.type})")
        for item in items:
            if item.path.name in CPU_ONLY_FILES or item.get_closest_marker("cpu_only"):
                item.add_marker(skip)
