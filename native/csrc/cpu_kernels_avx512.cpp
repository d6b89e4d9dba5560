// AVX-512 (F/BW/VL/DQ) CPU kernels. Every function in this file is compiled
// with a function-level target (pragma below), not with -mavx512f for the
// build; the dispatcher (ops.cpp) only calls attn_item_avx512 after a run-time
// CPU check. No std/torch headers: nothing with external linkage is shared
// with other translation units except the entry points at the bottom.
#include "kernels.h"

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define CB_HAVE_AVX512_TU 1
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#endif
#include <immintrin.h>

#include "avx512_hsum.h"
#include "half_utils.h"
#include "kv_prefetch.h"

namespace {

static inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? __mmask16(0xffff) : __mmask16((1u << n) - 1u); }

// 16 fp8 e5m2 bytes (each the upper byte of an fp16) as fp32: exact.
static inline __m512 e5m2x16_to_ps(__m128i b) { return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8)); }

// Loads up to 16 elements (mask) of any storage dtype as fp32 (zeros elsewhere).
static inline __m512 load16(const void* p, int dtype, __mmask16 m) {
  if (dtype == cbserve_native::kF32) return _mm512_maskz_loadu_ps(m, p);
  if (dtype == cbserve_native::kFP8E5M2) return e5m2x16_to_ps(_mm_maskz_loadu_epi8(m, p));
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  if (dtype == cbserve_native::kBF16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
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
  static inline R div(R a, R b) { return _mm512_div_ps(a, b); }
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
    const int64_t es = cbserve_native::elem_size(dtype);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = tail_mask(n - i);
      _mm512_mask_storeu_ps(dst + i, m, load16(static_cast<const char*>(src) + i * es, dtype, m));
    }
  }
  static inline void from_f32(const float* src, int dtype, void* dst, int64_t n) {
    const int64_t es = cbserve_native::elem_size(dtype);
    for (int64_t i = 0; i < n; i += 16) {
      const __mmask16 m = tail_mask(n - i);
      store16(static_cast<char*>(dst) + i * es, dtype, _mm512_maskz_loadu_ps(m, src + i), m);
    }
  }
  // Kt[d, t] = K[t, d] (fp32), 16 tokens x 16 dims at a time.
  static inline void pack_kt(const void* k, int64_t ld, int dtype, int64_t n, int64_t D, float* kt, int64_t ldkt) {
    const int64_t es = cbserve_native::elem_size(dtype);
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

// ------------------------------------------------- decode group kernels ---
template <int DT>
static inline __m512 load16t(const char* p, __mmask16 m) {
  return load16(p, DT, m);
}

// Bytes per element of storage dtype DT.
template <int DT>
constexpr int64_t esz() {
  return DT == cbserve_native::kF32 ? 4 : DT == cbserve_native::kFP8E5M2 ? 1 : 2;
}

// 32 consecutive elements (masked) as two fp32 vectors. bf16: lanes hold the
// even / odd elements (a shift and an AND of one load); fp32/fp16/fp8: the
// low and high 16. The query is permuted the same way, so dot products match.
template <int DT>
static inline void load32t(const char* p, __mmask32 m, __m512& x0, __m512& x1) {
  if constexpr (DT == cbserve_native::kBF16) {
    const __m512i raw = _mm512_maskz_loadu_epi16(m, p);
    x0 = _mm512_castsi512_ps(_mm512_slli_epi32(raw, 16));
    x1 = _mm512_castsi512_ps(_mm512_and_si512(raw, _mm512_set1_epi32(int(0xffff0000u))));
  } else if constexpr (DT == cbserve_native::kFP8E5M2) {
    const __m256i raw = _mm256_maskz_loadu_epi8(m, p);
    x0 = e5m2x16_to_ps(_mm256_castsi256_si128(raw));
    x1 = e5m2x16_to_ps(_mm256_extracti128_si256(raw, 1));
  } else {
    constexpr int64_t es = DT == cbserve_native::kF32 ? 4 : 2;
    x0 = load16(p, DT, __mmask16(m));
    x1 = load16(p + 16 * es, DT, __mmask16(m >> 16));
  }
}

// Up to 32 fp32 values (`left` of them valid, zeros after) in the same layout
// as load32t gives the storage dtype DT: for bf16 the even / odd elements,
// else the low and high 16.
template <int DT>
static inline void load32f(const float* p, int64_t left, __m512& x0, __m512& x1) {
  const __m512 lo = _mm512_maskz_loadu_ps(tail_mask(left), p);
  const __m512 hi = left > 16 ? _mm512_maskz_loadu_ps(tail_mask(left - 16), p + 16) : _mm512_setzero_ps();
  if constexpr (DT == cbserve_native::kBF16) {
    const __m512i ev = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    x0 = _mm512_permutex2var_ps(lo, ev, hi);
    x1 = _mm512_permutex2var_ps(lo, _mm512_add_epi32(ev, _mm512_set1_epi32(1)), hi);
  } else {
    x0 = lo;
    x1 = hi;
  }
}

// RS query rows x up to 16 tokens: each K row is loaded and converted once
// (in registers), dotted with the RS query rows (qb: [RS][2*NP] vectors in
// the load32t layout), and the per-token partial-sum vectors are reduced by
// transpose-add trees, 4 tokens at a time.
template <int NP, int DT, int RS, class PF>
static inline void dec_scores_rows(const float* qb, const char* base, const int64_t* offs, int64_t n,
                                   const __mmask32* m, float* S, int64_t lds, PF& pf) {
  constexpr int64_t es = esz<DT>();
  constexpr int NV = 2 * NP;
  __m512 c[RS][4];
  for (int j = 0; j < 4; ++j) {
    __m512 a[RS][4];
    for (int i = 0; i < 4; ++i) {
      const int64_t t = 4 * j + i < n ? 4 * j + i : n - 1;  // lanes >= n are not stored
      if (4 * j + i < n) pf.step();
      const char* k = base + offs[t] * es;
      __m512 x[NV];
      for (int pc = 0; pc < NP; ++pc) load32t<DT>(k + pc * 32 * es, m[pc], x[2 * pc], x[2 * pc + 1]);
      for (int r = 0; r < RS; ++r) {
        __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qb + r * NV * 16), x[0]);
        for (int v = 1; v < NV; ++v) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qb + (r * NV + v) * 16), x[v], acc);
        a[r][i] = acc;
      }
    }
    for (int r = 0; r < RS; ++r) c[r][j] = hsum4_lanes(a[r][0], a[r][1], a[r][2], a[r][3]);
  }
  const __mmask16 sm = tail_mask(n);
  for (int r = 0; r < RS; ++r) _mm512_mask_storeu_ps(S + r * lds, sm, hsum_quads(c[r][0], c[r][1], c[r][2], c[r][3]));
}

