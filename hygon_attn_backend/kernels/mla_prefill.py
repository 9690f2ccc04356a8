"""Ragged dense attention with a query/key head size unlike the value head size, and the
merge of two partial attention results by their LSE (``@triton.jit`` only).

Multi-head latent attention (DeepSeek V2/V3, Kimi K2, GLM) prefills as ordinary attention
once the latent K/V are up-projected: q and k have ``D_QK = 128 + 64`` columns (the
"nope" part and the rotary part), v has ``D_V = 128``. ``ragged_attention_kernel`` runs
that over a packed batch (``cu_seqlens_q`` / ``cu_seqlens_k``), any ``D_QK``, ``D_V`` up to
the register budget, GQA packed into the M tile as in ``prefill.py``.

The head sizes need not be powers of two. ``D_QK`` is split in two power-of-two parts,
``D1 = the largest power of two <= D_QK`` and ``D2 = next_pow2(D_QK - D1)`` (192 = 128 +
64, 576 = 512 + 64, 48 = 32 + 16): two ``tl.dot`` accumulate the logits, so a 192-wide
head costs 192 columns of work, not the 256 a single padded dot would. ``D_V`` is padded
to a power of two (loads masked). The plan (``ops/mla_prefill/tuning.py``) computes the
split.

Mask: row ``i`` of a request with ``Lq`` queries and ``Lk`` keys sees key ``j`` iff
``j <= i + (Lk - Lq)`` (causal, bottom-right aligned: the queries are the last ``Lq``
tokens of their sequence; ``Lk < Lq`` leaves the first rows without a key) or every key
(``CAUSAL`` false). Keys every row of a tile sees are walked without a mask; only the
diagonal (and the last partial tile) pays for it.

Softmax state ``m_i``, ``l_i``, ``acc`` is fp32 in log2 units (``exp2``).
"""

import triton
import triton.language as tl

from hygon_attn_backend.kernels.paged_kv import lookup_tile_pages, tile_row_offsets


