// The instruction set native._fused's vector code is compiled for (function
// target attributes, no build-wide -m flags) and the run-time check that
// guards every call into it. Shared by fused_ops.cpp and the linear kernels.
#pragma once

#if defined(__x86_64__)
#include <immintrin.h>
#define CB_FUSED_X86 1
// Plain AVX-512 (helpers that CB_AVX512BF16 and CB_AVX512VNNI code inline:
// a callee's target must be a subset of its caller's).
#define CB_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define CB_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))
// Integer dot products (int8_blocks.cpp): no AVX512-BF16, so that Ice Lake
// and Cascade Lake run them as well as Zen 4 and Sapphire Rapids.
#define CB_AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#define CB_AVX2 __attribute__((target("avx2,fma")))
#else
#define CB_FUSED_X86 0
#endif

#include <cstdlib>
#include <cstring>

namespace cbserve_fused {

// The highest instruction set the environment allows: CBSERVE_NATIVE_ISA
// (generic | avx2 | avx512 | amx), the same variable native._C's dispatch
// reads, so one setting forces both extensions down. -1 = generic (no vector
// kernel), 0 = AVX2, 2 = AVX-512, 3 = no cap.
inline int isa_cap() {
  static const int cap = [] {
    const char* env = std::getenv("CBSERVE_NATIVE_ISA");
    if (env == nullptr || *env == 0) return 3;
    if (std::strcmp(env, "generic") == 0) return -1;
    if (std::strcmp(env, "avx2") == 0) return 0;
    if (std::strcmp(env, "avx512") == 0) return 2;
    return 3;
  }();
  return cap;
}

// Whether this CPU runs CB_AVX512BF16 code (and the environment allows it).
inline bool has_avx512_bf16() {
#if CB_FUSED_X86
  static const bool ok = isa_cap() >= 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return ok;
#else
  return false;
#endif
}

// Whether this CPU runs CB_AVX512VNNI code (integer dot products), with or
// without AVX512-BF16.
inline bool has_avx512_vnni() {
#if CB_FUSED_X86
  static const bool ok = isa_cap() >= 2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
  return ok;
#else
  return false;
#endif
}

}  // namespace cbserve_fused
