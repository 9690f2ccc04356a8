// write_kv (scatter new tokens into the paged caches) and copy_blocks (copy-on-write of
// whole blocks). Every cache is reached through its strides (int64 offsets), so every
// layout of hygon_attn_backend/layouts.py works; slots and block ids outside the cache are
// skipped, never read or written.
#include "compat.h"
#include "fp8.cuh"
#include "hab_ops.h"

namespace {

constexpr int kWriteThreads = 256;
constexpr int kWriteElems = 4;  // elements of one (K or V) row set per thread

// ------------------------------------------------------------------ element codecs
struct F32 {};
struct E4M3 {};
struct E5M2 {};

template <typename T> struct Codec;
template <> struct Codec<HabHalf> {
  typedef uint16_t storage;
  HAB_DEV static float load(const storage* p, int64_t i) { return HabHalf::to_float(p[i]); }
  HAB_DEV static void store(storage* p, int64_t i, float x, float) { p[i] = HabHalf::from_float(x); }
};
template <> struct Codec<HabBf16> {
  typedef uint16_t storage;
  HAB_DEV static float load(const storage* p, int64_t i) { return HabBf16::to_float(p[i]); }
  HAB_DEV static void store(storage* p, int64_t i, float x, float) { p[i] = HabBf16::from_float(x); }
};
template <> struct Codec<F32> {
  typedef float storage;
  HAB_DEV static float load(const storage* p, int64_t i) { return p[i]; }
  HAB_DEV static void store(storage* p, int64_t i, float x, float) { p[i] = x; }
};
template <> struct Codec<E4M3> {
  typedef uint8_t storage;
  HAB_DEV static void store(storage* p, int64_t i, float x, float s) { p[i] = hab_fp8_encode<HabE4M3>(x, s); }
};
template <> struct Codec<E5M2> {
  typedef uint8_t storage;
  HAB_DEV static void store(storage* p, int64_t i, float x, float s) { p[i] = hab_fp8_encode<HabE5M2>(x, s); }
};

// One program per (token, chunk of H*D elements): grid (num_tokens, cdiv(H*D, 1024)).
// Element e of the chunk is head e / D, channel e % D, written to K and V.
template <typename SRC, typename DST>
__global__ void __launch_bounds__(kWriteThreads) write_kv_kernel(HabWriteKvParams p) {
  typedef typename Codec<SRC>::storage S;
  typedef typename Codec<DST>::storage C;
  const int64_t tok = blockIdx.x;
  const int64_t slot = hab_load_index(p.slot_mapping, p.slot_is_int64, tok * p.slot_stride);
  if (slot < 0 || slot >= p.num_blocks * p.page_size) return;  // padding (-1) or out of range
  const int64_t blk = slot / p.page_size, off = slot % p.page_size;
  const int64_t total = p.num_kv_heads * p.head_dim;
  const int64_t e0 = int64_t(blockIdx.y) * kWriteThreads * kWriteElems;
  const S* k = static_cast<const S*>(p.k);
  const S* v = static_cast<const S*>(p.v);
  C* kc = static_cast<C*>(p.k_cache);
  C* vc = static_cast<C*>(p.v_cache);
#pragma unroll
  for (int i = 0; i < kWriteElems; ++i) {
    const int64_t e = e0 + i * kWriteThreads + threadIdx.x;
    if (e >= total) break;
    const int64_t h = e / p.head_dim, d = e % p.head_dim;
    const float kx = Codec<SRC>::load(k, tok * p.k_stride[0] + h * p.k_stride[1] + d * p.k_stride[2]);
    const float vx = Codec<SRC>::load(v, tok * p.v_stride[0] + h * p.v_stride[1] + d * p.v_stride[2]);
    int64_t k_dst = blk * p.kc_stride_b + h * p.kc_stride_h + off * p.kc_stride_s;
    if (p.k_split_x > 0) {
      k_dst += (d / p.k_split_x) * p.kc_stride_d + (d % p.k_split_x) * p.kc_stride_x;
    } else {
      k_dst += d * p.kc_stride_d;
    }
    const int64_t v_dst = blk * p.vc_stride_b + h * p.vc_stride_h + off * p.vc_stride_s + d * p.vc_stride_d;
    // per tensor (stride 0) or per KV head (stride 1)
    const float k_scale = p.k_scale_ptr ? p.k_scale_ptr[h * p.k_scale_stride] : p.k_scale_value;
    const float v_scale = p.v_scale_ptr ? p.v_scale_ptr[h * p.v_scale_stride] : p.v_scale_value;
    Codec<DST>::store(kc, k_dst, kx, k_scale);
    Codec<DST>::store(vc, v_dst, vx, v_scale);
  }
}

template <typename SRC, typename DST>
const char* launch_write_kv(const HabWriteKvParams& p, hab_stream_t stream) {
  const int64_t chunks = hab_cdiv(p.num_kv_heads * p.head_dim, int64_t(kWriteThreads) * kWriteElems);
  dim3 grid(unsigned(p.num_tokens), unsigned(chunks));
  write_kv_kernel<SRC, DST><<<grid, kWriteThreads, 0, stream>>>(p);
  return nullptr;
}

template <typename SRC>
const char* write_kv_for_src(const HabWriteKvParams& p, hab_stream_t stream) {
  switch (p.cache_dtype) {
    case HAB_F16: return launch_write_kv<SRC, HabHalf>(p, stream);
    case HAB_BF16: return launch_write_kv<SRC, HabBf16>(p, stream);
    case HAB_F32: return launch_write_kv<SRC, F32>(p, stream);
    case HAB_FP8_E4M3: return launch_write_kv<SRC, E4M3>(p, stream);
    case HAB_FP8_E5M2: return launch_write_kv<SRC, E5M2>(p, stream);
    default: return "write_kv: unsupported cache dtype";
  }
}

// ------------------------------------------------------------------ copy_blocks
constexpr int kCopyThreads = 256;
constexpr int kCopyElems = 8;

template <typename W>
__global__ void __launch_bounds__(kCopyThreads) copy_blocks_kernel(HabCopyBlocksParams p) {
  const int64_t pair = blockIdx.x;
  const int64_t src = hab_load_index(p.block_mapping, p.map_is_int64, pair * p.map_stride_n);
  const int64_t dst = hab_load_index(p.block_mapping, p.map_is_int64, pair * p.map_stride_n + p.map_stride_c);
  if (src < 0 || src >= p.num_blocks || dst < 0 || dst >= p.num_blocks) return;
  const int64_t numel = p.sizes[0] * p.sizes[1] * p.sizes[2] * p.sizes[3];
  W* cache = static_cast<W*>(p.cache);
  const int64_t e0 = int64_t(blockIdx.y) * kCopyThreads * kCopyElems;
  W vals[kCopyElems];
  int64_t offs[kCopyElems];
#pragma unroll
  for (int i = 0; i < kCopyElems; ++i) {  // all loads first: several in flight per thread
    const int64_t e = e0 + i * kCopyThreads + threadIdx.x;
    int64_t rest = e;
    const int64_t i4 = rest % p.sizes[3]; rest /= p.sizes[3];
    const int64_t i3 = rest % p.sizes[2]; rest /= p.sizes[2];
    const int64_t i2 = rest % p.sizes[1];
    const int64_t i1 = rest / p.sizes[1];
    offs[i] = e < numel ? i1 * p.strides[0] + i2 * p.strides[1] + i3 * p.strides[2] + i4 * p.strides[3] : -1;
    if (offs[i] >= 0) vals[i] = cache[src * p.block_stride + offs[i]];
  }
#pragma unroll
  for (int i = 0; i < kCopyElems; ++i) {
    if (offs[i] >= 0) cache[dst * p.block_stride + offs[i]] = vals[i];
  }
}

template <typename W>
const char* launch_copy_blocks(const HabCopyBlocksParams& p, hab_stream_t stream) {
  const int64_t numel = p.sizes[0] * p.sizes[1] * p.sizes[2] * p.sizes[3];
  dim3 grid(unsigned(p.num_pairs), unsigned(hab_cdiv(numel, int64_t(kCopyThreads) * kCopyElems)));
  copy_blocks_kernel<W><<<grid, kCopyThreads, 0, stream>>>(p);
  return nullptr;
}

const char* finish(const char* err) {
  if (err) return err;
  const hab_error_t e = hab_get_last_error();
  return e == hab_success ? nullptr : hab_error_string(e);
}

}  // namespace

