// MLA decode on Hopper (sm_90a): the absorbed latent attention of DeepSeek-class models over
// a paged latent cache, with wgmma. Where it is used and what it was measured against:
// docs/native.md, docs/benchmarks.md.
//
// Why a native kernel: at Hq = 64..128 rows a request the two products cost
// 2 * rows * (576 + 512) FLOPs a key against its 1,152 bytes (242 FLOP/byte at 128 rows,
// past the H200's ridge point), so the loop is bound by the matrix units; Triton's tile
// (64 x 64, 8 warps) ran them at ~250 TFLOP/s.
//
// Work item: one program a (64-row block, request, partition): grid (cdiv(T * Hq, 64),
// B, num_partitions). The row blocks of a request are adjacent in the launch, so its key
// tiles come from the L2 for the second one. 384 threads:
//
//   warps 8-11    Q once (64 rows x 576, 9 panels of 64 channels), then key tiles of
//   (producers)   BLOCK_N = 64 rows into a 2-stage ring with cp.async (8 lanes a 128-byte
//                 panel row), each row's address from its own page; an absent key (a bad
//                 block id, past the partition) is zero-filled and its bit cleared in the
//                 stage's key mask.
//   warps 0-3     S = Q K^T ([64 x 64] fp32, 36 wgmma m64n64k16, both operands in shared
//   (warpgroup 0) memory), the mask and online softmax in registers, P packed to 16 bits:
//                 kept in registers for its own O[:, 0:256] += P V (RS wgmma) and stored
//                 (swizzled) with the rows' rescale factors for warpgroup 1.
//   warps 4-7     O[:, 256:512] += P V with P from shared memory (SS wgmma), rescaled by
//   (warpgroup 1) warpgroup 0's factors.
//
// The value of a key is the first 512 channels of its row in the K tile itself: V is read
// MN-major from the same shared memory (no second copy). Each warpgroup holds a 64 x 256
// fp32 accumulator (128 registers a thread); warpgroup 0 takes the registers the
// producers give up (setmaxnreg).
//
// fp8 caches (KVF = KV_E4M3 / KV_E5M2): the products run on fp16 operands. The producers
// copy a tile's codes (64 x 576 bytes) into the upper half of its stage and widen them in
// place to the fp16 tile the 16-bit kernel loads (the writes of 16-bit panel c reach the
// codes of panels 2c - 9 and 2c - 8 only, so four producer barriers order them:
// widen_tile); the next tile's rows are prefetched into the L2 meanwhile. A bf16 query is
// widened to fp16 in place, each row scaled by a power of two (sm90.cuh: widen_bf16_row)
// that folds into its logits' scale; kv_scale multiplies the logits and the output.
//
// Barriers: full_q / full_k (mbarriers) complete when the producers' copies land (and the
// mask words are written); empty_k when the 8 consumer warps are done with a stage. The two
// consumer warpgroups hand P over through named barriers: P_FULL when warpgroup 0 has
// stored P and the factors, P_EMPTY when warpgroup 1's product that read them has
// finished. The copies and the P stores are generic writes, wgmma reads through the async
// proxy: the writers (P) or the readers (the copies, after their wait) fence it.
#include <climits>

#include "compat.h"
#include "hab_ops.h"

#if defined(HAB_CUDA)
#include "fastdiv.h"
#include "sm90.cuh"

