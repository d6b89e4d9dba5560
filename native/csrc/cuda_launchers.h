// C launcher API of the CUDA kernels (cuda_kernels.cu). Plain C types only:
// no torch and no CUDA headers, so ops.cpp can call it and the .cu file
// compiles standalone with `nvcc -c` (see `make native-cuda-check`).
// `stream` is a cudaStream_t. Each returns a cudaError_t value (0 = success).
#pragma once
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Largest head_dim the CUDA attention kernel supports.
#define CBSERVE_CUDA_MAX_HEAD_DIM 256

// dtype: 0 = float32, 1 = bfloat16, 2 = float16 (cbserve_native::DType).
// All pointers are device pointers; arguments must have been validated.
// workspace: cbserve_paged_attention_workspace_floats(...) floats of device
// memory when that is not 0 (a decode launch split over the KV range), else
// nullptr; num_tokens is the query's T. sliding_window > 0: a query at
// position p sees keys [p - sliding_window + 1, p]; softcap > 0: scaled
// scores s become softcap * tanh(s / softcap) (0: neither; as on the CPU).
int cbserve_paged_attention_cuda(int dtype, void* out, const void* query, const void* key_cache,
                                 const void* value_cache, const int32_t* block_tables, const int32_t* cu_seqlens_q,
                                 const int32_t* seq_lens, int64_t num_seqs, int64_t max_blocks, int64_t hq, int64_t hkv,
                                 int64_t head_dim, int64_t block_size, int64_t max_q_len, float scale,
                                 int64_t sliding_window, float softcap, float* workspace, int64_t num_tokens,
                                 void* stream);

// Floats of workspace a launch with these sizes needs (0: it does not split).
// CBSERVE_CUDA_SPLIT_KV=0 in the environment turns splitting off.
int64_t cbserve_paged_attention_workspace_floats(int64_t num_tokens, int64_t hq, int64_t head_dim, int64_t max_blocks,
                                                 int64_t block_size, int64_t max_q_len);

// Decode launches (max_q_len 1) take the decode kernel where the shapes
// allow (on = 1, the default unless CBSERVE_CUDA_DECODE_KERNEL=0), else the
// general one; per process, for tests and benchmarks.
void cbserve_cuda_set_decode_kernel(int on);

int cbserve_reshape_and_cache_cuda(int dtype, const void* key, const void* value, void* key_cache, void* value_cache,
                                   const int64_t* slot_mapping, int64_t num_tokens, int64_t row_elems, void* stream);

// Layer kernels of the GPU lean forward (cuda_layer_kernels.cu); every size
// is an argument, nothing is read back on the host (CUDA-graph safe).
// x, residual [rows, hidden] in place: add != 0: residual += x first; then
// x = weight * rms_norm(residual). add == 0: residual = x, then the norm.
int cbserve_add_rms_norm_cuda(int dtype, void* x, void* residual, const void* weight, int64_t rows, int64_t hidden,
                              float eps, int add, void* stream);

// qkv [T, (hq + 2 hkv) * head_dim]: rotary on q (written to q_out [T, hq,
// head_dim]) and k at positions[t] (cos / sin tables [P, head_dim]); k and v
// written to slot slots[t] of the caches (none where it is negative).
int cbserve_rotary_cache_cuda(int dtype, void* q_out, const void* qkv, const int32_t* positions, const void* cos,
                              const void* sin, void* key_cache, void* value_cache, const int32_t* slots,
                              int64_t num_tokens, int64_t hq, int64_t hkv, int64_t head_dim, void* stream);

// out [rows, inter] = silu(gate) * up, gate_up [rows, 2 * inter].
int cbserve_silu_and_mul_cuda(int dtype, void* out, const void* gate_up, int64_t rows, int64_t inter, void* stream);

// Samples one token per row of logits [num_rows, vocab] (rows row_stride
// elements apart) into out [num_rows] (int64), as executor/sampler.py does for
// rows without logit processing; params [5, num_rows] float32: temperature
// (<= 0: greedy), top_k (<= 0 or >= vocab: off), top_p (off outside (0, 1)),
// min_p (<= 0: off), the uniform draw u in [0, 1). cuda_sampling.cu.
int cbserve_sample_cuda(int dtype, const void* logits, int64_t row_stride, int64_t num_rows, int64_t vocab,
                        const float* params, int64_t* out, void* stream);

const char* cbserve_cuda_error_string(int err);

#ifdef __cplusplus
}
#endif
