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
// bf16 only; callers check `avx512_linear_supported()`.

#include "avx512_linear.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#include "bf16_vec.h"
#include "cpu_isa.h"
#include "linear_args.h"

namespace cbserve_fused {

namespace {

constexpr int64_t kBlockN = 16;  // output features per block (one vector)
constexpr int64_t kBlockK = 32;  // K elements per tile of the packed layout
constexpr int64_t kTileElems = kBlockK * kBlockN;
constexpr int kMR = 6;  // rows of x per register block
constexpr int kNV = 4;  // feature blocks per register block

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

// Rows [m0, m0 + R) of x against feature blocks [nb, nb + NV). Row block
// `rb` of `nrb` pulls its share of the next group's weights toward L2 as it
// goes: spread over all of the group's row blocks, the group's DRAM traffic
// runs at an even rate instead of a burst in its first row block (which, at
// 12-24 rows, asks for more than a core's share of the memory bandwidth and
// stalls on full miss buffers).
template <int R, int NV>
CB_AVX512BF16 void micro(const Args& a, int64_t m0, int64_t nb, int64_t rb, int64_t nrb) {
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  const uint16_t* w = a.w + nb * a.panel;
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
    if (credit >= pairs) {
      credit -= pairs;
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v)
        _mm_prefetch(reinterpret_cast<const char*>(pf + (v * a.panel + q * 2 * kBlockN) * 2), _MM_HINT_T1);
      ++q;
    }
    kpair<R, NV, false>(acc, w, a.panel, x, a.K, p);
  }
  if (a.K & 1) kpair<R, NV, true>(acc, w, a.panel, x, a.K, pairs);  // x[K - 1] and the packing's zero
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

// Every row of x against feature blocks [nb, nb + NV), in ceil(M / kMR) row
// blocks of even size (8 rows: 4 + 4, not 6 + 2): each row block issues an
// equal share of the next group's prefetches, so they must take equal time.
template <int NV>
CB_AVX512BF16 void all_rows(const Args& a, int64_t nb) {
  const int64_t nrb = ceil_div(a.M, kMR), base = a.M / nrb, extra = a.M % nrb;
  for (int64_t rb = 0, m0 = 0; rb < nrb; ++rb) {
    const int64_t rows = base + (rb < extra ? 1 : 0);
    switch (rows) {
      case 1: micro<1, NV>(a, m0, nb, rb, nrb); break;
      case 2: micro<2, NV>(a, m0, nb, rb, nrb); break;
      case 3: micro<3, NV>(a, m0, nb, rb, nrb); break;
      case 4: micro<4, NV>(a, m0, nb, rb, nrb); break;
      case 5: micro<5, NV>(a, m0, nb, rb, nrb); break;
      default: micro<kMR, NV>(a, m0, nb, rb, nrb); break;
    }
    m0 += rows;
  }
}

// Feature blocks [b0, b1), kNV at a time (the rest in smaller groups).
CB_AVX512BF16 void blocks(const Args& a, int64_t b0, int64_t b1) {
  int64_t nb = b0;
  for (; nb + kNV <= b1; nb += kNV) all_rows<kNV>(a, nb);
  switch (b1 - nb) {
    case 1: all_rows<1>(a, nb); break;
    case 2: all_rows<2>(a, nb); break;
    case 3: all_rows<3>(a, nb); break;
    default: break;
  }
}

void run(const torch::Tensor& x, const torch::Tensor& packed, int64_t N, const uint16_t* bias, torch::Tensor& y,
         bool silu, Act act = Act::kSilu) {
  Args a;
  a.M = x.size(0);
  a.K = x.size(1);
  a.N = N;
  a.x = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  a.w = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
  a.bias = bias;
  a.y = reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>());
  a.panel = packed.size(1) * kTileElems;
  a.silu = silu;
  a.act = act;
  if (a.M == 0) return;
  const int64_t nblocks = ceil_div(N, kBlockN);
  // A fixed contiguous share of units per thread (a unit: one block, or a
  // (gate, up) pair). Claiming runs of blocks from an atomic counter, as
  // amx_linear does, was slower here, alone and in the server: runs of whole
  // 4-block groups split the small layers unevenly.
  const int64_t unit = silu ? 2 : 1;
  at::parallel_for(0, nblocks / unit, 1, [&](int64_t u0, int64_t u1) { blocks(a, u0 * unit, u1 * unit); });
}
#endif

void check_args(const torch::Tensor& x, const torch::Tensor& packed, int64_t n_features) {
  TORCH_CHECK(avx512_linear_supported(), "avx512_linear needs an AVX512-BF16 CPU");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "x and packed must be CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16,
              "avx512_linear is bf16 only (packed: amx_pack_weight's bf16 tiles)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(x.size(1) > 0, "x must have K > 0");
  TORCH_CHECK(packed.is_contiguous(), "packed must be contiguous");
  check_bf16_tiles(packed, n_features, x.size(1));
}

}  // namespace

bool avx512_linear_supported() { return has_avx512_bf16(); }

torch::Tensor avx512_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                            const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(out_features > 0, "out_features must be positive");
  check_args(x, packed, out_features);
  const uint16_t* bp = bf16_bias(bias, out_features);
  auto y = torch::empty({x.size(0), out_features}, x.options());
#if CB_FUSED_X86
  run(x, packed, out_features, bp, y, false);
#endif
  return y;
}

torch::Tensor avx512_linear_silu_mul(const torch::Tensor& x, const torch::Tensor& packed, int64_t inter,
                                     const std::string& activation) {
  const Act act = parse_act(activation);
  TORCH_CHECK(inter > 0 && inter % kBlockN == 0, "inter must be a positive multiple of 16");
  check_args(x, packed, 2 * inter);
  auto y = torch::empty({x.size(0), inter}, x.options());
#if CB_FUSED_X86
  run(x, packed, 2 * inter, nullptr, y, true, act);
#endif
  return y;
}

}  // namespace cbserve_fused
