// The AVX512-BF16 path for bf16 prefill items on CPUs without AMX (AMD Zen 4,
// Intel Cooper Lake), included by cpu_kernels_avx512.cpp after attn_amx.h.
//
// attn_prefill_amx's algorithm and buffers (KV tiles of whole cache blocks,
// K^T and V re-laid out once per tile into VNNI tiles by amx_pack_k /
// amx_pack_v, bf16 queries, an online softmax in fp32, probabilities rounded
// to bf16 for P.V, fp32 accumulators), with both products as vdpbf16ps
// register blocks instead of tile instructions: a VNNI tile row is one
// 64-byte vector of 16 (tokens or dims) x a bf16 pair, so each product is
// rows of bf16 pairs broadcast against those vectors, 6 rows x 4 vectors of
// fp32 accumulators at a time. Against the fp32 FMA path (attn_item_impl)
// vdpbf16ps does twice the multiply-adds per instruction and the tiles it
// reads are half the bytes.
#pragma once

namespace {

constexpr int kDpRows = 6;  // rows of a register block
constexpr int kDpVecs = 4;  // 16-wide output vectors of a register block

// C[r, 16 v ..] (=, or += with ACC) sum over k-pairs p < kp of the bf16 pair
// A[r, 2p .. 2p + 1] times the vector of pairs at
// B + (p / 16) * tile_stride + (p % 16) * 32 + v * vec_stride (elements).
template <int R, int NV, bool ACC>
CB_DP_ATTN static inline void dp_block(const uint16_t* A, int64_t lda, int64_t kp, const uint16_t* B,
                                       int64_t tile_stride, int64_t vec_stride, float* C, int64_t ldc) {
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t p = 0; p < kp; ++p) {
    const uint16_t* b = B + (p >> 4) * tile_stride + (p & 15) * 32;
    __m512bh bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = (__m512bh)_mm512_loadu_si512(b + v * vec_stride);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      __builtin_memcpy(&pair, A + r * lda + 2 * p, 4);
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], bv[v], a);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) {
      float* c = C + r * ldc + 16 * v;
      _mm512_storeu_ps(c, ACC ? _mm512_add_ps(_mm512_loadu_ps(c), acc[r][v]) : acc[r][v]);
    }
}

template <int R, bool ACC>
CB_DP_ATTN static inline void dp_rows(const uint16_t* A, int64_t lda, int64_t kp, const uint16_t* B,
                                      int64_t tile_stride, int64_t vec_stride, int64_t nvec, float* C, int64_t ldc) {
  int64_t v0 = 0;
  for (; v0 + kDpVecs <= nvec; v0 += kDpVecs)
    dp_block<R, kDpVecs, ACC>(A, lda, kp, B + v0 * vec_stride, tile_stride, vec_stride, C + 16 * v0, ldc);
  const uint16_t* b = B + v0 * vec_stride;
  switch (nvec - v0) {
    case 1: dp_block<R, 1, ACC>(A, lda, kp, b, tile_stride, vec_stride, C + 16 * v0, ldc); break;
    case 2: dp_block<R, 2, ACC>(A, lda, kp, b, tile_stride, vec_stride, C + 16 * v0, ldc); break;
    case 3: dp_block<R, 3, ACC>(A, lda, kp, b, tile_stride, vec_stride, C + 16 * v0, ldc); break;
    default: break;
  }
}

// Rows [0, rows) of A against nvec output vectors (see dp_block).
template <bool ACC>
CB_DP_ATTN static void dp_product(const uint16_t* A, int64_t lda, int64_t rows, int64_t kp, const uint16_t* B,
                                  int64_t tile_stride, int64_t vec_stride, int64_t nvec, float* C, int64_t ldc) {
  int64_t r0 = 0;
  for (; r0 + kDpRows <= rows; r0 += kDpRows)
    dp_rows<kDpRows, ACC>(A + r0 * lda, lda, kp, B, tile_stride, vec_stride, nvec, C + r0 * ldc, ldc);
  const uint16_t* a = A + r0 * lda;
  float* c = C + r0 * ldc;
  switch (rows - r0) {
    case 1: dp_rows<1, ACC>(a, lda, kp, B, tile_stride, vec_stride, nvec, c, ldc); break;
    case 2: dp_rows<2, ACC>(a, lda, kp, B, tile_stride, vec_stride, nvec, c, ldc); break;
    case 3: dp_rows<3, ACC>(a, lda, kp, B, tile_stride, vec_stride, nvec, c, ldc); break;
    case 4: dp_rows<4, ACC>(a, lda, kp, B, tile_stride, vec_stride, nvec, c, ldc); break;
    case 5: dp_rows<5, ACC>(a, lda, kp, B, tile_stride, vec_stride, nvec, c, ldc); break;
    default: break;
  }
}

// F8: the cache holds fp8 e5m2 (widened to bf16 while the tiles are packed).
// Scratch: attn_prefill_amx's layout (attn_scratch_floats covers it).
template <int DC, bool F8>
CB_DP_ATTN static bool attn_prefill_dp(const AttnParams& p, const AttnItem& it, float* scratch) {
  const int64_t D = p.head_dim, G = p.hq / p.hkv;
  const int64_t q_len = p.cu_seqlens[it.seq + 1] - p.cu_seqlens[it.seq];
  const int64_t ctx = p.seq_lens[it.seq] - q_len;
  const int64_t M = (it.q_end - it.q_begin) * G;
  if (M <= 0) return false;
  const int64_t KT = cbserve_native::kv_tile(p.block_size, M);
  const int64_t NP = round_up(KT, 32), DB = D / 16;
  const int64_t DP = D;  // D % 32 == 0

  const auto [Acc, mrow, lrow, S, Qb, Pb, Kb, Vb, tmp, offs] = prefill_bufs(scratch, M, D, NP);
  (void)tmp;
  prefill_rows_init(p, it, M, M, Qb, Acc, mrow, lrow);

  const int64_t kv_hi = item_kv_end(p, it);
  const int64_t ntiles = (kv_hi + KT - 1) / KT;

  for (int64_t j = item_kv_begin(p, it) / KT; j < ntiles; ++j) {  // tiles before every row's window: skipped
    const int64_t t0 = j * KT;
    const int64_t n = cb_min(KT, kv_hi - t0);
    const int64_t n16 = round_up(n, 16), n32 = round_up(n, 32);
    const int64_t r_start = cb_max(0, t0 - ctx - it.q_begin) * G;  // first row that sees this tile
    const int64_t rows = M - r_start;

    prefill_pack_tile<DC, F8>(p, it, t0, n, offs, Kb, Vb);

    // S = Q . K^T: D / 2 pairs; token group g's DC tiles are contiguous.
    dp_product<false>(Qb + r_start * D, D, rows, D / 2, Kb, 512, DC * 512, n16 / 16, S + r_start * NP, NP);

    prefill_softmax_tile(p, it, S, Pb, NP, Acc, mrow, lrow, r_start, M, M, r_start, t0, n);

    // Acc += P . V: n32 / 2 token pairs; the 32-token tiles of one dim block
    // are DB tiles apart.
    dp_product<true>(Pb + r_start * NP, NP, rows, n32 / 2, Vb, DB * 512, 512, DB, Acc + r_start * DP, DP);
  }
  store_rows(p, it, Acc, lrow, DP);
  return false;
}

}  // namespace
