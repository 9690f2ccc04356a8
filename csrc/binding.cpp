// torch binding of the native kernels: registers torch.ops.hygon_attn.* under the CUDA
// dispatch key (ROCm torch dispatches HIP tensors there too).
//
// Device-agnostic on purpose: compiled by the host C++ compiler, no CUDA/HIP header, no
// c10/cuda. The stream comes from the device guard implementation torch registered for
// the tensor's device type; the kernels take it as void*. Arguments arrive validated by
// hygon_attn_backend/ops/*.py; the checks here guard the raw-pointer contract only.
#include <string>
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include <optional>

#include "hab_ops.h"

namespace {

// The decode loop's plan (HabDecodeParams::loop_stages / loop_tile): stages 0 (the
// shared-softmax loop), 2 to 4 (the split-N loop's cp.async stages); tile 64 (the split-N
// loop's KV tile, the only one built).
// Numbers go into error messages as std::to_string: on the H200 image (torch 2.11.0+cu130,
// nvcc 13.0) an integer streamed into TORCH_CHECK's message segfaulted inside this
// library's copy of std::ostream::_M_insert<long>; strings stream fine.
void check_decode_loop(int64_t loop_stages, int64_t loop_tile, const char* op) {
  TORCH_CHECK(loop_stages == 0 || (loop_stages >= 2 && loop_stages <= 4), op,
              ": loop_stages must be 0 (shared-softmax loop) or 2 to 4 (split-N loop stages), got ",
              std::to_string(loop_stages));
  TORCH_CHECK(loop_tile == 64, op, ": loop_tile must be 64 (the split-N loop's only KV tile), got ",
              std::to_string(loop_tile));
}

void* stream_of(const at::Tensor& t) {
  const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(t.device().type());
  return impl->getStream(t.device()).native_handle();
}

int dtype_code(at::ScalarType type, const char* name) {
  switch (type) {
    case at::kHalf: return HAB_F16;
    case at::kBFloat16: return HAB_BF16;
    case at::kFloat: return HAB_F32;
    case at::kFloat8_e4m3fn: return HAB_FP8_E4M3;
    case at::kFloat8_e5m2: return HAB_FP8_E5M2;
    default: TORCH_CHECK(false, "hygon_attn native: unsupported dtype for ", name, ": ", type);
  }
  return -1;
}

int dtype_code(const at::Tensor& t, const char* name) { return dtype_code(t.scalar_type(), name); }

int index_is_int64(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong,
              "hygon_attn native: ", name, " must be int32 or int64, got ", t.scalar_type());
  return t.scalar_type() == at::kLong ? 1 : 0;
}

// dst[i] = t.stride(i) for the first n dimensions (the params structs' stride arrays)
template <int N>
void copy_strides(int64_t (&dst)[N], const at::Tensor& t, int n = N) {
  for (int i = 0; i < n; ++i) dst[i] = t.stride(i);
}

// an fp8 scale tensor: 1 element (per tensor: *stride 0), or with heads > 1 one element
// per KV head (*stride 1, contiguous)
const float* scale_ptr(const std::optional<at::Tensor>& s, const char* name, int64_t heads = 1,
                       int32_t* stride = nullptr) {
  if (stride != nullptr) *stride = 0;
  if (!s.has_value()) return nullptr;
  const bool per_head = heads > 1 && s->dim() == 1 && s->numel() == heads && s->is_contiguous();
  TORCH_CHECK(s->scalar_type() == at::kFloat && (s->numel() == 1 || per_head), "hygon_attn native: ", name,
              heads > 1 ? " must be a float32 tensor of 1 element or one per KV head" : " must be a 1-element float32 tensor");
  if (stride != nullptr) *stride = per_head ? 1 : 0;
  return s->data_ptr<float>();
}

void check(const char* err, const char* op) {
  TORCH_CHECK(err == nullptr, "hygon_attn native ", op, ": ", err ? err : "");
}

