// How fast can a decode-shaped grid stream a paged KV cache into shared memory on sm_90a,
// by the way the bytes are moved? No attention math: each program walks its partition's
// 64-token tiles (K and V, bshd pages of 16 slots in a random permutation, one KV head),
// lands each tile in a ring of shared-memory stages, touches a few words of it and frees
// the stage. The movers:
//   cpa      cp.async 16-byte copies by all 128 threads (the Triton and native decodes' way)
//   tma_page one bulk tensor copy a page (box 128 channels x 1 head x 16 slots = 4 KB),
//            issued by one thread, completion on an mbarrier (transaction bytes)
//   tma_row  one bulk tensor copy a token row (256 B), issued by 64 threads
// Each is timed at 2-4 stages. The L2 is cleared before every launch by a 256 MB memset
// ("write") or a read of a 256 MB buffer ("read"); CUDA-event median of REPS launches;
// 100% is a 2 GB device-to-device copy (bytes read + written) timed the same way.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -I csrc -DHAB_CUDA scripts/kv_stream_probe.cu -o kv_stream_probe
//   kv_stream_probe B CTX HKV PARTS [REPS]
//
// Also timed: cpa/sw (dense rows, 16-byte chunks XOR-swizzled; the others pad each row by
// 16 bytes), cpa+mma (the same loop with tensor-core work shaped like the native decode's
// at 16 query rows, MmaWork) and ws / ws+mma (warp-specialized: 4 warps stage with
// cp.async and mbarriers, 4 compute).
//
//   kv_stream_probe B CTX HKV PARTS REPS merge
// times instead what a split grid's merge costs on top of cpa+mma/sw: each program's
// (m, l, O[16][128] fp32) merged over its PARTS partitions either through a workspace and
// a second kernel (a programmatic dependent launch, the decodes' split path) or inside a
// thread-block cluster of the PARTS programs of one (sequence, head) through distributed
// shared memory (PARTS <= 16; above 8 a non-portable cluster size).
#include <cooperative_groups.h>
#include <cuda.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_check.h"
#include "tile_mma.cuh"

constexpr int D = 128, PAGE = 16, TILE = 64, THREADS = 128;
constexpr int ROW_BYTES = D * 2, TILE_BYTES = TILE * ROW_BYTES;  // one of K or V: 16 KB
// the cp.async movers' shared rows: 256 bytes + 16 of padding (ldmatrix without bank
// conflicts, as the native decode's Layout::LDK), so K or V of a tile is 17 KB there
constexpr int SROW = ROW_BYTES + 16, STILE = TILE * SROW;
// or (SW) dense 256-byte rows whose 16-byte chunk c sits at (c & 8) | ((c ^ row) & 7): each
// 128-byte line of the cache lands in one aligned 128-byte segment, and the 8 rows an
// ldmatrix reads hit 8 different bank groups
template <bool SW>
__device__ __forceinline__ int chunk_off(int row, int c) {
  return SW ? row * ROW_BYTES + 16 * ((c & 8) | ((c ^ row) & 7)) : row * SROW + 16 * c;
}

struct Args {
  const uint16_t* k;
  const uint16_t* v;
  const int* table;  // [B, ctx / PAGE]
  int ctx, hkv, parts, blocks_per_seq;
  float* out;  // [programs, THREADS]
  float* ws;   // merge: [programs][16 * D + 32] (O, m, l) of each partition
  uint16_t* o;  // merge: [B, hkv, 16, D] bf16, the merged rows
};

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* b, int n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(b)), "r"(n));
}
__device__ __forceinline__ void mbar_expect(uint64_t* b, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(b)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nW_%=:\nmbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n@!p bra W_%=;\n}\n" ::"r"(
          smem_u32(b)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void tma3(uint32_t dst, const CUtensorMap* map, int c0, int c1, int c2, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(
          dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(c2), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src) : "memory");
}

