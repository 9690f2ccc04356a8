// The native prefill's producer warpgroup (sm_90a): per work item Q, then the key tiles
// of a paged cache (or the dense new keys) into the ring of shared memory with cp.async.
// Included by prefill_sm90.cu.
#pragma once

#include "fastdiv.h"
#include "prefill_sm90_items.cuh"

#if defined(HAB_CUDA)
namespace hab_prefill {

// Address of key `pos` of this request's KV head in K (V: the same row of the V cache),
// or null when the key is absent.
struct KeyRows {
  const uint16_t* k;
  const uint16_t* v;
};

HAB_DEV KeyRows key_rows(const HabPrefillParams& p, const TileInfo& ti, const HabFastDiv& page_div, int pos) {
  const int64_t req = ti.req, kv_head = ti.kv_head;
  KeyRows r{nullptr, nullptr};
  if (pos < 0 || pos >= ti.key_end) return r;
  if (p.k_new != nullptr && pos >= ti.len_p) {
    const int64_t t = ti.q_start + (pos - ti.len_p);
    r.k = static_cast<const uint16_t*>(p.k_new) + t * p.kn_stride[0] + kv_head * p.kn_stride[1];
    r.v = static_cast<const uint16_t*>(p.v_new) + t * p.vn_stride[0] + kv_head * p.vn_stride[1];
    return r;
  }
  const int blk = page_div.div(pos), slot = page_div.mod(pos, blk);
  if (blk >= p.max_blocks) return r;
  const int64_t page = hab_load_index(p.block_table, p.table_is_int64, req * p.bt_stride[0] + int64_t(blk) * p.bt_stride[1]);
  if (page < 0 || page >= p.num_blocks) return r;
  r.k = static_cast<const uint16_t*>(p.k_cache) + page * p.k_stride[0] + kv_head * p.k_stride[1] + slot * p.k_stride[2];
  r.v = static_cast<const uint16_t*>(p.v_cache) + page * p.v_stride[0] + kv_head * p.v_stride[1] + slot * p.v_stride[2];
  return r;
}

HAB_DEV const uint16_t* shfl_ptr(const uint16_t* ptr, int src_lane) {
  const uint64_t u = reinterpret_cast<uint64_t>(ptr);
  const uint32_t lo = __shfl_sync(0xffffffffu, uint32_t(u), src_lane);
  const uint32_t hi = __shfl_sync(0xffffffffu, uint32_t(u >> 32), src_lane);
  return reinterpret_cast<const uint16_t*>((uint64_t(hi) << 32) | lo);
}

// Producer warp `pw` copies rows 32 pw .. 32 pw + 31 of a 128-row tile; row 32 pw + l
// starts at `row` of lane l (null: zero fill). Into the swizzled panels at `dst`
// (sm90.cuh): per instruction 4 rows x one 128-byte half, 8 lanes a half-row.
HAB_DEV void copy_rows(uint32_t dst, const uint16_t* row_ptr, const uint16_t* fallback, int pw, int lane) {
  const int sub = lane >> 3, chunk = lane & 7;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = 32 * pw + 4 * i + sub;
    const uint16_t* src = shfl_ptr(row_ptr, 4 * i + sub);
    const bool fill = src != nullptr;
    if (!fill) src = fallback;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const uint32_t d = dst + h * PANEL_BYTES + row * 128 + ((chunk ^ (row & 7)) << 4);
      hab_sm90::cp_async16(d, fill ? src + h * 64 + chunk * 8 : src, fill);
    }
  }
}

