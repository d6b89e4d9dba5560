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

// Where a split launch writes its partial results: for partition s, query
// token t and query head hh, index i = (s * num_tokens + t) * hq + hh:
// ml[2i] = running max, ml[2i + 1] = sum of exponentials, acc[i * D + d].
struct SplitKV {
  float* acc;
  float* ml;
  int part_tokens;  // a multiple of kTile
  int row_tiles;    // blockIdx.x = partition * row_tiles + row tile
  int num_tokens;
};

template <typename T, bool kSplit>
__global__ void __launch_bounds__(kRows * 32)
    paged_attention_kernel(T* __restrict__ out, const T* __restrict__ query, const T* __restrict__ key_cache,
                           const T* __restrict__ value_cache, const int32_t* __restrict__ block_tables,
                           const int32_t* __restrict__ cu_seqlens, const int32_t* __restrict__ seq_lens, int max_blocks,
                           int hq, int hkv, int D, int bs, float scale, SplitKV split) {
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
  const int pos = ctx + i;  // this row's position; it sees KV [0, pos]
  const int last_row = min(rows, row0 + kRows) - 1;
  int kv_hi = ctx + last_row / G + 1;  // KV range any row of the block sees
  int kv_lo = 0;
  if (kSplit) {
    kv_lo = part * split.part_tokens;
    if (kv_lo >= kv_hi) return;  // past this sequence's context (uniform: before any barrier)
    kv_hi = min(kv_hi, kv_lo + split.part_tokens);
  }

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
    if (lane < n && t0 + lane <= pos) {
      const float* kr = Ks + lane * ld;
      float dot = 0.f;
      for (int d = 0; d < D; ++d) dot = fmaf(q_row[d], kr[d], dot);
      s = dot;
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

// One block per (sequence, query head) of a split decode launch: the
// partitions' partial results weighted by exp(max_s - max), summed,
// normalised. A sequence's token sees KV [0, kv_len): partitions
// 0 .. ceil(kv_len / part_tokens) - 1 were written, each with at least one
// visible token.
template <typename T>
__global__ void combine_splits_kernel(T* __restrict__ out, const int32_t* __restrict__ cu_seqlens,
                                      const int32_t* __restrict__ seq_lens, int hq, int D, SplitKV split) {
  const int b = blockIdx.x, hh = blockIdx.y;
  const int t = cu_seqlens[b];
  if (cu_seqlens[b + 1] == t) return;
  const int parts = (seq_lens[b] + split.part_tokens - 1) / split.part_tokens;
  const size_t stride = size_t(split.num_tokens) * hq;
  const size_t base = size_t(t) * hq + hh;
  float mx = -INFINITY;
  for (int s = 0; s < parts; ++s) mx = fmaxf(mx, split.ml[2 * (s * stride + base)]);
  float sum = 0.f;
  for (int s = 0; s < parts; ++s) {
    const size_t i = s * stride + base;
    sum += __expf(split.ml[2 * i] - mx) * split.ml[2 * i + 1];
  }
  const float inv = sum > 0.f ? 1.f / sum : 0.f;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.f;
    for (int s = 0; s < parts; ++s) {
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

template <typename T>
int launch_attention(void* out, const void* q, const void* kc, const void* vc, const int32_t* bt, const int32_t* cu,
                     const int32_t* sl, int64_t B, int64_t max_blocks, int64_t hq, int64_t hkv, int64_t D, int64_t bs,
                     int64_t max_q_len, float scale, float* workspace, int64_t num_tokens, cudaStream_t stream) {
  if (B == 0 || max_q_len == 0) return 0;
  if (D <= 0 || D > CBSERVE_CUDA_MAX_HEAD_DIM || hkv <= 0 || hq % hkv != 0 || B > 65535 || hkv > 65535)
    return int(cudaErrorInvalidValue);
  const int64_t G = hq / hkv;
  const int64_t tiles = (max_q_len * G + kRows - 1) / kRows;
  const size_t smem = attention_smem(D);
  const auto* qp = static_cast<const T*>(q);
  const auto* kp = static_cast<const T*>(kc);
  const auto* vp = static_cast<const T*>(vc);
  if (workspace == nullptr) {
    const cudaError_t raised = allow_smem<T, false>();
    if (raised != cudaSuccess) return int(raised);
    const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(hkv), static_cast<unsigned>(B));
    paged_attention_kernel<T, false><<<grid, kRows * 32, smem, stream>>>(static_cast<T*>(out), qp, kp, vp, bt, cu, sl,
                                                                         int(max_blocks), int(hq), int(hkv), int(D),
                                                                         int(bs), scale, SplitKV{});
    return int(cudaGetLastError());
  }
  const int64_t part = part_tokens_for(max_blocks * bs);
  const int64_t parts = (max_blocks * bs + part - 1) / part;
  const int64_t per_part = size_t(num_tokens) * hq;
  const SplitKV split{workspace + 2 * parts * per_part, workspace, int(part), int(tiles), int(num_tokens)};
  const cudaError_t raised = allow_smem<T, true>();
  if (raised != cudaSuccess) return int(raised);
  const dim3 grid(static_cast<unsigned>(tiles * parts), static_cast<unsigned>(hkv), static_cast<unsigned>(B));
  paged_attention_kernel<T, true><<<grid, kRows * 32, smem, stream>>>(
      static_cast<T*>(out), qp, kp, vp, bt, cu, sl, int(max_blocks), int(hq), int(hkv), int(D), int(bs), scale, split);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return int(err);
  const dim3 cgrid(static_cast<unsigned>(B), static_cast<unsigned>(hq));
  combine_splits_kernel<T><<<cgrid, 64, 0, stream>>>(static_cast<T*>(out), cu, sl, int(hq), int(D), split);
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
                                            int64_t block_size, int64_t max_q_len, float scale, float* workspace,
                                            int64_t num_tokens, void* stream) {
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case 0:
      return launch_attention<float>(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens, num_seqs,
                                     max_blocks, hq, hkv, head_dim, block_size, max_q_len, scale, workspace, num_tokens,
                                     s);
    case 1:
      return launch_attention<__nv_bfloat16>(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                                             num_seqs, max_blocks, hq, hkv, head_dim, block_size, max_q_len, scale,
                                             workspace, num_tokens, s);
    case 2:
      return launch_attention<__half>(out, query, key_cache, value_cache, block_tables, cu_seqlens_q, seq_lens,
                                      num_seqs, max_blocks, hq, hkv, head_dim, block_size, max_q_len, scale, workspace,
                                      num_tokens, s);
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

extern "C" const char* cbserve_cuda_error_string(int err) { return cudaGetErrorString(static_cast<cudaError_t>(err)); }
