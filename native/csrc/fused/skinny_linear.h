// Decode-sized bf16 linear layer (skinny_linear.cpp), bound in fused_ops.cpp.
#pragma once

#include <torch/extension.h>

namespace cbserve_fused {

// Whether this CPU runs skinny_linear (AVX512-BF16).
bool skinny_linear_supported();

// y [M, N] = x [M, K] · weight [N, K]ᵀ (+ bias [N]), all bf16, contiguous.
torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& weight,
                            const c10::optional<torch::Tensor>& bias);

}  // namespace cbserve_fused
