"""native._fused.amx_linear: the bf16 linear layer on AMX tiles, against an
fp32 reference and oneDNN, its weight layout, and PackedLinear's dispatch."""

from __future__ import annotations

import pytest
import torch

import native._fused as fused
from executor.cpu import packed_linear
from executor.cpu.packed_linear import AMX_MAX_ROWS, PackedLinear
from tests.native.helpers import record_rows

pytestmark = pytest.mark.skipif(not fused.amx_linear_supported(), reason="needs an AMX-BF16 CPU")


def _reference(x, w, b=None):
    y = x.float() @ w.float().T
    return y if b is None else y + b.float()


# Rows: one tile, a tile pair, several passes over K with a partial last tile;
# shapes: SmolLM2's, and odd ones that pad N to 16 and K to 32.
@pytest.mark.parametrize("m", [1, 5, 16, 17, 33, 70])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (17, 64), (50, 40), (1, 33), (33, 1), (16, 32)])
def test_matches_fp32_reference_up_to_bf16_rounding(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    packed = fused.amx_pack_weight(w)
    for bias in (None, b):
        got = fused.amx_linear(x, packed, n, bias)
        assert got.dtype == torch.bfloat16 and got.shape == (m, n)
        torch.testing.assert_close(got.float(), _reference(x, w, bias), rtol=2**-7, atol=1e-3 * k**0.5)


def test_packed_layout_is_vnni_tiles_zero_padded():
    w = torch.arange(20 * 40, dtype=torch.float32).reshape(20, 40).bfloat16()
    p = fused.amx_pack_weight(w)
    assert p.shape == (2, 2, 16, 16, 2)  # ceil(20/16) column blocks x ceil(40/32) K blocks
    # Tile (nb, kb), row kp, column n, pair j holds w[16 nb + n, 32 kb + 2 kp + j].
    assert p[1, 0, 3, 2, 1] == w[18, 7]
    assert p[0, 1, 2, 5, 0] == w[5, 36]
    assert p[1, 1, :, 4:].abs().sum() == 0  # features 20..31 padded
    assert p[0, 1, 4:].abs().sum() == 0  # K 40..63 padded


def test_agrees_with_onednn_on_the_lm_head():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(20, 576, generator=g).bfloat16()
    w = torch.randn(49152, 576, generator=g).bfloat16() * 0.05
    got = fused.amx_linear(x, fused.amx_pack_weight(w), 49152, None)
    want = torch.nn.functional.linear(x, w)
    assert (got == want).float().mean().item() > 0.9
    assert torch.equal(got.float().argmax(-1), want.float().argmax(-1))


def test_zero_rows_and_bad_arguments():
    w = torch.randn(8, 32).bfloat16()
    p = fused.amx_pack_weight(w)
    assert fused.amx_linear(torch.empty(0, 32, dtype=torch.bfloat16), p, 8).shape == (0, 8)
    with pytest.raises(RuntimeError, match="bf16"):
        fused.amx_linear(torch.randn(1, 32), p, 8)
    with pytest.raises(RuntimeError, match="amx_pack_weight"):
        fused.amx_linear(torch.randn(1, 64).bfloat16(), p, 8)  # K of another weight
    with pytest.raises(RuntimeError, match="amx_pack_weight"):
        fused.amx_linear(torch.randn(1, 32).bfloat16(), p, 40)  # out_features of another weight
    with pytest.raises(RuntimeError, match="contiguous"):
        fused.amx_linear(torch.randn(32, 2).bfloat16().T, p, 8)
    with pytest.raises(RuntimeError, match="bias"):
        fused.amx_linear(torch.randn(1, 32).bfloat16(), p, 8, torch.randn(7).bfloat16())
    with pytest.raises(RuntimeError, match="bf16"):
        fused.amx_pack_weight(torch.randn(8, 32))


def test_packed_linear_takes_amx_up_to_its_row_limit(monkeypatch):
    lin = torch.nn.Linear(64, 48, bias=True, dtype=torch.bfloat16)
    packed = PackedLinear(lin)
    assert packed.kernel == "amx"
    calls = record_rows(monkeypatch, packed, "_amx")
    with torch.inference_mode():
        for rows in (1, 7, AMX_MAX_ROWS, AMX_MAX_ROWS + 1):
            x = torch.randn(rows, 64).bfloat16()
            torch.testing.assert_close(packed(x).float(), lin(x).float(), rtol=2**-7, atol=2e-2)
        # A strided input (a view) is made contiguous, not rejected.
        x = torch.randn(64, 6).bfloat16().T
        torch.testing.assert_close(packed(x).float(), lin(x).float(), rtol=2**-7, atol=2e-2)
    assert calls == [1, 7, AMX_MAX_ROWS, 6]


def test_without_amx_packed_linear_falls_back(monkeypatch):
    monkeypatch.setattr(packed_linear, "amx_ops", lambda: None)
    lin = torch.nn.Linear(64, 48, bias=False, dtype=torch.bfloat16)
    packed = PackedLinear(lin)
    assert packed.kernel in ("avx512", "onednn")
    x = torch.randn(9, 64).bfloat16()
    with torch.inference_mode():
        torch.testing.assert_close(packed(x).float(), lin(x).float(), rtol=2**-7, atol=2e-2)


# --- gate|up projection with the SiLU-and-mul epilogue ----------------------


@pytest.mark.parametrize("m", [1, 5, 17, 33, 70, 400])
@pytest.mark.parametrize("inter,k", [(1536, 576), (16, 40), (48, 1536)])
def test_silu_mul_epilogue_is_bit_exact_with_projection_then_silu_and_mul(m, inter, k):
    g = torch.Generator().manual_seed(m + inter + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = (torch.randn(2 * inter, k, generator=g) * 0.1).bfloat16()
    got = fused.amx_linear_silu_mul(x, fused.amx_pack_gate_up(w), inter)
    assert got.shape == (m, inter) and got.dtype == torch.bfloat16
    two_step = fused.silu_and_mul(fused.amx_linear(x, fused.amx_pack_weight(w), 2 * inter, None))
    assert torch.equal(got, two_step)
    # and it is act_fn(gate_proj(x)) * up_proj(x) up to the matmuls' bf16 rounding
    gate, up = torch.nn.functional.linear(x, w[:inter]), torch.nn.functional.linear(x, w[inter:])
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2e-2)


def test_gate_up_packing_interleaves_gate_and_up_blocks_of_16():
    inter, k = 32, 40
    w = torch.arange(2 * inter * k, dtype=torch.float32).reshape(2 * inter, k).bfloat16()
    p = fused.amx_pack_gate_up(w)
    assert p.shape == (4, 2, 16, 16, 2)  # blocks: gate 0, up 0, gate 1, up 1
    # Tile (nb, kb), row kp, column n, pair j holds feature 16 nb + n of the interleaved weight.
    assert p[0, 0, 3, 2, 1] == w[2, 7]  # gate feature 2
    assert p[1, 0, 3, 2, 1] == w[inter + 2, 7]  # up feature 2
    assert p[2, 1, 2, 5, 0] == w[16 + 5, 36]  # gate feature 21
    assert p[3, 1, 2, 5, 0] == w[inter + 16 + 5, 36]  # up feature 21


def test_silu_mul_bad_arguments():
    w = torch.randn(64, 32).bfloat16()
    p = fused.amx_pack_gate_up(w)
    x = torch.randn(3, 32).bfloat16()
    assert fused.amx_linear_silu_mul(torch.empty(0, 32, dtype=torch.bfloat16), p, 32).shape == (0, 32)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        fused.amx_linear_silu_mul(x, p, 24)
    with pytest.raises(RuntimeError, match="amx_pack_weight"):
        fused.amx_linear_silu_mul(x, p, 16)  # packed for inter 32
    with pytest.raises(RuntimeError, match="amx_pack_weight"):
        fused.amx_linear_silu_mul(torch.randn(3, 64).bfloat16(), p, 32)  # K of another weight
    with pytest.raises(RuntimeError, match="multiple of 16"):
        fused.amx_pack_gate_up(torch.randn(40, 32).bfloat16())  # I = 20


def _llama_mlp(hidden, inter, seed):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=inter, hidden_act="silu")
    return LlamaMLP(cfg).to(torch.bfloat16).eval()


