// What the AMX code of both extensions shares: the LDTILECFG operand for
// eight 16 x 64-byte tiles (the only shape cbserve uses) and the request for
// the tile state. Used by the attention kernels (native._C: ops.cpp asks,
// attn_amx.h loads) and by amx_linear (native._fused). Internal linkage only:
// this header is also included by a translation unit compiled for AVX-512,
// whose code must never be picked by the linker for the rest of the library
// (that one defines CB_AMX_TILES_CONFIG_ONLY: no system headers, no syscall).
#pragma once

#include <stdint.h>

#if defined(__linux__) && !defined(CB_AMX_TILES_CONFIG_ONLY)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {
namespace cbserve_amx {

// The 64-byte operand of LDTILECFG (palette 1), every tile 16 rows x 64 bytes.
struct alignas(64) TileConfig16x64 {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
  uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
};

#ifndef CB_AMX_TILES_CONFIG_ONLY
// Linux keeps the AMX tile state off until a process asks for it
// (arch_prctl ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); torch's oneDNN
// asks too, and asking again is harmless.
inline bool request_tile_state() {
#if defined(__linux__) && defined(SYS_arch_prctl)
  constexpr int kArchReqXcompPerm = 0x1023;
  constexpr int kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}
#endif

}  // namespace cbserve_amx
}  // namespace
