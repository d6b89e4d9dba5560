// GGUF Q4_1 / Q8_0 blocks packed into weight tiles (executor/cpu/gguf_weights.py)
// and their expansion to bf16 tiles [16 k-pairs][16 n][2], the layout
// amx_pack_weight writes. Shared by amx_linear.cpp (AMX tiles) and
// avx512_linear.cpp (VDPBF16PS, CPUs without AMX): the expansion is
// AVX512-BF16 code and rounds exactly as transformers' GGUF loader and a bf16
// cast do, so both kernels see the bf16 model's weights bit for bit.
#pragma once

#include <torch/extension.h>

#include <cstdint>

#include "cpu_isa.h"

namespace cbserve_fused {
namespace gguf_tiles {

constexpr int64_t kTileN = 16;                   // output features per weight tile
constexpr int64_t kTileK = 32;                   // K elements per tile (16 bf16 pairs)
constexpr int64_t kTileElems = kTileK * kTileN;  // 512 bf16 = 1 KB

// Packed weight formats (amx_pack_weight; Q4_1 / Q8_0 blocks packed by executor/cpu/gguf_weights.py).
enum class Fmt { kBf16, kQ4_1, kQ8_0 };
constexpr int64_t kQ41TileBytes = 320;  // q [4][16 lanes][4 k-pairs] nibbles (low: features 0-7), d [16], m [16] fp16
constexpr int64_t kQ80TileBytes = 544;  // q [16 k-pairs][2 halves][16 lanes] int8, d [16] fp16

inline int64_t tile_bytes(Fmt f) { return f == Fmt::kQ4_1 ? kQ41TileBytes : kQ80TileBytes; }

// The format of uint8 blocks packed by executor/cpu/gguf_weights.py, from the
// size of their last dimension (one tile's bytes); checks the layout.
inline Fmt block_fmt(const torch::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 &&
                  (packed.size(2) == kQ41TileBytes || packed.size(2) == kQ80TileBytes),
              "block-quantised weights must be uint8 [N/16, K/32, ", kQ41TileBytes, " (Q4_1) or ", kQ80TileBytes,
              " (Q8_0)]");
  return packed.size(2) == kQ41TileBytes ? Fmt::kQ4_1 : Fmt::kQ8_0;
}

// The format of blocks packed for an [n_features, k] weight; checks that
// they hold whole tiles of exactly that weight.
inline Fmt check_blocks(const torch::Tensor& packed, int64_t n_features, int64_t k) {
  const Fmt fmt = block_fmt(packed);
  TORCH_CHECK(k % kTileK == 0 && n_features % kTileN == 0 && packed.size(0) == n_features / kTileN &&
                  packed.size(1) == k / kTileK,
              "block-quantised weights of [", n_features, ", ", k,
              "] need K a multiple of 32, N of 16, and packed [N/16, K/32, tile bytes]");
  return fmt;
}

#if CB_FUSED_X86
// Where tile (column block nb, k-block kb) of packed blocks sits, in tiles
// from the start: the blocks are stored pair-major (executor/cpu/gguf_weights.py),
// column blocks 2p and 2p + 1 alternating k-block by k-block, so a thread's
// sweep over a pair, and over a run of pairs, is one forward stream (two
// interleaved streams per pair kept the hardware prefetcher re-learning).
// An odd last column block follows alone.
inline int64_t block_tile_index(int64_t nb, int64_t kb, int64_t nblocks, int64_t kblocks) {
  const int64_t full = nblocks & ~int64_t(1);
  return nb < full ? (nb & ~int64_t(1)) * kblocks + 2 * kb + (nb & 1) : nb * kblocks + kb;
}

// Word w of a tile row holds k-parity (w % 2) of feature w / 2. The packed
// blocks keep the q values of a row's words 0..15 (features 0..7) and 16..31
// (features 8..15) in two vectors of 16 lanes, so one vcvtne2ps2bf16 of the
// two gives the row in tile order; the scales, stored once per feature, are
// spread to those lanes once per tile.
alignas(64) constexpr int32_t kLowFeatures[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
alignas(64) constexpr int32_t kHighFeatures[16] = {8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};

// A tile's scales spread to the lanes of a row's two halves (words 0..15:
// features 0..7, words 16..31: features 8..15); m only for Q4_1.
struct TileScales {
  __m512 dl, dh, ml, mh;
};

CB_AVX512BF16 inline TileScales tile_scales(Fmt fmt, const uint8_t* src) {
  const __m512i lo = _mm512_load_si512(kLowFeatures);
  const __m512i hi = _mm512_load_si512(kHighFeatures);
  const bool q4 = fmt == Fmt::kQ4_1;
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (q4 ? 256 : 512))));
  TileScales s{_mm512_permutexvar_ps(lo, d), _mm512_permutexvar_ps(hi, d), _mm512_setzero_ps(), _mm512_setzero_ps()};
  if (q4) {
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 288)));
    s.ml = _mm512_permutexvar_ps(lo, m);
    s.mh = _mm512_permutexvar_ps(hi, m);
  }
  return s;
}