// dec_scores_rows for head_dim 33-64 (two 32-element pairs) with named
// variables instead of arrays, for the reason given at dec_pv_rows2p.
static inline __m512 dot2p(const float* q, __m512 x0, __m512 x1, __m512 x2, __m512 x3) {
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), x0);
  acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16), x1, acc);
  acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + 32), x2, acc);
  return _mm512_fmadd_ps(_mm512_loadu_ps(q + 48), x3, acc);
}

// One token's dot products with the RS query rows (qb: [RS][64] in the
// load32t layout). Always inlined: called as a function, its reference
// outputs put the caller's named accumulators back in memory.
template <int DT, int RS>
__attribute__((always_inline)) static inline void scores_token2p(const float* qb, const char* k, const __mmask32* m,
                                                                 __m512& s0, __m512& s1, __m512& s2) {
  constexpr int64_t es = esz<DT>();
  __m512 x0, x1, x2, x3;
  load32t<DT>(k, m[0], x0, x1);
  load32t<DT>(k + 32 * es, m[1], x2, x3);
  s0 = dot2p(qb, x0, x1, x2, x3);
  if constexpr (RS > 1) s1 = dot2p(qb + 64, x0, x1, x2, x3);
  if constexpr (RS > 2) s2 = dot2p(qb + 128, x0, x1, x2, x3);
}

// Tokens 4j .. 4j + 3 (clamped to n - 1; those lanes are not stored), each
// row's four dot-product vectors reduced to one (hsum4_lanes).
template <int DT, int RS, class PF>
__attribute__((always_inline)) static inline void scores_quad2p(const float* qb, const char* base, const int64_t* offs,
                                                                int64_t n, int j, const __mmask32* m, PF& pf,
                                                                __m512& c0, __m512& c1, __m512& c2) {
  constexpr int64_t es = esz<DT>();
  const __m512 z = _mm512_setzero_ps();
  __m512 a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z, a20 = z, a21 = z, a22 = z, a23 = z;
  const int64_t t0 = 4 * j;
  auto tok = [&](int64_t t) {
    if (t < n) pf.step();
    return base + offs[t < n ? t : n - 1] * es;
  };
  scores_token2p<DT, RS>(qb, tok(t0), m, a00, a10, a20);
  scores_token2p<DT, RS>(qb, tok(t0 + 1), m, a01, a11, a21);
  scores_token2p<DT, RS>(qb, tok(t0 + 2), m, a02, a12, a22);
  scores_token2p<DT, RS>(qb, tok(t0 + 3), m, a03, a13, a23);
  c0 = hsum4_lanes(a00, a01, a02, a03);
  if constexpr (RS > 1) c1 = hsum4_lanes(a10, a11, a12, a13);
  if constexpr (RS > 2) c2 = hsum4_lanes(a20, a21, a22, a23);
}

