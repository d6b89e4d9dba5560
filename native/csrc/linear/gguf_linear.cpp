// GGUF blocks on CPUs without AVX512-BF16 (gguf_linear.h). Each tile of the
// packed blocks (32 k by 16 features, or a K-quant's k-block of its
// super-tile) is expanded into a 2 KB fp32 panel [32 k][16 features], the
// layout of one stretch of avx2_f32_linear's panels, and multiplied there
// while it sits in L1: the weights stream from memory once per call as their
// blocks (4.6-8.5 bits a weight instead of 16 or 32), and are expanded once
// per call whatever the number of rows. A thread takes a run of column-block
// pairs, which the packing stores k-block by k-block alternating (one
// forward stream); its fp32 sums for every row of x and the pair's 32
// features live in a per-thread buffer between k-blocks, so each output's
// sum runs over k in order with one FMA per term: avx2_f32_linear's own
// arithmetic over the same weights. The AVX2 code (FMA, F16C) and the
// portable code compute the same values and sums, bit for bit. Under int8
// block activations (AVX512-VNNI CPUs) every call goes to int8_blocks
// instead: Ice Lake and Cascade Lake run this file, lacking AVX512-BF16.

#include "gguf_linear.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "avx2_bf16.h"
#include "cpu_isa.h"
#include "gguf_tiles.h"
#include "int8_blocks.h"
#include "linear_args.h"

