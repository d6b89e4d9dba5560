// The AMX-BF16 path for bf16 prefill items (tokens x GQA group > 16 rows),
// included by cpu_kernels_avx512.cpp after attn_body.h (it reuses V, the
// online softmax, the row I/O and the cache-row offsets from there).
//
// Same structure as the tiled path (KV tiles of whole cache blocks, an online
// softmax between tiles, fp32 accumulators), with both products on AMX tiles:
//   scores  S [16 rows x 16 tokens] += Q [16 x 32 d] . K^T [32 d x 16 tokens]
//   output  O [16 rows x 16 d]      += P [16 x 32 tokens] . V [32 tokens x 16 d]
// K^T and V are re-laid out once per KV tile into the VNNI tiles the
// instruction reads (K: a 16 x 16 dword transpose per 16 tokens and 32 dims;
// V: two token rows interleaved element by element; an fp8 e5m2 cache is
// widened to bf16 on the way, exactly), queries are read as
// bf16 and the probabilities rounded to bf16 for P.V, as torch's own CPU
// flash attention does for bf16; scores, softmax and accumulation are fp32.
#pragma once

#define CB_AMX_TILES_CONFIG_ONLY
#include "amx_tiles.h"

#define CB_AMX_ATTN \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,avx512bf16,amx-tile,amx-bf16")))
// The helpers below use no tile instruction: attn_dp.h's vdpbf16ps path for
// CPUs without AMX shares them (the AMX functions inline them).
#define CB_DP_ATTN __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,avx512bf16")))

namespace {

// Tile 0: accumulator; 2-3: K or V tiles; 4-7: the row tile's query chunks
// (scores) or P (output). Every tile 16 rows x 64 bytes.
CB_AMX_ATTN static inline void amx_attn_config() {
  const cbserve_amx::TileConfig16x64 cfg;
  _tile_loadconfig(&cfg);
}

// 32 fp8 e5m2 values as 32 bf16 (exact: every e5m2 value is a bf16 value).
CB_DP_ATTN static inline __m512 e5m2x32_to_bf16(const uint8_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return (__m512)_mm512_cvtne2ps_pbh(e5m2x16_to_ps(_mm256_extracti128_si256(raw, 1)),
                                     e5m2x16_to_ps(_mm256_castsi256_si128(raw)));
}

// 16 cache elements from element offset `o` as 16 bf16: a bf16 cache is read
// as is, an fp8 e5m2 one widened.
template <bool F8>
CB_DP_ATTN static inline __m256i kv_bf16x16(const void* cache, int64_t o) {
  if constexpr (F8) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(cache) + o));
    return (__m256i)_mm512_cvtneps_pbh(e5m2x16_to_ps(raw));
  } else {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(cache) + o));
  }
}

// Kb tile (g, c) for tokens [16 g, 16 g + 16) and dims [32 c, 32 c + 32):
// row dp holds, for each token t, the pair K[t, 32 c + 2 dp .. + 1] — the
// transpose of the tokens' 16-dword rows. Tokens >= n are zero.
template <bool F8>
CB_DP_ATTN static inline void amx_pack_k(const void* kc, const int64_t* offs, int64_t n, int64_t g, int64_t c,
                                         uint16_t* tile) {
  __m512 r[16];
  for (int t = 0; t < 16; ++t) {
    const int64_t tok = 16 * g + t;
    if (tok >= n) {
      r[t] = _mm512_setzero_ps();
    } else if constexpr (F8) {
      r[t] = e5m2x32_to_bf16(static_cast<const uint8_t*>(kc) + offs[tok] + 32 * c);
    } else {
      r[t] = _mm512_loadu_ps(static_cast<const uint16_t*>(kc) + offs[tok] + 32 * c);
    }
  }
  transpose16(r);
  for (int t = 0; t < 16; ++t) _mm512_storeu_ps(tile + 32 * t, r[t]);
}

// Vb tile (c, b) for tokens [32 c, 32 c + 32) and dims [16 b, 16 b + 16):
// row tp holds, for each dim, the pair (V[32 c + 2 tp, d], V[32 c + 2 tp + 1, d]).
template <bool F8>
CB_DP_ATTN static inline void amx_pack_v(const void* vc, const int64_t* offs, int64_t n, int64_t c, int64_t b,
                                         uint16_t* tile) {
  const __m512i il = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5,
                                      20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int tp = 0; tp < 16; ++tp) {
    const int64_t a = 32 * c + 2 * tp;
    const __m256i va = a < n ? kv_bf16x16<F8>(vc, offs[a] + 16 * b) : _mm256_setzero_si256();
    const __m256i vb = a + 1 < n ? kv_bf16x16<F8>(vc, offs[a + 1] + 16 * b) : _mm256_setzero_si256();
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(va), vb, 1);
    _mm512_storeu_si512(tile + 32 * tp, _mm512_permutexvar_epi16(il, both));
  }
}

