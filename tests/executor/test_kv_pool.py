"""The CPU KV pool (executor/kv_cache.cpu_pool): one mapping for every
layer's K and V, zeroed and committed at start-up, each tensor its own
non-overlapping contiguous slice, backed by 2 MB pages where the kernel's
transparent huge pages allow them, and swap copies through it exact."""

from __future__ import annotations

import pytest
import torch

from executor.kv_cache import CacheShape, KVCache, cpu_pool
from tests.executor.helpers import anon_huge_kb, thp_mode


def test_tensors_are_zeroed_contiguous_and_disjoint():
    tensors, mapping = cpu_pool(6, (5, 16, 3, 64), torch.bfloat16)
    assert mapping is not None and len(tensors) == 6
    assert all(t.is_contiguous() and t.shape == (5, 16, 3, 64) and not t.any() for t in tensors)
    for i, t in enumerate(tensors):
        t.fill_(i + 1)
    for i, t in enumerate(tensors):  # a write to one tensor never shows in another
        assert torch.equal(t, torch.full_like(t, i + 1))
    starts = sorted(t.data_ptr() for t in tensors)
    nbytes = tensors[0].numel() * tensors[0].element_size()
    assert all(b - a >= nbytes for a, b in zip(starts, starts[1:]))


def test_empty_pool():
    tensors, mapping = cpu_pool(4, (0, 16, 3, 64), torch.float32)
    assert mapping is None and [t.numel() for t in tensors] == [0] * 4


@pytest.mark.skipif(thp_mode() not in ("always", "madvise"), reason="transparent huge pages are off here")
def test_cpu_cache_sits_on_huge_pages():
    cache = KVCache(CacheShape(num_layers=2, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16),
                    num_blocks=1024)  # 2 x 2 x 6 MB
    lo = min(t.data_ptr() for t in cache.key + cache.value)
    hi = max(t.data_ptr() + t.numel() * t.element_size() for t in cache.key + cache.value)
    huge_kb = anon_huge_kb(lo, hi)
    assert huge_kb >= 8 * 1024, f"{huge_kb} kB of huge pages under a 24 MB cache"


def test_swap_round_trip_through_the_pool():
    shape = CacheShape(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float32)
    cache = KVCache(shape, num_blocks=6, num_swap_blocks=3)
    for layer in range(3):
        cache.key[layer].copy_(torch.randn_like(cache.key[layer]))
        cache.value[layer].copy_(torch.randn_like(cache.value[layer]))
    want_k = [cache.key[layer][[1, 4]].clone() for layer in range(3)]
    want_v = [cache.value[layer][[1, 4]].clone() for layer in range(3)]
    cache.swap_out([(1, 0), (4, 2)])
    for layer in range(3):
        cache.key[layer].zero_()
        cache.value[layer].zero_()
    cache.swap_in([(0, 5), (2, 0)])
    for layer in range(3):
        assert torch.equal(cache.key[layer][[5, 0]], want_k[layer])
        assert torch.equal(cache.value[layer][[5, 0]], want_v[layer])
