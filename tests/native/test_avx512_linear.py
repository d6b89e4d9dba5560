"""native._fused.avx512_linear / avx512_linear_silu_mul: the bf16 linear
layer with AVX512-BF16 dot products over amx_pack_weight's tile layout (CPUs
without AMX), against an fp32 reference, oneDNN and the two-step MLP, and the
PackedLinear / FusedMLP dispatch to it."""

from __future__ import annotations

import pytest
import torch

import native._fused as fused
from executor.cpu import packed_linear
from executor.cpu.fused_modules import FusedMLP
from executor.cpu.packed_linear import PackedLinear
from tests.native.helpers import record_rows
from tests.small_configs import small

pytestmark = pytest.mark.skipif(not fused.avx512_linear_supported(), reason="needs an AVX512-BF16 CPU")


def _reference(x, w, b=None):
    y = x.float() @ w.float().T
    return y if b is None else y + b.float()


def _run(x, w, bias=None):
    return fused.avx512_linear(x, fused.amx_pack_weight(w), w.shape[0], bias)


# Rows cover every register-block height (1-6) and several blocks of even
# size (7: 4 + 3, 8: 4 + 4, 13: 5 + 4 + 4, 64: nine of 6 and two of 5);
# features cover 1-4 blocks a group, groups plus a remainder, and ragged last
# blocks; K odd, below one tile and not a multiple of 32.
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 13, 64])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (17, 64), (50, 40), (1, 33), (33, 1), (112, 31), (80, 577)])
def test_matches_fp32_reference_up_to_bf16_rounding(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    for bias in (None, b):
        ref = _reference(x, w, bias)
        got = _run(x, w, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        # fp32 sums in another order, one bf16 rounding of the output: within
        # one bf16 ulp (2^-8 relative) of the exact result, plus summation noise.
        torch.testing.assert_close(got.float(), ref, rtol=2**-7, atol=1e-3 * k**0.5)


def test_prefill_sized_inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(515, 576, generator=g).bfloat16()
    w = torch.randn(200, 576, generator=g).bfloat16()
    torch.testing.assert_close(_run(x, w).float(), _reference(x, w), rtol=2**-7, atol=0.03)


def test_agrees_with_onednn_on_model_shapes():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 576, generator=g).bfloat16()
    w = torch.randn(49152, 576, generator=g).bfloat16() * 0.05
    got = _run(x, w)
    want = torch.nn.functional.linear(x, w)
    # Same products, different summation order: nearly every output equal.
    assert (got == want).float().mean().item() > 0.9
    assert torch.equal(got.float().argmax(-1), want.float().argmax(-1))


def test_same_bits_with_one_thread_or_two():
    # Each output is one thread's, summed in K order whatever the split.
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 576, generator=g).bfloat16()
    w = torch.randn(336, 576, generator=g).bfloat16()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _run(x, w)
        torch.set_num_threads(2)
        two = _run(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_zero_rows_and_bad_arguments():
    w = torch.randn(8, 32).bfloat16()
    p = fused.amx_pack_weight(w)
    assert fused.avx512_linear(torch.empty(0, 32, dtype=torch.bfloat16), p, 8).shape == (0, 8)
    with pytest.raises(RuntimeError, match="bf16"):
        fused.avx512_linear(torch.randn(1, 32), p, 8)
    with pytest.raises(RuntimeError, match="amx_pack_weight"):
        fused.avx512_linear(torch.randn(1, 64).bfloat16(), p, 8)  # K of another weight
    with pytest.raises(RuntimeError, match="amx_pack_weight"):
        fused.avx512_linear(torch.randn(1, 32).bfloat16(), p, 17)  # more features than packed
    with pytest.raises(RuntimeError, match="contiguous"):
        fused.avx512_linear(torch.randn(32, 2).bfloat16().T, p, 8)
    with pytest.raises(RuntimeError, match="bias"):
        fused.avx512_linear(torch.randn(1, 32).bfloat16(), p, 8, torch.randn(7).bfloat16())
    with pytest.raises(RuntimeError, match=r"\[N/16, K/32"):  # blocks of another K (test_avx512_blocks.py)
        fused.avx512_linear(torch.randn(1, 32).bfloat16(), torch.zeros(1, 2, 320, dtype=torch.uint8), 16)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        fused.avx512_linear_silu_mul(torch.randn(1, 32).bfloat16(), p, 4)


@pytest.mark.parametrize("m", [1, 5, 6, 17, 70])
@pytest.mark.parametrize("inter,k", [(1536, 576), (16, 40), (48, 1535)])
def test_silu_mul_epilogue_is_bit_exact_with_projection_then_silu_and_mul(m, inter, k):
    g = torch.Generator().manual_seed(m + inter + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(2 * inter, k, generator=g) * 0.1).bfloat16()
    got = fused.avx512_linear_silu_mul(x, fused.amx_pack_gate_up(w), inter)
    want = fused.silu_and_mul(_run(x, w))
    assert got.shape == (m, inter)
    assert torch.equal(got, want)


def _no_amx(monkeypatch):
    # As on an AVX512-BF16 CPU without AMX (this one, or an AMX CPU told not to use it).
    monkeypatch.setattr(packed_linear, "amx_ops", lambda: None)


def test_packed_linear_runs_it_for_every_row_count(monkeypatch):
    _no_amx(monkeypatch)
    lin = torch.nn.Linear(64, 48, bias=True, dtype=torch.bfloat16)
    packed = PackedLinear(lin)
    assert packed.kernel == "avx512" and packed.kernel_for(600) == "avx512_linear"
    calls = record_rows(monkeypatch, packed, "_avx512")
    with torch.inference_mode():
        for rows in (1, 5, 64, 600):
            x = torch.randn(rows, 64).bfloat16()
            torch.testing.assert_close(packed(x).float(), lin(x).float(), rtol=2**-7, atol=2e-2)
        x = torch.randn(64, 6).bfloat16().T  # a strided view is made contiguous, not rejected
        torch.testing.assert_close(packed(x).float(), lin(x).float(), rtol=2**-7, atol=2e-2)
        x = torch.randn(2, 3, 64).bfloat16()  # [B, T, H] as transformers' own forward passes it
        torch.testing.assert_close(packed(x).float(), lin(x).float(), rtol=2**-7, atol=2e-2)
    assert calls == [1, 5, 64, 600, 6, 6]


def test_fused_mlp_runs_the_silu_mul_epilogue(monkeypatch):
    _no_amx(monkeypatch)
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, hidden_act="silu")
    mlp = LlamaMLP(cfg).to(torch.bfloat16)
    fast = FusedMLP(mlp)
    assert fast.kernel == "avx512_linear_silu_mul"
    with torch.inference_mode():
        for rows in (1, 7, 130):
            x = torch.randn(rows, 64).bfloat16()
            torch.testing.assert_close(fast(x).float(), mlp(x).float(), rtol=2**-6, atol=2e-2)


