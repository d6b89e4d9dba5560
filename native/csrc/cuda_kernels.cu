// CUDA twins of the CPU ops, against raw device pointers (no torch headers):
// compiled by setup.py's CUDAExtension when a CUDA toolkit and a CUDA build of
// torch are present, and standalone by `make native-cuda-check`.
//
// paged_attention: one thread block per (query-row tile, KV head, sequence);
// a row is one (query token, query head of the GQA group) pair, one warp per
// row, kRows warps per block. The block streams the sequence's KV through
// shared memory in tiles of kTile tokens (read once per tile for all rows of
// the block, i.e. for the whole GQA group), each lane scores one token of the
// tile, and each warp keeps an online softmax (running max / sum) and its
// output row in registers (lane owns dims lane, lane+32, ...). No
// [q_len, kv_len] matrix is ever materialised.
//
// Decode (every query length 0 or 1) splits the KV range too: each block
// takes one partition of part_tokens tokens and writes its rows' unnormalised
// partial result (running max, sum, accumulator) to a float workspace, and a
// second kernel combines the partitions of each row. A sequence then keeps
// ceil(kv_len / part_tokens) blocks busy instead of one per KV head, which is
// what a small decode batch over a long context needs.
//
// Decode launches take decode_attention_kernel instead where the shapes allow
// (16-byte rows, GQA group of at most 8): a block per (partition, KV head,
// sequence) reads each K and V row once, 16 bytes per thread, for all G query
// heads of the group at once; see its comment.
//
// Both kernels take the CPU kernels' sliding window and soft cap (Mask): a
// row at position pos sees KV [pos - window + 1, pos] (window 0: [0, pos]),
// and each scaled score s becomes cap * tanh(s / cap) (cap 0: unchanged).
// KV before the window of a block's earliest row is not read at all; a split
// decode partition wholly before its sequence's window writes no partial
// result, and combine_splits_kernel starts after such partitions.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_common.cuh"
#include "cuda_launchers.h"

