// Q4_1 linear layer with the weights as AMX's A operand (amx_q4_rows.cpp),
// bound in fused_ops.cpp.
#pragma once

#include <torch/types.h>  // tensors without torch/extension.h's Python bindings: quicker to compile

namespace cbserve_fused {

// y [M, N] = x [M, K] · wᵀ, bf16, with w as Q4_1 blocks in the
// feature-major layout of executor/cpu/gguf_weights.py (BlockWeight.pack_rows:
// uint8 [N/32, K/32, 2, 320], N a multiple of 32), each weight expanded to
// bf16(d * q + m) exactly as amx_linear expands its blocks. With
// silu_inter > 0 the rows are gate and up blocks of 16 interleaved (as for
// amx_linear_silu_mul) and y is [M, silu_inter] = silu(gate) * up.
torch::Tensor amx_q4_rows_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                                 int64_t silu_inter);

// The bf16 weight [N, K] those blocks expand to (for the load-time check).
torch::Tensor amx_q4_rows_dequant(const torch::Tensor& packed);

}  // namespace cbserve_fused
