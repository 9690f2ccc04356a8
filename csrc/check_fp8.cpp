// Host check of fp8_widen.h (built and run by scripts/ci_native_compile.sh): every pair of
// finite codes, at every byte position of the word, widens to the fp16 and bf16 bits of
// the code's value, computed here independently (the fp8 formats' definition, in double);
// the device passes' byte-permute selectors give the host's spread.
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "fp8_widen.h"

// the value of an fp8 code: MANT mantissa bits, exponent bias BIAS; NaN for e4m3fn's 0x7f
// / 0xff and e5m2's exponent 31 (codes a cache never holds)
static double fp8_value(uint8_t c, int mant, int bias) {
  const int exp_bits = 7 - mant, e = (c & 0x7f) >> mant, m = c & ((1 << mant) - 1);
  const bool e4m3 = mant == 3;
  if ((e4m3 && (c & 0x7f) == 0x7f) || (!e4m3 && e == (1 << exp_bits) - 1)) return NAN;
  const double v = e == 0 ? ldexp(double(m), 1 - bias - mant) : ldexp(double((1 << mant) + m), e - bias - mant);
  return (c & 0x80) ? -v : v;
}

static double f16_value(uint16_t h) {
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  const double v = e == 0 ? ldexp(double(m), -24) : ldexp(double(1024 + m), e - 25);
  return (h & 0x8000) ? -v : v;
}

static double bf16_value(uint16_t b) {
  const int e = (b >> 7) & 0xff, m = b & 0x7f;
  const double v = e == 0 ? ldexp(double(m), -133) : ldexp(double(128 + m), e - 134);
  return (b & 0x8000) ? -v : v;
}

template <bool E4M3, bool BF16>
static long check_format(const char* name) {
  long checked = 0;
  for (int a = 0; a < 256; ++a) {
    for (int b = 0; b < 256; ++b) {
      const double va = fp8_value(uint8_t(a), E4M3 ? 3 : 2, E4M3 ? 7 : 15);
      const double vb = fp8_value(uint8_t(b), E4M3 ? 3 : 2, E4M3 ? 7 : 15);
      if (isnan(va) || isnan(vb)) continue;
      // the pair at bytes (0, 1) and at bytes (2, 3), the other bytes holding other codes
      const uint32_t x = uint32_t(a) | (uint32_t(b) << 8) | (uint32_t(b ^ 0x5a) << 16) | (uint32_t(a ^ 0x33) << 24);
      const uint32_t y = uint32_t(b ^ 0x11) | (uint32_t(a ^ 0x22) << 8) | (uint32_t(a) << 16) | (uint32_t(b) << 24);
      uint32_t lo, hi, lo2, hi2;
      hab_fp8x4_widen<E4M3, BF16>(x, lo, hi);
      hab_fp8x4_widen<E4M3, BF16>(y, lo2, hi2);
      const uint16_t got[4] = {uint16_t(lo), uint16_t(lo >> 16), uint16_t(hi2), uint16_t(hi2 >> 16)};
      const double want[4] = {va, vb, va, vb};
      for (int i = 0; i < 4; ++i) {
        const double v = BF16 ? bf16_value(got[i]) : f16_value(got[i]);
        // -0.0 must stay negative zero
        if (v != want[i] || signbit(v) != signbit(want[i])) {
          fprintf(stderr, "%s: codes 0x%02x 0x%02x (slot %d) widened to 0x%04x = %.9g, want %.9g\n", name, a, b, i,
                  got[i], v, want[i]);
          exit(1);
        }
      }
      checked += 4;
    }
  }
  printf("%s: %ld widenings exact\n", name, checked);
  return checked;
}

// the byte permutes of the device passes, as their ISAs define them
static uint32_t prmt(uint32_t x, uint32_t y, uint32_t s) {  // NVIDIA prmt / __byte_perm, default mode
  const uint64_t v = uint64_t(x) | (uint64_t(y) << 32);
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) r |= uint32_t((v >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
  return r;
}
static uint32_t v_perm_b32(uint32_t src0, uint32_t src1, uint32_t s) {  // AMD, selectors 0-7 and 0x0c
  const uint64_t v = uint64_t(src1) | (uint64_t(src0) << 32);
  uint32_t r = 0;
  for (int i = 0; i < 4; ++i) {
    const uint32_t b = (s >> (8 * i)) & 0xff;
    if (b != 0x0c && b > 7) { fprintf(stderr, "selector byte 0x%02x not modelled\n", b); exit(1); }
    r |= uint32_t(b == 0x0c ? 0 : (v >> (8 * b)) & 0xff) << (8 * i);
  }
  return r;
}

static void check_spread_selectors() {
  for (uint64_t x = 0; x < (uint64_t(1) << 32); x += 65521) {  // a prime stride over every word
    const uint32_t w = uint32_t(x) ^ uint32_t(x >> 7);
    const uint32_t want[2] = {hab_fp8_spread<0>(w), hab_fp8_spread<1>(w)};
    const uint32_t nv[2] = {HAB_FP8_SPREAD_SEL_NV0, HAB_FP8_SPREAD_SEL_NV1};
    const uint32_t amd[2] = {HAB_FP8_SPREAD_SEL_AMD0, HAB_FP8_SPREAD_SEL_AMD1};
    for (int h = 0; h < 2; ++h) {
      if (prmt(w, 0u, nv[h]) != want[h] || v_perm_b32(0u, w, amd[h]) != want[h]) {
        fprintf(stderr, "spread selector %d wrong for 0x%08x\n", h, w);
        exit(1);
      }
    }
  }
  for (uint64_t x = 0; x < (uint64_t(1) << 32); x += 65521) {
    const uint32_t lo = uint32_t(x) * 2654435761u, hi = uint32_t(x) ^ 0x9e3779b9u;
    const uint32_t want = hab_upper_halves(lo, hi);
    if (prmt(lo, hi, HAB_UPPER_HALVES_SEL_NV) != want || v_perm_b32(hi, lo, HAB_UPPER_HALVES_SEL_AMD) != want) {
      fprintf(stderr, "upper-halves selector wrong for 0x%08x 0x%08x\n", lo, hi);
      exit(1);
    }
  }
  // the two forms of the e4m3 step on every spread pair of codes
  for (uint32_t ab = 0; ab < 65536; ++ab) {
    const uint32_t s = hab_fp8_spread<0>(ab);
    if (hab_e4m3_div256_word(s) != hab_e4m3_div256_halves(s)) {
      fprintf(stderr, "e4m3 step: word and per-half forms differ on 0x%08x\n", s);
      exit(1);
    }
  }
  printf("byte-permute selectors (NVIDIA prmt, AMD v_perm_b32) and the two e4m3 forms agree\n");
}

int main() {
  check_spread_selectors();
  check_format<true, false>("e4m3 -> fp16");
  check_format<false, false>("e5m2 -> fp16");
  check_format<true, true>("e4m3 -> bf16");
  check_format<false, true>("e5m2 -> bf16");
  return 0;
}
