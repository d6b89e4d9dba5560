"""The CPU KV pool (executor/kv_cache.cpu_pool): one mapping for every
layer's K and V, zeroed and committed at start-up, each tensor its own
non-overlapping contiguous slice, backed by 2 MB pages where the kernel's
transparent huge pages allow them, and swap copies through it exact."""

from __future__ import annotations

import pytest
import torch

from executor.kv_cache import CacheShape, KVCache, cache_dtype, cpu_pool
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
    cache = KVCache(
        CacheShape(num_layers=2, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16), num_blocks=1024
    )  # 2 x 2 x 6 MB
    lo = min(t.data_ptr() for t in cache.key + cache.value)
    hi = max(t.data_ptr() + t.numel() * t.element_size() for t in cache.key + cache.value)
    huge_kb = anon_huge_kb(lo, hi)
    assert huge_kb >= 8 * 1024, f"{huge_kb} kB of huge pages under a 24 MB cache"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e5m2])
def test_swap_round_trip_through_the_pool(dtype):
    shape = CacheShape(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype)
    cache = KVCache(shape, num_blocks=6, num_swap_blocks=3)
    assert cache.key[0].dtype == dtype and cache.host_key[0].dtype == dtype
    for layer in range(3):
        cache.key[layer].copy_(torch.randn(cache.key[layer].shape).to(dtype))
        cache.value[layer].copy_(torch.randn(cache.value[layer].shape).to(dtype))
    bits = (lambda t: t.view(torch.uint8)) if dtype == torch.float8_e5m2 else (lambda t: t)
    want_k = [bits(cache.key[layer][[1, 4]]).clone() for layer in range(3)]
    want_v = [bits(cache.value[layer][[1, 4]]).clone() for layer in range(3)]
    cache.swap_out([(1, 0), (4, 2)])
    for layer in range(3):
        bits(cache.key[layer]).zero_()
        bits(cache.value[layer]).zero_()
    cache.swap_in([(0, 5), (2, 0)])
    for layer in range(3):
        assert torch.equal(bits(cache.key[layer][[5, 0]]), want_k[layer])
        assert torch.equal(bits(cache.value[layer][[5, 0]]), want_v[layer])


def test_fp8_blocks_are_half_the_bytes_of_bf16_ones():
    bf16 = CacheShape(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16)
    fp8 = CacheShape(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.float8_e5m2)
    assert bf16.bytes_per_block == 2 * fp8.bytes_per_block == 2 * 2 * 30 * 16 * 3 * 64
    assert (
        fp8.blocks_for(1000 * bf16.bytes_per_block + 7) == 2000 == 2 * bf16.blocks_for(1000 * bf16.bytes_per_block + 7)
    )


def test_cache_dtype_choices():
    assert cache_dtype("auto", torch.bfloat16, "cpu") == torch.bfloat16
    assert cache_dtype("auto", torch.float32, "cuda:0") == torch.float32
    assert cache_dtype("fp8_e5m2", torch.float32, "cpu") == torch.float8_e5m2
    with pytest.raises(ValueError, match="fp8_e5m2 has CPU kernels only"):
        cache_dtype("fp8_e5m2", torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="must be 'auto' or 'fp8_e5m2'"):
        cache_dtype("int8", torch.bfloat16, "cpu")
