// bf16 linear layer on AMX tiles (amx_linear.cpp), bound in fused_ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>  // the tensor alone: torch/types.h is several times slower to compile

#include <string>

namespace cbserve_fused {

// Whether this CPU (and kernel) runs AMX-BF16 code; asks Linux for the tile
// state on first use.
bool amx_linear_supported();

// weight [N, K] bf16 -> the tile layout amx_linear reads:
// [ceil(N/16), ceil(K/32), 16, 16, 2], zero-padded.
at::Tensor amx_pack_weight(const at::Tensor& weight);

// y [M, N] = x [M, K] · weightᵀ (+ bias [N]), bf16, with `packed` from
// amx_pack_weight, or a weight's GGUF blocks as uint8: Q4_1 / Q8_0 [N/16,
// K/32, 320 / 544], Q4_K / Q6_K [N/16, K/256, 2368 / 3360]
// (executor/cpu/gguf_weights.py), expanded to the same bf16 tiles on the fly
// (the packed argument of the three kernels below takes either).
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const c10::optional<at::Tensor>& bias);

// The greedy token of each row: argmax over the out_features columns of
// x · weightᵀ (+ bias) as amx_linear would return them (bf16-rounded), the
// first column on ties and the first NaN column if any (as torch.max), without
// writing the [M, out_features] logits. int64 [M].
at::Tensor amx_linear_argmax(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                             const c10::optional<at::Tensor>& bias);

// gate_up [2I, K] bf16 (gate rows, then up rows; I a multiple of 16) -> the
// amx_pack_weight layout of the rows interleaved in blocks of 16 (gate block
// j, then up block j), which amx_linear_silu_mul reads.
at::Tensor amx_pack_gate_up(const at::Tensor& gate_up);

// y [M, I] = act(x · gateᵀ) * (x · upᵀ), bf16, with the Hugging Face MLP's
// rounding points (both projections and the activation rounded to bf16), and
// `packed` from amx_pack_gate_up: the gate|up projection and act-and-mul in
// one pass, without writing the [M, 2I] projection. activation: "silu" or
// "gelu_tanh" (parse_act).
at::Tensor amx_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t inter,
                               const std::string& activation = "silu");

// The bf16 tiles [N/16, K/32, 16, 16, 2] that the kernels expand uint8
// Q4_1 / Q8_0 / Q4_K / Q6_K blocks to (equal to amx_pack_weight of the
// dequantised weight).
at::Tensor amx_dequant(const at::Tensor& packed);

}  // namespace cbserve_fused
