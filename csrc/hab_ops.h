// hab_ops.h: the native entry points, plain C++ (no torch, no CUDA/HIP headers).
//
// Every entry point takes raw device pointers, int64 sizes and strides in elements, and a
// stream as void* (cudaStream_t / hipStream_t). It launches asynchronously on that stream
// and returns nullptr on success or a static message naming what went wrong. Arguments
// are validated by the caller (hygon_attn_backend/ops/*.py); the kernels still never
// read or write outside the caches: bad slots and block ids are skipped.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// dtype codes shared with binding.cpp
enum HabDtype {
  HAB_F16 = 0,
  HAB_BF16 = 1,
  HAB_F32 = 2,
  HAB_FP8_E4M3 = 3,  // float8_e4m3fn
  HAB_FP8_E5M2 = 4,
};

// write_kv: k/v [num_tokens, H, D] -> caches. K cache: canonical [N, H, P, D] strides
// (kc_stride_x = 0) or the split-x cache [N, H, D/x, P, x] (k_split_x = x, kc_stride_d is
// the D/x chunk stride and kc_stride_x the innermost one).
typedef struct HabWriteKvParams {
  const void* k;
  const void* v;
  void* k_cache;
  void* v_cache;
  const void* slot_mapping;  // int32 or int64
  const float* k_scale_ptr;  // fp8 scales as device tensors (1 element, or one per KV head), or null
  const float* v_scale_ptr;
  float k_scale_value;  // used when the pointer is null
  float v_scale_value;
  int32_t k_scale_stride, v_scale_stride;  // per KV head 1, per tensor 0
  int src_dtype;    // HabDtype: F16 / BF16 / F32
  int cache_dtype;  // HabDtype: any
  int slot_is_int64;
  int64_t num_tokens, num_kv_heads, head_dim, page_size, num_blocks;
  int64_t k_split_x;
  int64_t slot_stride;
  int64_t k_stride[3], v_stride[3];  // (token, head, dim)
  int64_t kc_stride_b, kc_stride_h, kc_stride_s, kc_stride_d, kc_stride_x;
  int64_t vc_stride_b, vc_stride_h, vc_stride_s, vc_stride_d;
} HabWriteKvParams;

const char* hab_write_kv(const HabWriteKvParams* p, void* stream);

// copy_blocks on one cache: cache[dst] = cache[src] for each (src, dst) row, raw bits.
// The inner index space of a block is up to 4 axes (sizes, strides), merged by the caller.
typedef struct HabCopyBlocksParams {
  void* cache;
  const void* block_mapping;  // [num_pairs, 2] int32 / int64
  int map_is_int64;
  int elem_size;  // 1, 2, 4 or 8 bytes
  int64_t num_pairs, num_blocks, block_stride;
  int64_t map_stride_n, map_stride_c;
  int64_t sizes[4], strides[4];
} HabCopyBlocksParams;

const char* hab_copy_blocks(const HabCopyBlocksParams* p, void* stream);