namespace hab_mla {

constexpr int ROWS = 64;                          // query rows of a program
constexpr int BLOCK_N = 64;                       // keys a tile
constexpr int RANK = 512;                         // the value width (kv_lora_rank)
constexpr int WIDTH = 576;                        // a latent row: RANK + 64 rope channels
constexpr int PANELS = WIDTH / 64;                // 64-channel panels of a row
constexpr int PANEL_BYTES = 64 * 128;             // 64 rows x 64 channels x 2 bytes
constexpr int TILE_BYTES = PANELS * PANEL_BYTES;  // Q or one key tile: 73,728 bytes
constexpr int STAGES = 2;                         // Q + 2 tiles + P fill the 227 KB
[[maybe_unused]] constexpr int HALF = RANK / 2;                  // value channels of one consumer warpgroup
// fp8: a tile's codes staged in the upper half of its stage, panel-major (code panel c,
// row r: 64 bytes at CODES_OFF + c * CODE_PANEL_BYTES + r * 64)
constexpr int CODES_OFF = TILE_BYTES / 2;
constexpr int CODE_PANEL_BYTES = 64 * 64;
static_assert(CODES_OFF + PANELS * CODE_PANEL_BYTES == TILE_BYTES, "the codes fill the stage's upper half");
// the cache formats (a template parameter): q's 16-bit dtype, or fp8 codes
enum KvFormat { KV_16BIT = 0, KV_E4M3 = 1, KV_E5M2 = 2 };
constexpr int CONSUMER_WARPS = 8;
constexpr int PRODUCER_WARPS = 4;
constexpr int THREADS = (CONSUMER_WARPS + PRODUCER_WARPS) * 32;
// registers a thread: 168 at launch (65,536 / 384 in steps of 8); the producers keep 56
// (104 to widen fp8 codes and a bf16 Q: ptxas spills there at 56 and at 96), warpgroup 0
// (S, softmax, P and its half of O) takes 232, warpgroup 1 keeps 168:
// 4 x 32 x (104 + 232 + 168) = 64,512 <= 384 x 168 = 64,512
[[maybe_unused]] constexpr int PRODUCER_REGS = 56;
constexpr int FP8_PRODUCER_REGS = 104;
constexpr int SOFTMAX_REGS = 232;

[[maybe_unused]] constexpr int Q_OFF = 0;
constexpr int K_OFF = TILE_BYTES;
constexpr int P_OFF = K_OFF + STAGES * TILE_BYTES;  // [64 x 64] 16-bit, one swizzled panel
constexpr int ALPHA_OFF = P_OFF + PANEL_BYTES;      // [ROWS] float: a tile's rescale factors
constexpr int INV_OFF = ALPHA_OFF + 4 * ROWS;       // [ROWS] float: 1 / l at the end
constexpr int QINV_OFF = INV_OFF + 4 * ROWS;        // [ROWS] float: 1 / a widened Q row's scale
constexpr int MASK_OFF = QINV_OFF + 4 * ROWS;       // [STAGES][4] key bits (16 a producer warp)
constexpr int BAR_OFF = MASK_OFF + 16 * STAGES;
constexpr int NUM_BARS = 1 + 2 * STAGES;
// named barriers of the two consumer warpgroups (256 threads): P and the factors stored /
// read by warpgroup 1's last product; 1 / l at the end; of the producers (128): fp8 widening
[[maybe_unused]] constexpr int BAR_P_FULL = 2, BAR_P_EMPTY = 3, BAR_FINISH = 1, BAR_PRODUCERS = 4;
constexpr int PRODUCER_THREADS = PRODUCER_WARPS * 32;
constexpr int SMEM_USED = BAR_OFF + 8 * NUM_BARS;
constexpr int SMEM_BYTES = SMEM_USED + 1024;  // slack: the tiles start on a 1024-byte boundary
static_assert(SMEM_BYTES <= 227 * 1024, "more shared memory than an sm_90 program may have");
static_assert(4 * 32 * (FP8_PRODUCER_REGS + SOFTMAX_REGS + 65536 / THREADS / 8 * 8) <= THREADS * (65536 / THREADS / 8 * 8),
              "setmaxnreg: more registers than the launch allocates");

[[maybe_unused]] constexpr float LOG2E = 1.4426950408889634f;
[[maybe_unused]] constexpr float LN2 = 0.6931471805599453f;

struct Barriers {
  uint64_t* full_q;
  uint64_t* full_k;   // [STAGES]
  uint64_t* empty_k;  // [STAGES]
  uint32_t* mask;  // [STAGES][4]
  float* alpha;    // [ROWS]
  float* inv_l;    // [ROWS]
  float* q_inv;    // [ROWS] (fp8 with a bf16 query)
};

// What every role derives from the program's coordinates: the keys it walks.
struct Work {
  int64_t seq;
  int row0;     // first query row of the program
  int seq_len;  // keys of the request, the query tokens included (clamped to int)
  int key_lo, key_hi;
  int n_tiles;
  bool active;  // false: a partition past this sequence's last (the combine never reads it)
};

// The split of kernels/combine.py: seq_partitions (SEQ_SPLIT, ALIGN = BLOCK_N) over the
// keys the table holds, min(seq_len, max_blocks * P).
HAB_DEV int64_t clamp64(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : (v > hi ? hi : v); }

HAB_DEV Work work_of(const HabMlaDecodeParams& p) {
  Work w;
  w.seq = blockIdx.y;
  w.row0 = int(blockIdx.x) * ROWS;
  const int64_t part = blockIdx.z;
  const int64_t len = hab_load_index(p.seq_lens, p.lens_is_int64, w.seq * p.lens_stride);
  w.seq_len = int(clamp64(len, INT_MIN / 2, INT_MAX / 2));
  const int64_t key_end = clamp64(len, 0, clamp64(p.max_blocks * p.page_size, 0, INT_MAX / 2));
  w.active = true;
  w.key_lo = 0;
  w.key_hi = int(key_end);
  if (p.num_partitions > 1) {
    int64_t size = hab_cdiv(key_end, p.num_partitions);
    size = size > p.partition_size ? size : p.partition_size;
    size = hab_cdiv(size, BLOCK_N) * BLOCK_N;
    const int64_t parts = key_end > 0 ? hab_cdiv(key_end, size) : 1;
    w.active = part < parts;
    w.key_lo = int(clamp64(part * size, 0, key_end));
    w.key_hi = int(clamp64(part * size + size, 0, key_end));
  }
  w.n_tiles = int(hab_cdiv(w.key_hi - w.key_lo, BLOCK_N));
  return w;
}

// ------------------------------------------------------------------ producers
using hab_sm90::shfl_ptr;

// Producer warp pw copies rows 16 pw .. 16 pw + 15 of a 64-row tile (all 9 panels); row
// 16 pw + l starts at `row_ptr` of lane l (l < 16; null: zero fill, `fallback` never read).
// Per instruction 4 rows x one 128-byte panel row, 8 lanes a row; a row's panels are
// consecutive instructions (its 1,152 bytes are contiguous in the cache).
HAB_DEV void copy_tile(uint32_t dst, const uint8_t* row_ptr, const void* fallback, int pw, int lane) {
  const int sub = lane >> 3, chunk = lane & 7;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const int row = 16 * pw + 4 * q + sub;
    const uint8_t* src = shfl_ptr(row_ptr, 4 * q + sub);
    const bool fill = src != nullptr;
    const uint32_t d = dst + row * 128 + ((chunk ^ (row & 7)) << 4);
#pragma unroll
    for (int pnl = 0; pnl < PANELS; ++pnl) {
      hab_sm90::cp_async16(d + pnl * PANEL_BYTES, fill ? src + pnl * 128 + chunk * 16 : fallback, fill);
    }
  }
}

