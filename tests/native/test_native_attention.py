"""native.paged_attention against the torch reference (executor.torch_ops)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import native
from tests.native.helpers import SUPPORTED_ISAS, attend, case_batch, make_batch, reference, tolerance

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def cases(draw):
    block_size = draw(st.sampled_from([8, 16, 32, 64, 128]))
    hkv = draw(st.integers(1, 3))
    group = draw(st.sampled_from([1, 3, 4, 8]))
    d = draw(st.sampled_from([64, 80, 96, 128, 24]))
    nseq = draw(st.integers(1, 4))
    q_lens = draw(
        st.lists(st.sampled_from([0, 1, 1, 2, 5, block_size + 3, 2 * block_size + 1]), min_size=nseq, max_size=nseq)
    )
    ctx_lens = draw(st.lists(st.integers(0, 3 * block_size + 5), min_size=nseq, max_size=nseq))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    return dict(
        q_lens=q_lens, ctx_lens=ctx_lens, hq=hkv * group, hkv=hkv, d=d, block_size=block_size, dtype=dtype, seed=seed
    )


def check(case):
    batch = case_batch(case)
    scale = case["d"] ** -0.5
    got = attend(batch, scale)
    want = reference(batch, scale)
    assert got.dtype == case["dtype"]
    err = (got.float() - want).abs().max().item() if got.numel() else 0.0
    assert err <= tolerance(case["dtype"]), (err, case)


@settings(max_examples=35, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=cases())
def test_matches_reference(isa, case):
    check(case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_smollm2_mixed_batch(isa, dtype, block_size):
    """Decode, prefill and chunked prefill with context in one call, SmolLM2 heads."""
    check(
        dict(
            q_lens=[1, 70, 0, 33, 1],
            ctx_lens=[200, 0, 9, 100, 0],
            hq=9,
            hkv=3,
            d=64,
            block_size=block_size,
            dtype=dtype,
            seed=1,
        )
    )


def test_long_prefill_is_split_and_exact(isa):
    """One long prefill (many query chunks across threads) matches the reference."""
    check(dict(q_lens=[300], ctx_lens=[50], hq=8, hkv=2, d=64, block_size=16, dtype=torch.float32, seed=2))


def test_online_softmax_large_logits(isa):
    """Scores far from 0 (stable max subtraction across KV tiles)."""
    batch = make_batch([3, 1], [150, 300], hq=4, hkv=2, d=64, block_size=16, seed=3)
    batch["query"] *= 30.0
    got = attend(batch, 0.125)
    want = reference(batch, 0.125)
    assert (got - want).abs().max().item() <= 1e-4


def run_at_threads(batch, scale, threads):
    """native.paged_attention with `threads` torch threads (restored after)."""
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        return attend(batch, scale)
    finally:
        torch.set_num_threads(n)


def test_threads_do_not_change_result(isa):
    batch = make_batch([40, 1, 17], [10, 90, 0], hq=6, hkv=3, d=64, block_size=16, seed=4)
    assert torch.equal(run_at_threads(batch, 0.125, 1), run_at_threads(batch, 0.125, 2))


def test_empty_batch_and_all_zero_queries(isa):
    batch = make_batch([0, 0], [5, 0], hq=2, hkv=1, d=64, block_size=8)
    out = torch.empty(0, 2, 64)
    native.paged_attention(out, scale=0.1, **batch)
    # No sequences at all.
    native.paged_attention(
        torch.empty(0, 2, 64),
        torch.empty(0, 2, 64),
        torch.zeros(1, 8, 1, 64),
        torch.zeros(1, 8, 1, 64),
        torch.zeros(0, 1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
        0.1,
    )


def test_cpu_features_reports_dispatch():
    f = native.cpu_features()
    assert f["isa"] in ("generic", "avx2", "avx512", "amx")
    assert f["supported"][0] is True
    assert native.has_cuda() in (True, False)
    with pytest.raises(ValueError, match="unknown ISA"):
        native._set_isa("sse9")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hkv", [(9, 3), (8, 2), (16, 4), (20, 4), (12, 2), (32, 8)])
def test_large_decode_batch_whole_row_items(isa, dtype, hq, hkv):
    """Enough decode sequences that one work item takes all KV heads of a
    sequence (where q_len x Hq <= 32 rows): same result as the reference,
    including empty, one-token and past-a-chunk (> 512) contexts, 2-token
    queries (24 and 32 rows for 12 / 2 and 16 / 4 heads; 40 and 64 rows,
    split by KV head, for 20 / 4 and 32 / 8) and a sequence with no query
    this step."""
    q_lens = [1, 1, 2, 1, 0, 1, 1, 2, 1, 1, 1, 1, 1, 1, 2, 1, 1, 1, 1, 1]
    ctx_lens = [0, 5, 17, 600, 9, 31, 64, 200, 1, 700, 16, 15, 100, 3, 50, 520, 80, 2, 40, 33]
    check(dict(q_lens=q_lens, ctx_lens=ctx_lens, hq=hq, hkv=hkv, d=64, block_size=16, dtype=dtype, seed=5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [40, 48, 56, 64])
@pytest.mark.parametrize("hq,hkv", [(1, 1), (2, 1), (3, 1), (4, 1), (5, 1), (6, 1), (7, 1), (8, 1), (9, 3)])
def test_decode_head_dims_33_to_64(isa, dtype, d, hq, hkv):
    """Head dims of two 32-element pairs, the second partly masked, at every
    query-row count the AVX-512 decode kernels specialise (scores in passes
    of 1-3 rows, P.V in even passes of 1-6: 7 rows as 4 + 3, a 2-token
    query of 8 heads' 16 rows as 5 + 5 + 6; 9 = 3 KV heads x 3): the
    reference result."""
    q_lens = [1, 2, 1, 1]
    ctx_lens = [0, 33, 100, 517]
    check(dict(q_lens=q_lens, ctx_lens=ctx_lens, hq=hq, hkv=hkv, d=d, block_size=16, dtype=dtype, seed=d + hq))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("d", [36, 72, 200])
@pytest.mark.parametrize("hq,hkv", [(3, 1), (9, 3)])
def test_decode_head_dims_off_the_vector_width_and_past_one_pass(isa, dtype, d, hq, hkv):
    """Decode head dims that are not a multiple of 8 (the AVX2 kernels stage
    even fp32 rows then) and that take more than one 64-column P.V pass:
    the reference result."""
    check(dict(q_lens=[1, 1, 2], ctx_lens=[0, 40, 300], hq=hq, hkv=hkv, d=d, block_size=16, dtype=dtype, seed=d + hq))


def test_whole_row_and_per_head_items_agree_bitwise(isa):
    """Six decode sequences: whole-row items at one thread (at least a
    sequence per thread), per-KV-head items at eight threads (fewer sequences
    than threads); the arithmetic per head is the same."""
    batch = make_batch(
        [1] * 6, [30, 150, 7, 513, 64, 1], hq=9, hkv=3, d=64, block_size=16, dtype=torch.bfloat16, seed=6
    )
    whole, per_head = run_at_threads(batch, 0.125, 1), run_at_threads(batch, 0.125, 8)
    assert torch.equal(whole, per_head)
    assert (whole.float() - reference(batch, 0.125)).abs().max().item() <= tolerance(torch.bfloat16)


def _same_on(isas, batch, scale):
    """`batch` attended on each of `isas`: every output against the
    reference, and the first ISA's against the others'."""
    want = reference(batch, scale)
    before = native.cpu_features()["isa"]
    try:
        got = {}
        for isa in isas:
            native._set_isa(isa)
            got[isa] = attend(batch, scale)
    finally:
        native._set_isa(before)
    for out in got.values():
        assert not out.isnan().any()
        assert (out.float() - want).abs().max().item() <= tolerance(torch.bfloat16)
    for isa in isas[1:]:
        assert (got[isas[0]].float() - got[isa].float()).abs().max().item() <= tolerance(torch.bfloat16)


def _prefill_items_on(isas, d, block_size, logit_scale):
    """bf16 prefill items (a prompt over several KV tiles, a chunk after cached
    context, row counts that are not a multiple of 16, decode rows in the same
    call, scores far from 0 for the online softmax across tiles with bf16
    probabilities) on each of `isas` (see _same_on)."""
    batch = make_batch(
        [300, 1, 37, 5],
        [0, 150, 260, 40],
        hq=6,
        hkv=2,
        d=d,
        block_size=block_size,
        dtype=torch.bfloat16,
        seed=d + block_size,
    )
    batch["query"] *= logit_scale
    _same_on(isas, batch, d**-0.5)


@pytest.mark.skipif("amx" not in SUPPORTED_ISAS, reason="needs an AMX-BF16 CPU")
@pytest.mark.parametrize("d", [32, 64, 128])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("logit_scale", [1.0, 30.0])
def test_amx_prefill_items_match_the_reference_and_the_avx512_kernels(d, block_size, logit_scale):
    """bf16 prefill items on AMX tiles."""
    _prefill_items_on(("amx", "avx512"), d, block_size, logit_scale)


@pytest.mark.skipif(
    "avx512" not in SUPPORTED_ISAS or "avx2" not in SUPPORTED_ISAS or not native.cpu_features()["avx512_bf16"],
    reason="needs an AVX512-BF16 CPU",
)
@pytest.mark.parametrize("d", [32, 64, 96, 128])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("logit_scale", [1.0, 30.0])
def test_avx512_bf16_prefill_items_match_the_reference_and_the_fp32_kernels(d, block_size, logit_scale):
    """bf16 prefill items on vdpbf16ps register blocks (attn_dp.h, the avx512
    kernels on an AVX512-BF16 CPU), against the avx2 kernels' fp32 FMA path."""
    _prefill_items_on(("avx512", "avx2"), d, block_size, logit_scale)


@pytest.mark.skipif(
    "avx512" not in SUPPORTED_ISAS or "avx2" not in SUPPORTED_ISAS or not native.cpu_features()["avx512_bf16"],
    reason="needs an AVX512-BF16 CPU",
)
@pytest.mark.parametrize("d", [40, 64])
@pytest.mark.parametrize("hq,hkv", [(9, 3), (4, 1), (2, 1), (10, 2), (8, 1)])
@pytest.mark.parametrize("scale", [0.125, 0.1])
@pytest.mark.parametrize("logit_scale", [1.0, 30.0])
def test_avx512_bf16_decode_scores_match_the_reference_and_the_fp32_kernels(d, hq, hkv, scale, logit_scale):
    """bf16 decode items whose scaled query rows are exact in bf16 (scale
    1/8) take K rows as vdpbf16ps operands on an AVX512-BF16 CPU; other
    scales keep the fp32 FMA path. Both against the reference and the avx2
    kernels, with scores far from 0 too, 2-16 query rows per KV head (GQA
    groups of 2-8, one- and two-token queries), head dim 40's partly masked
    second half and contexts across chunks and blocks (partly filled
    16-token groups)."""
    batch = make_batch(
        [1, 1, 2, 1, 1, 1],
        [0, 15, 33, 100, 517, 64],
        hq=hq,
        hkv=hkv,
        d=d,
        block_size=16,
        dtype=torch.bfloat16,
        seed=d + hq,
    )
    batch["query"] *= logit_scale
    _same_on(("avx512", "avx2"), batch, scale)
