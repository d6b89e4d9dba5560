// Transpose-add reductions of AVX-512 fp32 accumulators for the decode
// attention kernels (cpu_kernels_avx512.cpp), and the in-register 16 x 16
// transpose, shared by the bf16 prefill attention (attn_amx.h, attn_dp.h) and
// amx_q4_rows_linear
// (linear/amx_q4_rows.cpp). x86-64 only; include after <immintrin.h>.
//
// The includer provides the ISA: either it compiles under an AVX-512
// `#pragma GCC target` / `clang attribute push`, or it defines CB_HSUM_TARGET
// as a function target attribute first. Internal linkage (anonymous
// namespace), so no AVX-512 code is shared through the linker.
#pragma once

#ifndef CB_HSUM_TARGET
#define CB_HSUM_TARGET
#endif

namespace {

// In-register 16x16 fp32 transpose: r[c] <- column c.
CB_HSUM_TARGET static inline void transpose16(__m512 r[16]) {
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

// Per 128-bit lane: the 4 vectors' in-lane sums, element i = vector i.
CB_HSUM_TARGET static inline __m512 hsum4_lanes(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 b0 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 b1 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  return _mm512_add_ps(_mm512_shuffle_ps(b0, b1, 0x44), _mm512_shuffle_ps(b0, b1, 0xEE));
}

// Lane 4j+i = hsum4_lanes result c[j]'s element i summed over the four 128-bit lanes.
CB_HSUM_TARGET static inline __m512 hsum_quads(__m512 c0, __m512 c1, __m512 c2, __m512 c3) {
  const __m512 d01 = _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
  const __m512 d23 = _mm512_add_ps(_mm512_shuffle_f32x4(c2, c3, 0x88), _mm512_shuffle_f32x4(c2, c3, 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d01, d23, 0x88), _mm512_shuffle_f32x4(d01, d23, 0xDD));
}

}  // namespace
