// sm90.cuh: the Hopper (sm_90a) primitives of the native prefill, as inline PTX.
//
//   - mbarriers: init, arrive, the cp.async arrive (the barrier completes when the thread's
//     earlier cp.async copies have landed), parity wait
//   - cp.async 16-byte copies with zero fill, an L2 prefetch, 16-byte shared loads / stores
//   - fp8 (e4m3 / e5m2) codes widened to fp16 (cvt, sm_89+)
//   - wgmma: shared-memory matrix descriptors (128-byte swizzle), m64n256k16, m64n128k16, m64n64k16
//     with fp32 accumulators, A from shared memory (SS) or from registers (RS), B from
//     shared memory K-major (imm-trans-b 0) or MN-major (1); fence / commit / wait
//
// The instructions exist only in the sm_90a device pass (HAB_SM90A); in other passes the
// functions compile to nothing (a barrier wait traps), so a kernel that uses them compiles
// everywhere and runs only where it was built for (the host checks the GPU first).
//
// Shared-memory layout the descriptors describe (PTX ISA "Shared Memory Matrix Layout",
// canonical layouts with 128B swizzling, 16-bit elements): a tile of R rows x 128 channels
// is two panels of R rows x 64 channels (128 bytes a row), panel p at p * R * 128 bytes;
// 16-byte chunk c of row r of a panel sits at r * 128 + ((c ^ (r % 8)) * 16). Panels start
// on 1024-byte boundaries (the swizzle pattern repeats every 8 rows = 1024 bytes).
//   K-major operand (Q as A, K as B of S = Q K^T): rows are M / N, the 16 channels of a
//     k-step are 32 bytes inside a 128-byte row: start = panel(k / 64) + (k % 64) * 2,
//     SBO = 1024 (the next 8 rows), LBO unused.
//   MN-major operand (V as B of O = P V, rows = tokens = K, channels = N): a k-step is 16
//     tokens = 2048 bytes: start = tile + 16 * k_step * 128, LBO = R * 128 (the next 64
//     channels: the other panel), SBO = 1024 (the next 8 tokens).
#pragma once

#include "compat.h"

#if defined(HAB_CUDA) && defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define HAB_SM90A 1
#endif

namespace hab_sm90 {

HAB_DEV uint32_t smem_addr(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }

// A pointer from lane `src_lane` of the warp (two 32-bit shuffles).
HAB_DEV const uint8_t* shfl_ptr(const uint8_t* ptr, int src_lane) {
  const uint64_t u = reinterpret_cast<uint64_t>(ptr);
  const uint32_t lo = __shfl_sync(0xffffffffu, uint32_t(u), src_lane);
  const uint32_t hi = __shfl_sync(0xffffffffu, uint32_t(u >> 32), src_lane);
  return reinterpret_cast<const uint8_t*>((uint64_t(hi) << 32) | lo);
}

// Host: the current device into `dev`, and `kernel`'s opt-in dynamic shared memory set to
// `bytes` once a device (a bit of `configured`, the caller's static). nullptr or the
// error's text.
template <typename Kernel>
inline const char* opt_in_smem(Kernel kernel, int bytes, uint64_t& configured, int& dev) {
  if (cudaGetDevice(&dev) != cudaSuccess) return "no device";
  const uint64_t bit = uint64_t(1) << (dev & 63);
  if (!(configured & bit)) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e != cudaSuccess) return cudaGetErrorString(e);
    configured |= bit;
  }
  return nullptr;
}

// ------------------------------------------------------------------ mbarrier
HAB_DEV void mbar_init(uint64_t* bar, int count) {
#if defined(HAB_SM90A)
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(count));
#endif
}

HAB_DEV void mbar_arrive(uint64_t* bar) {
#if defined(HAB_SM90A)
  asm volatile(
      "{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(smem_addr(bar))
      : "memory");
#endif
}

// The barrier's arrival of this thread happens once its earlier cp.async copies land
// (.noinc: the arrival is one of the counted ones).
HAB_DEV void mbar_arrive_cp_async(uint64_t* bar) {
#if defined(HAB_SM90A)
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_addr(bar)) : "memory");
#endif
}

// Wait until the phase of parity `parity` has completed (a fresh barrier counts its
// preceding phase, parity 1, as completed).
HAB_DEV void mbar_wait(uint64_t* bar, uint32_t parity) {
#if defined(HAB_SM90A)
  asm volatile(
      "{\n.reg .pred done;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
#else
  __trap();
#endif
}

// ------------------------------------------------------------------ cp.async
// 16 bytes global -> shared; fill false: 16 zero bytes, nothing read (src must still be a
// valid address).
HAB_DEV void cp_async16(uint32_t dst, const void* src, bool fill) {
#if defined(HAB_SM90A)
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(fill ? 16 : 0)
               : "memory");
#endif
}

