// LoRA deltas over a step's packed rows, grouped by adapter slot (the shrink
// x·Aᵀ and the expand ·Bᵀ of SGMV, per row in one pass): executor/lora.py's
// kernel on every CPU.
#pragma once

#include <ATen/core/Tensor.h>  // the tensor alone: torch/types.h is several times slower to compile

namespace cbserve_fused {

// For each row t with slot s = slots[t] > 0 (int32 [T]; 0 = the base model,
// no work):
//   out[t, col0 : col0 + N] += scales[s-1] * (x[t] · At[s-1]) · Bt[s-1]
// where At [S, K, R] is A transposed and Bt [S, R, N] is B transposed, both
// float32 with R a multiple of 16 (an adapter of a smaller rank has zero
// rows past its own), and ranks[s-1] (int32 [S]) = 0 marks a slot whose
// adapter leaves this projection alone. x [T, K] and out [T, >= col0 + N]
// (rows of any stride, columns contiguous) are float32 or bfloat16 alike.
// The shrink sums over k in order and the expand over r in order, each in
// fp32; the delta is scaled, added to out and rounded once. Rows are worked
// in blocks of up to 8 of the same slot, but each row's arithmetic is its
// own: its delta is the same whatever else the step holds.
void lora_add(const at::Tensor& x, at::Tensor& out, int64_t col0, const at::Tensor& slots, const at::Tensor& at,
              const at::Tensor& bt, const at::Tensor& ranks, const at::Tensor& scales);

}  // namespace cbserve_fused
