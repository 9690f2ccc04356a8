// Paged decode entry point: validates the launch, picks the instantiation (dtype, warp
// size, head_dim, rows) and, for split-KV launches, runs the combine kernel.
//
// Combine: each partition p of a (sequence, row) left m_p (log2 units), l_p and
// o_p = acc_p / l_p in the workspace. out = sum_p w_p o_p / sum_p w_p with
// w_p = l_p 2^(m_p - M), M = max_p m_p, over the cdiv(seq_len, partition_size)
// partitions that exist (later ones were never written). seq_len 0 gives zeros.
#include "compat.h"
#include "decode_kernel.cuh"
#include "hab_ops.h"

namespace {

constexpr int kCombineMaxThreads = 512;
constexpr int kCombineVec = 4;  // channels a thread sums (one 16-byte load a partition)

// A block-wide max or sum of one float per thread: the warps reduce by shuffles, warp w
// leaves its value in red[w], and after one barrier every thread reduces those
// THREADS / HAB_WARP_SIZE values itself (independent shared-memory reads). `red` is free
// again after the next barrier.
template <bool MAX, int THREADS>
__device__ __forceinline__ float block_reduce(float v, float* red) {
  constexpr int WARPS = THREADS / HAB_WARP_SIZE;
  v = MAX ? hab_group_max<HAB_WARP_SIZE>(v) : hab_group_sum<HAB_WARP_SIZE>(v);
  if (threadIdx.x % HAB_WARP_SIZE == 0) red[threadIdx.x / HAB_WARP_SIZE] = v;
  __syncthreads();
  float r = red[0];
#pragma unroll
  for (int w = 1; w < WARPS; ++w) r = MAX ? fmaxf(r, red[w]) : r + red[w];
  return r;
}

// One block of THREADS per (sequence, row). The block's threads are `groups` groups of
// `dim_threads` (cdiv(head_dim, 4) rounded up to a power of two: 16, 32 or 64), as many
// groups as the launch's partitions need (combine_threads); thread (g, c) sums
// channels 4c .. 4c + 3 over the partitions j with j % groups == g, one 16-byte load per
// partition where the workspace rows allow it (po_vec, checked on the host), and the
// groups' sums are added at the end.
// At head_dim 128 that is 16 groups, so 64 partitions are 4 independent loads a thread:
// one round of L2 latency instead of the 4 of one channel a thread in 4 groups. The loads are unconditional (every partition below `parts` wrote its slot, an
// empty one with l = 0 and o = 0; a select keeps a zero weight from touching its value).
// The first form, a branch on the weight before each load, waited for each load before
// the next: 16-28 us for 64 partitions on an H200 (docs/history.md). The max and the
// weights' total are block reductions by warp shuffles, one barrier each.
// Launched as a programmatic dependent launch of the decode kernel (combine_pdl), a block
// may start while the decode grid runs: everything before hab_gdc_wait() reads only what
// the decode kernel does not write.
template <int THREADS>
__global__ void __launch_bounds__(THREADS) combine_kernel(HabDecodeParams p, bool po_vec) {
  static_assert(THREADS % HAB_WARP_SIZE == 0 && THREADS <= kCombineMaxThreads, "whole warps");
  __shared__ float w_s[THREADS];  // weights of a chunk of partitions
  __shared__ float red_s[2][THREADS / 32];  // the warps' partial max / sums (two, alternating)
  __shared__ __align__(16) float sum_s[THREADS * kCombineVec];  // the groups' sums [groups][4 dim_threads]
  const int64_t seq = blockIdx.x;
  const int64_t row = blockIdx.y;  // t * Hq + h
  const int64_t tok = row / p.num_q_heads, head = row % p.num_q_heads;
  const int tid = threadIdx.x;
  const int head_dim = int(p.head_dim);
  int dim_shift = 4;  // log2(dim_threads)
  while ((1 << dim_shift) * kCombineVec < head_dim) ++dim_shift;
  const int dim_threads = 1 << dim_shift, groups = THREADS >> dim_shift;
  const int group = tid >> dim_shift, d0 = kCombineVec * (tid & (dim_threads - 1));
  const bool has = d0 < head_dim;  // head_dim is a multiple of 8: all 4 channels or none
  const int64_t seq_len = hab_load_index(p.seq_lens, p.lens_is_int64, seq * p.lens_stride);
  const int parts = int(min(hab_cdiv(seq_len, p.partition_size), p.num_partitions));
  const int64_t slot0 = seq * p.num_partitions;
  const float* ml = p.max_logits + slot0 * p.ml_stride[0] + row * p.ml_stride[1];
  const float* es = p.exp_sums + slot0 * p.ml_stride[0] + row * p.ml_stride[1];
  const float* po0 = p.partial_out + slot0 * p.po_stride[0] + row * p.po_stride[1];
  hab_gdc_wait();  // the decode grid's writes are visible from here
  // pass 1: M = max_p m_p, one partition per thread (the first chunk's m and l kept)
  float m_first = -INFINITY, l_first = 0.f;
  if (tid < parts) {
    m_first = ml[tid * p.ml_stride[0]];
    l_first = es[tid * p.ml_stride[0]];
  }
  float m = m_first;
  for (int q = tid + THREADS; q < parts; q += THREADS) m = fmaxf(m, ml[q * p.ml_stride[0]]);
  const float block_m = block_reduce<true, THREADS>(m, red_s[0]);
  const float big_m = block_m == -INFINITY ? 0.f : block_m;
  // pass 2: chunks of THREADS partitions: weights by one thread each, then every
  // thread sums its channels over its group's partitions of the chunk
  float acc[kCombineVec] = {0.f, 0.f, 0.f, 0.f};
  float total = 0.f;
  for (int c0 = 0, k = 1; c0 < parts; c0 += THREADS, k ^= 1) {
    const int q = c0 + tid;
    float w = 0.f;
    if (q < parts) {
      const float l = c0 == 0 ? l_first : es[q * p.ml_stride[0]];
      const float mq = c0 == 0 ? m_first : ml[q * p.ml_stride[0]];
      w = l > 0.f ? l * exp2f(mq - big_m) : 0.f;
    }
    w_s[tid] = w;  // the previous chunk's weights were read before its closing barrier
    total += block_reduce<false, THREADS>(w, red_s[k]);  // its barrier also publishes w_s
    const int n = min(THREADS, parts - c0);
    if (has) {
#pragma unroll 4
      for (int j = group; j < n; j += groups) {
        const float wj = w_s[j];
        const float* po = po0 + int64_t(c0 + j) * p.po_stride[0] + d0 * p.po_stride[2];
        float o[kCombineVec];
        if (po_vec) {  // the partial rows as 16-byte vectors
          const float4 v4 = *reinterpret_cast<const float4*>(po);
          o[0] = v4.x, o[1] = v4.y, o[2] = v4.z, o[3] = v4.w;
        } else {
#pragma unroll
          for (int e = 0; e < kCombineVec; ++e) o[e] = po[e * p.po_stride[2]];
        }
#pragma unroll
        for (int e = 0; e < kCombineVec; ++e) acc[e] += wj > 0.f ? wj * o[e] : 0.f;
      }
    }
    __syncthreads();  // every thread is done with this chunk's w_s and red_s[k ^ 1] is free
  }
  *reinterpret_cast<float4*>(sum_s + kCombineVec * tid) = make_float4(acc[0], acc[1], acc[2], acc[3]);
  __syncthreads();
  if (group != 0 || !has) return;
  for (int g = 1; g < groups; ++g) {
    const float4 v4 = *reinterpret_cast<const float4*>(sum_s + kCombineVec * (g * dim_threads + tid));
    acc[0] += v4.x, acc[1] += v4.y, acc[2] += v4.z, acc[3] += v4.w;
  }
  const float inv = 1.f / (total > 0.f ? total : 1.f);
  const int64_t o_base = seq * p.o_stride[0] + tok * p.o_stride[1] + head * p.o_stride[2];
#pragma unroll
  for (int e = 0; e < kCombineVec; ++e) hab_decode::store_out(p, o_base + (d0 + e) * p.o_stride[3], acc[e] * inv);
}

// Threads of a combine block: `dim_threads` (a power of two >= head_dim / 4, at least 16)
// per group of partitions, as many groups as the launch has partitions (rounded up to a
// power of two), at least 64 and at most kCombineMaxThreads threads. A launch of few
// partitions over many rows then runs small blocks, many an SM, in one wave (4,096 rows of
// 2 partitions took 8 waves of 512-thread blocks at 4 an SM: docs/history.md);
// many partitions keep the 512 threads that read them in one round.
int combine_threads(int64_t num_partitions, int64_t head_dim) {
  int dim_threads = 16;
  while (dim_threads * kCombineVec < head_dim) dim_threads *= 2;
  int threads = dim_threads;
  while (threads < kCombineMaxThreads && threads < dim_threads * num_partitions) threads *= 2;
  return threads < 64 ? 64 : threads;
}

// The combine launch of THREADS a block; with `pdl` (CUDA) a programmatic dependent
// launch: its blocks may be scheduled while the decode grid's last programs run (the
// decode kernel calls hab_gdc_launch_dependents first), and wait inside for the decode
// grid's writes.
template <int THREADS>
hab_error_t launch_combine_t(const HabDecodeParams& p, bool po_vec, dim3 grid, bool pdl, hab_stream_t stream) {
#if defined(HAB_CUDA)
  if (pdl) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = dim3(THREADS);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, combine_kernel<THREADS>, p, po_vec);
  }
