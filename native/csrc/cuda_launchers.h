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
int cbserve_paged_attention_cuda(int dtype, void* out, const void* query, const void* key_cache,
                                 const void* value_cache, const int32_t* block_tables, const int32_t* cu_seqlens_q,
                                 const int32_t* seq_lens, int64_t num_seqs, int64_t max_blocks, int64_t hq, int64_t hkv,
                                 int64_t head_dim, int64_t block_size, int64_t max_q_len, float scale, void* stream);

int cbserve_reshape_and_cache_cuda(int dtype, const void* key, const void* value, void* key_cache, void* value_cache,
                                   const int64_t* slot_mapping, int64_t num_tokens, int64_t row_elems, void* stream);

const char* cbserve_cuda_error_string(int err);

#ifdef __cplusplus
}
#endif
