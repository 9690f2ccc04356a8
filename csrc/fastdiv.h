// fastdiv.h: division by a divisor fixed for a whole program (the page size), as one
// multiply-high, an add and a shift. An int / int in a kernel is a ~25-instruction
// sequence (IABS, I2F, MUFU.RCP, F2I and fix-ups on sm_90); the decode staging divides
// each token index of every tile by the page size twice (block and slot), which was about
// a fifth of the split-N loop's instructions.
//
// Method (Granlund and Montgomery 1994, "round-up" variant): l = ceil(log2 d),
// m = floor(2^32 (2^l - d) / d) + 1; then n / d = (umulhi(m, n) + n) >> l for every
// 0 <= n < 2^31 (the sum stays below 2^32 there). d = 2^l gives m = 1 and umulhi = 0: a
// plain shift. Checked exhaustively over divisors and the boundary numerators by
// check_fastdiv.cpp (run in CI on the host compiler).
//
// No vendor header: usable from host code (the check) and from CUDA/HIP device code.
#pragma once

#include <stdint.h>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define HAB_FASTDIV_FN __host__ __device__ __forceinline__
#else
#define HAB_FASTDIV_FN inline
#endif

struct HabFastDiv {
  uint32_t d;  // divisor, 1 <= d < 2^31
  uint32_t m;  // magic multiplier
  uint32_t l;  // ceil(log2 d)

  HAB_FASTDIV_FN explicit HabFastDiv(int divisor) : d(uint32_t(divisor)), m(1), l(0) {
    while ((uint32_t(1) << l) < d) ++l;  // at most 31 steps, once per program
    m = uint32_t((uint64_t(1) << 32) * ((uint64_t(1) << l) - d) / d + 1);
  }
  // n / d for 0 <= n < 2^31
  HAB_FASTDIV_FN int div(int n) const {
    const uint32_t t = uint32_t((uint64_t(m) * uint32_t(n)) >> 32);
    return int((t + uint32_t(n)) >> l);
  }
  // n % d given q = div(n)
  HAB_FASTDIV_FN int mod(int n, int q) const { return n - q * int(d); }
};