namespace cbserve_fused {

namespace {

using gguf_tiles::Fmt;
using gguf_tiles::kQ4KSub;
using gguf_tiles::kQ6KSubBytes;
using gguf_tiles::kTileK;
using gguf_tiles::kTileN;

constexpr int64_t kPanelElems = kTileK * kTileN;  // one expanded tile: [32 k][16 features] fp32
constexpr int kMR = 6;                            // rows of x per register block (avx2_f32_linear's)

// ---- Portable code -------------------------------------------------------

inline float half_at(const uint8_t* p, int i) {
  uint16_t bits;
  std::memcpy(&bits, p + 2 * i, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline float round_bf16(float v) { return static_cast<float>(c10::BFloat16(v)); }

// Per-feature scales of k-block kb of `src`'s tile (`half`: a Q6_K k-block's
// second 16 weights): w = d * q + m. The products are exact in fp32
// (gguf_tiles.h, tile_scales), so their rounding cannot differ between paths.
struct Scales {
  float d[16], m[16];
};

void portable_scales(Fmt fmt, const uint8_t* src, int64_t kb, int half, Scales& s) {
  const int64_t sub = kb % kQ4KSub;
  for (int f = 0; f < 16; ++f) {
    s.m[f] = 0.0f;
    switch (fmt) {
      case Fmt::kQ4_1:
        s.d[f] = half_at(src + 256, f);
        s.m[f] = half_at(src + 288, f);
        break;
      case Fmt::kQ8_0: s.d[f] = half_at(src + 512, f); break;
      case Fmt::kQ4_K: {
        const uint8_t* s0 = src + kQ4KSub * 256;
        s.d[f] = half_at(s0, f) * static_cast<float>(s0[64 + 16 * sub + f]);
        s.m[f] = 0.0f - half_at(s0 + 32, f) * static_cast<float>(s0[64 + 128 + 16 * sub + f]);
        break;
      }
      default: {
        const uint8_t* s0 = src + kQ4KSub * kQ6KSubBytes;
        s.d[f] = half_at(s0, f) * static_cast<float>(static_cast<int8_t>(s0[32 + 16 * (2 * sub + half) + f]));
        break;
      }
    }
  }
}

// Word w of row j (k-pair j) of a tile is k-parity w % 2 of feature
// (w < 16 ? 0 : 8) + (w % 16) / 2 (gguf_tiles.h). Q4_1 / Q4_K / Q6_K keep
// row 4g + R's words in byte R of the 16 32-bit lanes of group g (64
// bytes): low nibble words 0..15, high nibble words 16..31; Q6_K adds two
// high bits per word from its 16-bit lanes at byte 256 + 32 g (bits 4R for
// words 0..15, 4R + 2 for 16..31). Q8_0 keeps row j's 32 int8 at 32 j.
void portable_tile(Fmt fmt, const uint8_t* src, int64_t kb, bool round, float* out) {
  Scales s;
  portable_scales(fmt, src, kb, 0, s);
  const uint8_t* q = gguf_tiles::tile_q(fmt, src, kb);
  for (int j = 0; j < 16; ++j) {
    if (fmt == Fmt::kQ6_K && j == 8) portable_scales(fmt, src, kb, 1, s);
    const int g = j / 4, R = j % 4;
    for (int w = 0; w < 32; ++w) {
      const int lane = w % 16, f = (w < 16 ? 0 : 8) + lane / 2, k = 2 * j + lane % 2;
      float v;
      if (fmt == Fmt::kQ8_0) {
        v = static_cast<float>(static_cast<int8_t>(q[32 * j + w])) * s.d[f];
      } else {
        const uint8_t byte = q[64 * g + 4 * lane + R];
        int qi = w < 16 ? byte & 15 : byte >> 4;
        if (fmt == Fmt::kQ6_K) {
          uint16_t high;
          std::memcpy(&high, q + 256 + 32 * g + 2 * lane, 2);
          qi += 16 * ((high >> (4 * R + (w < 16 ? 0 : 2))) & 3) - 32;
          v = static_cast<float>(qi) * s.d[f];
        } else {
          v = std::fma(static_cast<float>(qi), s.d[f], s.m[f]);
        }
      }
      out[k * kTileN + f] = round ? round_bf16(v) : v;
    }
  }
}

// Rows of x times `w` ([kn][16]: k from k0) onto their sums `acc` ([M][16]).
void portable_accumulate(const float* x, int64_t M, int64_t K, int64_t k0, int64_t kn, const float* w, float* acc) {
  for (int64_t r = 0; r < M; ++r)
    for (int64_t k = 0; k < kn; ++k) {
      const float xv = x[r * K + k0 + k];
      for (int64_t f = 0; f < kTileN; ++f) acc[r * kTileN + f] = std::fma(xv, w[k * kTileN + f], acc[r * kTileN + f]);
    }
}

// ---- AVX2 + FMA + F16C ---------------------------------------------------

#if CB_FUSED_X86
#define CB_AVX2_F16C __attribute__((target("avx2,fma,f16c")))

CB_AVX2_F16C inline __m256 h8(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

CB_AVX2_F16C inline __m256 u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

CB_AVX2_F16C inline __m256 i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// portable_scales in vectors: d[0], m[0] features 0..7, d[1], m[1] 8..15.
CB_AVX2_F16C inline void avx2_scales(Fmt fmt, const uint8_t* src, int64_t kb, int half, __m256* d, __m256* m) {
  const int64_t sub = kb % kQ4KSub;
  const __m256 zero = _mm256_setzero_ps();
  m[0] = m[1] = zero;
  if (fmt == Fmt::kQ4_1) {
    d[0] = h8(src + 256), d[1] = h8(src + 272), m[0] = h8(src + 288), m[1] = h8(src + 304);
  } else if (fmt == Fmt::kQ8_0) {
    d[0] = h8(src + 512), d[1] = h8(src + 528);
  } else if (fmt == Fmt::kQ4_K) {
    const uint8_t* s0 = src + kQ4KSub * 256;
    const uint8_t* sc = s0 + 64 + 16 * sub;
    d[0] = _mm256_mul_ps(h8(s0), u8x8(sc)), d[1] = _mm256_mul_ps(h8(s0 + 16), u8x8(sc + 8));
    m[0] = _mm256_sub_ps(zero, _mm256_mul_ps(h8(s0 + 32), u8x8(sc + 128)));
    m[1] = _mm256_sub_ps(zero, _mm256_mul_ps(h8(s0 + 48), u8x8(sc + 136)));
  } else {
    const uint8_t* s0 = src + kQ4KSub * kQ6KSubBytes;
    const uint8_t* sc = s0 + 32 + 16 * (2 * sub + half);
    d[0] = _mm256_mul_ps(h8(s0), i8x8(sc)), d[1] = _mm256_mul_ps(h8(s0 + 16), i8x8(sc + 8));
  }
}

// round_bf16x8 for finite lanes (a tile's values are: fp16 scales times small
// integers): nearest even by adding 0x7FFF + the kept lsb, then dropping the
// low half; 5 operations against its 8, a third of a decode step's expansion.
CB_AVX2_F16C inline __m256 round_finite_bf16x8(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The even (odd) 32-bit lanes of lanes 0..7 `a` and 8..15 `b`, in order:
// lane f of the result is lane 2f (2f + 1), feature f's word of k-parity 0 (1).
CB_AVX2_F16C inline __m256i even_lanes(__m256i a, __m256i b) {
  const __m256 s = _mm256_shuffle_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), 0x88);
  return _mm256_castpd_si256(_mm256_permute4x64_pd(_mm256_castps_pd(s), 0xD8));
}

CB_AVX2_F16C inline __m256i odd_lanes(__m256i a, __m256i b) {
  const __m256 s = _mm256_shuffle_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), 0xDD);
  return _mm256_castpd_si256(_mm256_permute4x64_pd(_mm256_castps_pd(s), 0xD8));
}

// Row j's q values I (k = 2j features 0..7, 8..15, then k = 2j + 1's)
// scaled and rounded, handed to `sink` as k = 2j's two vectors, then 2j + 1's.
template <Fmt F, typename Sink>
CB_AVX2_F16C inline void emit_row(const __m256i* I, const __m256* d, const __m256* m, bool round, int j, Sink& sink) {
  __m256 v[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 qf = _mm256_cvtepi32_ps(I[i]);
    v[i] = (F == Fmt::kQ4_1 || F == Fmt::kQ4_K) ? _mm256_fmadd_ps(qf, d[i & 1], m[i & 1]) : _mm256_mul_ps(qf, d[i & 1]);
    if (round) v[i] = round_finite_bf16x8(v[i]);
  }
  sink(2 * j, v[0], v[1]);
  sink(2 * j + 1, v[2], v[3]);
}

// A sink that writes the expanded tile ([32 k][16 features]).
struct PanelSink {
  float* out;
  CB_AVX2_F16C void operator()(int k, __m256 lo, __m256 hi) {
    _mm256_storeu_ps(out + k * kTileN, lo);
    _mm256_storeu_ps(out + k * kTileN + 8, hi);
  }
};

// A sink that multiplies each k's weights into R rows' sums at once (from
// x's column k0), the tile never stored: avx2_rows' arithmetic, in order.
template <int R>
struct FmaSink {
  const float* x;
  int64_t K, k0;
  __m256 lo[R], hi[R];
  CB_AVX2_F16C void operator()(int k, __m256 w0, __m256 w1) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * K + k0 + k);
      lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
    }
  }
};

