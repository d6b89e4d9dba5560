// GGUF Q4_1 / Q8_0 / Q4_K / Q6_K blocks packed into weight tiles (executor/cpu/gguf_weights.py)
// and their expansion to bf16 tiles [16 k-pairs][16 n][2], the layout
// amx_pack_weight writes. Shared by amx_linear.cpp (AMX tiles) and
// avx512_linear.cpp (VDPBF16PS, CPUs without AMX): the expansion is
// AVX512-BF16 code and rounds exactly as transformers' GGUF loader and a bf16
// cast do, so both kernels see the bf16 model's weights bit for bit.
#pragma once

#include <ATen/core/Tensor.h>  // the tensor alone: torch/types.h is several times slower to compile

#include <cstdint>

#include "cpu_isa.h"

namespace cbserve_fused {
namespace gguf_tiles {

constexpr int64_t kTileN = 16;                   // output features per weight tile
constexpr int64_t kTileK = 32;                   // K elements per tile (16 bf16 pairs)
constexpr int64_t kTileElems = kTileK * kTileN;  // 512 bf16 = 1 KB

// Packed weight formats (amx_pack_weight; GGUF blocks packed by executor/cpu/gguf_weights.py).
enum class Fmt { kBf16, kQ4_1, kQ8_0, kQ4_K, kQ6_K };
constexpr int64_t kQ41TileBytes = 320;  // q [4][16 lanes][4 k-pairs] nibbles (low: features 0-7), d [16], m [16] fp16
constexpr int64_t kQ80TileBytes = 544;  // q [16 k-pairs][2 halves][16 lanes] int8, d [16] fp16
// Q4_K: one tile per super-block (16 features x 256 K, 8 k-blocks): the 8
// k-blocks' q bytes in Q4_1's layout (256 each), then d [16] and dmin [16]
// fp16, then sc [8][16] and mn [8][16] uint8 (the 6-bit scales and mins,
// unpacked): 4.625 bits a weight against the file's 4.5.
constexpr int64_t kQ4KSub = 8;  // k-blocks per K-quant super-block
constexpr int64_t kQ4KTileBytes = kQ4KSub * 256 + 64 + 2 * kQ4KSub * 16;
// Q6_K: one tile per super-block: per k-block (384 bytes) the low 4 bits
// of q + 32 in Q4_1's layout (256), then their high 2 bits (128: per group
// g, 16 lanes of 16 bits, bits 4R + 2h of lane j the high bits of k-pair
// 4g + R, half h), then d [16] fp16, then the int8 scales of each 16 weights,
// sc [16][16]: 6.5625 bits a weight, the file's own.
constexpr int64_t kQ6KSubBytes = 384;
constexpr int64_t kQ6KTileBytes = kQ4KSub * kQ6KSubBytes + 32 + 16 * 16;

inline bool k_quant(Fmt f) { return f == Fmt::kQ4_K || f == Fmt::kQ6_K; }

inline int64_t tile_bytes(Fmt f) {
  switch (f) {
    case Fmt::kQ4_1: return kQ41TileBytes;
    case Fmt::kQ8_0: return kQ80TileBytes;
    case Fmt::kQ4_K: return kQ4KTileBytes;
    default: return kQ6KTileBytes;
  }
}

// 32-wide k-blocks per packed tile (a K-quant tile holds a super-block).
inline int64_t kblocks_per_tile(Fmt f) { return k_quant(f) ? kQ4KSub : 1; }

// The format of uint8 blocks packed by executor/cpu/gguf_weights.py, from the
// size of their last dimension (one tile's bytes); checks the layout.
inline Fmt block_fmt(const at::Tensor& packed) {
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3,
              "block-quantised weights must be a uint8 [N/16, K/32 or K/256, tile bytes] tensor");
  for (Fmt f : {Fmt::kQ4_1, Fmt::kQ8_0, Fmt::kQ4_K, Fmt::kQ6_K})
    if (packed.size(2) == tile_bytes(f)) return f;
  TORCH_CHECK(false, "block-quantised weights must be uint8 [N/16, K/32, ", kQ41TileBytes, " (Q4_1) or ", kQ80TileBytes,
              " (Q8_0)] or [N/16, K/256, ", kQ4KTileBytes, " (Q4_K) or ", kQ6KTileBytes, " (Q6_K)]");
  return Fmt::kBf16;
}

// The format of blocks packed for an [n_features, k] weight; checks that
// they hold whole tiles of exactly that weight.
inline Fmt check_blocks(const at::Tensor& packed, int64_t n_features, int64_t k) {
  const Fmt fmt = block_fmt(packed);
  const int64_t tk = kTileK * kblocks_per_tile(fmt);
  TORCH_CHECK(
      k % tk == 0 && n_features % kTileN == 0 && packed.size(0) == n_features / kTileN && packed.size(1) == k / tk,
      "block-quantised weights of [", n_features, ", ", k, "] need K a multiple of ", tk,
      ", N of 16, and packed [N/16, K/", tk, ", tile bytes]");
  return fmt;
}

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

// The packed tile holding k-block kb (32 wide) of column block nb, of
// `kblocks` k-blocks in all: for Q4_K the super-tile, whose k-block
// kb % 8 tile_q / tile_scales pick.
inline const uint8_t* tile_at(Fmt fmt, const uint8_t* src, int64_t nb, int64_t kb, int64_t nblocks, int64_t kblocks) {
  const int64_t per = kblocks_per_tile(fmt);
  return src + block_tile_index(nb, kb / per, nblocks, kblocks / per) * tile_bytes(fmt);
}

// The q bytes of k-block kb in its tile (Q4_1's layout for Q4_K; Q6_K: kQ6KTileBytes).
inline const uint8_t* tile_q(Fmt fmt, const uint8_t* tile, int64_t kb) {
  if (fmt == Fmt::kQ4_K) return tile + 256 * (kb % kQ4KSub);
  return fmt == Fmt::kQ6_K ? tile + kQ6KSubBytes * (kb % kQ4KSub) : tile;
}

#if CB_FUSED_X86
// Word w of a tile row holds k-parity (w % 2) of feature w / 2. The packed
// blocks keep the q values of a row's words 0..15 (features 0..7) and 16..31
// (features 8..15) in two vectors of 16 lanes, so one vcvtne2ps2bf16 of the
// two gives the row in tile order; the scales, stored once per feature, are
// spread to those lanes once per tile.
alignas(64) constexpr int32_t kLowFeatures[16] = {0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7};
alignas(64) constexpr int32_t kHighFeatures[16] = {8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15};

// A tile's scales spread to the lanes of a row's two halves (words 0..15:
// features 0..7, words 16..31: features 8..15); m only for Q4_1 / Q4_K.
struct TileScales {
  __m512 dl, dh, ml, mh;
};

CB_AVX512 inline __m512 f16_ps(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

CB_AVX512 inline __m512 u8_ps(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

CB_AVX512 inline __m512 i8_ps(const uint8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}

// The scales of k-block kb of `tile` (kb matters for the K-quants only;
// `half`: a Q6_K k-block's second 16 weights, k-pairs 8..15). A Q4_K
// k-block's w = d * sc * q - dmin * mn (gguf-py's order): d * sc and
// dmin * mn are exact in fp32 (11-bit by 6-bit), and so is (d * sc) * q, so
// the one FMA of q4_row, with m = -(dmin * mn), rounds as gguf-py does. A
// Q6_K one's w = (d * sc) * q: d * sc exact (11-bit by 8-bit), the product
// with q rounded once in q6_row's multiply, as in gguf-py.
CB_AVX512BF16 inline TileScales tile_scales(Fmt fmt, const uint8_t* src, int64_t kb = 0, int half = 0) {
  const __m512i lo = _mm512_load_si512(kLowFeatures);
  const __m512i hi = _mm512_load_si512(kHighFeatures);
  __m512 d, m = _mm512_setzero_ps();
  if (fmt == Fmt::kQ6_K) {
    const int64_t s0 = kQ4KSub * kQ6KSubBytes;
    d = _mm512_mul_ps(f16_ps(src + s0), i8_ps(src + s0 + 32 + 16 * (2 * (kb % kQ4KSub) + half)));
  } else if (fmt == Fmt::kQ4_K) {
    const int64_t sub = kb % kQ4KSub, s0 = kQ4KSub * 256;
    d = _mm512_mul_ps(f16_ps(src + s0), u8_ps(src + s0 + 64 + 16 * sub));
    m = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(f16_ps(src + s0 + 32), u8_ps(src + s0 + 64 + 128 + 16 * sub)));
  } else if (fmt == Fmt::kQ4_1) {
    d = f16_ps(src + 256);
    m = f16_ps(src + 288);
  } else {
    d = f16_ps(src + 512);
  }
  return TileScales{_mm512_permutexvar_ps(lo, d), _mm512_permutexvar_ps(hi, d), _mm512_permutexvar_ps(lo, m),
                    _mm512_permutexvar_ps(hi, m)};
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

// (low | high << 4) - 32 of one half-row as fp32, by two table lookups
// (vpermps reads an index's low 4 bits): the nibble at bit `lo_shift` of each
// lane of `group` over 0..15, the bit pair at `hi_shift` of `high` over
// 16 * pair - 32 (repeated four times: the index's bits 2-3 are the next
// pair's); the sum of two small integers is exact.
CB_AVX512BF16 inline __m512 q6_values(__m512i group, __m512i high, int lo_shift, int hi_shift) {
  const __m512 low_table = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512 high_table = _mm512_set_ps(16, 0, -16, -32, 16, 0, -16, -32, 16, 0, -16, -32, 16, 0, -16, -32);
  return _mm512_add_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(group, lo_shift), low_table),
                       _mm512_permutexvar_ps(_mm512_srli_epi32(high, hi_shift), high_table));
}

// Row 4g + R of a Q6_K k-block, from `group` (its 64 low-bit bytes g, as
// q4_row's) and `high` (its high-bit words g widened to 32-bit lanes), as
// bf16: q = (low | high << 4) - 32, then (d * sc) * q in fp32
// (one rounding, as gguf-py), then RNE.
template <int R>
CB_AVX512BF16 inline __m512bh q6_row(__m512i group, __m512i high, const TileScales& s) {
  const __m512 a = _mm512_mul_ps(q6_values(group, high, 8 * R, 4 * R), s.dl);
  const __m512 b = _mm512_mul_ps(q6_values(group, high, 8 * R + 4, 4 * R + 2), s.dh);
  return _mm512_cvtne2ps_pbh(b, a);
}

// Group g's high bits of a Q6_K k-block (`q`: its bytes), one lane each.
CB_AVX512 inline __m512i q6_high(const uint8_t* q, int g) {
  return _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 256 + 32 * g)));
}