// ---- fp8 caches
// Producer warp pw's rows 16 pw .. 16 pw + 15 of a tile's codes into the stage's staging
// half (row 16 pw + l starts at `row_ptr` of lane l, l < 16; null: zeros): per
// instruction 8 rows x 64 bytes of one code panel, 4 lanes a row.
HAB_DEV void copy_codes(uint32_t stage, const uint8_t* row_ptr, const void* fallback, int pw, int lane) {
  const int sub = lane >> 2, q = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int row = 16 * pw + 8 * h + sub;
    const uint8_t* src = shfl_ptr(row_ptr, 8 * h + sub);
    const bool fill = src != nullptr;
    const uint32_t d = stage + CODES_OFF + row * 64 + q * 16;
#pragma unroll
    for (int c = 0; c < PANELS; ++c) {
      hab_sm90::cp_async16(d + c * CODE_PANEL_BYTES, fill ? src + c * 64 + q * 16 : fallback, fill);
    }
  }
}

// 16 codes (channels 64 c + 16 qc ..) of `row` -> fp16 into 16-bit panel c: slots 2 qc and
// 2 qc + 1 of the row, swizzled as copy_tile lays them out
HAB_DEV void store_widened(uint32_t stage, int c, int row, int qc, const uint32_t (&w)[4], bool e5m2) {
  uint32_t a[4], b[4];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    a[2 * k] = hab_sm90::fp8x2_to_f16x2(w[k], e5m2);
    a[2 * k + 1] = hab_sm90::fp8x2_to_f16x2(w[k] >> 16, e5m2);
    b[2 * k] = hab_sm90::fp8x2_to_f16x2(w[2 + k], e5m2);
    b[2 * k + 1] = hab_sm90::fp8x2_to_f16x2(w[2 + k] >> 16, e5m2);
  }
  const uint32_t base = stage + c * PANEL_BYTES + row * 128;
  hab_sm90::st_shared_v4(base + (((2 * qc) ^ (row & 7)) << 4), a);
  hab_sm90::st_shared_v4(base + (((2 * qc + 1) ^ (row & 7)) << 4), b);
}

// Producer thread tid's two 16-code chunks of code panel c (chunk tid + 128 i: row
// tid / 4 + 32 i, channels 16 (tid % 4) ..): 8 lanes read 128 contiguous bytes and store
// to 8 distinct 16-byte bank groups.
HAB_DEV void load_code_chunks(uint32_t stage, int c, int tid, uint32_t (&w)[2][4]) {
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    hab_sm90::ld_shared_v4(stage + CODES_OFF + c * CODE_PANEL_BYTES + ((tid >> 2) + 32 * i) * 64 + (tid & 3) * 16, w[i]);
  }
}
HAB_DEV void store_code_chunks(uint32_t stage, int c, int tid, const uint32_t (&w)[2][4], bool e5m2) {
#pragma unroll
  for (int i = 0; i < 2; ++i) store_widened(stage, c, (tid >> 2) + 32 * i, tid & 3, w[i], e5m2);
}
HAB_DEV void widen_panel(uint32_t stage, int c, int tid, bool e5m2) {
  uint32_t w[2][4];
  load_code_chunks(stage, c, tid, w);
  store_code_chunks(stage, c, tid, w, e5m2);
}

