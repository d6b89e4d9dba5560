// y = x · wᵀ (+ bias) in bf16 with AVX512-BF16 dot products, for CPUs
// without AMX (AMD Zen 4 and later, Intel Cooper Lake).
//
// There, oneDNN's prepacked bf16 kernels run the decode-sized shapes well
// below both the memory and the vdpbf16ps roofs (docs/native.md). The weights are packed once into the AMX tile layout
// (amx_pack_weight: [N/16][K/32][16 k-pairs][16 n][2]), which is also the
// layout VDPBF16PS wants: one k-pair of 16 output features is one 64-byte
// vector, and one feature block's whole K sweep is contiguous. A register
// block of up to kMR rows of x by kNV feature blocks (24 fp32 accumulators)
// takes, per k-pair, kNV weight vectors and one broadcast pair of x per row;
// each thread sweeps its contiguous share of feature blocks front to back, all
// rows of x per group of blocks (the group's weights stay in L1/L2 for the
// later row blocks; its row blocks prefetch the next group's into L2, each a
// share), so the weights stream from memory once per call.
//
// avx512_linear_silu_mul is the MLP's gate|up projection with the act-and-mul
// epilogue (SiLU or GELU-tanh) (weights from amx_pack_gate_up: gate block j, then up block j), as
// amx_linear_silu_mul: the [M, 2I] projection is never written.
//
// The weights may also stay in a GGUF file's Q4_1 / Q8_0 / Q4_K / Q6_K blocks (uint8,
// packed by executor/cpu/gguf_weights.py as for amx_linear): run_blocks
// expands them to the same bf16 tiles (gguf_tiles.h) a pair of feature blocks
// at a time and runs the same loop, so the outputs equal the bf16 weights'.
//
// bf16 x only; callers check `avx512_linear_supported()`.

#include "avx512_linear.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_vec.h"
#include "cpu_isa.h"
#include "gguf_tiles.h"
#include "linear_args.h"

namespace cbserve_fused {

namespace {

constexpr int64_t kBlockN = 16;  // output features per block (one vector)
constexpr int64_t kBlockK = 32;  // K elements per tile of the packed layout
constexpr int64_t kTileElems = kBlockK * kBlockN;
constexpr int kMR = 6;  // rows of x per register block
constexpr int kNV = 4;  // feature blocks per register block
// Rows up to which blocks are expanded in registers, one register block of
// two feature blocks (16 accumulators; more rows spill). Above, expanding a
// pair once into a buffer and running the bf16 loop costs about what two
// register passes do (docs/quantization.md).
constexpr int kMQ = 8;

#if CB_FUSED_X86

// The pair (x[2p], x[2p + 1]) as one 32-bit lane value.
inline int32_t pair_at(const uint16_t* x, int64_t p) {
  int32_t v;
  std::memcpy(&v, x + 2 * p, 4);
  return v;
}

struct Args {
  const uint16_t* x;     // [M, K]
  const uint16_t* w;     // packed tiles
  const uint16_t* bias;  // [N] or null
  uint16_t* y;           // [M, N], or [M, N / 2] with silu
  int64_t M, K, N;
  int64_t panel;  // elements of one feature block's K sweep
  bool silu;      // gate|up pairs: y = act(gate) * up
  Act act = Act::kSilu;
  bool prefetch = true;  // pull the next group's weights toward L2 (not for expanded blocks)
};

// acc[r][v] += k-pair p of rows [0, R) of x against blocks [0, NV) of w;
// LAST: the odd K's final pair, x[K - 1] and the packing's zero.
template <int R, int NV, bool LAST>
CB_AVX512BF16 __attribute__((always_inline)) inline void kpair(__m512 (&acc)[R][NV], const uint16_t* w, int64_t panel,
                                                               const uint16_t* x, int64_t K, int64_t p) {
  __m512bh wv[NV];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(w + v * panel + p * 2 * kBlockN);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512bh xb =
        (__m512bh)_mm512_set1_epi32(LAST ? static_cast<int32_t>(x[r * K + K - 1]) : pair_at(x + r * K, p));
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], wv[v], xb);
  }
}

