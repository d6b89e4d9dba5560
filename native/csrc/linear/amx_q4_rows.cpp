// Q4_1 linear layer for decode-sized batches (M <= 32) with the weights as
// AMX's A operand: yᵀ = w · xᵀ.
//
// amx_linear feeds the weights as the B operand, whose tile row is one k-pair
// of 16 different features: each lane has its own scale, so every weight is
// expanded in fp32 (a table lookup and an FMA per 16 weights, then a
// conversion). Here a tile row is one feature's 32 weights of one GGUF block,
// which share one d and one m: the row's 16 possible bf16 values are one FMA
// and one conversion, and a single vpermw looks all 32 weights up (the index
// is the nibble; vpermw reads the low five bits of each word, so the table is
// held twice). Per 16 x 32 tile that is ~80 vector instructions instead of
// ~140, and the expansion is what a small batch's step waits for
// (docs/native.md). The values are bit-identical to amx_linear's: bf16(fma(q, d, m)).
//
// The price is a transposed output: each pair of column blocks ends with
// fp32 tiles C[feature][token] that the epilogue turns into rows of y.
// Packed layout (BlockWeight.pack_rows): per pair of column blocks, per
// k-block, the two tiles; a tile is 8 row pairs of 32 bytes (byte j: weight j
// of the even row in the low nibble, of the odd row in the high nibble), then
// d[16] and m[16] in fp16.

#include "amx_q4_rows.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_vec.h"
#include "cpu_isa.h"

#include "../amx_tiles.h"

#if CB_FUSED_X86
#define CB_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
#define CB_HSUM_TARGET CB_AMX
#include "../avx512_hsum.h"
#endif

namespace cbserve_fused {

bool amx_linear_supported();

namespace {

constexpr int64_t kTile = 16;        // features per column block, tokens per xᵀ tile, k-pairs per tile
constexpr int64_t kBlockK = 32;      // weights per GGUF block = k per tile
constexpr int64_t kTileBytes = 320;  // 256 bytes of nibbles, d[16], m[16] fp16
constexpr int64_t kTileWords = 512;  // one bf16 tile (1 KB)

#if CB_FUSED_X86
// One A tile [16 features][32 k] of bf16 from its packed Q4_1 form.
CB_AMX inline void expand_tile(const uint8_t* src, uint16_t* dst) {
  alignas(64) float dm[32];
  _mm512_store_ps(dm, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 256))));
  _mm512_store_ps(dm + 16, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 288))));
  const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int i = 0; i < 8; ++i) {
    const __m512i lo = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * i)));
    const __m512i hi = _mm512_srli_epi16(lo, 4);
    const __m512 ta = _mm512_fmadd_ps(iota, _mm512_set1_ps(dm[2 * i]), _mm512_set1_ps(dm[16 + 2 * i]));
    const __m512 tb = _mm512_fmadd_ps(iota, _mm512_set1_ps(dm[2 * i + 1]), _mm512_set1_ps(dm[17 + 2 * i]));
    const __m512i table_a = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(ta, ta));
    const __m512i table_b = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(tb, tb));
    _mm512_storeu_si512(dst + 64 * i, _mm512_permutexvar_epi16(lo, table_a));
    _mm512_storeu_si512(dst + 64 * i + 32, _mm512_permutexvar_epi16(hi, table_b));
  }
}

// Token t's 16 features from a C tile [16 features][16 tokens] in memory.
CB_AMX inline __m512 column(const float* c, int64_t t) {
  const __m512i stride = _mm512_set_epi32(240, 224, 208, 192, 176, 160, 144, 128, 112, 96, 80, 64, 48, 32, 16, 0);
  return _mm512_i32gather_ps(stride, c + t, 4);
}

// Where a pass's finished tiles go: pair p (column blocks 2p, 2p + 1),
// tokens m0 .. m0 + rows - 1 (up to 32: two token tiles).
struct PassOut {
  int64_t p = -1, m0 = 0, rows = 0;
};

