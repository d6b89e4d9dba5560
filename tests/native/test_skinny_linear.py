"""native._fused.skinny_linear: the decode-sized bf16 linear layer, against an
fp32 reference and oneDNN, and the PackedLinear dispatch to it."""

from __future__ import annotations

import pytest
import torch

import native._fused as fused
from executor import packed_linear
from executor.packed_linear import SKINNY_MAX_ROWS, PackedLinear
from tests.native.helpers import record_rows

pytestmark = pytest.mark.skipif(not fused.skinny_linear_supported(), reason="needs an AVX512-BF16 CPU")


def _reference(x, w, b=None):
    y = x.float() @ w.float().T
    return y if b is None else y + b.float()


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (17, 64), (50, 40), (1, 33), (33, 1)])
def test_matches_fp32_reference_up_to_bf16_rounding(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    for bias in (None, b):
        ref = _reference(x, w, bias)
        got = fused.skinny_linear(x, w, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        # fp32 sums in another order, one bf16 rounding of the output: within
        # one bf16 ulp (2^-8 relative) of the exact result, plus summation noise.
        torch.testing.assert_close(got.float(), ref, rtol=2 ** -7, atol=1e-3 * k ** 0.5)


def test_agrees_with_onednn_on_model_shapes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 576, generator=g).bfloat16()
    w = torch.randn(49152, 576, generator=g).bfloat16() * 0.05
    got = fused.skinny_linear(x, w)
    want = torch.nn.functional.linear(x, w)
    # Same products, different summation order: nearly every output equal.
    assert (got == want).float().mean().item() > 0.9
    assert torch.equal(got.float().argmax(-1), want.float().argmax(-1))


def test_zero_rows_and_bad_arguments():
    w = torch.randn(8, 32).bfloat16()
    assert fused.skinny_linear(torch.empty(0, 32, dtype=torch.bfloat16), w).shape == (0, 8)
    with pytest.raises(RuntimeError, match="bf16"):
        fused.skinny_linear(torch.randn(1, 32), w.float())
    with pytest.raises(RuntimeError, match=r"\[M, K\]"):
        fused.skinny_linear(torch.randn(1, 31).bfloat16(), w)
    with pytest.raises(RuntimeError, match="contiguous"):
        fused.skinny_linear(torch.randn(32, 2).bfloat16().T, w)
    with pytest.raises(RuntimeError, match="bias"):
        fused.skinny_linear(torch.randn(1, 32).bfloat16(), w, torch.randn(7).bfloat16())


def test_packed_linear_uses_it_for_few_rows_only(monkeypatch):
    # As on an AVX512-BF16 CPU without AMX (where amx_linear would take these rows).
    monkeypatch.setattr(packed_linear, "amx_ops", lambda: None)
    lin = torch.nn.Linear(64, 48, bias=True, dtype=torch.bfloat16)
    packed = PackedLinear(lin)
    assert packed.kernel == "skinny"
    calls = record_rows(monkeypatch, packed, "_skinny")
    with torch.inference_mode():
        for rows in (1, SKINNY_MAX_ROWS, SKINNY_MAX_ROWS + 1, 64):
            x = torch.randn(rows, 64).bfloat16()
            torch.testing.assert_close(packed(x).float(), lin(x).float(), rtol=2 ** -7, atol=2e-2)
    assert calls == [1, SKINNY_MAX_ROWS]