// paged decode. q/out [S, T, Hq, D] (strides), caches canonical [N, Hkv, P, D] views
// (k_split_x > 0: K is [N, Hkv, D/x, P, x]); block_table [S, max_blocks]; seq_lens [S].
// num_partitions > 1: partitions of partition_size tokens write (m, l, o) into the
// workspace at slot seq * num_partitions + part, row t * Hq + h, then a combine kernel
// writes out. soft_cap <= 0: off; sliding_window <= 0: off; sinks null: off.
typedef struct HabDecodeParams {
  void* out;
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const void* block_table;
  const void* seq_lens;
  const float* sinks;  // [Hq] float32 or null
  const float* k_scale_ptr;
  const float* v_scale_ptr;
  float* max_logits;   // [slots, rows] float32
  float* exp_sums;     // [slots, rows] float32
  float* partial_out;  // [slots, rows, D] float32
  float scale, k_scale_value, v_scale_value, soft_cap;
  int32_t k_scale_stride, v_scale_stride;  // the scale tensors: per KV head 1, per tensor 0
  int q_dtype;    // F16 / BF16
  int out_dtype;  // F16 / BF16 / F32
  int kv_dtype;   // = q_dtype, or FP8_E4M3 / FP8_E5M2
  int table_is_int64, lens_is_int64;
  int64_t num_seqs, num_tokens, num_q_heads, num_kv_heads, head_dim;
  int64_t page_size, num_blocks, max_blocks_per_seq, k_split_x;
  int64_t sliding_window, partition_size, num_partitions;
  // 0: the shared-softmax loop; 2 to 4: the split-N loop (where it applies: 16-bit KV of
  // q's dtype, or fp8 KV at head_dim 80-128 in 16-byte rows) with that many cp.async stages. loop_tile: the split-N loop's KV tile, 64 (the only one built).
  // Planned by the caller (the decode op's tuning).
  int64_t loop_stages, loop_tile;
  // 1: a split launch starts its combine kernel as a programmatic dependent launch of the
  // decode kernel (NVIDIA sm_90+; planned by the decode op's tuning), 0: a plain launch. Ignored
  // on HIP and without a split.
  int64_t combine_pdl;
  // Query rows a program takes at most: 0 lets the launch decide (64, or 32 where a 64-row
  // program's shared memory is past the device's limit, e.g. D >= 128 on a 64 KB gfx9);
  // 32 forces 32-row programs (tests of that route). More rows run in row chunks.
  int64_t max_rows;
  int64_t q_stride[4], o_stride[4];  // (seq, token, head, dim)
  int64_t k_stride[5];               // (block, head, slot, dim, chunk); chunk: split-x only
  int64_t v_stride[4];               // (block, head, slot, dim)
  int64_t bt_stride[2], lens_stride;
  int64_t ml_stride[2];  // max_logits / exp_sums (slot, row)
  int64_t po_stride[3];  // partial_out (slot, row, dim)
} HabDecodeParams;

const char* hab_paged_decode(const HabDecodeParams* p, void* stream);

// prefix prefill ("extend") on sm_90a (wgmma): new tokens of each request attend to its
// paged prefix and to themselves under j <= i + (Lk - Lq) (causal), head_dim 128, fp16 or
// bf16 q (the caches q's dtype or fp8). q/out [total_q, Hq, 128], caches [N, Hkv, P, 128]
// views, k_new/v_new [total_q, Hkv, 128] or null (then every key is in the cache),
// innermost stride 1 and rows 16-byte aligned (checked by the caller). The tile map
// (tile_req, tile_mblock: num_tiles int32, req < 0 unused) has blocks of 128 / group
// tokens. A block id outside [0, num_blocks) or a table column past max_blocks is an
// absent key. Ragged (the same kernel): dense K/V of their own lengths, q/k 128 or 192
// wide, v 128, 16-bit (out [total_q, Hq, 128]).
typedef struct HabPrefillParams {
  void* out;
  const void* q;
  const void* k_cache;
  const void* v_cache;
  const void* k_new;  // null: every key in the cache
  const void* v_new;
  float* lse;          // [total_q, Hq] float32 natural log, or null
  const float* sinks;  // [Hq] float32 or null
  const void* block_table;
  const void* cu_seqlens_q;
  // [B] int32 / int64 every key of a request; ragged: cu_seqlens_k [B + 1], request b's
  // keys rows cu_seqlens_k[b] .. cu_seqlens_k[b + 1] of k_new / v_new (no cache)
  const void* seq_lens_k;
  const int32_t* tile_req;
  const int32_t* tile_mblock;
  // [2] int32, zero between launches, or null. Set: a persistent launch (one program an
  // SM taking work items from sched[0]; the last program resets both words), so a
  // plan's launches must not run concurrently. Null: one program per work item.
  int32_t* sched;
  float scale, soft_cap;  // soft_cap <= 0: off
  int dtype;              // F16 / BF16 (q, out; the caches and k_new / v_new when 16-bit)
  int kv_dtype;           // = dtype, or FP8_E4M3 / FP8_E5M2 (then no k_new / v_new)
  const float* k_scale_ptr;  // fp8: the caches' scales as device tensors (1 element, or one per KV head), or null
  const float* v_scale_ptr;
  float k_scale_value, v_scale_value;  // fp8: used when the pointer is null
  int32_t k_scale_stride, v_scale_stride;  // per KV head 1, per tensor 0
  int table_is_int64, cu_is_int64, lens_is_int64;
  int causal;
  // 1: the two consumer warpgroups take turns issuing S = Q K^T (named barriers), so one's
  // softmax runs under the other's matrix products; 0: each issues when its data is there
  int pingpong;
  // 1: a warpgroup issues S of the next tile with P V of this one (intra-warpgroup
  // overlap); 0: one tile at a time
  int overlap;
  // 1: ragged dense attention (MLA's up-projected prefill): every key from k_new / v_new,
  // request b's at rows cu_seqlens_k[b] (seq_lens_k holds cu_seqlens_k), no cache, no
  // block table; the mask bottom-right causal as for a prefix of Lk - Lq keys
  int ragged;
  int64_t num_tiles, num_q_heads, num_kv_heads;
  int64_t head_dim, head_dim_v;  // q / k and v heads: 128 / 128, or 192 / 128 (16-bit only)
  // rows of q / out and (ragged) of k_new / v_new: a row outside them is never read or
  // written, whatever the offsets say
  int64_t total_q, total_k;
  int64_t page_size, num_blocks, max_blocks, sliding_window;  // sliding_window <= 0: off
  int64_t q_stride[2], o_stride[2];    // (token, head)
  int64_t k_stride[3], v_stride[3];    // (block, head, slot)
  int64_t kn_stride[2], vn_stride[2];  // (token, head)
  int64_t lse_stride[2];               // (token, head)
  int64_t bt_stride[2], cu_stride, lens_stride;
} HabPrefillParams;