template <int DT, int RS, class PF>
static inline void dec_scores_rows2p(const float* qb, const char* base, const int64_t* offs, int64_t n,
                                     const __mmask32* m, float* S, int64_t lds, PF& pf) {
  static_assert(RS >= 1 && RS <= 3, "rows");
  const __m512 z = _mm512_setzero_ps();
  __m512 c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z, c20 = z, c21 = z, c22 = z, c23 = z;
  scores_quad2p<DT, RS>(qb, base, offs, n, 0, m, pf, c00, c10, c20);
  scores_quad2p<DT, RS>(qb, base, offs, n, 1, m, pf, c01, c11, c21);
  scores_quad2p<DT, RS>(qb, base, offs, n, 2, m, pf, c02, c12, c22);
  scores_quad2p<DT, RS>(qb, base, offs, n, 3, m, pf, c03, c13, c23);
  const __mmask16 sm = tail_mask(n);
  _mm512_mask_storeu_ps(S, sm, hsum_quads(c00, c01, c02, c03));
  if constexpr (RS > 1) _mm512_mask_storeu_ps(S + lds, sm, hsum_quads(c10, c11, c12, c13));
  if constexpr (RS > 2) _mm512_mask_storeu_ps(S + 2 * lds, sm, hsum_quads(c20, c21, c22, c23));
}

// The same scores for a bf16 cache and head_dim 33-64 on AVX512-BF16 CPUs:
// each token's K row is used as loaded (no widening to fp32, no even / odd
// split) in two vdpbf16ps a query row, against the scaled query rows as bf16
// (qv: two 32-element vectors a row, natural order); the same transpose-add
// trees then reduce each row's lanes (a lane holds the sum of two products).
// Taken only where the scaled query rows are exact in bf16 (qbf16, see
// AttnParams::bf16_decode_dots: bf16 queries and a power-of-two scale such as
// head_dim 64's 1/8): the products are then the fp32 path's, exact in fp32
// (denormals aside, which vdpbf16ps flushes), and only the order of the fp32
// additions differs. Per token and KV head of SmolLM2 (3 query rows) 6
// vdpbf16ps replace 12 FMAs and the K row's widening (docs/native.md).
#define CB_DEC_DP __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,avx512bf16")))

template <int RS>
CB_DEC_DP __attribute__((always_inline)) static inline void scores_token_dp(const __m512bh* qv, const char* k,
                                                                            const __mmask32* m, __m512& s0, __m512& s1,
                                                                            __m512& s2) {
  const __m512bh k0 = (__m512bh)_mm512_maskz_loadu_epi16(m[0], k);
  const __m512bh k1 = (__m512bh)_mm512_maskz_loadu_epi16(m[1], k + 64);
  const __m512 z = _mm512_setzero_ps();
  s0 = _mm512_dpbf16_ps(_mm512_dpbf16_ps(z, k0, qv[0]), k1, qv[1]);
  if constexpr (RS > 1) s1 = _mm512_dpbf16_ps(_mm512_dpbf16_ps(z, k0, qv[2]), k1, qv[3]);
  if constexpr (RS > 2) s2 = _mm512_dpbf16_ps(_mm512_dpbf16_ps(z, k0, qv[4]), k1, qv[5]);
}

template <int RS, class PF>
CB_DEC_DP __attribute__((always_inline)) static inline void scores_quad_dp(const __m512bh* qv, const char* base,
                                                                           const int64_t* offs, int64_t n, int j,
                                                                           const __mmask32* m, PF& pf, __m512& c0,
                                                                           __m512& c1, __m512& c2) {
  const __m512 z = _mm512_setzero_ps();
  __m512 a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z, a20 = z, a21 = z, a22 = z, a23 = z;
  const int64_t t0 = 4 * j;
  auto tok = [&](int64_t t) {
    if (t < n) pf.step();
    return base + offs[t < n ? t : n - 1] * 2;
  };
  scores_token_dp<RS>(qv, tok(t0), m, a00, a10, a20);
  scores_token_dp<RS>(qv, tok(t0 + 1), m, a01, a11, a21);
  scores_token_dp<RS>(qv, tok(t0 + 2), m, a02, a12, a22);
  scores_token_dp<RS>(qv, tok(t0 + 3), m, a03, a13, a23);
  c0 = hsum4_lanes(a00, a01, a02, a03);
  if constexpr (RS > 1) c1 = hsum4_lanes(a10, a11, a12, a13);
  if constexpr (RS > 2) c2 = hsum4_lanes(a20, a21, a22, a23);
}

template <int RS, class PF>
CB_DEC_DP static inline void dec_scores_rows_dp(const __m512bh* qv, const char* base, const int64_t* offs, int64_t n,
                                                const __mmask32* m, float* S, int64_t lds, PF& pf) {
  const __m512 z = _mm512_setzero_ps();
  __m512 c00 = z, c01 = z, c02 = z, c03 = z, c10 = z, c11 = z, c12 = z, c13 = z, c20 = z, c21 = z, c22 = z, c23 = z;
  scores_quad_dp<RS>(qv, base, offs, n, 0, m, pf, c00, c10, c20);
  scores_quad_dp<RS>(qv, base, offs, n, 1, m, pf, c01, c11, c21);
  scores_quad_dp<RS>(qv, base, offs, n, 2, m, pf, c02, c12, c22);
  scores_quad_dp<RS>(qv, base, offs, n, 3, m, pf, c03, c13, c23);
  const __mmask16 sm = tail_mask(n);
  _mm512_mask_storeu_ps(S, sm, hsum_quads(c00, c01, c02, c03));
  if constexpr (RS > 1) _mm512_mask_storeu_ps(S + lds, sm, hsum_quads(c10, c11, c12, c13));
  if constexpr (RS > 2) _mm512_mask_storeu_ps(S + 2 * lds, sm, hsum_quads(c20, c21, c22, c23));
}