// The staged codes of a tile (landed, seen by every producer) -> the fp16 tile, in place.
// 16-bit panel c is bytes [8192 c, 8192 c + 8192) of the stage, code panel c' bytes
// [36864 + 4096 c', + 4096): panel c's stores reach code panels 2c - 9 and 2c - 8 only,
// so panels 0-3 go first, and a barrier of the producers precedes panels 4-5 (past the
// reads of code panels 0-3), 6 (0-5), 7 (0-6) and 8 (0-8: its own codes are read first).
HAB_DEV void widen_tile(uint32_t stage, int tid, bool e5m2) {
#pragma unroll
  for (int c = 0; c < 4; ++c) widen_panel(stage, c, tid, e5m2);
  hab_sm90::named_sync(BAR_PRODUCERS, PRODUCER_THREADS);
  widen_panel(stage, 4, tid, e5m2);
  widen_panel(stage, 5, tid, e5m2);
  hab_sm90::named_sync(BAR_PRODUCERS, PRODUCER_THREADS);
  widen_panel(stage, 6, tid, e5m2);
  hab_sm90::named_sync(BAR_PRODUCERS, PRODUCER_THREADS);
  widen_panel(stage, 7, tid, e5m2);
  uint32_t last[2][4];
  load_code_chunks(stage, 8, tid, last);
  hab_sm90::named_sync(BAR_PRODUCERS, PRODUCER_THREADS);
  store_code_chunks(stage, 8, tid, last, e5m2);
}

// A row's 576 codes into the L2 ahead of their copy: lanes l and l + 16 share row l's
// pointer; each touches three of the bytes 0, 128, .., 512, 575 (every 128-byte line of
// the row holds one of them)
HAB_DEV void prefetch_row(const uint8_t* row, int lane) {
  if (row == nullptr) return;
  const int at = lane < 16 ? 0 : 384;
  hab_sm90::prefetch_l2(row + at);
  hab_sm90::prefetch_l2(row + at + 128);
  hab_sm90::prefetch_l2(row + (lane < 16 ? 256 : WIDTH - 1));
}

// bf16 Q rows 16 pw .. 16 pw + 15 (copied by this warp, landed) -> fp16 in place
HAB_DEV void widen_q(uint32_t q_tile, float* q_inv, int pw, int lane) {
  const int sub = lane >> 3, chunk = lane & 7;
#pragma unroll 1
  for (int i = 0; i < 4; ++i) {
    const int row = 16 * pw + 4 * i + sub;
    const float inv = hab_sm90::widen_bf16_row<PANELS>(q_tile + row * 128 + ((chunk ^ (row & 7)) << 4), PANEL_BYTES);
    if (chunk == 0) q_inv[row] = inv;
  }
}

// Whether the producers widen Q to fp16 (a bf16 query beside an fp8 cache; q_inv holds
// each row's factor), read by the producers and by warpgroup 0
template <int KVF>
HAB_DEV bool widens_query(const HabMlaDecodeParams& p) {
  return KVF != KV_16BIT && p.dtype == HAB_BF16;
}

