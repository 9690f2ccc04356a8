// Paged decode attention, the DCU design: grid (kv_head x row chunk, seq, partition).
//
// One program (NUM_WARPS warps) owns one KV head of one sequence over one partition of
// its keys, and computes all ROWS query rows of that head's GQA group (and of every
// speculative token: row r is token r / G, query head kv_head * G + r % G) against each
// K/V tile it loads once. ROWS is the group size rounded up to {1, 2, 4, ..., 64} (a
// template parameter; extra rows masked); more than 64 rows are split into row chunks.
//
// Per KV tile of BLOCK_N tokens:
//   stage   K, V tile -> shared memory (the next tile's loads are issued into registers
//           before this tile is computed: the loads of one overlap the math of the other).
//           Tokens past the partition, past the table or with a bad block id are zeros
//           and masked (never read).
//   S       = Q K^T on the warp tile unit (tile_mma.cuh): [ROWS_PAD, BLOCK_N] fp32
//   softmax online, in exp2 units (qk_scale = scale * k_scale * log2 e), one warp a row
//   O      += P V on the warp tile unit: [ROWS_PAD, HEAD_DIM_PAD] fp32, in registers
// End: out = O * v_scale / l (one partition), or (m, l, O * v_scale / l) into the
// workspace for the combine kernel (several partitions).
#pragma once

#include "compat.h"
#include "fastdiv.h"
#include "fp8.cuh"
#include "fp8_widen.h"
#include "hab_ops.h"
#include "tile_mma.cuh"

