// y = x · wᵀ (+ bias) in bf16 on AMX tiles, for decode-sized batches.
//
// From 5 to a few dozen rows a decode step is still a stream over all the
// weights, which oneDNN's prepacked kernels read well below the memory
// bandwidth there (docs/native.md, "Linear layers").
// One TDPBF16PS multiplies a 16 x 32 tile of x by a 32 x 16 tile of weights,
// so compute is a small fraction of the time and the kernel is a loop that
// reads the packed weights front to back, two 16-feature column blocks at a
// time. A thread takes runs of up to 8 contiguous pairs, which the
// hardware prefetcher follows: software prefetches of the next pair (an
// earlier version) made the whole-model sweep slower.
//
// The weights are packed once (amx_pack_weight) into 1 KB tiles in the
// VNNI order the instruction reads, [N/16][K/32][16 k-pairs][16 n][2], so one
// column block's whole K sweep is contiguous. x is copied into a
// zero-padded [M rounded up to 16, K rounded up to 32] buffer so that every
// tile load stays in bounds.
//
// The weights may also stay in the 4- or 8-bit blocks of a GGUF file
// (Q4_1: w = d * q + m, Q8_0: w = d * q, 32 weights of one row per block;
// Q4_K / Q6_K: super-blocks of 256 with a scale per 32 or 16), packed by
// executor/cpu/gguf_weights.py into tiles of 320 / 544 bytes against 1 KB
// (a K-quant tile: one super-block, 8 k-blocks, gguf_tiles.h). They are
// expanded to bf16 tiles on the way: in a single pass (up to 32 rows) each
// k-block's two tiles one iteration ahead of their multiply,
// into an L1 buffer, with the blocks software-prefetched (the expansion, not
// the memory, is then the limit); with more rows a claimed run at a time into
// a per-thread buffer that the passes read from L2. The expansion computes
// d * q (+ m) in fp32 and rounds to bf16 (RNE), as transformers' GGUF loader
// and a bf16 cast do, so the tiles are bit-identical to amx_pack_weight of
// the bf16 model's weights and so are the outputs. The blocks are packed so
// that a tile row converts in tile order (dequant_tile).
//
// amx_linear_silu_mul is the MLP's gate|up projection on the same loop with
// a different epilogue: amx_pack_gate_up interleaves the gate and up rows in
// blocks of 16, so a thread's pair of column blocks is the gate and the up of
// the same 16 features, and the pair's accumulators become act(gate) * up
// directly, act SiLU or GELU-tanh (the [M, 2I] projection is never written).

#include "amx_linear.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "bf16_vec.h"
#include "cpu_isa.h"
#include "gguf_tiles.h"
#include "linear_args.h"

#include "../amx_tiles.h"

#if CB_FUSED_X86
#define CB_AMX __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16")))
#endif