void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping, const std::optional<at::Tensor>& k_scale,
              const std::optional<at::Tensor>& v_scale, double k_scale_value, double v_scale_value) {
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes(), "write_kv: k, v must be [T, H, D]");
  TORCH_CHECK(v_cache.dim() == 4 && (k_cache.dim() == 4 || k_cache.dim() == 5), "write_kv: cache ranks");
  c10::OptionalDeviceGuard guard(k.device());
  HabWriteKvParams p{};
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.slot_mapping = slot_mapping.data_ptr();
  p.k_scale_ptr = scale_ptr(k_scale, "k_scale", k.size(1), &p.k_scale_stride);
  p.v_scale_ptr = scale_ptr(v_scale, "v_scale", k.size(1), &p.v_scale_stride);
  p.k_scale_value = float(k_scale_value);
  p.v_scale_value = float(v_scale_value);
  p.src_dtype = dtype_code(k, "k");
  p.cache_dtype = dtype_code(k_cache, "k_cache");
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "write_kv: k/v and the two caches must share dtypes");
  p.slot_is_int64 = index_is_int64(slot_mapping, "slot_mapping");
  p.num_tokens = k.size(0);
  p.num_kv_heads = k.size(1);
  p.head_dim = k.size(2);
  p.num_blocks = v_cache.size(0);
  p.page_size = v_cache.size(2);
  p.slot_stride = slot_mapping.stride(0);
  copy_strides(p.k_stride, k);
  copy_strides(p.v_stride, v);
  p.kc_stride_b = k_cache.stride(0);
  p.kc_stride_h = k_cache.stride(1);
  if (k_cache.dim() == 5) {  // [N, H, D/x, P, x]
    p.k_split_x = k_cache.size(4);
    p.kc_stride_d = k_cache.stride(2);
    p.kc_stride_s = k_cache.stride(3);
    p.kc_stride_x = k_cache.stride(4);
  } else {
    p.kc_stride_s = k_cache.stride(2);
    p.kc_stride_d = k_cache.stride(3);
  }
  p.vc_stride_b = v_cache.stride(0);
  p.vc_stride_h = v_cache.stride(1);
  p.vc_stride_s = v_cache.stride(2);
  p.vc_stride_d = v_cache.stride(3);
  check(hab_write_kv(&p, stream_of(k)), "write_kv");
}

void copy_blocks(at::Tensor& cache, const at::Tensor& block_mapping, at::IntArrayRef sizes,
                 at::IntArrayRef strides) {
  TORCH_CHECK(sizes.size() == 4 && strides.size() == 4, "copy_blocks: 4 inner sizes and strides");
  TORCH_CHECK(block_mapping.dim() == 2 && block_mapping.size(1) == 2, "copy_blocks: block_mapping [n, 2]");
  c10::OptionalDeviceGuard guard(cache.device());
  HabCopyBlocksParams p{};
  p.cache = cache.data_ptr();
  p.block_mapping = block_mapping.data_ptr();
  p.map_is_int64 = index_is_int64(block_mapping, "block_mapping");
  p.elem_size = int(cache.element_size());
  p.num_pairs = block_mapping.size(0);
  p.num_blocks = cache.size(0);
  p.block_stride = cache.stride(0);
  p.map_stride_n = block_mapping.stride(0);
  p.map_stride_c = block_mapping.stride(1);
  for (int i = 0; i < 4; ++i) {
    p.sizes[i] = sizes[i];
    p.strides[i] = strides[i];
  }
  check(hab_copy_blocks(&p, stream_of(cache)), "copy_blocks");
}