namespace {

constexpr int kRows = 8;   // warps (rows) per block
constexpr int kTile = 32;  // KV tokens per shared-memory tile
constexpr int kMaxDPerLane = CBSERVE_CUDA_MAX_HEAD_DIM / 32;
constexpr int kMaxSplits = 32;  // partitions per sequence, at most (bounds the workspace)

struct Mask {
  int window;  // > 0: a row at pos sees KV [pos - window + 1, pos]
  float cap;   // > 0: scores become cap * tanh(s / cap)
};

__device__ __forceinline__ float soft_cap(float s, const Mask& mask) {
  return mask.cap > 0.f ? mask.cap * tanhf(s / mask.cap) : s;
}

// First KV token a row at position pos sees.
__device__ __forceinline__ int window_lo(int pos, const Mask& mask) {
  return mask.window > 0 ? max(0, pos - mask.window + 1) : 0;
}

// Where a split launch writes its partial results: for partition s, query
// token t and query head hh, index i = (s * num_tokens + t) * hq + hh:
// ml[2i] = running max, ml[2i + 1] = sum of exponentials, acc[i * D + d].
struct SplitKV {
  float* acc;
  float* ml;
  int part_tokens;  // a multiple of kTile
  int row_tiles;    // blockIdx.x = partition * row_tiles + row tile
  int num_tokens;
  int direct;  // 1: a sequence with one partition had its output written directly (decode kernel)
};

template <typename T, bool kSplit>
__global__ void __launch_bounds__(kRows * 32)
    paged_attention_kernel(T* __restrict__ out, const T* __restrict__ query, const T* __restrict__ key_cache,
                           const T* __restrict__ value_cache, const int32_t* __restrict__ block_tables,
                           const int32_t* __restrict__ cu_seqlens, const int32_t* __restrict__ seq_lens, int max_blocks,
                           int hq, int hkv, int D, int bs, float scale, Mask mask, SplitKV split) {
  const int b = blockIdx.z, h = blockIdx.y;
  const int G = hq / hkv;
  const int q0 = cu_seqlens[b];
  const int q_len = cu_seqlens[b + 1] - q0;
  const int rows = q_len * G;
  const int part = kSplit ? int(blockIdx.x) / split.row_tiles : 0;
  const int row0 = (kSplit ? int(blockIdx.x) % split.row_tiles : int(blockIdx.x)) * kRows;
  if (row0 >= rows) return;  // whole block idle: uniform exit before any barrier
  const int kv_len = seq_lens[b];
  const int ctx = kv_len - q_len;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row = row0 + warp;
  const bool active = row < rows;
  const int i = active ? row / G : 0;
  const int g = active ? row % G : 0;
  const int pos = ctx + i;  // this row's position; it sees KV [lo, pos]
  const int lo = window_lo(pos, mask);
  const int last_row = min(rows, row0 + kRows) - 1;
  int kv_hi = ctx + last_row / G + 1;  // KV range any row of the block sees
  int kv_lo = window_lo(ctx + row0 / G, mask);
  if (kSplit) {
    const int p_lo = part * split.part_tokens;
    if (p_lo >= kv_hi) return;  // past this sequence's context (uniform: before any barrier)
    kv_hi = min(kv_hi, p_lo + split.part_tokens);
    kv_lo = max(kv_lo, p_lo);
  }
  if (kv_lo >= kv_hi) return;  // a split partition before the window (uniform)

  extern __shared__ float smem[];
  const int ld = D + 1;         // padded: lane t reads row t of Ks without bank conflicts
  float* Ks = smem;             // [kTile][D+1]
  float* Vs = Ks + kTile * ld;  // [kTile][D+1]
  float* Qs = Vs + kTile * ld;  // [kRows][D]
  float* q_row = Qs + warp * D;

  const size_t q_off = (size_t(q0 + i) * hq + size_t(h) * G + g) * D;
  for (int d = lane; d < D; d += 32) q_row[d] = active ? to_f(query[q_off + d]) * scale : 0.f;

  float acc[kMaxDPerLane];
#pragma unroll
  for (int k = 0; k < kMaxDPerLane; ++k) acc[k] = 0.f;
  float m = -INFINITY, l = 0.f;
  const int32_t* table = block_tables + size_t(b) * max_blocks;

  for (int t0 = kv_lo; t0 < kv_hi; t0 += kTile) {
    const int n = min(kTile, kv_hi - t0);
    __syncthreads();  // previous tile fully consumed (and q_row written)
    for (int idx = threadIdx.x; idx < n * D; idx += blockDim.x) {
      const int t = idx / D, d = idx - t * D;
      const int tok = t0 + t;
      const size_t blk = size_t(table[tok / bs]);
      const size_t src = ((blk * bs + tok % bs) * hkv + h) * size_t(D) + d;
      Ks[t * ld + d] = to_f(key_cache[src]);
      Vs[t * ld + d] = to_f(value_cache[src]);
    }
    __syncthreads();
    if (!active) continue;
    float s = -INFINITY;
    if (lane < n && t0 + lane <= pos && t0 + lane >= lo) {
      const float* kr = Ks + lane * ld;
      float dot = 0.f;
      for (int d = 0; d < D; ++d) dot = fmaf(q_row[d], kr[d], dot);
      s = soft_cap(dot, mask);
    }
    const float mx = warp_max(s);
    if (mx == -INFINITY) continue;  // warp-uniform: nothing visible in this tile
    const float m_new = fmaxf(m, mx);
    const float corr = __expf(m - m_new);  // 0 on the first visible tile
    const float p = s == -INFINITY ? 0.f : __expf(s - m_new);
    l = l * corr + warp_sum(p);
    m = m_new;
#pragma unroll
    for (int k = 0; k < kMaxDPerLane; ++k) acc[k] *= corr;
    for (int t = 0; t < n; ++t) {
      const float pt = __shfl_sync(0xffffffffu, p, t);
      const float* vr = Vs + t * ld;
#pragma unroll
      for (int k = 0; k < kMaxDPerLane; ++k) {
        const int d = lane + 32 * k;
        if (d < D) acc[k] = fmaf(pt, vr[d], acc[k]);
      }
    }
  }
  if (!active) return;
  if (kSplit) {
    const size_t pi = (size_t(part) * split.num_tokens + q0 + i) * hq + size_t(h) * G + g;
    if (lane == 0) {
      split.ml[2 * pi] = m;
      split.ml[2 * pi + 1] = l;
    }
#pragma unroll
    for (int k = 0; k < kMaxDPerLane; ++k) {
      const int d = lane + 32 * k;
      if (d < D) split.acc[pi * D + d] = acc[k];
    }
    return;
  }
  const float inv = l > 0.f ? 1.f / l : 0.f;
#pragma unroll
  for (int k = 0; k < kMaxDPerLane; ++k) {
    const int d = lane + 32 * k;
    if (d < D) out[q_off + d] = from_f<T>(acc[k] * inv);
  }
}

// ---------------------------------------------------------------- decode ---
// One query token per sequence. Block (partition, KV head, sequence) of
// kDecThreads threads; the GQA group's G <= kG query rows share every K / V
// load. A token's head row (D elements) is read by TG = D / VE threads, VE
// elements (16 bytes) each, so a pass of the block covers kDecThreads / TG
// tokens. The partition is walked in chunks of kDecChunk tokens: scores to
// shared memory, an online softmax per row (running max and sum in shared
// memory), then P.V into per-thread accumulators; at the end those are summed
// over the token lanes in a fixed order. A sequence whose context fits one
// partition is normalised and written to `out` here; the others leave their
// partial results for combine_splits_kernel (split.direct = 1 tells it to
// skip the first kind).
constexpr int kDecThreads = 128;
constexpr int kDecChunk = 128;

template <typename T>
struct Vec16 {
  static constexpr int n = 16 / sizeof(T);
};

__device__ __forceinline__ void load16(const float* p, float (&f)[4]) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  f[0] = v.x;
  f[1] = v.y;
  f[2] = v.z;
  f[3] = v.w;
}
__device__ __forceinline__ void load16(const __nv_bfloat16* p, float (&f)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}
__device__ __forceinline__ void load16(const __half* p, float (&f)[8]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __half22float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

template <typename T, int kG>
__global__ void __launch_bounds__(kDecThreads)
    decode_attention_kernel(T* __restrict__ out, const T* __restrict__ query, const T* __restrict__ key_cache,
                            const T* __restrict__ value_cache, const int32_t* __restrict__ block_tables,
                            const int32_t* __restrict__ cu_seqlens, const int32_t* __restrict__ seq_lens,
                            int max_blocks, int hq, int hkv, int D, int bs, float scale, Mask mask, SplitKV split) {
  constexpr int VE = Vec16<T>::n;
  const int b = blockIdx.z, h = blockIdx.y, part = blockIdx.x;
  const int q0 = cu_seqlens[b];
  if (cu_seqlens[b + 1] == q0) return;  // no query token (uniform: before any barrier)
  const int kv_len = seq_lens[b];
  const int p_lo = part * split.part_tokens;
  if (p_lo >= kv_len) return;
  const int kv_hi = min(kv_len, p_lo + split.part_tokens);
  // Every token of [kv_lo, kv_hi) is visible to the sequence's one position.
  const int kv_lo = max(p_lo, window_lo(kv_len - 1, mask));
  if (kv_lo >= kv_hi) return;  // wholly before the window: combine_splits_kernel skips it
  const bool whole = kv_len <= split.part_tokens;
  const int G = hq / hkv;
  const int TG = D / VE;               // threads per token row (a power of two, <= 32)
  const int lanes = kDecThreads / TG;  // tokens per pass
  const int tid = threadIdx.x;
  const int sub = tid % TG, tl = tid / TG;

  __shared__ float s_p[kG][kDecChunk];
  __shared__ float s_m[kG], s_l[kG], s_corr[kG];
  __shared__ float red[kDecThreads * VE * kG];  // [lanes][kG][D] at the end

  float q[kG][VE];
#pragma unroll
  for (int g = 0; g < kG; ++g) {
    if (g < G) {
      load16(query + (size_t(q0) * hq + size_t(h) * G + g) * D + sub * VE, q[g]);
#pragma unroll
      for (int e = 0; e < VE; ++e) q[g][e] *= scale;
    } else {
#pragma unroll
      for (int e = 0; e < VE; ++e) q[g][e] = 0.f;
    }
  }
  float acc[kG][VE];
#pragma unroll
  for (int g = 0; g < kG; ++g)
#pragma unroll
    for (int e = 0; e < VE; ++e) acc[g][e] = 0.f;
  if (tid < kG) {
    s_m[tid] = -INFINITY;
    s_l[tid] = 0.f;
  }
  const int32_t* table = block_tables + size_t(b) * max_blocks;
  const int warp = tid >> 5, lane = tid & 31;

  for (int c0 = kv_lo; c0 < kv_hi; c0 += kDecChunk) {
    const int n = min(kDecChunk, kv_hi - c0);
    // Scores: every lane runs the same number of passes (the shuffles need
    // the whole warp); tokens past n score -inf.
    for (int t = tl; t < kDecChunk; t += lanes) {
      float k[VE];
      const bool valid = t < n;
      if (valid) {
        const int tok = c0 + t;
        const size_t row = (size_t(table[tok / bs]) * bs + tok % bs) * hkv + h;
        load16(key_cache + row * D + sub * VE, k);
      } else {
#pragma unroll
        for (int e = 0; e < VE; ++e) k[e] = 0.f;
      }
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        float d = 0.f;
#pragma unroll
        for (int e = 0; e < VE; ++e) d = fmaf(q[g][e], k[e], d);
        for (int o = TG >> 1; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
        if (sub == 0) s_p[g][t] = valid ? soft_cap(d, mask) : -INFINITY;
      }
    }
    __syncthreads();
    // Online softmax: warp w takes rows w, w + 4, ...; each lane reads and
    // rewrites only its own columns.
    for (int g = warp; g < kG; g += kDecThreads / 32) {
      float mx = -INFINITY;
      for (int t = lane; t < n; t += 32) mx = fmaxf(mx, s_p[g][t]);
      mx = warp_max(mx);
      const float m_old = s_m[g];
      const float m_new = fmaxf(m_old, mx);
      float sum = 0.f;
      for (int t = lane; t < kDecChunk; t += 32) {
        const float p = t < n ? __expf(s_p[g][t] - m_new) : 0.f;
        s_p[g][t] = p;
        sum += p;
      }
      sum = warp_sum(sum);
      if (lane == 0) {
        const float corr = __expf(m_old - m_new);  // 0 on the first chunk
        s_corr[g] = corr;
        s_l[g] = s_l[g] * corr + sum;
        s_m[g] = m_new;
      }
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < kG; ++g) {
      const float corr = s_corr[g];
#pragma unroll
      for (int e = 0; e < VE; ++e) acc[g][e] *= corr;
    }
    for (int t = tl; t < n; t += lanes) {
      const int tok = c0 + t;
      const size_t row = (size_t(table[tok / bs]) * bs + tok % bs) * hkv + h;
      float v[VE];
      load16(value_cache + row * D + sub * VE, v);
#pragma unroll
      for (int g = 0; g < kG; ++g) {
        const float p = s_p[g][t];
#pragma unroll
        for (int e = 0; e < VE; ++e) acc[g][e] = fmaf(p, v[e], acc[g][e]);
      }
    }
    __syncthreads();  // s_p and s_corr consumed before the next chunk
  }
#pragma unroll
  for (int g = 0; g < kG; ++g)
#pragma unroll
    for (int e = 0; e < VE; ++e) red[(tl * kG + g) * D + sub * VE + e] = acc[g][e];
  __syncthreads();
  for (int i = tid; i < G * D; i += kDecThreads) {
    const int g = i / D, d = i - g * D;
    float o = 0.f;
    for (int l = 0; l < lanes; ++l) o += red[(l * kG + g) * D + d];
    const size_t hh = size_t(h) * G + g;
    if (whole) {
      const float l = s_l[g];
      out[(size_t(q0) * hq + hh) * D + d] = from_f<T>(o * (l > 0.f ? 1.f / l : 0.f));
    } else {
      split.acc[((size_t(part) * split.num_tokens + q0) * hq + hh) * D + d] = o;
    }
  }
  if (!whole && tid < G) {
    const size_t pi = (size_t(part) * split.num_tokens + q0) * hq + size_t(h) * G + tid;
    split.ml[2 * pi] = s_m[tid];
    split.ml[2 * pi + 1] = s_l[tid];
  }
}

// One block per (sequence, query head) of a split decode launch: the
// partitions' partial results weighted by exp(max_s - max), summed,
// normalised. A sequence's token sees KV [lo, kv_len) (lo = 0 without a
// window): partitions lo / part_tokens .. ceil(kv_len / part_tokens) - 1
// were written, each with at least one visible token.
template <typename T>
__global__ void combine_splits_kernel(T* __restrict__ out, const int32_t* __restrict__ cu_seqlens,
                                      const int32_t* __restrict__ seq_lens, int hq, int D, Mask mask, SplitKV split) {
  const int b = blockIdx.x, hh = blockIdx.y;
  const int t = cu_seqlens[b];
  if (cu_seqlens[b + 1] == t) return;
  const int parts = (seq_lens[b] + split.part_tokens - 1) / split.part_tokens;
  if (split.direct && parts == 1) return;  // written by the decode kernel itself
  const int first = window_lo(seq_lens[b] - 1, mask) / split.part_tokens;
  const size_t stride = size_t(split.num_tokens) * hq;
  const size_t base = size_t(t) * hq + hh;
  float mx = -INFINITY;
  for (int s = first; s < parts; ++s) mx = fmaxf(mx, split.ml[2 * (s * stride + base)]);
  float sum = 0.f;
  for (int s = first; s < parts; ++s) {
    const size_t i = s * stride + base;
    sum += __expf(split.ml[2 * i] - mx) * split.ml[2 * i + 1];
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.f;
    for (int s = first; s < parts; ++s) {
      const size_t i = s * stride + base;
      o = fmaf(__expf(split.ml[2 * i] - mx), split.acc[i * D + d], o);
    }
    out[base * D + d] = from_f<T>(o * inv);
  }
}

template <typename T>
__global__ void reshape_and_cache_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                         T* __restrict__ key_cache, T* __restrict__ value_cache,
                                         const int64_t* __restrict__ slots, int64_t row) {
  const int64_t t = blockIdx.x;
  const int64_t s = slots[t];
  if (s < 0) return;
  for (int64_t e = threadIdx.x; e < row; e += blockDim.x) {
    key_cache[s * row + e] = key[t * row + e];
    value_cache[s * row + e] = value[t * row + e];
  }
}

