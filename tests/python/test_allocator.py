"""Note [The wide caching allocator] (csrc/wide/memory/caching_allocator.cpp): a WideModel's
calls and backward passes allocate from its cache; nothing outside a scope changes; an output
handed to the user is never reused while alive."""

import os
import threading

import pytest
import torch
from torch import nn

import wide_compiler as wc
from wide_compiler import allocator, testing

FAST = wc.WideConfig.fast()
BIG = 1 << 18  # floats: 1 MiB, above the 64 KiB floor


def _net():
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 64))


def test_outside_a_scope_nothing_is_cached():
    before = allocator.cache_info()
    t = torch.empty(BIG)
    assert allocator.cache_info().live_bytes == before.live_bytes
    del t
    assert allocator.cache_info().cached_bytes == before.cached_bytes


def test_a_scope_reuses_freed_blocks_and_small_ones_are_left_alone():
    allocator.empty_cache()
    with allocator.caching_scope():
        before = allocator.cache_info()
        a = torch.empty(BIG)
        small = torch.empty(16)
        assert allocator.cache_info().live_bytes == before.live_bytes + 4 * BIG
        ptr = a.data_ptr()
        del a
        b = torch.empty(BIG - 100)  # best fit within 5/4 of the request
        assert b.data_ptr() == ptr
        assert allocator.cache_info().hits == before.hits + 1
    del b, small


def test_scopes_nest_and_leaving_too_often_is_an_error():
    with allocator.caching_scope():
        with allocator.caching_scope():
            pass
        t = torch.empty(BIG)  # still inside the outer scope
        assert allocator.cache_info().live_bytes >= 4 * BIG
    del t
    with pytest.raises(RuntimeError, match="not entered"):
        torch.ops.wide._caching_scope(False)


def test_scopes_are_per_thread():
    seen = {}

    def other():
        before = allocator.cache_info().live_bytes
        t = torch.empty(BIG)
        seen["delta"] = allocator.cache_info().live_bytes - before
        del t

    with allocator.caching_scope():
        keep = torch.empty(BIG)
        th = threading.Thread(target=other)
        th.start()
        th.join()
    assert seen["delta"] == 0
    del keep


def test_a_backward_scope_closed_on_another_thread_is_left_by_its_own():
    """The engine may run a backward pass's final callback on a device's worker thread (Note [A
    backward pass that ends on another thread]): closing there neither fails nor leaves the
    worker's scope; the entering thread leaves it when the scope object goes."""
    scope = allocator._BackwardScope()
    errors = []

    def close_elsewhere():
        try:
            scope.close()
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    th = threading.Thread(target=close_elsewhere)
    th.start()
    th.join()
    assert not errors
    assert torch.ops.wide._caching_scope(True) == 1  # still inside it here: now two deep
    torch.ops.wide._caching_scope(False)
    scope = None  # its last reference: __del__ leaves the scope here
    with pytest.raises(RuntimeError, match="not entered"):
        torch.ops.wide._caching_scope(False)


def test_outputs_are_never_reused_while_alive():
    """Two calls in a row: the first output keeps its values and its memory."""
    models = testing.make_members(_net, 3)
    wide = wc.compile(models, torch.randn(256, 64), config=FAST)
    x1, x2 = torch.randn(3, 256, 64), torch.randn(3, 256, 64)
    with torch.no_grad():
        y1 = wide(x1)
        want = y1.clone()
        for _ in range(3):
            y2 = wide(x2)
            assert y2.data_ptr() != y1.data_ptr()
    torch.testing.assert_close(y1, want, rtol=0, atol=0)
    testing.assert_members_close(y2, [m(x2[i]) for i, m in enumerate(models)])


def test_steady_calls_hit_the_cache():
    models = testing.make_members(_net, 3)
    wide = wc.compile(models, torch.randn(256, 64), config=FAST)
    x = torch.randn(3, 256, 64)
    with torch.no_grad():
        wide(x)
        hits = allocator.cache_info().hits
        wide(x)
    assert allocator.cache_info().hits > hits


def test_training_steps_match_and_backward_leaves_no_scope_open():
    """The backward pass runs in a scope entered by a hook and left by the engine's final
    callback: gradients are the members' and the thread is outside any scope afterwards."""
    models = testing.make_members(_net, 3)
    wide = wc.compile([m.train() for m in models], torch.randn(256, 64), config=FAST).train()
    x = torch.randn(3, 256, 64)
    for _ in range(2):
        wide.zero_grad()
        wide(x).square().sum().backward()
    for i, m in enumerate(models):
        m(x[i]).square().sum().backward()
    for name, p in wide.named_parameters():
        torch.testing.assert_close(p.grad, torch.stack([m.get_parameter(name).grad for m in models]),
                                   rtol=1e-4, atol=1e-4)
    live = allocator.cache_info().live_bytes
    t = torch.empty(BIG)
    assert allocator.cache_info().live_bytes == live
    del t


def _assert_outside_a_scope():
    with pytest.raises(RuntimeError, match="not entered"):
        torch.ops.wide._caching_scope(False)


