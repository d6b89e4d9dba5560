// AVX-512 (F/BW/VL/DQ) CPU kernels. Every function in this file is compiled
// with a function-level target (pragma below), not with -mavx512f for the
// build; the dispatcher (ops.cpp) only calls attn_item_avx512 after a run-time
// CPU check. No std/torch headers: nothing with external linkage is shared
// with other translation units except the entry points at the bottom.
#include "kernels.h"

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define CB_HAVE_AVX512_TU 1
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif
#include <immintrin.h>

#include "half_utils.h"

namespace {

static inline __mmask16 tail_mask(int64_t n) {
  return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u);
}

// Loads up to 16 elements (mask) of any storage dtype as fp32 (zeros elsewhere).
static inline __m512 load16(const void* p, int dtype, __mmask16 m) {
  if (dtype == cbserve_native::kF32) return _mm512_maskz_loadu_ps(m, p);
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  if (dtype == cbserve_native::kBF16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  return _mm512_cvtph_ps(h);
}

static inline void store16(void* p, int dtype, __m512 x, __mmask16 m) {
  if (dtype == cbserve_native::kF32) {
    _mm512_mask_storeu_ps(p, m, x);
  } else if (dtype == cbserve_native::kF16) {
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    // fp32 -> bf16, round to nearest even; NaN kept quiet.
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
    _mm256_mask_storeu_epi16(p, m, _mm512_cvtepi32_epi16(r));
  }
}

// In-register 16x16 fp32 transpose: r[c] <- column c.
static inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m512 u[16];
  for (int g = 0; g < 4; ++g) {
    u[4 * g + 0] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);
    u[4 * g + 1] = _mm512_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);
    u[4 * g + 2] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);
    u[4 * g + 3] = _mm512_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);
  }
  // u[4g+k] lane L holds column 4L+k of rows 4g..4g+3.
  for (int k = 0; k < 4; ++k) {
    const __m512 v0 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88);
    const __m512 w0 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
    const __m512 v1 = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xDD);
    const __m512 w1 = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xDD);
    r[0 + k] = _mm512_shuffle_f32x4(v0, w0, 0x88);
    r[8 + k] = _mm512_shuffle_f32x4(v0, w0, 0xDD);
    r[4 + k] = _mm512_shuffle_f32x4(v1, w1, 0x88);
    r[12 + k] = _mm512_shuffle_f32x4(v1, w1, 0xDD);
  }
}

struct V {
  using R = __m512;
  static constexpr int W = 16;
  // 32 zmm registers: 4x4 accumulators + 4 loads + broadcasts.
  static constexpr int RT_S = 6, CT_S = 4, RT_P = 4, CT_P = 4;
  static inline R zero() { return _mm512_setzero_ps(); }
  static inline R set1(float x) { return _mm512_set1_ps(x); }
  static inline R load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, R x) { _mm512_storeu_ps(p, x); }
  static inline R fma(R a, R b, R c) { return _mm512_fmadd_ps(a, b, c); }
  static inline R add(R a, R b) { return _mm512_add_ps(a, b); }
  static inline R mul(R a, R b) { return _mm512_mul_ps(a, b); }
  static inline R sub(R a, R b) { return _mm512_sub_ps(a, b); }
  static inline R max(R a, R b) { return _mm512_max_ps(a, b); }
  static inline float hmax(R a) { return _mm512_reduce_max_ps(a); }
  static inline float hsum(R a) { return _mm512_reduce_add_ps(a); }
  // exp(x) = 2^n * p(r), r = x - n ln2; ~1 ulp; exactly 0 below -87.
  static inline R exp(R x) {
    const R lo = _mm512_set1_ps(-87.f);
    const __mmask16 keep = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
    x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(88.f));
    const R n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    R r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    R y = _mm512_set1_ps(1.9875691500e-4f);
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
    y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
    return _mm512_maskz_mov_ps(keep, _mm512_scalef_ps(y, n));
  }
  static inline void to_f32(const void* src, int dtype, float* dst, int64_t n) {
    const int64_t es = dtype == cbserve_native::kF32 ? 4 : 2;
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = tail_mask(n - i);
      _mm512_mask_storeu_ps(dst + i, m, load16(static_cast<const char*>(src) + i * es, dtype, m));
    }
  }
  static inline void from_f32(const float* src, int dtype, void* dst, int64_t n) {
    const int64_t es = dtype == cbserve_native::kF32 ? 4 : 2;
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = tail_mask(n - i);
      store16(static_cast<char*>(dst) + i * es, dtype, _mm512_maskz_loadu_ps(m, src + i), m);
    }
  }
  // Kt[d, t] = K[t, d] (fp32), 16 tokens x 16 dims at a time.
  static inline void pack_kt(const void* k, int64_t ld, int dtype, int64_t n, int64_t D, float* kt,
                             int64_t ldkt) {
    const int64_t es = dtype == cbserve_native::kF32 ? 4 : 2;
    const char* kb = static_cast<const char*>(k);
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int64_t tn = n - t0 < 16 ? n - t0 : 16;
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        const int64_t dn = D - d0 < 16 ? D - d0 : 16;
        const __mmask16 m = tail_mask(dn);
        __m512 r[16];
        for (int64_t t = 0; t < 16; ++t)
          r[t] = t < tn ? load16(kb + ((t0 + t) * ld + d0) * es, dtype, m) : _mm512_setzero_ps();
        transpose16(r);
        const __mmask16 tm = tail_mask(tn);
        for (int64_t d = 0; d < dn; ++d) _mm512_mask_storeu_ps(kt + (d0 + d) * ldkt + t0, tm, r[d]);
      }
    }
  }
};

}  // namespace

#include "attn_body.h"

namespace cbserve_native {
void attn_item_avx512(const AttnParams& p, const AttnItem& it, float* scratch) {
  attn_item_impl(p, it, scratch);
}
}  // namespace cbserve_native

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // x86-64

namespace cbserve_native {
#ifdef CB_HAVE_AVX512_TU
bool have_avx512_kernels() { return true; }
#else
bool have_avx512_kernels() { return false; }
void attn_item_avx512(const AttnParams&, const AttnItem&, float*) {}
#endif
}  // namespace cbserve_native
