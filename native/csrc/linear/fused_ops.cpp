// Fused element-wise ops of the Llama block for the CPU executor:
// RMSNorm and SiLU-and-mul. Each replaces several ATen calls (and their
// fp32 temporaries) by one pass over the row, with the same rounding points
// as the Hugging Face modules they stand in for.
//
// AVX-512 (+bf16) code is compiled with function-level target attributes and
// chosen at run time; a portable loop serves every other CPU and dtype.

#include <torch/csrc/utils/pybind.h>  // pybind11 and the at::Tensor caster, not all of torch/extension.h
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>

#include "../avx2_exp.h"
#include "bf16_vec.h"
#include "cpu_isa.h"
#include "amx_linear.h"
#include "amx_q4_rows.h"
#include "avx2_bf16.h"
#include "avx2_f32_linear.h"
#include "avx512_linear.h"
#include "gguf_linear.h"
#include "int8_blocks.h"
#include "lora_linear.h"

namespace {

using cbserve_fused::has_avx512_bf16;

void check_row_major(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.dim() >= 1, name, " must have at least one dimension");
}

// x [..., H] and weight [H], both contiguous CPU tensors of one dtype.
void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  check_row_major(x, "x");
  check_row_major(weight, "weight");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "weight must be [H] with H = x.size(-1)");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x must share a dtype");
}

// ---- portable reference loops (any float dtype) -----------------------------
// 1 / sqrt(mean(x^2) + eps) of one row, summed in fp32.
template <typename T>
inline float inv_rms(const T* x, int64_t h, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < h; ++i) ss += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  return 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
}

template <typename T>
void rms_norm_rows(T* out, const T* x, const T* w, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * h;
      T* orow = out + r * h;
      const float inv = inv_rms(xr, h, eps);
      for (int64_t i = 0; i < h; ++i) {
        T y = static_cast<T>(static_cast<float>(xr[i]) * inv);  // hidden.to(input_dtype)
        orow[i] = static_cast<T>(static_cast<float>(w[i]) * static_cast<float>(y));
      }
    }
  });
}

// out = (w * (x * rsqrt(mean(x^2) + eps))).to(T) with w in fp32: the rounding
// of RMSNorms that scale before casting (OLMo 2's; Gemma's with w = 1 + weight).
// With round_first, out = (w * (x * rsqrt(...)).to(T)).to(T): Qwen3's q/k
// norms (Llama's rounding), exact with w holding T's values. w is one [H]
// row, or one per head (row r of an [A, B, H] view takes w's row r % B).
// Out may be x (each row is read whole first).
// Where row r of a [A, B, H] view lies (a 2-D [R, H] one is B = 1): rows
// may be slices of a wider tensor (a fused projection's q or k heads).
struct RowMap {
  int64_t B, s0, s1;
  int64_t at(int64_t r) const { return (r / B) * s0 + (r % B) * s1; }
};

template <typename T>
void rms_norm_w32_rows(T* out, RowMap om, const T* x, RowMap xm, const float* w, int64_t w_step, bool round_first,
                       int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + xm.at(r);
      T* orow = out + om.at(r);
      const float* wr = w + (r % xm.B) * w_step;
      const float inv = inv_rms(xr, h, eps);
      for (int64_t i = 0; i < h; ++i) {
        const float y = static_cast<float>(xr[i]) * inv;
        orow[i] = static_cast<T>(wr[i] * (round_first ? static_cast<float>(static_cast<T>(y)) : y));
      }
    }
  });
}

// One row's residual += (w * norm(x)).to(T), rounded as `residual + hidden`
// in T: a norm after a block and its residual add.
template <typename T>
inline void norm_add_row(T* rr, const T* xr, const float* w, int64_t h, float eps) {
  const float inv = inv_rms(xr, h, eps);
  for (int64_t i = 0; i < h; ++i) {
    const T y = static_cast<T>(w[i] * (static_cast<float>(xr[i]) * inv));
    rr[i] = static_cast<T>(static_cast<float>(rr[i]) + static_cast<float>(y));
  }
}

// norm_add_row, then out = (w2 * norm(residual)).to(T): Gemma's norm after
// attention (or after the MLP), the residual add, and the norm before the
// next block.
template <typename T>
void norm_add_norm_w32_rows(T* out, const T* x, T* res, const float* w1, float eps1, const float* w2, float eps2,
                            int64_t rows, int64_t h) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* rr = res + r * h;
      norm_add_row(rr, x + r * h, w1, h, eps1);
      const float inv2 = inv_rms(rr, h, eps2);
      for (int64_t i = 0; i < h; ++i) out[r * h + i] = static_cast<T>(w2[i] * (static_cast<float>(rr[i]) * inv2));
    }
  });
}

// norm_add_row over [rows, h]: OLMo 2's norm after attention (or after the
// MLP) and its residual add.
template <typename T>
void norm_add_w32_rows(const T* x, T* res, const float* w, float eps, int64_t rows, int64_t h) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_add_row(res + r * h, x + r * h, w, h, eps);
  });
}

// act(g) in fp32: SiLU, or GELU-tanh as g / (1 + exp(-2a)) (bf16_vec.h's gelu_tanh_mul).
inline float act_scalar(cbserve_fused::Act act, float g) {
  if (act == cbserve_fused::Act::kGeluTanh)
    return g / (1.f + std::exp(-2.f * 0.7978845608028654f * (g + 0.044715f * g * g * g)));
  return g / (1.f + std::exp(-g));
}

// One row's act(gate) * up from feature i0 on, in the model dtype T:
// act_fn(gate) rounded to T, then the product rounded to T.
template <typename T>
inline void act_mul_row(T* o, const T* g, const T* u, int64_t i0, int64_t inter, cbserve_fused::Act act) {
  for (int64_t i = i0; i < inter; ++i) {
    T s = static_cast<T>(act_scalar(act, static_cast<float>(g[i])));
    o[i] = static_cast<T>(static_cast<float>(s) * static_cast<float>(u[i]));
  }
}

template <typename T>
void act_mul_rows(T* out, const T* gu, int64_t rows, int64_t inter, cbserve_fused::Act act) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = gu + r * 2 * inter;
      act_mul_row(out + r * inter, g, g + inter, 0, inter, act);
    }
  });
}

