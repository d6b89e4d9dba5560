// Argument checks shared by the native linear layers (amx_linear.cpp,
// avx512_linear.cpp, avx2_f32_linear.cpp).
#pragma once

#include <c10/util/BFloat16.h>
#include <ATen/core/Tensor.h>  // the tensor alone: torch/types.h is several times slower to compile

#include <cstdint>

namespace cbserve_fused {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The raw bf16 data of an optional bias of n_out features (nullptr without one).
inline const uint16_t* bf16_bias(const c10::optional<at::Tensor>& bias, int64_t n_out) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(
      bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->dim() == 1 && bias->size(0) == n_out,
      "bias must be a contiguous bf16 [N] tensor (N = output features)");
  return reinterpret_cast<const uint16_t*>(bias->data_ptr<c10::BFloat16>());
}

// The fp32 data of an optional bias of n_out features (nullptr without one).
inline const float* f32_bias(const c10::optional<at::Tensor>& bias, int64_t n_out) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->dim() == 1 && bias->size(0) == n_out,
              "bias must be a contiguous fp32 [N] tensor (N = output features)");
  return bias->data_ptr<float>();
}

// The fp32 bias of a layer computed in fp32 (avx2_f32_linear, gguf_linear):
// an fp32 bias as it is, a bf16 one (bf16 layers) widened exactly into
// `widened`, added before the output's rounding; nullptr without one.
inline const float* fp32_arith_bias(const c10::optional<at::Tensor>& bias, int64_t n_out, bool bf16,
                                    at::Tensor& widened) {
  if (!bf16) return f32_bias(bias, n_out);
  if (bf16_bias(bias, n_out) == nullptr) return nullptr;
  widened = bias->to(at::kFloat);
  return widened.data_ptr<float>();
}

// Checks that `packed` holds amx_pack_weight's (or amx_pack_gate_up's) bf16
// tiles of an [n_features, k] weight: [ceil(N/16), ceil(K/32), 16, 16, 2].
inline void check_bf16_tiles(const at::Tensor& packed, int64_t n_features, int64_t k) {
  TORCH_CHECK(packed.dim() == 5 && packed.size(0) == (n_features + 15) / 16 && packed.size(1) == (k + 31) / 32 &&
                  packed.size(2) == 16 && packed.size(3) == 16 && packed.size(4) == 2,
              "packed must come from amx_pack_weight (or amx_pack_gate_up) of a weight with x's K and ", n_features,
              " output features");
}

}  // namespace cbserve_fused
