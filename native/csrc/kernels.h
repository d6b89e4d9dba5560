// Plain C++ interface between the torch-facing dispatcher (ops.cpp) and the
// per-ISA CPU kernels (cpu_kernels_*.cpp). No torch or std headers here on
// purpose: the ISA translation units are compiled for AVX-512 / AVX2 and must
// not instantiate any shared inline (COMDAT) code that the linker could pick
// for the rest of the library.
#pragma once
#include <stdint.h>

namespace cbserve_native {

// kFP8E5M2 (the upper byte of an IEEE half: 1 sign, 5 exponent, 2 mantissa
// bits) only ever appears as the KV cache's storage (AttnParams::kv_dtype),
// never as a query or an output.
enum DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2, kFP8E5M2 = 3 };

// Bytes per element of a storage dtype.
inline int64_t elem_size(int32_t dtype) { return dtype == kF32 ? 4 : dtype == kFP8E5M2 ? 1 : 2; }

// Vector width used for padding (the widest ISA: 16 fp32 lanes).
constexpr int kPad = 16;

struct AttnParams {
  void* out;                    // [T, Hq, D]
  const void* query;            // [T, Hq, D]
  const void* key_cache;        // [num_blocks, block_size, Hkv, D]
  const void* value_cache;      // [num_blocks, block_size, Hkv, D]
  const int32_t* block_tables;  // [B, max_blocks]
  const int32_t* cu_seqlens;    // [B + 1]
  const int32_t* seq_lens;      // [B]
  int64_t num_seqs;
  int64_t max_blocks;
  int64_t hq;
  int64_t hkv;
  int64_t head_dim;
  int64_t block_size;
  float scale;
  int32_t dtype;     // DType of query and out
  int32_t kv_dtype;  // DType of key_cache / value_cache: dtype, or kFP8E5M2
  // Decode scores may take the scaled query rows as bf16 (vdpbf16ps over
  // the bf16 K rows): set for the avx512 ISA on an AVX512-BF16 CPU with
  // bf16 query and cache and a power-of-two scale (the scaled rows are then
  // exact in bf16). Not on AMX CPUs, where it was no faster.
  bool bf16_decode_dots;
  // Sliding window: a query at position p sees keys (p - window, p]; 0 = none.
  int64_t window;
  // Attention-logit soft cap: a scaled score s becomes softcap * tanh(s /
  // softcap) before the softmax; 0 = none.
  float softcap;
};

// One unit of work: all query heads of KV heads [kv_head, kv_head + n_heads),
// for query tokens [q_begin, q_end) (relative to the sequence's first query
// token). Only decode items (attn_decode_impl) span more than one KV head:
// one token's K (or V) rows of all heads are adjacent in the cache, so
// reading them together streams whole blocks instead of strided slices.
struct AttnItem {
  int32_t seq;
  int32_t kv_head;
  int32_t q_begin;
  int32_t q_end;
  int32_t n_heads;
};

// Query rows (tokens x query heads) of an item.
inline int64_t item_rows(const AttnItem& it, int64_t group) {
  return int64_t(it.q_end - it.q_begin) * group * it.n_heads;
}

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// KV tokens per online-softmax step: whole cache blocks, at least 64 tokens
// for small items (decode) and 128 for big ones (prefill chunks), so the
// per-row softmax bookkeeping is amortised over several blocks.
inline int64_t kv_tile(int64_t block_size, int64_t rows) {
  const int64_t min_tokens = rows < 16 ? 64 : 128;
  return block_size >= min_tokens ? block_size : block_size * ((min_tokens + block_size - 1) / block_size);
}

// Decode path (attn_body.h, attn_decode_impl): items with at most
// kDecodeMaxRows rows (tokens x group heads, e.g. q_len 1-2) skip the tiled
// micro-GEMM path; they stream K/V straight from the cache, 16 tokens at a
// time, and keep an exact softmax over chunks of kDecodeChunk tokens (online
// rescaling only between chunks). 64 rather than 32: the per-chunk work
// (softmax reductions and rescaling, masks, offsets, the prefetcher's
// set-up) is paid half as often and the next chunk's prefetch runs further
// ahead; 128 was slower at batch 64. A two-pass variant (all scores, one
// softmax, then P.V) was slower: its single K-then-V prefetch stream does
// not keep as many lines in flight (docs/native.md).
// An item of all KV heads of a token (whole cache rows, read contiguously)
// takes the decode path up to kDecodeRowsCap rows: a group of at most 16 rows
// per KV head still goes through the group kernels one head at a time.
constexpr int64_t kDecodeMaxRows = 16;
constexpr int64_t kDecodeRowsCap = 32;
constexpr int64_t kDecodeChunk = 64;  // multiple of 16