namespace hab_decode {

constexpr int NUM_WARPS = 4;
constexpr int MAX_SPLIT_N_STAGES = 4;  // what the loop's code handles; the entry takes 2 and 3 (decode.cu)
constexpr int SPLIT_N_TOKENS = 64;      // the split-N loop's KV tile
constexpr float LOG2E = 1.4426950408889634f;
// the split-N loop's KV formats (a template parameter): the query's 16-bit dtype, or fp8
enum KvFormat { KV_16BIT = 0, KV_E4M3 = 1, KV_E5M2 = 2 };

template <int HEAD_DIM_PAD> struct TileN { static constexpr int value = HEAD_DIM_PAD > 128 ? 32 : 64; };

template <int ROWS, int HEAD_DIM_PAD>
struct Layout {
  static constexpr int BLOCK_N = TileN<HEAD_DIM_PAD>::value;
  static constexpr int RT = (ROWS + 15) / 16;       // 16-row tiles
  static constexpr int MP = RT * 16;                // padded rows
  static constexpr int LDK = HEAD_DIM_PAD + 8;          // K, V, Q row stride (16 B pad: no bank conflicts)
  static constexpr int LDP = BLOCK_N + 8;           // P row stride
  static constexpr int LDS = BLOCK_N + 4;           // S row stride (floats)
  static constexpr int CH = HEAD_DIM_PAD / 8;           // 8-element chunks of a row
  // shared memory, in bytes (all offsets 16 B aligned)
  static constexpr int Q_OFF = 0;
  static constexpr int K_OFF = Q_OFF + MP * LDK * 2;
  static constexpr int V_OFF = K_OFF + BLOCK_N * LDK * 2;
  static constexpr int P_OFF = V_OFF + BLOCK_N * LDK * 2;
  static constexpr int S_OFF = P_OFF + MP * LDP * 2;
  static constexpr int M_OFF = S_OFF + MP * LDS * 4;       // m, l, alpha: [MP] floats each
  static constexpr int OK_OFF = M_OFF + 3 * MP * 4;        // token visible flags [BLOCK_N]
  static constexpr int BYTES = OK_OFF + BLOCK_N * 4;
  static_assert(HEAD_DIM_PAD % 16 == 0, "head_dim must be a multiple of 16");
};

// The split-N loop's shared memory for KV tiles of SPLIT_N_TOKENS tokens (decode_split_n.cuh):
// Q (16 rows), then 2..MAX_SPLIT_N_STAGES cp.async stages of (K, V, token flags), then two
// tiles' (block, slot) per token; the slices' merge (decode_split_n.cuh) reuses the stages.
// KVB: bytes of a cached element, 2 (16-bit KV) or 1 (fp8 KV).
template <int HEAD_DIM_PAD, int KVB = 2>
struct SplitNGeometry {
  static constexpr int SN_TOKENS = SPLIT_N_TOKENS;
  typedef Layout<16, HEAD_DIM_PAD> L;
  static constexpr int SLICES = SN_TOKENS / 16;                 // 16-token slices of a tile
  static constexpr int CTW = HEAD_DIM_PAD / 16 / (NUM_WARPS / SLICES);  // O column tiles a warp
  // A staged K or V row is HEAD_DIM_PAD channels with no padding (ROW_BYTES), its 16-byte
  // chunk c stored at chunk c ^ (row % 8): each 128-byte line of the cache lands in one
  // aligned 128-byte segment of shared memory, and the 8 rows of an ldmatrix matrix read 8
  // different bank groups. (Rows padded by 16 bytes, conflict-free as well, streamed 6-8%
  // slower on the H200: docs/history.md.)
  static constexpr int ROW_BYTES = HEAD_DIM_PAD * KVB;
  static constexpr int ROW_CH = ROW_BYTES / 16;  // 16-byte chunks a row
  static_assert(ROW_CH % 8 == 0, "the swizzle permutes 8 chunks of 16 bytes");
  HAB_DEV static int kv_off(int row, int chunk) { return row * ROW_BYTES + 16 * (chunk ^ (row & 7)); }  // bytes
  static constexpr int STAGE_BYTES = 2 * SN_TOKENS * ROW_BYTES + SN_TOKENS;  // K, V, token flags (bytes)
  // the slices' merge after the loop: (m, l) and O rows padded to LDO floats, then the
  // rows' output offsets; it reuses the stages (and the block-id area past them)
  static constexpr int LDO = HEAD_DIM_PAD + 8;
  static constexpr int MERGE_BYTES = SLICES * 16 * (2 + LDO) * 4 + 16 * 8;
  // after the stages: two tiles' (block, slot) per token, int2 [2][SN_TOKENS]
  static constexpr int loop_bytes(int stages) { return stages * STAGE_BYTES + 2 * SN_TOKENS * 8; }
  static constexpr int bytes(int stages) {
    return L::K_OFF + (loop_bytes(stages) > MERGE_BYTES ? loop_bytes(stages) : MERGE_BYTES);
  }
  static_assert(NUM_WARPS % SLICES == 0 && CTW * (NUM_WARPS / SLICES) * 16 == HEAD_DIM_PAD,
                "the warps split a tile's tokens and O's channels evenly");
};

// out[off] = val in the output dtype (fp32, bf16 or fp16)
HAB_DEV void store_out(const HabDecodeParams& p, int64_t off, float val) {
  if (p.out_dtype == HAB_F32) static_cast<float*>(p.out)[off] = val;
  else if (p.out_dtype == HAB_BF16) static_cast<uint16_t*>(p.out)[off] = HabBf16::from_float(val);
  else static_cast<uint16_t*>(p.out)[off] = HabHalf::from_float(val);
}

// out[off .. off + 3] = v in the output dtype, one 8-byte (16-bit out) or 16-byte (fp32)
// store: out's channels contiguous and `off` a multiple of 4 on an aligned base (Flags::o_vec)
HAB_DEV void store_out4(const HabDecodeParams& p, int64_t off, const float (&v)[4]) {
  if (p.out_dtype == HAB_F32) {
    *reinterpret_cast<float4*>(static_cast<float*>(p.out) + off) = make_float4(v[0], v[1], v[2], v[3]);
    return;
  }
  uint2 w;
  if (p.out_dtype == HAB_BF16) {
    w.x = hab_pack2(HabBf16::from_float(v[0]), HabBf16::from_float(v[1]));
    w.y = hab_pack2(HabBf16::from_float(v[2]), HabBf16::from_float(v[3]));
  } else {
    w.x = hab_pack2(HabHalf::from_float(v[0]), HabHalf::from_float(v[1]));
    w.y = hab_pack2(HabHalf::from_float(v[2]), HabHalf::from_float(v[3]));
  }
  *reinterpret_cast<uint2*>(static_cast<uint16_t*>(p.out) + off) = w;
}

// 8 KV elements (one chunk) as compute-dtype bits, from fp8 codes held in a uint2 (exact:
// every fp8 value is a 16-bit float of either kind; fp8_widen.h)
template <typename KIND, typename FMT>
HAB_DEV uint4 fp8x8_to(uint2 codes) {
  constexpr bool E4M3 = FMT::kMant == 3, BF16 = KIND::kCode == HabBf16::kCode;
  uint4 w;
  hab_fp8x4_widen<E4M3, BF16>(codes.x, w.x, w.y);
  hab_fp8x4_widen<E4M3, BF16>(codes.y, w.z, w.w);
  return w;
}

// One 8-element chunk of a cache row, element by element (layouts whose channels are not
// contiguous, e.g. V transposed).
HAB_DEV uint4 load_chunk_strided(const uint8_t* base, int64_t off, int64_t stride_d, int elem_bytes) {
  uint32_t w[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int64_t o = off + i * stride_d;
    const uint32_t x = elem_bytes == 2 ? uint32_t(reinterpret_cast<const uint16_t*>(base)[o]) : uint32_t(base[o]);
    if (elem_bytes == 2) w[i >> 1] |= x << (16 * (i & 1));
    else w[i >> 2] |= x << (8 * (i & 3));
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// How a tile's chunks are read: 16-byte vectors (16-bit KV, contiguous channels), 8-byte
// vectors (fp8 KV), or element by element (any strides).
enum LoadMode { LOAD_VEC16 = 0, LOAD_VEC8 = 1, LOAD_STRIDED = 2 };

template <int MODE>
HAB_DEV uint4 load_chunk(const uint8_t* base, int64_t off, int64_t stride_d, int elem_bytes) {
  if (MODE == LOAD_VEC16) return *reinterpret_cast<const uint4*>(base + off * 2);
  if (MODE == LOAD_VEC8) {
    const uint2 c = *reinterpret_cast<const uint2*>(base + off);
    return make_uint4(c.x, c.y, 0u, 0u);
  }
  return load_chunk_strided(base, off, stride_d, elem_bytes);
}

template <typename KIND>
HAB_DEV uint4 fp8_to_compute(uint4 raw, int kv_dtype) {
  if (kv_dtype == HAB_FP8_E4M3) return fp8x8_to<KIND, HabE4M3>(make_uint2(raw.x, raw.y));
  return fp8x8_to<KIND, HabE5M2>(make_uint2(raw.x, raw.y));
}

// What a thread needs to address its chunks of a K/V tile.
// Block and slot strides are 32-bit and non-negative (the entry point checks), so a
// chunk's offset is one wide multiply-add on the block id plus 32-bit math.
struct StageGeometry {
  const uint8_t* k_base;
  const uint8_t* v_base;
  int64_t k_doff, v_doff, k_sd;  // channel offsets of the thread's chunk, K's channel stride
  HabFastDiv page;  // token index -> (block, slot)
  int k_block, k_slot, v_block, v_slot;  // strides of a block and of a slot, in elements
  int n0, kv_bytes;
  bool d_ok;  // the chunk is inside head_dim
  HAB_DEV int slot_of(int token) const { return page.mod(token, page.div(token)); }
  // block >= 0, strides >= 0: an unsigned 32 x 32 -> 64 multiply (one wide IMAD)
  HAB_DEV int64_t k_row(int block, int slot) const {  // channel 0 of the head's row
    return int64_t(uint64_t(uint32_t(block)) * uint32_t(k_block)) + slot * k_slot;
  }
  HAB_DEV int64_t v_row(int block, int slot) const {
    return int64_t(uint64_t(uint32_t(block)) * uint32_t(v_block)) + slot * v_slot;
  }
  HAB_DEV int64_t k_offset(int block, int slot) const { return k_row(block, slot) + k_doff; }  // the thread's chunk
  HAB_DEV int64_t v_offset(int block, int slot) const { return v_row(block, slot) + v_doff; }
};

// Issue the K and V loads of one tile: item i is token start + n0 + i * STEP of block
// pg[i] (-1: zeros, nothing read).
template <int MODE, int ITEMS, int STEP>
HAB_DEV void issue_loads(uint4 (&k_reg)[ITEMS], uint4 (&v_reg)[ITEMS], const int (&pg)[ITEMS], int start,
                         const StageGeometry& g, const HabDecodeParams& p) {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    k_reg[i] = make_uint4(0u, 0u, 0u, 0u);
    v_reg[i] = make_uint4(0u, 0u, 0u, 0u);
    if (pg[i] >= 0 && g.d_ok) {
      const int slot = g.slot_of(start + g.n0 + i * STEP);
      const int64_t k_off = g.k_offset(pg[i], slot);
      const int64_t v_off = g.v_offset(pg[i], slot);
      k_reg[i] = load_chunk<MODE>(g.k_base, k_off, g.k_sd, g.kv_bytes);
      v_reg[i] = load_chunk<MODE>(g.v_base, v_off, p.v_stride[3], g.kv_bytes);
    }
  }
}

struct Flags {  // per launch, computed on the host
  int k_vec, v_vec;  // K / V rows read as 16-byte chunks
  int q_vec;         // Q rows read as 16-byte chunks
  int po_vec;        // the split workspace's partial rows written / read as 16-byte float4
  int o_vec;         // out's rows written 4 channels a store (8 bytes at 16 bits, 16 at fp32)
  int split_n;  // mma.sync targets, <= 16 rows, head_dim <= 128: 1, the split-N loop where it applies; 0: off
  int stages;   // the split-N loop's cp.async stages, 2..MAX_SPLIT_N_STAGES (stages - 1 tiles in flight)
  int* programs_per_sm;  // host pointer: set, the launcher writes the occupancy there and launches nothing
  int kv16;     // fp8 K and V rows read as 16-byte chunks of 16 channels (the fp8 split-N loop)
};

// The split-N loop (decode_split_n) applies: mma.sync unit, one 16-row tile, and one
// 16-token slice of the KV tile per warp.
template <typename KIND, int ROWS, int HEAD_DIM_PAD, int WARP>
struct SplitN {
  // host side: the shape condition (the unit is a device-pass fact)
  static constexpr bool value_on_host = WARP == 32 && ROWS <= 16 && TileN<HEAD_DIM_PAD>::value == 16 * NUM_WARPS;
  static constexpr bool value = HabTileUnitOf<KIND, WARP>::value == HAB_UNIT_MMA_SYNC && value_on_host;
};
#if defined(HAB_CUDA)
#define HAB_CUDA_BUILD true
#else
#define HAB_CUDA_BUILD false
#endif

}  // namespace hab_decode

#include "decode_split_n.cuh"

namespace hab_decode {


// SN: 0, the shared-softmax loop; SPLIT_N_TOKENS, the split-N loop (one kernel each, so
// that each loop gets the registers it needs and no more). KVF: the split-N loop's KV
// format (KvFormat; the shared-softmax loop reads p.kv_dtype at run time).
template <typename KIND, int ROWS, int HEAD_DIM_PAD, int WARP, int SN, int KVF>
HAB_DEV void decode_body(const HabDecodeParams& p, Flags flags, int row_chunks) {
  typedef Layout<ROWS, HEAD_DIM_PAD> L;
  typedef HabWarpTile<KIND, WARP> Tile;
  constexpr int BLOCK_N = L::BLOCK_N, MP = L::MP, RT = L::RT, CH = L::CH;
  constexpr int THREADS = NUM_WARPS * WARP;
  constexpr int CHUNKS = BLOCK_N * CH;
  constexpr int ITEMS = CHUNKS / THREADS;  // chunks a thread stages per tile (K and V each)
  static_assert(ITEMS <= 32, "staging flags are one 32-bit word");
  constexpr int NT = BLOCK_N / 16;                   // S column tiles
  constexpr int CT = HEAD_DIM_PAD / 16;                  // O column tiles
  constexpr int CT_W = (CT + NUM_WARPS - 1) / NUM_WARPS;  // O column tiles per warp

  extern __shared__ __align__(16) uint8_t smem[];
  uint16_t* q_s = reinterpret_cast<uint16_t*>(smem + L::Q_OFF);   // [MP][LDK]
  uint16_t* k_s = reinterpret_cast<uint16_t*>(smem + L::K_OFF);   // [BLOCK_N][LDK]
  uint16_t* v_s = reinterpret_cast<uint16_t*>(smem + L::V_OFF);   // [BLOCK_N][LDK]
  uint16_t* p_s = reinterpret_cast<uint16_t*>(smem + L::P_OFF);   // [MP][LDP]
  float* s_s = reinterpret_cast<float*>(smem + L::S_OFF);         // [MP][LDS]
  float* m_s = reinterpret_cast<float*>(smem + L::M_OFF);         // [MP]
  float* l_s = m_s + MP;                                          // [MP]
  float* a_s = l_s + MP;                                          // [MP] alpha
  int* ok_s = reinterpret_cast<int*>(smem + L::OK_OFF);           // [BLOCK_N]

  const int tid = threadIdx.x, lane = tid % WARP, warp = tid / WARP;
  // row and head indices are 32-bit (a 64-bit division is a subroutine call)
  const int group = int(p.num_q_heads / p.num_kv_heads);
  const int kv_head = int(blockIdx.x) / row_chunks;
  const int row0 = (int(blockIdx.x) % row_chunks) * ROWS;  // first row of the chunk
  const int64_t seq = blockIdx.y;
  const int part = blockIdx.z;
  const int total_rows = int(p.num_tokens) * group;
  const int rows = min(ROWS, total_rows - row0);  // valid rows here

  const int seq_len = int(hab_load_index(p.seq_lens, p.lens_is_int64, seq * p.lens_stride));
  const bool split = p.num_partitions > 1;
  const int part_start = int(int64_t(part) * p.partition_size);
  if (split && part_start >= seq_len) return;
  // keys past the table's columns are absent: the walk ends at the table's capacity whatever
  // seq_len says (positions still follow seq_len); the last partition takes the keys left past
  // the grid's partitions (a max_seq_len below seq_len), so none is skipped
  const int key_end = int(min(int64_t(seq_len), p.max_blocks_per_seq * p.page_size));
  const int part_end = split && part == int(p.num_partitions) - 1
                           ? key_end
                           : int(min(int64_t(part_start) + p.partition_size, int64_t(key_end)));

  const float k_scale = p.k_scale_ptr ? p.k_scale_ptr[kv_head * p.k_scale_stride] : p.k_scale_value;
  const float v_scale = p.v_scale_ptr ? p.v_scale_ptr[kv_head * p.v_scale_stride] : p.v_scale_value;
  const float sm_scale = p.scale * k_scale;  // natural units, K's dequant scale folded in
  const float qk_scale = sm_scale * LOG2E;   // log2 units, for exp2
  const bool use_cap = p.soft_cap > 0.f;
  const bool use_window = p.sliding_window > 0;

  const int head_dim = int(p.head_dim);  // <= HEAD_DIM_PAD, a multiple of 8; the rest is zeros

  // ---- Q rows -> shared (zeros in padded rows and channels), running state. The split-N
  // loop loads Q after its first block-id reads are issued (their latencies overlap).
  static_assert((MP * HEAD_DIM_PAD) % THREADS == 0, "Q tile splits evenly over threads");
  // 16-byte chunks where q's rows allow it (flags.q_vec): 2 loads a thread for a 16-row
  // tile at head_dim 128 instead of 16, each with its row's head division
  constexpr int Q_CHUNKS = (MP * CH + THREADS - 1) / THREADS;  // a thread's chunks (the last may be past the tile)
  auto load_q = [&]() {
    if (flags.q_vec) {
#pragma unroll  // every load of the Q tile in flight at once
      for (int k = 0; k < Q_CHUNKS; ++k) {
        const int i = tid + k * THREADS, r = i / CH, d = 8 * (i % CH);
        if (i >= MP * CH) break;
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (r < rows && d < head_dim) {  // head_dim is a multiple of 8: a chunk is in or out
          const int gr = row0 + r, t = gr / group, h = kv_head * group + gr % group;
          x = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p.q) + seq * p.q_stride[0] +
                                              t * p.q_stride[1] + h * p.q_stride[2] + d);
        }
        *reinterpret_cast<uint4*>(q_s + r * L::LDK + d) = x;
      }
      return;
    }
#pragma unroll  // every load of the Q tile in flight at once
    for (int k = 0; k < MP * HEAD_DIM_PAD / THREADS; ++k) {
      const int i = tid + k * THREADS, r = i / HEAD_DIM_PAD, d = i % HEAD_DIM_PAD;
      uint16_t x = 0;
      if (r < rows && d < head_dim) {
        const int gr = row0 + r, t = gr / group, h = kv_head * group + gr % group;
        x = static_cast<const uint16_t*>(p.q)[seq * p.q_stride[0] + t * p.q_stride[1] + h * p.q_stride[2] +
                                              d * p.q_stride[3]];
      }
      q_s[r * L::LDK + d] = x;
    }
  };
  if constexpr (SN == 0) load_q();
  const int kv_bytes = (p.kv_dtype == HAB_FP8_E4M3 || p.kv_dtype == HAB_FP8_E5M2) ? 1 : 2;
  // the split-N loop (mma.sync targets, 16-bit KV read as 16-byte vectors; the host
  // launches its kernel only then) lays out its shared memory differently: the
  // shared-softmax state below would overlap its stages
  constexpr bool split_n_run = SN != 0;
  for (int i = tid; i < MP * L::LDP && !split_n_run; i += THREADS) p_s[i] = 0;
  for (int r = tid; r < MP && !split_n_run; r += THREADS) {
    float m0 = -INFINITY, l0 = 0.f;
    if (p.sinks && r < rows && part == 0) {  // a sink: one extra key of value 0 (counted once)
      const int h = kv_head * group + (row0 + r) % group;
      m0 = p.sinks[h] * LOG2E;
      l0 = 1.f;
    }
    m_s[r] = m0;
    l_s[r] = l0;
    a_s[r] = 1.f;
  }