// The epilogue of rows [m0, m0 + R) against feature blocks [nb, nb + NV):
// act(gate) * up of (gate, up) block pairs, or the sums plus bias.
template <int R, int NV>
CB_AVX512BF16 __attribute__((always_inline)) inline void store_rows(const Args& a, __m512 (&acc)[R][NV], int64_t m0,
                                                                    int64_t nb) {
  if (a.silu) {  // blocks (gate j, up j) side by side; NV is even here
    const int64_t I = a.N / 2;
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
      for (int v = 0; v + 1 < NV; v += 2) {
        const int64_t f0 = (nb + v) / 2 * kBlockN;
        store_bf16(reinterpret_cast<c10::BFloat16*>(a.y + (m0 + r) * I + f0),
                   act_mul(a.act, round_bf16(acc[r][v]), round_bf16(acc[r][v + 1])), 0xFFFF);
      }
    return;
  }
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    const int64_t n0 = (nb + v) * kBlockN;
    const __mmask16 m = lanes(a.N - n0);
    const __m512 b = bias_lanes(a.bias, n0, m);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
      store_bf16(reinterpret_cast<c10::BFloat16*>(a.y + (m0 + r) * a.N + n0), _mm512_add_ps(acc[r][v], b), m);
  }
}

// Rows [m0, m0 + R) of x against feature blocks [nb, nb + NV). Row block
// `rb` of `nrb` pulls its share of the next group's weights toward L2 as it
// goes: spread over all of the group's row blocks, the group's DRAM traffic
// runs at an even rate instead of a burst in its first row block (which, at
// 12-24 rows, asks for more than a core's share of the memory bandwidth and
// stalls on full miss buffers).
template <int R, int NV>
CB_AVX512BF16 void micro(const Args& a, const uint16_t* w, int64_t m0, int64_t nb, int64_t rb, int64_t nrb) {
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const uint16_t* x = a.x + m0 * a.K;
  const int64_t pairs = a.K / 2;
  // Lines [q, q_end) of each of the next group's feature blocks, one every
  // nrb-th k-pair on average (past the last group: a prefetch never faults;
  // integer addresses, no out-of-range pointers).
  const uintptr_t pf = reinterpret_cast<uintptr_t>(w) + NV * a.panel * 2;
  const int64_t q_end = (rb + 1) * pairs / nrb;
  int64_t q = rb * pairs / nrb, credit = 0;
  const int64_t share = q_end - q;
  for (int64_t p = 0; p < pairs; ++p) {
    credit += share;
    if (a.prefetch && credit >= pairs) {
      credit -= pairs;
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        _mm_prefetch(reinterpret_cast<const char*>(pf + (v * a.panel + q * 2 * kBlockN) * 2), _MM_HINT_T1);
      ++q;
    }
    kpair<R, NV, false>(acc, w, a.panel, x, a.K, p);
  }
  if (a.K & 1) kpair<R, NV, true>(acc, w, a.panel, x, a.K, pairs);  // x[K - 1] and the packing's zero
  store_rows<R, NV>(a, acc, m0, nb);
}

// acc[r][v] += k-pair p of rows [0, R) of x against the weight vectors wv.
template <int R, int NV>
CB_AVX512BF16 __attribute__((always_inline)) inline void dots(__m512 (&acc)[R][NV], const __m512bh (&wv)[NV],
                                                              const uint16_t* x, int64_t K, int64_t p) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair_at(x + r * K, p));
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], wv[v], xb);
  }
}

// Rows [m0, m0 + R) of x against feature blocks [nb, nb + NV) straight from
// their GGUF blocks (format F): each k-pair's weight vector is
// expanded in registers by dequant_tile's own row functions (group_row /
// q8_row, so to the same bf16 values) and goes into the dot products
// without a store. For decode-sized M the expansion is then the only work
// besides reading the blocks.
template <int R, int NV, gguf_tiles::Fmt F>
CB_AVX512BF16 void micro_q(const Args& a, const uint8_t* src, int64_t nblocks, int64_t kblocks, int64_t m0,
                           int64_t nb) {
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const uint16_t* x = a.x + m0 * a.K;
  const __m512 q16 = gguf_tiles::q4_table();
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    const uint8_t* tile[NV];
    const uint8_t* t[NV];
    gguf_tiles::TileScales sc[NV];
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      tile[v] = gguf_tiles::tile_at(F, src, nb + v, kb, nblocks, kblocks);
      t[v] = gguf_tiles::tile_q(F, tile[v], kb);
      sc[v] = gguf_tiles::tile_scales(F, tile[v], kb);
    }
    const int64_t p0 = kb * (kBlockK / 2);
    if (gguf_tiles::nibble_groups(F)) {
      for (int g = 0; g < 4; ++g) {                 // k-pair 4g + j: byte j of each lane of group g
        if (F == gguf_tiles::Fmt::kQ6_K && g == 2)  // k-pairs 8..15: a Q6_K block's second 16 weights
          for (int v = 0; v < NV; ++v) sc[v] = gguf_tiles::tile_scales(F, tile[v], kb, 1);
        __m512i gv[NV], hv[NV];
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) {
          gv[v] = _mm512_loadu_si512(t[v] + 64 * g);
          hv[v] = gguf_tiles::group_high<F>(t[v], g);
        }
#define CB_GROUP_PAIR(j)                                                                        \
  do {                                                                                          \
    __m512bh wv[NV];                                                                            \
    for (int v = 0; v < NV; ++v) wv[v] = gguf_tiles::group_row<F, j>(gv[v], hv[v], q16, sc[v]); \
    dots<R, NV>(acc, wv, x, a.K, p0 + 4 * g + (j));                                             \
  } while (0)
        CB_GROUP_PAIR(0);
        CB_GROUP_PAIR(1);
        CB_GROUP_PAIR(2);
        CB_GROUP_PAIR(3);
#undef CB_GROUP_PAIR
      }
    } else {
#pragma GCC unroll 2
      for (int j = 0; j < 16; ++j) {  // k-pair j: the tile's 32 bytes at 32 j
        __m512bh wv[NV];
#pragma GCC unroll 2
        for (int v = 0; v < NV; ++v) wv[v] = gguf_tiles::q8_row(t[v] + 32 * j, sc[v]);
        dots<R, NV>(acc, wv, x, a.K, p0 + j);
      }
    }
  }
  store_rows<R, NV>(a, acc, m0, nb);
}

