// The CPU paged-attention kernel, written once against a small vector
// abstraction `V` and included by each ISA translation unit
// (cpu_kernels_{generic,avx2,avx512}.cpp) after it defines `V`. Everything has
// internal linkage (anonymous namespace): each TU gets its own copy compiled
// for its own instruction set, and nothing is shared through the linker.
//
// V must provide:
//   using R = <register type>;  static constexpr int W;   // fp32 lanes
//   static constexpr int RT_S, CT_S;  // score micro-tile: rows x vectors
//   static constexpr int RT_P, CT_P;  // P.V micro-tile: rows x vectors
//   R zero(); R set1(float); R load(const float*); void store(float*, R);
//   R fma(R a, R b, R c) /* a*b+c */; R add(R, R); R mul(R, R); R max(R, R); R sub(R, R);
//   float hmax(R); float hsum(R); R exp(R) /* 0 for x < -87 */;
//   void to_f32(const void* src, int dtype, float* dst, int64_t n);
//   void from_f32(const float* src, int dtype, void* dst, int64_t n);
//   void pack_kt(const void* k, int64_t ld, int dtype, int64_t n, int64_t D,
//                float* kt, int64_t ldkt);   // kt[d*ldkt + t] = k[t*ld + d]
#pragma once

#include "half_utils.h"
#include "kernels.h"
#include "kv_prefetch.h"

#define CB_UNROLL _Pragma("GCC unroll 16")