  // ---- key range of this program
  int loop_start = part_start;
  if (use_window) {  // whole tiles before the first token's earliest visible key are skipped
    const int first_key = max(seq_len - int(p.num_tokens) - int(p.sliding_window) + 1, 0);
    loop_start = max(part_start, first_key / BLOCK_N * BLOCK_N);
  }
  const int num_tiles = part_end > loop_start ? (part_end - loop_start + BLOCK_N - 1) / BLOCK_N : 0;

  const uint8_t* k_base = static_cast<const uint8_t*>(p.k_cache) + (int64_t(kv_head) * p.k_stride[1]) * kv_bytes;
  const uint8_t* v_base = static_cast<const uint8_t*>(p.v_cache) + (int64_t(kv_head) * p.v_stride[1]) * kv_bytes;
  const int64_t k_sd = p.k_split_x > 0 ? p.k_stride[4] : p.k_stride[3];  // innermost d stride of K
  const HabFastDiv page_div(int(p.page_size));
  const int split_x = int(p.k_split_x);

  // ---- staging: thread tid stages channels d0 .. d0 + 7 of tokens n_i = tid / CH + i * STEP
  // of each tile (CH divides THREADS: d0 is the same for every item, its offsets are
  // computed once). Block ids are read one tile ahead (pg_next), so the table's latency
  // overlaps the previous tile instead of preceding this tile's K/V loads.
  constexpr int STEP = THREADS / CH;
  static_assert(STEP * CH == THREADS && ITEMS * THREADS == CHUNKS, "tile chunks split evenly");
  const int n0 = tid / CH, d0 = 8 * (tid % CH);
  const bool d_ok = d0 < head_dim;
  // a chunk past head_dim is never read; its offsets are 0, so its address stays in the row
  const int64_t k_doff = !d_ok ? 0
                         : split_x > 0 ? int64_t(d0 / split_x) * p.k_stride[3] + int64_t(d0 % split_x) * p.k_stride[4]
                                       : int64_t(d0) * p.k_stride[3];
  const int64_t v_doff = d_ok ? int64_t(d0) * p.v_stride[3] : 0;
  const int64_t bt_row = seq * p.bt_stride[0];
  // the table's columns in 32-bit (the entry point checks that a row spans < 2^31 entries)
  const int max_blk = int(p.max_blocks_per_seq), bt_col = int(p.bt_stride[1]);
  uint4 k_reg[ITEMS], v_reg[ITEMS];
  int pg_next[ITEMS];  // block id of each item's token in the next tile to load, -1: skip
  // block id of token j of this sequence, -1 past the partition, past the table or bad
  auto block_of = [&](int j) {
    const int blk = page_div.div(j);
    int64_t page = -1;
    if (j < part_end && blk < max_blk) page = hab_load_index(p.block_table, p.table_is_int64, bt_row + blk * bt_col);
    return (page >= 0 && page < p.num_blocks) ? int(page) : -1;
  };
  auto lookup = [&](int tile) {
    const int start = loop_start + tile * BLOCK_N;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) pg_next[i] = block_of(start + n0 + i * STEP);
  };
  uint32_t ok_bits = 0;
  // the common case (16-bit KV, both caches vector-loadable) gets its own loop; fp8 and
  // strided layouts share a second one
  const int k_mode = flags.k_vec ? (kv_bytes == 2 ? LOAD_VEC16 : LOAD_VEC8) : LOAD_STRIDED;
  const int v_mode = flags.v_vec ? (kv_bytes == 2 ? LOAD_VEC16 : LOAD_VEC8) : LOAD_STRIDED;
  const bool fast = k_mode == LOAD_VEC16 && v_mode == LOAD_VEC16;
  const bool fp8 = kv_bytes == 1;
  const StageGeometry geo{k_base,
                          v_base,
                          k_doff,
                          v_doff,
                          k_sd,
                          page_div,
                          int(p.k_stride[0]),
                          int(p.k_stride[2]),
                          int(p.v_stride[0]),
                          int(p.v_stride[2]),
                          n0,
                          kv_bytes,
                          d_ok};
  auto load_tile = [&](int tile) {
    const int start = loop_start + tile * BLOCK_N;
    int pg[ITEMS];
    ok_bits = 0;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      pg[i] = pg_next[i];
      ok_bits |= (pg[i] >= 0 ? 1u : 0u) << i;
    }
    lookup(tile + 1);  // read ahead
    if (fast) {
      issue_loads<LOAD_VEC16, ITEMS, STEP>(k_reg, v_reg, pg, start, geo, p);
    } else if (fp8 && k_mode == LOAD_VEC8 && v_mode == LOAD_VEC8) {
      issue_loads<LOAD_VEC8, ITEMS, STEP>(k_reg, v_reg, pg, start, geo, p);
    } else {
      issue_loads<LOAD_STRIDED, ITEMS, STEP>(k_reg, v_reg, pg, start, geo, p);
    }
  };
  auto store_tile = [&]() {
    if (fp8) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        k_reg[i] = fp8_to_compute<KIND>(k_reg[i], p.kv_dtype);
        v_reg[i] = fp8_to_compute<KIND>(v_reg[i], p.kv_dtype);
      }
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int n = n0 + i * STEP;
      *reinterpret_cast<uint4*>(k_s + n * L::LDK + d0) = k_reg[i];
      *reinterpret_cast<uint4*>(v_s + n * L::LDK + d0) = v_reg[i];
      if (d0 == 0) ok_s[n] = (ok_bits >> i) & 1u;
    }
  };

  float o_acc[RT][CT_W][Tile::kElems];
