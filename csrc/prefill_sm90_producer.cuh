// The native prefill's producer warpgroup (sm_90a): per work item Q, then the key tiles
// of a paged cache (or the dense new keys) into the ring of shared memory with cp.async.
// fp8 caches (FP8): a tile's codes are loaded into registers a tile ahead and widened to
// fp16 into the ring; a bf16 Q is rescaled per row into fp16 in place.
// Included by prefill_sm90.cu.
#pragma once

#include <type_traits>

#include "fastdiv.h"
#include "prefill_sm90_items.cuh"

#if defined(HAB_CUDA)
namespace hab_prefill {

// Address of key `pos` of this request's KV head in K (V: the same row of the V cache),
// or null when the key is absent. KV_BYTES: bytes of a cache element (dense new keys
// have q's 16-bit dtype).
struct KeyRows {
  const uint8_t* k;
  const uint8_t* v;
};

template <int KV_BYTES, bool RAGGED>
HAB_DEV KeyRows key_rows(const HabPrefillParams& p, const TileInfo& ti, const HabFastDiv& page_div, int pos) {
  const int64_t req = ti.req, kv_head = ti.kv_head;
  KeyRows r{nullptr, nullptr};
  if (pos < 0 || pos >= ti.key_end) return r;
  if (RAGGED) {  // every key dense: row k_start + pos, bounded by the rows there are
    const int64_t t = ti.k_start + pos;
    if (t < 0 || t >= p.total_k) return r;
    r.k = static_cast<const uint8_t*>(p.k_new) + 2 * (t * p.kn_stride[0] + kv_head * p.kn_stride[1]);
    r.v = static_cast<const uint8_t*>(p.v_new) + 2 * (t * p.vn_stride[0] + kv_head * p.vn_stride[1]);
    return r;
  }
  if (p.k_new != nullptr && pos >= ti.len_p) {
    const int64_t t = ti.q_start + (pos - ti.len_p);
    r.k = static_cast<const uint8_t*>(p.k_new) + 2 * (t * p.kn_stride[0] + kv_head * p.kn_stride[1]);
    r.v = static_cast<const uint8_t*>(p.v_new) + 2 * (t * p.vn_stride[0] + kv_head * p.vn_stride[1]);
    return r;
  }
  const int blk = page_div.div(pos), slot = page_div.mod(pos, blk);
  if (blk >= p.max_blocks) return r;
  const int64_t page = hab_load_index(p.block_table, p.table_is_int64, req * p.bt_stride[0] + int64_t(blk) * p.bt_stride[1]);
  if (page < 0 || page >= p.num_blocks) return r;
  r.k = static_cast<const uint8_t*>(p.k_cache) +
        KV_BYTES * (page * p.k_stride[0] + kv_head * p.k_stride[1] + slot * p.k_stride[2]);
  r.v = static_cast<const uint8_t*>(p.v_cache) +
        KV_BYTES * (page * p.v_stride[0] + kv_head * p.v_stride[1] + slot * p.v_stride[2]);
  return r;
}

using hab_sm90::fp8x2_to_f16x2;
using hab_sm90::ld_shared_v4;
using hab_sm90::shfl_ptr;
using hab_sm90::st_shared_v4;

// Producer warp `pw` copies rows 32 pw .. 32 pw + 31 of a 128-row 16-bit tile of PANELS
// 64-channel panels; row 32 pw + l starts at `row` of lane l (null: zero fill). Into the
// swizzled panels at `dst` (sm90.cuh): per instruction 4 rows x one 128-byte panel row,
// 8 lanes a panel row.
template <int PANELS>
HAB_DEV void copy_rows(uint32_t dst, const uint8_t* row_ptr, const void* fallback, int pw, int lane) {
  const int sub = lane >> 3, chunk = lane & 7;
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = 32 * pw + 4 * i + sub;
    const uint8_t* src = shfl_ptr(row_ptr, 4 * i + sub);
    const bool fill = src != nullptr;
#pragma unroll
    for (int h = 0; h < PANELS; ++h) {
      const uint32_t d = dst + h * PANEL_BYTES + row * 128 + ((chunk ^ (row & 7)) << 4);
      hab_sm90::cp_async16(d, fill ? src + h * 128 + chunk * 16 : fallback, fill);
    }
  }
}

// ---------------------------------------------------------------- fp8 caches
// A lane's 16-byte chunks of a K or V tile's codes, loaded into registers one tile ahead
// (8 rows x 16 codes: 32 registers). Lane l of a warp, per row step i, takes the codes
// of channels 16 c .. 16 c + 15 of row 4 i + 2 (l >> 4) + ((l >> 2) & 1),
// c = 4 ((l >> 3) & 1) + (l & 3): each 8-lane phase of the widened stores then covers two
// rows of one panel (slots 2 (l & 3) and + 1, swizzled by the row): 8 distinct 16-byte
// bank groups.
struct Lane8 {
  int row0, chunk;  // row of step 0 (+ 4 i), chunk of the row
  HAB_DEV Lane8(int pw, int lane)
      : row0(32 * pw + 2 * (lane >> 4) + ((lane >> 2) & 1)), chunk(4 * ((lane >> 3) & 1) + (lane & 3)) {}
  HAB_DEV int src_lane(int i) const { return (row0 & 31) + 4 * i; }
};