// Up to kMQ rows over blocks of format F: pairs of feature blocks per
// thread, micro_q for each, one register block of all the rows.
template <gguf_tiles::Fmt F>
void few_rows(const Args& a, const uint8_t* src, int64_t nblocks, int64_t kblocks) {
  at::parallel_for(0, ceil_div(nblocks, 2), 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t nb = 2 * u;
      const bool two = nb + 1 < nblocks;
#define CB_MQ(R)                                         \
  case R:                                                \
    if (two)                                             \
      micro_q<R, 2, F>(a, src, nblocks, kblocks, 0, nb); \
    else                                                 \
      micro_q<R, 1, F>(a, src, nblocks, kblocks, 0, nb); \
    break;
      switch (a.M) {
        CB_MQ(1)
        CB_MQ(2)
        CB_MQ(3)
        CB_MQ(4)
        CB_MQ(5)
        CB_MQ(6)
        CB_MQ(7)
        CB_MQ(8)
        default: break;
      }
#undef CB_MQ
    }
  });
}

// ---- int8 activations (block_activations "int8", AVX512-VNNI CPUs) ----
//
// Up to kMI8 rows, x is rounded per 32-wide k-block to integers with one
// fp32 scale each, x̂ = dx * q (dx = max|x| / L, q = rne(x * L / max|x|)),
// as llama.cpp's Q8_0 activations, and each tile's products are integer dot
// products: vpdpbusd of the 4-bit (Q6_K: 6-bit) unsigned weights against
// int8 q (L = 127) for the nibble_groups formats, vpdpwssd of Q8_0's int8
// weights against int16 q (L = 32767). Each k-block's integer sums are then
// scaled by the weights' d (and the m term, m * dx * Σq) in fp32. So the
// outputs are w · x̂ with the blocks' exact w, up to fp32 rounding, no longer
// the bf16 model's bit for bit; docs/quantization.md states the bounds.

// The activations of up to kMI8 rows, quantized for the integer kernels.
struct QuantX {
  const int8_t* q8;    // nibble formats: [M][kblocks][32] int8, in nibble_order
  const int16_t* q16;  // Q8_0: [M][K] int16
  const float* dx;     // [M][kblocks] scales
  const float* sx;     // [M][kblocks][2]: dx * Σq over each 16-wide half
};

// Byte j of a k-block's 32 int8 for the nibble kernels holds x(8g + 2R + p)
// for j = 8g + 4p + R: a group g's 8 bytes are the lane words of k-parity
// 0 and 1 (bytes R: k-pair 4g + R), as one 64-bit broadcast. Per 16-wide half.
alignas(64) constexpr int32_t kNibbleOrder[16] = {0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15};
// A feature's two k-parity lanes (words 2f, 2f + 1 of the low / high nibbles).
alignas(64) constexpr int32_t kEvenWords[16] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
alignas(64) constexpr int32_t kOddWords[16] = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
constexpr int kMI8 = 16;  // rows up to which the int8 kernels run

