// Host check of fastdiv.h (built and run by scripts/ci_native_compile.sh): for every
// divisor up to 4096 and a spread of larger ones, the quotient and remainder of every
// numerator below 2^16 and of numerators around each multiple of d up to 2^31 - 1
// (where a rounding error would first show) equal the hardware division.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "fastdiv.h"

static int check(int d, int n, long* checked) {
  const HabFastDiv f(d);
  const int q = f.div(n);
  ++*checked;
  if (q != n / d || f.mod(n, q) != n % d) {
    fprintf(stderr, "fastdiv wrong: %d / %d gave %d rem %d\n", n, d, q, f.mod(n, q));
    exit(1);  // the first wrong quotient is enough
  }
  return 0;
}

int main() {
  long checked = 0;
  int bad = 0;
  const int kMax = 2147483647;
  for (int d = 1; d <= 4096 + 512; ++d) {
    const int dd = d <= 4096 ? d : (kMax / (d - 4096 + 1));  // then divisors up to 2^30
    for (int n = 0; n < 65536; ++n) bad += check(dd, n, &checked);
    // around multiples k d near the top of the range and at powers of two
    for (int64_t k = int64_t(kMax) / dd; k > int64_t(kMax) / dd - 64 && k > 0; --k)
      for (int e = -1; e <= 1; ++e) {
        const int64_t n = k * dd + e;
        if (n >= 0 && n <= kMax) bad += check(dd, int(n), &checked);
      }
    for (int s = 16; s < 31; ++s)
      for (int e = -2; e <= 2; ++e) bad += check(dd, (1 << s) + e, &checked);
    bad += check(dd, kMax, &checked);
  }
  if (bad) return 1;
  printf("fastdiv: %ld quotients and remainders equal the hardware division\n", checked);
  return 0;
}