struct Codes8 {
  uint32_t w[8][4];
};

// warp pw's 32 rows of a tile's codes (a null row: zeros, nothing read)
HAB_DEV void load_rows8(Codes8& c, const uint8_t* row_ptr, int pw, int lane) {
  const Lane8 ln(pw, lane);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const uint8_t* src = shfl_ptr(row_ptr, ln.src_lane(i));
    uint4 v = make_uint4(0u, 0u, 0u, 0u);
    if (src != nullptr) v = __ldg(reinterpret_cast<const uint4*>(src + ln.chunk * 16));
    c.w[i][0] = v.x;
    c.w[i][1] = v.y;
    c.w[i][2] = v.z;
    c.w[i][3] = v.w;
  }
}

// This lane's codes (load_rows8) -> fp16 into the swizzled 16-bit tile at `dst`: chunk
// c of a row is channels 16 c .. 16 c + 15, panel c / 4, 16-byte slots 2 (c % 4) and
// 2 (c % 4) + 1.
HAB_DEV void widen_rows8(uint32_t dst, const Codes8& c, int pw, int lane, bool e5m2) {
  const Lane8 ln(pw, lane);
  const int panel = ln.chunk >> 2, sl = 2 * (ln.chunk & 3);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int row = ln.row0 + 4 * i;
    uint32_t a[4], b[4];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      a[2 * k] = fp8x2_to_f16x2(c.w[i][k], e5m2);
      a[2 * k + 1] = fp8x2_to_f16x2(c.w[i][k] >> 16, e5m2);
      b[2 * k] = fp8x2_to_f16x2(c.w[i][2 + k], e5m2);
      b[2 * k + 1] = fp8x2_to_f16x2(c.w[i][2 + k] >> 16, e5m2);
    }
    const uint32_t base = dst + panel * PANEL_BYTES + row * 128;
    st_shared_v4(base + ((sl ^ (row & 7)) << 4), a);
    st_shared_v4(base + (((sl + 1) ^ (row & 7)) << 4), b);
  }
}

// A bf16 Q tile this warp copied (copy_rows, landed) -> fp16 in place, each row scaled by
// a power of two that brings its largest |q| into [2^14, 2^15) (exact for every element
// in fp16's normal range; elements below 2^-28 of the row's largest lose bits); 1 / the
// scale into q_inv[row]. A zero row keeps scale 1.
HAB_DEV void widen_q(uint32_t q_tile, float* q_inv, int pw, int lane) {
  const int sub = lane >> 3, chunk = lane & 7;
#pragma unroll 2
  for (int i = 0; i < 8; ++i) {
    const int row = 32 * pw + 4 * i + sub;
    uint32_t w[2][4];
    float mx = 0.f;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      ld_shared_v4(q_tile + h * PANEL_BYTES + row * 128 + ((chunk ^ (row & 7)) << 4), w[h]);
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        mx = fmaxf(mx, fabsf(hab_bits_to_float(w[h][k] << 16)));
        mx = fmaxf(mx, fabsf(hab_bits_to_float(w[h][k] & 0xffff0000u)));
      }
    }
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 4));
    // 2^k with k = 14 - exponent(mx), kept within float's normal powers (a NaN row: 1)
    const int e = int((hab_float_to_bits(mx) >> 23) & 0xff) - 127;
    const int k = mx > 0.f && mx <= 3.4e38f ? min(126, max(-126, 14 - e)) : 0;
    const float s = hab_bits_to_float(uint32_t(127 + k) << 23);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      uint32_t o[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const __half2 v = __floats2half2_rn(hab_bits_to_float(w[h][j] << 16) * s,
                                            hab_bits_to_float(w[h][j] & 0xffff0000u) * s);
        o[j] = *reinterpret_cast<const uint32_t*>(&v);
      }
      st_shared_v4(q_tile + h * PANEL_BYTES + row * 128 + ((chunk ^ (row & 7)) << 4), o);
    }
    if (chunk == 0) q_inv[row] = hab_bits_to_float(uint32_t(127 - k) << 23);
  }
}