template <int KVF>
HAB_DEV void producer(const HabMlaDecodeParams& p, const Work& w, const Barriers& b, uint32_t smem, int pw,
                      int lane) {
  constexpr bool FP8 = KVF != KV_16BIT;
  constexpr int KV_BYTES = FP8 ? 1 : 2;
  const bool e5m2 = KVF == KV_E5M2;
  const int tid = 32 * pw + lane;
  const int my_row = 16 * pw + (lane & 15);  // lanes 16..31 repeat 0..15 (their pointers unused)
  const uint8_t* q_row = nullptr;
  const int row = w.row0 + my_row;
  if (row < p.num_tokens * p.num_heads) {
    const int64_t tok = row / p.num_heads, head = row % p.num_heads;
    q_row = static_cast<const uint8_t*>(p.q) + 2 * (w.seq * p.q_stride[0] + tok * p.q_stride[1] + head * p.q_stride[2]);
  }
  copy_tile(smem + Q_OFF, q_row, p.q, pw, lane);
  if (widens_query<KVF>(p)) {
    asm volatile("cp.async.wait_all;\n" ::: "memory");  // this lane's Q copies (nothing else is in flight)
    __syncwarp();                                       // and the warp's: its rows are its own
    widen_q(smem + Q_OFF, b.q_inv, pw, lane);
    hab_sm90::fence_proxy_async();
    hab_sm90::mbar_arrive(b.full_q);
  } else {
    hab_sm90::mbar_arrive_cp_async(b.full_q);
  }

  const HabFastDiv page_div(int(p.page_size));
  // the row of key tile j this lane addresses, null when absent
  auto key_row = [&](int j) -> const uint8_t* {
    const int pos = w.key_lo + j * BLOCK_N + my_row;
    if (pos >= w.key_hi) return nullptr;  // key_hi <= max_blocks * P: the column is in the table
    const int blk = page_div.div(pos), slot = page_div.mod(pos, blk);
    const int64_t page =
        hab_load_index(p.block_table, p.table_is_int64, w.seq * p.bt_stride[0] + int64_t(blk) * p.bt_stride[1]);
    if (page < 0 || page >= p.num_blocks) return nullptr;
    return static_cast<const uint8_t*>(p.kv) + KV_BYTES * (page * p.kv_stride[0] + int64_t(slot) * p.kv_stride[1]);
  };
  const uint8_t* next = w.n_tiles > 0 ? key_row(0) : nullptr;
  for (int j = 0; j < w.n_tiles; ++j) {
    const uint8_t* rows = next;
    const uint32_t bits = __ballot_sync(0xffffffffu, rows != nullptr) & 0xffffu;
    if (j + 1 < w.n_tiles) next = key_row(j + 1);  // the table read overlaps the wait
    const int s = j % STAGES;
    const uint32_t stage = smem + K_OFF + s * TILE_BYTES;
    if (FP8 && j + 1 < w.n_tiles) prefetch_row(next, lane);
    hab_sm90::mbar_wait(b.empty_k + s, ((j / STAGES) & 1) ^ 1);
    if (lane == 0) b.mask[4 * s + pw] = bits;
    if (FP8) {
      copy_codes(stage, rows, p.kv, pw, lane);
      asm volatile("cp.async.wait_all;\n" ::: "memory");
      hab_sm90::named_sync(BAR_PRODUCERS, PRODUCER_THREADS);  // every producer's codes landed
      widen_tile(stage, tid, e5m2);
      hab_sm90::fence_proxy_async();
      hab_sm90::mbar_arrive(b.full_k + s);
    } else {
      copy_tile(stage, rows, p.kv, pw, lane);
      hab_sm90::mbar_arrive_cp_async(b.full_k + s);
    }
    if (lane == 0) hab_sm90::mbar_arrive(b.full_k + s);  // releases the mask word
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives its thread
}

// ------------------------------------------------------------------ consumers
// Thread (warp wq of its warpgroup, lane = 4 g + t) holds rows r0 = 16 wq + g and r0 + 8:
// of S ([64 x 64]) element 4 i + e is row r0 + 8 (e >> 1), column 8 i + 2 t + (e & 1); of
// each [64 x 128] half of O element 4 i + e, column 8 i + 2 t + (e & 1) of the half.
struct Rows {
  int r[2];
  int64_t tok[2], head[2];
  bool ok[2];
  HAB_DEV Rows(const HabMlaDecodeParams& p, const Work& w, int wq, int lane) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      r[h] = 16 * wq + (lane >> 2) + 8 * h;
      const int row = w.row0 + r[h];
      ok[h] = row < p.num_tokens * p.num_heads;
      tok[h] = row / p.num_heads;
      head[h] = row % p.num_heads;
    }
  }
};

HAB_DEV void release(uint64_t* bar, int lane) {
  __syncwarp();
  if (lane == 0) hab_sm90::mbar_arrive(bar);
}

HAB_DEV void rescale(float (&o)[128], const float (&alpha)[2]) {
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    o[4 * i + 0] *= alpha[0];
    o[4 * i + 1] *= alpha[0];
    o[4 * i + 2] *= alpha[1];
    o[4 * i + 3] *= alpha[1];
  }
}

// out (unsplit) or the scratch slot (split) for this thread's rows of one warpgroup's
// half: O * inv (inv = 0: the row saw no key)
template <bool IS_BF16>
HAB_DEV void store_rows(const HabMlaDecodeParams& p, const Work& w, const Rows& rs, const float (&o)[128],
                        const float (&inv)[2], int col0, int t) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    if (!rs.ok[h]) continue;
    if (p.num_partitions > 1) {
      const int64_t slot = w.seq * p.num_partitions + blockIdx.z;
      float* dst = p.partial_out + slot * p.po_stride[0] + int64_t(w.row0 + rs.r[h]) * p.po_stride[1] + col0;
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        *reinterpret_cast<float2*>(dst + 8 * i + 2 * t) =
            make_float2(o[4 * i + 2 * h] * inv[h], o[4 * i + 2 * h + 1] * inv[h]);
      }
    } else {
      uint16_t* dst = static_cast<uint16_t*>(p.out) + w.seq * p.o_stride[0] + rs.tok[h] * p.o_stride[1] +
                      rs.head[h] * p.o_stride[2] + col0;
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        *reinterpret_cast<uint32_t*>(dst + 8 * i + 2 * t) =
            hab_sm90::pack2<IS_BF16>(o[4 * i + 2 * h] * inv[h], o[4 * i + 2 * h + 1] * inv[h]);
      }
    }
  }
}