// the program's tiles: [t0, t1) of its sequence
__device__ __forceinline__ void tiles_of(const Args& a, int& t0, int& t1) {
  const int n_tiles = a.ctx / TILE, per = (n_tiles + a.parts - 1) / a.parts;
  t0 = min(n_tiles, int(blockIdx.z) * per);
  t1 = min(n_tiles, t0 + per);
}

// a few words of a landed tile (K or V), so the copies are consumed
__device__ __forceinline__ float touch(const uint8_t* tile) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(tile);
  return __uint_as_float(w[threadIdx.x] & 0x3fffffffu) + __uint_as_float(w[threadIdx.x + 2048] & 0x3fffffffu);
}

// Tensor-core work shaped like the native decode's at 16 query rows (G <= 16 padded to 16):
// warp w takes tokens 16w .. 16w + 15 of the tile: S = Q K^T over 128 channels (8 k-steps,
// 2 n-tiles: 16 mma, 8 ldmatrix.x4), 16 exps, P to bf16, O += P V (16 n-tiles of 8
// channels: 16 mma, 8 ldmatrix.x4.trans). Q is a register constant; the values are
// nonsense, only the instruction stream matters.
template <bool SW>
struct MmaWork {
  float o[16][4];
  uint32_t q[4];
  __device__ void init() {
    for (int i = 0; i < 16; ++i)
      for (int e = 0; e < 4; ++e) o[i][e] = 0.f;
    for (int e = 0; e < 4; ++e) q[e] = 0x3c003c00u ^ (threadIdx.x * 0x10001u);
  }
  __device__ __forceinline__ void run(const uint8_t* ks, const uint8_t* vs) {
#if defined(HAB_HAS_MMA_SYNC)  // the device pass (csrc/tile_mma.cuh: ldmatrix, mma.sync)
    typedef HabWarpTile<HabBf16, 32> Tile;
    const int lane = threadIdx.x % 32, w = (threadIdx.x / 32) % 4;
    float c[2][4] = {};
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      const int tok = 16 * w + (lane / 16) * 8 + lane % 8, ch = kk * 16 + ((lane / 8) & 1) * 8;
      uint32_t b[4];
      Tile::ldsm_x4<false>(b, reinterpret_cast<const uint16_t*>(ks + chunk_off<SW>(tok, ch / 8)));
#pragma unroll
      for (int n = 0; n < 2; ++n) hab_mma_m16n8k16<HabBf16>(c[n], q, {b[2 * n], b[2 * n + 1]});
    }
    uint32_t pa[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float x0 = exp2f(c[i / 2][2 * (i % 2)] * 1e-3f), x1 = exp2f(c[i / 2][2 * (i % 2) + 1] * 1e-3f);
      __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
      pa[i] = *reinterpret_cast<uint32_t*>(&h);
    }
#pragma unroll
    for (int ct = 0; ct < 8; ++ct) {
      const int tok = 16 * w + ((lane / 8) & 1) * 8 + lane % 8, ch = ct * 16 + (lane / 16) * 8;
      uint32_t b[4];
      Tile::ldsm_x4<true>(b, reinterpret_cast<const uint16_t*>(vs + chunk_off<SW>(tok, ch / 8)));
#pragma unroll
      for (int n = 0; n < 2; ++n) hab_mma_m16n8k16<HabBf16>(o[2 * ct + n], pa, {b[2 * n], b[2 * n + 1]});
    }
#endif
  }
  __device__ float sum() const {
    float s = 0.f;
    for (int i = 0; i < 16; ++i)
      for (int e = 0; e < 4; ++e) s += o[i][e];
    return s;
  }
};

// a thread's share of a tile's cp.async copies (NT threads take the tile: 16 a row)
template <int NT, bool SW>
__device__ __forceinline__ void stage_tile(const Args& a, const int* tab, int h, int t, uint8_t* ks, int ptid) {
  uint8_t* vs = ks + STILE;
  const int u = ptid % 16, r0 = ptid / 16;
#pragma unroll
  for (int pass = 0; pass < TILE * 16 / NT; ++pass) {
    const int r = r0 + (NT / 16) * pass, tok = t * TILE + r;
    const int64_t row = (int64_t(tab[tok / PAGE]) * PAGE + tok % PAGE) * a.hkv + h;
    cp16(smem_u32(ks + chunk_off<SW>(r, u)), a.k + row * D + 8 * u);
    cp16(smem_u32(vs + chunk_off<SW>(r, u)), a.v + row * D + 8 * u);
  }
}