@triton.jit
def _ragged_walk(acc, l_i, m_i, q1, q2, diag, k_base, v_base, stride_kt, stride_kd,
                 stride_vt, stride_vd, lo, hi, n_limit, qk_scale, offs_n, offs_d1, offs_d2,
                 offs_dv, d_qk, d_v, bt_row, stride_btb, max_blocks, num_blocks,
                 stride_kb, stride_vb, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
                 D1: tl.constexpr, HAS_D2: tl.constexpr, PAD_D1: tl.constexpr,
                 PAD_D2: tl.constexpr, PAD_V: tl.constexpr, BLOCK_N: tl.constexpr,
                 PAGED: tl.constexpr, PAGE_SIZE: tl.constexpr):
    """Walk keys ``n`` in ``[lo, hi)`` (step BLOCK_N) of one request; keys ``>= n_limit``
    and, with ``CAUSAL``, keys past a row's ``diag`` are masked when ``MASKED``.
    ``PAGED``: key ``n`` is slot ``n % PAGE_SIZE`` of block ``bt_row[n // PAGE_SIZE]``
    (``stride_kb``/``stride_vb`` a block, ``stride_kt``/``stride_vt`` a slot); an absent
    block id (``paged_kv.lookup_tile_pages``) is never loaded and its keys are masked.

    q1: ``[BLOCK_M, D1]``, q2: ``[BLOCK_M, D2]`` (``HAS_D2``) in q's dtype;
    k_base / v_base: the request's first key row of this KV head; acc ``[BLOCK_M, DV]``,
    l_i / m_i ``[BLOCK_M]`` fp32; diag ``[BLOCK_M]`` int32 each row's last visible key.
    ``PAD_D1``: ``d_qk < D1`` (a head under 16 columns); ``PAD_D2``: the second part is
    wider than its ``d_qk - D1`` real columns; ``PAD_V``: ``DV > d_v``.
    """
    d2_valid = d_qk - D1
    CHECK: tl.constexpr = MASKED or PAGED  # loads and logits masked per key
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=1 if MASKED else None):
        n = start_n + offs_n  # [BLOCK_N]
        if PAGED:
            page = lookup_tile_pages(bt_row, stride_btb, start_n, offs_n, max_blocks,
                                     num_blocks, PAGE_SIZE, BLOCK_N)  # scalar or [BLOCK_N]
            k_rows = tile_row_offsets(page, start_n, offs_n, stride_kb, stride_kt,
                                      PAGE_SIZE, BLOCK_N)
            v_rows = tile_row_offsets(page, start_n, offs_n, stride_vb, stride_vt,
                                      PAGE_SIZE, BLOCK_N)
            n_ok = n < tl.where(page >= 0, n_limit, start_n)  # [BLOCK_N]; page: either
        else:
            k_rows = n.to(tl.int64) * stride_kt
            v_rows = n.to(tl.int64) * stride_vt
            n_ok = n < n_limit
        if CHECK:
            k1_mask = n_ok[:, None]
            if PAD_D1:
                k1_mask = k1_mask & (offs_d1[None, :] < d_qk)
            k1 = tl.load(k_base + k_rows[:, None] + offs_d1[None, :] * stride_kd,
                         mask=k1_mask, other=0.0)  # [BLOCK_N, D1]
        elif PAD_D1:
            k1 = tl.load(k_base + k_rows[:, None] + offs_d1[None, :] * stride_kd,
                         mask=offs_d1[None, :] < d_qk, other=0.0)
        else:
            k1 = tl.load(k_base + k_rows[:, None] + offs_d1[None, :] * stride_kd)
        k1 = k1.to(q1.dtype)  # an fp8 cache's codes, exact in fp16 / bf16
        s = tl.dot(q1, tl.trans(k1))  # [BLOCK_M, BLOCK_N] fp32
        if HAS_D2:
            k2_ptrs = k_base + k_rows[:, None] + (D1 + offs_d2)[None, :] * stride_kd
            if CHECK:
                k2_mask = n_ok[:, None]
                if PAD_D2:
                    k2_mask = k2_mask & (offs_d2[None, :] < d2_valid)
                k2 = tl.load(k2_ptrs, mask=k2_mask, other=0.0)  # [BLOCK_N, D2]
            elif PAD_D2:
                k2 = tl.load(k2_ptrs, mask=offs_d2[None, :] < d2_valid, other=0.0)
            else:
                k2 = tl.load(k2_ptrs)
            s = tl.dot(q2, tl.trans(k2.to(q2.dtype)), s)
        if CHECK:
            vis = n_ok[None, :]
            if MASKED and CAUSAL:
                vis = vis & (n[None, :] <= diag[:, None])
            s = tl.where(vis, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # [BLOCK_M]; m_i starts finite
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s * qk_scale - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v_ptrs = v_base + v_rows[:, None] + offs_dv[None, :] * stride_vd
        if CHECK:
            v_mask = n_ok[:, None]
            if PAD_V:
                v_mask = v_mask & (offs_dv[None, :] < d_v)
            v = tl.load(v_ptrs, mask=v_mask, other=0.0)  # [BLOCK_N, DV]
        elif PAD_V:
            v = tl.load(v_ptrs, mask=offs_dv[None, :] < d_v, other=0.0)
        else:
            v = tl.load(v_ptrs)
        acc = tl.dot(p.to(q1.dtype), v.to(q1.dtype), acc)  # [BLOCK_M, DV]
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def ragged_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, cu_seqlens_q_ptr, cu_seqlens_k_ptr,
        tile_req_ptr, tile_mblock_ptr, sm_scale, d_qk, d_v, total_q, total_k,
        kv_scale_ptr, kv_scale_value,
        stride_qt, stride_qh, stride_qd, stride_kt, stride_kh, stride_kd,
        stride_vt, stride_vh, stride_vd, stride_ot, stride_oh, stride_od,
        stride_lseh, stride_lset,
        block_table_ptr, stride_bt, stride_btb, max_blocks, num_blocks, stride_kb, stride_vb,
        GROUP: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, CAUSAL: tl.constexpr,
        RETURN_LSE: tl.constexpr, PAD_D1: tl.constexpr, PAD_D2: tl.constexpr,
        PAD_V: tl.constexpr, PAGED: tl.constexpr = False, PAGE_SIZE: tl.constexpr = 1,
        SCALE_FROM_PTR: tl.constexpr = False):
    """Grid ``(max_tiles, num_kv_heads * GROUP // HEADS)``; unused tile slots
    (``tile_req < 0``) exit. A tile packs ``HEADS`` query heads of one KV head's group of
    ``GROUP`` (``HEADS == GROUP``: the whole group, each K/V tile loaded once for it; a
    divisor of it where the group does not fit one tile): row ``r`` is token
    ``m_block * (BLOCK_M // HEADS) + r // HEADS``, head ``head0 + r % HEADS``.

    q: ``[total_q, Hq, d_qk]``, k: ``[total_k, Hkv, d_qk]``, v: ``[total_k, Hkv, d_v]``,
    out: ``[total_q, Hq, d_v]``, all any strides; lse: ``[Hq, total_q]`` fp32 natural log
    (``RETURN_LSE``; strides ``stride_lseh``, ``stride_lset``). cu_seqlens_q / _k:
    ``[B + 1]``; tile_req / tile_mblock: ``[max_tiles]`` int32 (``ops.prefill.plan``'s
    tile map: request and m-block of each program).
    ``D1 + D2 >= d_qk`` (``D2 == 0``: one part), ``DV >= d_v``, all powers of two >= 16;
    ``PAD_*`` say which of them is wider than its real columns (those loads are masked).
    ``PAGED`` (the absorbed MLA extend): k / v are ``[num_blocks, P, Hkv, D]`` views of one
    paged cache (``stride_kb``/``stride_vb`` a block, ``stride_kt``/``stride_vt`` a slot),
    ``cu_seqlens_k_ptr`` holds ``seq_lens_k [B]`` (every key of a request, prefix and new,
    in the cache), ``block_table [B, max_blocks]`` (row stride ``stride_bt``, column
    ``stride_btb``); ids outside ``[0, num_blocks)`` are absent keys. An fp8 cache's rows
    are ``code * kv_scale`` (``kv_scale_ptr[0]`` with SCALE_FROM_PTR, else
    ``kv_scale_value``; 1 for a 16-bit cache): the codes are widened to q's dtype, the
    scale folded into the logits' scale and the output.
    """
    TOK_M: tl.constexpr = BLOCK_M // HEADS
    HEAD_BLOCKS: tl.constexpr = GROUP // HEADS  # programs sharing one KV head's group
    HAS_D2: tl.constexpr = D2 > 0
    D2_ARANGE: tl.constexpr = D2 if D2 > 0 else 16
    pid_t = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_BLOCKS
    head0 = kv_head * GROUP + (tl.program_id(1) % HEAD_BLOCKS) * HEADS
    req = tl.load(tile_req_ptr + pid_t)
    if req < 0:
        return
    m_block = tl.load(tile_mblock_ptr + pid_t)
    # rows outside q / k are never touched, whatever the lengths say (the op checks them
    # on the host unless a plan or a graph capture skips it)
    q_start = tl.load(cu_seqlens_q_ptr + req)
    len_q = tl.load(cu_seqlens_q_ptr + req + 1) - q_start
    len_q = tl.where(q_start >= 0, tl.minimum(len_q, total_q - q_start), 0)
    if PAGED:  # seq_lens_k; keys past the table's capacity are absent
        k_start = req * 0  # every key is addressed through the table
        len_k = tl.minimum(tl.maximum(tl.load(cu_seqlens_k_ptr + req), 0),
                           max_blocks * PAGE_SIZE)
    else:
        k_start = tl.load(cu_seqlens_k_ptr + req)
        len_k = tl.load(cu_seqlens_k_ptr + req + 1) - k_start
        len_k = tl.maximum(tl.where(k_start >= 0, tl.minimum(len_k, total_k - k_start), 0),
                           0)
        k_start = tl.maximum(k_start, 0)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    shift = len_k - len_q  # causal: row i sees keys j <= i + shift

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d1 = tl.arange(0, D1)
    offs_d2 = tl.arange(0, D2_ARANGE)
    offs_dv = tl.arange(0, DV)
    d2_valid = d_qk - D1  # real columns of the second part
    m_tok0 = m_block * TOK_M
    tok = m_tok0 + offs_m // HEADS  # [BLOCK_M] token inside the request
    head = head0 + offs_m % HEADS  # [BLOCK_M] query head
    row_ok = (offs_m < TOK_M * HEADS) & (tok < len_q)
    diag = tok + shift  # [BLOCK_M] each row's last visible key (causal)

    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
    q1_mask = row_ok[:, None]
    if PAD_D1:
        q1_mask = q1_mask & (offs_d1[None, :] < d_qk)
    q1 = tl.load(q_ptr + q_rows[:, None] + offs_d1[None, :] * stride_qd, mask=q1_mask,
                 other=0.0)  # [BLOCK_M, D1]
    if HAS_D2:
        q2 = tl.load(q_ptr + q_rows[:, None] + (D1 + offs_d2)[None, :] * stride_qd,
                     mask=row_ok[:, None] & (offs_d2[None, :] < d2_valid),
                     other=0.0)  # [BLOCK_M, D2]
    else:
        q2 = q1  # unused

    if SCALE_FROM_PTR:
        kv_scale = tl.load(kv_scale_ptr).to(tl.float32)
    else:
        kv_scale = kv_scale_value
    qk_scale = sm_scale * kv_scale * 1.4426950408889634  # log2(e), for exp2
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: no -inf - -inf
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
    k_base = k_ptr + k_start.to(tl.int64) * stride_kt + kv_head.to(tl.int64) * stride_kh
    v_base = v_ptr + k_start.to(tl.int64) * stride_vt + kv_head.to(tl.int64) * stride_vh

    if CAUSAL:
        # keys < shift + m_tok0 + 1 are visible to every row of the tile; the last row
        # sees up to shift + min(len_q, m_tok0 + TOK_M) - 1
        free_hi = tl.minimum(tl.maximum(shift + m_tok0 + 1, 0), len_k) // BLOCK_N * BLOCK_N
        hi = tl.minimum(tl.maximum(shift + tl.minimum(len_q, m_tok0 + TOK_M), 0), len_k)
    else:
        free_hi = len_k // BLOCK_N * BLOCK_N
        hi = len_k
    acc, l_i, m_i = _ragged_walk(
        acc, l_i, m_i, q1, q2, diag, k_base, v_base, stride_kt, stride_kd, stride_vt,
        stride_vd, 0, free_hi, len_k, qk_scale, offs_n, offs_d1, offs_d2, offs_dv, d_qk,
        d_v, bt_row, stride_btb, max_blocks, num_blocks, stride_kb, stride_vb,
        MASKED=False, CAUSAL=False, D1=D1, HAS_D2=HAS_D2, PAD_D1=PAD_D1, PAD_D2=PAD_D2,
        PAD_V=PAD_V, BLOCK_N=BLOCK_N, PAGED=PAGED, PAGE_SIZE=PAGE_SIZE)
    acc, l_i, m_i = _ragged_walk(  # the diagonal / the partial last tile
        acc, l_i, m_i, q1, q2, diag, k_base, v_base, stride_kt, stride_kd, stride_vt,
        stride_vd, free_hi, hi, len_k, qk_scale, offs_n, offs_d1, offs_d2, offs_dv,
        d_qk, d_v, bt_row, stride_btb, max_blocks, num_blocks, stride_kb, stride_vb,
        MASKED=True, CAUSAL=CAUSAL, D1=D1, HAS_D2=HAS_D2, PAD_D1=PAD_D1, PAD_D2=PAD_D2,
        PAD_V=PAD_V, BLOCK_N=BLOCK_N, PAGED=PAGED, PAGE_SIZE=PAGE_SIZE)

    # ---- epilogue: rows that saw no key (l_i == 0) give out = 0, lse = -inf
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    out = acc * (kv_scale / l_safe)[:, None]  # [BLOCK_M, DV]
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_dv[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < d_v))
    if RETURN_LSE:
        lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) * 0.6931471805599453,
                       float("-inf"))  # [BLOCK_M] natural log
        l_ptrs = lse_ptr + head.to(tl.int64) * stride_lseh + \
            (q_start + tok).to(tl.int64) * stride_lset
        tl.store(l_ptrs, lse, mask=row_ok)


