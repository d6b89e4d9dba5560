// Q4_1 linear layer with the weights as AMX's A operand (amx_q4_rows.cpp),
// bound in fused_ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>  // the tensor alone: torch/types.h is several times slower to compile

namespace cbserve_fused {

// y [M, N] = x [M, K] · wᵀ, bf16, with w as Q4_1 blocks in the
// feature-major layout of executor/cpu/gguf_weights.py (BlockWeight.pack_rows:
// uint8 [N/32, K/32, 2, 320], N a multiple of 32), each weight expanded to
// bf16(d * q + m) exactly as amx_linear expands its blocks. With
// silu_inter > 0 the rows are gate and up blocks of 16 interleaved (as for
// amx_linear_silu_mul) and y is [M, silu_inter] = silu(gate) * up.
at::Tensor amx_q4_rows_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, int64_t silu_inter);

// The bf16 weight [N, K] those blocks expand to (for the load-time check).
at::Tensor amx_q4_rows_dequant(const at::Tensor& packed);

}  // namespace cbserve_fused