// residual += x (rounded to T, as `residual + hidden_states` in the model
// dtype), then out = RMSNorm(residual).
template <typename T>
void add_rms_norm_rows(T* out, const T* x, T* res, const T* w, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      T* rr = res + r * h;
      const T* xr = x + r * h;
      for (int64_t i = 0; i < h; ++i) rr[i] = static_cast<T>(static_cast<float>(rr[i]) + static_cast<float>(xr[i]));
    }
  });
  rms_norm_rows<T>(out, res, w, rows, h, eps);
}

// Rotary embedding (rotate-half form) on the q and k heads of a fused
// [T, (Hq + 2 Hkv) * D] projection, split into contiguous q / k / v:
//   y[:D/2] = x1*cos[:D/2] - x2*sin[:D/2],  y[D/2:] = x2*cos[D/2:] + x1*sin[D/2:]
// each product and the sum rounded to T, as `q * cos + rotate_half(q) * sin`.
template <typename T>
inline void rope_row(T* y, const T* x, const T* c, const T* s, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[half + i]);
    const T a = static_cast<T>(x1 * static_cast<float>(c[i]));
    const T b = static_cast<T>(-x2 * static_cast<float>(s[i]));
    y[i] = static_cast<T>(static_cast<float>(a) + static_cast<float>(b));
    const T e = static_cast<T>(x2 * static_cast<float>(c[half + i]));
    const T f = static_cast<T>(x1 * static_cast<float>(s[half + i]));
    y[half + i] = static_cast<T>(static_cast<float>(e) + static_cast<float>(f));
  }
}

// The same with an fp32 table in fp32 arithmetic, rounded to T once at the
// end: models whose rotary runs in fp32 (OLMo 2's cos / sin stay fp32, so
// `q * cos + rotate_half(q) * sin` is computed there and cast back).
template <typename T>
inline void rope_row_f32(T* y, const T* x, const float* c, const float* s, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[half + i]);
    const float a = x1 * c[i], b = -x2 * s[i];
    y[i] = static_cast<T>(a + b);
    const float e = x2 * c[half + i], f = x1 * s[half + i];
    y[half + i] = static_cast<T>(e + f);
  }
}

// Token t's k and v heads go to row `slots[t]` of k / v ([rows, Hkv, D]; a
// negative slot skips them), or to row t when `slots` is null. C: the
// table's type (T, or float for an fp32 rotary). The rotary turns the first
// R <= D dims of each head (a partial rotary, Phi-4-mini's); the rest pass.
template <typename T, typename C = T>
void rope_split_rows(const T* qkv, const C* cos, const C* sin, T* q, T* k, T* v, const int64_t* slots, int64_t rows,
                     int64_t hq, int64_t hkv, int64_t D, int64_t R) {
  const int64_t width = (hq + 2 * hkv) * D;
  at::parallel_for(0, rows, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t t = r0; t < r1; ++t) {
      const T* src = qkv + t * width;
      const C* c = cos + t * R;
      const C* s = sin + t * R;
      auto rotate = [&](T* y, const T* x) {
        if constexpr (std::is_same<C, float>::value) {
          rope_row_f32<T>(y, x, c, s, R);  // for T = float both forms are the same
        } else {
          rope_row<T>(y, x, c, s, R);
        }
        for (int64_t i = R; i < D; ++i) y[i] = x[i];
      };
      for (int64_t h = 0; h < hq; ++h) rotate(q + (t * hq + h) * D, src + h * D);
      const int64_t dst = slots != nullptr ? slots[t] : t;
      if (dst < 0) continue;
      for (int64_t h = 0; h < hkv; ++h) rotate(k + (dst * hkv + h) * D, src + (hq + h) * D);
      const T* vs = src + (hq + hkv) * D;
      T* vd = v + dst * hkv * D;
      for (int64_t i = 0; i < hkv * D; ++i) vd[i] = vs[i];
    }
  });
}

// First index of each row's maximum; NaN counts as the maximum (as torch.max).
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  int64_t best = 0;
  float bv = static_cast<float>(x[0]);
  if (std::isnan(bv)) return 0;
  for (int64_t i = 1; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v)) return i;
    if (v > bv) bv = v, best = i;
  }
  return best;
}

#if CB_FUSED_X86
// ---- AVX-512 bf16 ------------------------------------------------------------

using cbserve_fused::act_mul;
using cbserve_fused::lanes;
using cbserve_fused::load_bf16;
using cbserve_fused::load_bf16_masked;
using cbserve_fused::round_bf16;
using cbserve_fused::store_bf16;

CB_AVX512BF16 void rms_norm_bf16_rows(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* w, int64_t r0,
                                      int64_t r1, int64_t h, float eps) {
  for (int64_t r = r0; r < r1; ++r) {
    const c10::BFloat16* xr = x + r * h;
    c10::BFloat16* orow = out + r * h;
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 16 <= h; i += 16) {
      __m512 v = load_bf16(xr + i);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    if (i < h) {
      const __mmask16 m = lanes(h - i);
      __m512 v = load_bf16_masked(xr + i, m);
      acc = _mm512_fmadd_ps(v, v, acc);
    }
    const float inv = 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(h) + eps);
    const __m512 vinv = _mm512_set1_ps(inv);
    for (i = 0; i < h; i += 16) {
      const __mmask16 m = lanes(h - i);
      __m512 y = round_bf16(_mm512_mul_ps(load_bf16_masked(xr + i, m), vinv));
      store_bf16(orow + i, _mm512_mul_ps(load_bf16_masked(w + i, m), y), m);
    }
  }
}

void rms_norm_bf16_avx512(c10::BFloat16* out, const c10::BFloat16* x, const c10::BFloat16* w, int64_t rows, int64_t h,
                          float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) { rms_norm_bf16_rows(out, x, w, r0, r1, h, eps); });
}

