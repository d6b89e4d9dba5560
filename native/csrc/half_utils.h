// Scalar fp16 / bf16 <-> fp32 conversions (internal linkage, header-only).
// Included by every CPU kernel translation unit; no std headers.
#pragma once
#include <stdint.h>

namespace {

static inline float cb_bits_to_f32(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
static inline uint32_t cb_f32_to_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}

static inline float cb_bf16_to_f32(uint16_t h) { return cb_bits_to_f32(uint32_t(h) << 16); }

// Round to nearest even; NaN stays NaN.
static inline uint16_t cb_f32_to_bf16(float f) {
  uint32_t u = cb_f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

static inline float cb_f16_to_f32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else {  // subnormal: normalise
      exp = 127 - 15 + 1;
      while ((man & 0x400u) == 0) {
        man <<= 1;
        exp--;
      }
      man &= 0x3ffu;
      u = sign | (exp << 23) | (man << 13);
    }
  } else if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  return cb_bits_to_f32(u);
}

// Round to nearest even, overflow to inf, NaN stays NaN.
static inline uint16_t cb_f32_to_f16(float f) {
  const uint32_t u = cb_f32_to_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t au = u & 0x7fffffffu;
  if (au > 0x7f800000u) return uint16_t(sign | 0x7e00u);
  if (au >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to >= 65520 -> inf
  if (au < 0x38800000u) {                                  // below the smallest normal half: subnormal or zero
    if (au < 0x33000000u) return uint16_t(sign);           // < 2^-25 rounds to 0
    const uint32_t e = au >> 23;
    const uint32_t m = (au & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126 - e;  // 14..24
    uint32_t r = m >> shift;
    const uint32_t rem = m & ((1u << shift) - 1);
    const uint32_t half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) r++;
    return uint16_t(sign | r);
  }
  uint32_t r = au - 0x38000000u;  // rebias exponent (127 - 15) << 23
  r = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;
  return uint16_t(sign | r);
}

// fp8 e5m2 is the upper byte of an IEEE half: widening is exact.
static inline float cb_e5m2_to_f32(uint8_t b) { return cb_f16_to_f32(uint16_t(uint16_t(b) << 8)); }

// Round to nearest even on the fp32 bits, overflow (>= 2^16 after rounding)
// to inf, NaN to 0x7f; the same bytes as torch's float8_e5m2 conversion.
static inline uint8_t cb_f32_to_e5m2(float f) {
  uint32_t u = cb_f32_to_bits(f);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint8_t r;
  if (u >= (143u << 23)) {  // |f| >= 65536 (or inf / NaN)
    r = u > 0x7f800000u ? 0x7f : 0x7c;
  } else if (u < (113u << 23)) {        // below the smallest normal (2^-14): the fp32 adder rounds
    const uint32_t magic = 134u << 23;  // 2^7: one e5m2 subnormal step is its last mantissa bit
    r = uint8_t(cb_f32_to_bits(cb_bits_to_f32(u) + cb_bits_to_f32(magic)) - magic);
  } else {
    u += 0xc8000000u + 0xfffffu + ((u >> 21) & 1u);  // rebias 127 -> 15, round half to even
    r = uint8_t(u >> 21);
  }
  return uint8_t(r | (sign >> 24));
}

static inline float cb_load_scalar(const void* p, int64_t i, int dtype) {
  if (dtype == 0) return static_cast<const float*>(p)[i];
  if (dtype == 3) return cb_e5m2_to_f32(static_cast<const uint8_t*>(p)[i]);
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  return dtype == 1 ? cb_bf16_to_f32(h) : cb_f16_to_f32(h);
}

static inline void cb_store_scalar(void* p, int64_t i, int dtype, float v) {
  if (dtype == 0) {
    static_cast<float*>(p)[i] = v;
  } else if (dtype == 3) {
    static_cast<uint8_t*>(p)[i] = cb_f32_to_e5m2(v);
  } else {
    static_cast<uint16_t*>(p)[i] = dtype == 1 ? cb_f32_to_bf16(v) : cb_f32_to_f16(v);
  }
}

}  // namespace