CB_AVX512BF16 inline __m512 q4_table() { return _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }

// The formats whose k-block is 4 groups of 64 low-bit bytes (Q4_1's
// layout): Q4_1, Q4_K, and Q6_K with its high bits beside them.
constexpr bool nibble_groups(Fmt f) { return f == Fmt::kQ4_1 || f == Fmt::kQ4_K || f == Fmt::kQ6_K; }

// Group g's high bits of a k-block of format F (`q`: its bytes): Q6_K's
// (q6_high), nothing for the 4-bit formats.
template <Fmt F>
CB_AVX512BF16 inline __m512i group_high(const uint8_t* q, int g) {
  if constexpr (F == Fmt::kQ6_K) return q6_high(q, g);
  return _mm512_setzero_si512();
}

// Row 4g + R of a k-block of a nibble_groups format F, from its group g
// (`group`, and `high` from group_high), as bf16: q6_row for Q6_K, q4_row
// (table `q16`) for Q4_1 and Q4_K.
template <Fmt F, int R>
CB_AVX512BF16 inline __m512bh group_row(__m512i group, __m512i high, __m512 q16, const TileScales& s) {
  if constexpr (F == Fmt::kQ6_K) return q6_row<R>(group, high, s);
  return q4_row<R>(group, q16, s);
}