#pragma unroll
  for (int a = 0; a < RT; ++a)
#pragma unroll
    for (int b = 0; b < CT_W; ++b)
#pragma unroll
      for (int e = 0; e < Tile::kElems; ++e) o_acc[a][b][e] = 0.f;

  if constexpr (SN != 0) {
    // (a device pass without mma.sync compiles an empty body: the host never launches it there)
#if defined(HAB_HAS_MMA_SYNC)
    if constexpr (SplitN<KIND, ROWS, HEAD_DIM_PAD, WARP>::value)
      decode_split_n<KIND, HEAD_DIM_PAD, KVF>(p, part_end, loop_start, seq_len, rows, row0, group, kv_head, seq,
                                             part, head_dim, qk_scale, sm_scale, v_scale, use_cap, use_window, q_s,
                                             smem + L::K_OFF, flags.stages, flags.po_vec != 0, flags.o_vec != 0, geo,
                                             block_of, load_q);
#endif
    return;
  }
  if (num_tiles > 0) {
    lookup(0);
    load_tile(0);
  }
  for (int tile = 0; tile < num_tiles; ++tile) {
    const int start = loop_start + tile * BLOCK_N;
    __syncthreads();  // the previous tile's K, V, P are no longer read
    store_tile();
    __syncthreads();
    if (tile + 1 < num_tiles) load_tile(tile + 1);  // in flight during this tile's math

    // ---- S = Q K^T: [MP, BLOCK_N], tiles (rt, nt) over the warps
    for (int pi = warp; pi < RT * NT; pi += NUM_WARPS) {
      const int rt = pi / NT, nt = pi % NT;
      float c[Tile::kElems];
#pragma unroll
      for (int e = 0; e < Tile::kElems; ++e) c[e] = 0.f;
#pragma unroll 2
      for (int kk = 0; kk < HEAD_DIM_PAD / 16; ++kk) {
        Tile::template mma<true>(c, q_s + rt * 16 * L::LDK + kk * 16, L::LDK,
                                 k_s + nt * 16 * L::LDK + kk * 16, 1, L::LDK, lane, rows - rt * 16);
      }
#pragma unroll
      for (int e = 0; e < Tile::kElems; ++e)
        s_s[(rt * 16 + Tile::row(lane, e)) * L::LDS + nt * 16 + Tile::col(lane, e)] = c[e];
    }
    __syncthreads();

    // ---- online softmax, one warp a row: P = exp2(s - m_new) (compute dtype), alpha
    for (int r = warp; r < rows; r += NUM_WARPS) {
      const int pos = seq_len - int(p.num_tokens) + (row0 + r) / group;  // last visible key
      float s_loc[(BLOCK_N + WARP - 1) / WARP];
      float mx = -INFINITY;
#pragma unroll
      for (int u = 0; u < (BLOCK_N + WARP - 1) / WARP; ++u) {
        const int n = lane + u * WARP;
        float s = -INFINITY;
        if (n < BLOCK_N) {
          const int j = start + n;
          bool vis = ok_s[n] && j <= pos;
          if (use_window) vis = vis && j > pos - int(p.sliding_window);
          if (vis) {
            const float raw = s_s[r * L::LDS + n];
            if (use_cap) {
              const float x = raw * sm_scale / p.soft_cap;
              const float th = 1.f - 2.f / (exp2f(x * (2.f * LOG2E)) + 1.f);
              s = p.soft_cap * th * LOG2E;
            } else {
              s = raw * qk_scale;
            }
          }
        }
        s_loc[u] = s;
        mx = fmaxf(mx, s);
      }
      mx = hab_group_max<WARP>(mx);
      const float m_old = m_s[r];
      const float m_new = fmaxf(m_old, mx);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;
      float sum = 0.f;
#pragma unroll
      for (int u = 0; u < (BLOCK_N + WARP - 1) / WARP; ++u) {
        const int n = lane + u * WARP;
        if (n < BLOCK_N) {
          const float pv = exp2f(s_loc[u] - m_use);
          sum += pv;
          p_s[r * L::LDP + n] = KIND::from_float(pv);
        }
      }
      sum = hab_group_sum<WARP>(sum);
      hab_syncwarp();
      if (lane == 0) {
        const float alpha = exp2f(m_old - m_use);
        a_s[r] = alpha;
        l_s[r] = l_s[r] * alpha + sum;
        m_s[r] = m_new;
      }
    }
    __syncthreads();

    // ---- O = alpha * O + P V: O column tiles ct = warp + NUM_WARPS * b
#pragma unroll
    for (int b = 0; b < CT_W; ++b) {
      const int ct = warp + NUM_WARPS * b;
      if (ct < CT) {
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
          if (rt * 16 < rows) {
#pragma unroll
            for (int e = 0; e < Tile::kElems; ++e) o_acc[rt][b][e] *= a_s[rt * 16 + Tile::row(lane, e)];
#pragma unroll 2
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
              Tile::template mma<false>(o_acc[rt][b], p_s + rt * 16 * L::LDP + kk * 16, L::LDP,
                                        v_s + kk * 16 * L::LDK + ct * 16, L::LDK, 1, lane, rows - rt * 16);
            }
          }
        }
      }
    }
  }
  __syncthreads();

  // ---- results