def test_a_weight_only_its_layer_holds_lives_on_in_the_tiles_alone(monkeypatch):
    """avx512_linear takes every row count, so prepack_linears keeps no plain
    bf16 copy beside the tiles, except a tied LM head's (the embedding's)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    _no_amx(monkeypatch)
    torch.manual_seed(0)
    cfg = LlamaConfig(**small(num_hidden_layers=1, tie_word_embeddings=True))
    model = LlamaForCausalLM(cfg).bfloat16()
    o_before = model.model.layers[0].self_attn.o_proj.weight.detach().clone()
    x = torch.randn(5, o_before.shape[1]).bfloat16()
    want = torch.nn.functional.linear(x, o_before)
    assert packed_linear.prepack_linears(model) == 8
    o = model.model.layers[0].self_attn.o_proj
    assert o.weight.device.type == "meta" and "weight" not in dict(o.named_parameters())
    assert torch.equal(o.plain_weight(), o_before)  # unpacked from the tiles, exactly
    torch.testing.assert_close(o(x).float(), want.float(), rtol=2**-7, atol=2e-2)
    head = model.lm_head
    assert head.weight.device.type == "cpu" and head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # An odd shape unpacks too (the tiles' padding is cut off).
    lin = torch.nn.Linear(40, 20, bias=False).bfloat16()
    odd = PackedLinear(lin, keep_plain=False)
    assert odd.weight.device.type == "meta" and torch.equal(odd.plain_weight(), lin.weight.detach())