// The epilogue of one pass from its C tiles acc[token tile][block][16 x 16].
CB_AMX void finish_pass(const float* acc, const PassOut& out, int64_t N, int64_t silu_inter, uint16_t* y) {
  for (int64_t tb = 0; tb * kTile < out.rows; ++tb) {
    const int64_t rows = std::min<int64_t>(kTile, out.rows - tb * kTile);
    const float* c0 = acc + tb * 2 * 256;
    const float* c1 = c0 + 256;
    __m512 g[16], u[16];
    if (rows > 4 && silu_inter > 0) {
      // silu(gate) * up is element-wise: on the [feature][token] tiles, then one transpose.
      for (int i = 0; i < 16; ++i)
        g[i] = silu_mul(round_bf16(_mm512_load_ps(c0 + 16 * i)), round_bf16(_mm512_load_ps(c1 + 16 * i)));
      transpose16(g);
      for (int64_t t = 0; t < rows; ++t)
        store_bf16(reinterpret_cast<c10::BFloat16*>(y + (out.m0 + tb * kTile + t) * silu_inter + out.p * kTile), g[t],
                   0xFFFF);
      continue;
    }
    if (rows > 4) {
      for (int i = 0; i < 16; ++i) g[i] = _mm512_load_ps(c0 + 16 * i), u[i] = _mm512_load_ps(c1 + 16 * i);
      transpose16(g);
      transpose16(u);
    } else {
      for (int64_t t = 0; t < rows; ++t) g[t] = column(c0, t), u[t] = column(c1, t);
    }
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t row = out.m0 + tb * kTile + t;
      if (silu_inter > 0) {
        store_bf16(reinterpret_cast<c10::BFloat16*>(y + row * silu_inter + out.p * kTile),
                   silu_mul(round_bf16(g[t]), round_bf16(u[t])), 0xFFFF);
      } else {
        _mm512_storeu_si512(y + row * N + out.p * 2 * kTile,
                            reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(u[t], g[t])));
      }
    }
  }
}

// One pass: C[token tile][block] over all k-blocks of pair `p`, its weight
// tiles bf16 in `w` ([k-block][2][tile]; `q` null) or, with `q`, expanded
// from the pair's packed tiles one k-block ahead into `buf` just before use;
// xᵀ tiles m-tile `t0` (and t0 + 1 with `two_m`) of each k-block. The
// previous pass's epilogue runs once this one's tiles are issued (its
// accumulators have long left the tile stores), and this one becomes `pending`.
CB_AMX void pair_pass(const uint16_t* w, const uint8_t* q, uint16_t* buf, const uint32_t* xt, int64_t xstep, int64_t t0,
                      bool two_m, int64_t kblocks, const PassOut& out, float (*acc)[4][256], int& slot,
                      PassOut& pending, int64_t N, int64_t silu_inter, uint16_t* y) {
  if (q != nullptr) {
    expand_tile(q, buf);
    expand_tile(q + kTileBytes, buf + kTileWords);
  }
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    const uint16_t* a0;
    if (q != nullptr) {
      if (kb + 1 < kblocks) {
        // Three k-blocks ahead, into the next pair near the end (a hint never faults).
        const uintptr_t ahead = reinterpret_cast<uintptr_t>(q) + (kb + 4) * 2 * kTileBytes;
        for (int64_t l = 0; l < 2 * kTileBytes; l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(ahead + l), _MM_HINT_T0);
        uint16_t* nb = buf + ((kb + 1) & 1) * 2 * kTileWords;
        expand_tile(q + (kb + 1) * 2 * kTileBytes, nb);
        expand_tile(q + (kb + 1) * 2 * kTileBytes + kTileBytes, nb + kTileWords);
      }
      a0 = buf + (kb & 1) * 2 * kTileWords;
    } else {
      a0 = w + kb * 2 * kTileWords;
    }
    const uint32_t* b = xt + kb * xstep + t0 * 256;
    _tile_loadd(4, b, 64);
    _tile_loadd(6, a0, 64);
    _tile_dpbf16ps(0, 6, 4);
    _tile_loadd(7, a0 + kTileWords, 64);
    _tile_dpbf16ps(1, 7, 4);
    if (two_m) {
      _tile_loadd(5, b + 256, 64);
      _tile_dpbf16ps(2, 6, 5);
      _tile_dpbf16ps(3, 7, 5);
    }
  }
  if (pending.p >= 0) finish_pass(&acc[slot ^ 1][0][0], pending, N, silu_inter, y);
  _tile_stored(0, acc[slot][0], 64);
  _tile_stored(1, acc[slot][1], 64);
  _tile_stored(2, acc[slot][2], 64);
  _tile_stored(3, acc[slot][3], 64);
  pending = out;
  slot ^= 1;
}

