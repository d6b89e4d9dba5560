// Integer kernels over GGUF blocks (int8_blocks.h). The layouts are
// gguf_tiles.h's; only AVX512F/BW/VL and VNNI instructions are used here
// (CB_AVX512VNNI), so a CPU without AVX512-BF16 runs them too.

#include "int8_blocks.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <atomic>
#include <cstring>
#include <vector>

#include "bf16_vec.h"
#include "cpu_isa.h"
#include "linear_args.h"

namespace cbserve_fused {
namespace int8_blocks {

namespace {

std::atomic<bool> g_enabled{false};

#if CB_FUSED_X86

using gguf_tiles::Fmt;
constexpr int64_t kBlockK = 32;  // K elements per k-block
constexpr int64_t kBlockN = 16;  // output features per block (one vector)
constexpr int kRowBlock = 8;     // rows per register block

// The activations of M rows, quantized for the integer kernels.
struct QuantX {
  const int8_t* q8;    // Q4_1 / Q4_K / Q6_K: [M][kblocks][32] int8, in kNibbleOrder
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

// 16 consecutive values of x from fp32 or bf16 bits, as fp32 (exact).
CB_AVX512VNNI inline __m512 load_x(const void* x, bool bf16_x, int64_t at) {
  if (bf16_x) return load_bf16(static_cast<const c10::BFloat16*>(x) + at);
  return _mm512_loadu_ps(static_cast<const float*>(x) + at);
}

// Rows [0, M) of x, K = 32 * kblocks, quantized into `buf` (thread-local to
// the caller: the workers read it). `wide`: int16 (Q8_0), else int8.
CB_AVX512VNNI QuantX quantize_x(const void* x, bool bf16_x, int64_t M, int64_t K, int64_t kblocks, bool wide,
                                std::vector<int8_t>& buf) {
  const int64_t qbytes = wide ? 2 * M * K : M * K, fbytes = 3 * M * kblocks * 4;
  if (static_cast<int64_t>(buf.size()) < qbytes + fbytes + 64) buf.resize(qbytes + fbytes + 64);
  int8_t* base = buf.data();
  float* dx = reinterpret_cast<float*>(base + ((qbytes + 63) & ~int64_t(63)));
  float* sx = dx + M * kblocks;
  const __m512i order = _mm512_load_si512(kNibbleOrder);
  const float levels = wide ? 32767.f : 127.f;
  for (int64_t r = 0; r < M; ++r)
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      const __m512 lo = load_x(x, bf16_x, r * K + kb * kBlockK), hi = load_x(x, bf16_x, r * K + kb * kBlockK + 16);
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
template <Fmt F>
CB_AVX512VNNI __attribute__((always_inline)) inline void group_bytes(const uint8_t* q, int g, __m512i& lo,
                                                                     __m512i& hi) {
  const __m512i nib = _mm512_set1_epi8(0x0F);
  const __m512i gv = _mm512_loadu_si512(q + 64 * g);
  lo = _mm512_and_si512(gv, nib);
  hi = _mm512_and_si512(_mm512_srli_epi32(gv, 4), nib);
  if constexpr (F == Fmt::kQ6_K) {
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

// Hands a register block's sums to the caller's epilogue.
template <int R, int NV>
CB_AVX512VNNI __attribute__((always_inline)) inline void hand_over(__m512 (&acc)[R][NV], int64_t m0, int64_t nb,
                                                                   Store store, const void* ctx) {
  alignas(64) float sums[R * NV * kBlockN];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) _mm512_store_ps(sums + (r * NV + v) * kBlockN, acc[r][v]);
  store(ctx, m0, R, nb, NV, sums);
}

// Rows [m0, m0 + R) against feature blocks [nb, nb + NV) of a nibble_groups
// format F, with int8 x.
template <int R, int NV, Fmt F>
CB_AVX512VNNI void micro_i8(const QuantX& qx, const uint8_t* src, int64_t nblocks, int64_t kblocks, int64_t m0,
                            int64_t nb, Store store, const void* ctx) {
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
  hand_over<R, NV>(acc, m0, nb, store, ctx);
}

// Rows [m0, m0 + R) against feature blocks [nb, nb + NV) of Q8_0 blocks, with
// int16 x: k-pair j's 32 int8 weights widen to int16 in word order, and
// vpdpwssd's lane f sums words 2f and 2f + 1, feature f's two k-parities.
template <int R, int NV>
CB_AVX512VNNI void micro_i16(const QuantX& qx, int64_t K, const uint8_t* src, int64_t nblocks, int64_t kblocks,
                             int64_t m0, int64_t nb, Store store, const void* ctx) {
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
          std::memcpy(&pair, qx.q16 + (m0 + r) * K + kb * kBlockK + 2 * j, 4);
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
  hand_over<R, NV>(acc, m0, nb, store, ctx);
}

template <int R, int NV, Fmt F>
CB_AVX512VNNI void micro_int(const QuantX& qx, int64_t K, const uint8_t* src, int64_t nblocks, int64_t kblocks,
                             int64_t m0, int64_t nb, Store store, const void* ctx) {
  if constexpr (F == Fmt::kQ8_0)
    micro_i16<R, NV>(qx, K, src, nblocks, kblocks, m0, nb, store, ctx);
  else
    micro_i8<R, NV, F>(qx, src, nblocks, kblocks, m0, nb, store, ctx);
}

// Every row over blocks of format F: pairs of feature blocks per thread, row
// blocks of up to kRowBlock rows each, of even size (the pair's blocks stay
// in L1/L2 for the later ones).
template <Fmt F>
void int_rows(const QuantX& qx, int64_t M, int64_t K, const uint8_t* src, int64_t nblocks, int64_t kblocks, Store store,
              const void* ctx) {
  at::parallel_for(0, ceil_div(nblocks, 2), 1, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t nb = 2 * u;
      const bool two = nb + 1 < nblocks;
      const int64_t nrb = ceil_div(M, kRowBlock), base = M / nrb, extra = M % nrb;
      for (int64_t rb = 0, m0 = 0; rb < nrb; ++rb) {
        const int64_t rows = base + (rb < extra ? 1 : 0);
#define CB_MI(R)                                                            \
  case R:                                                                   \
    if (two)                                                                \
      micro_int<R, 2, F>(qx, K, src, nblocks, kblocks, m0, nb, store, ctx); \
    else                                                                    \
      micro_int<R, 1, F>(qx, K, src, nblocks, kblocks, m0, nb, store, ctx); \
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
#endif

}  // namespace

void set_enabled(bool on) { g_enabled.store(on); }

bool enabled() { return g_enabled.load(); }

bool takes(int64_t M, int64_t max_rows) { return M <= max_rows && g_enabled.load() && has_avx512_vnni(); }

void multiply(const void* x, bool bf16_x, int64_t M, int64_t K, gguf_tiles::Fmt fmt, const uint8_t* src,
              int64_t nblocks, int64_t kblocks, Store store, const void* ctx) {
  TORCH_CHECK(takes(0), "int8_blocks::multiply: int8 activations off, or no AVX512-VNNI");
  TORCH_CHECK(K == kblocks * gguf_tiles::kTileK, "int8_blocks::multiply: K must be 32 x k-blocks");
  if (M == 0) return;
#if CB_FUSED_X86
  thread_local std::vector<int8_t> buf;
  const QuantX qx = quantize_x(x, bf16_x, M, K, kblocks, fmt == Fmt::kQ8_0, buf);
  switch (fmt) {
    case Fmt::kQ4_1: int_rows<Fmt::kQ4_1>(qx, M, K, src, nblocks, kblocks, store, ctx); break;
    case Fmt::kQ4_K: int_rows<Fmt::kQ4_K>(qx, M, K, src, nblocks, kblocks, store, ctx); break;
    case Fmt::kQ6_K: int_rows<Fmt::kQ6_K>(qx, M, K, src, nblocks, kblocks, store, ctx); break;
    case Fmt::kQ8_0: int_rows<Fmt::kQ8_0>(qx, M, K, src, nblocks, kblocks, store, ctx); break;
    default: TORCH_CHECK(false, "int8_blocks::multiply: bf16 tiles are not blocks");
  }
#endif
}

}  // namespace int8_blocks

bool avx512_int8_supported() { return has_avx512_vnni(); }

void set_block_activations(const std::string& kind) {
  TORCH_CHECK(kind == "bf16" || kind == "int8", "block activations must be 'bf16' or 'int8', not '", kind, "'");
  int8_blocks::set_enabled(kind == "int8");
}

std::string block_activations() { return int8_blocks::enabled() ? "int8" : "bf16"; }

}  // namespace cbserve_fused
