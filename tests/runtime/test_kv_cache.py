"""KV cache: rollback is a length change, and a rolled-back cache continues exactly like a
fresh run; capacity arithmetic."""

from __future__ import annotations

import os

import numpy as np
import pytest

from specedge.runtime.backends.ort_cpu import OrtCpuBackend
from specedge.runtime.bundle import load_bundle
from specedge.runtime.kv_cache import CAPACITY_STEP, KVCache, SlotCaches, capacity_for, zeroed


@pytest.fixture(scope="module", params=["portable", "fused"])
def backend(request, tiny_bundle, tiny_fused_bundle):
    """Both KV layouts: the runtime writes the new rows (portable), the graph writes them
    in place (fused, GroupQueryAttention)."""
    bundle = tiny_fused_bundle if request.param == "fused" else tiny_bundle
    return OrtCpuBackend(load_bundle(bundle).target)


def test_rollback_then_continue_equals_fresh_run(backend):
    rolled = backend.new_cache(64)
    backend.forward(rolled, [1, 5, 6, 7], 1)
    backend.forward(rolled, [8, 9, 10], 3)        # a verification that gets rejected...
    addresses = [k.ctypes.data for k in rolled.keys]
    rolled.rollback(5)                            # ...keeping one accepted draft row
    got = backend.forward(rolled, [11, 12], 2).copy()

    fresh = backend.new_cache(64)
    want = backend.forward(fresh, [1, 5, 6, 7, 8, 11, 12], 2).copy()
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert rolled.length == fresh.length == 7
    for a, b in zip(rolled.keys + rolled.values, fresh.keys + fresh.values):
        np.testing.assert_allclose(a[:, :, :7], b[:, :, :7], atol=1e-5)
    assert [k.ctypes.data for k in rolled.keys] == addresses  # fixed buffers, no realloc


def test_stale_rows_are_never_read(backend):
    """Garbage beyond `length` must not change the logits: rows past it are masked."""
    clean = backend.new_cache(64)
    dirty = backend.new_cache(64)
    for cache in (clean, dirty):
        backend.forward(cache, [1, 5, 6], 1)
    for buf in dirty.keys + dirty.values:
        buf[:, :, 3:] = 1e4
    a = backend.forward(clean, [7], 1).copy()
    b = backend.forward(dirty, [7], 1).copy()
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_logits_do_not_depend_on_capacity(backend):
    small, large = backend.new_cache(8), backend.new_cache(512)
    a = backend.forward(small, [1, 5, 6, 7], 4).copy()
    b = backend.forward(large, [1, 5, 6, 7], 4).copy()
    np.testing.assert_allclose(a, b, atol=1e-5)


def test_grown_cache_holds_the_rows_and_continues_like_a_fresh_run(backend):
    small = backend.new_cache(8)
    backend.forward(small, [1, 5, 6, 7, 8], 1)
    big = small.grown(32)
    assert big.capacity == 32 and big.length == 5
    assert big.keys[0].ctypes.data != small.keys[0].ctypes.data
    for a, b in zip(small.keys + small.values, big.keys + big.values):
        np.testing.assert_array_equal(a[:, :, :5], b[:, :, :5])
    got = backend.forward(big, [9, 10, 11, 12, 13], 2).copy()  # past the old capacity
    want = backend.forward(backend.new_cache(32), [1, 5, 6, 7, 8, 9, 10, 11, 12, 13], 2)
    np.testing.assert_allclose(got, want, atol=1e-5)
    with pytest.raises(ValueError, match="shrink"):
        big.grown(4)


def test_cache_full_is_an_error_not_an_overflow(backend):
    cache = backend.new_cache(4)
    backend.forward(cache, [1, 2, 3], 1)
    with pytest.raises(ValueError, match="KV cache full"):
        backend.forward(cache, [4, 5], 1)
    assert cache.length == 3


def test_kvcache_write_and_rollback_arithmetic():
    cache = KVCache(num_layers=2, num_kv_heads=1, head_dim=2, capacity=5)
    cache.write(np.full((4, 1, 1, 3, 2), 7.0, np.float32))
    assert cache.length == 3 and cache.keys[1][0, 0, 2, 0] == 7.0
    cache.rollback(1)
    assert cache.length == 1
    with pytest.raises(ValueError):
        cache.rollback(2)
    with pytest.raises(ValueError):
        cache.write(np.zeros((4, 1, 1, 5, 2), np.float32))


def test_kvcache_advance_counts_rows_written_in_place():
    cache = KVCache(num_layers=1, num_kv_heads=1, head_dim=2, capacity=5)
    cache.advance(3)
    assert cache.length == 3
    with pytest.raises(ValueError, match="KV cache full"):
        cache.advance(3)
    assert cache.length == 3


def test_capacity_for():
    assert capacity_for(1, 8192) == CAPACITY_STEP
    assert capacity_for(CAPACITY_STEP + 1, 8192) == 2 * CAPACITY_STEP
    assert capacity_for(300, 300) == 300
    assert capacity_for(65, 8192, step=64) == 128
    with pytest.raises(ValueError):
        capacity_for(301, 300)


def test_slot_caches_resize_keeps_every_slots_rows_both_ways():
    caches = SlotCaches(num_layers=2, num_kv_heads=1, head_dim=2, capacity=8, slots=3, spare=2)
    for slot, n in zip(caches.slots, (3, 0, 5)):
        slot.write(np.random.default_rng(n).random((4, 1, 1, n, 2), dtype=np.float32))
    before = [slot.planes[..., :slot.length, :].copy() for slot in caches.slots]
    for capacity in (20, 6):
        caches.resize(capacity)
        assert caches.capacity == capacity and caches.planes.shape[3] == capacity + 2
        for slot, rows in zip(caches.slots, before):
            assert slot.capacity == capacity and slot.planes.base is caches.planes
            assert np.array_equal(slot.planes[..., :slot.length, :], rows)
            assert all(k.base is caches.planes for k in slot.keys + slot.values)
    with pytest.raises(ValueError, match="holds 5 rows"):
        caches.resize(4)


def test_zeroed_buffers_are_private_zeros():
    """Cache buffers (`zeroed`) start at zero, take writes, and stay the process's own: a
    forked child's write does not reach them (a shared mapping would)."""
    small, large = zeroed((3, 4)), zeroed((8, 1024, 256))
    assert small.shape == (3, 4) and not small.any() and large.dtype == np.float32
    assert not large.any()
    large[1, 2, 3] = 5.0
    assert large.sum() == 5.0
    pid = os.fork()
    if pid == 0:  # the child
        large[0, 0, 0] = 7.0
        os._exit(0)
    os.waitpid(pid, 0)
    assert large[0, 0, 0] == 0.0
