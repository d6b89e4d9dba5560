// Argument checks shared by the native linear layers (amx_linear.cpp,
// avx512_linear.cpp).
#pragma once

#include <c10/util/BFloat16.h>
#include <torch/extension.h>

#include <cstdint>

namespace cbserve_fused {

// The raw bf16 data of an optional bias of n_out features (nullptr without one).
inline const uint16_t* bf16_bias(const c10::optional<torch::Tensor>& bias, int64_t n_out) {
  if (!bias.has_value() || !bias->defined()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->dim() == 1 &&
                  bias->size(0) == n_out,
              "bias must be a contiguous bf16 [N] tensor (N = output features)");
  return reinterpret_cast<const uint16_t*>(bias->data_ptr<c10::BFloat16>());
}

}  // namespace cbserve_fused