// all 128 threads stage and (MMA) compute, one barrier a tile (the native decode's loop)
// merge epilogues of cpa_kernel: none; the workspace (then combine_kernel); the cluster
enum { EPI_NONE = 0, EPI_WS = 1, EPI_CLUSTER = 2 };
constexpr int PART_FLOATS = 16 * D + 32;  // one partition's O [16][D], m [16], l [16]

// The 4 warps' O fragments (16 rows x D each) added into one [16][D] fp32 partial in shared
// memory (the native decode's slice merge), with a made-up (m, l) a row; returns it.
template <bool SW>
__device__ float* merge_slices(const MmaWork<SW>& mw, uint8_t* sm) {
  float* wsm = reinterpret_cast<float*>(sm);  // [4][16][D]
  const int lane = threadIdx.x % 32, w = threadIdx.x / 32, g = lane / 4, t4 = lane % 4;
#pragma unroll
  for (int n = 0; n < 16; ++n)
#pragma unroll
    for (int e = 0; e < 4; e += 2)
      *reinterpret_cast<float2*>(wsm + (w * 16 + g + 8 * (e / 2)) * D + 8 * n + 2 * t4) =
          make_float2(mw.o[n][e], mw.o[n][e + 1]);
  __syncthreads();
  float* part = wsm + 4 * 16 * D;  // [16][D], then m [16], l [16]
  for (int i = threadIdx.x; i < 16 * D / 4; i += THREADS) {
    float4 x = reinterpret_cast<const float4*>(wsm)[i];
#pragma unroll
    for (int q = 1; q < 4; ++q) {
      const float4 y = reinterpret_cast<const float4*>(wsm + q * 16 * D)[i];
      x.x += y.x, x.y += y.y, x.z += y.z, x.w += y.w;
    }
    reinterpret_cast<float4*>(part)[i] = x;
  }
  if (threadIdx.x < 16) {
    part[16 * D + threadIdx.x] = float(blockIdx.z % 3);
    part[16 * D + 16 + threadIdx.x] = 1.f + threadIdx.x;
  }
  __syncthreads();
  return part;
}

// out[e] = sum_q w_q O_q[e] / sum_q w_q, w_q = l_q 2^(m_q - M), for 4 adjacent channels
// (row r = e / D) of `n` partials; part(q) points at partial q's [16 * D + 32] floats
template <class Part>
__device__ __forceinline__ void merge4(Part part, int n, int e, uint16_t* out) {
  const int r = e / D;
  float big = -INFINITY;
  for (int q = 0; q < n; ++q) big = fmaxf(big, part(q)[16 * D + r]);
  float acc[4] = {0.f, 0.f, 0.f, 0.f}, tot = 0.f;
  for (int q = 0; q < n; ++q) {
    const float* pq = part(q);
    const float w = pq[16 * D + 16 + r] * exp2f(pq[16 * D + r] - big);
    const float4 x = *reinterpret_cast<const float4*>(pq + e);
    acc[0] += w * x.x, acc[1] += w * x.y, acc[2] += w * x.z, acc[3] += w * x.w;
    tot += w;
  }
  const float inv = 1.f / tot;
  __nv_bfloat162 lo = __floats2bfloat162_rn(acc[0] * inv, acc[1] * inv);
  __nv_bfloat162 hi = __floats2bfloat162_rn(acc[2] * inv, acc[3] * inv);
  uint2 v;
  v.x = *reinterpret_cast<uint32_t*>(&lo);
  v.y = *reinterpret_cast<uint32_t*>(&hi);
  *reinterpret_cast<uint2*>(out + e) = v;
}