// The fp8 cache's scale (1 for a 16-bit cache): the logits' and the output's factor
template <int KVF>
HAB_DEV float kv_scale_of(const HabMlaDecodeParams& p) {
  if (KVF == KV_16BIT) return 1.f;
  return p.kv_scale_ptr != nullptr ? *p.kv_scale_ptr : p.kv_scale_value;
}

// Warpgroup 0: per tile S, the mask, the online softmax, P for both warpgroups, its half
// of O; at the end each row's LSE (or max and sum) and 1 / l for warpgroup 1. The
// products run on MMA_BF16 operands (fp16 for an fp8 cache), out is written as OUT_BF16.
template <bool OUT_BF16, int KVF>
HAB_DEV void softmax_warpgroup(const HabMlaDecodeParams& p, const Work& w, const Barriers& b, uint32_t smem,
                               int warp, int lane) {
  constexpr bool MMA_BF16 = OUT_BF16 && KVF == KV_16BIT;
  const int t = lane & 3;
  const Rows rs(p, w, warp, lane);
  const float ks = kv_scale_of<KVF>(p);
  int diag[2];  // the last key each row sees
#pragma unroll
  for (int h = 0; h < 2; ++h) diag[h] = w.seq_len - int(p.num_tokens) + int(rs.tok[h]);
  const bool causal = p.num_tokens > 1;
  float mult[2] = {p.scale * LOG2E * ks, p.scale * LOG2E * ks};  // times 1 / a widened Q row's scale
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float o[128];  // this warpgroup's 64 x 256 of O
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  uint32_t pa[16];  // P of the tile, the A fragments of the P V product (k-step kk: 4 kk ..)
#pragma unroll
  for (int i = 0; i < 16; ++i) pa[i] = 0u;
  const uint32_t q_tile = smem + Q_OFF;
  hab_sm90::mbar_wait(b.full_q, 0);
  if (widens_query<KVF>(p)) {
    mult[0] *= b.q_inv[rs.r[0]];
    mult[1] *= b.q_inv[rs.r[1]];
  }
  for (int j = 0; j < w.n_tiles; ++j) {
    const int s = j % STAGES;
    const uint32_t k_tile = smem + K_OFF + s * TILE_BYTES;
    hab_sm90::mbar_wait(b.full_k + s, (j / STAGES) & 1);
    uint32_t bits[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) bits[k] = b.mask[4 * s + k];
    hab_sm90::fence_proxy_async();
    float sc[32];
    hab_sm90::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < WIDTH / 16; ++ks) {
      const uint32_t off = (ks / 4) * PANEL_BYTES + (ks % 4) * 32;
      hab_sm90::wgmma_ss_m64n64k16<MMA_BF16>(sc, hab_sm90::desc_sw128(q_tile + off, 16, 1024),
                                            hab_sm90::desc_sw128(k_tile + off, 16, 1024), ks > 0);
    }
    hab_sm90::wgmma_commit();
    hab_sm90::wgmma_wait<0>();
    hab_sm90::fence_regs(sc);
    // column c is key n0 + c: visible when present (its mask bit) and, for T > 1, at or
    // before the row's own position
    const int n0 = w.key_lo + j * BLOCK_N;
    const bool all_keys = (bits[0] & bits[1] & bits[2] & bits[3] & 0xffffu) == 0xffffu;
    if (!all_keys || (causal && n0 + BLOCK_N - 1 > min(diag[0], diag[1]))) {  // only tiles that need it pay
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = 8 * i + 2 * t + (e & 1);
          const bool key = (bits[i >> 1] >> (col & 15)) & 1u;
          const bool vis = key && (!causal || n0 + col <= diag[e >> 1]);
          sc[4 * i + e] = vis ? sc[4 * i + e] : -INFINITY;
        }
      }
    }
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < 8; ++i) mx = fmaxf(mx, fmaxf(sc[4 * i + 2 * h], sc[4 * i + 2 * h + 1]));
      mx = fmaxf(mx, hab_shfl_xor(mx, 1));
      mx = fmaxf(mx, hab_shfl_xor(mx, 2));
      const float m_new = fmaxf(m[h], mx * mult[h]);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // nothing seen yet: p = 0
      alpha[h] = hab_ex2_ftz(m[h] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          float& x = sc[4 * i + 2 * h + e];
          x = hab_ex2_ftz(fmaf(x, mult[h], -m_use));
          sum += x;
        }
      }
      l[h] = l[h] * alpha[h] + sum;
      m[h] = m_new;
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) pa[i] = hab_sm90::pack2<MMA_BF16>(sc[2 * i], sc[2 * i + 1]);
    // P and the factors to warpgroup 1, once its product of the last tile has read them
    if (j > 0) hab_sm90::named_sync(BAR_P_EMPTY, 256);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = rs.r[h];
        const uint32_t addr = smem + P_OFF + r * 128 + ((i ^ (r & 7)) << 4) + 4 * t;
        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(pa[2 * i + h]) : "memory");
      }
    }
    if (t == 0) {
      b.alpha[rs.r[0]] = alpha[0];
      b.alpha[rs.r[1]] = alpha[1];
    }
    hab_sm90::fence_proxy_async();
    hab_sm90::named_arrive(BAR_P_FULL, 256);
    rescale(o, alpha);
    hab_sm90::fence_regs(o);
    hab_sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {  // value channels 0..255: panels 0-3
      const uint32_t a[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
      hab_sm90::wgmma_rs_m64n256k16_tb<MMA_BF16>(o, a, hab_sm90::desc_sw128(k_tile + kk * 16 * 128, PANEL_BYTES, 1024));
    }
    hab_sm90::wgmma_commit();
    // waited here, not with the next S: the stage goes back to the producers as soon as
    // both halves of P V are done, so the tile after next loads over most of an iteration
    // (a wait<1> after the next S made ptxas serialize the products)
    hab_sm90::wgmma_wait<0>();
    hab_sm90::fence_regs(o);
    hab_sm90::fence_regs_u32(pa);
    release(b.empty_k + s, lane);
  }
  float inv[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = l[h];
    sum += hab_shfl_xor(sum, 1);
    sum += hab_shfl_xor(sum, 2);
    inv[h] = sum > 0.f ? 1.f / sum : 0.f;
    if (t == 0) b.inv_l[rs.r[h]] = inv[h];
    if (t == 0 && rs.ok[h]) {
      if (p.num_partitions > 1) {
        const int64_t slot = w.seq * p.num_partitions + blockIdx.z;
        const int64_t at = slot * p.ml_stride[0] + int64_t(w.row0 + rs.r[h]) * p.ml_stride[1];
        p.max_logits[at] = m[h];
        p.exp_sums[at] = sum;
      } else if (p.lse != nullptr) {
        p.lse[w.seq * p.lse_stride[0] + rs.tok[h] * p.lse_stride[1] + rs.head[h] * p.lse_stride[2]] =
            sum > 0.f ? (m[h] + __log2f(sum)) * LN2 : -INFINITY;
      }
    }
  }
  hab_sm90::named_sync(BAR_FINISH, 256);  // 1 / l to warpgroup 1
  const float out_scale[2] = {inv[0] * ks, inv[1] * ks};
  store_rows<OUT_BF16>(p, w, rs, o, out_scale, 0, t);
}

