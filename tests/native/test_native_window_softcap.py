"""Sliding-window attention and attention-logit soft-capping in
native.paged_attention, against the torch reference, on every CPU ISA."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import native
from tests.native.helpers import SUPPORTED_ISAS, attend, case_batch, make_batch, reference, tolerance
from tests.native.test_native_attention import cases


@st.composite
def windowed(draw):
    case = draw(cases())
    bs = case["block_size"]
    # Windows shorter than one token's context, than a block, and longer
    # than a KV tile; caps small enough to bend the scores.
    case["sliding_window"] = draw(st.sampled_from([0, 1, 3, 16, bs + 5, 3 * bs]))
    case["softcap"] = draw(st.sampled_from([0.0, 0.7, 5.0]))
    case["logit_scale"] = draw(st.sampled_from([1.0, 8.0]))
    return case


def check_windowed(case, device="cpu"):
    """One windowed() case on `device` against the reference."""
    batch = case_batch(case, device=device)
    batch["query"] *= case["logit_scale"]
    kw = {"sliding_window": case["sliding_window"], "softcap": case["softcap"]}
    scale = case["d"] ** -0.5
    got = attend(batch, scale, **kw).cpu()
    want = reference(batch, scale, **kw)
    assert not got.isnan().any()
    err = (got.float() - want).abs().max().item() if got.numel() else 0.0
    # fp32 rounding in exp() grows with the scores' magnitude.
    tol = tolerance(case["dtype"]) * (case["logit_scale"] if case["dtype"] == torch.float32 else 1.0)
    assert err <= tol, (err, case)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=windowed())
def test_window_and_softcap_match_the_reference(isa, case):
    check_windowed(case)


@pytest.mark.parametrize("window", [0, 7, 40, 200])
@pytest.mark.parametrize("softcap", [0.0, 1.5])
def test_bf16_prefill_and_decode_items_on_every_isa(window, softcap):
    # Prompts over several KV tiles (the AMX / vdpbf16ps prefill paths on
    # CPUs that have them), a chunk after cached context, decode rows with
    # long contexts: each ISA against the reference and against the others.
    batch = make_batch(
        [300, 1, 37, 1], [0, 450, 260, 40], hq=6, hkv=2, d=64, block_size=16, dtype=torch.bfloat16, seed=window
    )
    batch["query"] *= 4.0
    kw = {"sliding_window": window, "softcap": softcap}
    want = reference(batch, 0.125, **kw)
    before = native.cpu_features()["isa"]
    try:
        got = {}
        for isa in SUPPORTED_ISAS:
            native._set_isa(isa)
            got[isa] = attend(batch, 0.125, **kw)
    finally:
        native._set_isa(before)
    for isa, out in got.items():
        assert not out.isnan().any(), isa
        assert (out.float() - want).abs().max().item() <= tolerance(torch.bfloat16), isa


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,q_len", [(20, 4, 1), (16, 4, 2)])
def test_windowed_and_capped_whole_row_items_of_up_to_32_rows(isa, dtype, hq, hkv, q_len):
    # Ten decode sequences, enough for items of every KV head of a sequence
    # at once with 20 or 32 query rows; contexts shorter than, across and
    # several times the window.
    n = 10
    ctx = [0, 3, 39, 40, 41, 90, 130, 257, 400, 17]
    case = dict(q_lens=[q_len] * n, ctx_lens=ctx, hq=hq, hkv=hkv, d=64, block_size=16, dtype=dtype, seed=hq + q_len)
    check_windowed(dict(case, sliding_window=40, softcap=1.5, logit_scale=4.0))


def test_a_window_of_one_is_each_tokens_own_value():
    batch = make_batch([5, 1], [0, 9], hq=2, hkv=1, d=64, block_size=8, seed=3)
    got = attend(batch, 0.125, sliding_window=1)
    v = batch["value_cache"].view(-1, 1, 64)
    table, slots = batch["block_tables"], []
    for b, (q0, q1) in enumerate([(0, 5), (9, 10)]):
        for pos in range(q0, q1):
            slots.append(int(table[b, pos // 8]) * 8 + pos % 8)
    assert torch.allclose(got, v[slots].expand(-1, 2, -1), atol=1e-6)


@pytest.mark.parametrize(("kw", "match"), [({"sliding_window": -1}, "sliding_window"), ({"softcap": -2.0}, "softcap")])
def test_bad_window_or_cap_is_refused(kw, match):
    batch = make_batch([1], [4], hq=2, hkv=1, d=64, block_size=8)
    with pytest.raises(ValueError, match=match):
        attend(batch, 0.125, **kw)
