// bf16 linear layer on AVX512-BF16 dot products over the AMX tile layout
// (avx512_linear.cpp), for CPUs without AMX; bound in fused_ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>  // the tensor alone: torch/types.h is several times slower to compile

#include <string>

namespace cbserve_fused {

// Whether this CPU runs avx512_linear (AVX512-BF16; AMX not needed).
bool avx512_linear_supported();

// y [M, N] = x [M, K] · weightᵀ (+ bias [N]), bf16, with `packed` from
// amx_pack_weight (bf16 tiles [N/16, K/32, 16, 16, 2]; any K, any N) or a
// GGUF Q4_1 / Q8_0 weight's blocks packed by executor/cpu/gguf_weights.py
// (uint8 [N/16, K/32, tile bytes]), expanded on the way to the same tiles.
at::Tensor avx512_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const c10::optional<at::Tensor>& bias);

// y [M, I] = act(x · gateᵀ) * (x · upᵀ), bf16, `packed` from
// amx_pack_gate_up (or the blocks of that order), with the Hugging Face MLP's rounding points (as
// amx_linear_silu_mul, the same activations): the [M, 2I] projection is
// never written.
at::Tensor avx512_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t inter,
                                  const std::string& activation = "silu");

}  // namespace cbserve_fused