// 1 / sqrt(mean(x^2) + eps) of one bf16 row, summed in 16 fp32 lanes (as
// rms_norm_bf16_rows sums).
CB_AVX512BF16 float inv_rms_bf16(const c10::BFloat16* xr, int64_t h, float eps) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= h; i += 16) {
    const __m512 v = load_bf16(xr + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  if (i < h) {
    const __m512 v = load_bf16_masked(xr + i, lanes(h - i));
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  return 1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(h) + eps);
}

// orow = (w * (xr * inv)).to(bf16), w fp32 (with round_first, xr * inv is
// rounded to bf16 before the product); orow may be xr.
CB_AVX512BF16 void scale_w32_bf16_row(c10::BFloat16* orow, const c10::BFloat16* xr, const float* w, int64_t h,
                                      float inv, bool round_first = false) {
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < h; i += 16) {
    const __mmask16 m = lanes(h - i);
    __m512 y = _mm512_mul_ps(load_bf16_masked(xr + i, m), vinv);
    if (round_first) y = round_bf16(y);
    store_bf16(orow + i, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + i), y), m);
  }
}

void rms_norm_w32_bf16_avx512(c10::BFloat16* out, RowMap om, const c10::BFloat16* x, RowMap xm, const float* w,
                              int64_t w_step, bool round_first, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const c10::BFloat16* xr = x + xm.at(r);
      scale_w32_bf16_row(out + om.at(r), xr, w + (r % xm.B) * w_step, h, inv_rms_bf16(xr, h, eps), round_first);
    }
  });
}

CB_AVX512BF16 void norm_add_bf16_row(c10::BFloat16* rr, const c10::BFloat16* xr, const float* w, int64_t h, float inv) {
  const __m512 vinv = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < h; i += 16) {
    const __mmask16 m = lanes(h - i);
    const __m512 y =
        round_bf16(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, w + i), _mm512_mul_ps(load_bf16_masked(xr + i, m), vinv)));
    store_bf16(rr + i, _mm512_add_ps(load_bf16_masked(rr + i, m), y), m);
  }
}

void norm_add_norm_w32_bf16_avx512(c10::BFloat16* out, const c10::BFloat16* x, c10::BFloat16* res, const float* w1,
                                   float eps1, const float* w2, float eps2, int64_t rows, int64_t h) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const c10::BFloat16* xr = x + r * h;
      c10::BFloat16* rr = res + r * h;
      norm_add_bf16_row(rr, xr, w1, h, inv_rms_bf16(xr, h, eps1));
      scale_w32_bf16_row(out + r * h, rr, w2, h, inv_rms_bf16(rr, h, eps2));
    }
  });
}

void norm_add_w32_bf16_avx512(const c10::BFloat16* x, c10::BFloat16* res, const float* w, float eps, int64_t rows,
                              int64_t h) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) norm_add_bf16_row(res + r * h, x + r * h, w, h, inv_rms_bf16(x + r * h, h, eps));
  });
}

CB_AVX512BF16 void act_mul_bf16_rows(c10::BFloat16* out, const c10::BFloat16* gu, int64_t r0, int64_t r1, int64_t inter,
                                     cbserve_fused::Act act) {
  for (int64_t r = r0; r < r1; ++r) {
    const c10::BFloat16* g = gu + r * 2 * inter;
    const c10::BFloat16* u = g + inter;
    c10::BFloat16* o = out + r * inter;
    for (int64_t i = 0; i < inter; i += 16) {
      const __mmask16 m = lanes(inter - i);
      store_bf16(o + i, act_mul(act, load_bf16_masked(g + i, m), load_bf16_masked(u + i, m)), m);
    }
  }
}

void act_mul_bf16_avx512(c10::BFloat16* out, const c10::BFloat16* gu, int64_t rows, int64_t inter,
                         cbserve_fused::Act act) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) { act_mul_bf16_rows(out, gu, r0, r1, inter, act); });
}

// ---- fp32 on AVX2 + FMA (CPUs without native bf16, where fp32 is served) ----

// act(g) * u on 8 lanes, act as act_scalar computes it: g / (1 + exp(-g)),
// or g / (1 + exp(-2a)) for GELU-tanh.
CB_AVX2 inline __m256 act_mul_f32x8(cbserve_fused::Act act, __m256 g, __m256 u) {
  __m256 z = _mm256_sub_ps(_mm256_setzero_ps(), g);
  if (act == cbserve_fused::Act::kGeluTanh) {
    const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_mul_ps(g, g), g), _mm256_set1_ps(0.044715f), g);
    z = _mm256_mul_ps(inner, _mm256_set1_ps(-2.f * 0.7978845608028654f));
  }
  const __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), cb_exp_avx2(z)));
  return _mm256_mul_ps(s, u);
}

CB_AVX2 void act_mul_f32_rows(float* out, const float* gu, int64_t r0, int64_t r1, int64_t inter,
                              cbserve_fused::Act act) {
  for (int64_t r = r0; r < r1; ++r) {
    const float* g = gu + r * 2 * inter;
    const float* u = g + inter;
    float* o = out + r * inter;
    int64_t i = 0;
    for (; i + 8 <= inter; i += 8)
      _mm256_storeu_ps(o + i, act_mul_f32x8(act, _mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    for (; i < inter; ++i) o[i] = act_scalar(act, g[i]) * u[i];
  }
}

void act_mul_f32_avx2(float* out, const float* gu, int64_t rows, int64_t inter, cbserve_fused::Act act) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) { act_mul_f32_rows(out, gu, r0, r1, inter, act); });
}

// bf16 where the CPU has no native bf16 (`--dtype bfloat16` on AVX2): the
// activation rounded to bf16 before the product, as act_mul_rows rounds it.
CB_AVX2 void act_mul_bf16_avx2_rows(c10::BFloat16* out, const c10::BFloat16* gu, int64_t r0, int64_t r1, int64_t inter,
                                    cbserve_fused::Act act) {
  const auto bits = [](const c10::BFloat16* p) { return reinterpret_cast<const uint16_t*>(p); };
  const __m256 one = _mm256_set1_ps(1.f);
  for (int64_t r = r0; r < r1; ++r) {
    const c10::BFloat16* g = gu + r * 2 * inter;
    const c10::BFloat16* u = g + inter;
    c10::BFloat16* o = out + r * inter;
    int64_t i = 0;
    for (; i + 8 <= inter; i += 8) {
      const __m256 s = cbserve_fused::round_bf16x8(act_mul_f32x8(act, cbserve_fused::load_bf16x8(bits(g + i)), one));
      cbserve_fused::store_bf16x8(reinterpret_cast<uint16_t*>(o + i),
                                  _mm256_mul_ps(s, cbserve_fused::load_bf16x8(bits(u + i))));
    }
    act_mul_row(o, g, u, i, inter, act);
  }
}