// Whether an item takes the decode path (few query rows) rather than the tiled one.
inline bool is_decode_item(const AttnItem& it, int64_t group) {
  const int64_t rows = item_rows(it, group);
  return rows <= kDecodeMaxRows || (it.n_heads > 1 && rows <= kDecodeRowsCap);
}

// First key a query at position pos sees under a sliding window (0: none).
inline int64_t window_start(int64_t pos, int64_t window) { return window > 0 && pos >= window ? pos - window + 1 : 0; }

inline int64_t decode_scratch_floats(int64_t head_dim) {
  const int64_t dp = round_up(head_dim, kPad);
  // Q, Acc [rows, dp]; max, sum [rows]; S [rows, chunk]; K/V staging [16, dp];
  // int64 row offsets [2, chunk].
  return 2 * kDecodeRowsCap * dp + 2 * kDecodeRowsCap + kDecodeRowsCap * kDecodeChunk + 16 * dp + 4 * kDecodeChunk +
         4 * kPad;
}

// Floats of scratch memory a call needs whose tiled items have at most
// `max_rows` (tokens x group) rows, and any decode items (a tiled item has
// more than kDecodeMaxRows rows, so up to that there is none); the caller
// allocates it once per thread.
inline int64_t attn_scratch_floats(int64_t max_rows, int64_t head_dim, int64_t block_size) {
  if (max_rows <= kDecodeMaxRows) return decode_scratch_floats(head_dim);  // decode path only
  const int64_t kt = kv_tile(block_size, 1 << 30);
  const int64_t dp = round_up(head_dim, kPad), np = round_up(kt, kPad);
  const int64_t tiled = 2 * max_rows * dp + 3 * max_rows + max_rows * np + 2 * dp * np + 4 * kPad;
  // The AMX path (attn_amx.h): Acc [M, D], max/sum, S [Mpad, NP] fp32; Q, P
  // [Mpad, D / NP] and the K/V tiles [NP, D] bf16; one fp32 tile; KT row pointers.
  const int64_t mp = round_up(max_rows, 16), np32 = round_up(kt, 32);
  const int64_t amx =
      max_rows * dp + 2 * mp + mp * np32 + mp * dp / 2 + mp * np32 / 2 + np32 * dp + 256 + 2 * kt + 4 * kPad;
  const int64_t dec = decode_scratch_floats(head_dim);
  const int64_t big = tiled > amx ? tiled : amx;
  return big > dec ? big : dec;
}

struct CacheParams {
  const void* key;    // [T, Hkv, D]
  const void* value;  // [T, Hkv, D]
  void* key_cache;    // [num_blocks, block_size, Hkv, D]
  void* value_cache;
  const int64_t* slot_mapping;  // [T]
  int64_t row_bytes;            // Hkv * D * element size
};

// Runs one item. `next` (may be null) is the item this thread runs after it:
// a decode item prefetches the start of next's KV during its last chunk and
// returns true when it did; `prefetched` passes that on to the next call.
using AttnItemFn = bool (*)(const AttnParams&, const AttnItem& it, const AttnItem* next, bool prefetched,
                            float* scratch);

bool attn_item_generic(const AttnParams&, const AttnItem&, const AttnItem*, bool, float* scratch);
bool attn_item_avx2(const AttnParams&, const AttnItem&, const AttnItem*, bool, float* scratch);
bool attn_item_avx512(const AttnParams&, const AttnItem&, const AttnItem*, bool, float* scratch);
bool attn_item_amx(const AttnParams&, const AttnItem&, const AttnItem*, bool, float* scratch);
// dst[i] = src[i] (fp32 / bf16 / fp16 per `dtype`) as fp8 e5m2, rounded to
// nearest even, overflow to inf, NaN kept (bit-identical to torch's
// .to(torch.float8_e5m2)). The AVX-512 one only after the run-time CPU check.
void to_e5m2_generic(const void* src, int32_t dtype, uint8_t* dst, int64_t n);
void to_e5m2_avx512(const void* src, int32_t dtype, uint8_t* dst, int64_t n);
// Whether the ISA translation unit was compiled in (x86-64 with GCC/Clang).
bool have_avx2_kernels();
bool have_avx512_kernels();

}  // namespace cbserve_native