#else
  (void)pdl;
#endif
  combine_kernel<THREADS><<<grid, THREADS, 0, stream>>>(p, po_vec);
  return hab_get_last_error();
}

hab_error_t launch_combine(const HabDecodeParams& p, bool po_vec, dim3 grid, bool pdl, hab_stream_t stream) {
  switch (combine_threads(p.num_partitions, p.head_dim)) {
    case 64: return launch_combine_t<64>(p, po_vec, grid, pdl, stream);
    case 128: return launch_combine_t<128>(p, po_vec, grid, pdl, stream);
    case 256: return launch_combine_t<256>(p, po_vec, grid, pdl, stream);
    default: return launch_combine_t<kCombineMaxThreads>(p, po_vec, grid, pdl, stream);
  }
}

bool aligned(const void* ptr, int64_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

// The `chunk`-element chunks of a row are one vector load: contiguous along d (stride 1
// inside each chunk) and every chunk start aligned to the vector.
int chunks_are_vectors(const void* base, int elem_bytes, int64_t d_stride, int64_t chunk_mult,
                       const int64_t* strides, int n, int chunk = 8) {
  if (d_stride != 1 || chunk_mult % chunk != 0) return 0;
  const int64_t vec = int64_t(chunk) * elem_bytes;
  if (!aligned(base, vec)) return 0;
  for (int i = 0; i < n; ++i)
    if ((strides[i] * elem_bytes) % vec != 0) return 0;
  return 1;
}

bool fits_int32(int64_t x) { return x >= 0 && x <= 2147483647LL; }

// The loop choice of HabDecodeParams::loop_stages / loop_tile: stages 0, the shared-softmax
// loop; 2 to 4, the split-N loop where it applies, with that many cp.async stages (two keep
// one tile in flight while a tile is computed, three keep two); loop_tile is its KV tile
// and must be 64 (decode_kernel.cuh, SPLIT_N_TOKENS). The caller plans both; false for any
// other value. A device without mma.sync runs the shared-softmax loop whatever was planned.
bool loop_flags(int64_t loop_stages, int64_t loop_tile, hab_decode::Flags* flags) {
  if (loop_stages != 0 && (loop_stages < 2 || loop_stages > hab_decode::MAX_SPLIT_N_STAGES)) return false;
  if (loop_tile != hab_decode::SPLIT_N_TOKENS) return false;
  flags->split_n = loop_stages != 0 && hab_device_has_mma_sync() ? 1 : 0;
  flags->stages = loop_stages != 0 ? int(loop_stages) : 2;
  return true;
}

const char* launch_for_head_dim(const HabDecodeParams& p, hab_decode::Flags flags, int warp, void* stream) {
  // head_dim padded to 64 / 128 / 256 (padded channels are zeros, never loaded or stored)
  switch (p.head_dim) {
    case 64: return hab_decode_launch_d64(p, flags, warp, stream);
    case 80: case 96: case 128: return hab_decode_launch_d128(p, flags, warp, stream);
    case 192: case 256: return hab_decode_launch_d256(p, flags, warp, stream);
    default: return "paged_decode: native head_dim must be 64, 80, 96, 128, 192 or 256";
  }
}

}  // namespace

