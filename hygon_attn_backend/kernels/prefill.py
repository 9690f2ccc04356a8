"""Prefix-prefill ("extend") attention kernel over a paged prefix (``@triton.jit`` only).

One program per (tile, kv_head). A tile is one ``(request, m_block)`` pair from the tile
map built by ``ops.prefill.plan_prefix_prefill`` (a ragged batch does not pay for its
longest request). GQA packs the group into the M tile: row ``r`` of the ``BLOCK_M`` rows is
token ``m_block * TOK_M + r // GROUP`` and query head ``kv_head * GROUP + r % GROUP``, with
``TOK_M = BLOCK_M // GROUP``, so every K/V tile is loaded once for the whole group.

Two stages (mask drawn in ``prefill_mask``):

1. no mask: the prefix keys ``[0, Lk - Lq)`` from the paged cache;
2. the new keys ``[0, Lq)`` under ``j <= i + (Lk - Lq)``, walked up to
   ``min(Lq, (m_block + 1) * TOK_M)``: tiles above the diagonal are never loaded, tiles
   wholly below it run unmasked, only the diagonal tiles pay for the mask. With a tree
   mask (``TREE``, speculative verify) every new key is walked under the packed mask.

With dense ``k_new``/``v_new`` (SGLang) the stages read two sources: the prefix from the
cache (its partial last tile bound-checked), then the new keys from the dense tensors.
With every key in the cache (vLLM), stage 1 extends over the new keys wholly below the
diagonal (they are visible to every row of the tile), so one unmasked walk from key 0
covers prefix and below-diagonal keys with tiles aligned to ``BLOCK_N`` (and to pages:
one table read per tile when ``P % BLOCK_N == 0``), and stage 2 is the diagonal alone.

Softmax state ``m_i``, ``l_i``, ``acc`` is fp32 in log2 units (``exp2``).
"""

import triton
import triton.language as tl

from hygon_attn_backend.kernels.paged_kv import (lookup_tile_pages, table_row_present,
                                                 tile_row_offsets)
from hygon_attn_backend.kernels.prefill_mask import tile_visibility
from hygon_attn_backend.kernels.softmax import tanh_f32


@triton.jit
def _prefill_stage(acc, l_i, m_i, q, diag,
                   k_base, v_base, bt_row_ptr, stride_bt_block, max_blocks, num_blocks,
                   stride_k_block, stride_k_row, stride_kd,
                   stride_v_block, stride_v_row, stride_vd,
                   lo, hi, n_limit, key0, src0, window, qk_scale, cap_scale, soft_cap,
                   v_mult, offs_n, offs_d, head_dim, row_present, tree_rows, len_p,
                   tree_words, FROM_CACHE: tl.constexpr,
                   PAGE_SIZE: tl.constexpr, BOUND: tl.constexpr, CAUSAL: tl.constexpr,
                   WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, SCALE_V: tl.constexpr,
                   PAD_D: tl.constexpr, BLOCK_N: tl.constexpr, TWO_WALKS: tl.constexpr,
                   TREE: tl.constexpr):
    """One stage (:func:`_prefill_walk`). With ``TWO_WALKS``, an unmasked stage of cache
    keys whose tiles span pages is compiled twice: without any per-key check, taken when
    ``row_present`` says every block id of the stage is present, and with it otherwise.
    The per-key check costs ~20% of the kernel at page 16 even behind a scalar branch
    (docs/history.md); the second copy costs no shared memory but makes
    ptxas serialize the wgmma, so the plan takes it only where the tile is serialized
    anyway (:func:`ops.prefill.tuning.two_walks`)."""
    # CHECK_KEYS is a compile-time choice per call site, so the two walks are two calls;
    # with SPLIT_WALK false the condition is a constant and only the checked walk compiles
    SPLIT_WALK: tl.constexpr = TWO_WALKS and FROM_CACHE and PAGE_SIZE % BLOCK_N != 0 and \
        not (BOUND or CAUSAL or WINDOW or TREE)
    if SPLIT_WALK and row_present:
        acc, l_i, m_i = _prefill_walk(
            acc, l_i, m_i, q, diag, k_base, v_base, bt_row_ptr, stride_bt_block,
            max_blocks, num_blocks, stride_k_block, stride_k_row, stride_kd,
            stride_v_block, stride_v_row, stride_vd, lo, hi, n_limit, key0, src0,
            window, qk_scale, cap_scale, soft_cap, v_mult, offs_n, offs_d, head_dim,
            row_present, tree_rows, len_p, tree_words, FROM_CACHE, PAGE_SIZE, BOUND, CAUSAL,
            WINDOW, SOFT_CAP, SCALE_V, PAD_D, BLOCK_N, CHECK_KEYS=False, TREE=TREE)
    else:
        acc, l_i, m_i = _prefill_walk(
            acc, l_i, m_i, q, diag, k_base, v_base, bt_row_ptr, stride_bt_block,
            max_blocks, num_blocks, stride_k_block, stride_k_row, stride_kd,
            stride_v_block, stride_v_row, stride_vd, lo, hi, n_limit, key0, src0,
            window, qk_scale, cap_scale, soft_cap, v_mult, offs_n, offs_d, head_dim,
            row_present, tree_rows, len_p, tree_words, FROM_CACHE, PAGE_SIZE, BOUND, CAUSAL,
            WINDOW, SOFT_CAP, SCALE_V, PAD_D, BLOCK_N, CHECK_KEYS=True, TREE=TREE)
    return acc, l_i, m_i