@triton.jit
def merge_states_kernel(out_ptr, out_lse_ptr, a_ptr, lse_a_ptr, b_ptr, lse_b_ptr,
                        num_heads, head_dim,
                        stride_at, stride_ah, stride_ad, stride_bt, stride_bh, stride_bd,
                        stride_ot, stride_oh, stride_od,
                        stride_lah, stride_lat, stride_lbh, stride_lbt,
                        stride_loh, stride_lot,
                        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                        WRITE_LSE: tl.constexpr):
    """Grid ``(num_tokens, cdiv(num_heads, BLOCK_H))``: token ``t``, heads ``h``.

    a, b, out: ``[N, H, D]`` (any strides); lse_a, lse_b, out_lse: ``[H, N]`` fp32 natural
    log (any strides). A partial whose LSE is not finite (``-inf``: it saw no key; ``+inf``
    or NaN: no defined normaliser) contributes nothing, its output values unread; two
    such partials give 0 and ``-inf``. The output may be ``a`` or ``b`` itself (each
    element is read before it is written, by the same program).
    """
    t = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    h_ok = offs_h < num_heads
    h64 = offs_h.to(tl.int64)
    la = tl.load(lse_a_ptr + h64 * stride_lah + t * stride_lat, mask=h_ok, other=0.0)
    lb = tl.load(lse_b_ptr + h64 * stride_lbh + t * stride_lbt, mask=h_ok, other=0.0)
    ok_a = (la == la) & (tl.abs(la) != float("inf"))  # finite (NaN != NaN)
    ok_b = (lb == lb) & (tl.abs(lb) != float("inf"))
    m = tl.maximum(tl.where(ok_a, la, -3.0e38), tl.where(ok_b, lb, -3.0e38))
    m = tl.where(ok_a | ok_b, m, 0.0)  # no finite partial: any finite value (weights 0)
    wa = tl.where(ok_a, tl.exp(tl.where(ok_a, la, 0.0) - m), 0.0)  # [BLOCK_H]
    wb = tl.where(ok_b, tl.exp(tl.where(ok_b, lb, 0.0) - m), 0.0)
    total = wa + wb
    some = total > 0.0
    inv = 1.0 / tl.where(some, total, 1.0)
    ca = wa * inv
    cb = wb * inv
    if WRITE_LSE:
        lse = tl.where(some, m + tl.log(tl.where(some, total, 1.0)), float("-inf"))
        tl.store(out_lse_ptr + h64 * stride_loh + t * stride_lot, lse, mask=h_ok)
    for d0 in range(0, head_dim, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask = h_ok[:, None] & (offs_d[None, :] < head_dim)
        ma = mask & ok_a[:, None]
        mb = mask & ok_b[:, None]
        xa = tl.load(a_ptr + t * stride_at + h64[:, None] * stride_ah + offs_d[None, :] * stride_ad,
                     mask=ma, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
        xb = tl.load(b_ptr + t * stride_bt + h64[:, None] * stride_bh + offs_d[None, :] * stride_bd,
                     mask=mb, other=0.0).to(tl.float32)
        y = tl.where(ma, xa * ca[:, None], 0.0) + tl.where(mb, xb * cb[:, None], 0.0)
        tl.store(out_ptr + t * stride_ot + h64[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 y.to(out_ptr.dtype.element_ty), mask=mask)