// portable_tile on 8 features a vector. The k-parity split is done on the
// integers, before they are widened: once per group of 4 rows for the
// nibble formats (their lanes' even / odd words), by a byte shuffle for
// Q8_0; the per-feature scales then apply as loaded.
template <Fmt F, typename Sink>
CB_AVX2_F16C inline void avx2_tile_fmt(const uint8_t* src, int64_t kb, bool round, Sink& sink) {
  const uint8_t* q = gguf_tiles::tile_q(F, src, kb);
  __m256 d[2], m[2];
  avx2_scales(F, src, kb, 0, d, m);
  __m256i I[4];
  if constexpr (F == Fmt::kQ8_0) {
    const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    for (int j = 0; j < 16; ++j) {
      const __m128i a = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32 * j)), split);
      const __m128i b = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 32 * j + 16)), split);
      I[0] = _mm256_cvtepi8_epi32(a), I[1] = _mm256_cvtepi8_epi32(b);
      I[2] = _mm256_cvtepi8_epi32(_mm_srli_si128(a, 8)), I[3] = _mm256_cvtepi8_epi32(_mm_srli_si128(b, 8));
      emit_row<F>(I, d, m, round, j, sink);
    }
    return;
  }
  const __m256i nib = _mm256_set1_epi32(15), three = _mm256_set1_epi32(3), off = _mm256_set1_epi32(32);
  for (int g = 0; g < 4; ++g) {
    const __m256i A = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * g));
    const __m256i B = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64 * g + 32));
    const __m256i E = even_lanes(A, B), O = odd_lanes(A, B);
    __m256i HE = _mm256_setzero_si256(), HO = HE;
    if constexpr (F == Fmt::kQ6_K) {
      if (g == 2) avx2_scales(F, src, kb, 1, d, m);  // k-pairs 8..15: the second 16 weights
      const uint8_t* h = q + 256 + 32 * g;
      const __m256i HA = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h)));
      const __m256i HB = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + 16)));
      HE = even_lanes(HA, HB), HO = odd_lanes(HA, HB);
    }
    for (int R = 0; R < 4; ++R) {
      const __m128i lo = _mm_cvtsi32_si128(8 * R), hi = _mm_cvtsi32_si128(8 * R + 4);
      I[0] = _mm256_and_si256(_mm256_srl_epi32(E, lo), nib);
      I[1] = _mm256_and_si256(_mm256_srl_epi32(E, hi), nib);
      I[2] = _mm256_and_si256(_mm256_srl_epi32(O, lo), nib);
      I[3] = _mm256_and_si256(_mm256_srl_epi32(O, hi), nib);
      if constexpr (F == Fmt::kQ6_K) {  // + 16 x the high bits (4R: features 0..7, 4R + 2: 8..15) - 32
        const __m128i s0 = _mm_cvtsi32_si128(4 * R), s1 = _mm_cvtsi32_si128(4 * R + 2);
        const __m256i H[4] = {_mm256_srl_epi32(HE, s0), _mm256_srl_epi32(HE, s1), _mm256_srl_epi32(HO, s0),
                              _mm256_srl_epi32(HO, s1)};
        for (int i = 0; i < 4; ++i)
          I[i] = _mm256_sub_epi32(_mm256_add_epi32(I[i], _mm256_slli_epi32(_mm256_and_si256(H[i], three), 4)), off);
      }
      emit_row<F>(I, d, m, round, 4 * g + R, sink);
    }
  }
}

