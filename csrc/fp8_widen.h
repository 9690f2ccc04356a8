// fp8_widen.h: fp8 cache codes (e4m3fn / e5m2) widened to 16-bit floats two at a time,
// exact, for GPUs without an fp8 conversion instruction (AMD/Hygon gfx9, NVIDIA before
// sm_89) and the loops that widen on every target (the shared-softmax decode loop).
//
// Method. A 32-bit word holds two codes a, b in the high bytes of its 16-bit halves
// (hab_fp8_spread: one byte permute). e5m2 is the upper byte of the fp16 with the same
// value (same exponent bias, subnormals included): the spread word is the fp16 pair.
// e4m3fn: sign to bit 15, exponent and mantissa shifted right by one into fp16's fields
// (one shift, one and-or a pair) give an fp16 whose value is the code's times 2^-8 (the
// biases differ by 8; an e4m3 subnormal lands on an fp16 subnormal, scaled the same way),
// and one packed fp16 multiply by 2^8 makes it exact. bf16: each fp16 converted to f32
// (exact) keeps its upper 16 bits (exact: an fp8 value has at most 4 significant bits).
// Instructions a pair (gfx9 ISA): fp16 e5m2 1, e4m3 4; bf16 e5m2 4, e4m3 7 (an element by
// an integer decode to float and a round to the 16-bit type took about 9.5 (fp16) and 15.5
// (bf16) an element).
//
// No vendor header: the host build (check_fp8.cpp, run in CI) runs the same integer
// steps, and the fp16 multiply and conversion in software; the device passes use the
// packed multiply (mul.rn.f16x2 / v_pk_mul_f16) and the hardware conversion, both exact
// here (a power-of-two factor on finite fp16 values that neither overflow nor underflow).
// NaN and infinity codes never reach a cache (the writes saturate): their widening is
// unspecified.
#pragma once

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define HAB_FP8W_FN __host__ __device__ __forceinline__
#else
#define HAB_FP8W_FN inline
#endif

// codes of bytes 2 HALF and 2 HALF + 1 of x into the high bytes of the low and high 16-bit
// halves (HALF 0: bytes 0, 1; HALF 1: bytes 2, 3), the low bytes zero: one byte permute on
// the GPUs (the selectors below; check_fp8.cpp checks them against the shifts of the host
// build). NVIDIA prmt(x, 0, s): nibble i of s picks result byte i from x's bytes 0-3 and
// the zero word's 4-7. AMD v_perm_b32(0, x, s): byte i of s picks from x's bytes 0-3, the
// zero word's 4-7, 0x0c a zero byte.
constexpr uint32_t HAB_FP8_SPREAD_SEL_NV0 = 0x1404u, HAB_FP8_SPREAD_SEL_NV1 = 0x3424u;
constexpr uint32_t HAB_FP8_SPREAD_SEL_AMD0 = 0x010c000cu, HAB_FP8_SPREAD_SEL_AMD1 = 0x030c020cu;

template <int HALF>
HAB_FP8W_FN uint32_t hab_fp8_spread(uint32_t x) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(x, 0u, HALF == 0 ? HAB_FP8_SPREAD_SEL_NV0 : HAB_FP8_SPREAD_SEL_NV1);
#elif defined(__HIP_DEVICE_COMPILE__)
  return __builtin_amdgcn_perm(0u, x, HALF == 0 ? HAB_FP8_SPREAD_SEL_AMD0 : HAB_FP8_SPREAD_SEL_AMD1);
#else
  if (HALF == 0) return ((x & 0xffu) << 8) | ((x & 0xff00u) << 16);
  return ((x >> 8) & 0xff00u) | (x & 0xff000000u);
#endif
}

// spread e4m3fn codes -> the fp16 pair of their values times 2^-8: the sign stays at bit
// 15, exponent and mantissa move one bit down. Two forms of the same bits (check_fp8.cpp
// compares them on every pair): a word shift and two masks (one LOP3 after the shift on
// NVIDIA), and a per-half arithmetic shift, which copies the sign into bit 14 for the mask
// to clear (one packed shift and an and on AMD).
HAB_FP8W_FN uint32_t hab_e4m3_div256_word(uint32_t s) { return (s & 0x80008000u) | ((s >> 1) & 0x3f803f80u); }
HAB_FP8W_FN uint32_t hab_e4m3_div256_halves(uint32_t s) {
#if defined(__HIP_DEVICE_COMPILE__)
  typedef short s16x2 __attribute__((ext_vector_type(2)));
  const uint32_t t = __builtin_bit_cast(uint32_t, __builtin_bit_cast(s16x2, s) >> s16x2{1, 1});
#else
  const uint32_t t = uint32_t(uint16_t(int16_t(uint16_t(s)) >> 1)) |
                     (uint32_t(uint16_t(int16_t(uint16_t(s >> 16)) >> 1)) << 16);
#endif
  return t & 0xbf80bf80u;
}
HAB_FP8W_FN uint32_t hab_e4m3_spread_to_f16_div256(uint32_t s) {
#if defined(__HIP_DEVICE_COMPILE__)
  return hab_e4m3_div256_halves(s);
#else
  return hab_e4m3_div256_word(s);
#endif
}