// The prefill paths' scratch (attn_scratch_floats covers it) for M rows,
// head dim D and NP tokens a KV tile: Acc [M, D], max / sum [M], S [Mpad, NP]
// fp32; Q [Mpad, D], P [Mpad, NP] bf16; K tiles [NP / 16][D / 32], V tiles
// [NP / 32][D / 16]; one fp32 tile; the KV tile's cache rows.
struct PrefillBufs {
  float* Acc;
  float* mrow;
  float* lrow;
  float* S;
  uint16_t* Qb;
  uint16_t* Pb;
  uint16_t* Kb;
  uint16_t* Vb;
  float* tmp;
  int64_t* offs;
};

static inline PrefillBufs prefill_bufs(float* scratch, int64_t M, int64_t D, int64_t NP) {
  const int64_t Mpad = round_up(M, 16);
  PrefillBufs b;
  b.Acc = scratch;
  b.mrow = b.Acc + M * D;
  b.lrow = b.mrow + Mpad;
  b.S = b.lrow + Mpad;
  b.Qb = reinterpret_cast<uint16_t*>(b.S + Mpad * NP);
  b.Pb = b.Qb + Mpad * D;
  b.Kb = b.Pb + Mpad * NP;
  b.Vb = b.Kb + NP * D;
  b.tmp = reinterpret_cast<float*>(b.Vb + NP * D);
  b.offs = reinterpret_cast<int64_t*>(b.tmp + 256);
  return b;
}

// K^T and V of the KV tile's n tokens from t0 into their VNNI tiles.
template <int DC, bool F8>
CB_DP_ATTN static inline void prefill_pack_tile(const AttnParams& p, const AttnItem& it, int64_t t0, int64_t n,
                                                int64_t* offs, uint16_t* Kb, uint16_t* Vb) {
  const int64_t DB = p.head_dim / 16;
  item_offsets(p, it, t0, n, offs);  // K and V share the layout
  for (int64_t g = 0; g < round_up(n, 16) / 16; ++g)
    for (int64_t c = 0; c < DC; ++c) amx_pack_k<F8>(p.key_cache, offs, n, g, c, Kb + (g * DC + c) * 512);
  for (int64_t c = 0; c < round_up(n, 32) / 32; ++c)
    for (int64_t b = 0; b < DB; ++b) amx_pack_v<F8>(p.value_cache, offs, n, c, b, Vb + (c * DB + b) * 512);
}

// Queries of an item's M rows as bf16 [Mpad, D] (rows past M zero), zeroed
// fp32 accumulators [M, D], running max and sum of each row.
CB_DP_ATTN static inline void prefill_rows_init(const AttnParams& p, const AttnItem& it, int64_t M, int64_t Mpad,
                                                uint16_t* Qb, float* Acc, float* mrow, float* lrow) {
  const int64_t D = p.head_dim;
  const uint16_t* qsrc = static_cast<const uint16_t*>(p.query);
  RowCursor rows(p, it);
  for (int64_t r = 0; r < Mpad; ++r) {
    uint16_t* qr = Qb + r * D;
    if (r < M) {
      __builtin_memcpy(qr, qsrc + rows.next(), D * 2);
      for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(Acc + r * D + d, _mm512_setzero_ps());
      mrow[r] = -__builtin_inff();
      lrow[r] = 0.f;
    } else {
      __builtin_memset(qr, 0, D * 2);
    }
  }
}

// One KV tile's scores S [rows, NP] (tokens t0 .. t0 + n) of rows [r0, r1):
// scale, causal mask, online softmax (rescaling Acc), then P rows as bf16
// [rows, NP] up to the 32-token boundary; zero rows where a row sees nothing
// of this tile (r < r_start) or is padding (r >= M).
CB_DP_ATTN static inline void prefill_softmax_tile(const AttnParams& p, const AttnItem& it, float* S, uint16_t* Pb,
                                                   int64_t NP, float* Acc, float* mrow, float* lrow, int64_t r0,
                                                   int64_t r1, int64_t M, int64_t r_start, int64_t t0, int64_t n) {
  const int64_t D = p.head_dim, G = p.hq / p.hkv;
  const int64_t ctx = p.seq_lens[it.seq] - (p.cu_seqlens[it.seq + 1] - p.cu_seqlens[it.seq]);
  const int64_t n16 = round_up(n, 16), n32 = round_up(n, 32);
  const __m512 scale = _mm512_set1_ps(p.scale);
  const float ninf = -__builtin_inff();
  for (int64_t r = r0; r < r1; ++r) {
    uint16_t* pr = Pb + r * NP;
    if (r < r_start || r >= M) {
      for (int64_t c = 0; c < n32; c += 32) _mm512_storeu_si512(pr + c, _mm512_setzero_si512());
      continue;
    }
    const int64_t pos = ctx + it.q_begin + r / G;
    const int64_t vis = cb_min(n, pos - t0 + 1);
    float* s = S + r * NP;
    for (int64_t c = 0; c < n16; c += 16) {
      const __mmask16 keep = tail_mask(vis - c > 0 ? vis - c : 0);
      _mm512_storeu_ps(s + c, _mm512_mask_mul_ps(_mm512_set1_ps(ninf), keep, _mm512_loadu_ps(s + c), scale));
    }
    if (p.window > 0 || p.softcap > 0.f) mask_row(p, s, n16, pos, t0, vis);
    online_softmax_row(s, n16, mrow[r], lrow[r], Acc + r * D, D);
    for (int64_t c = 0; c < n16; c += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + c), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(s + c)));
    if (n32 > n16) _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + n16), _mm256_setzero_si256());
  }
}