// Hint: the 128-byte line holding `p` into the L2 (no register written, no fault).
HAB_DEV void prefetch_l2(const void* p) {
#if defined(HAB_SM90A)
  asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p));
#endif
}

// 16 bytes of shared memory to / from four registers
HAB_DEV void ld_shared_v4(uint32_t addr, uint32_t (&w)[4]) {
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(addr) : "memory");
}
HAB_DEV void st_shared_v4(uint32_t addr, const uint32_t (&w)[4]) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(addr), "r"(w[0]), "r"(w[1]), "r"(w[2]), "r"(w[3])
               : "memory");
}

// two fp8 codes (low byte first) -> fp16x2, exact (every e4m3 / e5m2 value is an fp16)
HAB_DEV uint32_t fp8x2_to_f16x2(uint32_t codes, bool e5m2) {
  uint32_t r = 0u;
#if defined(HAB_SM90A)
  const uint16_t c = uint16_t(codes);
  if (e5m2) asm("cvt.rn.f16x2.e5m2x2 %0, %1;\n" : "=r"(r) : "h"(c));
  else asm("cvt.rn.f16x2.e4m3x2 %0, %1;\n" : "=r"(r) : "h"(c));
#else
  (void)codes;
  (void)e5m2;
#endif
  return r;
}

// One row of a bf16 tile in swizzled panels -> fp16 in place, scaled by the power of two
// 2^k that brings the row's largest finite |x| into [2^14, 2^15): exact for every element
// in fp16's normal range (elements below 2^-28 of the row's largest lose bits). Called by
// the 8 lanes of a row (all 32 lanes of the warp, 4 rows), each with its 16-byte chunk of
// panel 0 at `addr` and of panel p at addr + p * panel_bytes (NP panels). Returns 1 / 2^k;
// a zero or non-finite row keeps 2^k = 1 (its NaN / inf stay). The MLA decode's rows
// (9 panels); the prefill's 2-panel rows have their own loop (prefill_sm90_producer.cuh:
// widen_q, the same rule), which its register allocation prefers.
template <int NP>
HAB_DEV float widen_bf16_row(uint32_t addr, uint32_t panel_bytes) {
  uint32_t w[NP][4];  // the row's chunks stay in registers between the two passes
  float mx = 0.f;
#pragma unroll
  for (int p = 0; p < NP; ++p) {
    ld_shared_v4(addr + p * panel_bytes, w[p]);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      mx = fmaxf(mx, fabsf(hab_bits_to_float(w[p][k] << 16)));
      mx = fmaxf(mx, fabsf(hab_bits_to_float(w[p][k] & 0xffff0000u)));
    }
  }
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
  mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
  // k = 14 - exponent(mx), kept within float's normal powers
  const int e = int((hab_float_to_bits(mx) >> 23) & 0xff) - 127;
  const int k = mx > 0.f && mx <= 3.4e38f ? min(126, max(-126, 14 - e)) : 0;
  const float s = hab_bits_to_float(uint32_t(127 + k) << 23);
#pragma unroll
  for (int p = 0; p < NP; ++p) {
    uint32_t o[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const __half2 v =
          __floats2half2_rn(hab_bits_to_float(w[p][j] << 16) * s, hab_bits_to_float(w[p][j] & 0xffff0000u) * s);
      o[j] = *reinterpret_cast<const uint32_t*>(&v);
    }
    st_shared_v4(addr + p * panel_bytes, o);
  }
  return hab_bits_to_float(uint32_t(127 - k) << 23);
}

