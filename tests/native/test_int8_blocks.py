"""GGUF blocks times int8 activations (block_activations "int8", AVX512-VNNI
CPUs; native/csrc/linear/int8_blocks.cpp), through both kernels that use
them: avx512_linear (bf16 x and y, AVX512-BF16 CPUs) and gguf_linear (fp32
or bf16 x and y; the kernel of CPUs without AVX512-BF16, and of fp32
models everywhere). x is rounded per 32-wide k-block to int8 (int16 against
Q8_0) with one fp32 scale, and the products are integer dot products. The
outputs must be that rounded x times the blocks' exact weights, to the
output dtype's rounding; "bf16" (the default) must leave each kernel's own
expansion bit for bit, and so must avx512_linear's calls above 16 rows
(gguf_linear takes the integer kernels at every row count)."""

from __future__ import annotations

import pytest
import torch

import native._fused as fused
from executor.cpu.gguf_weights import BlockWeight
from tests.native.test_amx_blocks import _bits, _blocks, linear_case

pytestmark = pytest.mark.skipif(not fused.avx512_int8_supported(), reason="needs an AVX512-VNNI CPU")

INT_ROWS = 16  # int8_blocks.h's kMaxRows: avx512_linear's limit
KINDS = ["q4_1", "q8_0", "q4_k", "q6_k"]


def _needs(kernel: str) -> None:
    if kernel == "avx512" and not fused.avx512_linear_supported():
        pytest.skip("avx512_linear needs an AVX512-BF16 CPU")
    if kernel.startswith("gguf") and not fused.gguf_linear_avx2():
        pytest.skip("gguf_linear's vector code needs AVX2 + FMA + F16C")


# avx512_linear in bf16; gguf_linear in fp32 (the served dtype of CPUs
# without AVX512-BF16) and in bf16.
KERNELS = ["avx512", "gguf", "gguf-bf16"]


