// The split-N decode loop (mma.sync targets), included by decode_kernel.cuh after the
// pieces it shares with the shared-softmax loop (Layout, StageGeometry, SplitN, store_out).
#pragma once

#include <type_traits>

#include "compat.h"
#include "tile_mma.cuh"

namespace hab_decode {

#if defined(HAB_HAS_MMA_SYNC)
// Split-N decode loop (mma.sync, one 16-row tile): warp w owns tokens [16 w, 16 w + 16) of
// every KV tile of SPLIT_N_TOKENS (64) tokens and all head_dim channels of O.
// A warp keeps its own online-softmax state (m, l) and O accumulator for its tokens, all
// in registers: S = Q K^T of its 16 tokens is one 16x16 fragment, P is built from it in
// the A layout of the P V product, so a tile needs no shared-memory round trip and no
// barrier beyond the staging ones. The token slices' (m, l, O) are merged once at the end,
// through shared memory (the K/V staging area, free by then).
// At head_dim 128 a thread holds a 64-register O and a stage is 35 KB, so 2 programs (3
// stages) fit an SM. (A 32-token layout, two warps a slice, half the O and the stage,
// measured 1-12% slower at 16 of 18 shapes and was dropped: docs/history.md.)
//
// Pipeline: `stages` cp.async stages (a runtime value, 2..MAX_SPLIT_N_STAGES), one commit
// group per tile. At the top of tile t the groups 0..t+stages-2 are committed; waiting
// until at most stages-2 are pending means tile t landed. The barrier after it also says
// every warp is done with tile t-1, whose stage, (t+stages-1) % stages, then takes tile
// t+stages-1. So stages-1 tiles are in flight while a tile is computed (2 stages: one,
// the next tile). Past the last tile an empty group keeps the count uniform.
HAB_DEV void cp_async16(void* smem_dst, const void* gmem_src, bool fill) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
  const int src_bytes = fill ? 16 : 0;  // 0: the 16 bytes are zero-filled, nothing is read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem_src), "r"(src_bytes));
}
HAB_DEV void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
HAB_DEV void cp_async_wait_all() { asm volatile("cp.async.wait_group 0;\n" ::); }
// wait until at most `pending` (0..MAX_SPLIT_N_STAGES - 2) of this thread's groups are in flight
// (the entry runs 2 to 4 stages: pending 0 to 2)
HAB_DEV void cp_async_wait_pending(int pending) {
  static_assert(MAX_SPLIT_N_STAGES == 4, "one case per pending count");
  if (pending >= 2) asm volatile("cp.async.wait_group 2;\n" ::);
  else if (pending == 1) asm volatile("cp.async.wait_group 1;\n" ::);
  else asm volatile("cp.async.wait_group 0;\n" ::);
}

// How far (log2 units) a logit may exceed a row's reference max before the max moves and
// O, l are rescaled. With the exact running max (0) a 16-row group rescales O on most
// tiles of a short partition (some row's max still rises: P(any of 16 rows) ~ 1 - (1 -
// 1/t)^16 at tile t, 88% at t = 8), 8 x CTW multiplies a thread each time; with a slack
// of 8 it happens about once per partition, and P <= 256 stays exact to its 16-bit
// rounding in either dtype (fp16 reaches 65504). l and O are relative to the same
// reference, so the result is the same softmax.
constexpr float RESCALE_SLACK = 8.f;

// P = 2^x with x <= RESCALE_SLACK or -inf: hab_ex2_ftz (compat.h), one instruction.

// ---- fp8 KV (KVF = KV_E4M3 / KV_E5M2): the products run on fp16 operands, widened from
// the staged fp8 bytes after ldmatrix, so the stages hold (and cp.async moves) one byte an
// element. ldmatrix reads a 16-byte chunk of 16 channels as 8 16-bit columns:
//  - K (not transposed): lane (g, t4) gets token g's channels 4 t4 .. 4 t4 + 3 of the chunk.
//    The product sums over the channels, so the k-step's order is permuted instead of the
//    bytes: channels 4t4, 4t4+1 play the fragment's k = 2t4, 2t4+1 and 4t4+2, 4t4+3 play
//    k = 2t4+8, 2t4+9; the query's fragments take the same order (fp8_query_fragments).
//  - V (transposed): lane (g, t4) gets tokens 2t4, 2t4+1 of channels 2g and 2g+1; a byte
//    permute pairs each channel's two tokens, so a chunk gives the B fragments of two
//    8-column tiles, the even channels 16c + 2n and the odd ones 16c + 2n + 1
//    (fp8_mma_v_chunk); the merge puts O's columns back in order.