def test_fused_mlp_runs_the_epilogue_on_amx_and_matches_the_stock_mlp():
    from executor.cpu.fused_modules import FusedMLP

    stock = _llama_mlp(96, 48, 0)
    mlp = FusedMLP(stock)
    assert mlp.kernel == "amx_linear_silu_mul" and mlp.gate_up is None
    with torch.inference_mode():
        for shape in ((1, 96), (37, 96), (1, 400, 96)):  # the lean forward's [T, H] and HF's [1, T, H]
            x = torch.randn(*shape).bfloat16()
            got = mlp(x)
            assert got.shape == shape
            torch.testing.assert_close(got.float(), stock(x).float(), rtol=2**-6, atol=2e-2)


def test_fused_mlp_without_bf16_kernels_or_with_an_odd_width_keeps_the_two_step_path(monkeypatch):
    from executor.cpu.fused_modules import FusedMLP

    odd = FusedMLP(_llama_mlp(96, 40, 1))  # I = 40: not a whole number of 16-feature blocks
    assert odd.gate_up is not None and odd.kernel == "amx + silu_and_mul"
    # Without AMX an AVX512-BF16 CPU takes avx512_linear_silu_mul
    # (test_avx512_linear.py); without either, the two-step path.
    monkeypatch.setattr(packed_linear, "amx_ops", lambda: None)
    monkeypatch.setattr(packed_linear, "avx512_ops", lambda: None)
    stock = _llama_mlp(96, 48, 2)
    mlp = FusedMLP(stock)
    assert mlp.gate_up is not None and mlp.kernel.endswith("+ silu_and_mul")
    with torch.inference_mode():
        x = torch.randn(9, 96).bfloat16()
        torch.testing.assert_close(mlp(x).float(), stock(x).float(), rtol=2**-6, atol=2e-2)
        torch.testing.assert_close(
            odd(x).float(),
            odd.down(torch.nn.functional.silu(odd.gate_up(x)[:, :40]) * odd.gate_up(x)[:, 40:]).float(),
            rtol=2**-6,
            atol=2e-2,
        )