namespace cbserve_fused {

namespace {

constexpr int64_t kTileN = 16;                   // output features per weight tile
constexpr int64_t kTileK = 32;                   // K elements per tile (16 bf16 pairs)
constexpr int64_t kTileM = 16;                   // rows of x per tile
constexpr int64_t kTileElems = kTileK * kTileN;  // 512 bf16 = 1 KB
using gguf_tiles::block_fmt;
using gguf_tiles::Fmt;
using gguf_tiles::tile_bytes;
#if CB_FUSED_X86
using gguf_tiles::block_tile_index;
using gguf_tiles::dequant_tile;
#endif

int64_t round_up(int64_t v, int64_t to) { return (v + to - 1) / to * to; }

#if CB_FUSED_X86
// Tiles 0-3: accumulators C[m-half][n-block]; 4-5: x rows 0-15 / 16-31;
// 6-7: weight tiles of the two column blocks. Every tile is 16 x 64 bytes.
CB_AMX void load_tile_config() {
  const cbserve_amx::TileConfig16x64 cfg;
  _tile_loadconfig(&cfg);
}

// Writes rows [m0, m0 + rows) x features [n0, n0 + 16) of y from one fp32
// accumulator tile in `acc` (16 x 16), plus bias, rounded to bf16.
CB_AMX void store_block(const float* acc, const uint16_t* bias, uint16_t* y, int64_t rows, int64_t N, int64_t n0) {
  if (n0 >= N) return;
  const __mmask16 nmask = lanes(N - n0);
  const __m512 b = bias_lanes(bias, n0, nmask);
  for (int64_t r = 0; r < rows; ++r)
    store_bf16(reinterpret_cast<c10::BFloat16*>(y + r * N + n0), _mm512_add_ps(_mm512_loadu_ps(acc + r * kTileN), b),
               nmask);
}

// The SiLU-and-mul epilogue: rows [r0, r0 + rows) x features [f0, f0 + 16)
// of y [M, I] = act(gate) * up from the gate and up accumulator tiles, each
// rounded to bf16 first as the separate projection would store it.
CB_AMX void store_act_mul(const float* gate, const float* up, uint16_t* y, int64_t rows, int64_t I, int64_t f0,
                          Act act) {
  const __mmask16 m = lanes(I - f0);
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 g = round_bf16(_mm512_loadu_ps(gate + r * kTileN));
    const __m512 u = round_bf16(_mm512_loadu_ps(up + r * kTileN));
    store_bf16(reinterpret_cast<c10::BFloat16*>(y + r * I + f0), act_mul(act, g, u), m);
  }
}

// The gate|up epilogue's shape: y [M, inter] = act(gate) * up; inter 0 for a
// plain projection.
struct Gated {
  int64_t inter = 0;
  Act act = Act::kSilu;
};

// What the epilogue of one pass needs: its four accumulator tiles, stored to
// memory, and where they go in y.
struct PassOut {
  const float* acc = nullptr;  // [4][16 x 16]: C[m-half][n-block]
  int64_t m0 = 0, nb = 0;
  bool two = false, two_m = false;
};

// One thread's running greedy choice per row of x (amx_linear_argmax): the
// largest bf16-rounded output so far and its column (the first one on ties:
// a thread sees its columns in increasing order), and the first NaN column.
struct ArgmaxRows {
  float* val;
  int64_t* idx;
  int64_t* nan_idx;
};

// Folds rows [r0, r0 + rows) x features [n0, n0 + 16) of one fp32
// accumulator tile (plus bias, rounded to bf16 as the logits would be stored)
// into `am`: store_block's argmax twin.
CB_AMX void argmax_block(const float* acc, const uint16_t* bias, int64_t rows, int64_t N, int64_t n0, ArgmaxRows& am,
                         int64_t r0) {
  if (n0 >= N) return;
  const __mmask16 m = lanes(N - n0);
  const __m512 b = bias_lanes(bias, n0, m);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t r = r0 + i;
    const __m512 v = round_bf16(_mm512_add_ps(_mm512_loadu_ps(acc + i * kTileN), b));
    const __mmask16 nan = _mm512_mask_cmp_ps_mask(m, v, v, _CMP_UNORD_Q);
    if (nan) {
      am.nan_idx[r] = std::min<int64_t>(am.nan_idx[r], n0 + __builtin_ctz(nan));
      continue;
    }
    const __m512 vm = _mm512_mask_blend_ps(m, _mm512_set1_ps(-INFINITY), v);
    const float mv = _mm512_reduce_max_ps(vm);
    if (mv > am.val[r] || am.idx[r] < 0) {
      const __mmask16 eq = _mm512_cmp_ps_mask(vm, _mm512_set1_ps(mv), _CMP_EQ_OQ) & m;
      am.val[r] = mv;
      am.idx[r] = n0 + __builtin_ctz(eq);
    }
  }
}

