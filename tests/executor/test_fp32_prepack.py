"""fp32 linears on native avx2_f32_linear or oneDNN's prepacked kernel (CPUs
without native bf16, or CBSERVE_FP32_PREPACK=1): the same outputs as F.linear within fp32 rounding,
the same greedy tokens, and the plain weights not kept twice."""

from __future__ import annotations

import pytest
import torch

from executor import model_loader, model_source
from executor.cpu import packed_linear
from executor.cpu.fused_modules import FusedMLP
from executor.cpu.packed_linear import PackedLinear, fp32_prepacked
from executor.runner import ModelRunner
from tests.executor.helpers import greedy, needs_bf16

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


def _tiny(monkeypatch, prepack: str) -> ModelRunner:
    monkeypatch.setenv("CBSERVE_FP32_PREPACK", prepack)
    return ModelRunner(model_loader.load_model(model_source.resolve("tiny"), torch.float32), 16, 64)


def test_the_default_follows_the_cpu_and_the_switch_overrides_it(monkeypatch):
    monkeypatch.delenv("CBSERVE_FP32_PREPACK", raising=False)
    onednn = torch.backends.mkldnn.is_available()
    assert fp32_prepacked() == (onednn and not model_loader.cpu_has_native_bf16())
    monkeypatch.setenv("CBSERVE_FP32_PREPACK", "0")
    assert not fp32_prepacked()
    monkeypatch.setenv("CBSERVE_FP32_PREPACK", "1")
    assert fp32_prepacked() == onednn


needs_avx2_f32 = pytest.mark.skipif(
    packed_linear._fused() is None or not packed_linear._fused().avx2_f32_linear_supported(),
    reason="no AVX2 + FMA here",
)