void act_mul_bf16_avx2(c10::BFloat16* out, const c10::BFloat16* gu, int64_t rows, int64_t inter,
                       cbserve_fused::Act act) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) { act_mul_bf16_avx2_rows(out, gu, r0, r1, inter, act); });
}

CB_AVX512BF16 void add_rows_bf16(c10::BFloat16* res, const c10::BFloat16* x, int64_t r0, int64_t r1, int64_t h) {
  for (int64_t r = r0; r < r1; ++r) {
    c10::BFloat16* rr = res + r * h;
    const c10::BFloat16* xr = x + r * h;
    for (int64_t i = 0; i < h; i += 16) {
      const __mmask16 m = lanes(h - i);
      store_bf16(rr + i, _mm512_add_ps(load_bf16_masked(rr + i, m), load_bf16_masked(xr + i, m)), m);
    }
  }
}

void add_rms_norm_bf16_avx512(c10::BFloat16* out, const c10::BFloat16* x, c10::BFloat16* res, const c10::BFloat16* w,
                              int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    add_rows_bf16(res, x, r0, r1, h);
    rms_norm_bf16_rows(out, res, w, r0, r1, h, eps);
  });
}

CB_AVX512BF16 void rope_row_bf16(c10::BFloat16* y, const c10::BFloat16* x, const c10::BFloat16* c,
                                 const c10::BFloat16* s, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = lanes(half - i);
    const __m512 x1 = load_bf16_masked(x + i, m), x2 = load_bf16_masked(x + half + i, m);
    const __m512 a = round_bf16(_mm512_mul_ps(x1, load_bf16_masked(c + i, m)));
    const __m512 b = round_bf16(_mm512_mul_ps(x2, load_bf16_masked(s + i, m)));
    store_bf16(y + i, _mm512_sub_ps(a, b), m);
    const __m512 e = round_bf16(_mm512_mul_ps(x2, load_bf16_masked(c + half + i, m)));
    const __m512 f = round_bf16(_mm512_mul_ps(x1, load_bf16_masked(s + half + i, m)));
    store_bf16(y + half + i, _mm512_add_ps(e, f), m);
  }
}

CB_AVX512BF16 void rope_split_bf16_rows(const c10::BFloat16* qkv, const c10::BFloat16* cos, const c10::BFloat16* sin,
                                        c10::BFloat16* q, c10::BFloat16* k, c10::BFloat16* v, const int64_t* slots,
                                        int64_t r0, int64_t r1, int64_t hq, int64_t hkv, int64_t D, int64_t R) {
  const int64_t width = (hq + 2 * hkv) * D;
  const int64_t row_bytes = hkv * D * static_cast<int64_t>(sizeof(c10::BFloat16));
  for (int64_t t = r0; t < r1; ++t) {
    const c10::BFloat16* src = qkv + t * width;
    const c10::BFloat16* c = cos + t * R;
    const c10::BFloat16* s = sin + t * R;
    auto rotate = [&](c10::BFloat16* y, const c10::BFloat16* x) {
      rope_row_bf16(y, x, c, s, R);
      if (R < D) std::memcpy(y + R, x + R, sizeof(c10::BFloat16) * (D - R));
    };
    // Decode tokens' cache slots lie in scattered blocks the hardware
    // prefetcher cannot guess: ask for the next token's lines for writing.
    if (slots != nullptr && t + 1 < r1 && slots[t + 1] >= 0) {
      const char* kn = reinterpret_cast<const char*>(k + slots[t + 1] * hkv * D);
      const char* vn = reinterpret_cast<const char*>(v + slots[t + 1] * hkv * D);
      for (int64_t o = 0; o < row_bytes; o += 64) {
        __builtin_prefetch(kn + o, 1, 3);
        __builtin_prefetch(vn + o, 1, 3);
      }
    }
    for (int64_t h = 0; h < hq; ++h) rotate(q + (t * hq + h) * D, src + h * D);
    const int64_t dst = slots != nullptr ? slots[t] : t;
    if (dst < 0) continue;
    for (int64_t h = 0; h < hkv; ++h) rotate(k + (dst * hkv + h) * D, src + (hq + h) * D);
    std::memcpy(v + dst * hkv * D, src + (hq + hkv) * D, sizeof(c10::BFloat16) * hkv * D);
  }
}

// Per lane: the first index of the lane's maximum (strictly greater replaces);
// across lanes: the smallest index among lanes holding the row maximum.
CB_AVX512BF16 int64_t argmax_bf16_row(const c10::BFloat16* x, int64_t n) {
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  __m512 best = ninf;
  __m512i bidx = _mm512_setzero_si512();
  __m512i idx = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i step = _mm512_set1_epi32(16);
  __mmask16 nan = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes(n - i);
    const __m512 v = _mm512_mask_blend_ps(m, ninf, load_bf16_masked(x + i, m));
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    bidx = _mm512_mask_mov_epi32(bidx, gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  if (nan) return argmax_row<c10::BFloat16>(x, n);
  const float mv = _mm512_reduce_max_ps(best);
  const __mmask16 eq = _mm512_cmp_ps_mask(best, _mm512_set1_ps(mv), _CMP_EQ_OQ);
  return _mm512_mask_reduce_min_epi32(eq, bidx);
}
#endif  // CB_FUSED_X86

}  // namespace

// out = weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), rows over the last dim.
//   x      [..., H]  fp32 | bf16 | fp16, contiguous
//   weight [H]       same dtype
// returns  [..., H]  new tensor
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  auto out = at::empty_like(x);
  const int64_t h = x.size(-1);
  const int64_t rows = h ? x.numel() / h : 0;
  if (rows == 0) return out;
#if CB_FUSED_X86
  if (x.scalar_type() == at::kBFloat16 && has_avx512_bf16()) {
    rms_norm_bf16_avx512(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(),
                         rows, h, static_cast<float>(eps));
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), rows, h,
                            static_cast<float>(eps));
  });
  return out;
}