template <typename Sink>
CB_AVX2_F16C void avx2_tile_sink(Fmt fmt, const uint8_t* src, int64_t kb, bool round, Sink& sink) {
  switch (fmt) {
    case Fmt::kQ4_1: return avx2_tile_fmt<Fmt::kQ4_1>(src, kb, round, sink);
    case Fmt::kQ8_0: return avx2_tile_fmt<Fmt::kQ8_0>(src, kb, round, sink);
    case Fmt::kQ4_K: return avx2_tile_fmt<Fmt::kQ4_K>(src, kb, round, sink);
    default: return avx2_tile_fmt<Fmt::kQ6_K>(src, kb, round, sink);
  }
}

CB_AVX2_F16C void avx2_tile(Fmt fmt, const uint8_t* src, int64_t kb, bool round, float* out) {
  PanelSink sink{out};
  avx2_tile_sink(fmt, src, kb, round, sink);
}

// R rows of x times the tile expanded in registers, onto their sums `acc` ([R][16]).
template <int R>
CB_AVX2_F16C void avx2_fused_rows(Fmt fmt, const uint8_t* src, int64_t kb, bool round, const float* x, int64_t K,
                                  float* acc) {
  FmaSink<R> sink{x, K, kb * kTileK, {}, {}};
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    sink.lo[r] = _mm256_loadu_ps(acc + r * kTileN), sink.hi[r] = _mm256_loadu_ps(acc + r * kTileN + 8);
  avx2_tile_sink(fmt, src, kb, round, sink);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
    _mm256_storeu_ps(acc + r * kTileN, sink.lo[r]), _mm256_storeu_ps(acc + r * kTileN + 8, sink.hi[r]);
}