const char* hab_prefix_prefill(const HabPrefillParams* p, void* stream);

// MLA decode on sm_90a (wgmma) over a paged latent cache: one latent row of 576 values a
// token (kv_lora_rank 512 + rope 64), the key the whole row, the value its first 512; the
// query rows of a request (row = t * Hq + h of T tokens x Hq heads) share every key. q
// [B, T, Hq, 576] fp16/bf16, kv [num_blocks, P, 576] of q's dtype or fp8 (e4m3fn / e5m2
// codes of value / kv_scale), views with innermost stride 1 and rows 16-byte aligned
// (checked by the caller). Token t of a request sees keys
// j <= seq_len - T + t. A block id outside [0, num_blocks) or a key past the table's
// max_blocks * P is absent. Unsplit (num_partitions 1): out [B, T, Hq, 512] q's dtype and
// lse (natural log, or null). Split: partition z of each sequence (the length over
// num_partitions, >= partition_size keys, a multiple of 64) writes its running max (log2
// units), sum and normalised partial output to the scratch slot seq * num_partitions + z,
// as the Triton MLA decode does (kernels/mla_decode.py; its combine merges them).
typedef struct HabMlaDecodeParams {
  void* out;            // [B, T, Hq, 512] (unsplit)
  float* lse;           // [B, T, Hq] or null (unsplit)
  float* max_logits;    // [slots, rows] (split)
  float* exp_sums;      // [slots, rows] (split)
  float* partial_out;   // [slots, rows, 512] (split)
  const void* q;
  const void* kv;
  const void* block_table;  // [B, max_blocks] int32 / int64
  const void* seq_lens;     // [B] int32 / int64
  const float* kv_scale_ptr;  // fp8 cache: its per-tensor scale, a 1-element device tensor, or null
  float kv_scale_value;       // used when the pointer is null
  float scale;
  int dtype;     // F16 / BF16: q and out
  int kv_dtype;  // dtype, FP8_E4M3 or FP8_E5M2
  int table_is_int64, lens_is_int64;
  int64_t num_seqs, num_tokens, num_heads, width, rank;
  int64_t page_size, num_blocks, max_blocks, num_partitions, partition_size;
  int64_t q_stride[3], o_stride[3], lse_stride[3];  // (seq, token, head)
  int64_t kv_stride[2];                             // (block, slot)
  int64_t bt_stride[2], lens_stride;
  int64_t ml_stride[2], po_stride[2];  // max_logits / exp_sums, partial_out: (slot, row)
} HabMlaDecodeParams;

const char* hab_mla_decode(const HabMlaDecodeParams* p, void* stream);

// Programs of the paged-decode kernel that fit on one multiprocessor at once (the
// runtime's occupancy calculator) for queries of q_dtype, a KV cache of kv_dtype, head_dim,
// `rows` query rows per KV head (G * T) and loop_stages / loop_tile as in HabDecodeParams,
// assuming 16-byte aligned contiguous K/V rows; -1 on error (no device, bad argument).
int hab_decode_programs_per_sm(int q_dtype, int kv_dtype, int head_dim, int rows, int loop_stages, int loop_tile);

// Lanes per warp of the current device (32 on NVIDIA, 64 on gfx9), or -1 with no device.
int hab_runtime_warp_size(void);

#ifdef __cplusplus
}
#endif