// S rows [16 rt, 16 rt + 16) x tokens [0, n16) = Q . K^T, DC = D / 32 chunks.
template <int DC>
CB_AMX_ATTN static inline void amx_scores(const uint16_t* Qb, int64_t D, const uint16_t* Kb, int64_t n16, float* S,
                                          int64_t NP) {
  _tile_loadd(4, Qb, D * 2);
  if constexpr (DC > 1) _tile_loadd(5, Qb + 32, D * 2);
  if constexpr (DC > 2) _tile_loadd(6, Qb + 64, D * 2);
  if constexpr (DC > 3) _tile_loadd(7, Qb + 96, D * 2);
  for (int64_t g = 0; g < n16 / 16; ++g) {
    const uint16_t* kt = Kb + g * DC * 512;
    _tile_zero(0);
    _tile_loadd(2, kt, 64);
    _tile_dpbf16ps(0, 4, 2);
    if constexpr (DC > 1) {
      _tile_loadd(3, kt + 512, 64);
      _tile_dpbf16ps(0, 5, 3);
    }
    if constexpr (DC > 2) {
      _tile_loadd(2, kt + 1024, 64);
      _tile_dpbf16ps(0, 6, 2);
    }
    if constexpr (DC > 3) {
      _tile_loadd(3, kt + 1536, 64);
      _tile_dpbf16ps(0, 7, 3);
    }
    _tile_stored(0, S + 16 * g, NP * 4);
  }
}

// F8: the cache holds fp8 e5m2 (widened to bf16 while the tiles are packed).
template <int DC, bool F8>
CB_AMX_ATTN static bool attn_prefill_amx(const AttnParams& p, const AttnItem& it, float* scratch) {
  const int64_t D = p.head_dim, G = p.hq / p.hkv;
  const int64_t q_len = p.cu_seqlens[it.seq + 1] - p.cu_seqlens[it.seq];
  const int64_t ctx = p.seq_lens[it.seq] - q_len;
  const int64_t M = (it.q_end - it.q_begin) * G;
  if (M <= 0) return false;
  const int64_t Mpad = round_up(M, 16);
  const int64_t KT = cbserve_native::kv_tile(p.block_size, M);
  const int64_t NP = round_up(KT, 32), DB = D / 16;
  const int64_t DP = D;  // D % 32 == 0

  const auto [Acc, mrow, lrow, S, Qb, Pb, Kb, Vb, tmp, offs] = prefill_bufs(scratch, M, D, NP);

  prefill_rows_init(p, it, M, Mpad, Qb, Acc, mrow, lrow);

  amx_attn_config();
  const int64_t kv_hi = item_kv_end(p, it);
  const int64_t ntiles = (kv_hi + KT - 1) / KT;

  for (int64_t j = item_kv_begin(p, it) / KT; j < ntiles; ++j) {  // tiles before every row's window: skipped
    const int64_t t0 = j * KT;
    const int64_t n = cb_min(KT, kv_hi - t0);
    const int64_t n16 = round_up(n, 16), n32 = round_up(n, 32);
    const int64_t r_start = cb_max(0, t0 - ctx - it.q_begin) * G;  // first row that sees this tile
    const int64_t rt0 = r_start / 16;

    prefill_pack_tile<DC, F8>(p, it, t0, n, offs, Kb, Vb);

    for (int64_t rt = rt0; rt < Mpad / 16; ++rt) amx_scores<DC>(Qb + rt * 16 * D, D, Kb, n16, S + rt * 16 * NP, NP);

    prefill_softmax_tile(p, it, S, Pb, NP, Acc, mrow, lrow, rt0 * 16, Mpad, M, r_start, t0, n);

    for (int64_t rt = rt0; rt < Mpad / 16; ++rt) {
      const uint16_t* prow = Pb + rt * 16 * NP;
      const int64_t r_end = cb_min(M, rt * 16 + 16);
      for (int64_t b = 0; b < DB; ++b) {
        _tile_zero(0);
        for (int64_t c = 0; c < n32 / 32; ++c) {
          _tile_loadd(4, prow + 32 * c, NP * 2);
          _tile_loadd(2, Vb + (c * DB + b) * 512, 64);
          _tile_dpbf16ps(0, 4, 2);
        }
        _tile_stored(0, tmp, 64);
        for (int64_t r = cb_max(rt * 16, r_start); r < r_end; ++r) {
          float* a = Acc + r * DP + 16 * b;
          _mm512_storeu_ps(a, _mm512_add_ps(_mm512_loadu_ps(a), _mm512_loadu_ps(tmp + (r - rt * 16) * 16)));
        }
      }
    }
  }
  _tile_release();
  store_rows(p, it, Acc, lrow, DP);
  return false;
}

}  // namespace
