// y = x · wᵀ (+ bias) with fp32 AVX2 FMA arithmetic, for CPUs without native
// bf16 (AVX2 only): fp32 layers (where `--dtype auto` serves fp32) and bf16
// layers (`--dtype bfloat16`: weights, activations and output stored in bf16,
// every product and sum in fp32, the output rounded once to bf16 as torch's
// bf16 matmul rounds it).
//
// The weights are packed once into panels of 16 output features:
// [ceil(N/16)][K][16] in the weight's dtype, zero-padded past N, so one k of
// one panel is two 8-lane fp32 vectors (one 32-byte load of 16 bf16) and a
// panel's whole K sweep is contiguous. A register block of up to kMR rows of
// x by one panel (12 fp32 accumulators) takes, per k, the panel's two weight
// vectors and one broadcast of x per row. Each thread sweeps a contiguous
// share of panels front to back, every row block of x per panel (the panel
// stays in L1/L2 for the later row blocks), so the weights stream from memory
// once per call, and at a few rows (decode) at the memory's speed. A bf16
// panel that serves three row blocks or more is widened to fp32 once into a
// per-thread buffer (widening in registers costs the FMA pipes about a third
// at prefill sizes); up to two row blocks widen each k in registers, where
// the weights' stream, not the arithmetic, bounds the call. bf16 x is widened
// once per call. Callers check `avx2_f32_linear_supported()`.

#include "avx2_f32_linear.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "avx2_bf16.h"
#include "cpu_isa.h"
#include "linear_args.h"

namespace cbserve_fused {

namespace {

constexpr int64_t kPanel = 16;  // output features per panel (two vectors)
constexpr int kMR = 6;          // rows of x per register block

#if CB_FUSED_X86
// O: float (fp32 layers) or uint16_t (bf16 bits).
template <typename O>
struct Args {
  const float* x;     // [M, K], fp32 (bf16 x widened first)
  const float* bias;  // [N] fp32 or null
  O* y;               // [M, N]
  int64_t M, K, N;
};

// One k of a panel as two fp32 vectors: plain loads, or 16 bf16 widened (a
// bf16 is the top half of an fp32).
CB_AVX2 inline void load_panel_row(const float* w, __m256& w0, __m256& w1) {
  w0 = _mm256_loadu_ps(w);
  w1 = _mm256_loadu_ps(w + 8);
}

CB_AVX2 inline void load_panel_row(const uint16_t* w, __m256& w0, __m256& w1) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  w0 = widen_bf16x8(_mm256_castsi256_si128(v));
  w1 = widen_bf16x8(_mm256_extracti128_si256(v, 1));
}

// 16 outputs (two vectors) to y: fp32 as they are, bf16 rounded.
CB_AVX2 inline void store16(float* y, __m256 lo, __m256 hi) {
  _mm256_storeu_ps(y, lo);
  _mm256_storeu_ps(y + 8, hi);
}

CB_AVX2 inline void store16(uint16_t* y, __m256 lo, __m256 hi) { store_bf16x16(y, lo, hi); }

// Rows [m0, m0 + R) of x against one panel `w` (output features from n0).
template <int R, typename W, typename O>
CB_AVX2 void micro(const Args<O>& a, int64_t m0, const W* w, int64_t n0) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  const float* x = a.x + m0 * a.K;
  // Four lines ahead of the sweep: the next lines are in flight while these
  // are used (a panel's sweep is one sequential stream). Integer addresses:
  // past the last panel a prefetch never faults, and no pointer leaves the
  // buffer.
  const uintptr_t pf = reinterpret_cast<uintptr_t>(w) + 4 * 64;
  for (int64_t k = 0; k < a.K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(pf + k * kPanel * sizeof(W)), _MM_HINT_T0);
    __m256 w0, w1;
    load_panel_row(w + k * kPanel, w0, w1);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * a.K + k);
      lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
    }
  }
  const int64_t valid = a.N - n0 < kPanel ? a.N - n0 : kPanel;
  alignas(32) float b[kPanel] = {};
  if (a.bias != nullptr) std::memcpy(b, a.bias + n0, valid * sizeof(float));
  const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    O* y = a.y + (m0 + r) * a.N + n0;
    if (valid == kPanel) {
      store16(y, _mm256_add_ps(lo[r], b0), _mm256_add_ps(hi[r], b1));
    } else {  // the last panel of an N that is not a multiple of 16
      alignas(32) O t[kPanel];
      store16(t, _mm256_add_ps(lo[r], b0), _mm256_add_ps(hi[r], b1));
      std::memcpy(y, t, valid * sizeof(O));
    }
  }
}

