// compat.h: one source for CUDA and HIP (no torch in here).
//
// What differs between the vendors, in one place:
//   - HAB_WARP_SIZE: lanes per warp/wavefront, exact in the device pass (32 on NVIDIA, 64 on
//     gfx9, 32 on gfx10+ unless -mwavefrontsize64). The HIP host pass always sees 64, so host
//     code asks the device at run time (hab_runtime_warp_size in decode.cu) and picks the kernel
//     instantiation; a kernel instantiated for the other warp size compiles to nothing.
//   - shuffles: hab_shfl_xor (CUDA *_sync with a full mask, HIP without masks).
//   - 16-bit float storage is raw uint16_t everywhere; HabHalf / HabBf16 convert explicitly,
//     so torch's __*_NO_HALF_CONVERSIONS__ flags do not matter.
//   - feature macros, device pass only: HAB_HAS_MMA_SYNC (sm_80+: mma.sync m16n8k16),
//     HAB_HAS_MFMA (gfx908/gfx90a/gfx940..942: v_mfma_f32_16x16x16 f16), HAB_HAS_MFMA_BF16
//     (gfx90a/gfx940..942: the bf16_1k form). Neither: plain FMAs.
#pragma once

#include <stdint.h>

#if defined(__HIP_PLATFORM_AMD__) || defined(__HIPCC__) || defined(USE_ROCM)
#define HAB_HIP 1
#include <hip/hip_runtime.h>
#include <hip/hip_fp16.h>
typedef hipStream_t hab_stream_t;
typedef hipError_t hab_error_t;
#define hab_success hipSuccess
#define hab_get_last_error hipGetLastError
#define hab_error_string hipGetErrorString
#define hab_func_set_max_dynamic_smem(f, bytes) \
  hipFuncSetAttribute(reinterpret_cast<const void*>(f), hipFuncAttributeMaxDynamicSharedMemorySize, (bytes))
#define hab_get_device hipGetDevice
#define hab_occupancy(n, f, threads, bytes) \
  hipOccupancyMaxActiveBlocksPerMultiprocessor((n), reinterpret_cast<const void*>(f), (threads), (bytes))
#else
#define HAB_CUDA 1
#include <cuda_runtime.h>
#include <cuda_fp16.h>
typedef cudaStream_t hab_stream_t;
typedef cudaError_t hab_error_t;
#define hab_success cudaSuccess
#define hab_get_last_error cudaGetLastError
#define hab_error_string cudaGetErrorString
#define hab_func_set_max_dynamic_smem(f, bytes) \
  cudaFuncSetAttribute((f), cudaFuncAttributeMaxDynamicSharedMemorySize, (bytes))
#define hab_get_device cudaGetDevice
#define hab_occupancy(n, f, threads, bytes) cudaOccupancyMaxActiveBlocksPerMultiprocessor((n), (f), (threads), (bytes))
#endif

// ------------------------------------------------------------------ warp size, features
#if defined(HAB_HIP)
#if defined(__AMDGCN_WAVEFRONT_SIZE)
#define HAB_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE
#else
#define HAB_WARP_SIZE 64
#endif
#if defined(__HIP_DEVICE_COMPILE__)
#define HAB_DEVICE_PASS 1
#endif
#if defined(__gfx908__) || defined(__gfx90a__) || defined(__gfx940__) || \
    defined(__gfx941__) || defined(__gfx942__)
#define HAB_HAS_MFMA 1
#endif
#if defined(__gfx90a__) || defined(__gfx940__) || defined(__gfx941__) || defined(__gfx942__)
#define HAB_HAS_MFMA_BF16 1
#endif
#else  // CUDA
#define HAB_WARP_SIZE 32
#if defined(__CUDA_ARCH__)
#define HAB_DEVICE_PASS 1
#if __CUDA_ARCH__ >= 800
#define HAB_HAS_MMA_SYNC 1
#endif
#endif
#endif

#define HAB_HD __host__ __device__ __forceinline__
#define HAB_DEV __device__ __forceinline__

// Host side: the current device's compute capability as 10 * major + minor (90 on an
// H100/H200), asked of the runtime once per device (64 devices cached; any other is asked
// every time); 0 on HIP or without a device.
inline int hab_device_cc() {
#if defined(HAB_CUDA)
  static int known[64] = {};  // 0: not asked yet
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return 0;
  if (dev >= 0 && dev < 64 && known[dev]) return known[dev];
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
    return 0;
  const int cc = 10 * major + minor;
  if (dev >= 0 && dev < 64) known[dev] = cc;
  return cc;
#else
  return 0;
#endif
}