// The epilogue of a pass: rows [m0, m0 + 32) x the pair's 32 features of y
// (+ bias), or act(gate) * up when gated.inter > 0, or (with `am`) only the
// rows' running argmax.
CB_AMX void finish_pass(const PassOut& out, const uint16_t* bias, uint16_t* y, int64_t M, int64_t N, Gated gated,
                        ArgmaxRows* am) {
  constexpr int64_t kAcc = kTileM * kTileN;
  const int64_t n0 = out.nb * kTileN;
  for (int half = 0; half < (out.two_m ? 2 : 1); ++half) {
    const int64_t r0 = out.m0 + half * kTileM;
    const int64_t rows = std::min<int64_t>(kTileM, M - r0);
    if (rows <= 0) continue;
    const float* a0 = out.acc + 2 * half * kAcc;
    if (am != nullptr) {  // block nb before nb + 1: each row sees its columns in increasing order
      argmax_block(a0, bias, rows, N, n0, *am, r0);
      if (out.two) argmax_block(a0 + kAcc, bias, rows, N, n0 + kTileN, *am, r0);
      continue;
    }
    if (gated.inter > 0) {
      store_act_mul(a0, a0 + kAcc, y + r0 * gated.inter, rows, gated.inter, n0 / 2, gated.act);
      continue;
    }
    store_block(a0, bias, y + r0 * N, rows, N, n0);
    if (out.two) store_block(a0 + kAcc, bias, y + r0 * N, rows, N, n0 + kTileN);
  }
}

// Column blocks nb and nb + 1 (when `two`) for rows m0 .. m0 + 31 of x (one
// pass). With `gated.inter` > 0 the pair is (gate block, up block) of a weight
// packed by amx_pack_gate_up and y is [M, gated.inter]: act(gate) * up.
//
// The epilogue of each pass runs one pass late (`pending`, alternating
// between the two halves of `acc`): reading accumulators straight after the
// tile store that wrote them stalls until the store has drained, which cost
// about a fifth of a batch-64 decode step's linear layers; a pass later the
// lines are plain L1 hits and the vector work overlaps the next pass's tiles.
CB_AMX void pair_pass(const uint16_t* xp, const uint16_t* wp, const uint16_t* bias, uint16_t* y, int64_t M,
                      int64_t Mpad, int64_t Kpad, int64_t N, int64_t nb, bool two, int64_t m0, Gated gated, float* acc,
                      int& slot, PassOut& pending, ArgmaxRows* am, int64_t wp_nb0, bool pair_major,
                      Fmt fmt = Fmt::kBf16, const uint8_t* q = nullptr, uint16_t* qbuf = nullptr) {
  constexpr int64_t kAcc = kTileM * kTileN;
  const int64_t kblocks = Kpad / kTileK;
  // wp (bf16 tiles, holding column blocks from wp_nb0) is null with `q`. In
  // pair-major order (blocks, and the tiles expanded from them) the pair's
  // two tiles of each k-block sit side by side (block_tile_index).
  const uint16_t* w0 = q == nullptr ? wp + (nb - wp_nb0) * kblocks * kTileElems : nullptr;
  const uint16_t* w1 = q == nullptr ? w0 + (pair_major ? kTileElems : kblocks * kTileElems) : nullptr;
  const int64_t wstep = pair_major && two ? 2 * kTileElems : kTileElems;
  // With `q` (a single pass over block-quantised weights): each k-block's two
  // tiles are expanded into `qbuf` (L1, alternating halves) just before use.
  // A K-quant tile holds a super-block of 8 k-blocks (`shift` 3): k-block kb
  // is sub-block kb % 8 of packed tile kb >> shift.
  const int64_t tb = q != nullptr ? tile_bytes(fmt) : 0;
  const int shift = q != nullptr && gguf_tiles::k_quant(fmt) ? 3 : 0;
  const int64_t sub_mask = (int64_t(1) << shift) - 1;
  const uint8_t* q0 = q != nullptr ? q + nb * (kblocks >> shift) * tb : nullptr;
  const uint8_t* q1 = q0 + tb;
  const int64_t qstep = two ? 2 * tb : tb;  // bytes from one packed tile of the pair to the next
  // Prefetched per k-block: Q4_1 / Q8_0 the pair's tiles three k-blocks
  // ahead; K-quants an eighth of the next super-block's pair.
  const int64_t pf_bytes = qstep >> shift;
  const int64_t pf_ahead = shift != 0 ? 1 : 2;
  const int64_t xstride = Kpad * 2;
  const bool two_m = m0 + kTileM < Mpad;
  const uint16_t* x0 = xp + m0 * Kpad;
  const uint16_t* x1 = x0 + kTileM * Kpad;
  if (q0 != nullptr) {
    dequant_tile(fmt, q0, qbuf, 0);
    if (two) dequant_tile(fmt, q1, qbuf + kTileElems, 0);
  }
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kb = 0; kb < kblocks; ++kb) {
    if (q0 != nullptr) {
      // Expand k-block kb + 1 now and multiply k-block kb (expanded one
      // iteration ago): the tile loads never wait for stores still in flight.
      const int64_t nk = kb + 1;
      if (nk < kblocks) {
        // Ahead of use, past the pair's end into the next one's (a prefetch
        // never faults; integer addresses, no out-of-range pointers).
        const uintptr_t ahead =
            reinterpret_cast<uintptr_t>(q0) + ((nk >> shift) + pf_ahead) * qstep + (nk & sub_mask) * pf_bytes;
        for (int64_t l = 0; l < pf_bytes; l += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + l), _MM_HINT_T0);
        uint16_t* nbuf = qbuf + (nk & 1) * 2 * kTileElems;
        const int64_t at = (nk >> shift) * qstep;
        dequant_tile(fmt, q0 + at, nbuf, nk);
        if (two) dequant_tile(fmt, q1 + at, nbuf + kTileElems, nk);
      }
    }
    // This k-block's two weight tiles.
    const uint16_t* t0 = q0 != nullptr ? qbuf + (kb & 1) * 2 * kTileElems : w0 + kb * wstep;
    const uint16_t* t1 = q0 != nullptr ? t0 + kTileElems : w1 + kb * wstep;
    _tile_loadd(4, x0 + kb * kTileK, xstride);
    _tile_loadd(6, t0, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (two) {
      _tile_loadd(7, t1, 64);
      _tile_dpbf16ps(1, 4, 7);
    }
    if (two_m) {
      _tile_loadd(5, x1 + kb * kTileK, xstride);
      _tile_dpbf16ps(2, 5, 6);
      if (two) _tile_dpbf16ps(3, 5, 7);
    }
  }
  if (pending.acc != nullptr) finish_pass(pending, bias, y, M, N, gated, am);
  float* a = acc + slot * 4 * kAcc;
  slot ^= 1;
  _tile_stored(0, a, 64);
  _tile_stored(1, a + kAcc, 64);
  _tile_stored(2, a + 2 * kAcc, 64);
  _tile_stored(3, a + 3 * kAcc, 64);
  pending = PassOut{a, m0, nb, two, two_m};
}