// One thread: pairs claimed `chunk` at a time. Up to 32 tokens one pass
// expands each k-block's tiles just before use; beyond, the claimed run's
// tiles are expanded once (up to 8 pairs: 288 KB at K = 576, 768 KB at 1536,
// in L2) and every 32-token pass reads them from there. Tiles: 0-3
// C[token tile][block], 4-5 xᵀ token tiles, 6-7 the pair's two weight tiles.
CB_AMX void run_rows(const uint8_t* packed, const uint32_t* xt, int64_t M, int64_t N, int64_t kblocks, int64_t npairs,
                     std::atomic<int64_t>& next, int64_t chunk, int64_t silu_inter, uint16_t* y) {
  const cbserve_amx::TileConfig16x64 cfg;
  _tile_loadconfig(&cfg);
  alignas(64) uint16_t buf[2 * 2 * kTileWords];
  alignas(64) float acc[2][4][256];
  const int64_t tiles_m = (M + kTile - 1) / kTile;
  const int64_t xstep = tiles_m * 256;  // uint32 per k-block of xᵀ
  const int64_t pair_bytes = kblocks * 2 * kTileBytes;
  const int64_t pair_words = kblocks * 2 * kTileWords;
  // Kept per thread between calls: a fresh allocation would be mapped and faulted in every time.
  thread_local std::vector<uint16_t> run;
  if (M > 2 * kTile && run.size() < size_t(chunk * pair_words)) run.resize(chunk * pair_words);
  int slot = 0;
  PassOut pending;
  for (int64_t p0 = next.fetch_add(chunk, std::memory_order_relaxed); p0 < npairs;
       p0 = next.fetch_add(chunk, std::memory_order_relaxed)) {
    const int64_t p1 = std::min(p0 + chunk, npairs);
    if (M <= 2 * kTile) {
      for (int64_t p = p0; p < p1; ++p)
        pair_pass(nullptr, packed + p * pair_bytes, buf, xt, xstep, 0, M > kTile, kblocks, PassOut{p, 0, M}, acc, slot,
                  pending, N, silu_inter, y);
      continue;
    }
    const uint8_t* src = packed + p0 * pair_bytes;
    const int64_t tiles = (p1 - p0) * kblocks * 2;
    for (int64_t t = 0; t < tiles; ++t) {
      const uintptr_t ahead = reinterpret_cast<uintptr_t>(src) + (t + 6) * kTileBytes;  // a hint only
      for (int64_t l = 0; l < kTileBytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + l), _MM_HINT_T0);
      expand_tile(src + t * kTileBytes, run.data() + t * kTileWords);
    }
    for (int64_t m0 = 0; m0 < M; m0 += 2 * kTile)
      for (int64_t p = p0; p < p1; ++p)
        pair_pass(run.data() + (p - p0) * pair_words, nullptr, buf, xt, xstep, m0 / kTile, m0 + kTile < M, kblocks,
                  PassOut{p, m0, std::min<int64_t>(2 * kTile, M - m0)}, acc, slot, pending, N, silu_inter, y);
  }
  if (pending.p >= 0) finish_pass(&acc[slot ^ 1][0][0], pending, N, silu_inter, y);
  _tile_release();
}
#endif

#if CB_FUSED_X86
// xᵀ as AMX B tiles [k-block][token tile][16 k-pairs][16 tokens] of bf16
// pairs (x as uint32 pairs [M][K/2]), zero past the last token: per k-block
// and token tile a 16 x 16 transpose of 32-bit pairs.
CB_AMX void build_xt(const uint32_t* xs, int64_t M, int64_t K, uint32_t* xt) {
  const int64_t pairs_k = K / 2, kblocks = K / kBlockK, tiles_m = (M + kTile - 1) / kTile;
  for (int64_t kb = 0; kb < kblocks; ++kb)
    for (int64_t tb = 0; tb < tiles_m; ++tb) {
      uint32_t* dst = xt + (kb * tiles_m + tb) * 256;
      const int64_t rows = std::min<int64_t>(kTile, M - tb * kTile);
      if (rows <= 4) {  // a few tokens: zeros, then their pairs one by one
        for (int i = 0; i < 16; ++i) _mm512_store_si512(dst + 16 * i, _mm512_setzero_si512());
        for (int64_t t = 0; t < rows; ++t)
          for (int64_t p = 0; p < kTile; ++p) dst[p * 16 + t] = xs[(tb * kTile + t) * pairs_k + kb * kTile + p];
        continue;
      }
      __m512 r[16];
      for (int64_t t = 0; t < 16; ++t)
        r[t] = t < rows ? _mm512_loadu_ps(reinterpret_cast<const float*>(xs + (tb * kTile + t) * pairs_k + kb * kTile))
                        : _mm512_setzero_ps();
      transpose16(r);
      for (int i = 0; i < 16; ++i) _mm512_store_ps(reinterpret_cast<float*>(dst + 16 * i), r[i]);
    }
}
#endif