namespace {

using cbserve_native::AttnItem;
using cbserve_native::AttnParams;
using cbserve_native::kPad;
using cbserve_native::round_up;

static inline int64_t cb_min(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t cb_max(int64_t a, int64_t b) { return a > b ? a : b; }

// S[r, c*W..] = sum_d Q[r, d] * Kt[d, c*W..] for an R x C register tile.
template <int R, int C>
static inline void score_tile(const float* __restrict Q, int64_t ldq, const float* __restrict Kt, int64_t ldk,
                              float* __restrict S, int64_t lds, int64_t D) {
  typename V::R acc[R][C];
  CB_UNROLL for (int r = 0; r < R; ++r) { CB_UNROLL for (int c = 0; c < C; ++c) acc[r][c] = V::zero(); }
  for (int64_t d = 0; d < D; ++d) {
    typename V::R k[C];
    CB_UNROLL for (int c = 0; c < C; ++c) k[c] = V::load(Kt + d * ldk + c * V::W);
    CB_UNROLL for (int r = 0; r < R; ++r) {
      const typename V::R q = V::set1(Q[r * ldq + d]);
      CB_UNROLL for (int c = 0; c < C; ++c) acc[r][c] = V::fma(q, k[c], acc[r][c]);
    }
  }
  CB_UNROLL for (int r = 0; r < R; ++r) {
    CB_UNROLL for (int c = 0; c < C; ++c) V::store(S + r * lds + c * V::W, acc[r][c]);
  }
}

// A[r, c*W..] += sum_{t < n} P[r, t] * Vb[t, c*W..] for an R x C register tile.
template <int R, int C>
static inline void pv_tile(const float* __restrict P, int64_t ldp, const float* __restrict Vb, int64_t ldv,
                           float* __restrict A, int64_t lda, int64_t n) {
  typename V::R acc[R][C];
  CB_UNROLL for (int r = 0; r < R; ++r) {
    CB_UNROLL for (int c = 0; c < C; ++c) acc[r][c] = V::load(A + r * lda + c * V::W);
  }
  for (int64_t t = 0; t < n; ++t) {
    typename V::R v[C];
    CB_UNROLL for (int c = 0; c < C; ++c) v[c] = V::load(Vb + t * ldv + c * V::W);
    CB_UNROLL for (int r = 0; r < R; ++r) {
      const typename V::R p = V::set1(P[r * ldp + t]);
      CB_UNROLL for (int c = 0; c < C; ++c) acc[r][c] = V::fma(p, v[c], acc[r][c]);
    }
  }
  CB_UNROLL for (int r = 0; r < R; ++r) {
    CB_UNROLL for (int c = 0; c < C; ++c) V::store(A + r * lda + c * V::W, acc[r][c]);
  }
}

template <int R>
static inline void score_rows(const float* Q, int64_t ldq, const float* Kt, int64_t ldk, float* S, int64_t lds,
                              int64_t D, int64_t cvecs) {
  for (int64_t c0 = 0; c0 < cvecs; c0 += V::CT_S) {
    const float* k = Kt + c0 * V::W;
    float* s = S + c0 * V::W;
    switch (cb_min(V::CT_S, cvecs - c0)) {
      case 1: score_tile<R, 1>(Q, ldq, k, ldk, s, lds, D); break;
      case 2:
        if constexpr (V::CT_S >= 2) score_tile<R, 2>(Q, ldq, k, ldk, s, lds, D);
        break;
      case 3:
        if constexpr (V::CT_S >= 3) score_tile<R, 3>(Q, ldq, k, ldk, s, lds, D);
        break;
      default:
        if constexpr (V::CT_S >= 4) score_tile<R, V::CT_S>(Q, ldq, k, ldk, s, lds, D);
        break;
    }
  }
}

static inline void scores(const float* Q, int64_t ldq, const float* Kt, int64_t ldk, float* S, int64_t lds, int64_t D,
                          int64_t rows, int64_t cvecs) {
  static_assert(V::RT_S >= 1 && V::RT_S <= 6, "row tile");
  for (int64_t r0 = 0; r0 < rows; r0 += V::RT_S) {
    const float* q = Q + r0 * ldq;
    float* s = S + r0 * lds;
    switch (cb_min(V::RT_S, rows - r0)) {
      case 1: score_rows<1>(q, ldq, Kt, ldk, s, lds, D, cvecs); break;
      case 2:
        if constexpr (V::RT_S >= 2) score_rows<2>(q, ldq, Kt, ldk, s, lds, D, cvecs);
        break;
      case 3:
        if constexpr (V::RT_S >= 3) score_rows<3>(q, ldq, Kt, ldk, s, lds, D, cvecs);
        break;
      case 4:
        if constexpr (V::RT_S >= 4) score_rows<4>(q, ldq, Kt, ldk, s, lds, D, cvecs);
        break;
      case 5:
        if constexpr (V::RT_S >= 5) score_rows<5>(q, ldq, Kt, ldk, s, lds, D, cvecs);
        break;
      default:
        if constexpr (V::RT_S >= 6) score_rows<6>(q, ldq, Kt, ldk, s, lds, D, cvecs);
        break;
    }
  }
}

template <int R>
static inline void pv_rows(const float* P, int64_t ldp, const float* Vb, int64_t ldv, float* A, int64_t lda, int64_t n,
                           int64_t dvecs) {
  for (int64_t c0 = 0; c0 < dvecs; c0 += V::CT_P) {
    const float* v = Vb + c0 * V::W;
    float* a = A + c0 * V::W;
    switch (cb_min(V::CT_P, dvecs - c0)) {
      case 1: pv_tile<R, 1>(P, ldp, v, ldv, a, lda, n); break;
      case 2:
        if constexpr (V::CT_P >= 2) pv_tile<R, 2>(P, ldp, v, ldv, a, lda, n);
        break;
      case 3:
        if constexpr (V::CT_P >= 3) pv_tile<R, 3>(P, ldp, v, ldv, a, lda, n);
        break;
      default:
        if constexpr (V::CT_P >= 4) pv_tile<R, V::CT_P>(P, ldp, v, ldv, a, lda, n);
        break;
    }
  }
}

// Rows are ordered token-major, so the number of visible tokens `nv[r]` is
// non-decreasing in r; a row tile uses the count of its last row (P is zero
// beyond each row's own count). Only columns [col0, col0 + seg_n) of P are
// used, against the V rows Vb[0 .. seg_n).
static inline void pv(const float* P, int64_t ldp, const float* Vb, int64_t ldv, float* A, int64_t lda,
                      const int32_t* nv, int64_t rows, int64_t dvecs, int64_t col0, int64_t seg_n) {
  static_assert(V::RT_P >= 1 && V::RT_P <= 4, "row tile");
  for (int64_t r0 = 0; r0 < rows; r0 += V::RT_P) {
    const int64_t rr = cb_min(V::RT_P, rows - r0);
    const int64_t n = cb_min(seg_n, nv[r0 + rr - 1] - col0);
    if (n <= 0) continue;
    const float* p = P + r0 * ldp + col0;
    float* a = A + r0 * lda;
    switch (rr) {
      case 1: pv_rows<1>(p, ldp, Vb, ldv, a, lda, n, dvecs); break;
      case 2:
        if constexpr (V::RT_P >= 2) pv_rows<2>(p, ldp, Vb, ldv, a, lda, n, dvecs);
        break;
      case 3:
        if constexpr (V::RT_P >= 3) pv_rows<3>(p, ldp, Vb, ldv, a, lda, n, dvecs);
        break;
      default:
        if constexpr (V::RT_P >= 4) pv_rows<4>(p, ldp, Vb, ldv, a, lda, n, dvecs);
        break;
    }
  }
}

// ------------------------------------------------------------ decode path ---
// Items with few rows (decode: q_len 1-2 x the GQA group). K and V are read
// straight from the cache in groups of (up to) 16 tokens: no transposed tile.
// An ISA may provide faster group kernels by defining CB_DEC_SCORES /
// CB_DEC_PV before including this header; these portable ones only use V.
//
//   scores: S[r*lds + t] = sum_d Q[r*ldq + d] * K_t[d]      (r < M, t < n <= 16)
//   pv:     A[r*lda + d] += sum_t P[r*ldp + t] * V_t[d]     (r < M, d < D, t < n <= chunk)
// with token t's row at element offset offs[t] of `base` (storage dtype);
// `tmp` is [16, DP] fp32 staging whose [D, DP) columns are zero. `qbf16`
// (AttnParams::bf16_decode_dots): the scaled query rows Q are exact in bf16,
// so a kernel may take them as bf16 without rounding anything.
static inline void dec_scores_simple(const float* Q, int64_t ldq, int64_t M, const char* base, const int64_t* offs,
                                     int64_t n, int dtype, int64_t D, float* S, int64_t lds, float* tmp, KvPrefetch& pf,
                                     bool qbf16) {
  (void)qbf16;
  const int64_t es = cbserve_native::elem_size(dtype);
  const int64_t DP = round_up(D, kPad);
  for (int64_t t = 0; t < n; ++t) {
    pf.step();
    float* kr = tmp + t * DP;
    V::to_f32(base + offs[t] * es, dtype, kr, D);
    for (int64_t r = 0; r < M; ++r) {
      typename V::R acc = V::zero();
      for (int64_t d = 0; d < DP; d += V::W) acc = V::fma(V::load(Q + r * ldq + d), V::load(kr + d), acc);
      S[r * lds + t] = V::hsum(acc);
    }
  }
}

static inline void dec_pv_simple(const float* P, int64_t ldp, int64_t M, const char* base, const int64_t* offs,
                                 int64_t n, int dtype, int64_t D, float* A, int64_t lda, float* tmp, KvPrefetch& pf) {
  const int64_t es = cbserve_native::elem_size(dtype);
  const int64_t DP = round_up(D, kPad);
  float* vr = tmp;
  for (int64_t t = 0; t < n; ++t) {
    pf.step();
    V::to_f32(base + offs[t] * es, dtype, vr, D);
    for (int64_t r = 0; r < M; ++r) {
      const float pt = P[r * ldp + t];
      if (pt == 0.f) continue;
      const typename V::R pv = V::set1(pt);
      float* a = A + r * lda;
      for (int64_t d = 0; d < DP; d += V::W) V::store(a + d, V::fma(pv, V::load(vr + d), V::load(a + d)));
    }
  }
}

// Online-softmax update of one score row s[0, ncols) (ncols a multiple of
// V::W, masked entries -inf): exponentiates s in place against the new running
// max m, folds the row's sum into l, and rescales the accumulator row acc[0, DP).
static inline void online_softmax_row(float* s, int64_t ncols, float& m, float& l, float* acc, int64_t DP) {
  const float ninf = -__builtin_inff();
  typename V::R mx = V::set1(ninf);
  for (int64_t c = 0; c < ncols; c += V::W) mx = V::max(mx, V::load(s + c));
  const float bmax = V::hmax(mx);
  if (bmax == ninf) {  // the row sees nothing of this tile (its window starts later): zero weights, state kept
    for (int64_t c = 0; c < ncols; c += V::W) V::store(s + c, V::zero());
    return;
  }
  const float m_old = m;
  const float m_new = bmax > m_old ? bmax : m_old;
  const typename V::R mv = V::set1(m_new);
  typename V::R sum = V::zero();
  for (int64_t c = 0; c < ncols; c += V::W) {
    const typename V::R e = V::exp(V::sub(V::load(s + c), mv));
    V::store(s + c, e);
    sum = V::add(sum, e);
  }
  const float corr = m_old == ninf ? 0.f : __builtin_expf(m_old - m_new);
  l = l * corr + V::hsum(sum);
  m = m_new;
  if (corr != 1.f) {
    const typename V::R cv = V::set1(corr);
    for (int64_t d = 0; d < DP; d += V::W) V::store(acc + d, V::mul(V::load(acc + d), cv));
  }
}

// online_softmax_row for the M (<= kDecodeRowsCap) rows of a decode chunk at once, in
// phases over all rows so that no row's reductions wait on another's: the
// rows' maxima, then every row's correction exp(m_old - m_new) in one vector
// exp (no scalar libm call between the rows), then the exponentials, then
// the sums and rescales. Rows with skip[r] (nothing visible in this chunk)
// are all zero on entry and keep their state, as do rows masked out
// entirely. Same results as online_softmax_row up to the rounding of the
// corrections.
static inline void online_softmax_rows(float* S, int64_t lds, int64_t M, int64_t ncols, const bool* skip, float* m,
                                       float* l, float* Acc, int64_t DP) {
  const float ninf = -__builtin_inff();
  constexpr int64_t RC = cbserve_native::kDecodeRowsCap;
  alignas(64) float mnew[RC], diff[RC], corr[RC], sums[RC * V::W];
  bool none[RC];
  for (int64_t r = 0; r < RC; ++r) diff[r] = 0.f;
  for (int64_t r = 0; r < M; ++r) {
    const float* s = S + r * lds;
    typename V::R mx = V::set1(ninf);
    for (int64_t c = 0; c < ncols; c += V::W) mx = V::max(mx, V::load(s + c));
    const float bmax = skip[r] ? ninf : V::hmax(mx);
    none[r] = bmax == ninf;  // masked out entirely (e.g. its window starts later)
    // A row that sees nothing keeps its max; one seen for the first time has
    // no state to correct (its accumulator and sum are zero): any finite diff.
    mnew[r] = bmax > m[r] ? bmax : m[r];
    diff[r] = m[r] == ninf ? 0.f : m[r] - mnew[r];
  }
  for (int64_t r = 0; r < M; r += V::W) V::store(corr + r, V::exp(V::load(diff + r)));
  for (int64_t r = 0; r < M; ++r) {
    float* s = S + r * lds;
    if (none[r]) {  // zero weights, state kept
      if (!skip[r])
        for (int64_t c = 0; c < ncols; c += V::W) V::store(s + c, V::zero());
      continue;
    }
    const typename V::R mv = V::set1(mnew[r]);
    typename V::R sum = V::zero();
    for (int64_t c = 0; c < ncols; c += V::W) {
      const typename V::R e = V::exp(V::sub(V::load(s + c), mv));
      V::store(s + c, e);
      sum = V::add(sum, e);
    }
    V::store(sums + r * V::W, sum);
  }
  // The rows' horizontal sums and rescales after all their exponentials, so
  // that no row's reduction chain waits on the previous one. The rescale is
  // unconditional: corr is exactly 1 where the max did not move, and a
  // multiply is cheaper than the mispredicted branch around it.
  for (int64_t r = 0; r < M; ++r) {
    if (none[r]) continue;
    l[r] = l[r] * corr[r] + V::hsum(V::load(sums + r * V::W));
    m[r] = mnew[r];
    float* acc = Acc + r * DP;
    const typename V::R cv = V::set1(corr[r]);
    for (int64_t d = 0; d < DP; d += V::W) V::store(acc + d, V::mul(V::load(acc + d), cv));
  }
}

// One row's scores of the tokens [t0, t0 + ncols) (ncols a multiple of
// V::W) for a query at position pos: the scores are soft-capped, then keys
// after pos (t >= vis) and, with a sliding window, before pos - window + 1
// are masked to -inf. The cap, cap * tanh(s / cap), runs in vector lanes as
// cap * (1 - 2 / (exp(2 s / cap) + 1)) (V::exp saturates, so no lane
// overflows; masked lanes are overwritten after).
static inline void mask_row(const AttnParams& p, float* s, int64_t ncols, int64_t pos, int64_t t0, int64_t vis) {
  const float ninf = -__builtin_inff();
  if (p.softcap > 0.f) {
    const typename V::R cap = V::set1(p.softcap), k = V::set1(2.f / p.softcap), one = V::set1(1.f), two = V::set1(2.f);
    for (int64_t c = 0; c < ncols; c += V::W) {
      const typename V::R e = V::exp(V::mul(V::load(s + c), k));
      V::store(s + c, V::mul(cap, V::sub(one, V::div(two, V::add(e, one)))));
    }
  }
  const int64_t lo = cb_min(vis, cb_max(0, cbserve_native::window_start(pos, p.window) - t0));
  for (int64_t t = 0; t < lo; ++t) s[t] = ninf;
  for (int64_t t = cb_max(vis, 0); t < ncols; ++t) s[t] = ninf;
}

// An item's rows are (KV head h, query token i, head g of the GQA group),
// r = (h * nq + i) * G + g. RowCursor walks them in that order and gives
// each row's element offset of its query / output vector in the [T, Hq, D]
// tensors: nested steps instead of a division and two remainders a row.
class RowCursor {
 public:
  RowCursor(const AttnParams& p, const AttnItem& it)
      : D_(p.head_dim), G_(p.hq / p.hkv), nq_(it.q_end - it.q_begin), tok_(p.hq * p.head_dim) {
    head_ = ((p.cu_seqlens[it.seq] + it.q_begin) * p.hq + it.kv_head * G_) * D_;
    row_ = head_;
  }
  // The current row's offset; moves to the next row.
  int64_t next() {
    const int64_t off = row_ + g_ * D_;
    if (++g_ == G_) {
      g_ = 0;
      row_ += tok_;
      if (++i_ == nq_) i_ = 0, head_ += G_ * D_, row_ = head_;
    }
    return off;
  }

 private:
  const int64_t D_, G_, nq_, tok_;
  int64_t head_, row_, i_ = 0, g_ = 0;
};

// Loads the item's scaled fp32 query rows Qf [M, DP] (zero beyond D) and
// resets the online-softmax state: Acc [M, DP] = 0, max = -inf, sum = 0.
static inline void init_rows(const AttnParams& p, const AttnItem& it, float* Qf, float* Acc, float* mrow, float* lrow,
                             int64_t DP) {
  const int64_t D = p.head_dim, M = cbserve_native::item_rows(it, p.hq / p.hkv);
  const int64_t esize = cbserve_native::elem_size(p.dtype);
  const char* qbase = static_cast<const char*>(p.query);
  RowCursor rows(p, it);
  for (int64_t r = 0; r < M; ++r) {
    float* qr = Qf + r * DP;
    V::to_f32(qbase + rows.next() * esize, p.dtype, qr, D);
    for (int64_t d = 0; d < D; ++d) qr[d] *= p.scale;
    for (int64_t d = D; d < DP; ++d) qr[d] = 0.f;
    float* ar = Acc + r * DP;
    for (int64_t d = 0; d < DP; ++d) ar[d] = 0.f;
    mrow[r] = -__builtin_inff();
    lrow[r] = 0.f;
  }
}

// Normalises each accumulator row by its softmax sum and writes it to out.
static inline void store_rows(const AttnParams& p, const AttnItem& it, float* Acc, const float* lrow, int64_t DP) {
  const int64_t D = p.head_dim, M = cbserve_native::item_rows(it, p.hq / p.hkv);
  const int64_t esize = cbserve_native::elem_size(p.dtype);
  char* obase = static_cast<char*>(p.out);
  RowCursor rows(p, it);
  for (int64_t r = 0; r < M; ++r) {
    float* a = Acc + r * DP;
    const float inv = lrow[r] > 0.f ? 1.f / lrow[r] : 0.f;
    const typename V::R iv = V::set1(inv);
    for (int64_t d = 0; d < DP; d += V::W) V::store(a + d, V::mul(V::load(a + d), iv));
    V::from_f32(a, p.dtype, obase + rows.next() * esize, D);
  }
}

#ifndef CB_DEC_SCORES
#define CB_DEC_SCORES dec_scores_simple
#endif
#ifndef CB_DEC_PV
#define CB_DEC_PV dec_pv_simple
#endif

static_assert(cbserve_native::kDecodeRowsCap % 16 == 0, "mrow/lrow keep S 64-byte aligned");
static_assert(cbserve_native::kDecodeChunk % 16 == 0, "chunk");

// Element offsets of tokens [c0, c0 + n)'s cache rows at item `it`'s first
// KV head; head j of the item is j * D further. One block's tokens are a
// fixed stride apart, so each block costs one multiply and each token an add.
static inline void item_offsets(const AttnParams& p, const AttnItem& it, int64_t c0, int64_t n, int64_t* o) {
  const int64_t bs = p.block_size, tok = p.hkv * p.head_dim;
  const int32_t* table = p.block_tables + it.seq * p.max_blocks;
  for (int64_t t = 0, blk = c0 / bs, in_blk = c0 % bs; t < n; ++blk, in_blk = 0) {
    const int64_t end = cb_min(n, t + bs - in_blk);
    int64_t off = (int64_t(table[blk]) * bs + in_blk) * tok + it.kv_head * p.head_dim;
    for (; t < end; ++t, off += tok) o[t] = off;
  }
}

// Exclusive end of the KV range any row of the item sees.
static inline int64_t item_kv_end(const AttnParams& p, const AttnItem& it) {
  const int64_t q_len = p.cu_seqlens[it.seq + 1] - p.cu_seqlens[it.seq];
  return p.seq_lens[it.seq] - q_len + it.q_end;
}

// First KV token any row of the item sees: its earliest row's window start
// (0 without a window). Nothing before it is read.
static inline int64_t item_kv_begin(const AttnParams& p, const AttnItem& it) {
  const int64_t q_len = p.cu_seqlens[it.seq + 1] - p.cu_seqlens[it.seq];
  return cbserve_native::window_start(p.seq_lens[it.seq] - q_len + it.q_begin, p.window);
}

static bool attn_decode_impl(const AttnParams& p, const AttnItem& it, const AttnItem* next, bool prefetched,
                             float* scratch) {
  const int64_t D = p.head_dim, hq = p.hq, hkv = p.hkv;
  const int64_t G = hq / hkv, nh = it.n_heads;
  const int dtype = p.kv_dtype;  // the cache's: every read below is a K or V row
  const int64_t esize = cbserve_native::elem_size(dtype);
  const int64_t q0 = p.cu_seqlens[it.seq];
  const int64_t q_len = p.cu_seqlens[it.seq + 1] - q0;
  const int64_t ctx = p.seq_lens[it.seq] - q_len;
  const int64_t Mh = (it.q_end - it.q_begin) * G;  // rows per KV head
  const int64_t M = Mh * nh;
  const int64_t DP = round_up(D, kPad);
  constexpr int64_t CH = cbserve_native::kDecodeChunk;

  constexpr int64_t RC = cbserve_native::kDecodeRowsCap;
  float* Qf = scratch;         // [M, DP]  scaled queries
  float* Acc = Qf + M * DP;    // [M, DP]  un-normalised output
  float* mrow = Acc + M * DP;  // [M]      running max
  float* lrow = mrow + RC;     // [M]      running sum (M <= RC; keeps S 64-byte aligned)
  float* S = lrow + RC;        // [M, CH]  scores, then probabilities of one chunk
  float* tmp = S + M * CH;     // [16, DP] staging for the group kernels
  // Token row offsets of this chunk and of the next one (being prefetched).
  int64_t* offs = reinterpret_cast<int64_t*>(tmp + 16 * DP);  // [CH]
  int64_t* offs_next = offs + CH;                             // [CH]
  for (int64_t t = 0; t < 16; ++t)
    for (int64_t d = D; d < DP; ++d) tmp[t * DP + d] = 0.f;

  init_rows(p, it, Qf, Acc, mrow, lrow, DP);
  const bool qbf16 = p.bf16_decode_dots;

  const int64_t kv_lo = item_kv_begin(p, it), kv_hi = item_kv_end(p, it);
  const char* kc = static_cast<const char*>(p.key_cache);
  const char* vc = static_cast<const char*>(p.value_cache);
  // The item's heads are adjacent in a token's cache row: prefetch them as one span.
  KvPrefetch pf;
  pf.kc = kc;
  pf.vc = vc;
  pf.es = esize;
  const int64_t headb = D * esize;
  const bool prefetch_next = next != nullptr && cbserve_native::is_decode_item(*next, G);
  bool did_next = false;

  // Blocks are scattered, so the hardware prefetcher cannot follow: each
  // chunk is requested while the previous one computes (the first one while
  // the thread's previous item finished, or else up front).
  item_offsets(p, it, kv_lo, cb_min(CH, kv_hi - kv_lo), offs);
  if (!prefetched) {
    pf.rowb = nh * D * esize;
    pf.reset(offs, cb_min(CH, kv_hi - kv_lo), 1);
    pf.finish();
  }

  for (int64_t c0 = kv_lo; c0 < kv_hi; c0 += CH) {
    const int64_t n = cb_min(CH, kv_hi - c0);
    int64_t n1 = cb_max(0, cb_min(CH, kv_hi - c0 - CH));
    const int64_t visits = 2 * nh * n;  // the score and P.V loops step once per (token, head)
    if (n1 > 0) {
      item_offsets(p, it, c0 + CH, n1, offs_next);
      pf.rowb = nh * D * esize;
    } else if (prefetch_next) {  // last chunk: the next item's first one
      const int64_t lo1 = item_kv_begin(p, *next);
      n1 = cb_min(CH, item_kv_end(p, *next) - lo1);
      item_offsets(p, *next, lo1, n1, offs_next);
      pf.rowb = next->n_heads * D * esize;
      did_next = true;
    }
    pf.reset(offs_next, n1, (n1 * ((pf.rowb + 63) / 64) + visits - 1) / visits);
    // Scores of the chunk, 16 tokens at a time, all heads of a token group together.
    for (int64_t g0 = 0; g0 < n; g0 += 16) {
      const int64_t gn = cb_min(16, n - g0);
      for (int64_t j = 0; j < nh; ++j)
        CB_DEC_SCORES(Qf + j * Mh * DP, DP, Mh, kc + j * headb, offs + g0, gn, dtype, D, S + j * Mh * CH + g0, CH, tmp,
                      pf, qbf16);
    }
    // Exact softmax over the chunk, rescaling the running state once per chunk.
    const int64_t ncols = (n + V::W - 1) / V::W * V::W;
    bool skip[RC];
    for (int64_t r = 0; r < M; ++r) {
      const int64_t pos = ctx + it.q_begin + (r % Mh) / G;  // the row's own position
      const int64_t vis = cb_max(0, cb_min(n, pos - c0 + 1));
      float* s = S + r * CH;
      skip[r] = vis == 0;
      if (skip[r]) {
        for (int64_t t = 0; t < ncols; ++t) s[t] = 0.f;
        continue;
      }
      mask_row(p, s, ncols, pos, c0, vis);
    }
    online_softmax_rows(S, CH, M, ncols, skip, mrow, lrow, Acc, DP);
    // P.V, streaming V rows.
    for (int64_t j = 0; j < nh; ++j)
      CB_DEC_PV(S + j * Mh * CH, CH, Mh, vc + j * headb, offs, n, dtype, D, Acc + j * Mh * DP, DP, tmp, pf);
    pf.finish();
    int64_t* swap = offs;
    offs = offs_next;
    offs_next = swap;
  }

  store_rows(p, it, Acc, lrow, DP);
  return did_next;
}

// ------------------------------------------------------------- tiled path ---
static bool attn_item_impl(const AttnParams& p, const AttnItem& it, const AttnItem* next, bool prefetched,
                           float* scratch) {
  if (cbserve_native::is_decode_item(it, p.hq / p.hkv)) return attn_decode_impl(p, it, next, prefetched, scratch);
  const int64_t D = p.head_dim, bs = p.block_size, hq = p.hq, hkv = p.hkv;
  const int64_t G = hq / hkv, h = it.kv_head;
  const int dtype = p.kv_dtype;  // the cache's: every read below is a K or V row
  const int64_t esize = cbserve_native::elem_size(dtype);
  const int64_t q0 = p.cu_seqlens[it.seq];
  const int64_t q_len = p.cu_seqlens[it.seq + 1] - q0;
  const int64_t kv_len = p.seq_lens[it.seq];
  const int64_t ctx = kv_len - q_len;  // position of the sequence's first query token
  const int64_t nq = it.q_end - it.q_begin;
  const int64_t M = nq * G;
  if (M <= 0) return false;
  const int64_t KT = cbserve_native::kv_tile(bs, M);
  const int64_t DP = round_up(D, kPad), NP = round_up(KT, kPad);

  float* Qf = scratch;                                     // [M, DP]   scaled queries, fp32
  float* Acc = Qf + M * DP;                                // [M, DP]   un-normalised output
  float* mrow = Acc + M * DP;                              // [M]       running max
  float* lrow = mrow + M;                                  // [M]       running sum
  float* S = lrow + M;                                     // [M, NP]   scores, then probabilities
  float* Kt = S + M * NP;                                  // [DP, NP]  K block, transposed, fp32
  float* Vf = Kt + DP * NP;                                // [NP, DP]  V block, fp32
  int32_t* nv = reinterpret_cast<int32_t*>(Vf + NP * DP);  // [M] visible tokens per row

  init_rows(p, it, Qf, Acc, mrow, lrow, DP);

  const int64_t kv_hi = ctx + it.q_end;  // exclusive end of the KV range any row sees
  const int64_t ntiles = (kv_hi + KT - 1) / KT;
  const int32_t* table = p.block_tables + it.seq * p.max_blocks;
  const int64_t ld = hkv * D;  // elements between consecutive tokens of one head
  // fp32 V is read in place (one P.V pass per cache block) when the item is
  // small (decode); bigger items gather it once per tile so the P.V register
  // tiles run over the whole tile.
  const bool direct_v = dtype == cbserve_native::kF32 && D % V::W == 0 && M < 16;
  const char* kc = static_cast<const char*>(p.key_cache);
  const char* vc = static_cast<const char*>(p.value_cache);
  const int64_t dvecs = DP / V::W;

  // Tiles before the earliest row's window are skipped whole; rows whose
  // window starts later are masked inside a tile.
  for (int64_t j = item_kv_begin(p, it) / KT; j < ntiles; ++j) {
    const int64_t t0 = j * KT;
    const int64_t n = cb_min(KT, kv_hi - t0);
    // First row that sees any token of this tile (position >= t0).
    const int64_t i_start = cb_max(0, t0 - ctx - it.q_begin);
    const int64_t r_start = i_start * G;
    const int64_t rows = M - r_start;
    const int64_t cvecs = (n + V::W - 1) / V::W;
    const int64_t ncols = cvecs * V::W;

    // Gather the tile's K (transposed) and, unless read in place, V as fp32.
    for (int64_t s0 = 0; s0 < n; s0 += bs) {
      const int64_t blk = table[(t0 + s0) / bs];
      const int64_t sn = cb_min(bs, n - s0);
      const int64_t base = (blk * bs * hkv + h) * D;  // element offset of (blk, 0, h, 0)
      V::pack_kt(kc + base * esize, ld, dtype, sn, D, Kt + s0, NP);
      if (!direct_v) {
        for (int64_t t = 0; t < sn; ++t) {
          float* vr = Vf + (s0 + t) * DP;
          V::to_f32(vc + (base + t * ld) * esize, dtype, vr, D);
          for (int64_t d = D; d < DP; ++d) vr[d] = 0.f;
        }
      }
    }
    for (int64_t d = 0; d < D; ++d)
      for (int64_t t = n; t < ncols; ++t) Kt[d * NP + t] = 0.f;

    scores(Qf + r_start * DP, DP, Kt, NP, S + r_start * NP, NP, D, rows, cvecs);

    // Online softmax update, row by row.
    for (int64_t r = r_start; r < M; ++r) {
      const int64_t pos = ctx + it.q_begin + r / G;
      const int64_t vis = cb_min(n, pos - t0 + 1);  // >= 1 for r >= r_start
      nv[r] = static_cast<int32_t>(vis);
      float* s = S + r * NP;
      mask_row(p, s, ncols, pos, t0, vis);
      online_softmax_row(s, ncols, mrow[r], lrow[r], Acc + r * DP, DP);
    }

    if (direct_v) {
      for (int64_t s0 = 0; s0 < n; s0 += bs) {
        const int64_t blk = table[(t0 + s0) / bs];
        const float* vb = reinterpret_cast<const float*>(vc) + (blk * bs * hkv + h) * D;
        pv(S + r_start * NP, NP, vb, ld, Acc + r_start * DP, DP, nv + r_start, rows, dvecs, s0, cb_min(bs, n - s0));
      }
    } else {
      pv(S + r_start * NP, NP, Vf, DP, Acc + r_start * DP, DP, nv + r_start, rows, dvecs, 0, n);
    }
  }

  store_rows(p, it, Acc, lrow, DP);
  return false;
}

// Portable helpers a V can reuse.
static inline void scalar_to_f32(const void* src, int dtype, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = cb_load_scalar(src, i, dtype);
}
static inline void scalar_from_f32(const float* src, int dtype, void* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) cb_store_scalar(dst, i, dtype, src[i]);
}

}  // namespace
