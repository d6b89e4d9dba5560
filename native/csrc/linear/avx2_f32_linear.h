// Linear layer in fp32 arithmetic on AVX2 FMA over panels of 16 output
// features (avx2_f32_linear.cpp), for CPUs without native bf16: fp32 layers,
// and bf16 layers stored in bf16 and computed in fp32; bound in fused_ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>  // the tensor alone: torch/types.h is several times slower to compile

namespace cbserve_fused {

// Whether this CPU runs avx2_f32_linear (AVX2 and FMA).
bool avx2_f32_linear_supported();

// weight [N, K] fp32 or bf16 -> the zero-padded panel layout avx2_f32_linear
// reads, same dtype: [ceil(N/16), K, 16].
at::Tensor avx2_f32_pack_weight(const at::Tensor& weight);

// y [M, N] = x [M, K] · weightᵀ (+ bias [N]) with `packed` from
// avx2_f32_pack_weight (any K, any N): x, packed, bias and y all fp32, or all
// bf16 (fp32 sums, y rounded to nearest even once).
at::Tensor avx2_f32_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                           const c10::optional<at::Tensor>& bias);

}  // namespace cbserve_fused