// software fp16 <-> float for finite values (the host build; exact on what it is given)
inline float hab_fp8w_f16_to_float_sw(uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  float v = e == 0 ? float(m) * (1.0f / 16777216.0f)  // m * 2^-24
                   : float(1024 + m) * (1.0f / 1024.0f);
  for (int i = 15; i < e; ++i) v *= 2.0f;
  for (int i = e; i < 15 && e != 0; ++i) v *= 0.5f;
  return (h & 0x8000u) ? -v : v;
}
inline uint16_t hab_fp8w_float_to_f16_sw(float v) {  // v exactly representable in fp16
  uint32_t bits;
  memcpy(&bits, &v, 4);
  const uint16_t sign = uint16_t((bits >> 16) & 0x8000u);  // -0 keeps its sign
  float a = sign ? -v : v;
  if (a == 0.f) return sign;
  int e = 15;
  while (a >= 2.0f && e < 30) { a *= 0.5f; ++e; }
  while (a < 1.0f && e > 1) { a *= 2.0f; --e; }
  if (a < 1.0f) return uint16_t(sign | uint16_t(a * 1024.0f));  // subnormal: a * 2^-14
  return uint16_t(sign | (e << 10) | uint16_t((a - 1.0f) * 1024.0f));
}

// the upper 16 bits of lo into the low half, those of hi into the high half: one byte
// permute (selectors as for the spread)
constexpr uint32_t HAB_UPPER_HALVES_SEL_NV = 0x7632u;        // prmt(lo, hi, s)
constexpr uint32_t HAB_UPPER_HALVES_SEL_AMD = 0x07060302u;   // v_perm_b32(hi, lo, s)
HAB_FP8W_FN uint32_t hab_upper_halves(uint32_t lo, uint32_t hi) {
#if defined(__CUDA_ARCH__)
  return __byte_perm(lo, hi, HAB_UPPER_HALVES_SEL_NV);
#elif defined(__HIP_DEVICE_COMPILE__)
  return __builtin_amdgcn_perm(hi, lo, HAB_UPPER_HALVES_SEL_AMD);
#else
  return (hi & 0xffff0000u) | (lo >> 16);
#endif
}

HAB_FP8W_FN uint32_t hab_fp8w_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#elif defined(__HIP_DEVICE_COMPILE__)
  return __builtin_bit_cast(uint32_t, f);
#else
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
#endif
}

// both halves of an fp16 pair times 2^8
HAB_FP8W_FN uint32_t hab_f16x2_mul256(uint32_t h) {
#if defined(__CUDA_ARCH__)
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(h), "r"(0x5c005c00u));
  return r;
#elif defined(__HIP_DEVICE_COMPILE__)
  typedef _Float16 f16x2 __attribute__((ext_vector_type(2)));
  f16x2 v = __builtin_bit_cast(f16x2, h);
  v = v * f16x2{_Float16(256.0f), _Float16(256.0f)};
  return __builtin_bit_cast(uint32_t, v);
#else
  const uint32_t lo = hab_fp8w_float_to_f16_sw(hab_fp8w_f16_to_float_sw(uint16_t(h)) * 256.0f);
  const uint32_t hi = hab_fp8w_float_to_f16_sw(hab_fp8w_f16_to_float_sw(uint16_t(h >> 16)) * 256.0f);
  return lo | (hi << 16);
#endif
}

// an fp16 pair -> the bf16 pair of the same values (values of at most 8 significant bits)
HAB_FP8W_FN uint32_t hab_f16x2_to_bf16x2(uint32_t h) {
  float lo, hi;
#if defined(__CUDA_ARCH__)
  asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.f32.f16 %0, l; cvt.f32.f16 %1, h; }\n"
      : "=f"(lo), "=f"(hi) : "r"(h));
#elif defined(__HIP_DEVICE_COMPILE__)
  typedef _Float16 f16x2 __attribute__((ext_vector_type(2)));
  const f16x2 v = __builtin_bit_cast(f16x2, h);
  lo = float(v.x);
  hi = float(v.y);
#else
  lo = hab_fp8w_f16_to_float_sw(uint16_t(h));
  hi = hab_fp8w_f16_to_float_sw(uint16_t(h >> 16));
#endif
  return hab_upper_halves(hab_fp8w_bits(lo), hab_fp8w_bits(hi));
}

// four codes (bytes 0..3 of x) -> 16-bit pairs: bytes 0, 1 into lo, bytes 2, 3 into hi, the
// lower byte in the lower half. E4M3: e4m3fn (else e5m2); BF16: bf16 (else fp16) values.
template <bool E4M3, bool BF16>
HAB_FP8W_FN void hab_fp8x4_widen(uint32_t x, uint32_t& lo, uint32_t& hi) {
  lo = hab_fp8_spread<0>(x);
  hi = hab_fp8_spread<1>(x);
  if (E4M3) {
    lo = hab_f16x2_mul256(hab_e4m3_spread_to_f16_div256(lo));
    hi = hab_f16x2_mul256(hab_e4m3_spread_to_f16_div256(hi));
  }
  if (BF16) {
    lo = hab_f16x2_to_bf16x2(lo);
    hi = hab_f16x2_to_bf16x2(hi);
  }
}
