// Token sampling on the GPU: the host sampler's algorithm (executor/sampler.py)
// for rows that need no logit processing: greedy rows take the first index of
// the maximum; the others temperature, min-p, top-k, top-p and one
// inverse-CDF draw with the uniform number the host computed from
// (seed, output index).
//
// One block per row, and nothing a block computes depends on another row or
// on how many rows there are: every sum is taken in a fixed order (per
// thread in index order, then a fixed tree), so a row samples the same token
// alone or in any batch, run after run.
//
// The kept set is found without sorting. Ordering keys of the raw logits
// (temperature > 0 keeps their order) give two thresholds, each by a binary
// search over the key space: top-k keeps keys >= the largest K with
// count(key >= K) >= k; top-p keeps keys >= the largest K with
// mass(key >= K) >= p * mass(all kept), which is the host's rule (a token is
// kept while the mass sorted before it is < p) up to rounding and ties. With
// 16-bit logits a search takes 16 passes over the row, with fp32 32.
// min-p keeps exp(x - x_max) >= min_p. The draw is the first index (vocabulary
// order) whose prefix mass exceeds u times the kept mass.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "cuda_common.cuh"
#include "cuda_launchers.h"

namespace {

constexpr int kSampleThreads = 1024;
constexpr int kWarps = kSampleThreads / 32;

// Order-preserving unsigned keys: a < b as numbers <=> key(a) < key(b).
__device__ __forceinline__ uint32_t key_of(float x) {
  const uint32_t u = __float_as_uint(x);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ uint32_t key16(uint16_t u) {
  return (u & 0x8000u) ? uint32_t(uint16_t(~u)) : uint32_t(u | 0x8000u);
}
__device__ __forceinline__ uint32_t key_of(__nv_bfloat16 x) { return key16(__bfloat16_as_ushort(x)); }
__device__ __forceinline__ uint32_t key_of(__half x) { return key16(__half_as_ushort(x)); }

template <typename T>
struct KeyBits {
  static constexpr uint32_t max = sizeof(T) == 4 ? 0xffffffffu : 0xffffu;
};

// Block-wide reductions, the same in every thread; each leaves the scratch
// free for the next call.
__device__ float block_sum(float v, float* sh) {
  v = warp_sum(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) t += sh[w];
  return t;
}
__device__ float block_max(float v, float* sh) {
  v = warp_max(v);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  float t = -INFINITY;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) t = fmaxf(t, sh[w]);
  return t;
}
__device__ int block_count(int v, int* sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
  __syncthreads();
  int t = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) t += sh[w];
  return t;
}

// The first index of the row's maximum (a NaN never wins).
template <typename T>
__device__ int block_argmax(const T* x, int V, float* shv, int* shi) {
  float best = -INFINITY;
  int at = V;
  for (int i = threadIdx.x; i < V; i += kSampleThreads) {
    const float v = to_f(x[i]);
    if (v > best || (v == best && i < at)) {
      best = v;
      at = i;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(0xffffffffu, best, o);
    const int oi = __shfl_xor_sync(0xffffffffu, at, o);
    if (ov > best || (ov == best && oi < at)) {
      best = ov;
      at = oi;
    }
  }
  __syncthreads();
  if ((threadIdx.x & 31) == 0) {
    shv[threadIdx.x >> 5] = best;
    shi[threadIdx.x >> 5] = at;
  }
  __syncthreads();
  best = -INFINITY;
  at = V;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    if (shv[w] > best || (shv[w] == best && shi[w] < at)) {
      best = shv[w];
      at = shi[w];
    }
  }
  return at < V ? at : 0;
}

template <typename T>
struct Row {
  const T* x;
  int V;
  float temp, x_max, min_p;
  uint32_t k_floor;  // keys below it are out (top-k, then top-p)

  // exp(x - x_max) of element i where it is kept by min-p and the key
  // floor, else 0 (x = logit / temperature, as the host divides).
  __device__ float mass(int i, uint32_t floor) const {
    const T v = x[i];
    if (key_of(v) < floor) return 0.f;
    const float e = expf(to_f(v) / temp - x_max);
    return e >= min_p ? e : 0.f;
  }
  __device__ bool min_p_keeps(float raw) const { return min_p <= 0.f || expf(raw / temp - x_max) >= min_p; }
};

