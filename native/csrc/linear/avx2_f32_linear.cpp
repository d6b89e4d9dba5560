// y = x · wᵀ (+ bias) in fp32 with AVX2 FMA, for CPUs without native bf16
// (AVX2 only), where `--dtype auto` serves fp32.
//
// The weights are packed once into panels of 16 output features:
// [ceil(N/16)][K][16] fp32, zero-padded past N, so one k of one panel is two
// 32-byte vectors and a panel's whole K sweep is contiguous. A register block
// of up to kMR rows of x by one panel (12 fp32 accumulators) takes, per k,
// the panel's two weight vectors and one broadcast of x per row. Each thread
// sweeps a contiguous share of panels front to back, every row block of x per
// panel (the panel stays in L1/L2 for the later row blocks), so the weights
// stream from memory once per call, and at a few rows (decode) at the
// memory's speed. Callers check `avx2_f32_linear_supported()`.

#include "avx2_f32_linear.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#include "cpu_isa.h"
#include "linear_args.h"

namespace cbserve_fused {

namespace {

constexpr int64_t kPanel = 16;  // output features per panel (two vectors)
constexpr int kMR = 6;          // rows of x per register block

#if CB_FUSED_X86
struct Args {
  const float* x;     // [M, K]
  const float* w;     // panels
  const float* bias;  // [N] or null
  float* y;           // [M, N]
  int64_t M, K, N;
};

// Rows [m0, m0 + R) of x against panel `pb`.
template <int R>
CB_AVX2 void micro(const Args& a, int64_t m0, int64_t pb) {
  __m256 lo[R], hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm256_setzero_ps();
  const float* w = a.w + pb * a.K * kPanel;
  const float* x = a.x + m0 * a.K;
  // Four lines ahead of the sweep: the next lines are in flight while these
  // are used (a panel's sweep is one sequential stream). Integer addresses:
  // past the last panel a prefetch never faults, and no pointer leaves the
  // buffer.
  const uintptr_t pf = reinterpret_cast<uintptr_t>(w) + 4 * kPanel * sizeof(float);
  for (int64_t k = 0; k < a.K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(pf + k * kPanel * sizeof(float)), _MM_HINT_T0);
    const __m256 w0 = _mm256_loadu_ps(w + k * kPanel);
    const __m256 w1 = _mm256_loadu_ps(w + k * kPanel + 8);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * a.K + k);
      lo[r] = _mm256_fmadd_ps(xv, w0, lo[r]);
      hi[r] = _mm256_fmadd_ps(xv, w1, hi[r]);
    }
  }
  const int64_t n0 = pb * kPanel;
  const int64_t valid = a.N - n0 < kPanel ? a.N - n0 : kPanel;
  alignas(32) float b[kPanel] = {};
  if (a.bias != nullptr) std::memcpy(b, a.bias + n0, valid * sizeof(float));
  const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    float* y = a.y + (m0 + r) * a.N + n0;
    if (valid == kPanel) {
      _mm256_storeu_ps(y, _mm256_add_ps(lo[r], b0));
      _mm256_storeu_ps(y + 8, _mm256_add_ps(hi[r], b1));
    } else {  // the last panel of an N that is not a multiple of 16
      alignas(32) float t[kPanel];
      _mm256_store_ps(t, _mm256_add_ps(lo[r], b0));
      _mm256_store_ps(t + 8, _mm256_add_ps(hi[r], b1));
      std::memcpy(y, t, valid * sizeof(float));
    }
  }
}

// Every row of x against panels [p0, p1), kMR rows at a time.
CB_AVX2 void panels(const Args& a, int64_t p0, int64_t p1) {
  for (int64_t pb = p0; pb < p1; ++pb) {
    int64_t m0 = 0;
    for (; m0 + kMR <= a.M; m0 += kMR) micro<kMR>(a, m0, pb);
    switch (a.M - m0) {
      case 1: micro<1>(a, m0, pb); break;
      case 2: micro<2>(a, m0, pb); break;
      case 3: micro<3>(a, m0, pb); break;
      case 4: micro<4>(a, m0, pb); break;
      case 5: micro<5>(a, m0, pb); break;
      default: break;
    }
  }
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

torch::Tensor avx2_f32_pack_weight(const torch::Tensor& weight) {
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == at::kFloat && weight.dim() == 2,
              "weight must be a CPU fp32 [N, K] tensor");
  TORCH_CHECK(weight.size(0) > 0 && weight.size(1) > 0, "weight must have N > 0 and K > 0");
  const auto w = weight.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = ceil_div(N, kPanel);
  auto packed = torch::zeros({P, K, kPanel}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = packed.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j) {
        const float* row = src + (p * kPanel + j) * K;
        float* out = dst + p * K * kPanel + j;
        for (int64_t k = 0; k < K; ++k) out[k * kPanel] = row[k];
      }
  });
  return packed;
}

torch::Tensor avx2_f32_linear(const torch::Tensor& x, const torch::Tensor& packed, int64_t out_features,
                              const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(avx2_f32_linear_supported(), "avx2_f32_linear needs an AVX2 + FMA CPU");
  TORCH_CHECK(out_features > 0, "out_features must be positive");
  TORCH_CHECK(x.device().is_cpu() && packed.device().is_cpu(), "x and packed must be CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && packed.scalar_type() == at::kFloat, "avx2_f32_linear is fp32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [M, K] tensor");
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 3 && packed.size(0) == ceil_div(out_features, kPanel) &&
                  packed.size(1) == x.size(1) && packed.size(2) == kPanel,
              "packed must come from avx2_f32_pack_weight of a weight with x's K and ", out_features,
              " output features");
  const float* bp = f32_bias(bias, out_features);
  auto y = torch::empty({x.size(0), out_features}, x.options());
#if CB_FUSED_X86
  if (x.size(0) == 0) return y;
  Args a{x.data_ptr<float>(), packed.data_ptr<float>(), bp, y.data_ptr<float>(), x.size(0), x.size(1), out_features};
  at::parallel_for(0, packed.size(0), 1, [&](int64_t p0, int64_t p1) { panels(a, p0, p1); });
#endif
  return y;
}

}  // namespace cbserve_fused