// out = (weight * (x * rsqrt(mean(x^2) + eps))).to(dtype), weight in fp32
// (rms_norm_w32_rows), written into `out`.
//   x, out [R, H] or [A, B, H] of one dtype, unit stride along H (rows may be
//          strided: a slice of a fused projection, its heads); out may be x
//   weight [H] fp32 contiguous, or [B, H] (one row per head of an [A, B, H] x)
//   round_first: round the normalised value to x's dtype before the weight
void rms_norm_w32_(const at::Tensor& x, const at::Tensor& weight, double eps, at::Tensor& out, bool round_first) {
  for (const at::Tensor* t : {&x, static_cast<const at::Tensor*>(&out)}) {
    TORCH_CHECK(t->device().is_cpu() && (t->dim() == 2 || t->dim() == 3) && t->stride(-1) == 1,
                "x and out must be [R, H] or [A, B, H] CPU tensors with unit stride along H");
  }
  TORCH_CHECK(x.sizes() == out.sizes() && x.scalar_type() == out.scalar_type(), "x and out differ in shape or dtype");
  const bool per_head = weight.dim() == 2 && x.dim() == 3 && weight.size(0) == x.size(1);
  TORCH_CHECK(weight.device().is_cpu() && weight.is_contiguous() && weight.scalar_type() == at::kFloat &&
                  (weight.dim() == 1 || per_head) && weight.size(-1) == x.size(-1),
              "weight must be fp32 [H], or [B, H] for an [A, B, H] x");
  const int64_t h = x.size(-1), rows = h ? x.numel() / h : 0;
  if (rows == 0 || h == 0) return;
  auto map = [](const at::Tensor& t) {
    return t.dim() == 2 ? RowMap{1, t.stride(0), 0} : RowMap{t.size(1), t.stride(0), t.stride(1)};
  };
  const RowMap xm = map(x), om = map(out);
  const int64_t w_step = per_head ? h : 0;
#if CB_FUSED_X86
  if (x.scalar_type() == at::kBFloat16 && has_avx512_bf16()) {
    rms_norm_w32_bf16_avx512(out.data_ptr<c10::BFloat16>(), om, x.data_ptr<c10::BFloat16>(), xm,
                             weight.data_ptr<float>(), w_step, round_first, rows, h, static_cast<float>(eps));
    return;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_w32_", [&] {
    rms_norm_w32_rows<scalar_t>(out.data_ptr<scalar_t>(), om, x.data_ptr<scalar_t>(), xm, weight.data_ptr<float>(),
                                w_step, round_first, rows, h, static_cast<float>(eps));
  });
}

// x and residual: [T, H] row-major, one shape and dtype; each weight fp32 [H] contiguous.
static void check_norm_add_args(const at::Tensor& x, const at::Tensor& residual,
                                std::initializer_list<const at::Tensor*> weights) {
  check_row_major(x, "x");
  check_row_major(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual differ in shape or dtype");
  for (const auto* w : weights)
    TORCH_CHECK(w->device().is_cpu() && w->is_contiguous() && w->scalar_type() == at::kFloat && w->dim() == 1 &&
                    w->size(0) == x.size(-1),
                "norm weights must be fp32 [H]");
}

// residual += (w1 * norm(x)).to(dtype) in place; returns (w2 * norm(residual)).to(dtype):
// a (1 + w) / fp32-weight norm after a block, its residual add and the next norm in one pass.
//   x, residual [T, H] contiguous, one dtype; w1, w2 [H] fp32 contiguous
at::Tensor norm_add_norm_w32(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w1, double eps1,
                             const at::Tensor& w2, double eps2) {
  check_norm_add_args(x, residual, {&w1, &w2});
  auto out = at::empty_like(x);
  const int64_t h = x.size(-1), rows = h ? x.numel() / h : 0;
  if (rows == 0) return out;
#if CB_FUSED_X86
  if (x.scalar_type() == at::kBFloat16 && has_avx512_bf16()) {
    norm_add_norm_w32_bf16_avx512(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(),
                                  residual.data_ptr<c10::BFloat16>(), w1.data_ptr<float>(), static_cast<float>(eps1),
                                  w2.data_ptr<float>(), static_cast<float>(eps2), rows, h);
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "norm_add_norm_w32", [&] {
    norm_add_norm_w32_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                                     w1.data_ptr<float>(), static_cast<float>(eps1), w2.data_ptr<float>(),
                                     static_cast<float>(eps2), rows, h);
  });
  return out;
}

// residual += (w * norm(x)).to(dtype) in place: an fp32-weight norm after a
// block and its residual add in one pass (OLMo 2's post-norms).
//   x, residual [T, H] contiguous, one dtype; w [H] fp32 contiguous
void norm_add_w32_(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  check_norm_add_args(x, residual, {&w});
  const int64_t h = x.size(-1), rows = h ? x.numel() / h : 0;
  if (rows == 0) return;
#if CB_FUSED_X86
  if (x.scalar_type() == at::kBFloat16 && has_avx512_bf16()) {
    norm_add_w32_bf16_avx512(x.data_ptr<c10::BFloat16>(), residual.data_ptr<c10::BFloat16>(), w.data_ptr<float>(),
                             static_cast<float>(eps), rows, h);
    return;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "norm_add_w32_", [&] {
    norm_add_w32_rows<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(), w.data_ptr<float>(),
                                static_cast<float>(eps), rows, h);
  });
}

// out = act(gate_up[..., :I]) * gate_up[..., I:], act "silu" or "gelu_tanh"
//   gate_up [..., 2I] contiguous (gate then up, as a fused projection gives)
// returns   [..., I]  new tensor
at::Tensor silu_and_mul(const at::Tensor& gate_up, const std::string& activation) {
  const cbserve_fused::Act act = cbserve_fused::parse_act(activation);
  check_row_major(gate_up, "gate_up");
  const int64_t two_i = gate_up.size(-1);
  TORCH_CHECK(two_i % 2 == 0, "gate_up's last dimension must be even (gate then up)");
  const int64_t inter = two_i / 2;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  auto out = at::empty(sizes, gate_up.options());
  const int64_t rows = inter ? gate_up.numel() / two_i : 0;
  if (rows == 0) return out;
#if CB_FUSED_X86
  if (gate_up.scalar_type() == at::kBFloat16 && has_avx512_bf16()) {
    act_mul_bf16_avx512(out.data_ptr<c10::BFloat16>(), gate_up.data_ptr<c10::BFloat16>(), rows, inter, act);
    return out;
  }
  if (gate_up.scalar_type() == at::kFloat && cbserve_fused::avx2_f32_linear_supported()) {
    act_mul_f32_avx2(out.data_ptr<float>(), gate_up.data_ptr<float>(), rows, inter, act);
    return out;
  }
  if (gate_up.scalar_type() == at::kBFloat16 && cbserve_fused::avx2_f32_linear_supported()) {
    act_mul_bf16_avx2(out.data_ptr<c10::BFloat16>(), gate_up.data_ptr<c10::BFloat16>(), rows, inter, act);
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_and_mul", [&] {
    act_mul_rows<scalar_t>(out.data_ptr<scalar_t>(), gate_up.data_ptr<scalar_t>(), rows, inter, act);
  });
  return out;
}