void check_packed(const at::Tensor& packed) {
  TORCH_CHECK(packed.device().is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 4 &&
                  packed.size(2) == 2 && packed.size(3) == kTileBytes && packed.is_contiguous(),
              "packed must be contiguous uint8 [N/32, K/32, 2, ", kTileBytes, "] (BlockWeight.pack_rows)");
}

}  // namespace

at::Tensor amx_q4_rows_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features, int64_t silu_inter) {
  TORCH_CHECK(amx_linear_supported(), "amx_q4_rows_linear needs an AMX-BF16 CPU");
  check_packed(packed);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous CPU bf16 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  TORCH_CHECK(
      N % (2 * kTile) == 0 && packed.size(0) == N / (2 * kTile) && K % kBlockK == 0 && packed.size(1) == K / kBlockK,
      "packed does not hold a [", N, ", ", K, "] weight");
  TORCH_CHECK(silu_inter == 0 || 2 * silu_inter == N, "silu_inter must be half of out_features");
  auto y = at::empty({M, silu_inter > 0 ? silu_inter : N}, x.options());
  if (M == 0) return y;
#if CB_FUSED_X86
  const int64_t kblocks = K / kBlockK, tiles_m = (M + kTile - 1) / kTile;
  // xᵀ as AMX B tiles [k-block][token tile][16 k-pairs][16 tokens] of bf16
  // pairs, zero past the last token.
  auto xt_t = at::empty({kblocks * tiles_m * 256}, x.options().dtype(at::kInt));
  build_xt(reinterpret_cast<const uint32_t*>(x.data_ptr<c10::BFloat16>()), M, K,
           reinterpret_cast<uint32_t*>(xt_t.data_ptr<int32_t>()));
  const auto* xt = reinterpret_cast<const uint32_t*>(xt_t.data_ptr<int32_t>());
  const int64_t npairs = N / (2 * kTile);
  const int64_t nthreads = at::get_num_threads();
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(8, npairs / (4 * nthreads)));
  std::atomic<int64_t> next{0};
  const auto* wp = packed.data_ptr<uint8_t>();
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>());
  at::parallel_for(0, nthreads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t w = t0; w < t1; ++w) run_rows(wp, xt, M, N, kblocks, npairs, next, chunk, silu_inter, yp);
  });
#endif
  return y;
}

at::Tensor amx_q4_rows_dequant(const at::Tensor& packed) {
  TORCH_CHECK(amx_linear_supported(), "amx_q4_rows_dequant needs an AMX-BF16 CPU");
  check_packed(packed);
  const int64_t npairs = packed.size(0), kblocks = packed.size(1);
  auto out = at::empty({npairs * 2 * kTile, kblocks * kBlockK}, packed.options().dtype(at::kBFloat16));
#if CB_FUSED_X86
  const auto* src = packed.data_ptr<uint8_t>();
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const int64_t K = kblocks * kBlockK;
  at::parallel_for(0, npairs, 1, [&](int64_t b0, int64_t b1) {
    alignas(64) uint16_t tile[kTileWords];
    for (int64_t p = b0; p < b1; ++p)
      for (int64_t kb = 0; kb < kblocks; ++kb)
        for (int64_t h = 0; h < 2; ++h) {
          expand_tile(src + ((p * kblocks + kb) * 2 + h) * kTileBytes, tile);
          for (int64_t r = 0; r < kTile; ++r)
            std::memcpy(dst + ((2 * p + h) * kTile + r) * K + kb * kBlockK, tile + r * kBlockK, kBlockK * 2);
        }
  });
#endif
  return out;
}

}  // namespace cbserve_fused