// R rows of x (row stride K) times `w` ([kn][16]: k from k0), onto their
// sums `acc` ([R][16]).
template <int R>
CB_AVX2_F16C void avx2_rows(const float* x, int64_t K, int64_t k0, int64_t kn, const float* w, float* acc) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) lo[r] = _mm256_loadu_ps(acc + r * kTileN), hi[r] = _mm256_loadu_ps(acc + r * kTileN + 8);
  for (int64_t k = 0; k < kn; ++k) {
    const __m256 w0 = _mm256_loadu_ps(w + k * kTileN), w1 = _mm256_loadu_ps(w + k * kTileN + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * K + k0 + k);
      lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(acc + r * kTileN, lo[r]), _mm256_storeu_ps(acc + r * kTileN + 8, hi[r]);
}

// The rows go in ceil(M / kMR) register blocks of near-equal size (8 rows:
// 4 + 4, not 6 + 2): a block of R rows has 2R independent FMA chains, and
// below 4 rows their latency, not the FMA ports, sets the pace. Each
// output's sum is the same whichever block holds its row.
CB_AVX2_F16C void avx2_accumulate(const float* x, int64_t M, int64_t K, int64_t k0, int64_t kn, const float* w,
                                  float* acc) {
  const int64_t blocks = (M + kMR - 1) / kMR, base = M / blocks, wide = M % blocks;
  for (int64_t i = 0, m0 = 0; i < blocks; ++i) {
    const int64_t rows = base + (i < wide ? 1 : 0);
    const float* xr = x + m0 * K;
    float* ar = acc + m0 * kTileN;
    switch (rows) {
      case 1: avx2_rows<1>(xr, K, k0, kn, w, ar); break;
      case 2: avx2_rows<2>(xr, K, k0, kn, w, ar); break;
      case 3: avx2_rows<3>(xr, K, k0, kn, w, ar); break;
      case 4: avx2_rows<4>(xr, K, k0, kn, w, ar); break;
      case 5: avx2_rows<5>(xr, K, k0, kn, w, ar); break;
      default: avx2_rows<kMR>(xr, K, k0, kn, w, ar); break;
    }
    m0 += rows;
  }
}
#endif

// ---- Shared driver -------------------------------------------------------

bool use_avx2() {
#if CB_FUSED_X86
  static const bool ok = isa_cap() >= 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
#else
  return false;
#endif
}

// One tile expanded into `out` ([32 k][16 features] fp32), rounded to bf16 or not.
void expand_tile(Fmt fmt, const uint8_t* tile, int64_t kb, bool round, float* out) {
#if CB_FUSED_X86
  if (use_avx2()) return avx2_tile(fmt, tile, kb, round, out);
#endif
  portable_tile(fmt, tile, kb, round, out);
}

// Rows up to which the AVX2 code multiplies a tile as it expands it, never
// storing it (FmaSink): each row's sums take registers, and the store and
// reload of the expanded tile cost more than a decode step's few rows' FMAs.
constexpr int64_t kFusedRows = 4;

// expand_tile + accumulate of one tile for M <= kFusedRows rows in one pass
// where the AVX2 code runs; false elsewhere.
bool fused_tile(Fmt fmt, const uint8_t* tile, int64_t kb, bool round, const float* x, int64_t M, int64_t K,
                float* acc) {
#if CB_FUSED_X86
  if (!use_avx2()) return false;
  switch (M) {
    case 1: avx2_fused_rows<1>(fmt, tile, kb, round, x, K, acc); return true;
    case 2: avx2_fused_rows<2>(fmt, tile, kb, round, x, K, acc); return true;
    case 3: avx2_fused_rows<3>(fmt, tile, kb, round, x, K, acc); return true;
    case 4: avx2_fused_rows<4>(fmt, tile, kb, round, x, K, acc); return true;
    default: return false;
  }
#else
  return false;
#endif
}

void accumulate(const float* x, int64_t M, int64_t K, int64_t k0, int64_t kn, const float* w, float* acc) {
#if CB_FUSED_X86
  if (use_avx2()) return avx2_accumulate(x, M, K, k0, kn, w, acc);
#endif
  portable_accumulate(x, M, K, k0, kn, w, acc);
}