// the second kernel of EPI_WS: one block per (head, sequence), 4 channels a thread
__global__ void __launch_bounds__(512) combine_kernel(const Args a) {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  const int h = blockIdx.x, b = blockIdx.y, e = 4 * threadIdx.x;
  const int64_t seq_head = int64_t(b) * a.hkv + h;
  auto part = [&](int q) { return a.ws + ((int64_t(q) * gridDim.y + b) * gridDim.x + h) * PART_FLOATS; };
  merge4(part, a.parts, e, a.o + seq_head * 16 * D);
}

template <int STAGES, bool MMA, bool SW, int EPI = EPI_NONE>
__global__ void __launch_bounds__(THREADS) cpa_kernel(const Args a) {
  extern __shared__ __align__(1024) uint8_t sm[];
  if constexpr (EPI == EPI_WS) asm volatile("griddepcontrol.launch_dependents;\n" ::);
  const int h = blockIdx.x, b = blockIdx.y;
  int t0, t1;
  tiles_of(a, t0, t1);
  const int* tab = a.table + int64_t(b) * a.blocks_per_seq;
  auto issue = [&](int t, int s) {
    stage_tile<THREADS, SW>(a, tab, h, t, sm + s * 2 * STILE, threadIdx.x);
    asm volatile("cp.async.commit_group;\n" ::: "memory");
  };
  MmaWork<SW> mw;
  mw.init();
  float acc = 0.f;
  for (int i = 0; i < STAGES - 1; ++i) {
    if (t0 + i < t1) issue(t0 + i, i);
    else asm volatile("cp.async.commit_group;\n" ::: "memory");
  }
  for (int t = t0; t < t1; ++t) {
    const int s = (t - t0) % STAGES;
    asm volatile("cp.async.wait_group %0;\n" ::"n"(STAGES - 2) : "memory");
    __syncthreads();  // tile t landed for all; every thread is done with tile t - 1
    const int nt = t + STAGES - 1;
    if (nt < t1) issue(nt, (nt - t0) % STAGES);
    else asm volatile("cp.async.commit_group;\n" ::: "memory");
    if constexpr (MMA) mw.run(sm + s * 2 * STILE, sm + s * 2 * STILE + STILE);
    else acc += touch(sm + s * 2 * STILE) + touch(sm + s * 2 * STILE + STILE);
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");
  const int64_t prog = (int64_t(blockIdx.z) * gridDim.y + b) * gridDim.x + h;
  if constexpr (EPI == EPI_NONE) {
    a.out[prog * THREADS + threadIdx.x] = acc + mw.sum();
  } else {
    __syncthreads();  // every warp is done with the stages
    float* part = merge_slices(mw, sm);
    if constexpr (EPI == EPI_WS) {
      float4* dst = reinterpret_cast<float4*>(a.ws + prog * PART_FLOATS);
      for (int i = threadIdx.x; i < PART_FLOATS / 4; i += THREADS) dst[i] = reinterpret_cast<const float4*>(part)[i];
    } else {
      namespace cg = cooperative_groups;
      cg::cluster_group cl = cg::this_cluster();
      cl.sync();  // every program of the cluster has its partial in shared memory
      const int n = int(cl.num_blocks()), rank = int(cl.block_rank()), per = 16 * D / n;
      auto remote = [&](int q) { return cl.map_shared_rank(part, q); };
      for (int e = rank * per + 4 * threadIdx.x; e < (rank + 1) * per; e += 4 * THREADS)
        merge4(remote, n, e, a.o + (int64_t(b) * a.hkv + h) * 16 * D);
      cl.sync();  // no program leaves while another reads its shared memory
    }
  }
}

// warp-specialized: warps 4-7 stage tiles (cp.async, completion on the stage's full
// mbarrier), warps 0-3 compute and free the stage (empty mbarrier); no block barrier
template <int STAGES, bool MMA, bool SW>
__global__ void __launch_bounds__(2 * THREADS) ws_kernel(const Args a) {
  extern __shared__ __align__(1024) uint8_t sm[];
  __shared__ uint64_t full[STAGES], empty[STAGES];
  const int h = blockIdx.x, b = blockIdx.y;
  int t0, t1;
  tiles_of(a, t0, t1);
  const int* tab = a.table + int64_t(b) * a.blocks_per_seq;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(full + s, THREADS);  // one cp.async arrival a producer thread
      mbar_init(empty + s, 4);       // one arrival a consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  float acc = 0.f;
  if (threadIdx.x >= THREADS) {
    const int ptid = threadIdx.x - THREADS;
    for (int t = t0; t < t1; ++t) {
      const int i = t - t0, s = i % STAGES;
      if (i >= STAGES) mbar_wait(empty + s, ((i / STAGES) - 1) & 1);
      stage_tile<THREADS, SW>(a, tab, h, t, sm + s * 2 * STILE, ptid);
      asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(smem_u32(full + s)) : "memory");
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    return;
  }
  MmaWork<SW> mw;
  mw.init();
  for (int t = t0; t < t1; ++t) {
    const int i = t - t0, s = i % STAGES;
    mbar_wait(full + s, (i / STAGES) & 1);
    if constexpr (MMA) mw.run(sm + s * 2 * STILE, sm + s * 2 * STILE + STILE);
    else acc += touch(sm + s * 2 * STILE) + touch(sm + s * 2 * STILE + STILE);
    __syncwarp();
    if (threadIdx.x % 32 == 0)
      asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(smem_u32(empty + s)) : "memory");
  }
  const int64_t prog = (int64_t(blockIdx.z) * gridDim.y + b) * gridDim.x + h;
  a.out[prog * THREADS + threadIdx.x] = acc + mw.sum();
}