// residual += x (in place, in the model dtype); returns RMSNorm(residual).
//   x, residual [..., H] same shape/dtype, contiguous; weight [H]
at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  check_row_major(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes(), "x and residual must have the same shape");
  TORCH_CHECK(residual.scalar_type() == x.scalar_type(), "residual and x must share a dtype");
  auto out = at::empty_like(x);
  const int64_t h = x.size(-1);
  const int64_t rows = h ? x.numel() / h : 0;
  if (rows == 0) return out;
#if CB_FUSED_X86
  if (x.scalar_type() == at::kBFloat16 && has_avx512_bf16()) {
    add_rms_norm_bf16_avx512(out.data_ptr<c10::BFloat16>(), x.data_ptr<c10::BFloat16>(),
                             residual.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(), rows, h,
                             static_cast<float>(eps));
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    add_rms_norm_rows<scalar_t>(out.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                                weight.data_ptr<scalar_t>(), rows, h, static_cast<float>(eps));
  });
  return out;
}

namespace {

// Checks qkv [T, (Hq + 2 Hkv) * D] and cos / sin [T, R] (R <= D, even: the
// rotary's dims) of one dtype.
void check_rope_args(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t hq, int64_t hkv,
                     int64_t head_dim) {
  check_row_major(qkv, "qkv");
  check_row_major(cos, "cos");
  check_row_major(sin, "sin");
  TORCH_CHECK(hq > 0 && hkv > 0 && head_dim > 0 && head_dim % 2 == 0, "need positive head counts and an even head_dim");
  TORCH_CHECK(qkv.dim() == 2 && qkv.size(1) == (hq + 2 * hkv) * head_dim, "qkv must be [T, (Hq + 2 Hkv) * D]");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == qkv.size(0) && cos.size(1) > 0 && cos.size(1) <= head_dim &&
                  cos.size(1) % 2 == 0 && sin.sizes() == cos.sizes(),
              "cos and sin must be [T, R], R even and at most head_dim (a partial rotary turns R dims)");
  TORCH_CHECK(cos.scalar_type() == sin.scalar_type() &&
                  (cos.scalar_type() == qkv.scalar_type() || cos.scalar_type() == at::kFloat),
              "qkv, cos and sin must share a dtype (or cos and sin be fp32: a rotary computed in fp32)");
}

// Rotary on q (into q) and k, k and v of token t into row slots[t] of k / v
// (row t when slots is null), on the AVX-512 path where it applies.
void run_rope(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& q, at::Tensor& k,
              at::Tensor& v, const int64_t* slots, int64_t hq, int64_t hkv, int64_t head_dim) {
  const int64_t T = qkv.size(0), R = cos.size(1);
  if (T == 0) return;
  if (cos.scalar_type() != qkv.scalar_type()) {  // an fp32 table: rotary in fp32, one rounding
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_split_f32", [&] {
      rope_split_rows<scalar_t, float>(qkv.data_ptr<scalar_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                                       q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), slots, T,
                                       hq, hkv, head_dim, R);
    });
    return;
  }
#if CB_FUSED_X86
  if (qkv.scalar_type() == at::kBFloat16 && has_avx512_bf16()) {
    using B = c10::BFloat16;
    const B* src = qkv.data_ptr<B>();
    const B* c = cos.data_ptr<B>();
    const B* s = sin.data_ptr<B>();
    B* qp = q.data_ptr<B>();
    B* kp = k.data_ptr<B>();
    B* vp = v.data_ptr<B>();
    at::parallel_for(0, T, 8, [&](int64_t r0, int64_t r1) {
      rope_split_bf16_rows(src, c, s, qp, kp, vp, slots, r0, r1, hq, hkv, head_dim, R);
    });
    return;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope_split", [&] {
    rope_split_rows<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                              q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(), slots, T, hq, hkv,
                              head_dim, R);
  });
}

}  // namespace

// Rotary embedding on a fused QKV projection, split into contiguous heads.
//   qkv      [T, (Hq + 2 Hkv) * D] contiguous (q heads, then k, then v)
//   cos, sin [T, R] (R <= D: a partial rotary turns the first R dims of each head) in qkv's dtype, or fp32
//            (the rotary then runs in fp32, rounded once)
// returns (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]), rotary applied to q and k.
std::tuple<at::Tensor, at::Tensor, at::Tensor> rope_split(const at::Tensor& qkv, const at::Tensor& cos,
                                                          const at::Tensor& sin, int64_t hq, int64_t hkv,
                                                          int64_t head_dim) {
  check_rope_args(qkv, cos, sin, hq, hkv, head_dim);
  const int64_t T = qkv.size(0);
  auto q = at::empty({T, hq, head_dim}, qkv.options());
  auto k = at::empty({T, hkv, head_dim}, qkv.options());
  auto v = at::empty({T, hkv, head_dim}, qkv.options());
  run_rope(qkv, cos, sin, q, k, v, nullptr, hq, hkv, head_dim);
  return {q, k, v};
}

