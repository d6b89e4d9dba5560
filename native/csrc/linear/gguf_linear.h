// Linear layers over GGUF blocks (the tile layout of gguf_tiles.h, packed by
// executor/cpu/gguf_weights.py) on CPUs without AVX512-BF16: AVX2 + FMA +
// F16C where the CPU has them, portable C++ otherwise (gguf_linear.cpp).
// avx512_linear and amx_linear read the same blocks on the CPUs that have
// those instructions.
#pragma once

#include <ATen/core/Tensor.h>  // the tensor alone: torch/types.h is several times slower to compile

namespace cbserve_fused {

// Whether gguf_linear runs its AVX2 code here (else its portable code).
bool gguf_linear_avx2();

// y [M, N] = x [M, K] · wᵀ (+ bias [N]) with w the weight `packed` holds.
// fp32 x: w is the blocks' exact fp32 values (as transformers dequantizes
// them), y fp32. bf16 x: w is those values rounded to bf16 (the bf16 model's
// weights), y bf16 rounded once. Every product and sum in fp32, each output
// summed over k in order from 0 with one FMA per term, then the bias added:
// what avx2_f32_linear computes over the same weights packed as panels, bit
// for bit, on the AVX2 and the portable paths alike. Except under int8 block
// activations (set_block_activations, AVX512-VNNI CPUs), at any row count:
// then x is rounded per 32-wide k-block and multiplied with integer dot
// products (int8_blocks.h), bias added in fp32, y in x's dtype.
at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias);

// The [N, K] weight `packed` holds, in `dtype` (float32: the exact values;
// bfloat16: rounded once), by the code gguf_linear expands tiles with.
at::Tensor gguf_dequant(const at::Tensor& packed, at::ScalarType dtype);

// Rows `ids` (int64 [T]) of the weight `packed` holds, [T, K] in `dtype`
// (float32 or bfloat16, rounded as gguf_dequant): an embedding lookup from
// blocks on any CPU.
at::Tensor gguf_embed(const at::Tensor& packed, const at::Tensor& ids, at::ScalarType dtype);

}  // namespace cbserve_fused