// ROWS: false = one copy a page (thread 0), true = one copy a token row (threads 0..63)
template <int STAGES, bool ROWS>
__global__ void __launch_bounds__(THREADS) tma_kernel(const Args a, const __grid_constant__ CUtensorMap mk,
                                                      const __grid_constant__ CUtensorMap mv) {
  extern __shared__ __align__(1024) uint8_t sm[];
  __shared__ uint64_t full[STAGES];
  const int h = blockIdx.x, b = blockIdx.y;
  int t0, t1;
  tiles_of(a, t0, t1);
  const int* tab = a.table + int64_t(b) * a.blocks_per_seq;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) mbar_init(full + s, 1);
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  auto issue = [&](int t, int s) {
    const uint32_t ks = smem_u32(sm + s * 2 * TILE_BYTES), vs = ks + TILE_BYTES;
    if constexpr (!ROWS) {
      if (threadIdx.x == 0) {
        mbar_expect(full + s, 2 * TILE_BYTES);
#pragma unroll
        for (int pg = 0; pg < TILE / PAGE; ++pg) {
          const int slot0 = tab[(t * TILE) / PAGE + pg] * PAGE;
          tma3(ks + pg * PAGE * ROW_BYTES, &mk, 0, h, slot0, full + s);
          tma3(vs + pg * PAGE * ROW_BYTES, &mv, 0, h, slot0, full + s);
        }
      }
    } else {
      if (threadIdx.x == 0) mbar_expect(full + s, 2 * TILE_BYTES);
      if (threadIdx.x < TILE) {
        const int r = threadIdx.x, tok = t * TILE + r;
        const int slot = tab[tok / PAGE] * PAGE + tok % PAGE;
        tma3(ks + r * ROW_BYTES, &mk, 0, h, slot, full + s);
        tma3(vs + r * ROW_BYTES, &mv, 0, h, slot, full + s);
      }
    }
  };
  float acc = 0.f;
  for (int i = 0; i < STAGES - 1; ++i)
    if (t0 + i < t1) issue(t0 + i, i);
  for (int t = t0; t < t1; ++t) {
    const int i = t - t0, s = i % STAGES;
    const int nt = t + STAGES - 1;
    // the stage of tile nt held tile t - 1: every thread is past it (the barrier below
    // of the previous iteration), so it may be refilled
    if (nt < t1) issue(nt, (nt - t0) % STAGES);
    mbar_wait(full + s, (i / STAGES) & 1);
    acc += touch(sm + s * 2 * TILE_BYTES) + touch(sm + s * 2 * TILE_BYTES + TILE_BYTES);
    __syncthreads();  // every thread is done with stage s
  }
  const int64_t prog = (int64_t(blockIdx.z) * gridDim.y + b) * gridDim.x + h;
  a.out[prog * THREADS + threadIdx.x] = acc;
}