#pragma unroll
  for (int b = 0; b < CT_W; ++b) {
    const int ct = warp + NUM_WARPS * b;
    if (ct >= CT) continue;
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
#pragma unroll
      for (int e = 0; e < Tile::kElems; ++e) {
        const int r = rt * 16 + Tile::row(lane, e), d = ct * 16 + Tile::col(lane, e);
        if (r >= rows || d >= head_dim) continue;
        const float l = l_s[r];
        const float val = o_acc[rt][b][e] * (v_scale / (l > 0.f ? l : 1.f));
        const int gr = row0 + r, t = gr / group, h = kv_head * group + gr % group;
        if (split) {
          const int64_t slot = seq * p.num_partitions + part, row = t * p.num_q_heads + h;
          p.partial_out[slot * p.po_stride[0] + row * p.po_stride[1] + d * p.po_stride[2]] = val;
        } else {
          store_out(p, seq * p.o_stride[0] + t * p.o_stride[1] + h * p.o_stride[2] + d * p.o_stride[3], val);
        }
      }
    }
  }
  if (split) {
    for (int r = tid; r < rows; r += THREADS) {
      const int gr = row0 + r, t = gr / group, h = kv_head * group + gr % group;
      const int64_t slot = seq * p.num_partitions + part, row = t * p.num_q_heads + h;
      p.max_logits[slot * p.ml_stride[0] + row * p.ml_stride[1]] = m_s[r];
      p.exp_sums[slot * p.ml_stride[0] + row * p.ml_stride[1]] = l_s[r];
    }
  }
}