# ---- amx_linear_argmax: the greedy LM head without the logits ----------------


@pytest.mark.parametrize("m", [1, 5, 17, 33, 70])
@pytest.mark.parametrize("n,k", [(49152, 576), (960, 576), (50, 40), (17, 64), (1, 33)])
def test_argmax_is_the_argmax_of_amx_linear(m, n, k):
    g = torch.Generator().manual_seed(m * 7 + n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    packed = fused.amx_pack_weight(w)
    for bias in (None, torch.randn(n, generator=g).bfloat16()):
        got = fused.amx_linear_argmax(x, packed, n, bias)
        assert got.dtype == torch.int64 and got.shape == (m,)
        # bf16-rounded outputs, first index of the maximum: the stored logits' argmax exactly
        assert torch.equal(got, fused.amx_linear(x, packed, n, bias).max(-1).indices)


def test_argmax_ties_take_the_first_column_even_across_threads():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 64, generator=g).bfloat16()
    w = torch.randn(4096, 64, generator=g).bfloat16() * 0.01
    best = x.float() @ torch.ones(64)  # a column that wins every row...
    w[3000] = torch.ones(64).bfloat16()
    w[5] = w[3000]  # ...and its copy far earlier (the other thread's half), and one later
    w[4000] = w[3000]
    got = fused.amx_linear_argmax(x, fused.amx_pack_weight(w), 4096, None)
    positive = best > 1
    assert positive.any()
    assert (got[positive] == 5).all()
    assert torch.equal(got, fused.amx_linear(x, fused.amx_pack_weight(w), 4096, None).max(-1).indices)


def test_argmax_nan_wins_at_its_first_column_and_all_minus_inf_gives_zero():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(3, 32, generator=g).bfloat16()
    w = torch.randn(2000, 32, generator=g).bfloat16()
    packed = fused.amx_pack_weight(w)
    bias = torch.zeros(2000).bfloat16()
    bias[1500] = float("nan")
    bias[700] = float("nan")
    assert fused.amx_linear_argmax(x, packed, 2000, bias).tolist() == [700, 700, 700]
    assert torch.equal(fused.amx_linear(x, packed, 2000, bias).max(-1).indices, torch.tensor([700] * 3))
    ninf = torch.full((2000,), float("-inf")).bfloat16()
    assert fused.amx_linear_argmax(x, packed, 2000, ninf).tolist() == [0, 0, 0]


def test_argmax_rejects_bad_arguments_and_takes_zero_rows():
    w = torch.randn(40, 32).bfloat16()
    packed = fused.amx_pack_weight(w)
    assert fused.amx_linear_argmax(torch.empty(0, 32).bfloat16(), packed, 40).shape == (0,)
    with pytest.raises(RuntimeError, match="packed must come from amx_pack_weight"):
        fused.amx_linear_argmax(torch.randn(2, 64).bfloat16(), packed, 40)
    with pytest.raises(RuntimeError, match="bf16 only"):
        fused.amx_linear_argmax(torch.randn(2, 32), packed, 40)


def test_packed_linear_greedy_argmax_matches_forward_and_steps_aside_above_the_row_limit():
    g = torch.Generator().manual_seed(5)
    lin = torch.nn.Linear(96, 300, bias=False).bfloat16()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(300, 96, generator=g))
    pl = PackedLinear(lin)
    x = torch.randn(9, 96, generator=g).bfloat16()
    assert pl.greedy_argmax(x) == pl(x).max(-1).indices.tolist()
    assert pl.greedy_argmax(torch.randn(AMX_MAX_ROWS + 1, 96).bfloat16()) is None
