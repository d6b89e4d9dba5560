// lora_add (lora_linear.h): AVX-512 (where avx512_linear runs), AVX2 + FMA,
// and portable code. A block of up to 8 rows of one slot shares each loaded
// row of At (the shrink keeps 16 ranks of each row in registers) and each
// 64-column panel of Bt (the expand keeps a row's 64 outputs in registers).
// Every path sums the shrink over k and the expand over r in order, so a
// row's delta never depends on the other rows.

#include "lora_linear.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "avx2_bf16.h"
#include "bf16_vec.h"
#include "cpu_isa.h"

namespace cbserve_fused {

namespace {

constexpr int64_t kRowBlock = 8;
constexpr int64_t kPanel = 64;

// ---- portable code: the reference order every path keeps ------------------
// v [m, R] = x rows (fp32, [m, K]) · at [K, R]: each (row, r) summed over k in order.
void shrink_generic(const float* xf, int64_t m, int64_t K, const float* at, int64_t R, float* v) {
  std::fill(v, v + m * R, 0.f);
  for (int64_t k = 0; k < K; ++k)
    for (int64_t i = 0; i < m; ++i)
      for (int64_t j = 0; j < R; ++j) v[i * R + j] += xf[i * K + k] * at[k * R + j];
}

// One row's delta over columns [n0, n0 + w), summed over r in order, added to out.
template <typename T>
void expand_generic(const float* v, int64_t R, const float* bt, int64_t N, int64_t n0, int64_t w, float scale, T* o) {
  for (int64_t j = 0; j < w; ++j) {
    float acc = 0.f;
    for (int64_t r = 0; r < R; ++r) acc += v[r] * bt[r * N + n0 + j];
    o[j] = static_cast<T>(static_cast<float>(o[j]) + acc * scale);
  }
}

#if CB_FUSED_X86
// ---- AVX-512: 16 ranks of up to 8 rows in registers; 64-column panels -----
template <int M>
CB_AVX512BF16 void shrink512(const float* xf, int64_t K, const float* at, int64_t R, float* v) {
  for (int64_t r0 = 0; r0 < R; r0 += 16) {
    __m512 acc[M];
    for (int i = 0; i < M; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      const __m512 a = _mm512_loadu_ps(at + k * R + r0);
      for (int i = 0; i < M; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(xf[i * K + k]), a, acc[i]);
    }
    for (int i = 0; i < M; ++i) _mm512_storeu_ps(v + i * R + r0, acc[i]);
  }
}

CB_AVX512BF16 void shrink_avx512(const float* xf, int64_t m, int64_t K, const float* at, int64_t R, float* v) {
  switch (m) {
    case 1: return shrink512<1>(xf, K, at, R, v);
    case 2: return shrink512<2>(xf, K, at, R, v);
    case 3: return shrink512<3>(xf, K, at, R, v);
    case 4: return shrink512<4>(xf, K, at, R, v);
    case 5: return shrink512<5>(xf, K, at, R, v);
    case 6: return shrink512<6>(xf, K, at, R, v);
    case 7: return shrink512<7>(xf, K, at, R, v);
    default: return shrink512<8>(xf, K, at, R, v);
  }
}

template <typename T>
CB_AVX512BF16 void expand_avx512(const float* v, int64_t R, const float* bt, int64_t N, int64_t n0, int64_t w,
                                 float scale, T* o) {
  const int nv = static_cast<int>((w + 15) / 16);
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  __mmask16 m[4];
  for (int q = 0; q < 4; ++q) m[q] = lanes(w - 16 * q);
  for (int64_t r = 0; r < R; ++r) {
    const __m512 vr = _mm512_set1_ps(v[r]);
    const float* b = bt + r * N + n0;
    for (int q = 0; q < nv; ++q) acc[q] = _mm512_fmadd_ps(vr, _mm512_maskz_loadu_ps(m[q], b + 16 * q), acc[q]);
  }
  const __m512 sc = _mm512_set1_ps(scale);
  for (int q = 0; q < nv; ++q) {
    if constexpr (std::is_same_v<T, float>) {
      const __m512 cur = _mm512_maskz_loadu_ps(m[q], o + 16 * q);
      _mm512_mask_storeu_ps(o + 16 * q, m[q], _mm512_add_ps(cur, _mm512_mul_ps(acc[q], sc)));
    } else {
      const __m512 cur = load_bf16_masked(o + 16 * q, m[q]);
      store_bf16(o + 16 * q, _mm512_add_ps(cur, _mm512_mul_ps(acc[q], sc)), m[q]);
    }
  }
}

CB_AVX512BF16 void widen_avx512(const c10::BFloat16* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load_bf16(src + i));
  if (i < n) _mm512_mask_storeu_ps(dst + i, lanes(n - i), load_bf16_masked(src + i, lanes(n - i)));
}

// ---- AVX2 + FMA: 16 ranks of up to 4 rows in registers; 64-column panels ----
template <int M>
CB_AVX2 void shrink256(const float* xf, int64_t K, const float* at, int64_t R, float* v) {
  for (int64_t r0 = 0; r0 < R; r0 += 16) {
    __m256 lo[M], hi[M];
    for (int i = 0; i < M; ++i) lo[i] = hi[i] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
      const __m256 a0 = _mm256_loadu_ps(at + k * R + r0), a1 = _mm256_loadu_ps(at + k * R + r0 + 8);
      for (int i = 0; i < M; ++i) {
        const __m256 xv = _mm256_set1_ps(xf[i * K + k]);
        lo[i] = _mm256_fmadd_ps(xv, a0, lo[i]);
        hi[i] = _mm256_fmadd_ps(xv, a1, hi[i]);
      }
    }
    for (int i = 0; i < M; ++i) {
      _mm256_storeu_ps(v + i * R + r0, lo[i]);
      _mm256_storeu_ps(v + i * R + r0 + 8, hi[i]);
    }
  }
}