def _linear(kernel: str, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    if kernel == "avx512":
        return fused.avx512_linear(x.bfloat16(), packed, n, None if bias is None else bias.bfloat16())
    dtype = torch.float32 if kernel == "gguf" else torch.bfloat16
    return fused.gguf_linear(x.to(dtype), packed, n, None if bias is None else bias.to(dtype))


def _x(kernel: str, x: torch.Tensor) -> torch.Tensor:
    """x as the kernel receives it (bf16 tests draw bf16 x; fp32 keeps more bits)."""
    if kernel != "gguf":
        return x
    return x.float() + 1e-3 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def int8_activations():
    fused.set_block_activations("int8")
    yield
    fused.set_block_activations("bf16")


def rounded_x(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x as the kernels round it: per 32-wide k-block, q = rne(x * L / max|x|)
    and x̂ = q * (max|x| / L), in fp32 (L = 127, or 32767 against Q8_0)."""
    levels = 32767.0 if kind == "q8_0" else 127.0
    xf = x.float().view(x.shape[0], -1, 32)
    amax = xf.abs().amax(-1, keepdim=True)
    # a tensor's true quotient: torch computes `levels / amax` as a reciprocal times levels, rounding twice
    inv = torch.where(amax > 0, torch.full_like(amax, levels) / amax, torch.zeros_like(amax))
    q = torch.round(xf * inv).clamp(-levels, levels)
    return (q * (amax / levels)).view_as(x.float())


def close_to(got: torch.Tensor, want: torch.Tensor) -> None:
    """got is want (fp64) to got's dtype's rounding, plus fp32 sums' error."""
    err = (got.double() - want).abs()
    ulp = 2.0**-8 if got.dtype == torch.bfloat16 else 2.0**-21
    bound = want.abs() * ulp + 1e-5 * want.abs().max()
    assert bool((err <= bound).all()), f"worst excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [1024, 1040])
@pytest.mark.parametrize("m", [1, 5, 8, 9, 16, 17, 70])
def test_int8_linear_is_rounded_x_times_the_blocks(kernel, kind, m, n, int8_activations):
    _needs(kernel)
    if kernel == "avx512" and m > INT_ROWS:
        pytest.skip("avx512_linear keeps its bf16 kernels above 16 rows (test below)")
    bw, packed, tiles, x, bias = linear_case(kind, m, n, seed=m + n, k=768 if kind.endswith("_k") else 576)
    x = _x(kernel, x)
    w = bw.dequantize().double()
    xhat = rounded_x(x if kernel == "gguf" else x.bfloat16(), kind).double()
    for b in (None, bias):
        got = _linear(kernel, x, packed, n, b)
        close_to(got, xhat @ w.T + (0 if b is None else b.double()))
    # the integer path ran: the kernel's own expansion gives other outputs
    fused.set_block_activations("bf16")
    assert not torch.equal(_bits(got), _bits(_linear(kernel, x, packed, n, bias)))


@pytest.mark.parametrize("kernel", ["avx512", "gguf"])
@pytest.mark.parametrize("kind", KINDS)
def test_int8_error_against_the_exact_product_is_bounded(kernel, kind, int8_activations):
    """The rounding of x costs what the docs say: about 0.4 % (int8) and
    well under 0.01 % (int16, Q8_0) of the product's norm for Gaussian x."""
    _needs(kernel)
    m, n = 8, 1024
    bw, packed, _, x, _ = linear_case(kind, m, n, seed=3, k=768 if kind.endswith("_k") else 576)
    x = _x(kernel, x)
    exact = x.double() @ bw.dequantize().double().T
    got = _linear(kernel, x, packed, n, None).double()
    rel = ((got - exact).norm() / exact.norm()).item()
    # bf16 rounding of the output alone is ~0.1 %; int8 x adds ~0.4 %
    assert rel < (0.01 if kind != "q8_0" else 0.003 if kernel == "avx512" else 1e-4), rel


@pytest.mark.parametrize("kind", ["q4_1", "q4_k", "q6_k"])
@pytest.mark.parametrize("m", [1, 7, 16])
def test_int8_silu_mul_over_gate_up_blocks(kind, m, int8_activations):
    _needs("avx512")
    inter, k = 1536, 768 if kind.endswith("_k") else 576
    gate, up = _blocks(kind, inter, k, seed=1), _blocks(kind, inter, k, seed=2)
    order = torch.arange(2 * inter).view(2, -1, 16).transpose(0, 1).reshape(-1)  # amx_pack_gate_up's rows
    packed = BlockWeight.cat([gate, up]).rows(order).pack()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    xhat = rounded_x(x, kind).double()
    g = (xhat @ gate.dequantize().double().T).bfloat16().float()  # the epilogue rounds each sum to bf16
    u = (xhat @ up.dequantize().double().T).bfloat16().float()
    want = torch.nn.functional.silu(g) * u
    got = fused.avx512_linear_silu_mul(x, packed, inter, "silu")
    # each sum is within bf16 rounding of the one above: allow a few ulps of the result
    assert torch.allclose(got.float(), want, rtol=3 * 2.0**-8, atol=1e-4 * want.abs().max().item())


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_bf16_default_and_long_chunks_stay_the_bf16_kernels(kind, int8_activations):
    _needs("avx512")
    m = INT_ROWS + 1
    _, packed, tiles, x, bias = linear_case(kind, m, 1024, seed=5)
    assert torch.equal(
        _bits(fused.avx512_linear(x, packed, 1024, bias)), _bits(fused.avx512_linear(x, tiles, 1024, bias))
    )
    fused.set_block_activations("bf16")
    _, packed, tiles, x, bias = linear_case(kind, 4, 1024, seed=5)
    assert torch.equal(
        _bits(fused.avx512_linear(x, packed, 1024, bias)), _bits(fused.avx512_linear(x, tiles, 1024, bias))
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [4, 40])
def test_gguf_linear_under_bf16_stays_its_fp32_expansion(kind, dtype, m):
    """Under "bf16" gguf_linear equals avx2_f32_linear over the dequantized
    weight bit for bit (gguf_linear.h), at few rows and many."""
    _needs("gguf")
    k = 768 if kind.endswith("_k") else 576
    bw = _blocks(kind, 1024, k, seed=6)
    w = bw.dequantize().to(dtype)
    bias = torch.randn(1024, generator=torch.Generator().manual_seed(2)).to(dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    want = fused.avx2_f32_linear(x, fused.avx2_f32_pack_weight(w), 1024, bias)
    assert torch.equal(_bits(fused.gguf_linear(x, bw.pack(), 1024, bias)), _bits(want))


def test_block_activations_setting():
    assert fused.block_activations() == "bf16"
    with pytest.raises(RuntimeError, match="'bf16' or 'int8'"):
        fused.set_block_activations("fp8")
    fused.set_block_activations("int8")
    try:
        assert fused.block_activations() == "int8"
    finally:
        fused.set_block_activations("bf16")


@pytest.mark.parametrize("kernel", KERNELS)
def test_zero_rows_of_x_give_the_bias(kernel, int8_activations):
    _needs(kernel)
    _, packed, _, x, bias = linear_case("q4_1", 3, 1024, seed=9)
    got = _linear(kernel, torch.zeros_like(x), packed, 1024, bias)
    assert torch.equal(got, bias.to(got.dtype).expand(3, -1))