// Programs per multiprocessor the register budget is sized for: 3-4 for the common 16-row
// tile (12-16 warps in flight per SM to cover the memory latency), fewer for the big
// tiles; the 64-token split-N loop at head_dim 128 is sized for 2 (its 3 stages of shared
// memory fit 2 programs; it holds Q's fragments in registers: 216 a thread).
// On AMD/Hygon gfx9 a CU has 64 KB of LDS, so no more programs fit at once than
// 65,536 / Layout::BYTES (one at D >= 128: 46-58 KB a program): asking for more only cut the
// registers (3 programs capped gfx906's 16-row D128 kernel at 84 VGPRs, which spilled 240-424
// bytes a lane, most of it reloaded in the KV loop) for an occupancy the LDS never allows.
// On HIP the rule is capped by that count (docs/history.md).
constexpr int HIP_LDS_BYTES = 64 * 1024;

template <int ROWS, int HEAD_DIM_PAD, int SN, int KVF = KV_16BIT>
struct MinBlocks {
  static constexpr int nvidia = SN == SPLIT_N_TOKENS ? (HEAD_DIM_PAD <= 64 ? 4 : (KVF != KV_16BIT ? 3 : 2))
                                : ROWS <= 16 ? (HEAD_DIM_PAD <= 64 ? 4 : (HEAD_DIM_PAD <= 128 ? 3 : 2))
                                             : (ROWS * HEAD_DIM_PAD <= 4096 ? 2 : 1);
#if defined(HAB_HIP)
  static constexpr int lds_fit = HIP_LDS_BYTES / Layout<ROWS, HEAD_DIM_PAD>::BYTES;
  static constexpr int value = lds_fit < 1 ? 1 : (lds_fit < nvidia ? lds_fit : nvidia);
#else
  static constexpr int value = nvidia;
#endif
};