// Column blocks nb0 (even) .. nb1 of block-quantised weights -> their bf16
// tiles in the same pair-major order (block_tile_index over 32-wide
// k-blocks), read in the order they are stored. A Q4_1 / Q8_0 tile expands
// to one bf16 tile in place; a K-quant one to its 8 k-blocks' tiles, which
// interleave with the pair's other column block's.
CB_AMX void dequant_tiles(Fmt fmt, const uint8_t* src, uint16_t* dst, int64_t nb0, int64_t nb1, int64_t nblocks,
                          int64_t kblocks) {
  const int64_t tb = tile_bytes(fmt), per = gguf_tiles::kblocks_per_tile(fmt), ktiles = kblocks / per;
  const int64_t base = nb0 * kblocks;  // first expanded tile of the run (nb0 even: a pair's start)
  const uint8_t* next = src + nb0 * ktiles * tb;
  for (int64_t c0 = nb0; c0 < nb1; c0 += 2) {
    const int64_t width = c0 + 1 < nb1 ? 2 : 1;  // the pair's column blocks (an odd last one alone)
    for (int64_t s = 0; s < ktiles; ++s)
      for (int64_t c = c0; c < c0 + width; ++c, next += tb) {
        const uintptr_t ahead = reinterpret_cast<uintptr_t>(next) + 4 * tb;  // may pass the end: a hint only
        for (int64_t l = 0; l < tb; l += 64) _mm_prefetch(reinterpret_cast<const char*>(ahead + l), _MM_HINT_T0);
        for (int64_t j = 0; j < per; ++j) {
          const int64_t kb = s * per + j;
          dequant_tile(fmt, next, dst + (gguf_tiles::block_tile_index(c, kb, nblocks, kblocks) - base) * kTileElems,
                       kb);
        }
      }
  }
}

