"""Shared fixtures and the ONE place where numerical tolerances are stated.

Tolerances
----------
A wide op computes all N members in one kernel (a batched GEMM, or one GEMM against the weights
concatenated on the output dim for a shared input) where the reference runs N separate ops. Both
compute the same sums, but BLAS blocks and vectorises them differently, so floating-point
additions happen in a different order. The results are therefore equal only up to rounding:

* float32: each output is a dot product of a few dozen terms in these tests; reordering a sum of
  k terms moves the result by about k * eps32 * sum|terms| (eps32 = 1.2e-7). With the small,
  unit-scale shapes used here that stays well under 1e-5, so forward outputs use rtol=atol=1e-5.
  Gradients go through one more GEMM (and, for a shared input, a sum over members), so they get
  a little more room: 1e-4 absolute / 1e-5 relative. An optimizer step scales gradients by the
  learning rate, so weights after a step use the forward tolerance.
* float64: the same argument with eps64 = 2.2e-16 gives errors far below 1e-10.

A real bug (a member reading another member's weights, a wrong dim, a missing bias) produces
errors of order 1, many orders of magnitude above these bounds.
"""
from __future__ import annotations

import os
import random
from collections.abc import Sequence

import pytest
import torch

# --------------------------------------------------------------------------------------------
# Tolerances (see the module docstring for the justification).
# --------------------------------------------------------------------------------------------
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float64: {"rtol": 1e-10, "atol": 1e-10},
}
GRAD_TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-4},
    torch.float64: {"rtol": 1e-10, "atol": 1e-10},
}


def tol(dtype: torch.dtype, *, grad: bool = False) -> dict[str, float]:
    """rtol/atol for comparing a wide result against N separate members in `dtype`."""
    table = GRAD_TOLERANCES if grad else TOLERANCES
    return table[dtype]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None,
                 *, grad: bool = False, msg: str = "") -> None:
    """torch.testing.assert_close with the suite's tolerances (and exact dtype/shape checks)."""
    dtype = dtype or expected.dtype
    torch.testing.assert_close(actual, expected, **tol(dtype, grad=grad),
                               msg=(lambda m: f"{msg}\n{m}") if msg else None)


def assert_members_close(wide_out: torch.Tensor, member_outs: Sequence[torch.Tensor],
                         dtype: torch.dtype | None = None, *, grad: bool = False,
                         what: str = "output") -> None:
    """Check that wide_out[i] equals member_outs[i] for every member i.

    wide_out is N-first ([N, ...]); member_outs is a sequence of N tensors of shape [...].
    A failure names the first member index that differs and by how much.
    """
    n = len(member_outs)
    assert isinstance(wide_out, torch.Tensor), f"{what}: expected a Tensor, got {type(wide_out)}"
    assert wide_out.dim() >= 1 and wide_out.shape[0] == n, (
        f"{what}: expected N-first tensor with N={n} members, got shape {tuple(wide_out.shape)}")
    dtype = dtype or member_outs[0].dtype
    for i, ref in enumerate(member_outs):
        got = wide_out[i]
        assert got.shape == ref.shape, (
            f"{what}: member {i}: shape {tuple(got.shape)} != expected {tuple(ref.shape)}")
        assert got.dtype == ref.dtype, f"{what}: member {i}: dtype {got.dtype} != {ref.dtype}"
        torch.testing.assert_close(
            got, ref, **tol(dtype, grad=grad),
            msg=lambda m, i=i: f"{what}: member {i} of {n} differs from its reference:\n{m}")


def assert_trees_members_close(wide_out, member_outs: Sequence, dtype=None, *, grad=False,
                               what="output") -> None:
    """assert_members_close over matching pytrees (tuple/list/dict outputs)."""
    from torch.utils._pytree import tree_flatten

    wide_leaves, wide_spec = tree_flatten(wide_out)
    per_member = [tree_flatten(o) for o in member_outs]
    for i, (_, spec) in enumerate(per_member):
        assert spec == wide_spec, f"{what}: member {i}: output structure {spec} != wide {wide_spec}"
    for k, leaf in enumerate(wide_leaves):
        assert_members_close(leaf, [leaves[k] for leaves, _ in per_member], dtype, grad=grad,
                             what=f"{what}[leaf {k}]")


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
    """Point the tuning cache at a temporary directory: tests never touch ~/.cache."""
    cache = tmp_path_factory.mktemp("wide_cache")
    monkeypatch.setenv("WIDE_COMPILER_CACHE_DIR", str(cache))
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