// Rows [0, M) of bf16 x, K = 32 * kblocks, quantized into `buf` (thread-local
// to the caller: the workers read it). `wide`: int16 (Q8_0), else int8.
CB_AVX512VNNI QuantX quantize_x(const Args& a, int64_t kblocks, bool wide, std::vector<int8_t>& buf) {
  const int64_t M = a.M, K = a.K;
  const int64_t qbytes = wide ? 2 * M * K : M * K, fbytes = 3 * M * kblocks * 4;
  if (static_cast<int64_t>(buf.size()) < qbytes + fbytes + 64) buf.resize(qbytes + fbytes + 64);
  int8_t* base = buf.data();
  float* dx = reinterpret_cast<float*>(base + ((qbytes + 63) & ~int64_t(63)));
  float* sx = dx + M * kblocks;
  const __m512i order = _mm512_load_si512(kNibbleOrder);
  const float levels = wide ? 32767.f : 127.f;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      const c10::BFloat16* xp = reinterpret_cast<const c10::BFloat16*>(a.x + r * K + kb * kBlockK);
      const __m512 lo = load_bf16(xp), hi = load_bf16(xp + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const float d = amax / levels, inv = amax > 0.f ? levels / amax : 0.f;
      const __m512i ql = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(inv)));
      const __m512i qh = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(inv)));
      const int64_t i = r * kblocks + kb;
      dx[i] = d;
      sx[2 * i] = d * static_cast<float>(_mm512_reduce_add_epi32(ql));
      sx[2 * i + 1] = d * static_cast<float>(_mm512_reduce_add_epi32(qh));
      if (wide) {
        int16_t* q = reinterpret_cast<int16_t*>(base) + r * K + kb * kBlockK;
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), _mm512_cvtsepi32_epi16(ql));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16), _mm512_cvtsepi32_epi16(qh));
      } else {
        int8_t* q = base + i * kBlockK;
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtsepi32_epi8(_mm512_permutexvar_epi32(order, ql)));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 16),
                         _mm512_cvtsepi32_epi8(_mm512_permutexvar_epi32(order, qh)));
      }
    }
  return QuantX{base, reinterpret_cast<const int16_t*>(base), dx, sx};
}

// Group g's weights of a nibble_groups k-block as unsigned bytes: lo for the
// low nibbles (features 0..7), hi for the high (features 8..15); Q6_K adds
// its two high bits (bits 4-5 of each byte: q + 32, 0..63).
template <gguf_tiles::Fmt F>
CB_AVX512VNNI __attribute__((always_inline)) inline void group_bytes(const uint8_t* q, int g, __m512i& lo,
                                                                     __m512i& hi) {
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i gv = _mm512_loadu_si512(q + 64 * g);
  lo = _mm512_and_si512(gv, nib);
  hi = _mm512_and_si512(_mm512_srli_epi32(gv, 4), nib);
  if constexpr (F == gguf_tiles::Fmt::kQ6_K) {
    // Lane bits 4R + 2h: k-pair 4g + R, half h. Spread 4-bit field R to byte R.
    __m512i t = gguf_tiles::q6_high(q, g);
    t = _mm512_and_si512(_mm512_or_si512(t, _mm512_slli_epi32(t, 8)), _mm512_set1_epi32(0x00FF00FF));
    t = _mm512_and_si512(_mm512_or_si512(t, _mm512_slli_epi32(t, 4)), _mm512_set1_epi32(0x0F0F0F0F));
    const __m512i two = _mm512_set1_epi8(0x30);
    lo = _mm512_or_si512(lo, _mm512_and_si512(_mm512_slli_epi32(t, 4), two));
    hi = _mm512_or_si512(hi, _mm512_and_si512(_mm512_slli_epi32(t, 2), two));
  }
}

// A k-block's per-feature sums from the two nibble accumulators (lane j:
// feature j / 2, k-parity j % 2), as fp32 in feature order.
CB_AVX512VNNI __attribute__((always_inline)) inline __m512 feature_sums(__m512i lo, __m512i hi, __m512i even,
                                                                        __m512i odd) {
  return _mm512_cvtepi32_ps(
      _mm512_add_epi32(_mm512_permutex2var_epi32(lo, even, hi), _mm512_permutex2var_epi32(lo, odd, hi)));
}

