// AVX2 + FMA + F16C CPU kernels. Every function in this file is compiled with
// a function-level target (pragma below), not with -mavx2 for the build; the
// dispatcher (ops.cpp) only calls attn_item_avx2 after a run-time CPU check.
// No std/torch headers: nothing with external linkage is shared with other
// translation units except the entry points at the bottom.
#include "kernels.h"

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define CB_HAVE_AVX2_TU 1
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
#include <immintrin.h>

#include "avx2_exp.h"
#include "half_utils.h"

namespace {

struct V {
  using R = __m256;
  static constexpr int W = 8;
  // 16 ymm registers: 4x2 accumulators + loads.
  static constexpr int RT_S = 4, CT_S = 2, RT_P = 4, CT_P = 2;
  static inline R zero() { return _mm256_setzero_ps(); }
  static inline R set1(float x) { return _mm256_set1_ps(x); }
  static inline R load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, R x) { _mm256_storeu_ps(p, x); }
  static inline R fma(R a, R b, R c) { return _mm256_fmadd_ps(a, b, c); }
  static inline R add(R a, R b) { return _mm256_add_ps(a, b); }
  static inline R mul(R a, R b) { return _mm256_mul_ps(a, b); }
  static inline R sub(R a, R b) { return _mm256_sub_ps(a, b); }
  static inline R div(R a, R b) { return _mm256_div_ps(a, b); }
  static inline R max(R a, R b) { return _mm256_max_ps(a, b); }
  static inline float hmax(R a) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
  }
  static inline float hsum(R a) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_shuffle_ps(x, x, 1));
    return _mm_cvtss_f32(x);
  }
  static inline R exp(R x) { return cb_exp_avx2(x); }  // ~1 ulp; 0 below -87
  static inline R load_bf16(const uint16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static inline R load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static inline void to_f32(const void* src, int dtype, float* dst, int64_t n) {
    int64_t i = 0;
    if (dtype == cbserve_native::kF32) {
      const float* s = static_cast<const float*>(src);
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, _mm256_loadu_ps(s + i));
    } else if (dtype == cbserve_native::kBF16) {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_bf16(s + i));
    } else if (dtype == cbserve_native::kF16) {
      const uint16_t* s = static_cast<const uint16_t*>(src);
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load_f16(s + i));
    } else {  // fp8 e5m2: each byte is the upper half of an fp16
      const uint8_t* s = static_cast<const uint8_t*>(src);
      for (; i + 8 <= n; i += 8) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + i));
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(b), 8)));
      }
    }
    for (; i < n; ++i) dst[i] = cb_load_scalar(src, i, dtype);
  }
  static inline void from_f32(const float* src, int dtype, void* dst, int64_t n) {
    int64_t i = 0;
    if (dtype == cbserve_native::kF32) {
      float* d = static_cast<float*>(dst);
      for (; i + 8 <= n; i += 8) _mm256_storeu_ps(d + i, _mm256_loadu_ps(src + i));
    } else if (dtype == cbserve_native::kF16) {
      uint16_t* d = static_cast<uint16_t*>(dst);
      for (; i + 8 <= n; i += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(d + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    }
    for (; i < n; ++i) cb_store_scalar(dst, i, dtype, src[i]);
  }
  static inline void pack_kt(const void* k, int64_t ld, int dtype, int64_t n, int64_t D, float* kt, int64_t ldkt) {
    const int64_t es = cbserve_native::elem_size(dtype);
    alignas(32) float row[1024];
    for (int64_t d0 = 0; d0 < D; d0 += 1024) {
      const int64_t dn = D - d0 < 1024 ? D - d0 : 1024;
      for (int64_t t = 0; t < n; ++t) {
        to_f32(static_cast<const char*>(k) + (t * ld + d0) * es, dtype, row, dn);
        for (int64_t d = 0; d < dn; ++d) kt[(d0 + d) * ldkt + t] = row[d];
      }
    }
  }
};

}  // namespace

#include "attn_body.h"

namespace cbserve_native {
bool attn_item_avx2(const AttnParams& p, const AttnItem& it, const AttnItem* next, bool prefetched, float* scratch) {
  return attn_item_impl(p, it, next, prefetched, scratch);
}
}  // namespace cbserve_native

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // x86-64

namespace cbserve_native {
#ifdef CB_HAVE_AVX2_TU
bool have_avx2_kernels() { return true; }
#else
bool have_avx2_kernels() { return false; }
bool attn_item_avx2(const AttnParams&, const AttnItem&, const AttnItem*, bool, float*) { return false; }
#endif
}  // namespace cbserve_native