constexpr int kMaxD = CBSERVE_CUDA_MAX_HEAD_DIM;
constexpr size_t attention_smem(int64_t D) { return (2 * size_t(kTile) * (D + 1) + size_t(kRows) * D) * sizeof(float); }

// Tokens per partition of a split decode over block tables of max_tokens
// columns' worth: at least 64, at most kMaxSplits partitions.
int64_t part_tokens_for(int64_t max_tokens) {
  const int64_t per = (max_tokens + kMaxSplits - 1) / kMaxSplits;
  const int64_t tiles = (per + kTile - 1) / kTile;
  return tiles * kTile > 64 ? tiles * kTile : 64;
}

// Whether decode launches split the KV range (CBSERVE_CUDA_SPLIT_KV=0: never).
bool split_enabled() {
  static const bool on = [] {
    const char* v = getenv("CBSERVE_CUDA_SPLIT_KV");
    return v == nullptr || strcmp(v, "0") != 0;
  }();
  return on;
}

template <typename T, bool kSplit>
cudaError_t allow_smem() {
  // Raised once, to what the largest head_dim needs: no runtime call but the
  // launch itself per step, which keeps a captured CUDA graph free of them
  // (the attribute is per device: one executor process drives one GPU).
  static const cudaError_t raised = cudaFuncSetAttribute(
      paged_attention_kernel<T, kSplit>, cudaFuncAttributeMaxDynamicSharedMemorySize, int(attention_smem(kMaxD)));
  return raised;
}