// The producer warpgroup (4 warps, 32 rows of every tile each). Per work item: Q once
// (when the consumers have released the last one), then per key tile its rows' addresses
// (one block-table read a row), the K copies, the mask word, the V copies; the next
// tile's addresses are computed while the ring slot is still busy. The ring position `jg`
// runs on across work items, so the next item's Q and first tiles load while the
// consumers finish the last one.
HAB_DEV void producer(const HabPrefillParams& p, const Barriers& b, uint32_t smem, int pw, int lane) {
  const int r = 32 * pw + lane;  // the row this lane addresses
  const HabFastDiv page_div(int(p.page_size));
  int jg = 0;
  for (int round = 0;; ++round) {
    if (pw == 0 && lane == 0) b.fetch[round & 1] = fetch_work(p, round);
    hab_sm90::named_sync(3, 32 * PRODUCER_WARPS);  // the fetched item is visible to the warpgroup
    const int32_t w = b.fetch[round & 1];
    TileInfo ti;
    const bool has = tile_info(p, w, ti);
    // Q row r = (token m_tok0 + r / G, head kv_head * G + r % G), null: past the item
    auto q_row_of = [&]() -> const uint16_t* {
      const int tok = ti.m_tok0 + r / ti.group;
      if (!has || r >= ti.tok_m * ti.group || tok >= ti.len_q) return nullptr;
      return static_cast<const uint16_t*>(p.q) + (ti.q_start + tok) * p.q_stride[0] +
             (int64_t(ti.kv_head) * ti.group + r % ti.group) * p.q_stride[1];
    };
    auto first_rows = [&]() {
      return has && ti.n_tiles > 0 ? key_rows(p, ti, page_div, ti.tile_lo * BLOCK_N + r) : KeyRows{};
    };
    // a key tile into ring position `at`: K (and its mask word), then V
    auto load_k = [&](int at, const KeyRows& kr, uint32_t bits) {  // bits: the warp's rows present
      const int s = at % STAGES;
      const uint32_t parity = ((at / STAGES) & 1) ^ 1;
      hab_sm90::mbar_wait(b.empty_k + s, parity);
      if (lane == 0) b.mask[4 * s + pw] = bits;
      copy_rows(smem + K_OFF + s * TILE_BYTES, kr.k, static_cast<const uint16_t*>(p.k_cache), pw, lane);
      hab_sm90::mbar_arrive_cp_async(b.full_k + s);
      if (lane == 0) hab_sm90::mbar_arrive(b.full_k + s);  // releases the mask word
    };
    auto load_v = [&](int at, const KeyRows& kr) {
      const int s = at % STAGES;
      const uint32_t parity = ((at / STAGES) & 1) ^ 1;
      hab_sm90::mbar_wait(b.empty_v + s, parity);
      copy_rows(smem + V_OFF + s * TILE_BYTES, kr.v, static_cast<const uint16_t*>(p.v_cache), pw, lane);
      hab_sm90::mbar_arrive_cp_async(b.full_v + s);
    };
    hab_sm90::mbar_wait(b.empty_q, (round & 1) ^ 1);
    if (pw == 0 && lane == 0) {
      *b.work = has ? w : -1;
      if (has) store_info(b.info, ti);
      hab_sm90::mbar_arrive(b.full_q);  // releases the work word
    }
    if (!has) {
      hab_sm90::mbar_arrive(b.full_q);  // no copies: the barrier completes at once
      break;
    }
    copy_rows(smem + Q_OFF, q_row_of(), static_cast<const uint16_t*>(p.q), pw, lane);
    hab_sm90::mbar_arrive_cp_async(b.full_q);
    KeyRows next = first_rows();
    for (int j = 0; j < ti.n_tiles; ++j, ++jg) {
      const KeyRows kr = next;
      const uint32_t bits = __ballot_sync(0xffffffffu, kr.k != nullptr);
      if (j + 1 < ti.n_tiles) next = key_rows(p, ti, page_div, (ti.tile_lo + j + 1) * BLOCK_N + r);
      load_k(jg, kr, bits);
      load_v(jg, kr);
    }
  }
  asm volatile("cp.async.wait_all;\n" ::: "memory");  // no copy outlives its thread
  if (p.sched != nullptr && pw == 0 && lane == 0) {
    // the last program past the end resets the counter for the next launch (every
    // program has stopped fetching by then)
    if (atomicAdd(p.sched + 1, 1) == int32_t(gridDim.x) - 1) {
      p.sched[0] = 0;
      p.sched[1] = 0;
    }
  }
}

}  // namespace hab_prefill
#endif  // HAB_CUDA
