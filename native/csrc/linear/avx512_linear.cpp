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
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_vec.h"
#include "cpu_isa.h"
#include "gguf_tiles.h"
#include "int8_blocks.h"
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
// Up to int8_blocks::kMaxRows rows, int8_blocks multiplies the blocks by x
// rounded per k-block with integer dot products (int8_blocks.h); its sums
// take this file's epilogue (store_rows), so bias, act(gate) * up and the
// bf16 output round as in the bf16 kernels.

template <int R, int NV>
CB_AVX512BF16 void store_sums_of(const Args& a, int64_t m0, int64_t nb, const float* sums) {
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 2
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_loadu_ps(sums + (r * NV + v) * kBlockN);
  store_rows<R, NV>(a, acc, m0, nb);
}

// int8_blocks::Store over an Args (ctx).
void store_sums(const void* ctx, int64_t m0, int rows, int64_t nb, int nv, const float* sums) {
  const Args& a = *static_cast<const Args*>(ctx);
#define CB_SR(R)                            \
  case R:                                   \
    if (nv == 2)                            \
      store_sums_of<R, 2>(a, m0, nb, sums); \
    else                                    \
      store_sums_of<R, 1>(a, m0, nb, sums); \
    break;
  switch (rows) {
    CB_SR(1)
    CB_SR(2)
    CB_SR(3)
    CB_SR(4)
    CB_SR(5)
    CB_SR(6)
    CB_SR(7)
    CB_SR(8)
    default: break;
  }
#undef CB_SR
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

Args make_args(const at::Tensor& x, int64_t N, const uint16_t* bias, at::Tensor& y, bool silu, Act act) {
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

void run(const at::Tensor& x, const at::Tensor& packed, int64_t N, const uint16_t* bias, at::Tensor& y, bool silu,
         Act act = Act::kSilu) {
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
void run_blocks(const at::Tensor& x, const at::Tensor& packed, int64_t N, const uint16_t* bias, at::Tensor& y,
                bool silu, Act act = Act::kSilu) {
  Args a = make_args(x, N, bias, y, silu, act);
  a.prefetch = false;
  const gguf_tiles::Fmt fmt = gguf_tiles::block_fmt(packed);
  const int64_t nblocks = packed.size(0), kblocks = packed.size(1) * gguf_tiles::kblocks_per_tile(fmt);
  a.panel = kblocks * kTileElems;
  if (a.M == 0) return;
  const uint8_t* src = packed.data_ptr<uint8_t>();
  if (int8_blocks::takes(a.M))
    return int8_blocks::multiply(a.x, true, a.M, a.K, fmt, src, nblocks, kblocks, store_sums, &a);
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
bool check_args(const at::Tensor& x, const at::Tensor& packed, int64_t n_features) {
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

at::Tensor avx512_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(out_features > 0, "out_features must be positive");
  const bool blocks = check_args(x, packed, out_features);
  const uint16_t* bp = bf16_bias(bias, out_features);
  auto y = at::empty({x.size(0), out_features}, x.options());
#if CB_FUSED_X86
  if (blocks)
    run_blocks(x, packed, out_features, bp, y, false);
  else
    run(x, packed, out_features, bp, y, false);
#endif
  return y;
}

at::Tensor avx512_linear_silu_mul(const at::Tensor& x, const at::Tensor& packed, int64_t inter,
                                  const std::string& activation) {
  const Act act = parse_act(activation);
  TORCH_CHECK(inter > 0 && inter % kBlockN == 0, "inter must be a positive multiple of 16");
  const bool blocks = check_args(x, packed, 2 * inter);
  auto y = at::empty({x.size(0), inter}, x.options());
#if CB_FUSED_X86
  if (blocks)
    run_blocks(x, packed, 2 * inter, nullptr, y, true, act);
  else
    run(x, packed, 2 * inter, nullptr, y, true, act);
#endif
  return y;
}

}  // namespace cbserve_fused