// Host side: the most dynamic shared memory one block of the current device may use (the
// opt-in limit on NVIDIA: 227 KB on an H100/H200; the LDS on AMD/Hygon gfx9: 64 KB), asked
// once per device (64 cached); 0 without a device.
inline int hab_max_smem_per_block() {
  static int known[64] = {};
  int dev = 0, bytes = 0;
  if (hab_get_device(&dev) != hab_success) return 0;
  if (dev >= 0 && dev < 64 && known[dev]) return known[dev];
#if defined(HAB_HIP)
  if (hipDeviceGetAttribute(&bytes, hipDeviceAttributeMaxSharedMemoryPerBlock, dev) != hipSuccess) return 0;
#else
  if (cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess) return 0;
#endif
  if (dev >= 0 && dev < 64) known[dev] = bytes;
  return bytes;
}

// Host side: whether the current device runs mma.sync m16n8k16 (NVIDIA sm_80+; the device
// pass's HAB_HAS_MMA_SYNC), for kernels that exist only there.
inline bool hab_device_has_mma_sync() { return hab_device_cc() >= 80; }

// Programmatic dependent launch (NVIDIA sm_90+; no-ops elsewhere). A kernel launched with
// the programmatic-serialization attribute may start before the previous kernel of its
// stream ends: it must call hab_gdc_wait() before reading what that kernel wrote (the
// wait returns once the whole previous grid has finished and its writes are visible).
// hab_gdc_launch_dependents() in the previous kernel lets the dependent grid be scheduled
// as soon as every program has made the call (without it: as the programs exit).
HAB_DEV void hab_gdc_wait() {
#if defined(HAB_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
HAB_DEV void hab_gdc_launch_dependents() {
#if defined(HAB_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}

// 2^x in one instruction on NVIDIA (ex2.approx.ftz: a result below 2^-126 flushes to 0, far
// under a 16-bit P's resolution; exp2f adds a range fix-up for denormal results). For the
// softmax's P and rescale factors, whose arguments are <= a small bound or -inf.
#if defined(HAB_CUDA)
HAB_DEV float hab_ex2_ftz(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
#endif

// ------------------------------------------------------------------ shuffles
template <typename T>
HAB_DEV T hab_shfl_xor(T v, int lane_mask) {
#if defined(HAB_HIP)
  return __shfl_xor(v, lane_mask);
#else
  return __shfl_xor_sync(0xffffffffu, v, lane_mask);
#endif
}

// Reductions over the WIDTH lanes of an aligned group (WIDTH a power of two <= WARP).
template <int WIDTH>
HAB_DEV float hab_group_max(float v) {
#pragma unroll
  for (int m = WIDTH / 2; m > 0; m >>= 1) v = fmaxf(v, hab_shfl_xor(v, m));
  return v;
}
template <int WIDTH>
HAB_DEV float hab_group_sum(float v) {
#pragma unroll
  for (int m = WIDTH / 2; m > 0; m >>= 1) v += hab_shfl_xor(v, m);
  return v;
}

HAB_DEV void hab_syncwarp() {
#if defined(HAB_HIP)
  __builtin_amdgcn_wave_barrier();
#else
  __syncwarp();
#endif
}

// ------------------------------------------------------------------ float bits
HAB_DEV float hab_bits_to_float(uint32_t u) { return __uint_as_float(u); }
HAB_DEV uint32_t hab_float_to_bits(float f) { return __float_as_uint(f); }

// fp16 and bf16, both stored as raw uint16_t.
struct HabHalf {
  static constexpr int kCode = 0;
  HAB_DEV static float to_float(uint16_t b) { return __half2float(__ushort_as_half(b)); }
  HAB_DEV static uint16_t from_float(float f) { return __half_as_ushort(__float2half_rn(f)); }
};

struct HabBf16 {
  static constexpr int kCode = 1;
  HAB_DEV static float to_float(uint16_t b) { return hab_bits_to_float(uint32_t(b) << 16); }
  // round to nearest even, NaN stays NaN (same as torch's float -> bfloat16)
  HAB_DEV static uint16_t from_float(float f) {
    uint32_t u = hab_float_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x0040u);
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
};

HAB_DEV uint32_t hab_pack2(uint16_t lo, uint16_t hi) { return uint32_t(lo) | (uint32_t(hi) << 16); }

// Two floats rounded to nearest even into one word of two KIND values, lo in the low half.
// On NVIDIA sm_80+ one cvt.rn.{f16,bf16}x2.f32 for the pair (the bf16 bit arithmetic of
// from_float is ~6 instructions an element); the same bits as two from_float calls, except
// that a NaN becomes the canonical quiet NaN.
template <typename KIND>
HAB_DEV uint32_t hab_pack2f(float lo, float hi) {
#if defined(HAB_CUDA) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  uint32_t r;
  if (KIND::kCode == HabBf16::kCode) asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  else asm("cvt.rn.f16x2.f32 %0, %1, %2;\n" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
#else
  return hab_pack2(KIND::from_float(lo), KIND::from_float(hi));
#endif
}

HAB_HD int64_t hab_cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Element i of an index tensor that is int32 or int64 (is_int64).
HAB_DEV int64_t hab_load_index(const void* p, int is_int64, int64_t i) {
  return is_int64 ? static_cast<const int64_t*>(p)[i] : int64_t(static_cast<const int32_t*>(p)[i]);
}
