"""Layout helpers (stack/unstack/pack/unpack) and WideConfig."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

import wide_compiler as wc


# ---------------------------------------------------------------------------------------------
# stack / unstack: N-first [N, B, ...]
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(3,), (2, 5), (2, 3, 4)])
@pytest.mark.parametrize("n", [1, 4])
def test_stack_unstack_round_trip(n, shape):
    xs = [torch.randn(shape) for _ in range(n)]
    t = wc.stack(xs)
    assert t.shape == (n, *shape)
    for i in range(n):
        assert torch.equal(t[i], xs[i])
    back = wc.unstack(t)
    assert isinstance(back, list) and len(back) == n
    for i in range(n):
        assert torch.equal(back[i], xs[i])


def test_stack_accepts_any_sequence_and_keeps_dtype():
    xs = tuple(torch.randn(2, 3, dtype=torch.float64) for _ in range(3))
    t = wc.stack(xs)
    assert t.dtype == torch.float64 and t.shape == (3, 2, 3)
    assert torch.equal(wc.stack(iter(xs)), t)


def test_stack_errors():
    with pytest.raises(ValueError, match=r"at least one"):
        wc.stack([])
    with pytest.raises(ValueError, match=r"member 2 has shape \[2, 4\], member 0 has \[2, 3\]"):
        wc.stack([torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 4)])


def test_unstack_errors():
    with pytest.raises(ValueError, match=r"0-dim"):
        wc.unstack(torch.tensor(1.0))


# ---------------------------------------------------------------------------------------------
# pack / unpack: channel-packed [B, N*C, ...]
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(2, 3), (2, 3, 5), (1, 4, 3, 3)])
@pytest.mark.parametrize("n", [1, 3])
def test_pack_unpack_round_trip(n, shape):
    xs = [torch.randn(shape) for _ in range(n)]
    t = wc.pack(xs)
    b, c, *rest = shape
    assert t.shape == (b, n * c, *rest)
    for i in range(n):  # member i owns channels [i*C, (i+1)*C)
        assert torch.equal(t[:, i * c:(i + 1) * c], xs[i])
    back = wc.unpack(t, n)
    assert isinstance(back, list) and len(back) == n
    for i in range(n):
        assert torch.equal(back[i], xs[i])


def test_pack_and_stack_agree():
    xs = [torch.randn(2, 3, 4) for _ in range(3)]
    packed, stacked = wc.pack(xs), wc.stack(xs)
    assert torch.equal(packed, stacked.permute(1, 0, 2, 3).reshape(2, 9, 4))


def test_pack_errors():
    with pytest.raises(ValueError, match=r"at least one"):
        wc.pack([])
    with pytest.raises(ValueError, match=r"member 1 has \[2, 4\], member 0 has \[2, 3\]"):
        wc.pack([torch.zeros(2, 3), torch.zeros(2, 4)])
    with pytest.raises(ValueError, match=r"\[B, C, \.\.\.\]"):
        wc.pack([torch.zeros(3), torch.zeros(3)])


@pytest.mark.parametrize("shape, n", [((2, 7), 3), ((5,), 1), ((2, 6), 0), ((2, 6), -2)])
def test_unpack_errors(shape, n):
    with pytest.raises(ValueError, match=r"\[B, N\*C, \.\.\.\]"):
        wc.unpack(torch.zeros(shape), n)


# ---------------------------------------------------------------------------------------------
# WideConfig
# ---------------------------------------------------------------------------------------------
def test_config_defaults():
    cfg = wc.WideConfig()
    assert cfg == wc.WideConfig.default()
    assert cfg.strategy == "auto" and cfg.tune and cfg.cache
    assert not cfg.validate and not cfg.strict
    assert cfg.rtol > 0 and cfg.atol > 0


def test_config_presets():
    fast, debug, safe = wc.WideConfig.fast(), wc.WideConfig.debug(), wc.WideConfig.safe()
    assert not fast.tune
    assert debug.validate and debug.strict and not debug.tune and not debug.cache
    assert safe.validate and safe.strict and safe.tune
    assert debug.trace_members and safe.trace_members and not wc.WideConfig().trace_members
    for cfg in (fast, debug, safe):
        assert isinstance(cfg, wc.WideConfig)
        assert cfg.strategy == "auto"


def test_config_is_frozen_and_replace_makes_a_copy():
    cfg = wc.WideConfig.fast()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.tune = True
    other = cfg.replace(strategy="loop")
    assert other.strategy == "loop" and cfg.strategy == "auto"
    assert other.tune is False


@pytest.mark.parametrize("kwargs, pattern", [
    ({"strategy": "fastest"}, r"strategy"),
    ({"tune_repeats": 0}, r"tune_repeats"),
])
def test_config_validates_fields(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        wc.WideConfig(**kwargs)


def test_config_cache_dir_resolution(tmp_path, monkeypatch):
    # The autouse fixture points WIDE_COMPILER_CACHE_DIR at a tmp dir: the default honours it.
    monkeypatch.setenv("WIDE_COMPILER_CACHE_DIR", str(tmp_path / "env"))
    assert str(wc.WideConfig().resolved_cache_dir()) == str(tmp_path / "env")
    explicit = wc.WideConfig(cache_dir=str(tmp_path / "explicit"))
    assert str(explicit.resolved_cache_dir()) == str(tmp_path / "explicit")


@pytest.fixture(scope="module")
def _env_of_a_module_fixture():
    return os.environ.get("WIDE_COMPILER_CACHE_DIR"), os.environ.get("WIDE_COMPILE_CACHE")


def test_a_module_fixture_compiles_away_from_the_users_cache(_env_of_a_module_fixture):
    """A module-scoped fixture is set up before the autouse function-scoped one: the session-wide
    one (conftest) keeps it off ~/.cache and the compile cache off too."""
    cache_dir, compile_cache = _env_of_a_module_fixture
    assert compile_cache == "0" and cache_dir and "wide_cache_session" in cache_dir, _env_of_a_module_fixture


def test_public_surface():
    for name in ("compile", "WideModel", "WideConfig", "stack", "unstack", "pack", "unpack",
                 "ArchitectureMismatchError", "UnsupportedOperationError", "ValidationError",
                 "WideCompileError", "nn"):
        assert name in wc.__all__, name
        assert hasattr(wc, name), name
    assert wc.__version__ == "0.1.0"
    assert issubclass(wc.ArchitectureMismatchError, ValueError)
    assert issubclass(wc.WideCompileError, RuntimeError)
    assert issubclass(wc.UnsupportedOperationError, wc.WideCompileError)
    assert issubclass(wc.ValidationError, wc.WideCompileError)
