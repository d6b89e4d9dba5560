// Transpose-add reductions of AVX-512 fp32 accumulators, shared by the decode
// attention kernels (cpu_kernels_avx512.cpp) and skinny_linear
// (fused/skinny_linear.cpp). x86-64 only; include after <immintrin.h>.
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