// Every row of x against one panel, in ceil(M / kMR) register blocks of
// near-equal size (8 rows: 4 + 4, not 6 + 2): a block of R rows runs 2R
// independent FMA chains, and below 4 rows their latency, not the FMA
// ports, sets the pace over the whole K.
template <typename W, typename O>
CB_AVX2 void rows(const Args<O>& a, const W* w, int64_t n0) {
  const int64_t blocks = (a.M + kMR - 1) / kMR, base = a.M / blocks, wide = a.M % blocks;
  for (int64_t i = 0, m0 = 0; i < blocks; ++i) {
    const int64_t r = base + (i < wide ? 1 : 0);
    switch (r) {
      case 1: micro<1>(a, m0, w, n0); break;
      case 2: micro<2>(a, m0, w, n0); break;
      case 3: micro<3>(a, m0, w, n0); break;
      case 4: micro<4>(a, m0, w, n0); break;
      case 5: micro<5>(a, m0, w, n0); break;
      default: micro<kMR>(a, m0, w, n0); break;
    }
    m0 += r;
  }
}

// Panels [p0, p1) of `w`.
template <typename W, typename O>
CB_AVX2 void panels(const Args<O>& a, const W* w, int64_t p0, int64_t p1) {
  const int64_t panel = a.K * kPanel;
  if constexpr (std::is_same_v<W, uint16_t>) {
    if (a.M > 2 * kMR) {  // three row blocks or more: widen each panel once
      std::vector<float> wide(panel);
      for (int64_t pb = p0; pb < p1; ++pb) {
        const uint16_t* src = w + pb * panel;
        for (int64_t i = 0; i < panel; i += kPanel) {
          __m256 w0, w1;
          load_panel_row(src + i, w0, w1);
          _mm256_storeu_ps(wide.data() + i, w0);
          _mm256_storeu_ps(wide.data() + i + 8, w1);
        }
        rows(a, wide.data(), pb * kPanel);
      }
      return;
    }
  }
  for (int64_t pb = p0; pb < p1; ++pb) rows(a, w + pb * panel, pb * kPanel);
}
#endif

}  // namespace

bool avx2_f32_linear_supported() {
#if CB_FUSED_X86
  static const bool ok = isa_cap() >= 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

namespace {

template <typename T>
void pack_panels(const T* src, T* dst, int64_t N, int64_t K) {
  at::parallel_for(0, ceil_div(N, kPanel), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
        const T* row = src + (p * kPanel + j) * K;
        T* out = dst + p * K * kPanel + j;
        for (int64_t k = 0; k < K; ++k) out[k * kPanel] = row[k];
      }
  });
}

}  // namespace

at::Tensor avx2_f32_pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              "weight must be a CPU fp32 or bf16 [N, K] tensor");
  TORCH_CHECK(weight.size(0) > 0 && weight.size(1) > 0, "weight must have N > 0 and K > 0");
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  auto packed = at::zeros({ceil_div(N, kPanel), K, kPanel}, w.options());
  if (w.scalar_type() == at::kFloat)
    pack_panels(w.data_ptr<float>(), packed.data_ptr<float>(), N, K);
  else
    pack_panels(reinterpret_cast<const uint16_t*>(w.data_ptr<c10::BFloat16>()),
                reinterpret_cast<uint16_t*>(packed.data_ptr<c10::BFloat16>()), N, K);
  return packed;
}

at::Tensor avx2_f32_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                           const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(avx2_f32_linear_supported(), "avx2_f32_linear needs an AVX2 + FMA CPU");
  TORCH_CHECK(out_features > 0, "out_features must be positive");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "x and packed must be CPU tensors");
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  TORCH_CHECK((x.scalar_type() == at::kFloat || bf16) && packed.scalar_type() == x.scalar_type(),
              "avx2_f32_linear takes fp32 or bf16 x with packed weights of the same dtype");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 3 && packed.size(0) == ceil_div(out_features, kPanel) &&
                  packed.size(1) == x.size(1) && packed.size(2) == kPanel,
              "packed must come from avx2_f32_pack_weight of a weight with x's K and ", out_features,
              " output features");
  at::Tensor bias32;
  const float* bp = fp32_arith_bias(bias, out_features, bf16, bias32);
  auto y = at::empty({x.size(0), out_features}, x.options());
#if CB_FUSED_X86
  if (x.size(0) == 0) return y;
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  if (!bf16) {
    Args<float> a{x.data_ptr<float>(), bp, y.data_ptr<float>(), M, K, out_features};
    const float* w = packed.data_ptr<float>();
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) { panels(a, w, p0, p1); });
  } else {
    const auto x32 = x.to(at::kFloat);  // exact
    Args<uint16_t> a{x32.data_ptr<float>(), bp, reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>()), M, K,
                     out_features};
    const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr<c10::BFloat16>());
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) { panels(a, w, p0, p1); });
  }
#endif
  return y;
}

}  // namespace cbserve_fused