// four fp8 codes (bytes 0..3 of x) -> fp16 pairs (bytes 0, 1) in lo and (2, 3) in hi, low
// byte in the low half; exact (every e4m3 / e5m2 value is an fp16 value)
template <int KVF>
HAB_DEV void fp8x4_to_f16x2(uint32_t x, uint32_t& lo, uint32_t& hi) {
#if __CUDA_ARCH__ >= 890
  if constexpr (KVF == KV_E4M3)
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; cvt.rn.f16x2.e4m3x2 %1, h; }\n"
        : "=r"(lo), "=r"(hi) : "r"(x));
  else
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e5m2x2 %0, l; cvt.rn.f16x2.e5m2x2 %1, h; }\n"
        : "=r"(lo), "=r"(hi) : "r"(x));
#else
  hab_fp8x4_widen<KVF == KV_E4M3, false>(x, lo, hi);
#endif
}

// c[0..3] += A B(tokens 0-7), c[4..7] += A B(tokens 8-15) for one k-step of 16 channels;
// n0, n1: the ldmatrix registers of the two 8-token matrices of K (fp8)
template <int KVF>
HAB_DEV void fp8_mma_k_pair(float (&c)[8], const uint32_t (&a)[4], uint32_t n0, uint32_t n1) {
  uint32_t b0[2], b1[2];
  fp8x4_to_f16x2<KVF>(n0, b0[0], b0[1]);
  fp8x4_to_f16x2<KVF>(n1, b1[0], b1[1]);
  hab_mma_m16n8k16<HabHalf>(*reinterpret_cast<float(*)[4]>(c), a, b0);
  hab_mma_m16n8k16<HabHalf>(*reinterpret_cast<float(*)[4]>(c + 4), a, b1);
}

// o[0..3] += P V(even channels of the chunk), o[4..7] += P V(odd channels); t0, t1: the
// transposed ldmatrix registers of tokens 0-7 and 8-15 of one 16-channel chunk of V (fp8)
template <int KVF>
HAB_DEV void fp8_mma_v_chunk(float (&o)[8], const uint32_t (&a)[4], uint32_t t0, uint32_t t1) {
  // bytes (tok 2t4 ch 2g, tok 2t4 ch 2g+1, tok 2t4+1 ch 2g, tok 2t4+1 ch 2g+1) -> the
  // channel 2g pair, then the channel 2g+1 pair
  uint32_t even[2], odd[2];
  fp8x4_to_f16x2<KVF>(__byte_perm(t0, 0u, 0x3120), even[0], odd[0]);
  fp8x4_to_f16x2<KVF>(__byte_perm(t1, 0u, 0x3120), even[1], odd[1]);
  hab_mma_m16n8k16<HabHalf>(*reinterpret_cast<float(*)[4]>(o), a, even);
  hab_mma_m16n8k16<HabHalf>(*reinterpret_cast<float(*)[4]>(o + 4), a, odd);
}

// The query's A fragments for fp8 KV: rows g, g + 8 of the 16-row tile q (KIND, row stride
// ldq), KH k-steps of 16 channels in the permuted order of fp8_mma_k_pair, as fp16 scaled by
// 2^-shift per row so that the row's largest finite |q| fits fp16 (shift = 0 below 2^16,
// i.e. always for fp16 queries); up[k] = 2^shift multiplies the row's logits back. NaN and
// inf entries are left out of the range (their rows stay NaN).
template <typename KIND, int KH>
HAB_DEV void fp8_query_fragments(uint32_t (&qa)[KH][4], float (&up)[2], const uint16_t* q, int ldq, int lane) {
  const int g = lane >> 2, t4 = lane & 3;
  auto quad = [&](int i, int k) {  // channels 16 i + 4 t4 .. + 3 of row g + 8 k
    return *reinterpret_cast<const uint2*>(q + (g + 8 * k) * ldq + 16 * i + 4 * t4);
  };
  auto value = [](const uint2& w, int e) {
    return KIND::to_float(uint16_t((e < 2 ? w.x : w.y) >> (16 * (e & 1))));
  };
  float down[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    float mx = 0.f;
#pragma unroll
    for (int i = 0; i < KH; ++i) {
      const uint2 w = quad(i, k);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float v = fabsf(value(w, e));
        mx = v < INFINITY ? fmaxf(mx, v) : mx;  // NaN compares false
      }
    }
    mx = hab_group_max<4>(mx);  // the quad holds the row's channels
    const int shift = max(int((hab_float_to_bits(mx) >> 23) & 0xffu) - 127 - 15, 0);
    down[k] = hab_bits_to_float(uint32_t(127 - shift) << 23);
    up[k] = hab_bits_to_float(uint32_t(127 + shift) << 23);
  }
#pragma unroll
  for (int i = 0; i < KH; ++i)
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const uint2 w = quad(i, k);
      qa[i][k] = hab_pack2f<HabHalf>(value(w, 0) * down[k], value(w, 1) * down[k]);
      qa[i][2 + k] = hab_pack2f<HabHalf>(value(w, 2) * down[k], value(w, 3) * down[k]);
    }
}

// Token rows: thread tid < BLOCK_N reads the block id of token tid of a tile (one table
// read per token instead of one per staged chunk: the threads staging one token's row
// share it) and its slot, rows[tile & 1][tid] = (block, slot) in shared memory (block -1: a
// token to skip), so the 8 threads that stage the row do no division. The table read of
// tile A + 1 is issued after the barrier of the iteration that stages tile A and the pair
// stored after that iteration's math, so its latency overlaps a tile; the next barrier
// publishes it. The buffer A + 1 & 1 was last read by issue(A - 1), before that barrier.
// load_q() stores the Q tile into q_s; it runs after the first tile's block ids are read,
// so the two latencies overlap (the prologue's first barrier publishes both).
template <typename KIND, int HEAD_DIM_PAD, int KVF, typename BlockOf, typename LoadQ>
HAB_DEV void decode_split_n(const HabDecodeParams& p, int part_end, int loop_start, int seq_len, int rows,
                            int row0, int group, int kv_head, int64_t seq, int part, int head_dim, float qk_scale,
                            float sm_scale, float v_scale, bool use_cap, bool use_window, const uint16_t* q_s,
                            uint8_t* stage_smem, int stages, bool po_vec, bool o_vec, const StageGeometry& geo,
                            BlockOf& block_of, LoadQ& load_q) {
  typedef Layout<16, HEAD_DIM_PAD> L;
  // fp8 KV (KVF e4m3 / e5m2): one byte an element, both products on fp16 operands (every
  // fp8 value is an fp16 value; the query is scaled into fp16's range: fp8_query_fragments)
  constexpr bool FP8 = KVF != KV_16BIT;
  constexpr int KVB = FP8 ? 1 : 2;
  typedef SplitNGeometry<HEAD_DIM_PAD, KVB> G;
  typedef typename std::conditional<FP8, HabHalf, KIND>::type MMA_KIND;  // the products' operands
  typedef HabWarpTile<MMA_KIND, 32> Tile;
  constexpr int BLOCK_N = SPLIT_N_TOKENS;
  constexpr int SLICES = G::SLICES, CTW = G::CTW;  // token slices of a tile; O column tiles of a warp
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int slice = warp % SLICES, ct0 = (warp / SLICES) * CTW;  // this warp's tokens and channels
  const bool keeps_state = warp < SLICES;  // one warp a slice publishes (m, l) for the merge
  const int g = lane >> 2, t4 = lane & 3;
  const int num_tiles = part_end > loop_start ? (part_end - loop_start + BLOCK_N - 1) / BLOCK_N : 0;
  // stage s: K [BLOCK_N][ROW_BYTES], V [BLOCK_N][ROW_BYTES] (chunks swizzled: G::kv_off,
  // bytes), token flags [BLOCK_N] bytes
  constexpr int STAGE_BYTES = G::STAGE_BYTES, ROW_BYTES = G::ROW_BYTES;
  static_assert((L::LDK * 2) % 16 == 0 && L::K_OFF % 16 == 0 && STAGE_BYTES % 16 == 0 &&
                    (BLOCK_N * ROW_BYTES) % 16 == 0,
                "ldmatrix and cp.async need 16-byte aligned rows in every stage");
  auto k_stage = [&](int s) { return stage_smem + s * STAGE_BYTES; };
  auto v_stage = [&](int s) { return k_stage(s) + BLOCK_N * ROW_BYTES; };
  auto ok_stage = [&](int s) { return stage_smem + s * STAGE_BYTES + 2 * BLOCK_N * ROW_BYTES; };  // [BLOCK_N] bytes
  // a lane's ldmatrix row address inside a stage
  auto smem16 = [](const uint8_t* at) { return reinterpret_cast<const uint16_t*>(at); };
  int2* rows_s = reinterpret_cast<int2*>(stage_smem + stages * STAGE_BYTES);  // [2][BLOCK_N] (block, slot)
  // token tid of tile `tile` (tid < BLOCK_N): its block id (-1: skip) and its slot
  auto block_of_tile = [&](int tile) { return block_of(loop_start + tile * BLOCK_N + tid); };
  auto slot_of_tile = [&](int tile) { return geo.slot_of(loop_start + tile * BLOCK_N + tid); };
  // K and V with the same block and slot strides (the engines' caches: one allocation
  // split in two, or two of one shape; a warp-uniform fact): a V row is its K row plus one
  // fixed distance, and the table holds each token's K row as a byte offset from k_base
  // (-1: skip), computed once by the thread that read the block id instead of by each of
  // the 8 threads that stage the row. Otherwise it holds (block, slot).
  const bool kv_same = geo.k_block == geo.v_block && geo.k_slot == geo.v_slot;
  int64_t* rows_off = reinterpret_cast<int64_t*>(rows_s);  // the same 8 bytes a token
  auto store_rows = [&](int tile, int blk, int slot) {
    const int i = (tile & 1) * BLOCK_N + tid;
    if (kv_same) rows_off[i] = blk >= 0 ? KVB * geo.k_row(blk, slot) : int64_t(-1);
    else rows_s[i] = make_int2(blk, slot);
  };
  // K/V rows of a tile straight into shared memory (cp.async, no registers); bad tokens
  // are zero-filled without a read. TPT = 8 threads stage one token: thread u copies chunks
  // u, u + 8, ... (8 channels each), so each copy instruction of the warp moves whole
  // 128-byte lines (one request per line, as with 16 threads a row) into consecutive
  // shared-memory words of one row (no bank conflict), and a thread computes one row
  // address per token instead of one per chunk. (4 or 2 threads a token take 6-9% fewer
  // instructions but make 2-4 requests per line and 2-way bank conflicts.) Needs rows
  // whose channels are contiguous (the split-N condition; split-x K runs the
  // shared-softmax loop).
  constexpr int TPT = 8, CPT = G::ROW_CH / TPT, TOKENS_PER_PASS = NUM_WARPS * 32 / TPT;
  constexpr int PASSES = BLOCK_N / TOKENS_PER_PASS;
  constexpr int CHUNK_ELEMS = 16 / KVB;  // channels a 16-byte chunk holds
  static_assert(G::ROW_CH % TPT == 0 && PASSES * TOKENS_PER_PASS == BLOCK_N, "a tile's rows split evenly");
  const int u = tid % TPT, tn0 = tid / TPT;  // chunk lane, first token of this thread
  bool chunk_in[CPT];  // chunk u + TPT j is inside head_dim (else it stays zero, never read)
#pragma unroll
  for (int j = 0; j < CPT; ++j) chunk_in[j] = CHUNK_ELEMS * (u + TPT * j) < head_dim;
  // byte offset of chunk u + TPT j in a row; a chunk past head_dim copies nothing and
  // addresses the row's start (inside the cache)
  int chunk_off[CPT];
#pragma unroll
  for (int j = 0; j < CPT; ++j) chunk_off[j] = chunk_in[j] ? 16 * TPT * j : 0;
  // where chunk u + TPT j of token tn0 + pass * TOKENS_PER_PASS lands in a stage: row n's
  // swizzle is n % 8 = tn0 % 8 for every pass, so it is this offset plus constants
  static_assert(TOKENS_PER_PASS % 8 == 0 && TPT == 8 && G::ROW_CH == TPT * CPT, "the swizzle repeats every pass");
  const int dst0 = G::kv_off(tn0, u);
  const int64_t kv_delta = int64_t(reinterpret_cast<uintptr_t>(geo.v_base)) -
                           int64_t(reinterpret_cast<uintptr_t>(geo.k_base));
  const uint8_t* k_thread = geo.k_base + 16 * u;  // this thread's chunk u of a row at offset 0
  // bit i: every token this thread staged for the i-th most recent tile was valid; the
  // barrier of a tile ANDs them over the block (a full tile needs no token mask)
  uint32_t ok_hist = 0;
  auto issue_rows = [&](int tile, int s, auto same) {  // s: the stage it goes to, tile % stages
    constexpr bool SAME = decltype(same)::value;
    const int2* tile_rows = rows_s + (tile & 1) * BLOCK_N;
    const int64_t* tile_off = rows_off + (tile & 1) * BLOCK_N;
    uint8_t* ks = k_stage(s) + dst0;
    uint8_t* vs = v_stage(s) + dst0;
    uint8_t* oks = ok_stage(s);
    bool all_ok = true;
#pragma unroll
    for (int pass = 0; pass < PASSES; ++pass) {
      const int n = tn0 + pass * TOKENS_PER_PASS;
      // no branch: a skipped token addresses block 0, slot 0 of the head (inside the
      // cache; a zero-byte copy reads nothing)
      bool tok_ok;
      const uint8_t *k_row, *v_row;
      if constexpr (SAME) {
        const int64_t off = tile_off[n];
        tok_ok = off >= 0;
        k_row = k_thread + (tok_ok ? off : 0);
        v_row = k_row + kv_delta;
      } else {
        const int2 bs = tile_rows[n];
        tok_ok = bs.x >= 0;
        const int blk = tok_ok ? bs.x : 0, slot = tok_ok ? bs.y : 0;
        k_row = k_thread + KVB * geo.k_row(blk, slot);
        v_row = geo.v_base + KVB * geo.v_row(blk, slot) + 16 * u;
      }
      all_ok = all_ok && tok_ok;
#pragma unroll
      for (int j = 0; j < CPT; ++j) {  // chunk u + TPT j: channels 8 (u + TPT j) ..
        const bool fill = tok_ok && chunk_in[j];
        const int at = pass * TOKENS_PER_PASS * ROW_BYTES + 128 * j;  // + dst0: G::kv_off(n, u + TPT j)
        cp_async16(ks + at, k_row + chunk_off[j], fill);
        cp_async16(vs + at, v_row + chunk_off[j], fill);
      }
      if (u == 0) oks[n] = tok_ok;
    }
    ok_hist = (ok_hist << 1) | (all_ok ? 1u : 0u);
    cp_async_commit();
  };
  auto issue = [&](int tile, int s) {
    if (kv_same) {
      issue_rows(tile, s, std::true_type{});
      return;
    }
    issue_rows(tile, s, std::false_type{});
  };
  auto push_empty = [&]() {  // an empty group past the last tile
    ok_hist = (ok_hist << 1) | 1u;
    cp_async_commit();
  };
  // rows g and g + 8 of this lane: last visible key, validity
  int pos[2];
  bool row_ok[2];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const int r = g + 8 * k;
    row_ok[k] = r < rows;
    pos[k] = seq_len - int(p.num_tokens) + (row0 + r) / group;
  }
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // l: this lane's partial sum
  // the sink counts once: slice 0 (its warps share one state), one lane a quad
  if (p.sinks && part == 0 && slice == 0) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      if (row_ok[k]) {
        m[k] = p.sinks[kv_head * group + (row0 + g + 8 * k) % group] * LOG2E;
        l[k] = t4 == 0 ? 1.f : 0.f;
      }
    }
  }
  float o[CTW][8];
#pragma unroll
  for (int ct = 0; ct < CTW; ++ct)
#pragma unroll
    for (int e = 0; e < 8; ++e) o[ct][e] = 0.f;

  // prologue: Q and tile 0's rows, then tiles 0 .. stages-2 (their rows read here, one
  // barrier each)
  const bool first_rows = tid < BLOCK_N && num_tiles > 0;
  const int blk0 = first_rows ? block_of_tile(0) : -1, slot0 = first_rows ? slot_of_tile(0) : 0;
  load_q();
  if (first_rows) store_rows(0, blk0, slot0);
  // the last valid key of the first row: a tile ending at or before it needs no causal mask
  const int pos_lo = seq_len - int(p.num_tokens);
  for (int t = 0; t < stages - 1; ++t) {
    __syncthreads();  // rows of tile t are visible; issue(t - 1) is done with the other buffer
    if (t < num_tiles) {
      const bool more = tid < BLOCK_N && t + 1 < num_tiles;
      const int next = more ? block_of_tile(t + 1) : -1;
      const int next_slot = more ? slot_of_tile(t + 1) : 0;
      issue(t, t);
      if (tid < BLOCK_N) store_rows(t + 1, next, next_slot);
    } else {
      push_empty();
    }
  }
  // Q's A fragments stay in registers for the whole loop (32 registers a thread at head_dim
  // 128; 2 programs an SM leave them: MinBlocks) instead of 8 ldmatrix a warp a tile, a
  // third of the loop's shared-memory reads: 0.2-0.4% at the large grids on the H200.
  constexpr int KH = HEAD_DIM_PAD / 16 / (NUM_WARPS / SLICES);  // 16-channel steps a warp
  static_assert(KH % 2 == 0, "two chains of whole steps");
  const int kk0 = (warp / SLICES) * KH;
  uint32_t qa[KH][4];  // Q's A fragments of this warp's k-steps
  // logits in log2 units (qk_row) and natural units (sm_row, the soft cap) of rows g, g + 8
  float qk_row[2] = {qk_scale, qk_scale}, sm_row[2] = {sm_scale, sm_scale};
  // Q is visible: the prologue's first barrier published it
  if constexpr (FP8) {
    static_assert(NUM_WARPS == SLICES, "a warp holds every channel of its rows (the rows' range)");
    float up[2];
    fp8_query_fragments<KIND, KH>(qa, up, q_s + kk0 * 16, L::LDK, lane);
#pragma unroll
    for (int k = 0; k < 2; ++k) qk_row[k] *= up[k], sm_row[k] *= up[k];
  } else {
#pragma unroll
    for (int i = 0; i < KH; ++i) Tile::ldsm_a(qa[i], q_s + (kk0 + i) * 16, L::LDK, lane);
  }
  // stage indices advance by one per tile (a run-time modulo is a division)
  auto next_stage = [&](int s) { return s + 1 == stages ? 0 : s + 1; };
  int s = 0, s_ahead = stages - 1;  // stages of `tile` and of `tile + stages - 1`
  for (int tile = 0; tile < num_tiles; ++tile, s = next_stage(s), s_ahead = next_stage(s_ahead)) {
    const int start = loop_start + tile * BLOCK_N;
    const uint8_t* k_s = k_stage(s);
    const uint8_t* v_s = v_stage(s);
    const uint8_t* ok_s = ok_stage(s);
    cp_async_wait_pending(stages - 2);  // this thread's copies of the tile landed
    // everyone's did, and every warp is done with tile - 1; and whether every token of the
    // tile is valid (this thread staged it stages - 1 issues ago)
    const bool tile_ok = __syncthreads_and(int((ok_hist >> (stages - 2)) & 1u)) != 0;
    const int ahead = tile + stages - 1;
    int next_id = -1, next_slot = 0;  // token tid of tile ahead + 1, its rows stored after the math
    if (ahead < num_tiles) {
      if (tid < BLOCK_N && ahead + 1 < num_tiles) {
        next_id = block_of_tile(ahead + 1);
        next_slot = slot_of_tile(ahead + 1);
      }
      issue(ahead, s_ahead);  // in flight during this tile's math (tile - 1's stage)
    } else {
      push_empty();
    }

    // S = Q K_slice^T: [16 rows, 16 tokens], element e of the lane: row g + 8 (e & 3) / 2,
    // token 16 slice + 8 (e / 4) + 2 t4 + (e & 1)
    // Two accumulator chains over the even and odd 16-channel steps, added at the end: each
    // mma waits for the one before it on its accumulator, so one chain of HEAD_DIM_PAD / 16
    // products is twice as long a dependency as two of half the length.
    float c[8], c_odd[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) c[e] = c_odd[e] = 0.f;
    // this lane's ldmatrix rows of K (token 16 slice + 8 (q >> 1) + r, chunk 2 kk + (q & 1))
    // and of V (token 16 slice + 8 (q & 1) + r, chunk 2 (ct0 + ct) + (q >> 1)); r = lane % 8
    // is the row's place in its 8-row group, so the swizzle XORs with r
    const int lq = lane >> 3, lr = lane & 7;
    const int k_lrow = slice * 16 + (lq >> 1) * 8 + lr, v_lrow = slice * 16 + (lq & 1) * 8 + lr;
    if constexpr (FP8) {
      // a 16-byte chunk is one k-step of 16 channels: matrices (tokens 0-7, step i), (8-15,
      // i), (0-7, i + 1), (8-15, i + 1) from rows slice * 16 + 8 (lq & 1) + lr, chunk i + (lq >> 1)
      const int f_lrow = slice * 16 + (lq & 1) * 8 + lr;
#pragma unroll
      for (int i = 0; i < KH; i += 2) {
        uint32_t b[4];
        Tile::template ldsm_x4<false>(b, smem16(k_s + G::kv_off(f_lrow, kk0 + i + (lq >> 1))));
        fp8_mma_k_pair<KVF>(c, qa[i], b[0], b[1]);
        fp8_mma_k_pair<KVF>(c_odd, qa[i + 1], b[2], b[3]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < KH; i += 2) {
        const int kk = kk0 + i;
        Tile::mma_a_regs_ldsm_bk(c, qa[i], smem16(k_s + G::kv_off(k_lrow, 2 * kk + (lq & 1))));
        Tile::mma_a_regs_ldsm_bk(c_odd, qa[i + 1], smem16(k_s + G::kv_off(k_lrow, 2 * (kk + 1) + (lq & 1))));
      }
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) c[e] += c_odd[e];
    // logits in log2 units (the soft cap is a warp-uniform branch around all 8), then the
    // mask as selects: no per-element branch
    if (use_cap) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float x = c[e] * sm_row[(e & 3) >> 1] / p.soft_cap;
        c[e] = p.soft_cap * (1.f - 2.f / (exp2f(x * (2.f * LOG2E)) + 1.f)) * LOG2E;
      }
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) c[e] *= qk_row[(e & 3) >> 1];
    }
    // The mask (warp-uniform choice): a full tile (every token valid, all before the first
    // row's last key, no window) keeps every logit; padded rows then see finite logits of
    // a zero query, which change nothing that is stored. Otherwise each element is masked
    // by selects on the tokens' flags (4 of them a lane, read as two byte pairs).
    if (!(tile_ok && start + BLOCK_N - 1 <= pos_lo && !use_window)) {
      const int n0 = slice * 16 + 2 * t4;
      const uint32_t f[2] = {*reinterpret_cast<const uint16_t*>(ok_s + n0),
                             *reinterpret_cast<const uint16_t*>(ok_s + n0 + 8)};
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int k = (e & 3) >> 1, n = n0 + 8 * (e >> 2) + (e & 1), j = start + n;
        const bool flag = (f[e >> 2] >> (8 * (e & 1))) & 0xffu;
        bool vis = row_ok[k] & flag & (j <= pos[k]);
        if (use_window) vis = vis & (j > pos[k] - int(p.sliding_window));
        c[e] = vis ? c[e] : -INFINITY;
      }
    }
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int e = 0; e < 8; ++e) mx[(e & 3) >> 1] = fmaxf(mx[(e & 3) >> 1], c[e]);
    float alpha[2], mu[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {  // the 4 lanes of a quad hold one row's 16 tokens
      mx[k] = hab_group_max<4>(mx[k]);
      // m is the row's reference max, moved only by a logit above it by more than
      // RESCALE_SLACK (log2 units; any finite logit when m is -inf): P <= 2^RESCALE_SLACK.
      // The rescale factor is exactly 1 when m stays, so the O rescale below is skipped
      // unless some row of the warp moved.
      const bool moves = mx[k] > m[k] + RESCALE_SLACK;
      const float m_new = moves ? mx[k] : m[k];
      mu[k] = m_new == -INFINITY ? 0.f : m_new;
      alpha[k] = moves ? hab_ex2_ftz(m[k] - mu[k]) : 1.f;
      m[k] = m_new;
      l[k] *= alpha[k];
    }
    float pf[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int k = (e & 3) >> 1;
      pf[e] = hab_ex2_ftz(c[e] - mu[k]);
      l[k] += pf[e];
    }
    // P in the A layout: a0 (g, 2t..), a1 (g + 8, 2t..), a2 (g, 2t + 8..), a3 (g + 8, 2t + 8..),
    // one conversion a pair (hab_pack2f)
    uint32_t a[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      a[i] = hab_pack2f<MMA_KIND>(pf[2 * i], pf[2 * i + 1]);
    }
    // the accumulators change scale only when a row's running max moved (alpha != 1);
    // past the first tiles that is rare, so the warp skips the 8 x CTW multiplies together
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int ct = 0; ct < CTW; ++ct)
#pragma unroll
        for (int e = 0; e < 8; ++e) o[ct][e] *= alpha[(e & 3) >> 1];
    }
    if constexpr (FP8) {
      // a 16-byte chunk is 16 channels, O's column tile ct: matrices (tokens 0-7, chunk
      // ct), (8-15, ct), (0-7, ct + 1), (8-15, ct + 1), read transposed
      const int f_lrow = slice * 16 + (lq & 1) * 8 + lr;
#pragma unroll
      for (int ct = 0; ct < CTW; ct += 2) {
        uint32_t b[4];
        Tile::template ldsm_x4<true>(b, smem16(v_s + G::kv_off(f_lrow, ct0 + ct + (lq >> 1))));
        fp8_mma_v_chunk<KVF>(o[ct], a, b[0], b[1]);
        fp8_mma_v_chunk<KVF>(o[ct + 1], a, b[2], b[3]);
      }
    } else {
#pragma unroll
      for (int ct = 0; ct < CTW; ++ct)
        Tile::mma_a_regs_ldsm_b(o[ct], a, smem16(v_s + G::kv_off(v_lrow, 2 * (ct0 + ct) + (lq >> 1))));
    }
    if (tid < BLOCK_N && ahead < num_tiles) store_rows(ahead + 1, next_id, next_slot);
  }

  // ---- merge the slices (shared memory, the stages reused): m_s, l_s [SLICES][16], then
  // O_s [SLICES][16][LDO] fp32, then the rows' output offsets [16] int64. The O rows are
  // padded by 8 floats, so a warp's float2 stores of a fragment hit 32 distinct banks per
  // half-warp (a row stride of HEAD_DIM_PAD floats put the fragment's 8 rows on one bank).
  constexpr int LDO = G::LDO;  // the merge's area: G::MERGE_BYTES, inside G::bytes(stages)