CB_AVX2 void shrink_avx2(const float* xf, int64_t m, int64_t K, const float* at, int64_t R, float* v) {
  for (int64_t i0 = 0; i0 < m; i0 += 4) {
    const float* x = xf + i0 * K;
    float* vo = v + i0 * R;
    switch (std::min<int64_t>(4, m - i0)) {
      case 1: shrink256<1>(x, K, at, R, vo); break;
      case 2: shrink256<2>(x, K, at, R, vo); break;
      case 3: shrink256<3>(x, K, at, R, vo); break;
      default: shrink256<4>(x, K, at, R, vo); break;
    }
  }
}

template <typename T>
CB_AVX2 void expand_avx2(const float* v, int64_t R, const float* bt, int64_t N, int64_t n0, int64_t w, float scale,
                         T* o) {
  const int nv = static_cast<int>(w / 8);  // whole 8-lane vectors; the rest below in the portable order
  __m256 acc[8];
  for (int q = 0; q < 8; ++q) acc[q] = _mm256_setzero_ps();
  for (int64_t r = 0; r < R; ++r) {
    const __m256 vr = _mm256_set1_ps(v[r]);
    const float* b = bt + r * N + n0;
    for (int q = 0; q < nv; ++q) acc[q] = _mm256_fmadd_ps(vr, _mm256_loadu_ps(b + 8 * q), acc[q]);
  }
  const __m256 sc = _mm256_set1_ps(scale);
  for (int q = 0; q < nv; ++q) {
    if constexpr (std::is_same_v<T, float>) {
      _mm256_storeu_ps(o + 8 * q, _mm256_add_ps(_mm256_loadu_ps(o + 8 * q), _mm256_mul_ps(acc[q], sc)));
    } else {
      uint16_t* p = reinterpret_cast<uint16_t*>(o) + 8 * q;
      store_bf16x8(p, _mm256_add_ps(load_bf16x8(p), _mm256_mul_ps(acc[q], sc)));
    }
  }
  if (nv * 8 < w) expand_generic(v, R, bt, N, n0 + nv * 8, w - nv * 8, scale, o + nv * 8);
}
#endif

enum class Isa { kGeneric, kAvx2, kAvx512 };

Isa lora_isa() {
#if CB_FUSED_X86
  if (has_avx512_bf16()) return Isa::kAvx512;
  static const bool avx2 = isa_cap() >= 0 && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) return Isa::kAvx2;
#endif
  return Isa::kGeneric;
}

// The deltas of m rows of one slot (their indices `rows`), added into out.
template <typename T>
void block_delta(Isa isa, const T* x, T* out, int64_t ostride, int64_t col0, const int64_t* rows, int64_t m, int64_t K,
                 int64_t N, const float* at, const float* bt, int64_t R, float scale, float* xf, float* v) {
  for (int64_t i = 0; i < m; ++i) {
    const T* xr = x + rows[i] * K;
    if constexpr (std::is_same_v<T, float>) {
      std::memcpy(xf + i * K, xr, K * sizeof(float));
    } else {
#if CB_FUSED_X86
      if (isa == Isa::kAvx512) {
        widen_avx512(xr, xf + i * K, K);
        continue;
      }
#endif
      for (int64_t k = 0; k < K; ++k) xf[i * K + k] = static_cast<float>(xr[k]);
    }
  }
#if CB_FUSED_X86
  if (isa == Isa::kAvx512) {
    shrink_avx512(xf, m, K, at, R, v);
  } else if (isa == Isa::kAvx2) {
    shrink_avx2(xf, m, K, at, R, v);
  } else {
    shrink_generic(xf, m, K, at, R, v);
  }
#else
  shrink_generic(xf, m, K, at, R, v);
#endif
  for (int64_t n0 = 0; n0 < N; n0 += kPanel) {
    const int64_t w = std::min(kPanel, N - n0);
    for (int64_t i = 0; i < m; ++i) {
      T* o = out + rows[i] * ostride + col0 + n0;
#if CB_FUSED_X86
      if (isa == Isa::kAvx512) {
        expand_avx512(v + i * R, R, bt, N, n0, w, scale, o);
        continue;
      }
      if (isa == Isa::kAvx2) {
        expand_avx2(v + i * R, R, bt, N, n0, w, scale, o);
        continue;
      }
#endif
      expand_generic(v + i * R, R, bt, N, n0, w, scale, o);
    }
  }
}

}  // namespace