// Rows [m0, m0 + R) against feature blocks [nb, nb + NV) of a nibble_groups
// format F, with int8 x.
template <int R, int NV, gguf_tiles::Fmt F>
CB_AVX512VNNI void micro_i8(const Args& a, const QuantX& qx, const uint8_t* src, int64_t nblocks, int64_t kblocks,
                            int64_t m0, int64_t nb) {
  using gguf_tiles::Fmt;
  __m512 acc[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const __m512i even = _mm512_load_si512(kEvenWords), odd = _mm512_load_si512(kOddWords);
  for (int64_t kb = 0; kb < kblocks; ++kb) {
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      const uint8_t* tile = gguf_tiles::tile_at(F, src, nb + v, kb, nblocks, kblocks);
      const uint8_t* q = gguf_tiles::tile_q(F, tile, kb);
      __m512i lo[4], hi[4];
#pragma GCC unroll 4
      for (int g = 0; g < 4; ++g) group_bytes<F>(q, g, lo[g], hi[g]);
      __m512 d0, d1 = _mm512_setzero_ps(), m0v = _mm512_setzero_ps(), m1v = _mm512_setzero_ps();
      if constexpr (F == Fmt::kQ4_1) {
        d0 = gguf_tiles::f16_ps(tile + 256);
        m0v = gguf_tiles::f16_ps(tile + 288);
      } else if constexpr (F == Fmt::kQ4_K) {
        const int64_t sub = kb % gguf_tiles::kQ4KSub, s0 = gguf_tiles::kQ4KSub * 256;
        d0 = _mm512_mul_ps(gguf_tiles::f16_ps(tile + s0), gguf_tiles::u8_ps(tile + s0 + 64 + 16 * sub));
        m0v = _mm512_sub_ps(_mm512_setzero_ps(), _mm512_mul_ps(gguf_tiles::f16_ps(tile + s0 + 32),
                                                               gguf_tiles::u8_ps(tile + s0 + 64 + 128 + 16 * sub)));
      } else {  // Q6_K: w = (d * sc_h) * (u - 32) per 16-wide half h
        const int64_t s0 = gguf_tiles::kQ4KSub * gguf_tiles::kQ6KSubBytes, sub = kb % gguf_tiles::kQ4KSub;
        const __m512 d = gguf_tiles::f16_ps(tile + s0);
        d0 = _mm512_mul_ps(d, gguf_tiles::i8_ps(tile + s0 + 32 + 16 * (2 * sub)));
        d1 = _mm512_mul_ps(d, gguf_tiles::i8_ps(tile + s0 + 32 + 16 * (2 * sub + 1)));
        m0v = _mm512_mul_ps(d0, _mm512_set1_ps(-32.f));
        m1v = _mm512_mul_ps(d1, _mm512_set1_ps(-32.f));
      }
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * kblocks + kb;
        const int8_t* xr = qx.q8 + i * kBlockK;
        __m512i xg[4];
#pragma GCC unroll 4
        for (int g = 0; g < 4; ++g) {
          int64_t w;
          std::memcpy(&w, xr + 8 * g, 8);
          xg[g] = _mm512_set1_epi64(w);
        }
        const __m512 dx = _mm512_set1_ps(qx.dx[i]);
        if constexpr (F == Fmt::kQ6_K) {
          __m512i l0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], xg[0]);
          __m512i h0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[0], xg[0]);
          l0 = _mm512_dpbusd_epi32(l0, lo[1], xg[1]);
          h0 = _mm512_dpbusd_epi32(h0, hi[1], xg[1]);
          __m512i l1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[2], xg[2]);
          __m512i h1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[2], xg[2]);
          l1 = _mm512_dpbusd_epi32(l1, lo[3], xg[3]);
          h1 = _mm512_dpbusd_epi32(h1, hi[3], xg[3]);
          acc[r][v] = _mm512_fmadd_ps(feature_sums(l0, h0, even, odd), _mm512_mul_ps(d0, dx), acc[r][v]);
          acc[r][v] = _mm512_fmadd_ps(feature_sums(l1, h1, even, odd), _mm512_mul_ps(d1, dx), acc[r][v]);
          acc[r][v] = _mm512_fmadd_ps(m0v, _mm512_set1_ps(qx.sx[2 * i]), acc[r][v]);
          acc[r][v] = _mm512_fmadd_ps(m1v, _mm512_set1_ps(qx.sx[2 * i + 1]), acc[r][v]);
        } else {
          __m512i l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[0], xg[0]);
          __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), hi[0], xg[0]);
#pragma GCC unroll 3
          for (int g = 1; g < 4; ++g) {
            l = _mm512_dpbusd_epi32(l, lo[g], xg[g]);
            h = _mm512_dpbusd_epi32(h, hi[g], xg[g]);
          }
          acc[r][v] = _mm512_fmadd_ps(feature_sums(l, h, even, odd), _mm512_mul_ps(d0, dx), acc[r][v]);
          acc[r][v] = _mm512_fmadd_ps(m0v, _mm512_set1_ps(qx.sx[2 * i] + qx.sx[2 * i + 1]), acc[r][v]);
        }
      }
    }
  }
  store_rows<R, NV>(a, acc, m0, nb);
}