@triton.jit
def _prefill_walk(acc, l_i, m_i, q, diag,
                  k_base, v_base, bt_row_ptr, stride_bt_block, max_blocks, num_blocks,
                  stride_k_block, stride_k_row, stride_kd,
                  stride_v_block, stride_v_row, stride_vd,
                  lo, hi, n_limit, key0, src0, window, qk_scale, cap_scale, soft_cap,
                  v_mult, offs_n, offs_d, head_dim, row_present, tree_rows, len_p,
                  tree_words, FROM_CACHE: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, BOUND: tl.constexpr, CAUSAL: tl.constexpr,
                  WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, SCALE_V: tl.constexpr,
                  PAD_D: tl.constexpr, BLOCK_N: tl.constexpr, CHECK_KEYS: tl.constexpr,
                  TREE: tl.constexpr):
    """Walk keys ``n`` in ``[lo, hi)`` (step BLOCK_N) of one stage and update the state.

    Key ``n`` is global key position ``key0 + n``; with ``FROM_CACHE`` it is cache
    position ``n`` (``src0 == 0``, ``lo % BLOCK_N == 0``: every tile starts on a
    ``BLOCK_N`` boundary), else dense row ``src0 + n`` of ``k_new``/``v_new`` (then
    ``stride_*_row`` is the token stride). Cache keys whose block id is absent
    (``paged_kv.lookup_tile_pages``: outside ``[0, num_blocks)`` or past the table's
    ``max_blocks`` columns) are never loaded and get logit ``-inf``; ``row_present`` (a
    scalar the caller computed with ``paged_kv.table_row_present``) says every block id of
    the stage is present, so the per-logit select is skipped (it costs ~25% of the kernel
    where a tile spans pages, docs/history.md). ``qk_scale``/
    ``cap_scale`` already hold the fp8 K scale of this stage's source; ``SCALE_V``
    multiplies P by ``v_mult`` (the fp8 V scale) before the PV product. ``CHECK_KEYS``
    False: the caller knows every block id of an unmasked multi-page stage is present
    (no key mask on the loads, no select).
    acc: ``[BLOCK_M, HEAD_DIM]`` fp32, l_i/m_i: ``[BLOCK_M]`` fp32,
    q: ``[BLOCK_M, HEAD_DIM]``, diag: ``[BLOCK_M]`` int32.
    """
    MASKED: tl.constexpr = BOUND or CAUSAL or WINDOW or TREE
    # a tile inside one page has one (scalar) block id: an absent page drops the whole
    # tile through the running max (no per-element select in the unmasked stages)
    ONE_PAGE: tl.constexpr = FROM_CACHE and PAGE_SIZE % BLOCK_N == 0
    # The diagonal / last partial tile (1-2 tiles a program) runs without software
    # pipelining. Two pipelined loops in a row (the unmasked walk, then this one) make
    # ptxas serialize every wgmma of the kernel ("C7515: ... non wgmma instructions
    # defining accumulator registers"): with this loop unpipelined, the 8-warp tiles and
    # 256x32 on 16 warps compile with asynchronous wgmma (sm_90, Triton 3.6;
    # docs/history.md).
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=1 if (BOUND or CAUSAL) else None):
        n = start_n + offs_n  # [BLOCK_N]
        if FROM_CACHE:
            page = lookup_tile_pages(bt_row_ptr, stride_bt_block, start_n, offs_n,
                                     max_blocks, num_blocks, PAGE_SIZE, BLOCK_N)
            key_ok = page >= 0  # scalar (ONE_PAGE) or [BLOCK_N]
            k_rows = tile_row_offsets(page, start_n, offs_n, stride_k_block, stride_k_row,
                                      PAGE_SIZE, BLOCK_N)  # [BLOCK_N] int64
            v_rows = tile_row_offsets(page, start_n, offs_n, stride_v_block, stride_v_row,
                                      PAGE_SIZE, BLOCK_N)  # [BLOCK_N] int64
            k_ptrs = k_base + k_rows[:, None] + offs_d[None, :] * stride_kd
            v_ptrs = v_base + v_rows[:, None] + offs_d[None, :] * stride_vd
            if ONE_PAGE or BOUND or CHECK_KEYS:
                if ONE_PAGE:
                    n_ok = n < tl.where(key_ok, n_limit, start_n)  # [BLOCK_N]
                elif BOUND:
                    n_ok = (n < n_limit) & key_ok
                else:
                    n_ok = key_ok
                kv_mask = n_ok[:, None]  # [BLOCK_N, 1]: no mask along D keeps wide loads
                if PAD_D:
                    kv_mask = kv_mask & (offs_d[None, :] < head_dim)
                k = tl.load(k_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM]
                v = tl.load(v_ptrs, mask=kv_mask, other=0.0)  # [BLOCK_N, HEAD_DIM]
            elif PAD_D:  # every key present (the caller checked the stage's ids)
                k = tl.load(k_ptrs, mask=offs_d[None, :] < head_dim, other=0.0)
                v = tl.load(v_ptrs, mask=offs_d[None, :] < head_dim, other=0.0)
            else:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
        else:
            k_rows = (src0 + n).to(tl.int64) * stride_k_row
            v_rows = (src0 + n).to(tl.int64) * stride_v_row
            k_ptrs = k_base + k_rows[:, None] + offs_d[None, :] * stride_kd  # [BLOCK_N, HEAD_DIM]
            v_ptrs = v_base + v_rows[:, None] + offs_d[None, :] * stride_vd  # [BLOCK_N, HEAD_DIM]
            if BOUND:
                if PAD_D:
                    kv_mask = (n[:, None] < n_limit) & (offs_d[None, :] < head_dim)
                else:
                    kv_mask = n[:, None] < n_limit
                k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
                v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
            elif PAD_D:
                k = tl.load(k_ptrs, mask=offs_d[None, :] < head_dim, other=0.0)
                v = tl.load(v_ptrs, mask=offs_d[None, :] < head_dim, other=0.0)
            else:
                k = tl.load(k_ptrs)
                v = tl.load(v_ptrs)
        # k, v: [BLOCK_N, HEAD_DIM] in the cache dtype (fp8 is widened to q's dtype)
        s = tl.dot(q, tl.trans(k.to(q.dtype)))  # [BLOCK_M, BLOCK_N] fp32
        if SOFT_CAP:
            s = soft_cap * tanh_f32(s * cap_scale) * 1.4426950408889634
            s_mult = 1.0
        else:
            s_mult = qk_scale  # applied inside exp2's argument: one FMA per logit
        if MASKED:
            vis = tile_visibility(diag, key0 + n, n, n_limit, window, tree_rows, len_p,
                                  tree_words, BOUND, CAUSAL, WINDOW, TREE)
            if FROM_CACHE and not ONE_PAGE:
                vis = vis & key_ok[None, :]
            s = tl.where(vis, s, float("-inf"))
        elif FROM_CACHE and not ONE_PAGE and CHECK_KEYS:
            if not row_present:  # rare: a bad id somewhere in the row
                s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * s_mult)  # [BLOCK_M], scale > 0
        m_sub = m_new
        if ONE_PAGE:
            m_new = tl.where(key_ok, m_new, m_i)  # an absent page leaves the state as is
            m_sub = tl.where(key_ok, m_new, float("inf"))  # ... and its p is 2^-inf = 0
        alpha = tl.exp2(m_i - m_new)  # m_i starts finite: never -inf - -inf
        p = tl.exp2(s * s_mult - m_sub[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if SCALE_V:
            p = p * v_mult
        acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc)  # [BLOCK_M, HEAD_DIM]
        m_i = m_new
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["num_blocks", "max_blocks", "window"])
def prefix_prefill_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, k_new_ptr, v_new_ptr, out_ptr, lse_ptr, sinks_ptr,
        tree_ptr, block_table_ptr, cu_seqlens_q_ptr, seq_lens_k_ptr, tile_req_ptr, tile_mblock_ptr,
        k_scale_ptr, v_scale_ptr,
        sm_scale, k_scale_val, v_scale_val, k_scale_stride, v_scale_stride, soft_cap, window,
        head_dim, num_blocks, max_blocks,
        stride_qt, stride_qh, stride_qd,
        stride_kb, stride_kh, stride_ks, stride_kd,
        stride_vb, stride_vh, stride_vs, stride_vd,
        stride_knt, stride_knh, stride_knd,
        stride_vnt, stride_vnh, stride_vnd,
        stride_ot, stride_oh, stride_od,
        stride_lset, stride_lseh,
        stride_bt, stride_bt_block, stride_tree, tree_words,
        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, CAUSAL: tl.constexpr,
        HAS_K_NEW: tl.constexpr, RETURN_LSE: tl.constexpr, SCALE_FROM_PTR: tl.constexpr,
        WINDOW: tl.constexpr, SOFT_CAP: tl.constexpr, HAS_SINKS: tl.constexpr,
        KV_SCALED: tl.constexpr, PAD_D: tl.constexpr, TWO_WALKS: tl.constexpr = False,
        TREE: tl.constexpr = False):
    """Grid ``(max_tiles, num_kv_heads)``; unused tile slots (``tile_req < 0``) exit.

    q: ``[total_q, Hq, D]``; k_cache/v_cache: ``[num_blocks, Hkv, P, D]`` views;
    k_new/v_new: ``[total_q, Hkv, D]`` (``HAS_K_NEW``); out like q; lse ``[total_q, Hq]``
    fp32 natural log (``RETURN_LSE``); sinks ``[Hq]`` fp32 (``HAS_SINKS``).
    block_table ``[B, max_blocks]`` int32/int64 (ids outside ``[0, num_blocks)``: absent
    keys), cu_seqlens_q ``[B + 1]``, seq_lens_k ``[B]``, tile_req/tile_mblock ``[max_tiles]``.
    tree: ``[total_q, tree_words]`` int32 packed tree mask, row stride ``stride_tree``
    (``TREE``, causal and no window: the new keys' visibility; the prefix stays visible).
    """
    TOK_M: tl.constexpr = BLOCK_M // GROUP
    SCAN: tl.constexpr = 256  # block ids per step of the table check
    pid_t = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = tl.load(tile_req_ptr + pid_t)
    if req < 0:
        return
    m_block = tl.load(tile_mblock_ptr + pid_t)
    q_start = tl.load(cu_seqlens_q_ptr + req)
    len_q = tl.load(cu_seqlens_q_ptr + req + 1) - q_start
    len_k = tl.load(seq_lens_k_ptr + req)
    len_p = len_k - len_q  # prefix length

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    m_tok0 = m_block * TOK_M
    tok = m_tok0 + offs_m // GROUP  # [BLOCK_M] token index inside the request
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head
    row_ok = (offs_m < TOK_M * GROUP) & (tok < len_q)
    diag = len_p + tok  # [BLOCK_M] global position of each row's token
    # [BLOCK_M] each row's packed tree-mask words (padding rows point at the first row)
    tree_rows = tree_ptr + (q_start + tl.where(row_ok, tok, 0)).to(tl.int64) * stride_tree

    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q_mask = row_ok[:, None]
    if PAD_D:
        q_mask = q_mask & (offs_d[None, :] < head_dim)
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :] * stride_qd, mask=q_mask,
                other=0.0)  # q: [BLOCK_M, HEAD_DIM]

    if SCALE_FROM_PTR:
        # per tensor (stride 0) or per KV head (stride 1)
        k_scale = tl.load(k_scale_ptr + kv_head * k_scale_stride)
        v_scale = tl.load(v_scale_ptr + kv_head * v_scale_stride)
    else:
        k_scale = k_scale_val
        v_scale = v_scale_val
    # fp8 caches: K's scale folds into the logit scale, V's into P (dense k_new: none)
    qk_scale = sm_scale * 1.4426950408889634  # log2(e), for exp2
    cap_scale = sm_scale / soft_cap
    qk_scale_c = qk_scale * k_scale
    cap_scale_c = cap_scale * k_scale

    if HAS_SINKS:  # a sink is one more always-visible key whose value is 0
        m_i = tl.maximum(tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634,
                         -1.0e30)  # [BLOCK_M]
        l_i = tl.full([BLOCK_M], 1.0, dtype=tl.float32)
    else:
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: no -inf - -inf
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_vh

    # keys a table row can hold: cache keys past them are absent, so no stage walks them
    # (a wild seq_lens_k, unchecked under validate=False, costs no more than the table)
    table_end = tl.minimum(max_blocks.to(tl.int64) * PAGE_SIZE, 2147483647).to(tl.int32)
    if HAS_K_NEW:
        # ---- stage 1: the paged prefix [0, len_c), no mask (len_c: its keys in the table)
        len_c = tl.minimum(len_p, table_end)
        lo1 = 0
        if WINDOW and CAUSAL:
            lo1 = tl.maximum(0, len_p + m_tok0 - window + 1) // BLOCK_N * BLOCK_N
        full1 = len_c // BLOCK_N * BLOCK_N
        present = table_row_present(bt_row, stride_bt_block, (full1 + PAGE_SIZE - 1) // PAGE_SIZE,
                                    max_blocks, num_blocks, SCAN=SCAN)
        acc, l_i, m_i = _prefill_stage(
            acc, l_i, m_i, q, diag, k_base, v_base, bt_row,
            stride_bt_block, max_blocks, num_blocks,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
            lo1, full1, len_c, 0, 0, window, qk_scale_c, cap_scale_c, soft_cap, v_scale,
            offs_n, offs_d, head_dim, present, tree_rows, len_p, tree_words,
            FROM_CACHE=True, PAGE_SIZE=PAGE_SIZE, BOUND=False,
            CAUSAL=False, WINDOW=WINDOW and CAUSAL, SOFT_CAP=SOFT_CAP, SCALE_V=KV_SCALED,
            PAD_D=PAD_D,
            BLOCK_N=BLOCK_N, TWO_WALKS=TWO_WALKS, TREE=False)
        acc, l_i, m_i = _prefill_stage(  # the partial last prefix tile, if any
            acc, l_i, m_i, q, diag, k_base, v_base, bt_row,
            stride_bt_block, max_blocks, num_blocks,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
            tl.maximum(full1, lo1), len_c, len_c, 0, 0, window, qk_scale_c, cap_scale_c,
            soft_cap, v_scale, offs_n, offs_d, head_dim, present, tree_rows, len_p,
            tree_words, FROM_CACHE=True, PAGE_SIZE=PAGE_SIZE, BOUND=True,
            CAUSAL=False, WINDOW=WINDOW and CAUSAL, SOFT_CAP=SOFT_CAP, SCALE_V=KV_SCALED,
            PAD_D=PAD_D,
            BLOCK_N=BLOCK_N, TWO_WALKS=TWO_WALKS, TREE=False)

        # ---- stage 2: the new tokens [0, len_q) from k_new / v_new
        kn_base = k_new_ptr + kv_head.to(tl.int64) * stride_knh
        vn_base = v_new_ptr + kv_head.to(tl.int64) * stride_vnh
        if TREE:  # a few draft tokens: every new key under the mask
            hi2 = len_q
            diag_lo = 0
            lo2 = 0
        elif CAUSAL:
            hi2 = tl.minimum(len_q, m_tok0 + TOK_M)  # tiles above the diagonal: never loaded
            diag_lo = m_tok0 // BLOCK_N * BLOCK_N  # tiles below it need no mask
            lo2 = 0
            if WINDOW:
                lo2 = tl.maximum(0, m_tok0 - window + 1) // BLOCK_N * BLOCK_N
        else:
            hi2 = len_q
            diag_lo = len_q // BLOCK_N * BLOCK_N
            lo2 = 0
        acc, l_i, m_i = _prefill_stage(
            acc, l_i, m_i, q, diag, kn_base, vn_base, bt_row,
            stride_bt_block, max_blocks, num_blocks,
            stride_knt, stride_knt, stride_knd, stride_vnt, stride_vnt, stride_vnd,
            lo2, diag_lo, hi2, len_p, q_start, window, qk_scale, cap_scale, soft_cap, 1.0,
            offs_n, offs_d, head_dim, present, tree_rows, len_p, tree_words,
            FROM_CACHE=False, PAGE_SIZE=PAGE_SIZE, BOUND=False,
            CAUSAL=False, WINDOW=WINDOW and CAUSAL, SOFT_CAP=SOFT_CAP, SCALE_V=False,
            PAD_D=PAD_D,
            BLOCK_N=BLOCK_N, TWO_WALKS=TWO_WALKS, TREE=False)
        acc, l_i, m_i = _prefill_stage(  # diagonal tiles (or the partial last tile)
            acc, l_i, m_i, q, diag, kn_base, vn_base, bt_row,
            stride_bt_block, max_blocks, num_blocks,
            stride_knt, stride_knt, stride_knd, stride_vnt, stride_vnt, stride_vnd,
            tl.maximum(diag_lo, lo2), hi2, hi2, len_p, q_start, window, qk_scale, cap_scale,
            soft_cap, 1.0, offs_n, offs_d, head_dim, present, tree_rows, len_p,
            tree_words, FROM_CACHE=False, PAGE_SIZE=PAGE_SIZE, BOUND=True,
            CAUSAL=CAUSAL and not TREE, WINDOW=WINDOW and CAUSAL, SOFT_CAP=SOFT_CAP,
            SCALE_V=False, PAD_D=PAD_D,
            BLOCK_N=BLOCK_N, TWO_WALKS=TWO_WALKS, TREE=TREE)

    else:
        # Every key is in the cache. Stage 1 walks the prefix and the new keys wholly
        # below the diagonal (keys < len_p + m_tok0 are visible to every row of the
        # tile) as one unmasked walk from key 0, so its tiles stay aligned to BLOCK_N and
        # to pages; stage 2 masks the diagonal and stops at len_p + min(Lq, m_tok0 +
        # TOK_M): tiles above the diagonal are never loaded.
        if TREE:  # the unmasked walk stops at the prefix, the mask decides the rest
            free_hi = len_p // BLOCK_N * BLOCK_N
            hi = len_k
        elif CAUSAL:
            free_hi = (len_p + m_tok0) // BLOCK_N * BLOCK_N
            hi = len_p + tl.minimum(len_q, m_tok0 + TOK_M)
        else:
            free_hi = len_k // BLOCK_N * BLOCK_N
            hi = len_k
        hi = tl.minimum(hi, table_end)
        free_hi = tl.minimum(free_hi, table_end // BLOCK_N * BLOCK_N)
        lo = 0
        if WINDOW and CAUSAL:
            lo = tl.maximum(0, len_p + m_tok0 - window + 1) // BLOCK_N * BLOCK_N
        present = table_row_present(bt_row, stride_bt_block,
                                    (free_hi + PAGE_SIZE - 1) // PAGE_SIZE, max_blocks,
                                    num_blocks, SCAN=SCAN)
        acc, l_i, m_i = _prefill_stage(  # ---- stage 1: no mask
            acc, l_i, m_i, q, diag, k_base, v_base, bt_row,
            stride_bt_block, max_blocks, num_blocks,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
            lo, free_hi, hi, 0, 0, window, qk_scale_c, cap_scale_c, soft_cap, v_scale,
            offs_n, offs_d, head_dim, present, tree_rows, len_p, tree_words,
            FROM_CACHE=True, PAGE_SIZE=PAGE_SIZE,
            BOUND=False, CAUSAL=False, WINDOW=WINDOW and CAUSAL, SOFT_CAP=SOFT_CAP,
            SCALE_V=KV_SCALED, PAD_D=PAD_D, BLOCK_N=BLOCK_N, TWO_WALKS=TWO_WALKS, TREE=False)
        acc, l_i, m_i = _prefill_stage(  # ---- stage 2: the diagonal (or the last tile)
            acc, l_i, m_i, q, diag, k_base, v_base, bt_row,
            stride_bt_block, max_blocks, num_blocks,
            stride_kb, stride_ks, stride_kd, stride_vb, stride_vs, stride_vd,
            tl.maximum(free_hi, lo), hi, hi, 0, 0, window, qk_scale_c, cap_scale_c,
            soft_cap, v_scale, offs_n, offs_d, head_dim, present, tree_rows, len_p,
            tree_words, FROM_CACHE=True, PAGE_SIZE=PAGE_SIZE, BOUND=True,
            CAUSAL=CAUSAL and not TREE, WINDOW=WINDOW and CAUSAL, SOFT_CAP=SOFT_CAP,
            SCALE_V=KV_SCALED, PAD_D=PAD_D, BLOCK_N=BLOCK_N, TWO_WALKS=TWO_WALKS, TREE=TREE)

    # ---- epilogue: rows that saw no key (l_i == 0) give out = 0, lse = -inf
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc * (1.0 / l_safe)[:, None]  # [BLOCK_M, HEAD_DIM]
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    o_mask = row_ok[:, None]
    if PAD_D:
        o_mask = o_mask & (offs_d[None, :] < head_dim)
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=o_mask)
    if RETURN_LSE:
        lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) * 0.6931471805599453,
                       float("-inf"))  # [BLOCK_M] natural log
        l_rows = (q_start + tok).to(tl.int64) * stride_lset + head.to(tl.int64) * stride_lseh
        tl.store(lse_ptr + l_rows, lse, mask=row_ok)
