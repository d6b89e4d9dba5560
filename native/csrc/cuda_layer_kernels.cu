// The element-wise layer kernels of the GPU lean forward
// (executor/gpu/lean_forward.py), against raw device pointers like
// cuda_kernels.cu. Each one replaces several torch kernels of the
// transformers layer code, and each rounds to the storage dtype where that
// code stores a tensor, so a step computes what the transformers model
// computes up to the order of a sum.
//
// None of them reads a value on the host: every size is an argument, so a
// step made of them can be captured into a CUDA graph and replayed.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

#include "cuda_common.cuh"
#include "cuda_launchers.h"

namespace {

constexpr int kNormThreads = 256;

// One block per row. kAdd: residual += x (rounded, as the model adds the
// residual stream in its dtype), then x = weight * rms_norm(residual).
// Without kAdd: residual = x, then the same norm (the first layer).
template <typename T, bool kAdd>
__global__ void __launch_bounds__(kNormThreads)
    add_rms_norm_kernel(T* __restrict__ x, T* __restrict__ residual, const T* __restrict__ weight, int H, float eps) {
  extern __shared__ float row[];  // [H]: the residual row in fp32
  __shared__ float partial[kNormThreads / 32];
  T* xr = x + size_t(blockIdx.x) * H;
  T* rr = residual + size_t(blockIdx.x) * H;
  float ss = 0.f;
  for (int i = threadIdx.x; i < H; i += blockDim.x) {
    const T v = kAdd ? from_f<T>(to_f(rr[i]) + to_f(xr[i])) : xr[i];
    rr[i] = v;
    const float f = to_f(v);
    row[i] = f;
    ss = fmaf(f, f, ss);
  }
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kNormThreads / 32; ++w) total += partial[w];
  const float inv = rsqrtf(total / float(H) + eps);
  for (int i = threadIdx.x; i < H; i += blockDim.x) xr[i] = from_f<T>(to_f(weight[i]) * round_to<T>(row[i] * inv));
}

// One block per token of qkv [T, (Hq + 2 Hkv) * D] (q heads, then k, then v).
// Rotates q (into q_out [T, Hq, D]) and k by the rotate-half rotary
// embedding of the token's position (cos / sin tables [P, D]), and writes k
// and v to the token's cache slot; a negative slot writes nothing.
template <typename T>
__global__ void rotary_cache_kernel(T* __restrict__ q_out, const T* __restrict__ qkv,
                                    const int32_t* __restrict__ positions, const T* __restrict__ cos,
                                    const T* __restrict__ sin, T* __restrict__ key_cache, T* __restrict__ value_cache,
                                    const int32_t* __restrict__ slots, int hq, int hkv, int D) {
  const size_t t = blockIdx.x;
  const int half = D / 2;
  const T* row = qkv + t * size_t(hq + 2 * hkv) * D;
  const T* c = cos + size_t(positions[t]) * D;
  const T* s = sin + size_t(positions[t]) * D;
  const int64_t slot = slots[t];
  for (int idx = threadIdx.x; idx < (hq + hkv) * half; idx += blockDim.x) {
    const int h = idx / half, i = idx - h * half;
    const T* src = row + size_t(h) * D;
    const float x1 = to_f(src[i]), x2 = to_f(src[i + half]);
    // x * cos + rotate_half(x) * sin, each product stored before the sum.
    const T o1 = from_f<T>(round_to<T>(x1 * to_f(c[i])) + round_to<T>(-x2 * to_f(s[i])));
    const T o2 = from_f<T>(round_to<T>(x2 * to_f(c[i + half])) + round_to<T>(x1 * to_f(s[i + half])));
    T* dst;
    if (h < hq) {
      dst = q_out + (t * hq + h) * D;
    } else {
      if (slot < 0) continue;
      dst = key_cache + (size_t(slot) * hkv + (h - hq)) * D;
    }
    dst[i] = o1;
    dst[i + half] = o2;
  }
  if (slot < 0) return;
  const T* v = row + size_t(hq + hkv) * D;
  T* vdst = value_cache + size_t(slot) * hkv * D;
  for (int e = threadIdx.x; e < hkv * D; e += blockDim.x) vdst[e] = v[e];
}

// out [T, I] = silu(gate) * up for gate_up [T, 2I] (gate columns first).
template <typename T>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ gate_up, int64_t rows, int64_t I) {
  const int64_t n = rows * I;
  for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < n; e += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = e / I, i = e - r * I;
    const float g = to_f(gate_up[r * 2 * I + i]);
    const float u = to_f(gate_up[r * 2 * I + I + i]);
    out[e] = from_f<T>(round_to<T>(g / (1.f + expf(-g))) * u);
  }
}