extern "C" int hab_runtime_warp_size(void) {
  int dev = 0, warp = 0;
  if (hab_get_device(&dev) != hab_success) return -1;
#if defined(HAB_HIP)
  if (hipDeviceGetAttribute(&warp, hipDeviceAttributeWarpSize, dev) != hipSuccess) return -1;
#else
  if (cudaDeviceGetAttribute(&warp, cudaDevAttrWarpSize, dev) != cudaSuccess) return -1;
#endif
  return warp;
}

extern "C" const char* hab_paged_decode(const HabDecodeParams* pp, void* stream) {
  const HabDecodeParams& p = *pp;
  if (p.num_seqs == 0) return nullptr;
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads) return "paged_decode: bad head counts";
  if (p.num_seqs > 65535 || p.num_partitions > 65535) return "paged_decode: too many sequences or partitions for one launch";
  if (p.num_partitions > 1 && (!p.max_logits || !p.exp_sums || !p.partial_out))
    return "paged_decode: a split launch needs the workspace";
  const int kv_bytes = (p.kv_dtype == HAB_FP8_E4M3 || p.kv_dtype == HAB_FP8_E5M2) ? 1 : 2;
  if (kv_bytes == 2 && p.kv_dtype != p.q_dtype) return "paged_decode: a 16-bit KV cache must have q's dtype";
  const int warp = hab_runtime_warp_size();
  if (warp < 0) return "paged_decode: no device";
  // the kernel addresses a block with 32-bit non-negative block and slot strides (StageGeometry)
  const int64_t slot_span[2] = {(p.page_size - 1) * p.k_stride[2], (p.page_size - 1) * p.v_stride[2]};
  if (!fits_int32(p.k_stride[0]) || !fits_int32(p.v_stride[0]) || !fits_int32(slot_span[0]) ||
      !fits_int32(slot_span[1]))
    return "paged_decode: cache block and slot strides must be non-negative and a block must span fewer than "
           "2^31 elements";
  // and a table row with 32-bit column offsets
  const int64_t last_column = p.max_blocks_per_seq > 0 ? p.max_blocks_per_seq - 1 : 0;
  if (!fits_int32(p.max_blocks_per_seq) || !fits_int32(last_column * p.bt_stride[1]))
    return "paged_decode: a block-table row must span fewer than 2^31 entries";

  // K: chunk of 8 channels d0..d0+7; 4-D: stride k_stride[3]; split-x: x (a multiple of 8)
  // contiguous channels at stride k_stride[4], chunks of x at k_stride[3]
  int k_vec;
  if (p.k_split_x > 0) {
    const int64_t others[3] = {p.k_stride[0], p.k_stride[1], p.k_stride[2]};
    k_vec = chunks_are_vectors(p.k_cache, kv_bytes, p.k_stride[4], p.k_split_x, others, 3) &&
            (p.k_stride[3] * kv_bytes) % (8 * kv_bytes) == 0;
  } else {
    k_vec = chunks_are_vectors(p.k_cache, kv_bytes, p.k_stride[3], 8, p.k_stride, 3);
  }
  const int v_vec = chunks_are_vectors(p.v_cache, kv_bytes, p.v_stride[3], 8, p.v_stride, 3);

  const int q_vec = chunks_are_vectors(p.q, 2, p.q_stride[3], 8, p.q_stride, 3);
  // the split workspace's rows as float4 (the planned workspace is contiguous)
  const int po_vec = p.num_partitions > 1 &&
                     chunks_are_vectors(p.partial_out, 4, p.po_stride[2], kCombineVec, p.po_stride, 2, kCombineVec);
  // out's rows as 4-channel vectors (the split-N loop's unsplit stores)
  const int out_bytes = p.out_dtype == HAB_F32 ? 4 : 2;
  const int o_vec = chunks_are_vectors(p.out, out_bytes, p.o_stride[3], p.head_dim, p.o_stride, 3, 4);
  // fp8 rows as 16-byte chunks of 16 channels (head_dim a multiple of 16)
  const int kv16 = kv_bytes == 1 && p.k_split_x == 0 &&
                   chunks_are_vectors(p.k_cache, 1, p.k_stride[3], p.head_dim, p.k_stride, 3, 16) &&
                   chunks_are_vectors(p.v_cache, 1, p.v_stride[3], p.head_dim, p.v_stride, 3, 16);
  hab_decode::Flags flags{k_vec, v_vec, q_vec, po_vec, o_vec, 0, 2, nullptr, kv16};
  if (!loop_flags(p.loop_stages, p.loop_tile, &flags))
    return "paged_decode: loop_stages must be 0, 2, 3 or 4 and loop_tile 64";
  const char* err = launch_for_head_dim(p, flags, warp, stream);
  if (err) return err;
  if (p.num_partitions > 1) {
    const int64_t rows = p.num_tokens * p.num_q_heads;
    if (rows > 65535) return "paged_decode: too many query rows for the combine launch";
    dim3 grid(unsigned(p.num_seqs), unsigned(rows));
    const hab_error_t e =
        launch_combine(p, po_vec != 0, grid, p.combine_pdl != 0, static_cast<hab_stream_t>(stream));
    if (e != hab_success) return hab_error_string(e);
  }
  const hab_error_t e = hab_get_last_error();
  return e == hab_success ? nullptr : hab_error_string(e);
}

extern "C" int hab_decode_programs_per_sm(int q_dtype, int kv_dtype, int head_dim, int rows, int loop_stages,
                                          int loop_tile) {
  if (rows <= 0 || (q_dtype != HAB_F16 && q_dtype != HAB_BF16)) return -1;
  const int warp = hab_runtime_warp_size();
  if (warp < 0) return -1;
  HabDecodeParams p{};
  p.q_dtype = p.out_dtype = q_dtype;
  p.kv_dtype = kv_dtype;
  p.head_dim = head_dim;
  p.num_tokens = 1;
  p.num_q_heads = rows;
  p.num_kv_heads = 1;
  int programs = 0;
  hab_decode::Flags flags{1, 1, 1, 1, 1, 0, 2, &programs, 1};
  if (!loop_flags(loop_stages, loop_tile, &flags)) return -1;
  return launch_for_head_dim(p, flags, warp, nullptr) ? -1 : programs;
}
