"""Shared fixtures. The equivalence checks and the tolerance table (with its justification) are
the public module :mod:`wide_compiler.testing`; tests import them from there."""
from __future__ import annotations

import os
import random

import pytest
import torch


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


@pytest.fixture(autouse=True)
def _isolated_cache_dir(tmp_path_factory, monkeypatch):
    """Point the tuning cache at a temporary directory: tests never touch ~/.cache. The compile
    cache is off (tests compile what they mean to compile, and storing every graph costs time);
    tests/python/test_compile_cache.py turns it on."""
    cache = tmp_path_factory.mktemp("wide_cache")
    monkeypatch.setenv("WIDE_COMPILER_CACHE_DIR", str(cache))
    monkeypatch.setenv("WIDE_COMPILE_CACHE", "0")
    return cache


@pytest.fixture(autouse=True)
def _default_dtype_guard():
    """Fail loudly if a test leaks a changed default dtype into the next one."""
    before = torch.get_default_dtype()
    yield
    after = torch.get_default_dtype()
    torch.set_default_dtype(before)
    assert after == before, f"test changed the default dtype from {before} to {after}"


def pytest_configure(config):
    # Two shared cores: keep intra-op threads modest so parallel sessions stay usable.
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(min(2, torch.get_num_threads()))
