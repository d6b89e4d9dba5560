// Portable CPU kernels (any architecture, compiled with the default flags).
#include "kernels.h"
#include "half_utils.h"

namespace {

struct V {
  using R = float;
  static constexpr int W = 1;
  static constexpr int RT_S = 4, CT_S = 4, RT_P = 4, CT_P = 4;
  static inline R zero() { return 0.f; }
  static inline R set1(float x) { return x; }
  static inline R load(const float* p) { return *p; }
  static inline void store(float* p, R x) { *p = x; }
  static inline R fma(R a, R b, R c) { return a * b + c; }
  static inline R add(R a, R b) { return a + b; }
  static inline R mul(R a, R b) { return a * b; }
  static inline R sub(R a, R b) { return a - b; }
  static inline R div(R a, R b) { return a / b; }
  static inline R max(R a, R b) { return a > b ? a : b; }
  static inline float hmax(R a) { return a; }
  static inline float hsum(R a) { return a; }
  static inline R exp(R x) { return x < -87.f ? 0.f : __builtin_expf(x); }
  static inline void to_f32(const void* src, int dtype, float* dst, int64_t n) {
    if (dtype == cbserve_native::kF32) {
      __builtin_memcpy(dst, src, n * 4);
    } else {
      for (int64_t i = 0; i < n; ++i) dst[i] = cb_load_scalar(src, i, dtype);
    }
  }
  static inline void from_f32(const float* src, int dtype, void* dst, int64_t n) {
    for (int64_t i = 0; i < n; ++i) cb_store_scalar(dst, i, dtype, src[i]);
  }
  static inline void pack_kt(const void* k, int64_t ld, int dtype, int64_t n, int64_t D, float* kt, int64_t ldkt) {
    for (int64_t t = 0; t < n; ++t)
      for (int64_t d = 0; d < D; ++d) kt[d * ldkt + t] = cb_load_scalar(k, t * ld + d, dtype);
  }
};

}  // namespace

#include "attn_body.h"

namespace cbserve_native {
bool attn_item_generic(const AttnParams& p, const AttnItem& it, const AttnItem* next, bool prefetched, float* scratch) {
  return attn_item_impl(p, it, next, prefetched, scratch);
}

void to_e5m2_generic(const void* src, int32_t dtype, uint8_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = cb_f32_to_e5m2(cb_load_scalar(src, i, dtype));
}
}  // namespace cbserve_native
