"""avx512_linear and avx512_linear_silu_mul over GGUF Q4_1 / Q8_0 / Q4_K / Q6_K blocks (CPUs
with AVX512-BF16 and no AMX serve a GGUF's blocks through them): every output
must equal, bit for bit, the same kernel's over the bf16 tiles the blocks
expand to, and so the bf16 weights transformers loads from the file."""

from __future__ import annotations

import pytest
import torch

import native._fused as fused
from executor.cpu.gguf_weights import BlockWeight
from tests.native.test_amx_blocks import _bits, _blocks, linear_case

pytestmark = pytest.mark.skipif(not fused.avx512_linear_supported(), reason="needs an AVX512-BF16 CPU")


# Rows: decode sizes and prefill chunks, register blocks of every height
# (1..6 rows) and their remainders. n: feature blocks in pairs (1024) and an
# odd last one (1040), which the pair-major packing stores alone.
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q4_k", "q6_k"])
@pytest.mark.parametrize("n", [1024, 1040])
@pytest.mark.parametrize("m", [1, 5, 7, 8, 9, 32, 100])
def test_linear_equals_the_bf16_kernel(kind, m, n):
    bw, packed, tiles, x, bias = linear_case(kind, m, n, seed=m + n, k=768 if kind.endswith("_k") else 576)
    for b in (None, bias):
        got = fused.avx512_linear(x, packed, n, b)
        assert torch.equal(_bits(got), _bits(fused.avx512_linear(x, tiles, n, b)))
    # and the product itself, against fp32 over the dequantised weights
    want = x.float() @ bw.dequantize().T + bias.float()
    assert torch.allclose(got.float(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


@pytest.mark.parametrize("kind", ["q4_1", "q4_k", "q6_k"])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("m", [1, 20, 64])
def test_silu_mul_over_gate_up_blocks_equals_the_bf16_kernel(m, activation, kind):
    inter, k = 1536, 768 if kind.endswith("_k") else 576
    gate, up = _blocks(kind, inter, k, seed=1), _blocks(kind, inter, k, seed=2)
    w = torch.cat([gate.dequantize(), up.dequantize()]).bfloat16()
    order = torch.arange(2 * inter).view(2, -1, 16).transpose(0, 1).reshape(-1)  # amx_pack_gate_up's rows
    packed = BlockWeight.cat([gate, up]).rows(order).pack()
    tiles = fused.amx_pack_gate_up(w)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    assert torch.equal(
        _bits(fused.avx512_linear_silu_mul(x, packed, inter, activation)),
        _bits(fused.avx512_linear_silu_mul(x, tiles, inter, activation)),
    )


def test_block_arguments_are_checked():
    packed = _blocks("q8_0", 32, 64, seed=0).pack()
    x = torch.randn(3, 64).bfloat16()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        fused.avx512_linear(torch.randn(3, 40).bfloat16(), packed, 32, None)
    with pytest.raises(RuntimeError, match=r"\[N/16, K/32"):
        fused.avx512_linear(x, packed, 48, None)  # 48 features: 3 blocks, packed has 2
    with pytest.raises(RuntimeError, match="uint8"):
        fused.avx512_linear(x, packed[..., :300].contiguous(), 32, None)
    with pytest.raises(RuntimeError, match="bf16 x"):
        fused.avx512_linear(x.float(), packed, 32, None)
    q4_k = _blocks("q4_k", 32, 512, seed=0).pack()  # two super-blocks of K
    with pytest.raises(RuntimeError, match="multiple of 256"):
        fused.avx512_linear(torch.randn(3, 256).bfloat16(), q4_k, 32, None)
    with pytest.raises(RuntimeError, match="GGUF blocks"):
        fused.avx512_linear(x, packed.view(torch.int8), 32, None)