// Rows [m0, m0 + R) against feature blocks [nb, nb + NV) of Q8_0 blocks, with
// int16 x: k-pair j's 32 int8 weights widen to int16 in word order, and
// vpdpwssd's lane f sums words 2f and 2f + 1, feature f's two k-parities.
template <int R, int NV>
CB_AVX512VNNI void micro_i16(const Args& a, const QuantX& qx, const uint8_t* src, int64_t nblocks, int64_t kblocks,
                             int64_t m0, int64_t nb) {
  using gguf_tiles::Fmt;
  __m512 acc[R][NV];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < kblocks; ++kb) {
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) {
      const uint8_t* tile = gguf_tiles::tile_at(Fmt::kQ8_0, src, nb + v, kb, nblocks, kblocks);
      __m512i s[R];
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) s[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int j = 0; j < 16; ++j) {
        const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + 32 * j)));
#pragma GCC unroll 16
        for (int r = 0; r < R; ++r) {
          int32_t pair;
          std::memcpy(&pair, qx.q16 + (m0 + r) * a.K + kb * kBlockK + 2 * j, 4);
          s[r] = _mm512_dpwssd_epi32(s[r], w, _mm512_set1_epi32(pair));
        }
      }
      const __m512 d = gguf_tiles::f16_ps(tile + 512);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        acc[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r]),
                                    _mm512_mul_ps(d, _mm512_set1_ps(qx.dx[(m0 + r) * kblocks + kb])), acc[r][v]);
    }
  }
  store_rows<R, NV>(a, acc, m0, nb);
}

template <int R, int NV, gguf_tiles::Fmt F>
CB_AVX512VNNI void micro_int(const Args& a, const QuantX& qx, const uint8_t* src, int64_t nblocks, int64_t kblocks,
                             int64_t m0, int64_t nb) {
  if constexpr (F == gguf_tiles::Fmt::kQ8_0)
    micro_i16<R, NV>(a, qx, src, nblocks, kblocks, m0, nb);
  else
    micro_i8<R, NV, F>(a, qx, src, nblocks, kblocks, m0, nb);
}

// Up to kMI8 rows over blocks of format F with integer dot products: pairs
// of feature blocks per thread, row blocks of up to 8 rows each (the pair's
// blocks stay in L1/L2 for the second).
template <gguf_tiles::Fmt F>
void int_rows(const Args& a, const QuantX& qx, const uint8_t* src, int64_t nblocks, int64_t kblocks) {
  at::parallel_for(0, ceil_div(nblocks, 2), 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t nb = 2 * u;
      const bool two = nb + 1 < nblocks;
      const int64_t nrb = ceil_div(a.M, 8), base = a.M / nrb, extra = a.M % nrb;
      for (int64_t rb = 0, m0 = 0; rb < nrb; ++rb) {
        const int64_t rows = base + (rb < extra ? 1 : 0);
#define CB_MI(R)                                                \
  case R:                                                       \
    if (two)                                                    \
      micro_int<R, 2, F>(a, qx, src, nblocks, kblocks, m0, nb); \
    else                                                        \
      micro_int<R, 1, F>(a, qx, src, nblocks, kblocks, m0, nb); \
    break;
        switch (rows) {
          CB_MI(1)
          CB_MI(2)
          CB_MI(3)
          CB_MI(4)
          CB_MI(5)
          CB_MI(6)
          CB_MI(7)
          CB_MI(8)
          default: break;
        }
#undef CB_MI
        m0 += rows;
      }
    }
  });
}

std::atomic<bool> g_int8_activations{false};

// Whether run_blocks takes the integer kernels for M rows.
bool int_activations(int64_t M) { return M <= kMI8 && g_int8_activations.load() && has_avx512_vnni(); }

void run_int(const Args& a, gguf_tiles::Fmt fmt, const uint8_t* src, int64_t nblocks, int64_t kblocks) {
  thread_local std::vector<int8_t> buf;
  const QuantX qx = quantize_x(a, kblocks, fmt == gguf_tiles::Fmt::kQ8_0, buf);
  switch (fmt) {
    case gguf_tiles::Fmt::kQ4_1: int_rows<gguf_tiles::Fmt::kQ4_1>(a, qx, src, nblocks, kblocks); break;
    case gguf_tiles::Fmt::kQ4_K: int_rows<gguf_tiles::Fmt::kQ4_K>(a, qx, src, nblocks, kblocks); break;
    case gguf_tiles::Fmt::kQ6_K: int_rows<gguf_tiles::Fmt::kQ6_K>(a, qx, src, nblocks, kblocks); break;
    default: int_rows<gguf_tiles::Fmt::kQ8_0>(a, qx, src, nblocks, kblocks); break;
  }
}