void paged_decode(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                  const at::Tensor& block_table, const at::Tensor& seq_lens,
                  const std::optional<at::Tensor>& sinks, const std::optional<at::Tensor>& k_scale,
                  const std::optional<at::Tensor>& v_scale, at::Tensor& max_logits, at::Tensor& exp_sums,
                  at::Tensor& partial_out, double scale, double k_scale_value, double v_scale_value,
                  double soft_cap, int64_t sliding_window, int64_t partition_size, int64_t num_partitions,
                  int64_t loop_stages, int64_t loop_tile, bool combine_pdl, int64_t max_rows) {
  TORCH_CHECK(q.dim() == 4 && out.sizes() == q.sizes(), "paged_decode: q, out must be [S, T, Hq, D]");
  TORCH_CHECK(v_cache.dim() == 4 && (k_cache.dim() == 4 || k_cache.dim() == 5), "paged_decode: cache ranks");
  TORCH_CHECK(partition_size > 0 && num_partitions >= 1, "paged_decode: partitions");
  check_decode_loop(loop_stages, loop_tile, "paged_decode");
  c10::OptionalDeviceGuard guard(q.device());
  HabDecodeParams p{};
  p.out = out.data_ptr();
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  p.block_table = block_table.data_ptr();
  p.seq_lens = seq_lens.data_ptr();
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == q.size(2),
                "paged_decode: sinks must be contiguous float32 [Hq]");
    p.sinks = sinks->data_ptr<float>();
  }
  p.k_scale_ptr = scale_ptr(k_scale, "k_scale", k_cache.size(1), &p.k_scale_stride);
  p.v_scale_ptr = scale_ptr(v_scale, "v_scale", k_cache.size(1), &p.v_scale_stride);
  const bool split = num_partitions > 1;
  TORCH_CHECK(!split || (max_logits.scalar_type() == at::kFloat && exp_sums.scalar_type() == at::kFloat &&
                         partial_out.scalar_type() == at::kFloat && max_logits.dim() == 2 &&
                         exp_sums.dim() == 2 && partial_out.dim() == 3),
              "paged_decode: workspace must be float32 [slots, rows] x2 and [slots, rows, D]");
  if (split) {
    p.max_logits = max_logits.data_ptr<float>();
    p.exp_sums = exp_sums.data_ptr<float>();
    p.partial_out = partial_out.data_ptr<float>();
    TORCH_CHECK(exp_sums.stride(0) == max_logits.stride(0) && exp_sums.stride(1) == max_logits.stride(1),
                "paged_decode: max_logits and exp_sums must share strides");
    copy_strides(p.ml_stride, max_logits);
    copy_strides(p.po_stride, partial_out);
  }
  p.scale = float(scale);
  p.k_scale_value = float(k_scale_value);
  p.v_scale_value = float(v_scale_value);
  p.soft_cap = float(soft_cap);
  p.q_dtype = dtype_code(q, "q");
  p.out_dtype = dtype_code(out, "out");
  p.kv_dtype = dtype_code(k_cache, "k_cache");
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type(), "paged_decode: k/v cache dtypes differ");
  p.table_is_int64 = index_is_int64(block_table, "block_table");
  p.lens_is_int64 = index_is_int64(seq_lens, "seq_lens");
  p.num_seqs = q.size(0);
  p.num_tokens = q.size(1);
  p.num_q_heads = q.size(2);
  p.head_dim = q.size(3);
  p.num_kv_heads = v_cache.size(1);
  p.page_size = v_cache.size(2);
  p.num_blocks = v_cache.size(0);
  p.max_blocks_per_seq = block_table.size(1);
  p.sliding_window = sliding_window;
  p.partition_size = partition_size;
  p.num_partitions = num_partitions;
  p.loop_stages = loop_stages;
  p.loop_tile = loop_tile;
  p.combine_pdl = combine_pdl ? 1 : 0;
  TORCH_CHECK(max_rows == 0 || max_rows == 32, "paged_decode: max_rows must be 0 or 32");
  p.max_rows = max_rows;
  copy_strides(p.q_stride, q);
  copy_strides(p.o_stride, out);
  copy_strides(p.v_stride, v_cache);
  if (k_cache.dim() == 5) {  // [N, H, D/x, P, x] -> (block, head, slot, chunk, x)
    p.k_split_x = k_cache.size(4);
    p.k_stride[0] = k_cache.stride(0);
    p.k_stride[1] = k_cache.stride(1);
    p.k_stride[2] = k_cache.stride(3);
    p.k_stride[3] = k_cache.stride(2);
    p.k_stride[4] = k_cache.stride(4);
  } else {
    copy_strides(p.k_stride, k_cache, 4);
  }
  copy_strides(p.bt_stride, block_table);
  p.lens_stride = seq_lens.stride(0);
  check(hab_paged_decode(&p, stream_of(q)), "paged_decode");
}