__global__ void read_flush(const int4* p, int64_t n, int* sink) {
  int acc = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    acc ^= p[i].x ^ p[i].w;
  if (acc == 0x7fffffff) *sink = acc;
}

static PFN_cuTensorMapEncodeTiled_v12000 encode_fn() {
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  CK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  if (q != cudaDriverEntryPointSuccess || fn == nullptr) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled not found\n");
    std::exit(1);
  }
  return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
}

// the cache [nb * PAGE slots, hkv heads, D channels] as a 3-D tensor; box: channels x 1 head x rows
static CUtensorMap make_map(const void* base, int64_t slots, int hkv, int box_rows) {
  CUtensorMap m;
  cuuint64_t dims[3] = {cuuint64_t(D), cuuint64_t(hkv), cuuint64_t(slots)};
  cuuint64_t strides[2] = {cuuint64_t(ROW_BYTES), cuuint64_t(ROW_BYTES) * hkv};
  cuuint32_t box[3] = {cuuint32_t(D), 1, cuuint32_t(box_rows)};
  cuuint32_t estr[3] = {1, 1, 1};
  CUresult r = encode_fn()(&m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, const_cast<void*>(base), dims, strides, box,
                           estr, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE,
                           CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "cuTensorMapEncodeTiled: %d\n", int(r));
    std::exit(1);
  }
  return m;
}