// rope_split with k and v written straight into their slots of the paged KV
// cache (what reshape_and_cache does with rope_split's k and v, without the
// intermediate tensors or a second pass).
//   key_cache, value_cache [num_blocks, block_size, Hkv, D], qkv's dtype, written in place
//   slot_mapping           [T] int64: block_id * block_size + offset; negative skips the token
// returns q [T, Hq, D].
at::Tensor rope_cache(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t hq, int64_t hkv,
                      int64_t head_dim, at::Tensor& key_cache, at::Tensor& value_cache,
                      const at::Tensor& slot_mapping) {
  check_rope_args(qkv, cos, sin, hq, hkv, head_dim);
  const int64_t T = qkv.size(0);
  for (const auto* c : {&key_cache, &value_cache}) {
    check_row_major(*c, "key_cache / value_cache");
    TORCH_CHECK(c->dim() == 4 && c->size(2) == hkv && c->size(3) == head_dim,
                "key_cache and value_cache must be [num_blocks, block_size, Hkv, D] with Hkv = ", hkv,
                " and D = ", head_dim);
    TORCH_CHECK(c->scalar_type() == qkv.scalar_type(), "the caches must have qkv's dtype");
  }
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key_cache and value_cache shapes differ");
  check_row_major(slot_mapping, "slot_mapping");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == T,
              "slot_mapping must be int64 [T]");
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK_INDEX(slots[t] < num_slots, "slot_mapping[", t, "] = ", slots[t], " is out of range for a cache of ",
                      num_slots, " slots");
  auto q = at::empty({T, hq, head_dim}, qkv.options());
  run_rope(qkv, cos, sin, q, key_cache, value_cache, slots, hq, hkv, head_dim);
  return q;
}

// Greedy decoding: the first index of each row's maximum, as torch.max(dim=-1)
// (NaN counts as the maximum), in one vectorised pass per row.
//   x [N, V] contiguous -> int64 [N]
at::Tensor argmax(const at::Tensor& x) {
  check_row_major(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "x must be [N, V] with V > 0");
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
#if CB_FUSED_X86
  if (x.scalar_type() == at::kBFloat16 && has_avx512_bf16()) {
    const c10::BFloat16* p = x.data_ptr<c10::BFloat16>();
    at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) o[r] = argmax_bf16_row(p + r * n, n);
    });
    return out;
  }