void prefix_prefill(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const std::optional<at::Tensor>& k_new, const std::optional<at::Tensor>& v_new,
                    const std::optional<at::Tensor>& lse, const std::optional<at::Tensor>& sinks,
                    const at::Tensor& block_table, const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens_k,
                    const at::Tensor& tile_req, const at::Tensor& tile_mblock,
                    const std::optional<at::Tensor>& sched, double scale, double soft_cap,
                    bool causal, int64_t sliding_window, bool pingpong, bool overlap,
                    const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& v_scale,
                    double k_scale_value, double v_scale_value) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes(), "prefix_prefill: q, out must be [T, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4, "prefix_prefill: caches must be [N, Hkv, P, D]");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1,
              "prefix_prefill: the innermost dimension must be contiguous");
  TORCH_CHECK(tile_req.scalar_type() == at::kInt && tile_mblock.scalar_type() == at::kInt &&
                  tile_req.is_contiguous() && tile_mblock.is_contiguous() && tile_mblock.numel() == tile_req.numel(),
              "prefix_prefill: the tile map must be contiguous int32");
  TORCH_CHECK(k_new.has_value() == v_new.has_value(), "prefix_prefill: k_new and v_new go together");
  c10::OptionalDeviceGuard guard(q.device());
  HabPrefillParams p{};
  p.out = out.data_ptr();
  p.q = q.data_ptr();
  p.k_cache = k_cache.data_ptr();
  p.v_cache = v_cache.data_ptr();
  if (k_new.has_value()) {
    TORCH_CHECK(k_new->dim() == 3 && v_new->dim() == 3 && k_new->stride(2) == 1 && v_new->stride(2) == 1 &&
                    k_new->scalar_type() == q.scalar_type() && v_new->scalar_type() == q.scalar_type(),
                "prefix_prefill: k_new, v_new must be [T, Hkv, D] of q's dtype, innermost contiguous");
    p.k_new = k_new->data_ptr();
    p.v_new = v_new->data_ptr();
    copy_strides(p.kn_stride, *k_new);
    copy_strides(p.vn_stride, *v_new);
  }
  if (lse.has_value()) {
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->dim() == 2, "prefix_prefill: lse must be float32 [T, Hq]");
    p.lse = lse->data_ptr<float>();
    copy_strides(p.lse_stride, *lse);
  }
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() && sinks->numel() == q.size(1),
                "prefix_prefill: sinks must be contiguous float32 [Hq]");
    p.sinks = sinks->data_ptr<float>();
  }
  p.block_table = block_table.data_ptr();
  p.cu_seqlens_q = cu_seqlens_q.data_ptr();
  p.seq_lens_k = seq_lens_k.data_ptr();
  p.tile_req = tile_req.data_ptr<int32_t>();
  p.tile_mblock = tile_mblock.data_ptr<int32_t>();
  if (sched.has_value()) {
    TORCH_CHECK(sched->scalar_type() == at::kInt && sched->is_contiguous() && sched->numel() == 2,
                "prefix_prefill: sched must be a contiguous int32 [2] (zeros)");
    p.sched = sched->data_ptr<int32_t>();
  }
  p.scale = float(scale);
  p.soft_cap = float(soft_cap);
  p.dtype = dtype_code(q, "q");
  p.kv_dtype = dtype_code(k_cache, "k_cache");
  const bool fp8 = p.kv_dtype == HAB_FP8_E4M3 || p.kv_dtype == HAB_FP8_E5M2;
  TORCH_CHECK(v_cache.scalar_type() == k_cache.scalar_type() && out.scalar_type() == q.scalar_type() &&
                  (fp8 || k_cache.scalar_type() == q.scalar_type()),
              "prefix_prefill: q and out share one 16-bit dtype, the caches q's or one fp8 dtype");
  p.k_scale_ptr = fp8 ? scale_ptr(k_scale, "k_scale", k_cache.size(1), &p.k_scale_stride) : nullptr;
  p.v_scale_ptr = fp8 ? scale_ptr(v_scale, "v_scale", k_cache.size(1), &p.v_scale_stride) : nullptr;
  p.k_scale_value = float(k_scale_value);
  p.v_scale_value = float(v_scale_value);
  p.table_is_int64 = index_is_int64(block_table, "block_table");
  p.cu_is_int64 = index_is_int64(cu_seqlens_q, "cu_seqlens_q");
  p.lens_is_int64 = index_is_int64(seq_lens_k, "seq_lens_k");
  p.causal = causal ? 1 : 0;
  p.pingpong = pingpong ? 1 : 0;
  p.overlap = overlap ? 1 : 0;
  p.num_tiles = tile_req.numel();
  p.num_q_heads = q.size(1);
  p.num_kv_heads = k_cache.size(1);
  p.head_dim = q.size(2);
  p.head_dim_v = v_cache.size(3);
  p.total_q = q.size(0);
  p.page_size = k_cache.size(2);
  p.num_blocks = k_cache.size(0);
  p.max_blocks = block_table.size(1);
  p.sliding_window = sliding_window;
  copy_strides(p.q_stride, q);
  copy_strides(p.o_stride, out);
  copy_strides(p.k_stride, k_cache);
  copy_strides(p.v_stride, v_cache);
  copy_strides(p.bt_stride, block_table);
  p.cu_stride = cu_seqlens_q.stride(0);
  p.lens_stride = seq_lens_k.stride(0);
  check(hab_prefix_prefill(&p, stream_of(q)), "prefix_prefill");
}

