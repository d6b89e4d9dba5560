// y = x · wᵀ (+ bias) for a few rows of x: the decode-sized linear layer.
//
// With one to a few tokens per step every weight is used once or a few times,
// so a decode step at small batch is a stream over all of the model's
// weights (about 270 MB for SmolLM2-135M in bf16, far more than the cache)
// and its speed is memory bandwidth. oneDNN's prepacked kernels reach about
// 17 GB/s of weights at one row here, against about 23 GB/s that two cores can
// stream. This kernel reads the plain [N, K] weight rows front to back with
// AVX512-BF16 dot products (vdpbf16ps: bf16 products, fp32 sums), 16 output
// features at a time, one pass over the weights for all rows of x.
//
// bf16 only, on AVX512-BF16 CPUs; callers check `skinny_linear_supported()`.

#include "skinny_linear.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cstdint>

#include "bf16_vec.h"
#include "cpu_isa.h"
#include "linear_args.h"

#if CB_FUSED_X86
#define CB_HSUM_TARGET CB_AVX512BF16
#include "../avx512_hsum.h"
#endif

namespace cbserve_fused {

namespace {

#if CB_FUSED_X86
constexpr int64_t kRows = 16;  // output features per block: one vector of results
// Blocks prefetched ahead (measured 20.5 GB/s at 1, 18.9 at 2, 15.7 at 4, 14.3 at 0).
constexpr int64_t kPrefetchBlocks = 1;

// Output features [n0, n0 + 16) of every row of x. Rows of w past N are
// clamped to N - 1 (computed, not stored). K is a multiple of 32 or masked.
CB_AVX512BF16 void block16(const uint16_t* x, const uint16_t* w, const uint16_t* bias, uint16_t* y,
                           int64_t M, int64_t N, int64_t K, int64_t n0) {
  const uint16_t* wr[kRows];
  for (int64_t i = 0; i < kRows; ++i) wr[i] = w + (n0 + i < N ? n0 + i : N - 1) * K;
  const int64_t kfull = K / 32 * 32;
  const __mmask32 ktail = static_cast<__mmask32>((uint64_t(1) << (K - kfull)) - 1);
  const __mmask16 nmask = lanes(N - n0);
  const __m512 b = bias_lanes(bias, n0, nmask);
  // The next block's rows (contiguous after this block's) are prefetched into
  // L2 while this one computes: 16 interleaved short row streams are more
  // than the hardware prefetcher follows well.
  const char* pf = reinterpret_cast<const char*>(w + (n0 + kRows) * K);
  const char* pf_end = reinterpret_cast<const char*>(w + N * K);
  const int64_t pf_bytes = kPrefetchBlocks * kRows * K * 2;
  // Spread over every pass over the block (one per pair of x rows).
  const int64_t pf_step = (pf_bytes / (((M + 1) / 2) * ((K + 31) / 32)) + 63) / 64 * 64;
  // Rows of x two at a time: 32 accumulators; the 16 weight rows (18 KB at
  // K = 576) stay in L1 for the second and later pairs.
  for (int64_t m0 = 0; m0 < M; m0 += 2) {
    const bool two = m0 + 1 < M;
    const uint16_t* x0 = x + m0 * K;
    const uint16_t* x1 = two ? x0 + K : x0;
    __m512 acc0[kRows], acc1[kRows];
    for (int64_t i = 0; i < kRows; ++i) acc0[i] = acc1[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
      const __mmask32 km = k < kfull ? static_cast<__mmask32>(0xFFFFFFFFu) : ktail;
      const __m512bh xv0 = (__m512bh)_mm512_maskz_loadu_epi16(km, x0 + k);
      const __m512bh xv1 = (__m512bh)_mm512_maskz_loadu_epi16(km, x1 + k);
      for (int64_t o = 0; o < pf_step && pf < pf_end; o += 64, pf += 64) _mm_prefetch(pf, _MM_HINT_T1);
      for (int64_t i = 0; i < kRows; ++i) {
        const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(km, wr[i] + k);
        acc0[i] = _mm512_dpbf16_ps(acc0[i], wv, xv0);
        acc1[i] = _mm512_dpbf16_ps(acc1[i], wv, xv1);
      }
    }
    for (int r = 0; r < (two ? 2 : 1); ++r) {
      __m512* a = r == 0 ? acc0 : acc1;
      __m512 s = hsum_quads(hsum4_lanes(a[0], a[1], a[2], a[3]), hsum4_lanes(a[4], a[5], a[6], a[7]),
                            hsum4_lanes(a[8], a[9], a[10], a[11]), hsum4_lanes(a[12], a[13], a[14], a[15]));
      // Rounded to nearest even, as oneDNN's bf16 output is.
      store_bf16(reinterpret_cast<c10::BFloat16*>(y + (m0 + r) * N + n0), _mm512_add_ps(s, b), nmask);
    }
  }
}
#endif

}  // namespace

bool skinny_linear_supported() { return has_avx512_bf16(); }

torch::Tensor skinny_linear(const torch::Tensor& x, const torch::Tensor& weight,
                            const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(skinny_linear_supported(), "skinny_linear needs an AVX512-BF16 CPU");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "x and weight must be CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16,
              "skinny_linear is bf16 only");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1),
              "x must be [M, K] and weight [N, K]");
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "x and weight must be contiguous");
  TORCH_CHECK(weight.size(0) > 0 && weight.size(1) > 0, "weight must not be empty");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const uint16_t* bp = bf16_bias(bias, N);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
#if CB_FUSED_X86
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<c10::BFloat16>());
  const int64_t blocks = (N + kRows - 1) / kRows;
  // Contiguous ranges of weight rows per thread: each thread streams its own
  // part of the matrix front to back (the hardware prefetcher follows).
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block16(xp, wp, bp, yp, M, N, K, b * kRows);
  });
#endif
  return y;
}

}  // namespace cbserve_fused
