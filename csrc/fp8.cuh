// fp8 e4m3fn / e5m2 codes from float, with integer bit arithmetic (exact on every target,
// no hardware fp8 conversion needed). Same results as torch's
// x.div(scale).clamp(-max, max).to(float8_*): IEEE division, round to nearest even. The
// other way (codes to 16-bit floats, two at a time): fp8_widen.h.
#pragma once

#include "compat.h"

template <int MANT, int BIAS>
struct HabFp8Format {
  static constexpr int kMant = MANT;
  static constexpr int kBias = BIAS;
};
typedef HabFp8Format<3, 7> HabE4M3;   // max 448
typedef HabFp8Format<2, 15> HabE5M2;  // max 57344

HAB_DEV float hab_div_rn(float x, float y) {
#if defined(HAB_HIP)
  return x / y;  // HIP divides with IEEE rounding unless fast-math is on
#else
  return __fdiv_rn(x, y);
#endif
}

// code of saturate(x / scale); NaN -> 0x7F | sign
template <typename F>
HAB_DEV uint8_t hab_fp8_encode(float x, float scale) {
  constexpr int MANT = F::kMant, BIAS = F::kBias;
  constexpr float kMax = MANT == 3 ? 448.0f : 57344.0f;
  float y = hab_div_rn(x, scale);
  const bool is_nan = y != y;
  const uint32_t sign = (hab_float_to_bits(y) >> 24) & 0x80u;
  y = fminf(fmaxf(y, -kMax), kMax);
  const int32_t mag = int32_t(hab_float_to_bits(y) & 0x7fffffffu);
  // normal target: round the 23-bit mantissa to MANT bits, re-bias the exponent
  int32_t normal = (mag + ((1 << (22 - MANT)) - 1) + ((mag >> (23 - MANT)) & 1)) >> (23 - MANT);
  normal -= (127 - BIAS) << MANT;
  // subnormal target: round(|y| / 2^(1 - BIAS - MANT)) from the 24-bit significand
  const int32_t expo = mag >> 23;
  const int32_t significand = (mag & 0x7fffff) | 0x800000;
  int32_t shift = (23 - MANT + 1 - BIAS + 127) - expo;
  shift = shift < 1 ? 1 : (shift > 31 ? 31 : shift);
  const int32_t sub = (significand + (1 << (shift - 1)) - 1 + ((significand >> shift) & 1)) >> shift;
  int32_t code = expo >= 128 - BIAS ? normal : sub;
  if (is_nan) code = 0x7f;
  return uint8_t(uint32_t(code) | sign);
}