// Ragged dense attention on the prefill kernel (MLA's up-projected prefill): q [Tq, Hq,
// 128 or 192], k [Tk, Hkv, q's width], v [Tk, Hkv, 128], out [Tq, Hq, 128], one 16-bit
// dtype, innermost contiguous; request b's queries rows cu_seqlens_q[b] .., its keys rows
// cu_seqlens_k[b] ..; lse [Hq, Tq] float32 (optional).
void ragged_prefill(at::Tensor& out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const std::optional<at::Tensor>& lse, const at::Tensor& cu_seqlens_q,
                    const at::Tensor& cu_seqlens_k, const at::Tensor& tile_req, const at::Tensor& tile_mblock,
                    const std::optional<at::Tensor>& sched, double scale, bool causal) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, "ragged_prefill: q, k, v, out must be 3-d");
  TORCH_CHECK(k.size(2) == q.size(2) && v.sizes().slice(0, 2) == k.sizes().slice(0, 2) && out.size(0) == q.size(0) &&
                  out.size(1) == q.size(1) && out.size(2) == v.size(2),
              "ragged_prefill: q [Tq, Hq, D], k [Tk, Hkv, D], v [Tk, Hkv, Dv], out [Tq, Hq, Dv]");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1 && out.stride(2) == 1,
              "ragged_prefill: the innermost dimension must be contiguous");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "ragged_prefill: q, k, v and out share one 16-bit dtype");
  TORCH_CHECK(tile_req.scalar_type() == at::kInt && tile_mblock.scalar_type() == at::kInt &&
                  tile_req.is_contiguous() && tile_mblock.is_contiguous() && tile_mblock.numel() == tile_req.numel(),
              "ragged_prefill: the tile map must be contiguous int32");
  TORCH_CHECK(cu_seqlens_k.dim() == 1 && cu_seqlens_k.numel() == cu_seqlens_q.numel(),
              "ragged_prefill: cu_seqlens_q and cu_seqlens_k must both be [B + 1]");
  c10::OptionalDeviceGuard guard(q.device());
  HabPrefillParams p{};
  p.out = out.data_ptr();
  p.q = q.data_ptr();
  p.k_new = k.data_ptr();
  p.v_new = v.data_ptr();
  copy_strides(p.kn_stride, k);
  copy_strides(p.vn_stride, v);
  if (lse.has_value()) {
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->dim() == 2 && lse->size(0) == q.size(1) &&
                    lse->size(1) == q.size(0),
                "ragged_prefill: lse must be float32 [Hq, Tq]");
    p.lse = lse->data_ptr<float>();
    p.lse_stride[0] = lse->stride(1);  // (token, head)
    p.lse_stride[1] = lse->stride(0);
  }
  p.cu_seqlens_q = cu_seqlens_q.data_ptr();
  p.seq_lens_k = cu_seqlens_k.data_ptr();
  p.tile_req = tile_req.data_ptr<int32_t>();
  p.tile_mblock = tile_mblock.data_ptr<int32_t>();
  if (sched.has_value()) {
    TORCH_CHECK(sched->scalar_type() == at::kInt && sched->is_contiguous() && sched->numel() == 2,
                "ragged_prefill: sched must be a contiguous int32 [2] (zeros)");
    p.sched = sched->data_ptr<int32_t>();
  }
  p.scale = float(scale);
  p.dtype = dtype_code(q, "q");
  p.kv_dtype = p.dtype;
  p.cu_is_int64 = index_is_int64(cu_seqlens_q, "cu_seqlens_q");
  p.lens_is_int64 = index_is_int64(cu_seqlens_k, "cu_seqlens_k");
  p.causal = causal ? 1 : 0;
  p.pingpong = 1;
  p.overlap = 1;
  p.ragged = 1;
  p.num_tiles = tile_req.numel();
  p.num_q_heads = q.size(1);
  p.num_kv_heads = k.size(1);
  p.head_dim = q.size(2);
  p.head_dim_v = v.size(2);
  p.total_q = q.size(0);
  p.total_k = k.size(0);
  p.page_size = 1;
  copy_strides(p.q_stride, q);
  copy_strides(p.o_stride, out);
  p.cu_stride = cu_seqlens_q.stride(0);
  p.lens_stride = cu_seqlens_k.stride(0);
  check(hab_prefix_prefill(&p, stream_of(q)), "ragged_prefill");
}