// Whether decode launches take decode_attention_kernel (CBSERVE_CUDA_DECODE_KERNEL=0
// or cbserve_cuda_set_decode_kernel(0): never; the tests run both).
int& decode_kernel_flag() {
  static int on = [] {
    const char* v = getenv("CBSERVE_CUDA_DECODE_KERNEL");
    return v == nullptr || strcmp(v, "0") != 0 ? 1 : 0;
  }();
  return on;
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

template <typename T, int kG>
cudaError_t launch_decode_g(T* out, const T* q, const T* kc, const T* vc, const int32_t* bt, const int32_t* cu,
                            const int32_t* sl, int64_t B, int64_t max_blocks, int64_t hq, int64_t hkv, int64_t D,
                            int64_t bs, float scale, const Mask& mask, int64_t parts, const SplitKV& split,
                            cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(parts), static_cast<unsigned>(hkv), static_cast<unsigned>(B));
  decode_attention_kernel<T, kG><<<grid, kDecThreads, 0, stream>>>(out, q, kc, vc, bt, cu, sl, int(max_blocks), int(hq),
                                                                   int(hkv), int(D), int(bs), scale, mask, split);
  return cudaGetLastError();
}

// The decode kernel when the shapes suit it: rows of 16-byte pieces, a
// power-of-two number of them up to 32, a GQA group of at most 8, 16-byte
// aligned query and caches. Returns cudaErrorNotSupported otherwise (the
// caller falls back to paged_attention_kernel).
template <typename T>
cudaError_t launch_decode(void* out, const void* q, const void* kc, const void* vc, const int32_t* bt,
                          const int32_t* cu, const int32_t* sl, int64_t B, int64_t max_blocks, int64_t hq, int64_t hkv,
                          int64_t D, int64_t bs, float scale, const Mask& mask, float* workspace, int64_t num_tokens,
                          cudaStream_t stream) {
  constexpr int64_t VE = Vec16<T>::n;
  const int64_t G = hq / hkv, TG = D / VE;
  if (!decode_kernel_flag() || D % VE != 0 || TG > 32 || (TG & (TG - 1)) != 0 || G > 8 || !aligned16(q) ||
      !aligned16(kc) || !aligned16(vc))
    return cudaErrorNotSupported;
  const int64_t max_tokens = max_blocks * bs;
  int64_t part = max_tokens, parts = 1;
  SplitKV split{};
  if (workspace != nullptr) {
    part = part_tokens_for(max_tokens);
    parts = (max_tokens + part - 1) / part;
    const int64_t per_part = num_tokens * hq;
    split = SplitKV{workspace + 2 * parts * per_part, workspace, int(part), int(parts), int(num_tokens), 1};
  } else {
    split.part_tokens = int(max_tokens);
    split.num_tokens = int(num_tokens);
    split.direct = 1;
  }
  auto* o = static_cast<T*>(out);
  const auto* qp = static_cast<const T*>(q);
  const auto* kp = static_cast<const T*>(kc);
  const auto* vp = static_cast<const T*>(vc);
  cudaError_t err;
  if (G <= 1) {
    err = launch_decode_g<T, 1>(o, qp, kp, vp, bt, cu, sl, B, max_blocks, hq, hkv, D, bs, scale, mask, parts, split,
                                stream);
  } else if (G <= 2) {
    err = launch_decode_g<T, 2>(o, qp, kp, vp, bt, cu, sl, B, max_blocks, hq, hkv, D, bs, scale, mask, parts, split,
                                stream);
  } else if (G <= 4) {
    err = launch_decode_g<T, 4>(o, qp, kp, vp, bt, cu, sl, B, max_blocks, hq, hkv, D, bs, scale, mask, parts, split,
                                stream);
  } else {
    err = launch_decode_g<T, 8>(o, qp, kp, vp, bt, cu, sl, B, max_blocks, hq, hkv, D, bs, scale, mask, parts, split,
                                stream);
  }
  if (err != cudaSuccess || parts < 2) return err;
  const dim3 cgrid(static_cast<unsigned>(B), static_cast<unsigned>(hq));
  combine_splits_kernel<T><<<cgrid, 64, 0, stream>>>(o, cu, sl, int(hq), int(D), mask, split);
  return cudaGetLastError();
}