extern "C" const char* hab_write_kv(const HabWriteKvParams* p, void* stream_ptr) {
  if (p->num_tokens == 0 || p->num_kv_heads == 0 || p->head_dim == 0) return nullptr;
  if (p->num_tokens > 0x7fffffffLL) return "write_kv: too many tokens for one launch";
  hab_stream_t stream = static_cast<hab_stream_t>(stream_ptr);
  switch (p->src_dtype) {
    case HAB_F16: return finish(write_kv_for_src<HabHalf>(*p, stream));
    case HAB_BF16: return finish(write_kv_for_src<HabBf16>(*p, stream));
    case HAB_F32: return finish(write_kv_for_src<F32>(*p, stream));
    default: return "write_kv: k/v must be float16, bfloat16 or float32";
  }
}

extern "C" const char* hab_copy_blocks(const HabCopyBlocksParams* p, void* stream_ptr) {
  const int64_t numel = p->sizes[0] * p->sizes[1] * p->sizes[2] * p->sizes[3];
  if (p->num_pairs == 0 || numel == 0) return nullptr;
  if (p->num_pairs > 0x7fffffffLL) return "copy_blocks: too many pairs for one launch";
  hab_stream_t stream = static_cast<hab_stream_t>(stream_ptr);
  switch (p->elem_size) {
    case 1: return finish(launch_copy_blocks<uint8_t>(*p, stream));
    case 2: return finish(launch_copy_blocks<uint16_t>(*p, stream));
    case 4: return finish(launch_copy_blocks<uint32_t>(*p, stream));
    case 8: return finish(launch_copy_blocks<uint64_t>(*p, stream));
    default: return "copy_blocks: element size must be 1, 2, 4 or 8 bytes";
  }
}