// One pass of dec_scores_dp over the first min(3, rows) query rows.
template <class PF>
CB_DEC_DP static inline void dec_scores_pass_dp(const __m512bh* qv, int64_t rows, const char* base, const int64_t* offs,
                                                int64_t n, const __mmask32* m, float* S, int64_t lds, PF& pf) {
  if (rows >= 3)
    dec_scores_rows_dp<3>(qv, base, offs, n, m, S, lds, pf);
  else if (rows == 2)
    dec_scores_rows_dp<2>(qv, base, offs, n, m, S, lds, pf);
  else
    dec_scores_rows_dp<1>(qv, base, offs, n, m, S, lds, pf);
}

CB_DEC_DP static void dec_scores_dp(const float* Q, int64_t ldq, int64_t M, const char* base, const int64_t* offs,
                                    int64_t n, int64_t D, const __mmask32* m, float* S, int64_t lds, KvPrefetch& pf) {
  __m512bh qv[2 * cbserve_native::kDecodeRowsCap];
  for (int64_t r = 0; r < M; ++r) {
    const float* q = Q + r * ldq;
    __m512 x[4];
    for (int c = 0; c < 4; ++c)
      x[c] = 16 * c < D ? _mm512_maskz_loadu_ps(tail_mask(D - 16 * c), q + 16 * c) : _mm512_setzero_ps();
    qv[2 * r] = _mm512_cvtne2ps_pbh(x[1], x[0]);
    qv[2 * r + 1] = _mm512_cvtne2ps_pbh(x[3], x[2]);
  }
  NoPrefetch none;  // only the first pass steps the item's prefetcher
  for (int64_t r0 = 0; r0 < M; r0 += 3) {
    const __m512bh* q = qv + 2 * r0;
    float* s = S + r0 * lds;
    if (r0 == 0)
      dec_scores_pass_dp(q, M - r0, base, offs, n, m, s, lds, pf);
    else
      dec_scores_pass_dp(q, M - r0, base, offs, n, m, s, lds, none);
  }
}

// The next pass of dec_scores_k over the first of `rows` query rows (qb in
// the load32t layout); returns how many it took.
template <int NP, int DT, class PF>
static inline int64_t dec_scores_pass(const float* qb, int64_t rows, const char* base, const int64_t* offs, int64_t n,
                                      const __mmask32* m, float* S, int64_t lds, PF& pf) {
  if constexpr (NP == 2) {
    if (rows >= 3) return dec_scores_rows2p<DT, 3>(qb, base, offs, n, m, S, lds, pf), 3;
    if (rows == 2) return dec_scores_rows2p<DT, 2>(qb, base, offs, n, m, S, lds, pf), 2;
    return dec_scores_rows2p<DT, 1>(qb, base, offs, n, m, S, lds, pf), 1;
  } else {
    constexpr int RS = NP <= 2 ? 3 : 2;
    if (rows >= RS) return dec_scores_rows<NP, DT, RS>(qb, base, offs, n, m, S, lds, pf), RS;
    if (RS > 2 && rows == 2) return dec_scores_rows<NP, DT, 2>(qb, base, offs, n, m, S, lds, pf), 2;
    return dec_scores_rows<NP, DT, 1>(qb, base, offs, n, m, S, lds, pf), 1;
  }
}

// Dispatch shim: NC = 16-lane chunks of D, NP = 32-element pairs.
template <int NC, int DT>
static void dec_scores_k(const float* Q, int64_t ldq, int64_t M, const char* base, const int64_t* offs, int64_t n,
                         int64_t D, float* S, int64_t lds, KvPrefetch& pf, bool qbf16) {
  constexpr int NP = (NC + 1) / 2, NV = 2 * NP;
  __mmask32 m[NP];
  for (int pc = 0; pc < NP; ++pc) {
    const int64_t left = D - pc * 32;
    m[pc] = left >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << left) - 1u);
  }
  if constexpr (NP == 2 && DT == cbserve_native::kBF16) {
    if (qbf16) {
      dec_scores_dp(Q, ldq, M, base, offs, n, D, m, S, lds, pf);
      return;
    }
  }
  // Query rows in the load32t layout (zero beyond D).
  alignas(64) float qb[16 * NV * 16];
  for (int64_t r = 0; r < M; ++r) {
    for (int pc = 0; pc < NP; ++pc) {
      __m512 x0, x1;
      load32f<DT>(Q + r * ldq + pc * 32, D - pc * 32, x0, x1);
      float* dst = qb + (r * NV + 2 * pc) * 16;
      _mm512_store_ps(dst, x0);
      _mm512_store_ps(dst + 16, x1);
    }
  }
  NoPrefetch none;  // only the first pass steps the item's prefetcher
  for (int64_t r0 = 0; r0 < M;) {
    const float* q = qb + r0 * NV * 16;
    float* s = S + r0 * lds;
    const int64_t rows = r0 == 0 ? dec_scores_pass<NP, DT>(q, M - r0, base, offs, n, m, s, lds, pf)
                                 : dec_scores_pass<NP, DT>(q, M - r0, base, offs, n, m, s, lds, none);
    r0 += rows;
  }
}

