// The native prefill's work items and the shared-memory layout of a program (sm_90a):
// the constants, the TileInfo of a (request, m_block) tile x KV head, its hand-over from
// the producers to the consumers, the barriers and the work counter. Included by
// prefill_sm90.cu (the kernel and its design notes).
#pragma once

#include "compat.h"
#include "hab_ops.h"

#if defined(HAB_CUDA)
#include "sm90.cuh"

namespace hab_prefill {


constexpr int BLOCK_M = 128;  // query rows of a program: two consumer warpgroups x 64
constexpr int BLOCK_N = 128;  // keys per K/V tile
constexpr int HEAD_DIM = 128;  // the value head, and the query/key head of a cache
constexpr int MLA_HEAD_DIM = 192;  // the query/key head of MLA's up-projected prefill (ragged)
// K/V ring stages of 16-bit caches (3 x 64 KB + Q fit in 227 KB) and the registers a
// producer thread keeps (setmaxnreg), so 216 a consumer: the measured best (3 stages
// +1-6% over 2; 64 producer registers +2-7% over 56 / 224, 80 / 208 and beyond lose 1-4%;
// docs/history.md).
constexpr int CONSUMER_WARPS = 8;
constexpr int PRODUCER_WARPS = 4;
constexpr int THREADS = (CONSUMER_WARPS + PRODUCER_WARPS) * 32;

constexpr int PANEL_BYTES = 128 * 128;       // 128 rows x 64 channels x 2 bytes
constexpr int TILE_BYTES = 2 * PANEL_BYTES;  // 128 rows x 128 channels (Q, a K or a V tile)
constexpr int INFO_WORDS = 8;

// Shared memory of a program (3 ring stages: Q + 3 x 64 KB fit in 227 KB) and the
// registers a producer keeps. FP8 (fp8 caches): the producers hold the next K and V
// tiles' codes in registers (104 a thread, 200 left to a consumer: measured 1.24 ms
// where 96 spills, 1.42, and 112 / 192 is level) and widen them into the 16-bit ring;
// Q's row scales (QSCALE, [BLOCK_M] float) come with Q. D_QK: the query/key head; at 192
// (MLA, 16-bit) a Q or K tile is three 64-channel panels (48 KB) and the ring two stages
// (Q + 2 x 80 KB = 208 KB).
template <bool FP8, int D_QK = HEAD_DIM>
struct Layout {
  static_assert(D_QK == HEAD_DIM || (D_QK == MLA_HEAD_DIM && !FP8), "q/k head 128, or 192 with 16-bit K/V");
  static constexpr int QK_PANELS = D_QK / 64;
  static constexpr int QK_TILE_BYTES = QK_PANELS * PANEL_BYTES;  // [128 rows x D_QK] a Q or K tile
  static constexpr int STAGES = D_QK == HEAD_DIM ? 3 : 2;
  static constexpr int PRODUCER_REGS = FP8 ? 104 : 64;
  static constexpr int Q_OFF = 0;
  static constexpr int K_OFF = QK_TILE_BYTES;
  static constexpr int V_OFF = K_OFF + STAGES * QK_TILE_BYTES;
  static constexpr int QSCALE_OFF = V_OFF + STAGES * TILE_BYTES;
  static constexpr int BAR_OFF = QSCALE_OFF + (FP8 ? 4 * BLOCK_M : 0);  // mbarriers, key masks, work words
  static constexpr int MASK_OFF = BAR_OFF + 8 * (2 + 4 * STAGES);
  static constexpr int WORK_OFF = MASK_OFF + 16 * STAGES;
  static constexpr int INFO_OFF = WORK_OFF + 16;  // [INFO_WORDS] int32: the loaded part of a TileInfo
  static constexpr int SMEM_USED = INFO_OFF + 4 * INFO_WORDS;
  static constexpr int SMEM_BYTES = SMEM_USED + 1024;  // slack: the tiles start on a 1024-byte boundary
  static_assert(SMEM_BYTES <= 227 * 1024, "more shared memory than an sm_90 program may have");
};

// What every role of a program derives from its tile: the request's lengths, the rows'
// tokens and the key range walked.
struct TileInfo {
  int64_t req, q_start;
  int64_t k_start;  // ragged: the request's first row of k_new / v_new (producers only)
  int kv_head;
  int len_q, len_k, len_p;  // new tokens, all keys, prefix keys
  int group, tok_m, m_tok0;
  int diag_min, diag_max;  // global key position of the first / last row's token
  int key_end;             // keys [tile_lo * BLOCK_N, key_end) are walked
  int tile_lo, n_tiles;
  int32_t item;  // the work item
};

// Work item w is tile w / Hkv of the map and KV head w % Hkv (the heads of a tile are
// consecutive: the map's heaviest tiles come first). False: past the map's used tiles
// (every later item is too).
// What the loads give (the map's tile, the request's lengths) -> the rest of TileInfo.
HAB_DEV void derive_tile(const HabPrefillParams& p, int m_block, TileInfo& ti) {
  ti.len_p = ti.len_k - ti.len_q;
  ti.group = int(p.num_q_heads / p.num_kv_heads);
  ti.tok_m = BLOCK_M / ti.group;
  ti.m_tok0 = m_block * ti.tok_m;
  const int tok_hi = min(ti.len_q, ti.m_tok0 + ti.tok_m);  // > m_tok0 for a mapped tile
  ti.diag_min = ti.len_p + ti.m_tok0;
  ti.diag_max = ti.len_p + tok_hi - 1;
  ti.key_end = p.causal ? min(ti.len_k, ti.diag_max + 1) : ti.len_k;
  // every key in the cache: the keys past what a table row holds are absent, never walked
  // (a wild seq_lens_k costs no more than the table; with dense new K/V the prefix is
  // walked to len_p, its keys past the table masked)
  if (p.k_new == nullptr) ti.key_end = int(min(int64_t(ti.key_end), p.max_blocks * p.page_size));
  int key_lo = 0;
  if (p.causal && p.sliding_window > 0) key_lo = max(0, ti.diag_min - int(p.sliding_window) + 1);
  ti.tile_lo = key_lo / BLOCK_N;
  ti.n_tiles = max(0, int(hab_cdiv(ti.key_end, BLOCK_N)) - ti.tile_lo);
}

template <bool RAGGED>
HAB_DEV bool tile_info(const HabPrefillParams& p, int64_t w, TileInfo& ti) {
  if (w < 0 || w >= p.num_tiles * p.num_kv_heads) return false;
  ti.item = int32_t(w);
  const int64_t tile = w / p.num_kv_heads;
  const int32_t req = p.tile_req[tile];
  if (req < 0) return false;
  ti.req = req;
  ti.kv_head = int(w % p.num_kv_heads);
  ti.q_start = hab_load_index(p.cu_seqlens_q, p.cu_is_int64, int64_t(req) * p.cu_stride);
  ti.len_q = int(hab_load_index(p.cu_seqlens_q, p.cu_is_int64, int64_t(req + 1) * p.cu_stride) - ti.q_start);
  ti.k_start = 0;
  if (RAGGED) {
    // seq_lens_k holds cu_seqlens_k. Wild offsets (unchecked) answer as for offsets
    // clipped to q's and k's rows, as the Triton ragged kernel does
    const int64_t q_end = hab_load_index(p.cu_seqlens_q, p.cu_is_int64, int64_t(req + 1) * p.cu_stride);
    ti.len_q = ti.q_start >= 0 ? int(max(int64_t(0), min(q_end, p.total_q) - ti.q_start)) : 0;
    const int64_t k0 = hab_load_index(p.seq_lens_k, p.lens_is_int64, int64_t(req) * p.lens_stride);
    const int64_t k_end = hab_load_index(p.seq_lens_k, p.lens_is_int64, int64_t(req + 1) * p.lens_stride);
    ti.len_k = k0 >= 0 ? int(max(int64_t(0), min(k_end, p.total_k) - k0)) : 0;
    ti.k_start = max(k0, int64_t(0));
  } else {
    ti.len_k = int(hab_load_index(p.seq_lens_k, p.lens_is_int64, int64_t(req) * p.lens_stride));
  }
  derive_tile(p, p.tile_mblock[tile], ti);
  return true;
}

// The loaded part of an item's TileInfo as INFO_WORDS int32 in shared memory: the
// producers load it once, the consumers derive the rest (no dependent global loads at an
// item's start; what comes from the parameters stays in uniform registers).
HAB_DEV void store_info(int32_t* d, const TileInfo& ti) {
  const int32_t v[INFO_WORDS] = {ti.item, int32_t(ti.req), int32_t(ti.q_start), int32_t(ti.q_start >> 32),
                                 ti.len_q, ti.len_k, ti.m_tok0 / ti.tok_m, ti.kv_head};
#pragma unroll
  for (int i = 0; i < INFO_WORDS; ++i) d[i] = v[i];
}

HAB_DEV void load_info(const HabPrefillParams& p, const volatile int32_t* d, TileInfo& ti) {
  int32_t v[INFO_WORDS];
#pragma unroll
  for (int i = 0; i < INFO_WORDS; ++i) v[i] = d[i];
  ti.item = v[0];
  ti.req = v[1];
  ti.q_start = int64_t(uint32_t(v[2])) | (int64_t(v[3]) << 32);
  ti.len_q = v[4];
  ti.len_k = v[5];
  ti.kv_head = v[7];
  derive_tile(p, v[6], ti);
}

struct Barriers {
  uint64_t* full_q;   // Q and the work word of a work item are in
  uint64_t* empty_q;  // the consumers are done with Q (and have read the work word)
  uint64_t* full_k;  // [Layout::STAGES]
  uint64_t* full_v;
  uint64_t* empty_k;
  uint64_t* empty_v;
  uint32_t* mask;  // [Layout::STAGES][4] key bits of the K stage
  float* q_inv;    // FP8: [BLOCK_M] 1 / each Q row's scale (the rows are widened to fp16)
  int32_t* work;   // [1] the work item the consumers run next (-1: none left)
  int32_t* fetch;  // [2] the producers' copy of the item they fetched (double-buffered)
  int32_t* info;   // [INFO_WORDS] the loaded part of the work word's TileInfo
};

// The next work item of this program. Persistent (p.sched set): from the launch's counter,
// so programs that finish early take more; one item per program otherwise.
HAB_DEV int32_t fetch_work(const HabPrefillParams& p, int round) {
  if (p.sched != nullptr) return atomicAdd(p.sched, 1);
  return round == 0 ? int32_t(blockIdx.x) : -1;
}

}  // namespace hab_prefill
#endif  // HAB_CUDA