template <typename KIND, int ROWS, int HEAD_DIM_PAD, int WARP, int SN, int KVF>
__global__ void __launch_bounds__(NUM_WARPS * WARP, (MinBlocks<ROWS, HEAD_DIM_PAD, SN, KVF>::value))
paged_decode_kernel(HabDecodeParams p, Flags flags, int row_chunks) {
#if defined(HAB_DEVICE_PASS)
  // a split launch's combine kernel may be scheduled once every program is here (it waits
  // for this grid's writes itself: decode.cu, combine_kernel)
  hab_gdc_launch_dependents();
  // the other warp size's instantiation (HIP builds both) compiles to an empty kernel
  if constexpr (WARP == HAB_WARP_SIZE) decode_body<KIND, ROWS, HEAD_DIM_PAD, WARP, SN, KVF>(p, flags, row_chunks);
#endif
}

// Host side: launch one kernel (SN as in decode_body) with `bytes` of shared memory, at
// most MAX_BYTES (the attribute is set once per kernel and device, sized for the most
// stages, so that a later launch with more stages fits).
template <typename KIND, int ROWS, int HEAD_DIM_PAD, int WARP, int SN, int MAX_BYTES, int KVF = KV_16BIT>
const char* launch_kernel(const HabDecodeParams& p, Flags flags, int bytes, hab_stream_t stream) {
  const int64_t total_rows = p.num_tokens * (p.num_q_heads / p.num_kv_heads);
  const int row_chunks = int(hab_cdiv(total_rows, ROWS));
  auto kernel = paged_decode_kernel<KIND, ROWS, HEAD_DIM_PAD, WARP, SN, KVF>;
  static uint64_t configured = 0;
  int dev = 0;
  if (hab_get_device(&dev) != hab_success) return "paged_decode: no device";
  const uint64_t bit = uint64_t(1) << (dev & 63);
  if (!(configured & bit)) {
    if (MAX_BYTES > 48 * 1024) {
      const hab_error_t e = hab_func_set_max_dynamic_smem(kernel, MAX_BYTES);
      if (e != hab_success) return hab_error_string(e);
    }
#if defined(HAB_CUDA)
    // the whole carveout as shared memory: MinBlocks programs fit on an SM
    cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout, 100);
#endif
    configured |= bit;
  }
  if (flags.programs_per_sm) {  // an occupancy query (the partition rule), no launch
    const hab_error_t e = hab_occupancy(flags.programs_per_sm, kernel, NUM_WARPS * WARP, bytes);
    return e == hab_success ? nullptr : hab_error_string(e);
  }
  dim3 grid(unsigned(p.num_kv_heads * row_chunks), unsigned(p.num_seqs), unsigned(p.num_partitions));
  kernel<<<grid, NUM_WARPS * WARP, bytes, stream>>>(p, flags, row_chunks);
  return nullptr;
}