// MLA decode (csrc/mla_decode_sm90.cu): q [B, T, Hq, 576], kv [N, P, 576] of q's dtype or
// fp8 (kv_scale: a 1-element float32 tensor, or kv_scale_value), out [B, T, Hq, 512] of
// q's dtype; lse [B, T, Hq] float32 (unsplit, optional); the scratch (max_logits, exp_sums
// [slots, rows], partial_out [slots, rows, 512] float32) for num_partitions > 1.
void mla_decode(at::Tensor& out, const std::optional<at::Tensor>& lse, const std::optional<at::Tensor>& max_logits,
                const std::optional<at::Tensor>& exp_sums, const std::optional<at::Tensor>& partial_out,
                const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_table,
                const at::Tensor& seq_lens, const std::optional<at::Tensor>& kv_scale, double kv_scale_value,
                double scale, int64_t num_partitions, int64_t partition_size) {
  TORCH_CHECK(q.dim() == 4 && out.dim() == 4 && kv_cache.dim() == 3, "mla_decode: q, out must be [B, T, Hq, W], kv [N, P, W]");
  TORCH_CHECK(q.stride(3) == 1 && out.stride(3) == 1 && kv_cache.stride(2) == 1,
              "mla_decode: the innermost dimension must be contiguous");
  const bool fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn || kv_cache.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK(out.scalar_type() == q.scalar_type() && (fp8 || kv_cache.scalar_type() == q.scalar_type()),
              "mla_decode: q and out share one 16-bit dtype, kv_cache q's or an fp8 dtype");
  c10::OptionalDeviceGuard guard(q.device());
  HabMlaDecodeParams p{};
  p.out = out.data_ptr();
  p.q = q.data_ptr();
  p.kv = kv_cache.data_ptr();
  p.block_table = block_table.data_ptr();
  p.seq_lens = seq_lens.data_ptr();
  p.scale = float(scale);
  p.dtype = dtype_code(q, "q");
  p.kv_dtype = dtype_code(kv_cache, "kv_cache");
  p.kv_scale_ptr = fp8 ? scale_ptr(kv_scale, "kv_scale") : nullptr;
  p.kv_scale_value = float(kv_scale_value);
  p.table_is_int64 = index_is_int64(block_table, "block_table");
  p.lens_is_int64 = index_is_int64(seq_lens, "seq_lens");
  p.num_seqs = q.size(0);
  p.num_tokens = q.size(1);
  p.num_heads = q.size(2);
  p.width = q.size(3);
  p.rank = out.size(3);
  p.page_size = kv_cache.size(1);
  p.num_blocks = kv_cache.size(0);
  p.max_blocks = block_table.size(1);
  p.num_partitions = num_partitions;
  p.partition_size = partition_size;
  copy_strides(p.q_stride, q, 3);
  copy_strides(p.o_stride, out, 3);
  copy_strides(p.kv_stride, kv_cache, 2);
  copy_strides(p.bt_stride, block_table);
  p.lens_stride = seq_lens.stride(0);
  if (lse.has_value()) {
    TORCH_CHECK(lse->scalar_type() == at::kFloat && lse->dim() == 3, "mla_decode: lse must be float32 [B, T, Hq]");
    p.lse = lse->data_ptr<float>();
    copy_strides(p.lse_stride, *lse);
  }
  if (num_partitions > 1) {
    TORCH_CHECK(max_logits.has_value() && exp_sums.has_value() && partial_out.has_value(),
                "mla_decode: a split launch needs its scratch");
    TORCH_CHECK(max_logits->scalar_type() == at::kFloat && exp_sums->scalar_type() == at::kFloat &&
                    partial_out->scalar_type() == at::kFloat && max_logits->dim() == 2 &&
                    exp_sums->strides() == max_logits->strides() && partial_out->dim() == 3 &&
                    partial_out->stride(2) == 1,
                "mla_decode: the scratch must be float32 [slots, rows] x 2 and [slots, rows, 512]");
    p.max_logits = max_logits->data_ptr<float>();
    p.exp_sums = exp_sums->data_ptr<float>();
    p.partial_out = partial_out->data_ptr<float>();
    copy_strides(p.ml_stride, *max_logits);
    copy_strides(p.po_stride, *partial_out, 2);
  }
  check(hab_mla_decode(&p, stream_of(q)), "mla_decode");
}