#endif
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "argmax", [&] {
    const scalar_t* p = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) o[r] = argmax_row<scalar_t>(p + r * n, n);
    });
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "cbserve fused element-wise ops (CPU)";
  m.def("rms_norm", &rms_norm, py::arg("x"), py::arg("weight"), py::arg("eps"),
        "RMSNorm over the last dim with Hugging Face Llama rounding; returns a new tensor.");
  m.def("rms_norm_w32_", &rms_norm_w32_, py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("out"),
        py::arg("round_first") = false, py::call_guard<py::gil_scoped_release>(),
        "out = (weight * (x * rsqrt(mean(x^2) + eps))).to(x.dtype) with an fp32 weight (OLMo 2 / Gemma "
        "rounding; round_first: (weight * (x * rsqrt(...)).to(x.dtype)).to(x.dtype), Qwen3's); x and out "
        "[R, H] or [A, B, H], rows may be strided, out may be x; weight [H] or [B, H] (one row per head).");
  m.def("norm_add_w32_", &norm_add_w32_, py::arg("x"), py::arg("residual"), py::arg("w"), py::arg("eps"),
        py::call_guard<py::gil_scoped_release>(),
        "residual += rms_norm_w32(x, w) in place (model dtype): OLMo 2's post-block norm and residual add in "
        "one pass.");
  m.def("norm_add_norm_w32", &norm_add_norm_w32, py::arg("x"), py::arg("residual"), py::arg("w1"), py::arg("eps1"),
        py::arg("w2"), py::arg("eps2"), py::call_guard<py::gil_scoped_release>(),
        "residual += rms_norm_w32(x, w1) in place (model dtype), then rms_norm_w32(residual, w2) as a new "
        "tensor: Gemma's post-block norm, residual add and next pre-norm in one pass.");
  m.def("silu_and_mul", &silu_and_mul, py::arg("gate_up"), py::arg("activation") = "silu",
        "act(gate) * up for gate_up = [gate | up] on the last dim, act 'silu' or 'gelu_tanh'; returns a new "
        "tensor.");
  m.def("argmax", &argmax, py::arg("x"),
        "First index of each row's maximum of a [N, V] tensor (NaN counts as the maximum), int64 [N].");
  m.def("add_rms_norm", &add_rms_norm, py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("eps"),
        "residual += x in place (model dtype), then RMSNorm(residual) as a new tensor.");
  m.def("rope_split", &rope_split, py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("num_q_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"),
        "Rotary embedding (rotate-half) on q and k of a fused [T, (Hq+2Hkv)*D] projection; returns "
        "contiguous (q, k, v).");
  m.def("rope_cache", &rope_cache, py::arg("qkv"), py::arg("cos"), py::arg("sin"), py::arg("num_q_heads"),
        py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("key_cache"), py::arg("value_cache"),
        py::arg("slot_mapping"), py::call_guard<py::gil_scoped_release>(),
        "rope_split with k and v written into their slots of the paged KV cache "
        "([num_blocks, block_size, Hkv, D]; a negative slot skips the token); returns q [T, Hq, D].");
  m.def("amx_pack_weight", &cbserve_fused::amx_pack_weight, py::arg("weight"),
        "weight [N, K] bf16 -> the zero-padded AMX tile layout amx_linear reads.");
  m.def("amx_linear", &cbserve_fused::amx_linear, py::arg("x"), py::arg("packed"), py::arg("out_features"),
        py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>(),
        "x [M, K] @ weight^T (+ bias) in bf16 on AMX tiles, weight packed by amx_pack_weight; "
        "AMX-BF16 CPUs only (see amx_linear_supported).");
  m.def("amx_pack_gate_up", &cbserve_fused::amx_pack_gate_up, py::arg("gate_up"),
        "gate_up [2I, K] bf16 (gate rows then up rows, I a multiple of 16) -> the AMX tile layout "
        "amx_linear_silu_mul reads.");
  m.def("amx_linear_silu_mul", &cbserve_fused::amx_linear_silu_mul, py::arg("x"), py::arg("packed"), py::arg("inter"),
        py::arg("activation") = "silu", py::call_guard<py::gil_scoped_release>(),
        "act(x @ gate^T) * (x @ up^T) [M, inter] (act 'silu' or 'gelu_tanh') in bf16 on AMX tiles, weights packed by "
        "amx_pack_gate_up; "
        "AMX-BF16 CPUs only (see amx_linear_supported).");
  m.def("amx_linear_argmax", &cbserve_fused::amx_linear_argmax, py::arg("x"), py::arg("packed"),
        py::arg("out_features"), py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>(),
        "The first index of each row's maximum of amx_linear(x, packed, out_features, bias) (NaN counts as "
        "the maximum, as torch.max), int64 [M], without writing the logits: the greedy LM head. "
        "AMX-BF16 CPUs only (see amx_linear_supported).");
  m.def("amx_dequant", &cbserve_fused::amx_dequant, py::arg("packed"),
        "uint8 GGUF blocks (Q4_1 / Q8_0 [N/16, K/32, 320 | 544], Q4_K / Q6_K [N/16, K/256, 2368 | 3360]) -> the "
        "bf16 tiles [N/16, K/32, 16, 16, 2] the kernels expand them to (the amx_pack_weight layout). "
        "AVX512-BF16 CPUs.");
  m.def("amx_linear_supported", &cbserve_fused::amx_linear_supported);
  m.def("avx512_linear", &cbserve_fused::avx512_linear, py::arg("x"), py::arg("packed"), py::arg("out_features"),
        py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>(),
        "x [M, K] @ weight^T (+ bias) in bf16 with AVX512-BF16 dot products, weight packed by amx_pack_weight; "
        "AVX512-BF16 CPUs, AMX not needed (see avx512_linear_supported).");
  m.def("avx512_linear_silu_mul", &cbserve_fused::avx512_linear_silu_mul, py::arg("x"), py::arg("packed"),
        py::arg("inter"), py::arg("activation") = "silu", py::call_guard<py::gil_scoped_release>(),
        "act(x @ gate^T) * (x @ up^T) [M, inter] (act 'silu' or 'gelu_tanh') in bf16 with AVX512-BF16 dot products, "
        "weights packed by "
        "amx_pack_gate_up; AVX512-BF16 CPUs (see avx512_linear_supported).");
  m.def("avx512_linear_supported", &cbserve_fused::avx512_linear_supported);
  m.def("avx512_int8_supported", &cbserve_fused::avx512_int8_supported,
        "Whether avx512_linear and gguf_linear can multiply GGUF blocks by int8 activations (AVX512-VNNI, "
        "with or without AVX512-BF16).");
  m.def("set_block_activations", &cbserve_fused::set_block_activations, py::arg("kind"),
        "'bf16' (default: the blocks expand to the model's weights, outputs equal its bit for bit) or 'int8': how "
        "avx512_linear (up to 16 rows) and gguf_linear (every call) multiply GGUF blocks (int8 / int16 "
        "activations per 32-wide k-block, integer dot products; AVX512-VNNI CPUs).");
  m.def("block_activations", &cbserve_fused::block_activations);
  m.def("avx2_f32_pack_weight", &cbserve_fused::avx2_f32_pack_weight, py::arg("weight"),
        "weight [N, K] fp32 or bf16 -> the zero-padded panel layout avx2_f32_linear reads (same dtype): "
        "[ceil(N/16), K, 16].");
  m.def("avx2_f32_linear", &cbserve_fused::avx2_f32_linear, py::arg("x"), py::arg("packed"), py::arg("out_features"),
        py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>(),
        "x [M, K] @ weight^T (+ bias) in fp32 arithmetic with AVX2 FMA, weight packed by avx2_f32_pack_weight; "
        "all fp32, or all bf16 (y rounded once); "
        "AVX2 + FMA CPUs (see avx2_f32_linear_supported).");
  m.def("avx2_f32_linear_supported", &cbserve_fused::avx2_f32_linear_supported);
  m.def("gguf_linear", &cbserve_fused::gguf_linear, py::arg("x"), py::arg("packed"), py::arg("out_features"),
        py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>(),
        "x [M, K] @ weight^T (+ bias) over GGUF blocks (the layout amx_dequant reads) in fp32 arithmetic, for "
        "CPUs without AVX512-BF16: fp32 x with the blocks' exact values, or bf16 x with them rounded to bf16 "
        "(y rounded once); AVX2 + FMA + F16C code where the CPU has it (gguf_linear_avx2), portable code elsewhere.");
  m.def("gguf_linear_avx2", &cbserve_fused::gguf_linear_avx2);
  m.def("gguf_dequant", &cbserve_fused::gguf_dequant, py::arg("packed"), py::arg("dtype"),
        py::call_guard<py::gil_scoped_release>(),
        "uint8 GGUF blocks -> the [N, K] weight gguf_linear computes with, float32 (exact) or bfloat16; any CPU.");
  m.def("lora_add", &cbserve_fused::lora_add, py::arg("x"), py::arg("out"), py::arg("col0"), py::arg("slots"),
        py::arg("a"), py::arg("bt"), py::arg("ranks"), py::arg("scales"), py::call_guard<py::gil_scoped_release>(),
        "LoRA deltas in place: out[t, col0:col0+N] += scales[s-1] * (x[t] A[s-1]^T) Bt[s-1] for the rows t of "
        "slot s = slots[t] > 0 (executor/lora.py); any CPU.");
  m.def("gguf_embed", &cbserve_fused::gguf_embed, py::arg("packed"), py::arg("ids"), py::arg("dtype"),
        py::call_guard<py::gil_scoped_release>(),
        "Rows ids (int64 [T]) of the weight packed as GGUF blocks, [T, K] float32 or bfloat16 as gguf_dequant "
        "expands them: an embedding lookup from blocks on any CPU.");
  m.def("amx_q4_rows_linear", &cbserve_fused::amx_q4_rows_linear, py::arg("x"), py::arg("packed"),
        py::arg("out_features"), py::arg("silu_inter") = 0, py::call_guard<py::gil_scoped_release>(),
        "x [M, K] @ weight^T in bf16, weight as Q4_1 blocks in the feature-major layout "
        "(BlockWeight.pack_rows: uint8 [N/32, K/32, 2, 320]) expanded exactly as amx_linear expands them; "
        "with silu_inter > 0, silu(gate) * up [M, silu_inter] of gate|up rows interleaved in blocks of 16. "
        "AMX-BF16 CPUs only.");
  m.def("amx_q4_rows_dequant", &cbserve_fused::amx_q4_rows_dequant, py::arg("packed"),
        "uint8 [N/32, K/32, 2, 320] (BlockWeight.pack_rows) -> the bf16 [N, K] weight amx_q4_rows_linear uses.");
}