// The largest K in [lo, hi] with weight(K) >= target, where weight is
// non-increasing in K and weight(lo) >= target.
template <typename F>
__device__ uint32_t search_floor(uint32_t lo, uint32_t hi, F weight_ge) {
  while (lo < hi) {
    const uint32_t mid = uint32_t((uint64_t(lo) + uint64_t(hi) + 1) / 2);
    if (weight_ge(mid)) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// params: [5, N] float32 rows: temperature, top_k, top_p, min_p, u.
template <typename T>
__global__ void __launch_bounds__(kSampleThreads)
    sample_kernel(const T* __restrict__ logits, int64_t ld, int V, const float* __restrict__ params, int N,
                  int64_t* __restrict__ out) {
  __shared__ float shf[kWarps];
  __shared__ int shi[kWarps];
  __shared__ float scan[kWarps];
  __shared__ int pick;
  const int r = blockIdx.x;
  const T* x = logits + size_t(r) * ld;
  const float temp = params[r], top_k = params[N + r], top_p = params[2 * N + r], min_p = params[3 * N + r];
  const float u = params[4 * N + r];
  if (!(temp > 0.f)) {  // greedy
    const int at = block_argmax(x, V, shf, shi);
    if (threadIdx.x == 0) out[r] = at;
    return;
  }
  // The raw maximum and whether the row holds a NaN or +inf.
  float mx = -INFINITY;
  int bad = 0;
  for (int i = threadIdx.x; i < V; i += kSampleThreads) {
    const float v = to_f(x[i]);
    bad |= isnan(v) || v == INFINITY;
    mx = fmaxf(mx, v);
  }
  mx = block_max(mx, shf);
  bad = block_count(bad, shi);
  const float x_max = mx / temp;
  if (bad || !isfinite(x_max)) {  // as the host: a row without a finite distribution goes greedy
    const int at = block_argmax(x, V, shf, shi);
    if (threadIdx.x == 0) out[r] = at;
    return;
  }
  Row<T> row{x, V, temp, x_max, min_p, 0u};
  const uint32_t key_hi = key_of(from_f<T>(mx));
  // top-k: over what min-p keeps (the host masks min-p first).
  const int k = int(top_k);
  if (k > 0 && k < V) {
    row.k_floor = search_floor(0u, key_hi, [&](uint32_t K) {
      int c = 0;
      for (int i = threadIdx.x; i < V; i += kSampleThreads) {
        const T v = x[i];
        c += key_of(v) >= K && row.min_p_keeps(to_f(v));
      }
      return block_count(c, shi) >= k;
    });
  }
  auto mass_ge = [&](uint32_t K) {
    float s = 0.f;
    for (int i = threadIdx.x; i < V; i += kSampleThreads) s += row.mass(i, K);
    return block_sum(s, shf);
  };
  float total = mass_ge(row.k_floor);
  if (top_p > 0.f && top_p < 1.f && total > 0.f && isfinite(total)) {
    const float target = top_p * total;
    row.k_floor = search_floor(row.k_floor, key_hi, [&](uint32_t K) { return mass_ge(K) >= target; });
  }
  // The draw: thread t owns the contiguous slice [t * per, (t + 1) * per).
  const int per = (V + kSampleThreads - 1) / kSampleThreads;
  const int lo = min(V, int(threadIdx.x) * per), hi = min(V, lo + per);
  float mine = 0.f;
  int last = -1;
  for (int i = lo; i < hi; ++i) {
    const float e = row.mass(i, row.k_floor);
    mine += e;
    if (e > 0.f) last = i;
  }
  // Exclusive prefix of the slices' masses: a warp scan, then the warps'.
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float inc = mine;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float y = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += y;
  }
  if (lane == 31) scan[warp] = inc;
  if (threadIdx.x == 0) pick = kSampleThreads;
  __syncthreads();
  float before = 0.f, all = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) {
    if (w < warp) before += scan[w];
    all += scan[w];
  }
  const float excl = before + inc - mine;
  if (!(all > 0.f) || !isfinite(all)) {  // nothing kept with mass: greedy, as the host
    const int at = block_argmax(x, V, shf, shi);
    if (threadIdx.x == 0) out[r] = at;
    return;
  }
  const float goal = u * all;
  if (mine > 0.f && excl + mine > goal) atomicMin(&pick, int(threadIdx.x));
  __syncthreads();
  if (int(threadIdx.x) == pick) {
    float run = excl;
    int tok = last;
    for (int i = lo; i < hi; ++i) {
      const float e = row.mass(i, row.k_floor);
      if (e > 0.f) {
        run += e;
        if (run > goal) {
          tok = i;
          break;
        }
      }
    }
    out[r] = tok;
  }
  if (pick == kSampleThreads) {  // rounding put the goal past every prefix: the last kept token
    int m = last;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) shi[warp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
      int best = -1;
      for (int w = 0; w < kWarps; ++w) best = max(best, shi[w]);
      out[r] = best < 0 ? 0 : best;
    }
  }
}

template <typename T>
int launch_sample(const void* logits, int64_t ld, int64_t N, int64_t V, const float* params, int64_t* out,
                  cudaStream_t stream) {
  if (N == 0) return 0;
  if (V <= 0 || V > (int64_t(1) << 30) || N > (int64_t(1) << 31) - 1) return int(cudaErrorInvalidValue);
  sample_kernel<T>
      <<<unsigned(N), kSampleThreads, 0, stream>>>(static_cast<const T*>(logits), ld, int(V), params, int(N), out);
  return int(cudaGetLastError());
}

}  // namespace

extern "C" int cbserve_sample_cuda(int dtype, const void* logits, int64_t row_stride, int64_t num_rows, int64_t vocab,
                                   const float* params, int64_t* out, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0: return launch_sample<float>(logits, row_stride, num_rows, vocab, params, out, s);
    case 1: return launch_sample<__nv_bfloat16>(logits, row_stride, num_rows, vocab, params, out, s);
    case 2: return launch_sample<__half>(logits, row_stride, num_rows, vocab, params, out, s);
    default: return int(cudaErrorInvalidValue);
  }
}