struct Blocks {
  Fmt fmt;
  const uint8_t* src;
  int64_t nblocks, kblocks;  // column blocks of 16 features; 32-wide k-blocks
  const uint8_t* tile(int64_t nb, int64_t kb) const { return gguf_tiles::tile_at(fmt, src, nb, kb, nblocks, kblocks); }
};

Blocks blocks_of(const at::Tensor& packed) {
  TORCH_CHECK(packed.device().is_cpu() && packed.is_contiguous(), "packed must be a contiguous CPU tensor");
  const Fmt fmt = gguf_tiles::block_fmt(packed);
  return Blocks{fmt, packed.data_ptr<uint8_t>(), packed.size(0), packed.size(1) * gguf_tiles::kblocks_per_tile(fmt)};
}

bool rounds(at::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "dtype must be float32 or bfloat16");
  return dtype == at::kBFloat16;
}

// Rows up to which int8 block activations take the integer kernels: every
// call, prefill chunks included. This file's fp32 expansion was slower at
// every row count measured (docs/benchmarks-quant.md), whereas
// avx512_linear's bf16 dot products keep up above int8_blocks::kMaxRows.
constexpr int64_t kIntMaxRows = std::numeric_limits<int64_t>::max();

// The epilogue of int8_blocks' sums: bias, then the output in x's dtype
// (bf16 rounded once).
struct IntOut {
  const float* bias;  // [N] fp32 or null
  float* y32;
  c10::BFloat16* y16;
  int64_t N;
};

void store_int_sums(const void* ctx, int64_t m0, int rows, int64_t nb, int nv, const float* sums) {
  const IntOut& o = *static_cast<const IntOut*>(ctx);
  for (int r = 0; r < rows; ++r)
    for (int v = 0; v < nv; ++v)
      for (int64_t f = 0; f < kTileN; ++f) {
        const int64_t n = (nb + v) * kTileN + f;
        if (n >= o.N) break;
        const float y = sums[(r * nv + v) * kTileN + f] + (o.bias != nullptr ? o.bias[n] : 0.0f);
        if (o.y16 != nullptr)
          o.y16[(m0 + r) * o.N + n] = c10::BFloat16(y);
        else
          o.y32[(m0 + r) * o.N + n] = y;
      }
}

}  // namespace

bool gguf_linear_avx2() { return use_avx2(); }

at::Tensor gguf_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous(), "x must be a contiguous CPU [M, K] tensor");
  const bool bf16 = rounds(x.scalar_type());
  const Blocks b = blocks_of(packed);
  gguf_tiles::check_blocks(packed, out_features, x.size(1));
  at::Tensor bias32;
  const float* bp = fp32_arith_bias(bias, out_features, bf16, bias32);
  auto y = at::empty({x.size(0), out_features}, x.options());
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  if (M == 0) return y;
  float* y32 = bf16 ? nullptr : y.data_ptr<float>();
  auto* y16 = bf16 ? reinterpret_cast<c10::BFloat16*>(y.data_ptr<c10::BFloat16>()) : nullptr;
  if (int8_blocks::takes(M, kIntMaxRows)) {  // block_activations "int8": integer dot products
    const IntOut out{bp, y32, y16, N};
    int8_blocks::multiply(x.data_ptr(), bf16, M, K, b.fmt, b.src, b.nblocks, b.kblocks, store_int_sums, &out);
    return y;
  }
  const auto x32 = bf16 ? x.to(at::kFloat) : x;  // exact
  const float* xp = x32.data_ptr<float>();
  const int64_t pairs = ceil_div(b.nblocks, 2);
  // Up to kStreamRows rows each tile's products follow its expansion (the
  // sums wait in `acc` between k-blocks); above, each column block is
  // expanded whole into `panel` ([K][16], 0.5 MB at K = 8192) and every row
  // runs its whole K over it: many rows' sums between k-blocks would no
  // longer stay in L1, and rows K apart in x map to the same L1 sets.
  constexpr int64_t kStreamRows = 2 * kMR;
  const bool whole = M > kStreamRows;
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> acc(2 * M * kTileN);
    std::vector<float> panel(whole ? K * kTileN : 0);
    alignas(64) float tile[kPanelElems];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t nb0 = 2 * p, nbs = nb0 + 1 < b.nblocks ? 2 : 1;
      std::fill(acc.begin(), acc.end(), 0.0f);
      if (whole) {
        for (int64_t i = 0; i < nbs; ++i) {
          for (int64_t kb = 0; kb < b.kblocks; ++kb)
            expand_tile(b.fmt, b.tile(nb0 + i, kb), kb, bf16, panel.data() + kb * kPanelElems);
          accumulate(xp, M, K, 0, K, panel.data(), acc.data() + i * M * kTileN);
        }
      } else {
        for (int64_t kb = 0; kb < b.kblocks; ++kb)
          for (int64_t i = 0; i < nbs; ++i) {
            float* a = acc.data() + i * M * kTileN;
            if (M <= kFusedRows && fused_tile(b.fmt, b.tile(nb0 + i, kb), kb, bf16, xp, M, K, a)) continue;
            expand_tile(b.fmt, b.tile(nb0 + i, kb), kb, bf16, tile);
            accumulate(xp, M, K, kb * kTileK, kTileK, tile, a);
          }
      }
      for (int64_t i = 0; i < nbs; ++i)
        for (int64_t r = 0; r < M; ++r)
          for (int64_t f = 0; f < kTileN; ++f) {
            const int64_t n = (nb0 + i) * kTileN + f;
            const float v = acc[(i * M + r) * kTileN + f] + (bp != nullptr ? bp[n] : 0.0f);
            if (bf16)
              y16[r * N + n] = c10::BFloat16(v);
            else
              y32[r * N + n] = v;
          }
    }
  });
  return y;
}

