// bf16 through fp32 lanes on AVX2 (CPUs without native bf16): loads widen
// exactly (a bf16 is the top half of an fp32), stores round to nearest even
// as c10::BFloat16's conversion does (a NaN stays a quiet NaN). Shared by
// avx2_f32_linear.cpp (bf16 weights and output) and fused_ops.cpp (bf16
// act(gate) * up).
#pragma once

#include <cstdint>

#include "cpu_isa.h"

#if CB_FUSED_X86
namespace cbserve_fused {

// 8 bf16 (one 128-bit load) -> 8 fp32 lanes.
CB_AVX2 inline __m256 widen_bf16x8(__m128i v) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

CB_AVX2 inline __m256 load_bf16x8(const uint16_t* p) {
  return widen_bf16x8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8 fp32 lanes -> their bf16 bits (RNE), one per int32 lane.
CB_AVX2 inline __m256i bf16_bits_x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
}

// fp32 -> bf16 -> fp32 (the value a bf16 store then load would give).
CB_AVX2 inline __m256 round_bf16x8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits_x8(v), 16)); }

CB_AVX2 inline void store_bf16x8(uint16_t* p, __m256 v) {
  const __m256i b = bf16_bits_x8(v);  // every lane fits 16 bits: packus never saturates
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1)));
}

// 16 fp32 lanes (two vectors) -> 16 bf16 in one 256-bit store.
CB_AVX2 inline void store_bf16x16(uint16_t* p, __m256 lo, __m256 hi) {
  // packus interleaves 128-bit lanes (lo 0-3, hi 0-3, lo 4-7, hi 4-7); the
  // permute restores the order.
  const __m256i b = _mm256_packus_epi32(bf16_bits_x8(lo), bf16_bits_x8(hi));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm256_permute4x64_epi64(b, 0xD8));
}

}  // namespace cbserve_fused
#endif