@needs_onednn
@pytest.mark.parametrize("kernel", ["onednn", pytest.param("avx2_f32", marks=needs_avx2_f32)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_prepacked_fp32_linear_computes_f_linear(monkeypatch, kernel, bias):
    monkeypatch.setenv("CBSERVE_FP32_LINEAR", kernel)
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200, bias=bias)
    w, b = linear.weight.detach().clone(), None if linear.bias is None else linear.bias.detach().clone()
    packed = PackedLinear(linear)
    assert packed.kernel == kernel
    # Only shape and dtype stay of the plain weight; it is no parameter.
    assert packed.weight.device.type == "meta" and packed.weight.shape == (200, 96)
    assert [n for n, _ in packed.named_parameters()] == []
    for rows in (1, 3, 16, 64, 130):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(packed(x), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 5, 96)  # the transformers forward's [B, T, H]
    torch.testing.assert_close(packed(x3), torch.nn.functional.linear(x3, w, b), rtol=1e-5, atol=1e-5)


@needs_bf16
def test_a_bf16_linear_keeps_its_plain_weight_unless_avx2_packs_it():
    linear = torch.nn.Linear(64, 48, bias=False, dtype=torch.bfloat16)
    packed = PackedLinear(linear)
    if packed_linear.avx2_bf16():  # one kernel at every row count: only the bf16 panels are held
        assert packed.kernel == "avx2_f32" and packed.packed.dtype == torch.bfloat16
        assert packed.weight.device.type == "meta" and packed.weight.dtype == torch.bfloat16
        assert torch.equal(packed.plain_weight(), linear.weight.detach())
    else:
        assert packed.weight is linear.weight


@needs_onednn
@pytest.mark.parametrize("kernel", ["onednn", pytest.param("avx2_f32", marks=needs_avx2_f32)])
def test_the_runner_prepacks_fp32_and_gives_the_stock_tokens(monkeypatch, kernel):
    monkeypatch.setenv("CBSERVE_FP32_LINEAR", kernel)
    prompts = [[(5 * i + 3 * L) % 250 + 3 for i in range(L)] for L in (1, 7, 33, 90)]
    packed = _tiny(monkeypatch, "1")
    stock = _tiny(monkeypatch, "0")
    layer = packed.model.model.layers[0]
    # avx2_f32 also runs the fused modules and the lean forward (test_fp32_lean.py).
    assert (packed.lean is not None) == isinstance(layer.mlp, FusedMLP) == (kernel == "avx2_f32")
    down = layer.mlp.down if isinstance(layer.mlp, FusedMLP) else layer.mlp.down_proj
    # Under the lean forward q/k/v are columns of its fused projection (QkvPart).
    q_proj = layer.self_attn.q_proj.fused if packed.lean is not None else layer.self_attn.q_proj
    assert isinstance(q_proj, PackedLinear) and isinstance(down, PackedLinear)
    assert q_proj.kernel == kernel and layer.self_attn.o_proj.kernel == kernel
    assert isinstance(stock.model.model.layers[0].self_attn.q_proj, torch.nn.Linear)
    # The tiny model ties its LM head to the embedding: the embedding keeps the weight.
    assert packed.model.model.embed_tokens.weight.device.type == "cpu"
    assert all(p.device.type == "cpu" for p in packed.model.parameters())
    assert greedy(packed, prompts, 12) == greedy(stock, prompts, 12)


@needs_onednn
def test_prepacking_replaces_every_linear_and_logs_it(monkeypatch):
    monkeypatch.setenv("CBSERVE_FP32_PREPACK", "1")
    model = model_loader.load_model(model_source.resolve("tiny"), torch.float32)
    n = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert packed_linear.prepack_linears(model) == n > 0
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    monkeypatch.setenv("CBSERVE_FP32_PREPACK", "0")
    assert packed_linear.prepack_linears(model_loader.load_model(model_source.resolve("tiny"), torch.float32)) == 0


@needs_avx2_f32
def test_the_avx2_kernel_at_every_edge_of_its_panels():
    """Feature counts around the 16-wide panels, K of 1 and odd, rows around
    the 6-row register block (split into near-equal blocks), and no rows at
    all: F.linear's values (in fp64) within fp32 rounding, and its arguments
    checked."""
    fused = packed_linear._fused()
    torch.manual_seed(1)
    for n, k in ((1, 1), (15, 7), (16, 33), (17, 64), (200, 96), (49, 1536)):
        w, b = torch.randn(n, k), torch.randn(n)
        packed = fused.avx2_f32_pack_weight(w)
        assert packed.shape == ((n + 15) // 16, k, 16)
        for rows in (0, 1, 5, 6, 7, 8, 12, 13, 16, 64):
            x = torch.randn(rows, k)
            for bias in (None, b):
                want = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
                got = fused.avx2_f32_linear(x, packed, n, bias)
                # fp32 sums of k products of unit normals: rounding grows with sqrt(k).
                torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5 * k**0.5)
    w = torch.randn(20, 8)
    packed = fused.avx2_f32_pack_weight(w)
    packed_bf16 = fused.avx2_f32_pack_weight(w.bfloat16())
    bad = [
        (torch.randn(2, 9), packed, 20, None),  # K differs from the packing's
        (torch.randn(2, 8), packed, 40, None),  # more features than packed
        (torch.randn(2, 8).bfloat16(), packed, 20, None),  # x and weights of two dtypes
        (torch.randn(2, 8), packed_bf16, 20, None),
        (torch.randn(2, 8).bfloat16(), packed_bf16, 20, torch.randn(20)),  # an fp32 bias on bf16
        (torch.randn(8, 2).t(), packed, 20, None),  # not contiguous
        (torch.randn(2, 8), packed, 20, torch.randn(19)),  # bias of the wrong length
    ]
    for args in bad:
        with pytest.raises((RuntimeError, ValueError, TypeError)):
            fused.avx2_f32_linear(*args)
    with pytest.raises((RuntimeError, ValueError, TypeError)):
        fused.avx2_f32_pack_weight(torch.randn(4, 4).half())


@needs_avx2_f32
def test_the_avx2_kernel_in_bf16_is_its_fp32_sums_rounded_once():
    """bf16 weights, x and bias: the fp32 kernel's result on the same values
    (widened exactly), rounded to nearest even, bit for bit, whether a panel
    is widened once for many row blocks or per k for one; and within one bf16
    rounding of the exact product."""
    fused = packed_linear._fused()
    torch.manual_seed(2)
    for n, k in ((1, 1), (15, 7), (17, 64), (200, 96), (49, 1536)):
        w, b = torch.randn(n, k).bfloat16(), torch.randn(n).bfloat16()
        packed, packed32 = fused.avx2_f32_pack_weight(w), fused.avx2_f32_pack_weight(w.float())
        assert packed.dtype == torch.bfloat16 and packed.shape == ((n + 15) // 16, k, 16)
        for rows in (0, 1, 5, 6, 7, 13, 64):
            x = torch.randn(rows, k).bfloat16()
            for bias in (None, b):
                got = fused.avx2_f32_linear(x, packed, n, bias)
                b32 = None if bias is None else bias.float()
                assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
                assert torch.equal(got, fused.avx2_f32_linear(x.float(), packed32, n, b32).bfloat16())
                exact = torch.nn.functional.linear(x.double(), w.double(), None if bias is None else bias.double())
                torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-5 * k**0.5)
    # Rounding ties go to even, and a NaN stays a NaN.
    eye = fused.avx2_f32_pack_weight(torch.eye(16).bfloat16())
    x = torch.zeros(2, 16).bfloat16()
    x[0, :3] = torch.tensor([1.0, 2.0, -3.0]).bfloat16()
    bias = torch.zeros(16).bfloat16()
    # Half an ulp of 1 (a tie, to 1.0), 5/8 of one of 2 (up), half of one of 3 (a tie, to -3.0).
    bias[:3] = torch.tensor([2**-8, 2**-7 + 2**-9, 2**-7]).bfloat16()
    x[1, 0] = float("nan")
    y = fused.avx2_f32_linear(x, eye, 16, bias).float()
    assert y[0, :3].tolist() == [1.0, 2.0 + 2**-6, -3.0 + 0.0] and y[1, 0].isnan()


@needs_avx2_f32
def test_fp32_layers_take_the_avx2_kernel_unless_told_otherwise(monkeypatch):
    monkeypatch.setenv("CBSERVE_FP32_PREPACK", "1")
    monkeypatch.delenv("CBSERVE_FP32_LINEAR", raising=False)
    linear = torch.nn.Linear(64, 48)
    assert PackedLinear(linear).kernel_for(1) == "avx2_f32_linear"
    monkeypatch.setenv("CBSERVE_FP32_LINEAR", "onednn")
    assert PackedLinear(linear).kernel_for(1) == "oneDNN prepacked"