// Every row of x against feature blocks [nb, nb + NV), whose panels start at
// `w`, in ceil(M / kMR) row blocks of even size (8 rows: 4 + 4, not 6 + 2):
// each row block issues an equal share of the next group's prefetches, so
// they must take equal time.
template <int NV>
CB_AVX512BF16 void all_rows(const Args& a, const uint16_t* w, int64_t nb) {
  const int64_t nrb = ceil_div(a.M, kMR), base = a.M / nrb, extra = a.M % nrb;
  for (int64_t rb = 0, m0 = 0; rb < nrb; ++rb) {
    const int64_t rows = base + (rb < extra ? 1 : 0);
    switch (rows) {
      case 1: micro<1, NV>(a, w, m0, nb, rb, nrb); break;
      case 2: micro<2, NV>(a, w, m0, nb, rb, nrb); break;
      case 3: micro<3, NV>(a, w, m0, nb, rb, nrb); break;
      case 4: micro<4, NV>(a, w, m0, nb, rb, nrb); break;
      case 5: micro<5, NV>(a, w, m0, nb, rb, nrb); break;
      default: micro<kMR, NV>(a, w, m0, nb, rb, nrb); break;
    }
    m0 += rows;
  }
}

// Feature blocks [b0, b1), kNV at a time (the rest in smaller groups).
CB_AVX512BF16 void blocks(const Args& a, int64_t b0, int64_t b1) {
  int64_t nb = b0;
  for (; nb + kNV <= b1; nb += kNV) all_rows<kNV>(a, a.w + nb * a.panel, nb);
  switch (b1 - nb) {
    case 1: all_rows<1>(a, a.w + nb * a.panel, nb); break;
    case 2: all_rows<2>(a, a.w + nb * a.panel, nb); break;
    case 3: all_rows<3>(a, a.w + nb * a.panel, nb); break;
    default: break;
  }
}

Args make_args(const torch::Tensor& x, int64_t N, const uint16_t* bias, torch::Tensor& y, bool silu, Act act) {
  Args a;
  a.M = x.size(0);
  a.K = x.size(1);
  a.N = N;
  a.x = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  a.w = nullptr;
  a.bias = bias;
  a.y = reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>());
  a.silu = silu;
  a.act = act;
  return a;
}

void run(const torch::Tensor& x, const torch::Tensor& packed, int64_t N, const uint16_t* bias, torch::Tensor& y,
         bool silu, Act act = Act::kSilu) {
  Args a = make_args(x, N, bias, y, silu, act);
  a.w = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  a.panel = packed.size(1) * kTileElems;
  if (a.M == 0) return;
  const int64_t nblocks = ceil_div(N, kBlockN);
  // A fixed contiguous share of units per thread (a unit: one block, or a
  // (gate, up) pair). Claiming runs of blocks from an atomic counter, as
  // amx_linear does, was slower here, alone and in the server: runs of whole
  // 4-block groups split the small layers unevenly.
  const int64_t unit = silu ? 2 : 1;
  at::parallel_for(0, nblocks / unit, 1, [&](int64_t u0, int64_t u1) { blocks(a, u0 * unit, u1 * unit); });
}

