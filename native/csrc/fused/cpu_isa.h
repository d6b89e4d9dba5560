// The instruction set native._fused's vector code is compiled for (function
// target attributes, no build-wide -m flags) and the run-time check that
// guards every call into it. Shared by fused_ops.cpp and the linear kernels.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#define CB_FUSED_X86 1
#define CB_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
#else
#define CB_FUSED_X86 0
#endif

namespace cbserve_fused {

// Whether this CPU runs CB_AVX512BF16 code.
inline bool has_avx512_bf16() {
#if CB_FUSED_X86
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

}  // namespace cbserve_fused
