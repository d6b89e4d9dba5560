"""The opt-in 8-bit KV cache (torch.float8_e5m2) in the native ops.

The cache write rounds each value to e5m2 exactly as torch's own conversion
does (same bytes); attention widens the bytes exactly, so against the torch
reference on the same fp8 cache the kernels are as close as with a cache of
the activations' dtype.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import native
from executor.torch_ops import reshape_and_cache as ref_reshape_and_cache
from tests.native.helpers import SUPPORTED_ISAS, attend, case_batch, reference, tolerance

F8 = torch.float8_e5m2
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _check(case):
    batch = case_batch(case, kv_dtype=F8)
    assert batch["key_cache"].dtype == F8
    got = attend(batch, case["d"] ** -0.5)
    want = reference(batch, case["d"] ** -0.5)
    err = (got.float() - want).abs().max().item() if got.numel() else 0.0
    assert err <= tolerance(case["dtype"]), (err, case)
    return got


@st.composite
def cases(draw):
    block_size = draw(st.sampled_from([8, 16, 32, 64]))
    hkv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 3, 4]))
    nseq = draw(st.integers(1, 4))
    return dict(
        q_lens=draw(
            st.lists(st.sampled_from([0, 1, 2, 5, block_size + 3, 2 * block_size + 1]), min_size=nseq, max_size=nseq)
        ),
        ctx_lens=draw(st.lists(st.integers(0, 3 * block_size + 5), min_size=nseq, max_size=nseq)),
        hq=hkv * group,
        hkv=hkv,
        d=draw(st.sampled_from([24, 64, 96, 128])),
        block_size=block_size,
        dtype=draw(st.sampled_from(DTYPES)),
        seed=draw(st.integers(0, 2**16)),
    )


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_attention_over_an_fp8_cache_matches_the_reference(isa, case):
    _check(case)


@pytest.mark.parametrize("dtype", DTYPES)
def test_smollm2_mixed_batch_over_an_fp8_cache(isa, dtype):
    """Decode (whole-row items), prefill and chunked prefill with context, SmolLM2 heads."""
    _check(
        dict(
            q_lens=[1] * 6 + [70, 33],
            ctx_lens=[200, 17, 64, 5, 130, 90, 0, 100],
            hq=9,
            hkv=3,
            d=64,
            block_size=16,
            dtype=dtype,
            seed=3,
        )
    )


def test_amx_prefill_over_an_fp8_cache_agrees_with_the_avx512_kernels():
    if "amx" not in SUPPORTED_ISAS:
        pytest.skip("no AMX-BF16 here")
    case = dict(q_lens=[150, 40], ctx_lens=[60, 300], hq=9, hkv=3, d=64, block_size=16, dtype=torch.bfloat16, seed=5)
    before = native.cpu_features()["isa"]
    try:
        native._set_isa("amx")
        amx = _check(case)
        native._set_isa("avx512")
        avx = _check(case)
    finally:
        native._set_isa(before)
    assert (amx.float() - avx.float()).abs().max().item() <= 2e-2


@pytest.mark.parametrize("dtype", DTYPES)
def test_cache_write_rounds_like_torch(isa, dtype):
    """Ties, subnormals, overflow to inf, inf, NaN and signed zero land on the
    bytes torch's float8_e5m2 conversion gives; skipped slots stay untouched."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(6000, generator=g) * torch.logspace(-9, 5, 6000)
    special = [
        float("nan"),
        float("inf"),
        -float("inf"),
        65536.0,
        61440.0,
        61439.0,
        57344.0,
        -57344.0,
        2.0**-16,
        2.0**-17,
        3 * 2.0**-17,
        2.0**-18,
        1e-30,
        -0.0,
        0.0,
        1.125,
        1.375,
        -2.5,
    ]
    x = torch.cat([x, torch.tensor(special)])
    n = x.numel() // 2 * 2
    key = x[:n].to(dtype).view(-1, 2, 1).expand(-1, 2, 8).contiguous()  # [T, Hkv=2, D=8]
    value = -key
    T = key.shape[0]
    kc = torch.full((T + 4, 1, 2, 8), 1.0).to(F8)
    vc = kc.clone()
    kc2, vc2 = kc.clone(), vc.clone()
    slots = torch.arange(T)
    slots[5] = -1  # skipped
    native.reshape_and_cache(key, value, kc, vc, slots)
    ref_reshape_and_cache(key, value, kc2, vc2, slots)
    assert torch.equal(kc.view(torch.uint8), kc2.view(torch.uint8))
    assert torch.equal(vc.view(torch.uint8), vc2.view(torch.uint8))
    assert torch.equal(kc[slots[slots >= 0]].view(torch.uint8), key[slots >= 0].to(F8).view(torch.uint8).unsqueeze(1))
    assert torch.equal(kc[5].float(), torch.ones(1, 2, 8)) and torch.equal(kc[T:].float(), torch.ones(4, 1, 2, 8))


def test_fp8_cache_halves_the_bytes_and_round_trips_within_e5m2_precision():
    key = torch.randn(64, 3, 64, dtype=torch.bfloat16)
    kc = torch.zeros(4, 16, 3, 64, dtype=F8)
    vc = torch.zeros_like(kc)
    native.reshape_and_cache(key, key, kc, vc, torch.arange(64))
    assert kc.element_size() == 1
    back = kc.view(64, 3, 64).float()
    rel = ((back - key.float()).abs() / key.float().abs().clamp_min(2.0**-14)).max().item()
    assert rel <= 0.125  # 2 mantissa bits: half a step is 1/8 of the value at most