// Pairs of column blocks claimed `chunk` at a time from `next` until none is
// left (in increasing order on each thread). A claimed run is swept one
// 32-row pass at a time over all its pairs: the pass's rows of x (36 KB at
// K = 576) stay in L1 while the run's weights (up to 8 pairs, 288 KB) come
// from memory on the first pass and from L2 on the next ones (pass-major
// within each pair, x was re-read from L2 for every pair).
CB_AMX void run_pairs(const uint16_t* xp, const void* weights, Fmt fmt, const uint16_t* bias, uint16_t* y, int64_t M,
                      int64_t Mpad, int64_t Kpad, int64_t N, int64_t nblocks, std::atomic<int64_t>& next, int64_t chunk,
                      Gated gated, ArgmaxRows* am) {
  alignas(64) float acc[2 * 4 * kTileM * kTileN];
  int slot = 0;
  PassOut pending;
  const int64_t npairs = (nblocks + 1) / 2;
  const int64_t kblocks = Kpad / kTileK;
  // Block-quantised weights: each claimed run is expanded to bf16 tiles here
  // first (up to 8 pairs: 16 x 18 KB at K = 576) and the passes read them from L2.
  // Kept per thread between calls: a fresh 0.3-0.8 MB allocation would be
  // mapped and faulted in on every call.
  thread_local std::vector<uint16_t> run_tiles;
  if (fmt != Fmt::kBf16 && Mpad > 2 * kTileM && run_tiles.size() < size_t(2 * chunk * kblocks * kTileElems))
    run_tiles.resize(2 * chunk * kblocks * kTileElems);
  alignas(64) uint16_t qbuf[4 * kTileElems];
  load_tile_config();
  for (int64_t p0 = next.fetch_add(chunk, std::memory_order_relaxed); p0 < npairs;
       p0 = next.fetch_add(chunk, std::memory_order_relaxed)) {
    const int64_t p1 = std::min(p0 + chunk, npairs);
    const uint16_t* wp = static_cast<const uint16_t*>(weights);
    int64_t wp_nb0 = 0;
    if (fmt != Fmt::kBf16 && Mpad <= 2 * kTileM) {  // one pass: expand each tile just before its use
      for (int64_t p = p0; p < p1; ++p)
        pair_pass(xp, nullptr, bias, y, M, Mpad, Kpad, N, 2 * p, 2 * p + 1 < nblocks, 0, gated, acc, slot, pending, am,
                  0, true, fmt, static_cast<const uint8_t*>(weights), qbuf);
      continue;
    }
    if (fmt != Fmt::kBf16) {
      wp_nb0 = 2 * p0;
      dequant_tiles(fmt, static_cast<const uint8_t*>(weights), run_tiles.data(), wp_nb0, std::min(2 * p1, nblocks),
                    nblocks, kblocks);
      wp = run_tiles.data();
    }
    for (int64_t m0 = 0; m0 < Mpad; m0 += 2 * kTileM)
      for (int64_t p = p0; p < p1; ++p)
        pair_pass(xp, wp, bias, y, M, Mpad, Kpad, N, 2 * p, 2 * p + 1 < nblocks, m0, gated, acc, slot, pending, am,
                  wp_nb0, fmt != Fmt::kBf16);
  }
  if (pending.acc != nullptr) finish_pass(pending, bias, y, M, N, gated, am);
  _tile_release();
}
#endif

}  // namespace

bool amx_linear_supported() {
#if CB_FUSED_X86
  static const bool ok = isa_cap() >= 3 && has_avx512_bf16() && __builtin_cpu_supports("amx-tile") &&
                         __builtin_cpu_supports("amx-bf16") && cbserve_amx::request_tile_state();
  return ok;
#else
  return false;
#endif
}