// Row 4g + R of a Q4_1 tile, from `group` (its 64 bytes g: byte R of each
// lane, low nibble for words 0..15), as bf16: d * q + m in fp32, then RNE.
// q16 holds 0..15: q becomes fp32 by table lookup (vpermps reads only the
// low 4 bits of each index).
template <int R>
CB_AVX512BF16 inline __m512bh q4_row(__m512i group, __m512 q16, const TileScales& s) {
  const __m512 a = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(group, 8 * R), q16), s.dl, s.ml);
  const __m512 b = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(group, 8 * R + 4), q16), s.dh, s.mh);
  return _mm512_cvtne2ps_pbh(b, a);
}

// Row j of a Q8_0 tile (its 32 bytes at `row`: 16 int8 for words 0..15,
// then 16 for words 16..31) as bf16: d * q in fp32, then RNE.
CB_AVX512BF16 inline __m512bh q8_row(const uint8_t* row, const TileScales& s) {
  const __m128i* q = reinterpret_cast<const __m128i*>(row);
  const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q))), s.dl);
  const __m512 b = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1))), s.dh);
  return _mm512_cvtne2ps_pbh(b, a);
}

CB_AVX512BF16 inline __m512 q4_table() { return _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }

// One tile of bf16 weights [16 k-pairs][16 n][2] from its Q4_1 / Q8_0 block
// form: d * q (+ m) in fp32, then bf16 RNE, as gguf-py and a bf16 cast round
// them. d * q is exact in fp32 (an 11-bit fp16 significand times a 4- or
// 8-bit integer), so one FMA rounds d * q + m exactly as a product then a sum do.
CB_AVX512BF16 inline void dequant_tile(Fmt fmt, const uint8_t* src, uint16_t* dst) {
  const TileScales s = tile_scales(fmt, src);
  __m512i* rows = reinterpret_cast<__m512i*>(dst);  // row j: 32 words at dst + 32 j
  if (fmt == Fmt::kQ4_1) {
    const __m512 q16 = q4_table();
    for (int g = 0; g < 4; ++g) {
      const __m512i v = _mm512_loadu_si512(src + 64 * g);
      _mm512_storeu_si512(rows + 4 * g, reinterpret_cast<__m512i>(q4_row<0>(v, q16, s)));
      _mm512_storeu_si512(rows + 4 * g + 1, reinterpret_cast<__m512i>(q4_row<1>(v, q16, s)));
      _mm512_storeu_si512(rows + 4 * g + 2, reinterpret_cast<__m512i>(q4_row<2>(v, q16, s)));
      _mm512_storeu_si512(rows + 4 * g + 3, reinterpret_cast<__m512i>(q4_row<3>(v, q16, s)));
    }
    return;
  }
  for (int j = 0; j < 16; ++j) _mm512_storeu_si512(rows + j, reinterpret_cast<__m512i>(q8_row(src + 32 * j, s)));
}
#endif

}  // namespace gguf_tiles
}  // namespace cbserve_fused