// Warpgroup 1: its half of O from warpgroup 0's P and factors.
template <bool OUT_BF16, int KVF>
HAB_DEV void value_warpgroup(const HabMlaDecodeParams& p, const Work& w, const Barriers& b, uint32_t smem, int wq,
                             int lane) {
  constexpr bool MMA_BF16 = OUT_BF16 && KVF == KV_16BIT;
  const int t = lane & 3;
  const Rows rs(p, w, wq, lane);
  float o[128];  // this warpgroup's 64 x 256 of O
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] = 0.f;
  for (int j = 0; j < w.n_tiles; ++j) {
    const int s = j % STAGES;
    const uint32_t k_tile = smem + K_OFF + s * TILE_BYTES;
    hab_sm90::named_sync(BAR_P_FULL, 256);
    hab_sm90::mbar_wait(b.full_k + s, (j / STAGES) & 1);
    hab_sm90::fence_proxy_async();
    const float alpha[2] = {b.alpha[rs.r[0]], b.alpha[rs.r[1]]};
    rescale(o, alpha);
    hab_sm90::fence_regs(o);
    hab_sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {  // value channels 256..511: panels 4-7
      hab_sm90::wgmma_ss_m64n256k16_tb<MMA_BF16>(o, hab_sm90::desc_sw128(smem + P_OFF + kk * 32, 16, 1024),
                                                hab_sm90::desc_sw128(k_tile + kk * 16 * 128 + 4 * PANEL_BYTES, PANEL_BYTES, 1024));
    }
    hab_sm90::wgmma_commit();
    hab_sm90::wgmma_wait<0>();
    hab_sm90::fence_regs(o);
    if (j + 1 < w.n_tiles) hab_sm90::named_arrive(BAR_P_EMPTY, 256);  // warpgroup 0 waits for it before P of j + 1
    release(b.empty_k + s, lane);
  }
  hab_sm90::named_sync(BAR_FINISH, 256);
  const float ks = kv_scale_of<KVF>(p);
  const float out_scale[2] = {b.inv_l[rs.r[0]] * ks, b.inv_l[rs.r[1]] * ks};
  store_rows<OUT_BF16>(p, w, rs, o, out_scale, HALF, t);
}