@pytest.mark.parametrize("how", ["backward", "autograd.grad", "thread"])
def test_a_failed_backward_leaves_no_scope_open(how):
    """The engine drops its final callbacks when a hook or node raises: the scope entered by the
    wide node's pre-hook is left anyway, and the next backward pass is exact."""
    models = testing.make_members(_net, 3)
    wide = wc.compile([m.train() for m in models], torch.randn(256, 64), config=FAST).train()
    x = torch.randn(3, 256, 64, requires_grad=True)
    calls = []

    def boom(grad):
        calls.append(grad.shape)
        raise RuntimeError("boom in a user hook")

    def run():
        y = wide(x)
        handle = x.register_hook(boom)  # runs after the wide node's pre-hook entered the scope
        with pytest.raises(RuntimeError, match="boom in a user hook"):
            if how == "autograd.grad":
                torch.autograd.grad(y.sum(), [x])
            else:
                y.sum().backward()
        handle.remove()
        _assert_outside_a_scope()
        wide.zero_grad()
        x.grad = None
        wide(x).square().sum().backward()
        _assert_outside_a_scope()

    if how == "thread":
        outcome = []

        def in_thread():
            try:
                run()
                outcome.append("ok")
            except BaseException as e:  # noqa: BLE001 - reported by the assertion below
                outcome.append(e)

        t = threading.Thread(target=in_thread)
        t.start()
        t.join()
        assert outcome == ["ok"]
    else:
        run()
    assert calls == [x.shape]
    _assert_outside_a_scope()
    for i, m in enumerate(models):
        m(x[i].detach()).square().sum().backward()
    for name, p in wide.named_parameters():
        torch.testing.assert_close(p.grad, torch.stack([m.get_parameter(name).grad for m in models]),
                                   rtol=1e-4, atol=1e-4)


def test_the_limit_bounds_what_is_kept():
    try:
        allocator.set_cache_limit(0)
        with allocator.caching_scope():
            t = torch.empty(BIG)
        del t
        assert allocator.cache_info().cached_bytes == 0
    finally:
        allocator.set_cache_limit(None)
    for bad in (-5, 1.5, True):
        with pytest.raises(ValueError, match="byte count"):
            allocator.set_cache_limit(bad)


def test_blocks_unused_for_many_calls_go_back_and_used_ones_stay():
    """Every 32 outermost scope exits, blocks freed 32 or more exits earlier and not taken since
    are released (a model no longer called stops holding memory); a block taken every call stays."""
    allocator.empty_cache()
    with allocator.caching_scope():
        stale = torch.empty(3 * BIG + 7)  # a size nothing else asks for
    del stale
    held = allocator.cache_info().cached_bytes
    assert held >= 12 * BIG
    misses = allocator.cache_info().misses
    for _ in range(70):
        with allocator.caching_scope():
            t = torch.empty(BIG)  # taken and freed every "call"
        del t
    info = allocator.cache_info()
    assert info.cached_bytes < 12 * BIG  # the stale block went back
    assert info.misses <= misses + 1  # the steady one did not


def _ram() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def _default_limit(peak: int) -> int:
    return max(1 << 30, min(2 * peak, _ram() // 16))


def test_the_default_limit_follows_the_working_set():
    """The default keeps every block of a working set above 1 GiB (a fixed 1 GiB let ResNet-18's
    N=16 training step miss 1-9 blocks a step), up to a sixteenth of the machine's memory;
    empty_cache() releases them and restarts the peak. The blocks are never touched, so no
    memory is committed."""
    allocator.empty_cache()
    base = allocator.cache_info()
    assert base.limit_bytes == _default_limit(base.peak_bytes)
    chunk = 300 << 20  # bytes; 4 of them need a limit above 1.2 GiB, so a machine of 20 GiB or more
    if _default_limit(base.live_bytes + 4 * chunk) < base.live_bytes + 4 * chunk:
        pytest.skip("a sixteenth of this machine's memory is below 1.2 GiB")
    with allocator.caching_scope():
        blocks = [torch.empty(chunk, dtype=torch.uint8) for _ in range(4)]
    peak = allocator.cache_info().peak_bytes
    assert peak >= base.live_bytes + 4 * chunk
    del blocks
    info = allocator.cache_info()
    assert info.limit_bytes == _default_limit(peak) and info.cached_bytes >= 4 * chunk  # all kept
    with allocator.caching_scope():  # and served again
        blocks = [torch.empty(chunk, dtype=torch.uint8) for _ in range(4)]
    assert allocator.cache_info().hits >= info.hits + 4
    del blocks
    try:
        allocator.set_cache_limit(1 << 30)  # a fixed limit trims at once
        assert allocator.cache_info().cached_bytes <= 1 << 30
    finally:
        allocator.set_cache_limit(None)
    allocator.empty_cache()
    info = allocator.cache_info()
    assert info.cached_bytes == 0 and info.peak_bytes == info.live_bytes
    assert info.limit_bytes == _default_limit(info.peak_bytes)


def test_hand_built_modules_forward_and_backward_use_the_cache():
    """wc.nn modules (through wide_compiler.functional) run each call and its backward pass in a
    caching scope: a second training step hits the cache in both, gradients match the members,
    and the thread is outside any scope afterwards."""
    torch.manual_seed(0)
    members = [nn.Linear(256, 512) for _ in range(4)]
    layer = wc.nn.WideLinear.from_modules(members)
    x = torch.randn(4, 128, 256)

    def step():
        layer.zero_grad()
        layer(x).square().sum().backward()

    step()
    hits = allocator.cache_info().hits
    step()
    assert allocator.cache_info().hits > hits
    for i, m in enumerate(members):
        m(x[i]).square().sum().backward()
        torch.testing.assert_close(layer.weight.grad[i], m.weight.grad, rtol=1e-4, atol=1e-3)
    live = allocator.cache_info().live_bytes
    t = torch.empty(BIG)
    assert allocator.cache_info().live_bytes == live  # not in a scope any more
    del t
    with torch.no_grad():  # no backward hooks without grad mode; the output is the op's
        torch.testing.assert_close(layer(x)[2], members[2](x[2]))
