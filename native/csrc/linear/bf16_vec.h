// AVX-512 bf16 vector helpers shared by the fused element-wise ops
// (fused_ops.cpp) and the epilogues of the linear kernels (amx_linear.cpp,
// avx512_linear.cpp: bias, output rounding, act(gate) * up): bf16 loads and
// stores through fp32 lanes, round-to-nearest-even to bf16, exp, and the
// gated activations with the Hugging Face MLP's rounding points.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>

#include "cpu_isa.h"

namespace cbserve_fused {

// The activation of a gated MLP, act(gate) * up: SiLU (Llama, Qwen, Mistral,
// Phi-3, OLMo 2, Granite) or GELU with the tanh approximation (Gemma's
// gelu_pytorch_tanh).
enum class Act : int { kSilu = 0, kGeluTanh = 1 };

inline Act parse_act(const std::string& name) {
  if (name == "silu") return Act::kSilu;
  if (name == "gelu_tanh") return Act::kGeluTanh;
  TORCH_CHECK(false, "activation must be 'silu' or 'gelu_tanh', not '", name, "'");
  return Act::kSilu;
}

}  // namespace cbserve_fused

#if CB_FUSED_X86
namespace cbserve_fused {

CB_AVX512 inline __mmask16 lanes(int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1); }

CB_AVX512 inline __m512 load_bf16(const c10::BFloat16* p) {
  __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

CB_AVX512BF16 inline __m512 load_bf16_masked(const c10::BFloat16* p, __mmask16 m) {
  __m256i v = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}

CB_AVX512BF16 inline __m512 round_bf16(__m512 v) {  // fp32 -> bf16 (RNE) -> fp32
  __m256i b = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

CB_AVX512BF16 inline void store_bf16(c10::BFloat16* p, __m512 v, __mmask16 m) {
  __m256i b = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
  _mm256_mask_storeu_epi16(p, m, b);
}

// A linear layer's bf16 bias (raw bits, may be null) for output features
// [n0, n0 + 16) in fp32 lanes: zero without a bias and past the `m` lanes.
CB_AVX512BF16 inline __m512 bias_lanes(const uint16_t* bias, int64_t n0, __mmask16 m) {
  return bias != nullptr ? load_bf16_masked(reinterpret_cast<const c10::BFloat16*>(bias + n0), m) : _mm512_setzero_ps();
}

CB_AVX512BF16 inline __m512 exp_ps(__m512 x) {
  // exp(x) = 2^(x*log2e): integer part via scalef, fraction by a degree-6 polynomial.
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-88.f));
  __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
  __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// silu(g) * u for bf16 values g, u held in fp32 lanes, as act_fn(gate) * up
// computes it in bf16: the SiLU is rounded to bf16 before the product (the
// caller rounds the product when it stores it).
CB_AVX512BF16 inline __m512 silu_mul(__m512 g, __m512 u) {
  const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g))));
  return _mm512_mul_ps(round_bf16(s), u);
}

// gelu_tanh(g) * u with the same rounding points. GELU's tanh form,
// 0.5 g (1 + tanh(a)) with a = sqrt(2 / pi) (g + 0.044715 g^3), is the same
// value as g / (1 + exp(-2a)), which has no cancellation near g = 0.
CB_AVX512BF16 inline __m512 gelu_tanh_mul(__m512 g, __m512 u) {
  const __m512 inner = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_mul_ps(g, g), g), _mm512_set1_ps(0.044715f), g);
  const __m512 e = exp_ps(_mm512_mul_ps(inner, _mm512_set1_ps(-2.f * 0.7978845608028654f)));
  const __m512 s = _mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e));
  return _mm512_mul_ps(round_bf16(s), u);
}

CB_AVX512BF16 inline __m512 act_mul(Act act, __m512 g, __m512 u) {
  return act == Act::kGeluTanh ? gelu_tanh_mul(g, u) : silu_mul(g, u);
}

}  // namespace cbserve_fused
#endif
