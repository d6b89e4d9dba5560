"""The Q4_1 kernel with the weights as AMX's A operand (amx_q4_rows_linear
over BlockWeight.pack_rows): its weights and every output must equal, bit
for bit, those of amx_linear over the same blocks and of the bf16 weights
they dequantise to; it refuses what it cannot run; GGUF Q4_1 layers run it
for small batches."""

from __future__ import annotations

import pytest
import structlog
import torch

import native._fused as fused
from executor.cpu import gguf_weights
from executor.cpu.fused_modules import FusedMLP
from executor.cpu.gguf_weights import BlockWeight
from executor.cpu.packed_linear import Q4_ROWS_MAX_ROWS, PackedLinear
from tests.native.test_amx_blocks import _bits, _blocks

pytestmark = pytest.mark.skipif(not fused.amx_linear_supported(), reason="needs an AMX-BF16 CPU")


@pytest.mark.parametrize("n,k", [(32, 32), (96, 96), (960, 576), (576, 1536)])
def test_rows_layout_expands_to_the_dequantised_weight(n, k):
    bw = _blocks("q4_1", n, k, seed=n * k)
    packed = bw.pack_rows()
    assert packed.dtype == torch.uint8 and packed.shape == (n // 32, k // 32, 2, 320)
    w = fused.amx_q4_rows_dequant(packed)
    assert w.shape == (n, k)
    assert torch.equal(_bits(w), _bits(bw.dequantize().bfloat16()))


# Rows: a few tokens (gathered epilogue, scalar xᵀ), one full token tile,
# the second tile partly and wholly filled (one pass, tiles expanded just
# before use), then several 32-token passes over a run of expanded tiles,
# the last one partial.
@pytest.mark.parametrize("m", [1, 3, 4, 5, 16, 17, 31, 32, 33, 49, 64, 100])
@pytest.mark.parametrize("n,k", [(64, 576), (960, 576), (576, 1536)])
def test_linear_and_silu_mul_equal_amx_linear_over_the_same_blocks(m, n, k):
    bw = _blocks("q4_1", n, k, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    rows, tiles = bw.pack_rows(), bw.pack()
    y = fused.amx_q4_rows_linear(x, rows, n)
    assert y.shape == (m, n)
    assert torch.equal(_bits(y), _bits(fused.amx_linear(x, tiles, n, None)))
    # Read as gate|up interleaved in blocks of 16 (amx_linear_silu_mul's order).
    s = fused.amx_q4_rows_linear(x, rows, n, n // 2)
    assert s.shape == (m, n // 2)
    assert torch.equal(_bits(s), _bits(fused.amx_linear_silu_mul(x, tiles, n // 2)))


@pytest.mark.parametrize("m", [7, 80])
def test_results_do_not_depend_on_the_thread_count(m):
    bw = _blocks("q4_1", 3072, 576, seed=3)
    x = torch.randn(m, 576, generator=torch.Generator().manual_seed(3)).bfloat16()
    rows = bw.pack_rows()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fused.amx_q4_rows_linear(x, rows, 3072, 1536)
        torch.set_num_threads(2)
        two = fused.amx_q4_rows_linear(x, rows, 3072, 1536)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(_bits(one), _bits(two))


def test_refuses_what_it_cannot_run():
    bw = _blocks("q4_1", 64, 64, seed=1)
    rows = bw.pack_rows()
    assert fused.amx_q4_rows_linear(torch.zeros(0, 64).bfloat16(), rows, 64).shape == (0, 64)
    with pytest.raises(RuntimeError, match="does not hold"):
        fused.amx_q4_rows_linear(torch.zeros(1, 64).bfloat16(), rows, 96)
    with pytest.raises(RuntimeError, match="does not hold"):
        fused.amx_q4_rows_linear(torch.zeros(1, 96).bfloat16(), rows, 64)
    with pytest.raises(RuntimeError, match="silu_inter"):
        fused.amx_q4_rows_linear(torch.zeros(1, 64).bfloat16(), rows, 64, 16)
    with pytest.raises(RuntimeError, match="pack_rows"):
        fused.amx_q4_rows_linear(torch.zeros(1, 64).bfloat16(), bw.pack(), 64)
    with pytest.raises(RuntimeError, match="bf16"):
        fused.amx_q4_rows_linear(torch.zeros(1, 64), rows, 64)


def test_pack_rows_applies_to_q4_1_in_pairs_of_column_blocks_only():
    assert _blocks("q8_0", 64, 64, seed=2).pack_rows() is None
    assert _blocks("q4_1", 48, 64, seed=2).pack_rows() is None  # three column blocks
    assert _blocks("q4_1", 64, 64, seed=2).pack_rows() is not None


def _linear_with_blocks(bw: BlockWeight, bias: bool = False, keep_tiles: bool = True) -> torch.nn.Linear:
    """A Linear over the blocks' weights; `keep_tiles` as for a small model
    (bf16 copies beside the blocks, gguf_weights.keep_tiles)."""
    n, k = bw.shape
    lin = torch.nn.Linear(k, n, bias=bias, dtype=torch.bfloat16)
    with torch.no_grad():
        lin.weight.copy_(bw.dequantize())
    bw.keep_tiles = keep_tiles
    lin.cbserve_blocks = bw
    return lin


def test_packed_linear_runs_it_up_to_its_row_limit_with_the_same_outputs():
    bw = _blocks("q4_1", 960, 576, seed=4)
    lin = _linear_with_blocks(bw)
    packed = PackedLinear(lin)
    assert packed.packed_rows.shape == (30, 18, 2, 320) and packed.kernel == "amx-q4_1"
    assert packed.kernel_for(1) == packed.kernel_for(Q4_ROWS_MAX_ROWS) == "amx_q4_rows_linear"
    assert packed.kernel_for(Q4_ROWS_MAX_ROWS + 1) == "amx_linear"
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        for m in (1, 9, 32, 33):
            x = torch.randn(m, 576, generator=g).bfloat16()
            got = packed(x)
            assert torch.equal(_bits(got), _bits(fused.amx_linear(x, packed.packed, 960, None)))
            # F.linear in fp32 differs from the bf16 kernels only by summation order and the final rounding.
            want = torch.nn.functional.linear(x.float(), lin.weight.float())
            torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2)
    # A bias is not the kernel's: such a layer keeps amx_linear.
    assert PackedLinear(_linear_with_blocks(bw, bias=True)).packed_rows is None
    with pytest.MonkeyPatch.context() as mp:  # the operator's switch
        mp.setenv(gguf_weights.ROWS_SWITCH, "0")
        assert PackedLinear(_linear_with_blocks(bw)).packed_rows is None
    # Blocks held alone (a large model): no second copy, amx_linear at every row count.
    alone = PackedLinear(_linear_with_blocks(bw, keep_tiles=False), keep_plain=False)
    assert alone.packed_rows is None and alone.weight.device.type == "meta"
    assert alone.kernel_for(1) == alone.kernel_for(1000) == "amx_linear"
    x = torch.randn(400, 576, generator=g).bfloat16()
    with torch.inference_mode():
        assert torch.equal(_bits(alone(x)), _bits(fused.amx_linear(x, packed.packed, 960, None)))
        torch.testing.assert_close(alone.plain_weight(), lin.weight.detach(), rtol=0, atol=0)


def test_fused_mlp_runs_it_for_small_batches_with_the_same_outputs():
    k, inter = 576, 1536
    gate, up = _blocks("q4_1", inter, k, seed=5), _blocks("q4_1", inter, k, seed=6)
    down = torch.nn.Linear(inter, k, bias=False, dtype=torch.bfloat16)
    mlp_mod = torch.nn.Module()
    mlp_mod.gate_proj, mlp_mod.up_proj, mlp_mod.down_proj = _linear_with_blocks(gate), _linear_with_blocks(up), down
    mlp = FusedMLP(mlp_mod)
    assert mlp.packed_rows.shape == (96, 18, 2, 320) and mlp.kernel == "amx_linear_silu_mul-q4_1"
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        for m in (1, 20, 32):
            x = torch.randn(m, k, generator=g).bfloat16()
            assert torch.equal(_bits(mlp.act(x)), _bits(fused.amx_linear_silu_mul(x, mlp.packed_gate_up, inter)))


def test_blocks_that_do_not_expand_to_the_weight_are_not_used():
    bw = _blocks("q4_1", 64, 64, seed=8)
    other = bw.dequantize().bfloat16()
    other[0, 0] = other[0, 0] + 1
    with structlog.testing.capture_logs() as logs:
        assert gguf_weights.packed_rows(bw, other, "test") is None
    assert any("small-batch" in e["event"] for e in logs)
    assert torch.equal(
        _bits(fused.amx_q4_rows_dequant(gguf_weights.packed_rows(bw, bw.dequantize().bfloat16(), "test"))),
        _bits(bw.dequantize().bfloat16()),
    )