template <typename T>
int launch_attention(void* out, const void* q, const void* kc, const void* vc, const int32_t* bt, const int32_t* cu,
                     const int32_t* sl, int64_t B, int64_t max_blocks, int64_t hq, int64_t hkv, int64_t D, int64_t bs,
                     int64_t max_q_len, float scale, int64_t window, float softcap, float* workspace,
                     int64_t num_tokens, cudaStream_t stream) {
  if (B == 0 || max_q_len == 0) return 0;
  if (D <= 0 || D > CBSERVE_CUDA_MAX_HEAD_DIM || hkv <= 0 || hq % hkv != 0 || B > 65535 || hkv > 65535 || window < 0 ||
      !(softcap >= 0.f))
    return int(cudaErrorInvalidValue);
  // A window past any int position is no window (positions are int32).
  const Mask mask{window > INT32_MAX ? 0 : int(window), softcap};
  const int64_t G = hq / hkv;
  const int64_t tiles = (max_q_len * G + kRows - 1) / kRows;
  const size_t smem = attention_smem(D);
  const auto* qp = static_cast<const T*>(q);
  const auto* kp = static_cast<const T*>(kc);
  const auto* vp = static_cast<const T*>(vc);
  if (max_q_len == 1) {
    const cudaError_t err = launch_decode<T>(out, q, kc, vc, bt, cu, sl, B, max_blocks, hq, hkv, D, bs, scale, mask,
                                             workspace, num_tokens, stream);
    if (err != cudaErrorNotSupported) return int(err);
  }
  if (workspace == nullptr) {
    const cudaError_t raised = allow_smem<T, false>();
    if (raised != cudaSuccess) return int(raised);
    const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(hkv), static_cast<unsigned>(B));
    paged_attention_kernel<T, false><<<grid, kRows * 32, smem, stream>>>(static_cast<T*>(out), qp, kp, vp, bt, cu, sl,
                                                                         int(max_blocks), int(hq), int(hkv), int(D),
                                                                         int(bs), scale, mask, SplitKV{});
    return int(cudaGetLastError());
  }
  const int64_t part = part_tokens_for(max_blocks * bs);
  const int64_t parts = (max_blocks * bs + part - 1) / part;
  const int64_t per_part = size_t(num_tokens) * hq;
  const SplitKV split{workspace + 2 * parts * per_part, workspace, int(part), int(tiles), int(num_tokens)};
  const cudaError_t raised = allow_smem<T, true>();
  if (raised != cudaSuccess) return int(raised);
  const dim3 grid(static_cast<unsigned>(tiles * parts), static_cast<unsigned>(hkv), static_cast<unsigned>(B));
  paged_attention_kernel<T, true><<<grid, kRows * 32, smem, stream>>>(static_cast<T*>(out), qp, kp, vp, bt, cu, sl,
                                                                      int(max_blocks), int(hq), int(hkv), int(D),
                                                                      int(bs), scale, mask, split);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return int(err);
  const dim3 cgrid(static_cast<unsigned>(B), static_cast<unsigned>(hq));
  combine_splits_kernel<T><<<cgrid, 64, 0, stream>>>(static_cast<T*>(out), cu, sl, int(hq), int(D), mask, split);
  return int(cudaGetLastError());
}