// The producer warpgroup (4 warps, 32 rows of every tile each). Per work item: Q once
// (when the consumers have released the last one), then per key tile its rows' addresses
// (one block-table read a row), the K copies, the mask word, the V copies; the next
// tile's addresses are computed while the ring slot is still busy. The ring position `jg`
// runs on across work items, so the next item's Q and first tiles load while the
// consumers finish the last one. FP8: a tile's codes are loaded into registers while
// the tile before is widened (K of tile j + 1 once K of tile j is in its slot, V the
// same); the loads' latency is hidden by the ring, the widening reads no shared memory.
template <bool FP8, int D_QK, bool RAGGED>
HAB_DEV void producer(const HabPrefillParams& p, const Barriers& b, uint32_t smem, int pw, int lane) {
  using L = Layout<FP8, D_QK>;
  constexpr int QK = L::QK_PANELS, VP = HEAD_DIM / 64;  // panels of a Q / K and of a V tile
  constexpr int KV_BYTES = FP8 ? 1 : 2;
  const int r = 32 * pw + lane;  // the row this lane addresses
  const HabFastDiv page_div(int(p.page_size));
  const bool e5m2 = p.kv_dtype == HAB_FP8_E5M2;
  const bool widen_query = FP8 && p.dtype == HAB_BF16;
  int jg = 0;
  for (int round = 0;; ++round) {
    if (pw == 0 && lane == 0) b.fetch[round & 1] = fetch_work(p, round);
    hab_sm90::named_sync(3, 32 * PRODUCER_WARPS);  // the fetched item is visible to the warpgroup
    const int32_t w = b.fetch[round & 1];
    TileInfo ti;
    const bool has = tile_info<RAGGED>(p, w, ti);
    // Q row r = (token m_tok0 + r / G, head kv_head * G + r % G), null: past the item
    auto q_row_of = [&]() -> const uint8_t* {
      const int tok = ti.m_tok0 + r / ti.group;
      if (!has || r >= ti.tok_m * ti.group || tok >= ti.len_q) return nullptr;
      if (RAGGED && (ti.q_start + tok < 0 || ti.q_start + tok >= p.total_q)) return nullptr;  // wild offsets
      return static_cast<const uint8_t*>(p.q) +
             2 * ((ti.q_start + tok) * p.q_stride[0] + (int64_t(ti.kv_head) * ti.group + r % ti.group) * p.q_stride[1]);
    };
    auto rows_of = [&](int j) {
      return key_rows<KV_BYTES, RAGGED>(p, ti, page_div, (ti.tile_lo + j) * BLOCK_N + r);
    };
    auto wait_empty = [&](uint64_t* empty, int at) {
      hab_sm90::mbar_wait(empty + at % L::STAGES, ((at / L::STAGES) & 1) ^ 1);
    };
    Codes8 kc, vc;  // FP8: the codes of the tile to be widened next
    // a K or V tile into its ring slot `tile`, completing `full`: FP8 widens this lane's
    // codes, else the rows are copied from `rows` (null: zeros, `fallback` never read)
    // (panels: the tile's 64-channel panels, a std::integral_constant)
    auto fill = [&](auto panels, uint32_t tile, const Codes8& codes, const uint8_t* rows,
                    const void* fallback, uint64_t* full) {
      if (FP8) {
        widen_rows8(tile, codes, pw, lane, e5m2);
        hab_sm90::mbar_arrive(full);
      } else {
        copy_rows<decltype(panels)::value>(tile, rows, fallback, pw, lane);
        hab_sm90::mbar_arrive_cp_async(full);
      }
    };
    // a key tile into ring position `at`: K (and its mask word), then V
    auto load_k = [&](int at, const KeyRows& kr, uint32_t bits) {  // bits: the warp's rows present
      const int s = at % L::STAGES;
      wait_empty(b.empty_k, at);
      if (lane == 0) b.mask[4 * s + pw] = bits;
      fill(std::integral_constant<int, QK>{}, smem + L::K_OFF + s * L::QK_TILE_BYTES, kc, kr.k,
           RAGGED ? p.k_new : p.k_cache, b.full_k + s);
      if (lane == 0) hab_sm90::mbar_arrive(b.full_k + s);  // releases the mask word
    };
    auto load_v = [&](int at, const KeyRows& kr) {
      const int s = at % L::STAGES;
      wait_empty(b.empty_v, at);
      fill(std::integral_constant<int, VP>{}, smem + L::V_OFF + s * TILE_BYTES, vc, kr.v,
           RAGGED ? p.v_new : p.v_cache, b.full_v + s);
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
    copy_rows<QK>(smem + L::Q_OFF, q_row_of(), p.q, pw, lane);
    if (widen_query) {
      asm volatile("cp.async.wait_all;\n" ::: "memory");  // this lane's Q copies (nothing else is in flight)
      widen_q(smem + L::Q_OFF, b.q_inv, pw, lane);
      hab_sm90::mbar_arrive(b.full_q);
    } else {
      hab_sm90::mbar_arrive_cp_async(b.full_q);
    }
    KeyRows next = ti.n_tiles > 0 ? rows_of(0) : KeyRows{};
    uint32_t next_bits = __ballot_sync(0xffffffffu, next.k != nullptr);
    if (FP8 && ti.n_tiles > 0) {
      load_rows8(kc, next.k, pw, lane);
      load_rows8(vc, next.v, pw, lane);
    }
    for (int j = 0; j < ti.n_tiles; ++j, ++jg) {
      const KeyRows kr = next;
      const uint32_t bits = next_bits;
      const bool more = j + 1 < ti.n_tiles;
      if (more) {
        next = rows_of(j + 1);
        next_bits = __ballot_sync(0xffffffffu, next.k != nullptr);
      }
      load_k(jg, kr, bits);
      if (FP8 && more) load_rows8(kc, next.k, pw, lane);
      load_v(jg, kr);
      if (FP8 && more) load_rows8(vc, next.v, pw, lane);
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
