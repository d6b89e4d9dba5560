"""native.reshape_and_cache against the torch reference."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import native
from executor.torch_ops import reshape_and_cache as ref_reshape_and_cache


@settings(max_examples=30, deadline=None)
@given(
    num_blocks=st.integers(1, 6),
    block_size=st.sampled_from([8, 16, 32]),
    hkv=st.integers(1, 3),
    d=st.sampled_from([24, 64, 80]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    data=st.data(),
)
def test_matches_reference(num_blocks, block_size, hkv, d, dtype, data):
    slots = num_blocks * block_size
    t = data.draw(st.integers(0, slots))
    chosen = data.draw(st.permutations(range(slots)))[:t]
    # Some tokens are skipped with a negative slot (padding).
    mapping = [s if data.draw(st.booleans()) or s % 3 else -1 for s in chosen]
    key = torch.randn(t, hkv, d).to(dtype)
    value = torch.randn(t, hkv, d).to(dtype)
    kc = torch.randn(num_blocks, block_size, hkv, d).to(dtype)
    vc = torch.randn(num_blocks, block_size, hkv, d).to(dtype)
    kc2, vc2 = kc.clone(), vc.clone()
    sm = torch.tensor(mapping, dtype=torch.int64).reshape(t)
    native.reshape_and_cache(key, value, kc, vc, sm)
    ref_reshape_and_cache(key, value, kc2, vc2, sm)
    assert torch.equal(kc, kc2)
    assert torch.equal(vc, vc2)


def test_negative_slots_are_skipped():
    kc = torch.zeros(2, 4, 1, 8)
    vc = torch.zeros(2, 4, 1, 8)
    key = torch.arange(3 * 8, dtype=torch.float32).reshape(3, 1, 8) + 1
    native.reshape_and_cache(key, -key, kc, vc, torch.tensor([5, -1, 0]))
    assert torch.equal(kc.view(-1, 8)[5], key[0, 0])
    assert torch.equal(kc.view(-1, 8)[0], key[2, 0])
    assert torch.equal(vc.view(-1, 8)[0], -key[2, 0])
    untouched = [i for i in range(8) if i not in (0, 5)]
    assert kc.view(-1, 8)[untouched].abs().sum() == 0
    assert vc.view(-1, 8)[untouched].abs().sum() == 0


def test_large_batch_parallel():
    kc = torch.zeros(64, 16, 3, 64, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(64 * 16)[:900]
    key = torch.randn(900, 3, 64).to(torch.bfloat16)
    native.reshape_and_cache(key, key * 2, kc, vc, slots)
    assert torch.equal(kc.view(-1, 3, 64)[slots], key)
    assert torch.equal(vc.view(-1, 3, 64)[slots], key * 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_then_attention_reads_what_was_written(dtype):
    from tests.native.helpers import reference

    hkv, d, bs = 2, 64, 16
    kc = torch.zeros(8, bs, hkv, d, dtype=dtype)
    vc = torch.zeros_like(kc)
    k = torch.randn(40, hkv, d).to(dtype)
    v = torch.randn(40, hkv, d).to(dtype)
    table = torch.tensor([[5, 2, 7]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, i // bs]) * bs + i % bs for i in range(40)])
    native.reshape_and_cache(k, v, kc, vc, slots)
    q = torch.randn(40, 4, d).to(dtype)
    batch = dict(
        query=q,
        key_cache=kc,
        value_cache=vc,
        block_tables=table,
        cu_seqlens_q=torch.tensor([0, 40], dtype=torch.int32),
        seq_lens=torch.tensor([40], dtype=torch.int32),
    )
    out = torch.empty_like(q)
    native.paged_attention(out, scale=0.125, **batch)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.float() - reference(batch, 0.125)).abs().max() <= tol