template <typename T>
int launch_cache(const void* k, const void* v, void* kc, void* vc, const int64_t* slots, int64_t T_, int64_t row,
                 cudaStream_t stream) {
  if (T_ == 0 || row == 0) return 0;
  const int threads = row >= 256 ? 256 : 128;
  reshape_and_cache_kernel<T><<<unsigned(T_), threads, 0, stream>>>(
      static_cast<const T*>(k), static_cast<const T*>(v), static_cast<T*>(kc), static_cast<T*>(vc), slots, row);
  return int(cudaGetLastError());
}

}  // namespace

extern "C" int cbserve_paged_attention_cuda(int dtype, void* out, const void* query, const void* key_cache,
                                            const void* value_cache, const int32_t* block_tables,
                                            const int32_t* cu_seqlens_q, const int32_t* seq_lens, int64_t num_seqs,
                                            int64_t max_blocks, int64_t hq, int64_t hkv, int64_t head_dim,
                                            int64_t block_size, int64_t max_q_len, float scale, int64_t sliding_window,
                                            float softcap, float* workspace, int64_t num_tokens, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0:
      return launch_attention<float>(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, num_seqs,
                                     max_blocks, hq, hkv, head_dim, block_size, max_q_len, scale, sliding_window,
                                     softcap, workspace, num_tokens, s);
    case 1:
      return launch_attention<__nv_bfloat16>(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                                             num_seqs, max_blocks, hq, hkv, head_dim, block_size, max_q_len, scale,
                                             sliding_window, softcap, workspace, num_tokens, s);
    case 2:
      return launch_attention<__half>(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                                      num_seqs, max_blocks, hq, hkv, head_dim, block_size, max_q_len, scale,
                                      sliding_window, softcap, workspace, num_tokens, s);
    default: return int(cudaErrorInvalidValue);
  }
}