// A[r] += sum_t P[r*ldp + t] * V_t over a whole chunk of tokens: V rows are
// converted on the fly (load32t layout), RT rows x 2*NP vectors of
// accumulators stay in registers; A (natural layout, D columns) is read and
// written once.
template <int NP, int DT, int RT, class PF>
static inline void dec_pv_rows(const float* P, int64_t ldp, const char* base, const int64_t* offs, int64_t n, int64_t D,
                               const __mmask32* m, float* A, int64_t lda, PF& pf) {
  constexpr int64_t es = esz<DT>();
  constexpr int NV = 2 * NP;
  const __m512i il = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i ih = _mm512_add_epi32(il, _mm512_set1_epi32(8));
  __m512 acc[RT][NV];
  for (int r = 0; r < RT; ++r)
    for (int pc = 0; pc < NP; ++pc) load32f<DT>(A + r * lda + pc * 32, D - pc * 32, acc[r][2 * pc], acc[r][2 * pc + 1]);
  for (int64_t t = 0; t < n; ++t) {
    pf.step();
    const char* v = base + offs[t] * es;
    __m512 x[NV];
    for (int pc = 0; pc < NP; ++pc) load32t<DT>(v + pc * 32 * es, m[pc], x[2 * pc], x[2 * pc + 1]);
    for (int r = 0; r < RT; ++r) {
      const __m512 pr = _mm512_set1_ps(P[r * ldp + t]);
      for (int c = 0; c < NV; ++c) acc[r][c] = _mm512_fmadd_ps(pr, x[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RT; ++r) {
    for (int pc = 0; pc < NP; ++pc) {
      float* a = A + r * lda + pc * 32;
      __m512 lo = acc[r][2 * pc], hi = acc[r][2 * pc + 1];
      if constexpr (DT == cbserve_native::kBF16) {
        lo = _mm512_permutex2var_ps(acc[r][2 * pc], il, acc[r][2 * pc + 1]);
        hi = _mm512_permutex2var_ps(acc[r][2 * pc], ih, acc[r][2 * pc + 1]);
      }
      _mm512_mask_storeu_ps(a, tail_mask(D - pc * 32), lo);
      if (D - pc * 32 > 16) _mm512_mask_storeu_ps(a + 16, tail_mask(D - pc * 32 - 16), hi);
    }
  }
}

// dec_pv_rows for head_dim 33-64 (two 32-element pairs), with every
// accumulator a named variable. GCC keeps dec_pv_rows' acc[RT][NV] array in
// registers inside the token loop but also stores all of it back to the
// stack on every token (12 512-bit stores a token for 3 rows: on Zen 4,
// where each is two 256-bit stores, about as much time as the FMAs).
template <int DT>
static inline void pv_row_load(const float* a, int64_t D, __m512& v0, __m512& v1, __m512& v2, __m512& v3) {
  load32f<DT>(a, D, v0, v1);
  load32f<DT>(a + 32, D - 32, v2, v3);
}

template <int DT>
static inline void pv_row_store(float* a, int64_t D, __m512 v0, __m512 v1, __m512 v2, __m512 v3) {
  if constexpr (DT == cbserve_native::kBF16) {  // back from the even / odd layout
    const __m512i il = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const __m512i ih = _mm512_add_epi32(il, _mm512_set1_epi32(8));
    const __m512 l0 = _mm512_permutex2var_ps(v0, il, v1), h0 = _mm512_permutex2var_ps(v0, ih, v1);
    const __m512 l1 = _mm512_permutex2var_ps(v2, il, v3), h1 = _mm512_permutex2var_ps(v2, ih, v3);
    v0 = l0, v1 = h0, v2 = l1, v3 = h1;
  }
  _mm512_storeu_ps(a, v0);
  _mm512_storeu_ps(a + 16, v1);
  _mm512_mask_storeu_ps(a + 32, tail_mask(D - 32), v2);
  if (D > 48) _mm512_mask_storeu_ps(a + 48, tail_mask(D - 48), v3);
}

// One row's four accumulators += p * the token's V row (x0..x3).
#define CB_PV_ROW(R, i)                                                       \
  if constexpr (RT > i) {                                                     \
    const __m512 p = _mm512_set1_ps(P[i * ldp + t]);                          \
    R##0 = _mm512_fmadd_ps(p, x0, R##0), R##1 = _mm512_fmadd_ps(p, x1, R##1); \
    R##2 = _mm512_fmadd_ps(p, x2, R##2), R##3 = _mm512_fmadd_ps(p, x3, R##3); \
  }

// Up to six rows in one pass: 24 accumulators, the token's four V vectors
// and one broadcast fit the 32 registers, so a GQA group of up to six query
// heads converts each V row once and keeps at least 4 x RT FMA chains.
template <int DT, int RT, class PF>
static inline void dec_pv_rows2p(const float* P, int64_t ldp, const char* base, const int64_t* offs, int64_t n,
                                 int64_t D, const __mmask32* m, float* A, int64_t lda, PF& pf) {
  static_assert(RT >= 1 && RT <= 6, "rows");
  constexpr int64_t es = esz<DT>();
  const __m512 z = _mm512_setzero_ps();
  __m512 a00 = z, a01 = z, a02 = z, a03 = z, a10 = z, a11 = z, a12 = z, a13 = z;
  __m512 a20 = z, a21 = z, a22 = z, a23 = z, a30 = z, a31 = z, a32 = z, a33 = z;
  __m512 a40 = z, a41 = z, a42 = z, a43 = z, a50 = z, a51 = z, a52 = z, a53 = z;
  pv_row_load<DT>(A, D, a00, a01, a02, a03);
  if constexpr (RT > 1) pv_row_load<DT>(A + lda, D, a10, a11, a12, a13);
  if constexpr (RT > 2) pv_row_load<DT>(A + 2 * lda, D, a20, a21, a22, a23);
  if constexpr (RT > 3) pv_row_load<DT>(A + 3 * lda, D, a30, a31, a32, a33);
  if constexpr (RT > 4) pv_row_load<DT>(A + 4 * lda, D, a40, a41, a42, a43);
  if constexpr (RT > 5) pv_row_load<DT>(A + 5 * lda, D, a50, a51, a52, a53);
  for (int64_t t = 0; t < n; ++t) {
    pf.step();
    const char* v = base + offs[t] * es;
    __m512 x0, x1, x2, x3;
    load32t<DT>(v, m[0], x0, x1);
    load32t<DT>(v + 32 * es, m[1], x2, x3);
    CB_PV_ROW(a0, 0)
    CB_PV_ROW(a1, 1)
    CB_PV_ROW(a2, 2)
    CB_PV_ROW(a3, 3)
    CB_PV_ROW(a4, 4)
    CB_PV_ROW(a5, 5)
  }
  pv_row_store<DT>(A, D, a00, a01, a02, a03);
  if constexpr (RT > 1) pv_row_store<DT>(A + lda, D, a10, a11, a12, a13);
  if constexpr (RT > 2) pv_row_store<DT>(A + 2 * lda, D, a20, a21, a22, a23);
  if constexpr (RT > 3) pv_row_store<DT>(A + 3 * lda, D, a30, a31, a32, a33);
  if constexpr (RT > 4) pv_row_store<DT>(A + 4 * lda, D, a40, a41, a42, a43);
  if constexpr (RT > 5) pv_row_store<DT>(A + 5 * lda, D, a50, a51, a52, a53);
}
#undef CB_PV_ROW

// One P.V pass over the first `rows` query rows: 1-6 for head_dim 33-64
// (dec_pv_rows2p), else 1-RT (dec_pv_rows).
template <int NP, int DT, int RT, class PF>
static inline void dec_pv_pass(const float* P, int64_t ldp, int64_t rows, const char* base, const int64_t* offs,
                               int64_t n, int64_t D, const __mmask32* m, float* A, int64_t lda, PF& pf) {
  if constexpr (NP == 2) {
    switch (rows) {
      case 1: dec_pv_rows2p<DT, 1>(P, ldp, base, offs, n, D, m, A, lda, pf); break;
      case 2: dec_pv_rows2p<DT, 2>(P, ldp, base, offs, n, D, m, A, lda, pf); break;
      case 3: dec_pv_rows2p<DT, 3>(P, ldp, base, offs, n, D, m, A, lda, pf); break;
      case 4: dec_pv_rows2p<DT, 4>(P, ldp, base, offs, n, D, m, A, lda, pf); break;
      case 5: dec_pv_rows2p<DT, 5>(P, ldp, base, offs, n, D, m, A, lda, pf); break;
      default: dec_pv_rows2p<DT, 6>(P, ldp, base, offs, n, D, m, A, lda, pf); break;
    }
  } else if (rows >= RT) {
    dec_pv_rows<NP, DT, RT>(P, ldp, base, offs, n, D, m, A, lda, pf);
  } else if (rows == 1) {
    dec_pv_rows<NP, DT, 1>(P, ldp, base, offs, n, D, m, A, lda, pf);
  } else if (rows == 2) {
    if constexpr (RT > 2) dec_pv_rows<NP, DT, 2>(P, ldp, base, offs, n, D, m, A, lda, pf);
  } else if (rows == 3) {
    if constexpr (RT > 3) dec_pv_rows<NP, DT, 3>(P, ldp, base, offs, n, D, m, A, lda, pf);
  }
}

template <int NC, int DT>
static void dec_pv_k(const float* P, int64_t ldp, int64_t M, const char* base, const int64_t* offs, int64_t n,
                     int64_t D, float* A, int64_t lda, KvPrefetch& pf) {
  constexpr int NP = (NC + 1) / 2, NV = 2 * NP;
  // rt * NV accumulators + NV values + 1 broadcast <= 32 registers.
  constexpr int RT = (31 / NV - 1) < 4 ? (31 / NV - 1) : 4;
  __mmask32 m[NP];
  for (int pc = 0; pc < NP; ++pc) {
    const int64_t left = D - pc * 32;
    m[pc] = left >= 32 ? __mmask32(0xffffffffu) : __mmask32((1u << left) - 1u);
  }
  // Passes of at most six rows (head_dim 33-64) or RT, as even as possible
  // (7 rows: 4 + 3): the rows of a pass share each V row's conversion, and a
  // lone row would leave one FMA chain per accumulator, latency-bound.
  const int64_t most = NP == 2 ? 6 : RT, passes = (M + most - 1) / most;
  NoPrefetch none;  // only the first pass steps the item's prefetcher
  for (int64_t r0 = 0, k = 0; k < passes; ++k) {
    const int64_t rows = (M - r0) / (passes - k);
    const float* pr = P + r0 * ldp;
    float* ar = A + r0 * lda;
    if (k == 0)
      dec_pv_pass<NP, DT, RT>(pr, ldp, rows, base, offs, n, D, m, ar, lda, pf);
    else
      dec_pv_pass<NP, DT, RT>(pr, ldp, rows, base, offs, n, D, m, ar, lda, none);
    r0 += rows;
  }
}

#define CB_DEC_DISPATCH(KERNEL, ...)       \
  do {                                     \
    const int64_t nc_ = (D + 15) / 16;     \
    switch (dtype * 16 + int(nc_)) {       \
      CB_DEC_CASES(KERNEL, 0, __VA_ARGS__) \
      CB_DEC_CASES(KERNEL, 1, __VA_ARGS__) \
      CB_DEC_CASES(KERNEL, 2, __VA_ARGS__) \
      CB_DEC_CASES(KERNEL, 3, __VA_ARGS__) \
      default: return false;               \
    }                                      \
    return true;                           \
  } while (0)
#define CB_DEC_CASE(KERNEL, DT, NC, ...) \
  case DT * 16 + NC: KERNEL<NC, DT>(__VA_ARGS__); break;
// clang-format off: a list of case labels, one per group size (clang-format
// cannot parse case labels inside a macro and reflows them differently each run).
#define CB_DEC_CASES(KERNEL, DT, ...)                                               \
  CB_DEC_CASE(KERNEL, DT, 1, __VA_ARGS__) CB_DEC_CASE(KERNEL, DT, 2, __VA_ARGS__)   \
  CB_DEC_CASE(KERNEL, DT, 3, __VA_ARGS__) CB_DEC_CASE(KERNEL, DT, 4, __VA_ARGS__)   \
  CB_DEC_CASE(KERNEL, DT, 5, __VA_ARGS__) CB_DEC_CASE(KERNEL, DT, 6, __VA_ARGS__)   \
  CB_DEC_CASE(KERNEL, DT, 7, __VA_ARGS__) CB_DEC_CASE(KERNEL, DT, 8, __VA_ARGS__)
// clang-format on

static inline bool dec_scores_fast(const float* Q, int64_t ldq, int64_t M, const char* base, const int64_t* offs,
                                   int64_t n, int dtype, int64_t D, float* S, int64_t lds, float* tmp, KvPrefetch& pf,
                                   bool qbf16) {
  (void)tmp;
  CB_DEC_DISPATCH(dec_scores_k, Q, ldq, M, base, offs, n, D, S, lds, pf, qbf16);
}
static inline bool dec_pv_fast(const float* P, int64_t ldp, int64_t M, const char* base, const int64_t* offs, int64_t n,
                               int dtype, int64_t D, float* A, int64_t lda, KvPrefetch& pf) {
  CB_DEC_DISPATCH(dec_pv_k, P, ldp, M, base, offs, n, D, A, lda, pf);
}
#undef CB_DEC_DISPATCH
#undef CB_DEC_CASE
#undef CB_DEC_CASES

}  // namespace

// head_dim <= 128 uses the AVX-512 group kernels, larger ones the portable ones.
#define CB_DEC_SCORES(Q, ldq, M, base, offs, n, dtype, D, S, lds, tmp, pf, qbf16) \
  (dec_scores_fast(Q, ldq, M, base, offs, n, dtype, D, S, lds, tmp, pf, qbf16)    \
       ? void()                                                                   \
       : dec_scores_simple(Q, ldq, M, base, offs, n, dtype, D, S, lds, tmp, pf, qbf16))
#define CB_DEC_PV(P, ldp, M, base, offs, n, dtype, D, A, lda, tmp, pf) \
  (dec_pv_fast(P, ldp, M, base, offs, n, dtype, D, A, lda, pf)         \
       ? void()                                                        \
       : dec_pv_simple(P, ldp, M, base, offs, n, dtype, D, A, lda, tmp, pf))

#include "attn_body.h"
#include "attn_amx.h"
#include "attn_dp.h"

namespace cbserve_native {
// The AVX-512 kernels, with bf16 prefill items (more than kDecodeMaxRows
// rows, head_dim 32 / 64 / 96 / 128; a bf16 or fp8 e5m2 cache) on AVX512-BF16
// dot products where the CPU has them (attn_dp.h).
bool attn_item_avx512(const AttnParams& p, const AttnItem& it, const AttnItem* next, bool prefetched, float* scratch) {
  static const bool dp = __builtin_cpu_supports("avx512bf16");
  if (dp && p.dtype == kBF16 && (p.kv_dtype == kBF16 || p.kv_dtype == kFP8E5M2) && !is_decode_item(it, p.hq / p.hkv) &&
      p.head_dim % 32 == 0) {
    const bool f8 = p.kv_dtype == kFP8E5M2;
    switch (p.head_dim / 32) {
      case 1: return f8 ? attn_prefill_dp<1, true>(p, it, scratch) : attn_prefill_dp<1, false>(p, it, scratch);
      case 2: return f8 ? attn_prefill_dp<2, true>(p, it, scratch) : attn_prefill_dp<2, false>(p, it, scratch);
      case 3: return f8 ? attn_prefill_dp<3, true>(p, it, scratch) : attn_prefill_dp<3, false>(p, it, scratch);
      case 4: return f8 ? attn_prefill_dp<4, true>(p, it, scratch) : attn_prefill_dp<4, false>(p, it, scratch);
      default: break;
    }
  }
  return attn_item_impl(p, it, next, prefetched, scratch);
}

// The AVX-512 kernels, with bf16 prefill items (more than kDecodeMaxRows
// rows, head_dim 32 / 64 / 96 / 128; a bf16 or fp8 e5m2 cache) on AMX tiles.
bool attn_item_amx(const AttnParams& p, const AttnItem& it, const AttnItem* next, bool prefetched, float* scratch) {
  if (p.dtype == kBF16 && (p.kv_dtype == kBF16 || p.kv_dtype == kFP8E5M2) && !is_decode_item(it, p.hq / p.hkv) &&
      p.head_dim % 32 == 0) {
    const bool f8 = p.kv_dtype == kFP8E5M2;
    switch (p.head_dim / 32) {
      case 1: return f8 ? attn_prefill_amx<1, true>(p, it, scratch) : attn_prefill_amx<1, false>(p, it, scratch);
      case 2: return f8 ? attn_prefill_amx<2, true>(p, it, scratch) : attn_prefill_amx<2, false>(p, it, scratch);
      case 3: return f8 ? attn_prefill_amx<3, true>(p, it, scratch) : attn_prefill_amx<3, false>(p, it, scratch);
      case 4: return f8 ? attn_prefill_amx<4, true>(p, it, scratch) : attn_prefill_amx<4, false>(p, it, scratch);
      default: break;
    }
  }
  return attn_item_impl(p, it, next, prefetched, scratch);
}

// fp32 / bf16 / fp16 -> fp8 e5m2, 16 at a time, as cb_f32_to_e5m2.
void to_e5m2_avx512(const void* src, int32_t dtype, uint8_t* dst, int64_t n) {
  const int64_t es = elem_size(dtype);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff);
  const __m512i magic = _mm512_set1_epi32(134 << 23);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512i u0 = _mm512_castps_si512(load16(static_cast<const char*>(src) + i * es, dtype, m));
    const __m512i u = _mm512_and_si512(u0, abs_mask);
    const __m512i sign = _mm512_srli_epi32(_mm512_andnot_si512(abs_mask, u0), 24);
    // Normal range: rebias the exponent, round half to even on bit 21.
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 21), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(int(0xc8000000u + 0xfffffu)), odd)), 21);
    // Below 2^-14: the fp32 adder rounds to the subnormal step.
    const __mmask16 small = _mm512_cmplt_epu32_mask(u, _mm512_set1_epi32(113 << 23));
    const __m512i sub =
        _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(u), _mm512_castsi512_ps(magic))), magic);
    r = _mm512_mask_mov_epi32(r, small, sub);
    // |x| >= 65536: inf, NaN: 0x7f.
    const __mmask16 big = _mm512_cmpge_epu32_mask(u, _mm512_set1_epi32(143 << 23));
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(u, _mm512_set1_epi32(0x7f800000));
    r = _mm512_mask_mov_epi32(r, big, _mm512_set1_epi32(0x7c));
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7f));
    r = _mm512_or_si512(_mm512_and_si512(r, _mm512_set1_epi32(0xff)), sign);
    _mm_mask_storeu_epi8(dst + i, m, _mm512_cvtepi32_epi8(r));
  }
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
bool attn_item_avx512(const AttnParams&, const AttnItem&, const AttnItem*, bool, float*) { return false; }
bool attn_item_amx(const AttnParams&, const AttnItem&, const AttnItem*, bool, float*) { return false; }
void to_e5m2_avx512(const void* src, int32_t dtype, uint8_t* dst, int64_t n) { to_e5m2_generic(src, dtype, dst, n); }
#endif
}  // namespace cbserve_native