template <bool OUT_BF16, int KVF>
__global__ void __launch_bounds__(THREADS, 1) mla_decode_kernel(const __grid_constant__ HabMlaDecodeParams p) {
#if defined(HAB_SM90A)
  const Work w = work_of(p);
  if (!w.active) return;  // the same for every thread of the program
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const uint32_t raw = hab_sm90::smem_addr(smem_raw);
  uint8_t* base = smem_raw + ((1024 - (raw & 1023)) & 1023);  // the swizzle pattern's period
  Barriers b;
  uint64_t* bars = reinterpret_cast<uint64_t*>(base + BAR_OFF);
  b.full_q = bars;
  b.full_k = bars + 1;
  b.empty_k = bars + 1 + STAGES;
  b.mask = reinterpret_cast<uint32_t*>(base + MASK_OFF);
  b.alpha = reinterpret_cast<float*>(base + ALPHA_OFF);
  b.inv_l = reinterpret_cast<float*>(base + INV_OFF);
  b.q_inv = reinterpret_cast<float*>(base + QINV_OFF);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    constexpr int COPIERS = PRODUCER_WARPS * 32;
    hab_sm90::mbar_init(b.full_q, COPIERS);
    for (int s = 0; s < STAGES; ++s) {
      hab_sm90::mbar_init(b.full_k + s, COPIERS + PRODUCER_WARPS);  // copies + the mask words
      hab_sm90::mbar_init(b.empty_k + s, CONSUMER_WARPS);
    }
  }
  __syncthreads();
  const uint32_t smem = hab_sm90::smem_addr(base);
  if (warp >= CONSUMER_WARPS) {
    hab_sm90::setmaxnreg_dec<(KVF == KV_16BIT ? PRODUCER_REGS : FP8_PRODUCER_REGS)>();
    producer<KVF>(p, w, b, smem, warp - CONSUMER_WARPS, lane);
  } else if (warp < 4) {
    hab_sm90::setmaxnreg_inc<SOFTMAX_REGS>();
    softmax_warpgroup<OUT_BF16, KVF>(p, w, b, smem, warp, lane);
  } else {
    value_warpgroup<OUT_BF16, KVF>(p, w, b, smem, warp - 4, lane);
  }
#else
  __trap();  // built without sm_90a: the host never launches this (hab_mla_decode)
#endif
}

template <bool OUT_BF16, int KVF>
const char* launch(const HabMlaDecodeParams& p, cudaStream_t stream) {
  auto kernel = mla_decode_kernel<OUT_BF16, KVF>;
  static uint64_t configured = 0;  // one bit per device
  int dev = 0;
  if (const char* err = hab_sm90::opt_in_smem(kernel, SMEM_BYTES, configured, dev)) return err;
  const dim3 grid(unsigned(hab_cdiv(p.num_tokens * p.num_heads, ROWS)), unsigned(p.num_seqs),
                  unsigned(p.num_partitions));
  kernel<<<grid, THREADS, SMEM_BYTES, stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace hab_mla
#endif  // HAB_CUDA

extern "C" const char* hab_mla_decode(const HabMlaDecodeParams* p, void* stream) {
#if defined(HAB_CUDA)
  using namespace hab_mla;
  if (p->width != WIDTH || p->rank != RANK) return "mla_decode: the native kernel takes rows of 512 + 64";
  if (p->dtype != HAB_F16 && p->dtype != HAB_BF16) return "mla_decode: dtype must be fp16 or bf16";
  if (p->kv_dtype != p->dtype && p->kv_dtype != HAB_FP8_E4M3 && p->kv_dtype != HAB_FP8_E5M2)
    return "mla_decode: the cache must be of q's dtype or fp8 (e4m3fn / e5m2)";
  if (p->page_size <= 0 || p->num_partitions <= 0) return "mla_decode: bad page_size or num_partitions";
  if (p->num_seqs > 65535 || p->num_partitions > 65535) return "mla_decode: more than 65,535 requests or partitions";
  if (hab_device_cc() != 90) return "mla_decode: the native kernel needs an sm_90 GPU (H100/H200)";
  if (p->num_seqs == 0 || p->num_tokens * p->num_heads == 0) return nullptr;
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool bf16 = p->dtype == HAB_BF16;
  if (p->kv_dtype == HAB_FP8_E4M3) return bf16 ? launch<true, KV_E4M3>(*p, s) : launch<false, KV_E4M3>(*p, s);
  if (p->kv_dtype == HAB_FP8_E5M2) return bf16 ? launch<true, KV_E5M2>(*p, s) : launch<false, KV_E5M2>(*p, s);
  return bf16 ? launch<true, KV_16BIT>(*p, s) : launch<false, KV_16BIT>(*p, s);
#else
  (void)p;
  (void)stream;
  return "mla_decode: the native kernel needs an NVIDIA sm_90 GPU (wgmma); none on HIP";
#endif
}