at::Tensor amx_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kBFloat16 && weight.dim() == 2,
              "weight must be a CPU bf16 [N, K] tensor");
  TORCH_CHECK(weight.size(0) > 0 && weight.size(1) > 0, "weight must not be empty");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t Npad = round_up(N, kTileN), Kpad = round_up(K, kTileK);
  auto padded = at::zeros({Npad, Kpad}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  // [nb, n, kb, kpair, 2] -> [nb, kb, kpair, n, 2]
  return padded.view({Npad / kTileN, kTileN, Kpad / kTileK, kTileK / 2, 2}).permute({0, 2, 3, 1, 4}).contiguous();
}

namespace {

// Checks x and packed (amx_pack_weight, amx_pack_gate_up, or the uint8
// [N/16, K/32 or K/256, tile bytes] blocks of a GGUF weight packed in Python,
// executor/cpu/gguf_weights.py) for an [n_features, K] weight; returns nblocks.
int64_t check_amx_args(const at::Tensor& x, const at::Tensor& packed, int64_t n_features, Fmt& fmt) {
  TORCH_CHECK(amx_linear_supported(), "amx_linear needs an AMX-BF16 CPU");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "x and packed must be CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "amx_linear is bf16 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  const int64_t nblocks = round_up(n_features, kTileN) / kTileN;
  TORCH_CHECK(packed.is_contiguous(), "packed must be contiguous");
  if (packed.scalar_type() == at::kByte) {
    fmt = gguf_tiles::check_blocks(packed, n_features, x.size(1));
    return nblocks;
  }
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16, "packed must be bf16 tiles or uint8 quantised blocks");
  check_bf16_tiles(packed, n_features, x.size(1));
  fmt = Fmt::kBf16;
  return nblocks;
}

// y = x · wᵀ (+ bias), or act(gate) * up when gated.inter > 0, over all pairs
// of column blocks split between the threads; with `argmax_out` ([M]) y is
// not written and each row's greedy column goes there instead.
void run(const at::Tensor& x, const at::Tensor& packed, Fmt fmt, int64_t N, int64_t nblocks, const uint16_t* bp,
         at::Tensor& y, Gated gated, int64_t* argmax_out = nullptr) {
  const int64_t M = x.size(0), K = x.size(1);
  if (M == 0) return;
#if CB_FUSED_X86
  const int64_t Mpad = round_up(M, kTileM), Kpad = round_up(K, kTileK);
  // Zero-padded copy of x: tile loads read whole 16 x 32 tiles.
  auto xpad_t = at::empty({Mpad, Kpad}, x.options());
  auto* xp = reinterpret_cast<uint16_t*>(xpad_t.data_ptr<c10::BFloat16>());
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  for (int64_t r = 0; r < Mpad; ++r) {
    uint16_t* dst = xp + r * Kpad;
    if (r < M) {
      std::memcpy(dst, xs + r * K, K * 2);
      std::memset(dst + K, 0, (Kpad - K) * 2);
    } else {
      std::memset(dst, 0, Kpad * 2);
    }
  }
  const void* wp = packed.data_ptr();
  auto* yp = argmax_out != nullptr ? nullptr : reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>());
  // The threads claim runs of up to 8 pairs (~290 KB of SmolLM2's weights)
  // until none is left, at least ~4 runs per thread, instead of a fixed half
  // each: in the server the router and the clients share the two cores, and a
  // thread the OS has preempted no longer holds the other one at the join.
  // Alone the two schemes are equal; with a busy neighbour, claiming wins.
  const int64_t nthreads = at::get_num_threads();
  const int64_t npairs = (nblocks + 1) / 2;
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(8, npairs / (4 * nthreads)));
  std::atomic<int64_t> next{0};
  // With argmax_out: one running argmax per thread and row, merged below (the
  // larger value wins, the smaller column on ties, the first NaN column over all).
  const int64_t am_len = argmax_out != nullptr ? nthreads * M : 0;
  std::vector<float> val(am_len, -INFINITY);
  std::vector<int64_t> idx(am_len, -1), nan_idx(am_len, INT64_MAX);
  at::parallel_for(0, nthreads, 1, [&](int64_t t0, int64_t t1) {
    ArgmaxRows am{}, *amp = nullptr;
    if (argmax_out != nullptr) {
      const int64_t t = std::min<int64_t>(at::get_thread_num(), nthreads - 1);
      am = ArgmaxRows{val.data() + t * M, idx.data() + t * M, nan_idx.data() + t * M};
      amp = &am;
    }
    for (int64_t w = t0; w < t1; ++w)
      run_pairs(xp, wp, fmt, bp, yp, M, Mpad, Kpad, N, nblocks, next, chunk, gated, amp);
  });
  if (argmax_out == nullptr) return;
  for (int64_t r = 0; r < M; ++r) {
    float bv = -INFINITY;
    int64_t bi = -1, ni = INT64_MAX;
    for (int64_t t = 0; t < nthreads; ++t) {
      const int64_t i = idx[t * M + r];
      const float v = val[t * M + r];
      ni = std::min(ni, nan_idx[t * M + r]);
      if (i >= 0 && (bi < 0 || v > bv || (v == bv && i < bi))) bv = v, bi = i;
    }
    argmax_out[r] = ni != INT64_MAX ? ni : std::max<int64_t>(bi, 0);
  }
