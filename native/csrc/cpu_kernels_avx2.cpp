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
#include "kv_prefetch.h"

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

// ------------------------------------------------- decode group kernels ---
// The decode path's score and P.V loops (attn_body.h, CB_DEC_SCORES /
// CB_DEC_PV) with their accumulators in registers: the portable ones chain
// one token's dot product through a single accumulator and a horizontal sum,
// and add each token's P.V into the output row in memory. fp32 rows of a
// head_dim that is a multiple of 8 are read in place; other dtypes and head
// dims are staged in fp32 in `tmp` first (its [D, DP) columns are zero).

// Eight vectors -> one vector of their eight horizontal sums, in order.
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
  const __m256 q0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 q1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(q0, q1, 0x20), _mm256_permute2f128_ps(q0, q1, 0x31));
}

// fp32 pointers to tokens [0, n)'s rows (n <= 16) and the columns to sweep:
// in place for fp32 with D % 8 == 0 (the query and output rows are zero past
// D), else staged in tmp [16, DP].
static inline int64_t dec_rows(const char* base, const int64_t* offs, int64_t n, int dtype, int64_t D, float* tmp,
                               KvPrefetch& pf, const float** rows) {
  const int64_t es = cbserve_native::elem_size(dtype);
  const int64_t DP = cbserve_native::round_up(D, cbserve_native::kPad);
  const bool in_place = dtype == cbserve_native::kF32 && D % 8 == 0;
  for (int64_t t = 0; t < n; ++t) {
    pf.step();
    if (in_place) {
      rows[t] = reinterpret_cast<const float*>(base + offs[t] * es);
    } else {
      V::to_f32(base + offs[t] * es, dtype, tmp + t * DP, D);
      rows[t] = tmp + t * DP;
    }
  }
  return in_place ? D : DP;
}

// S[r*lds + t] = Q[r] . K_t for r < M, t < n <= 16: eight tokens at a time,
// each with its own accumulator, reduced by one hsum8.
static inline void dec_scores_avx2(const float* Q, int64_t ldq, int64_t M, const char* base, const int64_t* offs,
                                   int64_t n, int dtype, int64_t D, float* S, int64_t lds, float* tmp, KvPrefetch& pf,
                                   bool qbf16) {
  (void)qbf16;
  const float* rows[16];
  const int64_t cols = dec_rows(base, offs, n, dtype, D, tmp, pf, rows);
  for (int64_t t0 = 0; t0 < n; t0 += 8) {
    const float* k[8];
    for (int i = 0; i < 8; ++i) k[i] = rows[t0 + i < n ? t0 + i : n - 1];  // lanes >= n are not stored
    for (int64_t r = 0; r < M; ++r) {
      const float* q = Q + r * ldq;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
      for (int64_t d = 0; d < cols; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + d), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[4] + d), a4);
        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[5] + d), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[6] + d), a6);
        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[7] + d), a7);
      }
      const __m256 sums = hsum8(a0, a1, a2, a3, a4, a5, a6, a7);
      if (n - t0 >= 8) {
        _mm256_storeu_ps(S + r * lds + t0, sums);
      } else {
        alignas(32) float b[8];
        _mm256_store_ps(b, sums);
        for (int64_t i = 0; i < n - t0; ++i) S[r * lds + t0 + i] = b[i];
      }
    }
  }
}

// a[0, 8 NV) += sum_{t < n} p[t] * rows[t][0, 8 NV), the NV accumulators in
// registers; tokens of zero weight are skipped, as the portable loop skips
// them (the sums' order is the same: token by token).
template <int NV>
static inline void pv_span(const float* p, int64_t n, const float* const* rows, int64_t d0, float* a) {
  __m256 acc[NV];
#pragma GCC unroll 8
  for (int j = 0; j < NV; ++j) acc[j] = _mm256_loadu_ps(a + 8 * j);
  for (int64_t t = 0; t < n; ++t) {
    if (p[t] == 0.f) continue;
    const __m256 pv = _mm256_set1_ps(p[t]);
    const float* v = rows[t] + d0;
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[j] = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + 8 * j), acc[j]);
  }
#pragma GCC unroll 8
  for (int j = 0; j < NV; ++j) _mm256_storeu_ps(a + 8 * j, acc[j]);
}

// A[r*lda + d] += sum_t P[r*ldp + t] * V_t[d] for r < M, t < n: sixteen
// tokens' V rows at a time, 64 output columns of a row per pass.
static inline void dec_pv_avx2(const float* P, int64_t ldp, int64_t M, const char* base, const int64_t* offs, int64_t n,
                               int dtype, int64_t D, float* A, int64_t lda, float* tmp, KvPrefetch& pf) {
  for (int64_t t0 = 0; t0 < n; t0 += 16) {
    const int64_t tn = n - t0 < 16 ? n - t0 : 16;
    const float* rows[16];
    const int64_t cols = dec_rows(base, offs + t0, tn, dtype, D, tmp, pf, rows);
    for (int64_t r = 0; r < M; ++r) {
      const float* pr = P + r * ldp + t0;
      float* a = A + r * lda;
      for (int64_t d0 = 0; d0 < cols; d0 += 64) {
        switch ((cols - d0) / 8 < 8 ? (cols - d0) / 8 : 8) {
          case 1: pv_span<1>(pr, tn, rows, d0, a + d0); break;
          case 2: pv_span<2>(pr, tn, rows, d0, a + d0); break;
          case 3: pv_span<3>(pr, tn, rows, d0, a + d0); break;
          case 4: pv_span<4>(pr, tn, rows, d0, a + d0); break;
          case 5: pv_span<5>(pr, tn, rows, d0, a + d0); break;
          case 6: pv_span<6>(pr, tn, rows, d0, a + d0); break;
          case 7: pv_span<7>(pr, tn, rows, d0, a + d0); break;
          default: pv_span<8>(pr, tn, rows, d0, a + d0); break;
        }
      }
    }
  }
}

#define CB_DEC_SCORES dec_scores_avx2
#define CB_DEC_PV dec_pv_avx2

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