template <typename T>
int launch_norm(void* x, void* residual, const void* weight, int64_t rows, int64_t H, float eps, bool add,
                cudaStream_t stream) {
  if (rows == 0) return 0;
  if (H <= 0 || rows > 0x7fffffff) return int(cudaErrorInvalidValue);
  const size_t smem = size_t(H) * sizeof(float);
  if (smem > 48 * 1024) return int(cudaErrorInvalidValue);
  auto* xp = static_cast<T*>(x);
  auto* rp = static_cast<T*>(residual);
  const auto* wp = static_cast<const T*>(weight);
  if (add) {
    add_rms_norm_kernel<T, true><<<unsigned(rows), kNormThreads, smem, stream>>>(xp, rp, wp, int(H), eps);
  } else {
    add_rms_norm_kernel<T, false><<<unsigned(rows), kNormThreads, smem, stream>>>(xp, rp, wp, int(H), eps);
  }
  return int(cudaGetLastError());
}

template <typename T>
int launch_rotary(void* q_out, const void* qkv, const int32_t* positions, const void* cos, const void* sin,
                  void* key_cache, void* value_cache, const int32_t* slots, int64_t T_, int64_t hq, int64_t hkv,
                  int64_t D, cudaStream_t stream) {
  if (T_ == 0) return 0;
  if (D <= 0 || D % 2 != 0 || T_ > 0x7fffffff) return int(cudaErrorInvalidValue);
  rotary_cache_kernel<T><<<unsigned(T_), 128, 0, stream>>>(
      static_cast<T*>(q_out), static_cast<const T*>(qkv), positions, static_cast<const T*>(cos),
      static_cast<const T*>(sin), static_cast<T*>(key_cache), static_cast<T*>(value_cache), slots, int(hq), int(hkv),
      int(D));
  return int(cudaGetLastError());
}

template <typename T>
int launch_silu(void* out, const void* gate_up, int64_t rows, int64_t I, cudaStream_t stream) {
  const int64_t n = rows * I;
  if (n == 0) return 0;
  const int threads = 256;
  const int64_t blocks = (n + threads - 1) / threads;
  silu_and_mul_kernel<T><<<unsigned(blocks < 65535 ? blocks : 65535), threads, 0, stream>>>(
      static_cast<T*>(out), static_cast<const T*>(gate_up), rows, I);
  return int(cudaGetLastError());
}

}  // namespace

extern "C" int cbserve_add_rms_norm_cuda(int dtype, void* x, void* residual, const void* weight, int64_t rows,
                                         int64_t hidden, float eps, int add, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0: return launch_norm<float>(x, residual, weight, rows, hidden, eps, add != 0, s);
    case 1: return launch_norm<__nv_bfloat16>(x, residual, weight, rows, hidden, eps, add != 0, s);
    case 2: return launch_norm<__half>(x, residual, weight, rows, hidden, eps, add != 0, s);
    default: return int(cudaErrorInvalidValue);
  }
}

extern "C" int cbserve_rotary_cache_cuda(int dtype, void* q_out, const void* qkv, const int32_t* positions,
                                         const void* cos, const void* sin, void* key_cache, void* value_cache,
                                         const int32_t* slots, int64_t num_tokens, int64_t hq, int64_t hkv,
                                         int64_t head_dim, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0:
      return launch_rotary<float>(q_out, qkv, positions, cos, sin, key_cache, value_cache, slots, num_tokens, hq, hkv,
                                  head_dim, s);
    case 1:
      return launch_rotary<__nv_bfloat16>(q_out, qkv, positions, cos, sin, key_cache, value_cache, slots, num_tokens,
                                          hq, hkv, head_dim, s);
    case 2:
      return launch_rotary<__half>(q_out, qkv, positions, cos, sin, key_cache, value_cache, slots, num_tokens, hq, hkv,
                                   head_dim, s);
    default: return int(cudaErrorInvalidValue);
  }
}

extern "C" int cbserve_silu_and_mul_cuda(int dtype, void* out, const void* gate_up, int64_t rows, int64_t inter,
                                         void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0: return launch_silu<float>(out, gate_up, rows, inter, s);
    case 1: return launch_silu<__nv_bfloat16>(out, gate_up, rows, inter, s);
    case 2: return launch_silu<__half>(out, gate_up, rows, inter, s);
    default: return int(cudaErrorInvalidValue);
  }
}