struct Timer {
  void* flush;
  int* sink;
  bool read;
  int reps;
  template <class F>
  float median_us(F launch) {
    std::vector<float> t;
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    for (int i = 0; i < reps + 3; ++i) {
      if (read) read_flush<<<1056, 256>>>(static_cast<const int4*>(flush), (256 << 20) / 16, sink);
      else CK(cudaMemsetAsync(flush, i & 0xff, 256 << 20));
      CK(cudaEventRecord(e0));
      launch();
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (i >= 3) t.push_back(1000.f * ms);
    }
    CK(cudaGetLastError());
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  }
};

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s B CTX HKV PARTS [REPS]\n", argv[0]);
    return 2;
  }
  const int B = std::atoi(argv[1]), ctx = std::atoi(argv[2]), hkv = std::atoi(argv[3]), parts = std::atoi(argv[4]);
  const int reps = argc > 5 ? std::atoi(argv[5]) : 30;
  const bool merge = argc > 6 && std::string(argv[6]) == "merge";
  if (ctx % (TILE * parts) != 0 && ctx % TILE != 0) return 2;
  const int bps = ctx / PAGE, nb = B * bps;
  const int64_t elems = int64_t(nb) * PAGE * hkv * D, kv_bytes = 2 * elems * 2;
  uint16_t *k, *v;
  int* table;
  float* out;
  void* flush;
  int* sink;
  CK(cudaMalloc(&k, elems * 2));
  CK(cudaMalloc(&v, elems * 2));
  CK(cudaMemset(k, 0x3c, elems * 2));
  CK(cudaMemset(v, 0x3c, elems * 2));
  std::vector<int> perm(nb);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), std::mt19937(0));
  CK(cudaMalloc(&table, nb * sizeof(int)));
  CK(cudaMemcpy(table, perm.data(), nb * sizeof(int), cudaMemcpyHostToDevice));
  const int progs = hkv * B * parts;
  CK(cudaMalloc(&out, int64_t(progs) * THREADS * 4));
  CK(cudaMalloc(&flush, 256 << 20));
  CK(cudaMemset(flush, 1, 256 << 20));
  CK(cudaMalloc(&sink, 4));
  void *ca, *cb;
  const int64_t cbytes = std::max<int64_t>(1ll << 30, kv_bytes / 2);  // the ceiling: >= 1 GB read + written
  CK(cudaMalloc(&ca, cbytes));
  CK(cudaMalloc(&cb, cbytes));
  float* ws;
  uint16_t* o;
  CK(cudaMalloc(&ws, int64_t(progs) * PART_FLOATS * 4));
  CK(cudaMalloc(&o, int64_t(B) * hkv * 16 * D * 2));
  Args a{k, v, table, ctx, hkv, parts, bps, out, ws, o};
  dim3 grid(hkv, B, parts);
  const CUtensorMap mk_page = make_map(k, int64_t(nb) * PAGE, hkv, PAGE), mv_page = make_map(v, int64_t(nb) * PAGE, hkv, PAGE);
  const CUtensorMap mk_row = make_map(k, int64_t(nb) * PAGE, hkv, 1), mv_row = make_map(v, int64_t(nb) * PAGE, hkv, 1);
  for (int read = 0; read < 2; ++read) {
    Timer tm{flush, sink, read != 0, reps};
    const float copy_us = tm.median_us([&] { CK(cudaMemcpyAsync(cb, ca, cbytes, cudaMemcpyDeviceToDevice)); });
    const double copy_gbps = 2.0 * cbytes / copy_us / 1e3;
    const float same_us = tm.median_us([&] { CK(cudaMemcpyAsync(cb, ca, kv_bytes / 2, cudaMemcpyDeviceToDevice)); });
    std::printf("B=%d ctx=%d hkv=%d parts=%d programs=%d KV %.0f MB flush=%s copy %.0f GB/s | same-bytes copy %.1f us %.1f%%\n",
                B, ctx, hkv, parts, progs, kv_bytes / 1e6, read ? "read" : "write", copy_gbps, same_us,
                100.0 * kv_bytes / same_us / 1e3 / copy_gbps);
    auto report = [&](const char* name, int stages, const void* fn, int smem, int threads, float us) {
      int occ = 0;
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, fn, threads, smem));
      std::printf("  %-10s stages %d (%d programs an SM): %8.1f us  %6.0f GB/s  %5.1f%% of copy\n", name, stages, occ,
                  us, kv_bytes / us / 1e3, 100.0 * kv_bytes / us / 1e3 / copy_gbps);
    };
    auto run_cpa = [&](auto st, auto mma, auto sw) {
      constexpr int S = decltype(st)::value;
      constexpr bool M = decltype(mma)::value, W = decltype(sw)::value;
      const int smem = S * 2 * STILE;
      CK(cudaFuncSetAttribute(cpa_kernel<S, M, W>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      report(M ? (W ? "cpa+mma/sw" : "cpa+mma") : (W ? "cpa/sw" : "cpa"), S,
             reinterpret_cast<const void*>(cpa_kernel<S, M, W>), smem, THREADS,
             tm.median_us([&] { cpa_kernel<S, M, W><<<grid, THREADS, smem>>>(a); }));
    };
    // cpa+mma/sw with a merge epilogue: EPI_WS adds combine_kernel (a programmatic dependent
    // launch), EPI_CLUSTER launches clusters of the PARTS programs of a (head, sequence)
    auto run_merge = [&](auto st, auto epi) {
      constexpr int S = decltype(st)::value, E = decltype(epi)::value;
      auto fn = cpa_kernel<S, true, true, E>;
      const int smem = std::max(S * 2 * STILE, (5 * 16 * D + 32) * 4);
      CK(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = grid;
      cfg.blockDim = dim3(THREADS);
      cfg.dynamicSmemBytes = smem;
      cudaLaunchAttribute attr[1];
      cfg.attrs = attr;
      cfg.numAttrs = 0;
      if (E == EPI_CLUSTER) {
        if (parts > 8) CK(cudaFuncSetAttribute(fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
        attr[0].id = cudaLaunchAttributeClusterDimension;
        attr[0].val.clusterDim.x = 1;
        attr[0].val.clusterDim.y = 1;
        attr[0].val.clusterDim.z = parts;
        cfg.numAttrs = 1;
        int clusters = 0;
        CK(cudaOccupancyMaxActiveClusters(&clusters, fn, &cfg));
        std::printf("  (clusters of %d: %d can be resident, %d launched)\n", parts, clusters, progs / parts);
      }
      cudaLaunchConfig_t ccfg = {};
      ccfg.gridDim = dim3(hkv, B);
      ccfg.blockDim = dim3(16 * D / 4);
      cudaLaunchAttribute cattr[1];
      cattr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
      cattr[0].val.programmaticStreamSerializationAllowed = 1;
      ccfg.attrs = cattr;
      ccfg.numAttrs = 1;
      const char* name = E == EPI_NONE ? "no merge" : (E == EPI_WS ? "ws+combine" : "cluster");
      report(name, S, reinterpret_cast<const void*>(fn), smem, THREADS, tm.median_us([&] {
               CK(cudaLaunchKernelEx(&cfg, fn, a));
               if (E == EPI_WS) CK(cudaLaunchKernelEx(&ccfg, combine_kernel, a));
             }));
    };
    auto run_ws = [&](auto st, auto mma, auto sw) {
      constexpr int S = decltype(st)::value;
      constexpr bool M = decltype(mma)::value, W = decltype(sw)::value;
      const int smem = S * 2 * STILE;
      CK(cudaFuncSetAttribute(ws_kernel<S, M, W>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      report(M ? (W ? "ws+mma/sw" : "ws+mma") : (W ? "ws/sw" : "ws"), S,
             reinterpret_cast<const void*>(ws_kernel<S, M, W>), smem, 2 * THREADS,
             tm.median_us([&] { ws_kernel<S, M, W><<<grid, 2 * THREADS, smem>>>(a); }));
    };
    auto run_tma = [&](auto st, auto rows) {
      constexpr int S = decltype(st)::value;
      constexpr bool R = decltype(rows)::value;
      const int smem = S * 2 * TILE_BYTES;
      CK(cudaFuncSetAttribute(tma_kernel<S, R>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
      const CUtensorMap& mk = R ? mk_row : mk_page;
      const CUtensorMap& mv = R ? mv_row : mv_page;
      report(R ? "tma_row" : "tma_page", S, reinterpret_cast<const void*>(tma_kernel<S, R>), smem, THREADS,
             tm.median_us([&] { tma_kernel<S, R><<<grid, THREADS, smem>>>(a, mk, mv); }));
    };
    using F = std::false_type;
    using T = std::true_type;
    if (merge) {
      run_merge(std::integral_constant<int, 3>{}, std::integral_constant<int, EPI_NONE>{});
      run_merge(std::integral_constant<int, 3>{}, std::integral_constant<int, EPI_WS>{});
      if (parts <= 16) run_merge(std::integral_constant<int, 3>{}, std::integral_constant<int, EPI_CLUSTER>{});
      run_merge(std::integral_constant<int, 2>{}, std::integral_constant<int, EPI_NONE>{});
      run_merge(std::integral_constant<int, 2>{}, std::integral_constant<int, EPI_WS>{});
      if (parts <= 16) run_merge(std::integral_constant<int, 2>{}, std::integral_constant<int, EPI_CLUSTER>{});
      continue;
    }
    run_cpa(std::integral_constant<int, 3>{}, F{}, F{});
    run_cpa(std::integral_constant<int, 3>{}, F{}, T{});
    run_cpa(std::integral_constant<int, 3>{}, T{}, F{});
    run_cpa(std::integral_constant<int, 3>{}, T{}, T{});
    run_cpa(std::integral_constant<int, 2>{}, T{}, T{});
    run_ws(std::integral_constant<int, 3>{}, T{}, F{});
    run_ws(std::integral_constant<int, 3>{}, T{}, T{});
    run_ws(std::integral_constant<int, 4>{}, T{}, T{});
    run_tma(std::integral_constant<int, 3>{}, F{});
  }
  std::vector<float> h(THREADS);
  CK(cudaMemcpy(h.data(), out, THREADS * 4, cudaMemcpyDeviceToHost));
  std::printf("  (check: program 0 thread 0 touched %.3g)\n", h[0]);
  return 0;
}
