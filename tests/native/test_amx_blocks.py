"""The AMX kernels over GGUF Q4_1 / Q8_0 / Q4_K / Q6_K blocks (executor/cpu/gguf_weights.py
packs them): the expanded tiles and every output must equal, bit for bit,
those of the bf16 weights the blocks dequantise to. The expansion itself is
AVX512-BF16 code (gguf_tiles.h), checked on any such CPU; the AVX512-BF16
kernels over the same blocks: test_avx512_blocks.py."""

from __future__ import annotations

import pytest
import torch

import native._fused as fused
from executor.cpu.gguf_weights import BlockWeight

amx = pytest.mark.skipif(not fused.amx_linear_supported(), reason="needs an AMX-BF16 CPU")


def _blocks(kind: str, n: int, k: int, seed: int) -> BlockWeight:
    g = torch.Generator().manual_seed(seed)
    # Scales over many binades (and minimums of both signs) so that d * q + m
    # lands on bf16 rounding ties and carries somewhere.
    if kind == "q4_k":  # d, dmin per 256 weights; 6-bit sc, mn per 32
        sb = k // 256
        d, dmin = (torch.rand(2, n, sb, generator=g) * 2.0 ** torch.randint(-14, 0, (2, n, sb), generator=g)).half()
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        sc, mn = torch.randint(0, 64, (2, n, k // 32), generator=g, dtype=torch.uint8)
        return BlockWeight(kind, q, d, dmin, sc, mn)
    if kind == "q6_k":  # d per 256 weights; int8 scales per 16, q in -32..31
        d = (torch.rand(n, k // 256, generator=g) * 2.0 ** torch.randint(-14, 0, (n, k // 256), generator=g)).half()
        q = torch.randint(-32, 32, (n, k), generator=g).to(torch.int8)
        sc = torch.randint(-128, 128, (n, k // 16), generator=g).to(torch.int8)
        return BlockWeight(kind, q, d, None, sc)
    d = (torch.rand(n, k // 32, generator=g) * 2.0 ** torch.randint(-14, 2, (n, k // 32), generator=g)).half()
    if kind == "q4_1":
        q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        m = (torch.randn(n, k // 32, generator=g) * 2.0 ** torch.randint(-12, 1, (n, k // 32), generator=g)).half()
        return BlockWeight(kind, q, d, m)
    q = torch.randint(-128, 128, (n, k), generator=g).to(torch.int8)
    return BlockWeight(kind, q, d, None)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def linear_case(kind: str, m: int, n: int, seed: int, k: int = 576):
    """Blocks of an [n, k] weight, packed and as the bf16 tiles they expand
    to, with an x of m rows and a bias: (bw, packed, tiles, x, bias)."""
    bw = _blocks(kind, n, k, seed=seed)
    g = torch.Generator().manual_seed(7 * m)
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    return bw, bw.pack(), fused.amx_pack_weight(bw.dequantize().bfloat16()), x, bias


_SHAPES = [(16, 32), (48, 96), (960, 576), (576, 1536)]
_Q4K_SHAPES = [(16, 256), (48, 512), (960, 768), (576, 1536)]  # K in whole 256-weight super-blocks


@pytest.mark.skipif(not fused.avx512_linear_supported(), reason="needs an AVX512-BF16 CPU")
@pytest.mark.parametrize(
    "kind,n,k",
    [(kind, *s) for kind in ("q4_1", "q8_0") for s in _SHAPES]
    + [(kind, *s) for kind in ("q4_k", "q6_k") for s in _Q4K_SHAPES],
)
def test_expanded_tiles_equal_the_packed_bf16_weight(kind, n, k):
    bw = _blocks(kind, n, k, seed=n + k)
    w = bw.dequantize().bfloat16()  # fp32 d * q (+ m), then RNE: what transformers + .bfloat16() give
    packed = bw.pack()
    tiles = {"q4_1": (k // 32, 320), "q8_0": (k // 32, 544), "q4_k": (k // 256, 2368), "q6_k": (k // 256, 3360)}[kind]
    assert packed.dtype == torch.uint8 and packed.shape == (n // 16, *tiles)
    assert torch.equal(_bits(fused.amx_dequant(packed)), _bits(fused.amx_pack_weight(w)))


@pytest.mark.parametrize("kind", ["Q4_K", "Q6_K"])
def test_k_quant_blocks_read_from_a_file_dequantise_as_gguf_py(kind):
    """The K-quant super-blocks of a tensor (bytes as llama.cpp writes them)
    unpack to q and scales that give gguf-py's own fp32 weights, operation
    for operation: Q4_K's d, dmin and 6-bit sc / mn, Q6_K's 4 + 2-bit q and
    int8 scales."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize

    from executor.cpu.gguf_weights import _q4_k, _q6_k
    from tests.integration import gguf_writer

    w = np.random.default_rng(3).standard_normal((48, 768)).astype(np.float32) * 0.05
    raw = gguf_writer.quantize_q4_k(w) if kind == "Q4_K" else gguf_writer.quantize_q6_k(w)
    want = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType[kind]))
    blocks = torch.from_numpy(raw).view(48, 3, -1)
    bw = _q4_k(blocks) if kind == "Q4_K" else _q6_k(blocks)
    assert torch.equal(bw.dequantize(), want)
    if kind == "Q4_K":
        assert (bw.sc > 31).any() and (bw.mn > 31).any()  # the scales' high bits are read too
    else:
        assert (bw.q < -16).any() and (bw.q > 15).any()  # q's high bits are read too
    assert (want - torch.from_numpy(w)).abs().max() < 0.02  # and the quantiser fits the weights


# Rows: one pass (the tiles expanded just before use: 1..32) and several
# passes over a run of expanded tiles (33+), with and without bias.
# A K-quant tile holds a 256-wide super-block (8 of the 32-wide k-blocks the
# passes step through): K = 768, three super-blocks.
@amx
@pytest.mark.parametrize("kind", ["q4_1", "q8_0", "q4_k", "q6_k"])
# n: column blocks in pairs (64), and an odd last block (65), which the
# pair-major packing stores alone.
@pytest.mark.parametrize("n", [1024, 1040])
@pytest.mark.parametrize("m", [1, 5, 16, 32, 33, 64, 100])
def test_linear_and_argmax_equal_the_bf16_kernel(kind, m, n):
    k = 768 if kind in ("q4_k", "q6_k") else 576
    _, packed, tiles, x, bias = linear_case(kind, m, n, seed=m, k=k)
    for b in (None, bias):
        assert torch.equal(_bits(fused.amx_linear(x, packed, n, b)), _bits(fused.amx_linear(x, tiles, n, b)))
        assert torch.equal(fused.amx_linear_argmax(x, packed, n, b), fused.amx_linear_argmax(x, tiles, n, b))


@amx
@pytest.mark.parametrize("kind", ["q4_1", "q4_k", "q6_k"])
@pytest.mark.parametrize("m", [1, 20, 64])
def test_silu_mul_over_gate_up_blocks_equals_the_bf16_kernel(kind, m):
    inter, k = 1536, 768 if kind in ("q4_k", "q6_k") else 576
    gate, up = _blocks(kind, inter, k, seed=1), _blocks(kind, inter, k, seed=2)
    w = torch.cat([gate.dequantize(), up.dequantize()]).bfloat16()
    # amx_pack_gate_up's row order: gate block j, then up block j.
    order = torch.arange(2 * inter).view(2, -1, 16).transpose(0, 1).reshape(-1)
    packed = BlockWeight.cat([gate, up]).rows(order).pack()
    tiles = fused.amx_pack_gate_up(w)
    assert torch.equal(_bits(fused.amx_dequant(packed)), _bits(tiles))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    assert torch.equal(
        _bits(fused.amx_linear_silu_mul(x, packed, inter)), _bits(fused.amx_linear_silu_mul(x, tiles, inter))
    )


@amx
def test_block_arguments_are_checked():
    bw = _blocks("q4_1", 32, 64, seed=0)
    packed = bw.pack()
    x = torch.randn(3, 64).bfloat16()
    with pytest.raises(RuntimeError, match="K a multiple of 32"):
        fused.amx_linear(torch.randn(3, 40).bfloat16(), packed, 32, None)
    with pytest.raises(RuntimeError, match=r"\[N/16, K/32"):
        fused.amx_linear(x, packed, 48, None)  # 48 features: 3 column blocks, packed has 2
    with pytest.raises(RuntimeError, match="uint8"):
        fused.amx_linear(x, packed[..., :300].contiguous(), 32, None)
    with pytest.raises(RuntimeError, match="uint8"):
        fused.amx_dequant(packed.view(torch.int8))
    with pytest.raises(ValueError, match="whole tiles"):
        _blocks("q4_1", 20, 64, seed=0).pack()
    with pytest.raises(ValueError, match="concatenate"):
        BlockWeight.cat([bw, _blocks("q8_0", 32, 64, seed=0)])