at::Tensor gguf_dequant(const at::Tensor& packed, at::ScalarType dtype) {
  const bool round = rounds(dtype);
  const Blocks b = blocks_of(packed);
  const int64_t N = b.nblocks * kTileN, K = b.kblocks * kTileK;
  auto out32 = at::empty({N, K}, packed.options().dtype(at::kFloat));
  float* o = out32.data_ptr<float>();
  at::parallel_for(0, b.nblocks, 1, [&](int64_t n0, int64_t n1) {
    alignas(64) float tile[kPanelElems];
    for (int64_t nb = n0; nb < n1; ++nb)
      for (int64_t kb = 0; kb < b.kblocks; ++kb) {
        expand_tile(b.fmt, b.tile(nb, kb), kb, round, tile);
        for (int64_t k = 0; k < kTileK; ++k)
          for (int64_t f = 0; f < kTileN; ++f) o[(nb * kTileN + f) * K + kb * kTileK + k] = tile[k * kTileN + f];
      }
  });
  return round ? out32.to(at::kBFloat16) : out32;  // bf16-valued: the cast is exact
}

at::Tensor gguf_embed(const at::Tensor& packed, const at::Tensor& ids, at::ScalarType dtype) {
  const bool round = rounds(dtype);
  const Blocks b = blocks_of(packed);
  TORCH_CHECK(ids.device().is_cpu() && ids.scalar_type() == at::kLong && ids.dim() == 1, "ids must be int64 [T]");
  const int64_t T = ids.size(0), K = b.kblocks * kTileK, rows = b.nblocks * kTileN;
  const auto ids_c = ids.contiguous();
  const int64_t* id = ids_c.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(0 <= id[t] && id[t] < rows, "row ", id[t], " outside [0, ", rows, ")");
  auto out32 = at::empty({T, K}, packed.options().dtype(at::kFloat));
  float* o = out32.data_ptr<float>();
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    alignas(64) float tile[kPanelElems];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t nb = id[t] / kTileN, lane = id[t] % kTileN;
      for (int64_t kb = 0; kb < b.kblocks; ++kb) {
        expand_tile(b.fmt, b.tile(nb, kb), kb, round, tile);
        for (int64_t k = 0; k < kTileK; ++k) o[t * K + kb * kTileK + k] = tile[k * kTileN + lane];
      }
    }
  });
  return round ? out32.to(at::kBFloat16) : out32;
}

}  // namespace cbserve_fused