int64_t warp_size() { return hab_runtime_warp_size(); }

int64_t decode_programs_per_sm(at::ScalarType q_dtype, at::ScalarType kv_dtype, int64_t head_dim, int64_t rows,
                               int64_t loop_stages, int64_t loop_tile) {
  check_decode_loop(loop_stages, loop_tile, "decode_programs_per_sm");
  return hab_decode_programs_per_sm(dtype_code(q_dtype, "q_dtype"), dtype_code(kv_dtype, "kv_dtype"), int(head_dim),
                                    int(rows), int(loop_stages), int(loop_tile));
}

}  // namespace

TORCH_LIBRARY(hygon_attn, m) {
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
        "Tensor? k_scale, Tensor? v_scale, float k_scale_value, float v_scale_value) -> ()");
  m.def("copy_blocks(Tensor(a!) cache, Tensor block_mapping, int[] sizes, int[] strides) -> ()");
  m.def("paged_decode(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor seq_lens, Tensor? sinks, Tensor? k_scale, Tensor? v_scale, Tensor(b!) max_logits, "
        "Tensor(c!) exp_sums, Tensor(d!) partial_out, float scale, float k_scale_value, "
        "float v_scale_value, float soft_cap, int sliding_window, int partition_size, "
        "int num_partitions, int loop_stages, int loop_tile, bool combine_pdl, int max_rows) -> ()");
  m.def("prefix_prefill(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor? k_new, Tensor? v_new, "
        "Tensor(b!)? lse, Tensor? sinks, Tensor block_table, Tensor cu_seqlens_q, Tensor seq_lens_k, "
        "Tensor tile_req, Tensor tile_mblock, Tensor(c!)? sched, float scale, float soft_cap, bool causal, int sliding_window, "
        "bool pingpong, bool overlap, Tensor? k_scale, Tensor? v_scale, float k_scale_value, "
        "float v_scale_value) -> ()");
  m.def("ragged_prefill(Tensor(a!) out, Tensor q, Tensor k, Tensor v, Tensor(b!)? lse, Tensor cu_seqlens_q, "
        "Tensor cu_seqlens_k, Tensor tile_req, Tensor tile_mblock, Tensor(c!)? sched, float scale, bool causal) -> ()");
  m.def("mla_decode(Tensor(a!) out, Tensor(b!)? lse, Tensor(c!)? max_logits, Tensor(d!)? exp_sums, "
        "Tensor(e!)? partial_out, Tensor q, Tensor kv_cache, Tensor block_table, Tensor seq_lens, Tensor? kv_scale, "
        "float kv_scale_value, float scale, int num_partitions, int partition_size) -> ()");
  m.def("warp_size() -> int", &warp_size);
  m.def("decode_programs_per_sm(ScalarType q_dtype, ScalarType kv_dtype, int head_dim, int rows, int loop_stages, "
        "int loop_tile) -> int",
        &decode_programs_per_sm);
}

TORCH_LIBRARY_IMPL(hygon_attn, CUDA, m) {
  m.impl("write_kv", &write_kv);
  m.impl("copy_blocks", &copy_blocks);
  m.impl("paged_decode", &paged_decode);
  m.impl("prefix_prefill", &prefix_prefill);
  m.impl("ragged_prefill", &ragged_prefill);
  m.impl("mla_decode", &mla_decode);
}