// One instantiation: the split-N kernel where flags.split_n asks for it and it applies
// (16-bit KV of q's dtype, or fp8 KV at head_dim pad 128 read as 16-channel chunks), else
// the shared-softmax one.
template <typename KIND, int ROWS, int HEAD_DIM_PAD, int WARP>
const char* launch(const HabDecodeParams& p, Flags flags, hab_stream_t stream) {
  typedef Layout<ROWS, HEAD_DIM_PAD> L;
  // the split-N loop's layout where it may run (flags.split_n is 0 on a device without
  // mma.sync: decode.cu's loop_flags)
  constexpr bool SPLIT_N_SHAPE = HAB_CUDA_BUILD && SplitN<KIND, ROWS, HEAD_DIM_PAD, 32>::value_on_host;
  if constexpr (SPLIT_N_SHAPE) {
    const bool split_n = flags.split_n && flags.k_vec && flags.v_vec && p.kv_dtype == p.q_dtype &&
                         p.k_split_x == 0;
    if (split_n) {
      typedef SplitNGeometry<HEAD_DIM_PAD> G;
      return launch_kernel<KIND, ROWS, HEAD_DIM_PAD, WARP, SPLIT_N_TOKENS, G::bytes(MAX_SPLIT_N_STAGES)>(
          p, flags, G::bytes(flags.stages), stream);
    }
    if constexpr (HEAD_DIM_PAD == 128) {
      const bool fp8 = p.kv_dtype == HAB_FP8_E4M3 || p.kv_dtype == HAB_FP8_E5M2;
      if (flags.split_n && flags.kv16 && fp8 && p.k_split_x == 0) {
        typedef SplitNGeometry<HEAD_DIM_PAD, 1> G;
        if (p.kv_dtype == HAB_FP8_E4M3)
          return launch_kernel<KIND, ROWS, HEAD_DIM_PAD, WARP, SPLIT_N_TOKENS, G::bytes(MAX_SPLIT_N_STAGES),
                               KV_E4M3>(p, flags, G::bytes(flags.stages), stream);
        return launch_kernel<KIND, ROWS, HEAD_DIM_PAD, WARP, SPLIT_N_TOKENS, G::bytes(MAX_SPLIT_N_STAGES),
                             KV_E5M2>(p, flags, G::bytes(flags.stages), stream);
      }
    }
  }
  return launch_kernel<KIND, ROWS, HEAD_DIM_PAD, WARP, 0, L::BYTES, KV_16BIT>(p, flags, L::BYTES, stream);
}

// The REUSE_KV switch: rows = G * T rounded up to {1, 2, 4, 8, 16, 32, 64} (more than 64
// rows run in row chunks of 64). Groups up to 16 share the 16-row instantiation: the
// matrix units compute 16-row tiles whatever the group, the FMA path skips rows past the
// group at run time (warp-uniform), so ROWS 1..8 would compile to the same work at 7x the
// build time.
template <int ROWS> struct RowsTile { static constexpr int value = ROWS < 16 ? 16 : ROWS; };

template <typename KIND, int HEAD_DIM_PAD, int WARP>
const char* dispatch_rows(const HabDecodeParams& p, Flags flags, hab_stream_t stream) {
  const int64_t rows = p.num_tokens * (p.num_q_heads / p.num_kv_heads);
  // 32-row programs in row chunks where a 64-row one would not fit the device's shared
  // memory (gfx9's 64 KB: the 64-row layout takes 78-81 KB at D 128-256) or when asked
  if (rows > 32 && (p.max_rows == 32 || Layout<64, HEAD_DIM_PAD>::BYTES > hab_max_smem_per_block()))
    return launch<KIND, 32, HEAD_DIM_PAD, WARP>(p, flags, stream);
#define HAB_ROWS_CASE(R) \
  if (rows <= R) return launch<KIND, RowsTile<R>::value, HEAD_DIM_PAD, WARP>(p, flags, stream);
  HAB_ROWS_CASE(1) HAB_ROWS_CASE(2) HAB_ROWS_CASE(4) HAB_ROWS_CASE(8) HAB_ROWS_CASE(16) HAB_ROWS_CASE(32)
#undef HAB_ROWS_CASE
  return launch<KIND, 64, HEAD_DIM_PAD, WARP>(p, flags, stream);
}

}  // namespace hab_decode

// Launchers for one padded head_dim (decode_d64.cu, decode_d128.cu, decode_d256.cu);
// warp: 32 or 64 lanes.
const char* hab_decode_launch_d64(const HabDecodeParams& p, hab_decode::Flags flags, int warp, void* stream);
const char* hab_decode_launch_d128(const HabDecodeParams& p, hab_decode::Flags flags, int warp, void* stream);
const char* hab_decode_launch_d256(const HabDecodeParams& p, hab_decode::Flags flags, int warp, void* stream);

// CUDA has only 32-lane warps; HIP builds wave64 (gfx9) and wave32 (gfx10+) instantiations.
#if defined(HAB_HIP)
#define HAB_DECODE_WARP64_CASE(KIND, PAD) \
  if (warp == 64) return hab_decode::dispatch_rows<KIND, PAD, 64>(p, flags, s);
#else
#define HAB_DECODE_WARP64_CASE(KIND, PAD)
#endif

#define HAB_DEFINE_DECODE_LAUNCH(PAD)                                                                 \
  const char* hab_decode_launch_d##PAD(const HabDecodeParams& p, hab_decode::Flags flags, int warp,   \
                                       void* stream) {                                                \
    hab_stream_t s = static_cast<hab_stream_t>(stream);                                               \
    if (warp != 32 && warp != 64) return "paged_decode: unsupported warp size";                       \
    if (p.q_dtype == HAB_BF16) {                                                                      \
      HAB_DECODE_WARP64_CASE(HabBf16, PAD)                                                            \
      return hab_decode::dispatch_rows<HabBf16, PAD, 32>(p, flags, s);                                \
    }                                                                                                 \
    HAB_DECODE_WARP64_CASE(HabHalf, PAD)                                                              \
    return hab_decode::dispatch_rows<HabHalf, PAD, 32>(p, flags, s);                                  \
  }