extern "C" int cbserve_reshape_and_cache_cuda(int dtype, const void* key, const void* value, void* key_cache,
                                              void* value_cache, const int64_t* slot_mapping, int64_t num_tokens,
                                              int64_t row_elems, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0: return launch_cache<float>(key, value, key_cache, value_cache, slot_mapping, num_tokens, row_elems, s);
    case 1:
      return launch_cache<__nv_bfloat16>(key, value, key_cache, value_cache, slot_mapping, num_tokens, row_elems, s);
    case 2: return launch_cache<__half>(key, value, key_cache, value_cache, slot_mapping, num_tokens, row_elems, s);
    default: return int(cudaErrorInvalidValue);
  }
}

extern "C" int64_t cbserve_paged_attention_workspace_floats(int64_t num_tokens, int64_t hq, int64_t head_dim,
                                                            int64_t max_blocks, int64_t block_size, int64_t max_q_len) {
  if (max_q_len != 1 || num_tokens == 0 || !split_enabled()) return 0;
  const int64_t tokens = max_blocks * block_size;
  const int64_t parts = (tokens + part_tokens_for(tokens) - 1) / part_tokens_for(tokens);
  if (parts < 2) return 0;
  return parts * num_tokens * hq * (head_dim + 2);
}

extern "C" void cbserve_cuda_set_decode_kernel(int on) { decode_kernel_flag() = on ? 1 : 0; }

extern "C" const char* cbserve_cuda_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }
