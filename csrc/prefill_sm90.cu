// Prefix-prefill ("extend") attention on Hopper: wgmma, a producer warpgroup, two consumer
// warpgroups (FlashAttention-3's structure over a paged cache). Design: docs/native.md;
// what was measured and dropped: docs/history.md.
//
// Work items: one (request, m_block) tile of the plan's tile map x one KV head. Its
// BLOCK_M = 128 query rows pack the GQA group: row r is token m_block * TOK_M + r / G and
// query head kv_head * G + r % G (TOK_M = 128 / G), so every K/V tile is loaded once for
// the whole group. Persistent launch (sched set): one program an SM, items taken from a
// counter; else one program per item. 384 threads:
//
//   warps 8-11         Q once per item, then K and V tiles of BLOCK_N = 128 keys into a
//   (producers)        3-stage ring of shared memory with cp.async (16-byte copies, 8
//                      lanes a 128-byte row half: coalesced), each key row's address from
//                      its own page (any page size; with k_new the keys past the prefix
//                      from the dense tensors). A key that is absent (past the causal
//                      limit, a bad block id, a column past the table) is zero-filled and
//                      its bit cleared in the stage's 128-bit key mask.
//   warps 0-7          two warpgroups, 64 rows each. Per tile: S = Q K^T (8 wgmma
//   (consumers)        m64n128k16, both operands in shared memory), the online softmax
//                      in registers (exp2, scale * log2 e folded into one FMA), P packed
//                      to 16 bits in registers, O += P V (8 wgmma with A from registers,
//                      V read MN-major: no transpose). The mask is applied only to tiles
//                      that need it (the causal diagonal, a window edge, an absent key).
//                      The warpgroups take turns issuing (pingpong) and each issues S of
//                      the next tile with P V of this one (overlap).
//
// Synchronization: mbarriers. full_k / full_v complete when the producers' cp.async
// copies of the stage land (cp.async.mbarrier.arrive) and, for K, the key mask is written;
// empty_k / empty_v when the 8 consumer warps have finished the wgmma that read the stage;
// full_q / empty_q hand over Q, the work word and the loaded part of its TileInfo (the
// producers load it once; the consumers derive the rest). A consumer fences the async proxy
// after its wait (the copies are generic writes, wgmma reads through the async proxy).
//
// Keys walked by an item: [key_lo, key_end) with key_end = min(Lk, last row's diagonal +
// 1) (causal: tiles above the diagonal never loaded) and key_lo from the sliding window.
// Rows that see no key give out = 0 and lse = -inf (with a sink: the sink alone).
//
// Ragged (p.ragged; MLA's up-projected prefill and dense varlen attention): every key of
// request b comes from the dense k_new / v_new rows cu_seqlens_k[b] .., under the same
// bottom-right mask (Lk < Lq: the first Lq - Lk rows see no key). The q/k head may be 192
// (MLA: 128 nope + 64 rope) with a 128-wide v: Q and K tiles of three 64-channel panels,
// S in 12 k-steps, a 2-stage ring (D_QK, Layout). A row index outside q / out or k / v
// (wild offsets) is never read or written.
#include <algorithm>

#include "compat.h"
#include "hab_ops.h"

#if defined(HAB_CUDA)
#include "prefill_sm90_items.cuh"
#include "prefill_sm90_producer.cuh"

namespace hab_prefill {

HAB_DEV float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// ------------------------------------------------------------------ consumers
// Thread (warpgroup wg, warp wq, lane = 4 g + t) holds rows r0 = 64 wg + 16 wq + g and
// r0 + 8 of S and O: element 4 i + e is row r0 + 8 (e >> 1), column 8 i + 2 t + (e & 1).
// IS_BF16: q and out are bf16 (else fp16). FP8: fp8 caches, whose tiles the producers
// widen to fp16 (with a bf16 Q rescaled per row into fp16): the products run in fp16,
// the K scale and Q's row scales fold into the logit multiplier, the V scale into 1 / l.
template <bool IS_BF16, bool FP8, bool SOFT_CAP, int D_QK, bool RAGGED>
struct Consumer {
  using L = Layout<FP8, D_QK>;
  static constexpr bool MMA_BF16 = IS_BF16 && !FP8;
  const HabPrefillParams& p;
  const TileInfo& ti;
  const Barriers& b;
  uint32_t smem, q_tile;  // q_tile: this warpgroup's 64 rows of each Q panel
  int wg, lane, t;
  int tok[2], head[2], diag[2];
  bool row_ok[2];
  float mult[2], cap_div[2], cap_log2;  // mult: a row's logit -> log2 units inside exp2's FMA
  float out_mult;                       // the V scale
  float m[2], l[2];               // running max (log2 units), this lane's part of the sum
  float o[64];
  bool pingpong;
  int jg0;  // ring position of this work item's first key tile

  static constexpr float LOG2E = 1.4426950408889634f;

  HAB_DEV Consumer(const HabPrefillParams& p_, const TileInfo& ti_, const Barriers& b_, uint32_t smem_, int warp,
                   int lane_, int jg0_)
      : p(p_), ti(ti_), b(b_), smem(smem_), wg(warp >> 2), lane(lane_), t(lane_ & 3), jg0(jg0_) {
    q_tile = smem + L::Q_OFF + wg * 64 * 128;
    const float k_scale = FP8 ? (p.k_scale_ptr ? p.k_scale_ptr[ti.kv_head * p.k_scale_stride] : p.k_scale_value) : 1.f;
    out_mult = FP8 ? (p.v_scale_ptr ? p.v_scale_ptr[ti.kv_head * p.v_scale_stride] : p.v_scale_value) : 1.f;
    const int r_base = 64 * wg + 16 * (warp & 3) + (lane >> 2);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = r_base + 8 * h;
      tok[h] = ti.m_tok0 + r / ti.group;
      head[h] = ti.kv_head * ti.group + r % ti.group;
      row_ok[h] = r < ti.tok_m * ti.group && tok[h] < ti.len_q;
      if (RAGGED) row_ok[h] = row_ok[h] && ti.q_start + tok[h] >= 0 && ti.q_start + tok[h] < p.total_q;
      diag[h] = ti.len_p + tok[h];
      // a sink is one more key of value 0: l starts at 1 (on one lane of the row)
      m[h] = p.sinks != nullptr && row_ok[h] ? p.sinks[head[h]] * LOG2E : -INFINITY;
      l[h] = m[h] != -INFINITY && t == 0 ? 1.f : 0.f;
      // the true logit of S's element: scale * k_scale / (Q's row scale) * S
      const float logit = p.scale * k_scale * (FP8 && IS_BF16 ? b.q_inv[r] : 1.f);
      cap_div[h] = logit / (SOFT_CAP ? p.soft_cap : 1.f);
      mult[h] = SOFT_CAP ? 1.f : logit * LOG2E;
    }
    cap_log2 = p.soft_cap * LOG2E;
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    pingpong = p.pingpong != 0;
  }

  HAB_DEV int stage(int j) const { return (jg0 + j) % L::STAGES; }
  HAB_DEV uint32_t parity(int j) const { return ((jg0 + j) / L::STAGES) & 1; }

  // ping-pong turns: warpgroup w issues its products after barrier 1 + w, then lets the
  // other go (warpgroup 1 opens the first turn for warpgroup 0)
  HAB_DEV void take_turn() { if (pingpong) hab_sm90::named_sync(1 + wg, 256); }
  HAB_DEV void pass_turn() { if (pingpong) hab_sm90::named_arrive(1 + (wg ^ 1), 256); }

  // Wait for K tile j, keep its key mask (the producer rewrites it once the stage is
  // released) and issue S = Q K^T ([64 x 128] fp32, D_QK / 16 k-steps) into sc; committed,
  // not waited.
  HAB_DEV void issue_s(float (&sc)[64], uint32_t (&bits)[4], int j) {
    const int s = stage(j);
    hab_sm90::mbar_wait(b.full_k + s, parity(j));
#pragma unroll
    for (int w = 0; w < 4; ++w) bits[w] = b.mask[4 * s + w];
    hab_sm90::fence_proxy_async();
    const uint32_t k_tile = smem + L::K_OFF + s * L::QK_TILE_BYTES;
    hab_sm90::wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < D_QK / 16; ++ks) {
      const uint32_t off = (ks / 4) * PANEL_BYTES + (ks % 4) * 32;
      hab_sm90::wgmma_ss_m64n128k16<MMA_BF16>(sc, hab_sm90::desc_sw128(q_tile + off, 16, 1024),
                                              hab_sm90::desc_sw128(k_tile + off, 16, 1024), ks > 0);
    }
    hab_sm90::wgmma_commit();
  }

  // Wait for V tile j and issue O += P V ([64 x 128] fp32); committed, not waited.
  HAB_DEV void issue_pv(const uint32_t (&pa)[32], int j) {
    const int s = stage(j);
    hab_sm90::mbar_wait(b.full_v + s, parity(j));
    hab_sm90::fence_proxy_async();
    const uint32_t v_tile = smem + L::V_OFF + s * TILE_BYTES;
    hab_sm90::fence_regs(o);
    hab_sm90::wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
      const uint32_t a[4] = {pa[4 * kk], pa[4 * kk + 1], pa[4 * kk + 2], pa[4 * kk + 3]};
      hab_sm90::wgmma_rs_m64n128k16_tb<MMA_BF16>(o, a, hab_sm90::desc_sw128(v_tile + kk * 16 * 128, PANEL_BYTES, 1024));
    }
    hab_sm90::wgmma_commit();
  }

  // One arrival a warp, after every lane's reads of the slot (the key mask, the work word):
  // the __syncwarp orders them before lane 0's release.
  HAB_DEV void release(uint64_t* bar) {
    __syncwarp();
    if (lane == 0) hab_sm90::mbar_arrive(bar);
  }
  HAB_DEV void release_k(int j) { release(b.empty_k + stage(j)); }
  HAB_DEV void release_v(int j) { release(b.empty_v + stage(j)); }
  // the last S product has landed: the producers may load the next item's Q
  HAB_DEV void release_q() { release(b.empty_q); }

  // S of tile j -> P (fp32, in place) under the mask (the diagonal, a window edge, absent
  // keys; only tiles that need it pay); the running max and sums move, alpha is the
  // factor O must be scaled by before P V is added.
  HAB_DEV void softmax(float (&sc)[64], const uint32_t (&bits)[4], int j, float (&alpha)[2]) {
    const int n0 = (ti.tile_lo + j) * BLOCK_N, window = int(p.sliding_window);
    if (SOFT_CAP) {
#pragma unroll
      for (int i = 0; i < 64; ++i) sc[i] = cap_log2 * tanh_approx(sc[i] * cap_div[(i >> 1) & 1]);
    }
    const bool all_keys = (bits[0] & bits[1] & bits[2] & bits[3]) == 0xffffffffu;
    const bool masked = !all_keys || (p.causal && n0 + BLOCK_N - 1 > ti.diag_min) ||
                        (p.causal && window > 0 && n0 <= ti.diag_max - window);
    if (masked) {
      // column c of the tile is visible to row h when its key bit is set and, causal,
      // lo[h] < c <= hi[h] (the diagonal, the window's far edge): compares and selects.
      // (A branch an element made a masked tile ~1,000 instructions longer; the selects
      // were 1-8% faster overall, 22% with 3 key tiles an item.)
      int hi[2], lo[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        hi[h] = p.causal ? diag[h] - n0 : BLOCK_N;
        lo[h] = p.causal && window > 0 ? diag[h] - window - n0 : -1;
      }
#pragma unroll
      for (int i = 0; i < 16; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = 8 * i + 2 * t + (e & 1), h = e >> 1;
          const bool key = (bits[i >> 2] >> (col & 31)) & 1u;  // columns 8 i .. 8 i + 7: one word
          const bool vis = key & (col <= hi[h]) & (col > lo[h]);
          sc[4 * i + e] = vis ? sc[4 * i + e] : -INFINITY;
        }
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < 16; ++i) mx = fmaxf(mx, fmaxf(sc[4 * i + 2 * h], sc[4 * i + 2 * h + 1]));
      mx = fmaxf(mx, hab_shfl_xor(mx, 1));
      mx = fmaxf(mx, hab_shfl_xor(mx, 2));
      const float m_new = fmaxf(m[h], mx * mult[h]);
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // nothing seen yet: p = 0
      alpha[h] = hab_ex2_ftz(m[h] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int i = 0; i < 16; ++i) {
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
  }

  HAB_DEV void rescale(const float (&alpha)[2]) {
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      o[4 * i + 0] *= alpha[0];
      o[4 * i + 1] *= alpha[0];
      o[4 * i + 2] *= alpha[1];
      o[4 * i + 3] *= alpha[1];
    }
  }

  // P as the A fragments of the PV product: k-step kk takes columns 16 kk .. 16 kk + 15
  HAB_DEV static void pack(uint32_t (&pa)[32], const float (&sc)[64]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) pa[i] = hab_sm90::pack2<MMA_BF16>(sc[2 * i], sc[2 * i + 1]);
  }

  // One tile at a time: S, softmax, P V, each product waited for at once.
  HAB_DEV void run_serial() {
    if (ti.n_tiles == 0) release_q();
    for (int j = 0; j < ti.n_tiles; ++j) {
      float sc[64];
      uint32_t bits[4], pa[32];
      float alpha[2];
      take_turn();
      issue_s(sc, bits, j);
      pass_turn();
      hab_sm90::wgmma_wait<0>();
      hab_sm90::fence_regs(sc);
      release_k(j);
      if (j == ti.n_tiles - 1) release_q();
      softmax(sc, bits, j, alpha);
      rescale(alpha);
      pack(pa, sc);
      issue_pv(pa, j);
      hab_sm90::wgmma_wait<0>();
      hab_sm90::fence_regs(o);
      release_v(j);
    }
  }

  // Intra-warpgroup overlap: S of tile j is issued with P V of tile j - 1, so the tensor
  // cores get both back to back. The source puts tile j's softmax between the two waits,
  // but ptxas hoists the P V wait above its max and exps (only the mask runs under the
  // P V); forcing the softmax under it measured level.
  // pa (P of tile j - 1) and o stay pinned in their registers until that product is waited.
  HAB_DEV void run_overlap() {
    if (ti.n_tiles == 0) {
      release_q();
      return;
    }
    float sc[64];
    uint32_t bits[4], pa[32];
    float alpha[2];
    take_turn();
    issue_s(sc, bits, 0);
    pass_turn();
    hab_sm90::wgmma_wait<0>();
    hab_sm90::fence_regs(sc);
    release_k(0);
    if (ti.n_tiles == 1) release_q();
    softmax(sc, bits, 0, alpha);
    pack(pa, sc);
    for (int j = 1; j < ti.n_tiles; ++j) {
      take_turn();
      issue_s(sc, bits, j);
      issue_pv(pa, j - 1);
      pass_turn();
      hab_sm90::wgmma_wait<1>();  // S of tile j has landed; P V of tile j - 1 may still run
      hab_sm90::fence_regs(sc);
      release_k(j);
      if (j == ti.n_tiles - 1) release_q();
      softmax(sc, bits, j, alpha);
      hab_sm90::wgmma_wait<0>();
      hab_sm90::fence_regs(o);
      hab_sm90::fence_regs_u32(pa);
      release_v(j - 1);
      rescale(alpha);
      pack(pa, sc);
    }
    take_turn();
    issue_pv(pa, ti.n_tiles - 1);
    pass_turn();
    hab_sm90::wgmma_wait<0>();
    hab_sm90::fence_regs(o);
    hab_sm90::fence_regs_u32(pa);
    release_v(ti.n_tiles - 1);
  }

  // out = O / l (0 where no key was seen), lse in natural log
  HAB_DEV void finish() {
    constexpr float LN2 = 0.6931471805599453f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = l[h];
      sum += hab_shfl_xor(sum, 1);
      sum += hab_shfl_xor(sum, 2);
      if (!row_ok[h]) continue;
      const float inv = sum > 0.f ? out_mult / sum : 0.f;
      const int64_t tok_g = ti.q_start + tok[h];
      uint16_t* out = static_cast<uint16_t*>(p.out) + tok_g * p.o_stride[0] + int64_t(head[h]) * p.o_stride[1];
#pragma unroll
      for (int i = 0; i < 16; ++i) {
        *reinterpret_cast<uint32_t*>(out + 8 * i + 2 * t) =
            hab_sm90::pack2<IS_BF16>(o[4 * i + 2 * h] * inv, o[4 * i + 2 * h + 1] * inv);
      }
      if (p.lse != nullptr && t == 0) {
        p.lse[tok_g * p.lse_stride[0] + int64_t(head[h]) * p.lse_stride[1]] =
            sum > 0.f ? (m[h] + __log2f(sum)) * LN2 : -INFINITY;
      }
    }
  }
};

// RAGGED: the keys dense at cu_seqlens_k (a compile-time mode: the paged kernel keeps
// none of its checks)
template <bool IS_BF16, bool FP8, bool SOFT_CAP, int D_QK, bool RAGGED>
__global__ void __launch_bounds__(THREADS, 1) prefill_kernel(const __grid_constant__ HabPrefillParams p) {
#if defined(HAB_SM90A)
  using L = Layout<FP8, D_QK>;
  constexpr int STAGES = L::STAGES;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const uint32_t raw = hab_sm90::smem_addr(smem_raw);
  const uint32_t pad = (1024 - (raw & 1023)) & 1023;
  uint8_t* base = smem_raw + pad;  // 1024-byte aligned: the swizzle pattern's period
  Barriers b;
  uint64_t* bars = reinterpret_cast<uint64_t*>(base + L::BAR_OFF);
  b.full_q = bars;
  b.empty_q = bars + 1;
  b.full_k = bars + 2;
  b.full_v = bars + 2 + STAGES;
  b.empty_k = bars + 2 + 2 * STAGES;
  b.empty_v = bars + 2 + 3 * STAGES;
  b.mask = reinterpret_cast<uint32_t*>(base + L::MASK_OFF);
  b.work = reinterpret_cast<int32_t*>(base + L::WORK_OFF);
  b.fetch = b.work + 1;
  b.info = reinterpret_cast<int32_t*>(base + L::INFO_OFF);
  b.q_inv = FP8 ? reinterpret_cast<float*>(base + L::QSCALE_OFF) : nullptr;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    constexpr int COPIERS = PRODUCER_WARPS * 32;
    hab_sm90::mbar_init(b.full_q, COPIERS + 1);  // copies + the work word
    hab_sm90::mbar_init(b.empty_q, CONSUMER_WARPS);
    for (int s = 0; s < STAGES; ++s) {
      hab_sm90::mbar_init(b.full_k + s, COPIERS + PRODUCER_WARPS);  // copies + the mask words
      hab_sm90::mbar_init(b.full_v + s, COPIERS);
      hab_sm90::mbar_init(b.empty_k + s, CONSUMER_WARPS);
      hab_sm90::mbar_init(b.empty_v + s, CONSUMER_WARPS);
    }
  }
  __syncthreads();
  const uint32_t smem = hab_sm90::smem_addr(base);
  // registers a thread: 168 at launch (65,536 over 384 threads, in steps of 8), moved from
  // the producers to the consumers. setmaxnreg.inc waits until the program's own pool has
  // the registers, so the two must sum to what the launch allocated (more: a hang):
  // 4 x 32 x 64 + 8 x 32 x 216 = 63,488 <= 384 x 168 = 64,512. The consumers get what the
  // producers leave, in steps of 8 (no spills at 64 / 216).
  constexpr int LAUNCH_REGS = 65536 / THREADS / 8 * 8;
  constexpr int CONSUMER_REGS =
      (THREADS * LAUNCH_REGS - PRODUCER_WARPS * 32 * L::PRODUCER_REGS) / (CONSUMER_WARPS * 32) / 8 * 8;
  static_assert(PRODUCER_WARPS * 32 * L::PRODUCER_REGS + CONSUMER_WARPS * 32 * CONSUMER_REGS <=
                    THREADS * LAUNCH_REGS,
                "setmaxnreg: more registers than the launch allocates");
  if (warp >= CONSUMER_WARPS) {
    hab_sm90::setmaxnreg_dec<L::PRODUCER_REGS>();
    producer<FP8, D_QK, RAGGED>(p, b, smem, warp - CONSUMER_WARPS, lane);
  } else {
    hab_sm90::setmaxnreg_inc<CONSUMER_REGS>();
    if (p.pingpong && warp >= 4) hab_sm90::named_arrive(1, 256);  // warpgroup 0 takes the first turn
    int jg = 0;
    for (int round = 0;; ++round) {
      hab_sm90::mbar_wait(b.full_q, round & 1);
      TileInfo ti;
      if (*reinterpret_cast<volatile int32_t*>(b.work) < 0) break;
      load_info(p, b.info, ti);
      Consumer<IS_BF16, FP8, SOFT_CAP, D_QK, RAGGED> c(p, ti, b, smem, warp, lane, jg);
      if (p.overlap) c.run_overlap();
      else c.run_serial();
      c.finish();
      jg += ti.n_tiles;
    }
  }
#else
  __trap();  // built without sm_90a: the host never launches this (hab_prefix_prefill)
#endif
}

template <bool IS_BF16, bool FP8, bool SOFT_CAP, int D_QK = HEAD_DIM, bool RAGGED = false>
const char* launch(const HabPrefillParams& p, cudaStream_t stream) {
  static_assert(D_QK == HEAD_DIM || RAGGED, "a 192-wide head is the ragged mode's");
  auto kernel = prefill_kernel<IS_BF16, FP8, SOFT_CAP, D_QK, RAGGED>;
  constexpr int SMEM_BYTES = Layout<FP8, D_QK>::SMEM_BYTES;
  static uint64_t configured = 0;  // one bit per device
  int dev = 0;
  if (const char* err = hab_sm90::opt_in_smem(kernel, SMEM_BYTES, configured, dev)) return err;
  static int sms[64] = {};  // multiprocessors per device
  if (!sms[dev & 63]) cudaDeviceGetAttribute(&sms[dev & 63], cudaDevAttrMultiProcessorCount, dev);
  const int64_t work = p.num_tiles * p.num_kv_heads;
  // persistent: one program an SM (the shared memory holds one), each taking items from
  // the counter; else one program an item
  const int64_t programs = p.sched != nullptr ? std::min<int64_t>(work, sms[dev & 63]) : work;
  kernel<<<dim3(unsigned(programs)), THREADS, SMEM_BYTES, stream>>>(p);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}

}  // namespace hab_prefill
#endif  // HAB_CUDA

extern "C" const char* hab_prefix_prefill(const HabPrefillParams* p, void* stream) {
#if defined(HAB_CUDA)
  using namespace hab_prefill;
  const bool mla = p->head_dim == MLA_HEAD_DIM && p->head_dim_v == HEAD_DIM;
  if (!mla && (p->head_dim != HEAD_DIM || p->head_dim_v != HEAD_DIM))
    return "prefix_prefill: the native kernel takes q/k and v heads 128 / 128 or 192 / 128";
  if (p->dtype != HAB_F16 && p->dtype != HAB_BF16) return "prefix_prefill: dtype must be fp16 or bf16";
  const bool fp8 = p->kv_dtype == HAB_FP8_E4M3 || p->kv_dtype == HAB_FP8_E5M2;
  if (p->ragged && (fp8 || p->k_new == nullptr)) return "prefix_prefill: ragged attention takes dense 16-bit K / V";
  if (mla && !p->ragged) return "prefix_prefill: a 192-wide q/k head is ragged attention's";
  if (p->ragged && (p->soft_cap > 0.f || p->sinks != nullptr || p->sliding_window > 0))
    return "prefix_prefill: ragged attention takes no soft cap, sinks or window";
  if (p->kv_dtype != p->dtype && !fp8) return "prefix_prefill: the caches must have q's dtype or be fp8";
  if (fp8 && p->k_new != nullptr) return "prefix_prefill: fp8 caches take no dense k_new / v_new";
  if (p->num_kv_heads <= 0 || p->num_q_heads % p->num_kv_heads) return "prefix_prefill: bad head counts";
  const int64_t group = p->num_q_heads / p->num_kv_heads;
  if (group > BLOCK_M) return "prefix_prefill: GQA group larger than 128";
  if (p->page_size <= 0) return "prefix_prefill: page_size must be positive";
  if (hab_device_cc() != 90) return "prefix_prefill: the native kernel needs an sm_90 GPU (H100/H200)";
  if (p->num_tiles == 0 || p->num_kv_heads == 0) return nullptr;
  if (p->num_tiles * p->num_kv_heads >= (int64_t(1) << 31)) return "prefix_prefill: more than 2^31 work items";
  cudaStream_t s = static_cast<cudaStream_t>(stream);
  const bool bf16 = p->dtype == HAB_BF16, cap = p->soft_cap > 0.f;
  if (p->ragged) {
    if (mla) return bf16 ? launch<true, false, false, MLA_HEAD_DIM, true>(*p, s) : launch<false, false, false, MLA_HEAD_DIM, true>(*p, s);
    return bf16 ? launch<true, false, false, HEAD_DIM, true>(*p, s) : launch<false, false, false, HEAD_DIM, true>(*p, s);
  }
  if (fp8) {
    if (bf16) return cap ? launch<true, true, true>(*p, s) : launch<true, true, false>(*p, s);
    return cap ? launch<false, true, true>(*p, s) : launch<false, true, false>(*p, s);
  }
  if (bf16) return cap ? launch<true, false, true>(*p, s) : launch<true, false, false>(*p, s);
  return cap ? launch<false, false, true>(*p, s) : launch<false, false, false>(*p, s);
#else
  (void)p;
  (void)stream;
  return "prefix_prefill: the native kernel needs an NVIDIA sm_90 GPU (wgmma); none on HIP";
#endif
}