#endif
}

}  // namespace

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const c10::optional<at::Tensor>& bias) {
  Fmt fmt;
  const int64_t nblocks = check_amx_args(x, packed, out_features, fmt);
  const uint16_t* bp = bf16_bias(bias, out_features);
  auto y = at::empty({x.size(0), out_features}, x.options());
  run(x, packed, fmt, out_features, nblocks, bp, y, Gated{});
  return y;
}

at::Tensor amx_linear_argmax(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                             const c10::optional<at::Tensor>& bias) {
  Fmt fmt;
  const int64_t nblocks = check_amx_args(x, packed, out_features, fmt);
  const uint16_t* bp = bf16_bias(bias, out_features);
  auto out = at::zeros({x.size(0)}, x.options().dtype(at::kLong));
  at::Tensor unused;
  run(x, packed, fmt, out_features, nblocks, bp, unused, Gated{}, out.data_ptr<int64_t>());
  return out;
}

at::Tensor amx_pack_gate_up(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(0) % (2 * kTileN) == 0,
              "gate_up must be [2 I, K] (gate rows then up rows) with I a multiple of 16");
  const int64_t I = gate_up.size(0) / 2, K = gate_up.size(1);
  // [2, I/16, 16, K] -> [I/16, 2, 16, K]: gate block j, then up block j.
  return amx_pack_weight(gate_up.reshape({2, I / kTileN, kTileN, K}).transpose(0, 1).reshape({2 * I, K}));
}

at::Tensor amx_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t inter,
                               const std::string& activation) {
  const Act act = parse_act(activation);
  TORCH_CHECK(inter > 0 && inter % kTileN == 0, "inter must be a positive multiple of 16");
  Fmt fmt;
  const int64_t nblocks = check_amx_args(x, packed, 2 * inter, fmt);
  auto y = at::empty({x.size(0), inter}, x.options());
  run(x, packed, fmt, 2 * inter, nblocks, nullptr, y, Gated{inter, act});
  return y;
}

at::Tensor amx_dequant(const at::Tensor& packed) {
  TORCH_CHECK(has_avx512_bf16(), "amx_dequant needs an AVX512-BF16 CPU");
  TORCH_CHECK(packed.device().is_cpu() && packed.is_contiguous(), "packed must be a contiguous CPU tensor");
  const Fmt fmt = block_fmt(packed);
  const int64_t nblocks = packed.size(0), kblocks = packed.size(1) * gguf_tiles::kblocks_per_tile(fmt);
  auto out = at::empty({nblocks, kblocks, kTileK / 2, kTileN, 2}, packed.options().dtype(at::kBFloat16));
#if CB_FUSED_X86
  const auto* src = packed.data_ptr<uint8_t>();
  auto* dst = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  at::parallel_for(0, nblocks, 2, [&](int64_t b0, int64_t b1) {
    for (int64_t nb = b0; nb < b1; ++nb)
      for (int64_t kb = 0; kb < kblocks; ++kb)
        dequant_tile(fmt, gguf_tiles::tile_at(fmt, src, nb, kb, nblocks, kblocks),
                     dst + (nb * kblocks + kb) * kTileElems, kb);
  });
#endif
  return out;
}

}  // namespace cbserve_fused