#pragma unroll
  for (int k = 0; k < 2; ++k) l[k] = hab_group_sum<4>(l[k]);
  cp_async_wait_all();  // only empty groups can be pending here; the merge reuses the stages
  __syncthreads();
  float* mw = reinterpret_cast<float*>(stage_smem);
  float* lw = mw + SLICES * 16;
  float* ow = lw + SLICES * 16;
  int64_t* base_w = reinterpret_cast<int64_t*>(ow + SLICES * 16 * LDO);
  if (t4 == 0 && keeps_state) {
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      mw[slice * 16 + g + 8 * k] = m[k];
      lw[slice * 16 + g + 8 * k] = l[k];
    }
  }
  if constexpr (FP8) {
    // fp8_mma_v_chunk's columns: row g + 8 k, channels 16 ct + 4 t4 .. + 3 are elements
    // 2k, 2k + 4, 2k + 1, 2k + 5
#pragma unroll
    for (int ct = 0; ct < CTW; ++ct)
#pragma unroll
      for (int k = 0; k < 2; ++k)
        *reinterpret_cast<float4*>(ow + (slice * 16 + g + 8 * k) * LDO + (ct0 + ct) * 16 + 4 * t4) =
            make_float4(o[ct][2 * k], o[ct][2 * k + 4], o[ct][2 * k + 1], o[ct][2 * k + 5]);
  } else {
#pragma unroll
    for (int ct = 0; ct < CTW; ++ct)
#pragma unroll
      for (int e = 0; e < 8; e += 2)  // elements e, e + 1: one row, two adjacent channels
        *reinterpret_cast<float2*>(ow + (slice * 16 + Tile::row(lane, e)) * LDO + (ct0 + ct) * 16 + Tile::col(lane, e)) =
            make_float2(o[ct][e], o[ct][e + 1]);
  }
  __syncthreads();
  // one thread a row: the slices' weights 2^(m_w - M) * v_scale / l (in place of l_w), the
  // row's (M, l) of a split, and where its output goes
  const bool split = p.num_partitions > 1;
  if (tid < rows) {
    const int r = tid;
    float big_m = -INFINITY;
#pragma unroll
    for (int w = 0; w < SLICES; ++w) big_m = fmaxf(big_m, mw[w * 16 + r]);
    const float mu = big_m == -INFINITY ? 0.f : big_m;
    float f[SLICES], lsum = 0.f;
#pragma unroll
    for (int w = 0; w < SLICES; ++w) {
      f[w] = exp2f(mw[w * 16 + r] - mu);  // 0 for a slice that saw no key
      lsum += lw[w * 16 + r] * f[w];
    }
    const float inv = v_scale / (lsum > 0.f ? lsum : 1.f);
#pragma unroll
    for (int w = 0; w < SLICES; ++w) lw[w * 16 + r] = f[w] * inv;
    const int gr = row0 + r, t = gr / group, h = kv_head * group + gr % group;
    if (split) {
      const int64_t slot = seq * p.num_partitions + part, row = int64_t(t) * p.num_q_heads + h;
      base_w[r] = slot * p.po_stride[0] + row * p.po_stride[1];
      p.max_logits[slot * p.ml_stride[0] + row * p.ml_stride[1]] = big_m;
      p.exp_sums[slot * p.ml_stride[0] + row * p.ml_stride[1]] = lsum;
    } else {
      base_w[r] = seq * p.o_stride[0] + int64_t(t) * p.o_stride[1] + int64_t(h) * p.o_stride[2];
    }
  }
  __syncthreads();
  // 4 adjacent channels a thread: sum_w weight_w O_w, one 16-byte store into the workspace
  // where its rows allow it (po_vec), one 8-byte store into a 16-bit out (o_vec)
  const bool vec = split && po_vec;
  constexpr int V4 = HEAD_DIM_PAD / 4;
  for (int i = tid; i < rows * V4; i += NUM_WARPS * 32) {
    const int r = i / V4, d = 4 * (i % V4);
    if (d >= head_dim) continue;  // head_dim is a multiple of 8: 4 channels in or out
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < SLICES; ++w) {
      const float fw = lw[w * 16 + r];
      const float4 v4 = *reinterpret_cast<const float4*>(ow + (w * 16 + r) * LDO + d);
      acc[0] += fw * v4.x, acc[1] += fw * v4.y, acc[2] += fw * v4.z, acc[3] += fw * v4.w;
    }
    const int64_t base = base_w[r];
    if (vec) {
      *reinterpret_cast<float4*>(p.partial_out + base + d) = make_float4(acc[0], acc[1], acc[2], acc[3]);
    } else if (split) {
#pragma unroll
      for (int e = 0; e < 4; ++e) p.partial_out[base + (d + e) * p.po_stride[2]] = acc[e];
    } else if (o_vec) {
      store_out4(p, base + d, acc);
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) store_out(p, base + (d + e) * p.o_stride[3], acc[e]);
    }
  }
}
#endif  // HAB_HAS_MMA_SYNC

}  // namespace hab_decode