// Generic-proxy writes (cp.async, st.shared) seen by this thread become visible to its
// later async-proxy reads (wgmma operands).
HAB_DEV void fence_proxy_async() {
#if defined(HAB_SM90A)
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Named barriers (ids 1..15; 0 is __syncthreads): `threads` counts the arrivals of both
// sides, a multiple of 32.
HAB_DEV void named_sync(int id, int threads) {
#if defined(HAB_SM90A)
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
#endif
}
HAB_DEV void named_arrive(int id, int threads) {
#if defined(HAB_SM90A)
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
#endif
}

// ------------------------------------------------------------------ wgmma
// 128-byte-swizzle shared-memory matrix descriptor (PTX ISA "Matrix Descriptor Format").
HAB_DEV uint64_t desc_sw128(uint32_t addr, uint32_t lbo_bytes, uint32_t sbo_bytes) {
  return uint64_t((addr & 0x3FFFF) >> 4) | (uint64_t((lbo_bytes & 0x3FFFF) >> 4) << 16) |
         (uint64_t((sbo_bytes & 0x3FFFF) >> 4) << 32) | (uint64_t(1) << 62);
}

HAB_DEV void wgmma_fence() {
#if defined(HAB_SM90A)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
HAB_DEV void wgmma_commit() {
#if defined(HAB_SM90A)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
HAB_DEV void wgmma_wait() {
#if defined(HAB_SM90A)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}

// Keeps the compiler from moving accumulator registers across an in-flight wgmma.
template <int N>
HAB_DEV void fence_regs(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

template <int N>
HAB_DEV void fence_regs_u32(uint32_t (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(d[i])::"memory");
}

// Hand registers between the warpgroups of a program (all warps of a warpgroup execute it).
template <int REGS>
HAB_DEV void setmaxnreg_inc() {
#if defined(HAB_SM90A)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
#endif
}
template <int REGS>
HAB_DEV void setmaxnreg_dec() {
#if defined(HAB_SM90A)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
#endif
}

#define HAB_ACC64(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// D[64 x 128] (+)= A[64 x 16] B[16 x 128], A and B K-major in shared memory.
// IS_BF16: bf16 operands, else fp16. accumulate 0: D = A B.
template <bool IS_BF16>
HAB_DEV void wgmma_ss_m64n128k16(float (&d)[64], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#if defined(HAB_SM90A)
  if (IS_BF16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : HAB_ACC64(d)
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n"
        : HAB_ACC64(d)
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
#endif
}

#define HAB_ACC32(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

// D[64 x 64] (+)= A[64 x 16] B[16 x 64], A and B K-major in shared memory (32 accumulator
// registers: element 4 i + e is row r0 + 8 (e >> 1), column 8 i + 2 t + (e & 1)).
template <bool IS_BF16>
HAB_DEV void wgmma_ss_m64n64k16(float (&d)[32], uint64_t desc_a, uint64_t desc_b, int accumulate) {
#if defined(HAB_SM90A)
  if (IS_BF16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : HAB_ACC32(d)
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
        : HAB_ACC32(d)
        : "l"(desc_a), "l"(desc_b), "r"(accumulate));
  }
#endif
}

// D[64 x 128] += A[64 x 16] B[16 x 128], A K-major in shared memory, B MN-major in shared
// memory (imm-trans-b 1).
template <bool IS_BF16>
HAB_DEV void wgmma_ss_m64n128k16_tb(float (&d)[64], uint64_t desc_a, uint64_t desc_b) {
#if defined(HAB_SM90A)
  if (IS_BF16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 1;\n}\n"
        : HAB_ACC64(d)
        : "l"(desc_a), "l"(desc_b), "r"(1));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 1;\n}\n"
        : HAB_ACC64(d)
        : "l"(desc_a), "l"(desc_b), "r"(1));
  }
#endif
}

// D[64 x 128] += A[64 x 16] B[16 x 128], A in registers (the m64k16 fragment: 4 registers
// of 2 elements), B MN-major in shared memory (imm-trans-b 1).
template <bool IS_BF16>
HAB_DEV void wgmma_rs_m64n128k16_tb(float (&d)[64], const uint32_t (&a)[4], uint64_t desc_b) {
#if defined(HAB_SM90A)
  if (IS_BF16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : HAB_ACC64(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
        : HAB_ACC64(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  }
#endif
}

#define HAB_ACC128(d) \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
    "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), \
    "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), \
    "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), \
    "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), \
    "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), \
    "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
    "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), \
    "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), \
    "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), \
    "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
    "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), \
    "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), \
    "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
    "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), \
    "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])

// D[64 x 256] += A[64 x 16] B[16 x 256], B MN-major in shared memory (imm-trans-b 1); A
// in registers (RS, the m64k16 fragment) or K-major in shared memory (SS). 128 accumulator
// registers: element 4 i + e is row r0 + 8 (e >> 1), column 8 i + 2 t + (e & 1).
template <bool IS_BF16>
HAB_DEV void wgmma_rs_m64n256k16_tb(float (&d)[128], const uint32_t (&a)[4], uint64_t desc_b) {
#if defined(HAB_SM90A)
  if (IS_BF16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
        : HAB_ACC128(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %133, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 1;\n}\n"
        : HAB_ACC128(d)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(1));
  }
#endif
}

template <bool IS_BF16>
HAB_DEV void wgmma_ss_m64n256k16_tb(float (&d)[128], uint64_t desc_a, uint64_t desc_b) {
#if defined(HAB_SM90A)
  if (IS_BF16) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 1;\n}\n"
        : HAB_ACC128(d)
        : "l"(desc_a), "l"(desc_b), "r"(1));
  } else {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p, 1, 1, 0, 1;\n}\n"
        : HAB_ACC128(d)
        : "l"(desc_a), "l"(desc_b), "r"(1));
  }
#endif
}

// Two floats -> one register of two 16-bit values (lo in the low half), round to nearest
// (compat.h's hab_pack2f: one cvt on sm_90a)
template <bool IS_BF16>
HAB_DEV uint32_t pack2(float lo, float hi) {
  return IS_BF16 ? hab_pack2f<HabBf16>(lo, hi) : hab_pack2f<HabHalf>(lo, hi);
}

}  // namespace hab_sm90
