// GGUF blocks times int8 activations with integer dot products (AVX512-VNNI),
// shared by avx512_linear (bf16 x and y, AVX512-BF16 CPUs) and gguf_linear
// (fp32 or bf16 x and y, CPUs without AVX512-BF16: Ice Lake, Cascade Lake).
//
// x is rounded per 32-wide k-block to integers with one fp32 scale each,
// x̂ = dx * q (dx = max|x| / L, q = rne(x * L / max|x|)), as llama.cpp's
// Q8_0 activations, and each tile's products are integer dot
// products: vpdpbusd of the 4-bit (Q6_K: 6-bit) unsigned weights against
// int8 q (L = 127) for Q4_1 / Q4_K / Q6_K, vpdpwssd of Q8_0's int8 weights
// against int16 q (L = 32767). Each k-block's integer sums are then scaled
// by the weights' d (and the m term, m * dx * Σq) in fp32. So the sums are
// w · x̂ with the blocks' exact w, up to fp32 rounding; the caller's
// epilogue (bias, activation, output rounding) takes them from there.
// docs/quantization.md states the bounds.
#pragma once

#include <cstdint>
#include <string>

#include "gguf_tiles.h"

namespace cbserve_fused {

// Whether this CPU runs the integer kernels (AVX512-VNNI, with or without
// AVX512-BF16) for avx512_linear's and gguf_linear's calls over blocks.
bool avx512_int8_supported();

// How avx512_linear (up to int8_blocks::kMaxRows rows) and gguf_linear
// (every call) multiply GGUF blocks, process-wide: "bf16" (the default: the
// blocks expand to the model's weights; avx512_linear then equals the bf16
// model, gguf_linear the fp32 or bf16 one, bit for bit) or "int8" (the
// integer kernels below, where avx512_int8_supported; the expansion
// elsewhere).
void set_block_activations(const std::string& kind);
std::string block_activations();

namespace int8_blocks {

// Rows up to which avx512_linear takes the integer kernels (above, its bf16
// dot products keep up); gguf_linear takes them at every row count.
constexpr int64_t kMaxRows = 16;

// The process-wide switch (block_activations "int8"), off by default.
void set_enabled(bool on);
bool enabled();

// Whether a call of M rows takes the integer kernels: int8 activations on,
// M <= max_rows (the caller's limit), and a CPU with AVX512-VNNI (has_avx512_vnni).
bool takes(int64_t M, int64_t max_rows = kMaxRows);

// Receives the fp32 sums of rows [m0, m0 + rows) against feature blocks
// [nb, nb + nv), `sums` [rows][nv][16], from the worker thread that made
// them (each output once). A (gate, up) pair of amx_pack_gate_up's order is
// one call (nb even, nv = 2) wherever nblocks is even.
using Store = void (*)(const void* ctx, int64_t m0, int rows, int64_t nb, int nv, const float* sums);

// Every row of x ([M, K] fp32, or bf16 bits with `bf16_x`; K = 32 * kblocks)
// against the blocks `src` (format fmt, nblocks feature blocks of 16), the
// sums handed to store(ctx, ...). Callers check takes(M, their limit). x is
// quantized into a buffer of the calling thread, kept for its next call:
// M * K bytes (twice that against Q8_0), bounded by the step's token budget.
void multiply(const void* x, bool bf16_x, int64_t M, int64_t K, gguf_tiles::Fmt fmt, const uint8_t* src,
              int64_t nblocks, int64_t kblocks, Store store, const void* ctx);

}  // namespace int8_blocks
}  // namespace cbserve_fused