void lora_add(const at::Tensor& x, at::Tensor& out, int64_t col0, const at::Tensor& slots, const at::Tensor& at,
              const at::Tensor& bt, const at::Tensor& ranks, const at::Tensor& scales) {
  TORCH_CHECK(x.device().is_cpu() && out.device().is_cpu(), "lora_add: CPU tensors");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0), "lora_add: x [T, K], out [T, >= N]");
  TORCH_CHECK(
      x.scalar_type() == out.scalar_type() && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
      "lora_add: x and out both float32 or both bfloat16");
  TORCH_CHECK(x.is_contiguous() && out.stride(1) == 1, "lora_add: x contiguous, out's columns contiguous");
  TORCH_CHECK(at.dim() == 3 && bt.dim() == 3 && at.size(0) == bt.size(0) && at.size(2) == bt.size(1),
              "lora_add: At [S, K, R] and Bt [S, R, N]");
  TORCH_CHECK(at.scalar_type() == at::kFloat && bt.scalar_type() == at::kFloat && scales.scalar_type() == at::kFloat,
              "lora_add: At, Bt and scales float32");
  TORCH_CHECK(at.is_contiguous() && bt.is_contiguous(), "lora_add: At and Bt contiguous");
  const int64_t T = x.size(0), K = x.size(1), S = at.size(0), R = at.size(2), N = bt.size(2);
  TORCH_CHECK(at.size(1) == K, "lora_add: At's K is not x's");
  TORCH_CHECK(R % 16 == 0 && R <= 1024, "lora_add: R must be a multiple of 16, at most 1024");
  TORCH_CHECK(col0 >= 0 && col0 + N <= out.size(1), "lora_add: columns [col0, col0 + N) outside out");
  TORCH_CHECK(slots.scalar_type() == at::kInt && slots.dim() == 1 && slots.size(0) == T && slots.is_contiguous(),
              "lora_add: slots int32 [T]");
  TORCH_CHECK(ranks.scalar_type() == at::kInt && ranks.numel() == S && scales.numel() == S && ranks.is_contiguous() &&
                  scales.is_contiguous(),
              "lora_add: ranks int32 [S], scales float32 [S]");
  const int32_t* sl = slots.data_ptr<int32_t>();
  const int32_t* rk = ranks.data_ptr<int32_t>();
  const float* sc = scales.data_ptr<float>();
  // Rows by slot, then blocks of up to kRowBlock rows of one slot.
  std::vector<std::vector<int64_t>> by_slot(S);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t s = sl[t];
    TORCH_CHECK(s >= 0 && s <= S, "lora_add: slot ", s, " outside [0, ", S, "]");
    if (s > 0 && rk[s - 1] > 0) by_slot[s - 1].push_back(t);
  }
  std::vector<int64_t> rows;
  std::vector<std::pair<int64_t, int64_t>> blocks;  // (first index into rows, slot)
  for (int64_t s = 0; s < S; ++s) {
    for (size_t i = 0; i < by_slot[s].size(); i += kRowBlock) blocks.emplace_back(rows.size() + i, s);
    rows.insert(rows.end(), by_slot[s].begin(), by_slot[s].end());
  }
  if (blocks.empty()) return;
  const float* ap = at.data_ptr<float>();
  const float* bp = bt.data_ptr<float>();
  const int64_t ostride = out.stride(0);
  const bool f32 = x.scalar_type() == at::kFloat;
  const int64_t nrows = static_cast<int64_t>(rows.size());
  const Isa isa = lora_isa();
  at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> xf(kRowBlock * K), v(kRowBlock * R);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t first = blocks[b].first, s = blocks[b].second;
      const int64_t next = b + 1 < static_cast<int64_t>(blocks.size()) ? blocks[b + 1].first : nrows;
      const int64_t m = std::min(kRowBlock, next - first);
      const float* as = ap + s * K * R;
      const float* bs = bp + s * R * N;
      if (f32) {
        block_delta(isa, x.data_ptr<float>(), out.data_ptr<float>(), ostride, col0, rows.data() + first, m, K, N, as,
                    bs, R, sc[s], xf.data(), v.data());
      } else {
        block_delta(isa, x.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>(), ostride, col0, rows.data() + first,
                    m, K, N, as, bs, R, sc[s], xf.data(), v.data());
      }
    }
  });
}

}  // namespace cbserve_fused
