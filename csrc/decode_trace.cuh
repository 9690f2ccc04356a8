// Diagnostic build only (-DHAB_DECODE_TRACE, scripts/decode_trace.py): %globaltimer stamps
// of each decode program's phases, TRACE_SLOTS words a program, written by its thread 0
// into a buffer the host sets (hab_decode_trace_set in decode_d128.cu). The library's build
// has none of this: HAB_DTRACE is empty.
#pragma once

#include "compat.h"

#if defined(HAB_DECODE_TRACE) && defined(HAB_CUDA)
namespace hab_decode {
constexpr int TRACE_SLOTS = 8;  // entry, prologue issued, tile 0 landed, loop end, exit, SM id, tiles
static __device__ unsigned long long* g_decode_trace;
HAB_DEV void decode_trace(int slot, unsigned long long value) {
  if (threadIdx.x != 0 || g_decode_trace == nullptr) return;
  const int64_t prog = (int64_t(blockIdx.z) * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  g_decode_trace[prog * TRACE_SLOTS + slot] = value;
}
HAB_DEV unsigned long long decode_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;\n" : "=l"(t));
  return t;
}
HAB_DEV unsigned long long decode_smid() {
  unsigned int s;
  asm volatile("mov.u32 %0, %%smid;\n" : "=r"(s));
  return s;
}
}  // namespace hab_decode
#define HAB_DTRACE(slot) hab_decode::decode_trace((slot), hab_decode::decode_now())
#define HAB_DTRACE_VALUE(slot, value) hab_decode::decode_trace((slot), (value))
#define HAB_DTRACE_SM(slot) hab_decode::decode_trace((slot), hab_decode::decode_smid())
#define HAB_DECODE_TRACE_SETTER                                                      \
  extern "C" const char* hab_decode_trace_set(unsigned long long* buf) {             \
    const cudaError_t e = cudaMemcpyToSymbol(hab_decode::g_decode_trace, &buf, sizeof(buf)); \
    return e == cudaSuccess ? nullptr : cudaGetErrorString(e);                        \
  }
#else
#define HAB_DTRACE(slot) \
  do {                   \
  } while (0)
#define HAB_DTRACE_VALUE(slot, value) \
  do {                                \
  } while (0)
#define HAB_DTRACE_SM(slot) \
  do {                      \
  } while (0)
#define HAB_DECODE_TRACE_SETTER
#endif