// Over GGUF blocks (gguf_tiles.h): a thread takes pairs of feature blocks
// (the blocks are stored pair-major, and a (gate, up) pair of
// amx_pack_gate_up's order is one). Up to kMQ rows (one register block) it
// expands each k-pair in registers as it multiplies (micro_q); with more, it
// expands the pair's whole K sweep once into two bf16 panels of its own
// buffer (L2-sized: 2 KB per 32 of K) and runs the bf16 loop over them for
// every row block. Either way the expanded weights equal amx_pack_weight's
// tiles of the bf16 model, and each output sums the same products in the
// same order as avx512_linear's over those tiles: equal bit for bit.
void run_blocks(const torch::Tensor& x, const torch::Tensor& packed, int64_t N, const uint16_t* bias, torch::Tensor& y,
                bool silu, Act act = Act::kSilu) {
  Args a = make_args(x, N, bias, y, silu, act);
  a.prefetch = false;
  const gguf_tiles::Fmt fmt = gguf_tiles::block_fmt(packed);
  const int64_t nblocks = packed.size(0), kblocks = packed.size(1) * gguf_tiles::kblocks_per_tile(fmt);
  a.panel = kblocks * kTileElems;
  if (a.M == 0) return;
  const uint8_t* src = packed.data_ptr<uint8_t>();
  if (int_activations(a.M)) return run_int(a, fmt, src, nblocks, kblocks);
  if (a.M <= kMQ) {  // decode sizes: expand in registers, one row block
    switch (fmt) {
      case gguf_tiles::Fmt::kQ4_1: few_rows<gguf_tiles::Fmt::kQ4_1>(a, src, nblocks, kblocks); break;
      case gguf_tiles::Fmt::kQ4_K: few_rows<gguf_tiles::Fmt::kQ4_K>(a, src, nblocks, kblocks); break;
      case gguf_tiles::Fmt::kQ6_K: few_rows<gguf_tiles::Fmt::kQ6_K>(a, src, nblocks, kblocks); break;
      default: few_rows<gguf_tiles::Fmt::kQ8_0>(a, src, nblocks, kblocks); break;
    }
    return;
  }
  at::parallel_for(0, ceil_div(nblocks, 2), 1, [&](int64_t u0, int64_t u1) {
    thread_local std::vector<uint16_t> buf;
    if (static_cast<int64_t>(buf.size()) < 2 * a.panel) buf.resize(2 * a.panel);
    uint16_t* panels = buf.data();
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t nb = 2 * u, nv = std::min<int64_t>(2, nblocks - nb);
      for (int64_t v = 0; v < nv; ++v)
        for (int64_t kb = 0; kb < kblocks; ++kb)
          gguf_tiles::dequant_tile(fmt, gguf_tiles::tile_at(fmt, src, nb + v, kb, nblocks, kblocks),
                                   panels + v * a.panel + kb * kTileElems, kb);
      if (nv == 2)
        all_rows<2>(a, panels, nb);
      else
        all_rows<1>(a, panels, nb);
    }
  });
}
#endif

// Whether `packed` holds GGUF blocks (uint8) rather than bf16 tiles; checks
// either layout against x and the output features.
bool check_args(const torch::Tensor& x, const torch::Tensor& packed, int64_t n_features) {
  TORCH_CHECK(avx512_linear_supported(), "avx512_linear needs an AVX512-BF16 CPU");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "x and packed must be CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "avx512_linear takes bf16 x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.size(1) > 0, "x must have K > 0");
  TORCH_CHECK(packed.is_contiguous(), "packed must be contiguous");
  if (packed.scalar_type() == at::kByte) {
    gguf_tiles::check_blocks(packed, n_features, x.size(1));
    return true;
  }
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16,
              "packed must be amx_pack_weight's bf16 tiles or GGUF blocks (uint8) from executor/cpu/gguf_weights.py");
  check_bf16_tiles(packed, n_features, x.size(1));
  return false;
}

}  // namespace

bool avx512_linear_supported() { return has_avx512_bf16(); }

bool avx512_int8_supported() { return has_avx512_vnni(); }

void set_block_activations(const std::string& kind) {
  TORCH_CHECK(kind == "bf16" || kind == "int8", "block activations must be 'bf16' or 'int8', not '", kind, "'");
#if CB_FUSED_X86
  g_int8_activations.store(kind == "int8");
#endif
}

std::string block_activations() {
#if CB_FUSED_X86
  if (g_int8_activations.load()) return "int8";
#endif
  return "bf16";
}

torch::Tensor avx512_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                            const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(out_features > 0, "out_features must be positive");
  const bool blocks = check_args(x, packed, out_features);
  const uint16_t* bp = bf16_bias(bias, out_features);
  auto y = torch::empty({x.size(0), out_features}, x.options());
#if CB_FUSED_X86
  if (blocks)
    run_blocks(x, packed, out_features, bp, y, false);
  else
    run(x, packed, out_features, bp, y, false);
#endif
  return y;
}

torch::Tensor avx512_linear_silu_mul(const torch::Tensor& x, const torch::Tensor& packed, int64_t inter,
                                     const std::string& activation) {
  const Act act = parse_act(activation);
  TORCH_CHECK(inter > 0 && inter % kBlockN == 0, "inter must be a positive multiple of 16");
  const bool blocks = check_args(x, packed, 2 * inter);
  auto y = torch::empty({x.size(0), inter}, x.options());
#if CB_FUSED_X86
  if (blocks)
    run_blocks(x, packed, 2 * inter, nullptr, y, true, act);
  else
    run(x, packed, 2 * inter, nullptr, y, true, act);
#endif
  return y;
}

}  // namespace cbserve_fused