// dequant_tile for a nibble_groups format F: `s`, k-block kb's scales; a
// Q6_K k-block takes its second scales from k-pair 8 (group 2) on.
template <Fmt F>
CB_AVX512BF16 inline void dequant_groups(const uint8_t* src, const uint8_t* q, int64_t kb, TileScales s,
                                         __m512i* rows) {
  const __m512 q16 = q4_table();
  for (int g = 0; g < 4; ++g) {
    if (F == Fmt::kQ6_K && g == 2) s = tile_scales(F, src, kb, 1);
    const __m512i v = _mm512_loadu_si512(q + 64 * g), h = group_high<F>(q, g);
    _mm512_storeu_si512(rows + 4 * g, reinterpret_cast<__m512i>(group_row<F, 0>(v, h, q16, s)));
    _mm512_storeu_si512(rows + 4 * g + 1, reinterpret_cast<__m512i>(group_row<F, 1>(v, h, q16, s)));
    _mm512_storeu_si512(rows + 4 * g + 2, reinterpret_cast<__m512i>(group_row<F, 2>(v, h, q16, s)));
    _mm512_storeu_si512(rows + 4 * g + 3, reinterpret_cast<__m512i>(group_row<F, 3>(v, h, q16, s)));
  }
}

// One tile of bf16 weights [16 k-pairs][16 n][2] from its Q4_1 / Q8_0 /
// Q4_K / Q6_K block form (`src`: the packed tile; for a K-quant its
// super-tile and kb the k-block in it): d * q (+ m) in fp32, then bf16 RNE,
// as gguf-py and a bf16 cast round them. d * q is exact in fp32 (an 11-bit
// fp16 significand times a 4- or 8-bit integer; the K-quants: tile_scales),
// so one FMA rounds d * q + m exactly as a product then a sum do.
CB_AVX512BF16 inline void dequant_tile(Fmt fmt, const uint8_t* src, uint16_t* dst, int64_t kb = 0) {
  const TileScales s = tile_scales(fmt, src, kb);
  __m512i* rows = reinterpret_cast<__m512i*>(dst);  // row j: 32 words at dst + 32 j
  const uint8_t* q = tile_q(fmt, src, kb);
  switch (fmt) {
    case Fmt::kQ4_1: return dequant_groups<Fmt::kQ4_1>(src, q, kb, s, rows);
    case Fmt::kQ4_K: return dequant_groups<Fmt::kQ4_K>(src, q, kb, s, rows);
    case Fmt::kQ6_K: return dequant_groups<Fmt::kQ6_K>(src, q, kb, s, rows);
    default: break;
  }
  for (int j = 0; j < 16; ++j) _mm512_storeu_si512(rows + j, reinterpret_cast<__m512i>(q8_row(q + 32 * j, s)));
}
#endif

}  // namespace gguf_tiles
}  // namespace cbserve_fused
