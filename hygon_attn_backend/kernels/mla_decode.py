"""Multi-head latent attention (MLA) decode over a paged latent cache, and its combine.

The cache holds one latent row a token, ``[kv_c (RANK) | k_pe (ROPE)]``; the key is the
whole row, the value its first ``RANK`` columns. The queries come absorbed (``q_nope``
multiplied into the latent space, then ``q_pe``), so every query head reads the same row:
grid ``(cdiv(T * Hq, BLOCK_M), num_seqs, num_partitions)``, one program serves
``BLOCK_M`` query rows (``row = t * Hq + h``) of one request against each KV tile it
loads once. QK^T is two dots (the RANK part and the ROPE part: 576 is no power of two),
PV one over the RANK part of the same tile. An fp8 cache (KV_WIDEN, ``kernels/fp8.py``)
is widened to fp16 as loaded and both dots run on fp16 operands (the query brought into
fp16's range by a power of two; the one per-tensor scale folds into the logits and the
output). Token ``t`` sits at ``seq_len - T + t`` and sees keys ``j <= seq_len - T + t``;
with ``TREE`` (speculative verify of a draft tree) it sees the keys before the drafts and
the drafts its row of the packed tree mask names (``kernels/tree_mask.py``).

Bounds: the paged-KV rule of ``kernels/paged_kv.py`` (absent keys are never read), the
walk ends at the table's capacity (``kernels/combine.py: table_keys``).

SPLIT=False: the program covers the whole sequence and writes ``out`` (and the rows'
natural-log LSE with WRITE_LSE). SPLIT=True: partition ``part`` of the sequence's own
length (``seq_partitions`` with SEQ_SPLIT) writes ``(m, l, acc / l)`` to the scratch slot
``seq * num_partitions + part``; :func:`mla_combine_kernel` merges them. Partition 0
always runs, so a sequence of length 0 gets its zero output (and ``-inf`` LSE).
"""

import triton
import triton.language as tl

from hygon_attn_backend.kernels.combine import seq_partitions, table_keys
from hygon_attn_backend.kernels.fp8 import (WIDEN_NONE, finite_abs_max, fp16_range,
                                            widen_kv)
from hygon_attn_backend.kernels.paged_kv import lookup_tile_pages, tile_row_offsets
from hygon_attn_backend.kernels.softmax import online_softmax_step
from hygon_attn_backend.kernels.tree_mask import tree_row_words, tree_visibility_of_words


@triton.jit(do_not_specialize=["scale", "kv_scale_value", "num_blocks",
                               "max_blocks_per_seq", "partition_size", "num_partitions"])
def mla_decode_kernel(
    out_ptr, lse_ptr, q_ptr, kv_ptr, block_table_ptr, seq_lens_ptr, kv_scale_ptr,
    max_logits_ptr, exp_sums_ptr, partial_out_ptr, tree_ptr,
    scale, kv_scale_value, num_blocks, max_blocks_per_seq, partition_size, num_partitions,
    stride_q_seq, stride_q_tok, stride_q_head, stride_q_dim,
    stride_o_seq, stride_o_tok, stride_o_head, stride_o_dim,
    stride_lse_seq, stride_lse_tok, stride_lse_head,
    stride_kv_block, stride_kv_slot, stride_kv_dim,
    stride_bt_seq, stride_bt_block,
    stride_ml_slot, stride_ml_row,
    stride_po_slot, stride_po_row, stride_po_dim,
    stride_tree, tree_words,
    NUM_HEADS: tl.constexpr,       # Hq
    NUM_TOKENS: tl.constexpr,      # T query tokens a request (MTP verify)
    RANK: tl.constexpr,            # kv_lora_rank: the value width
    RANK_PAD: tl.constexpr,        # next power of two of RANK (>= 16)
    ROPE: tl.constexpr,            # rope_dim (0: none)
    ROPE_PAD: tl.constexpr,        # next power of two of ROPE (>= 16)
    BLOCK_M: tl.constexpr,         # query rows a program (>= 16)
    BLOCK_N: tl.constexpr,         # keys a tile
    PAGE_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    SCALES_FROM_PTR: tl.constexpr,  # kv_scale is a 1-element tensor (no host sync)
    WRITE_LSE: tl.constexpr,       # unsplit: also store each row's LSE
    KV_WIDEN: tl.constexpr = 0,    # kernels/fp8.py: an fp8 cache widens to fp16, fp16 dots
    TREE: tl.constexpr = False,    # the NUM_TOKENS drafts under a packed tree mask
):
    row_block = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    part = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    key_end = table_keys(seq_len, max_blocks_per_seq, PAGE_SIZE)
    if SPLIT:
        part_size, num_parts = seq_partitions(key_end, partition_size, num_partitions,
                                              True, BLOCK_N)
        if part >= num_parts:
            return
    else:
        part_size = partition_size
    part_start = part * part_size
    part_end = tl.minimum(part_start + part_size, key_end)

    offs_m = row_block * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M] row = t * Hq + h
    offs_n = tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, RANK_PAD)
    offs_e = tl.arange(0, ROPE_PAD)
    row_ok = offs_m < NUM_TOKENS * NUM_HEADS
    tok_m = offs_m // NUM_HEADS  # [BLOCK_M]
    head_m = offs_m % NUM_HEADS  # [BLOCK_M]
    r_ok = offs_r < RANK
    e_ok = offs_e < ROPE

    q_row = (seq * stride_q_seq + tok_m.to(tl.int64) * stride_q_tok
             + head_m.to(tl.int64) * stride_q_head)  # [BLOCK_M]
    q_nope = tl.load(q_ptr + q_row[:, None] + offs_r[None, :].to(tl.int64) * stride_q_dim,
                     mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    # q_nope: [BLOCK_M, RANK_PAD]
    if ROPE > 0:
        q_pe = tl.load(q_ptr + q_row[:, None]
                       + (RANK + offs_e)[None, :].to(tl.int64) * stride_q_dim,
                       mask=row_ok[:, None] & e_ok[None, :], other=0.0)
        # q_pe: [BLOCK_M, ROPE_PAD]

    if SCALES_FROM_PTR:
        kv_scale = tl.load(kv_scale_ptr).to(tl.float32)
    else:
        kv_scale = kv_scale_value
    k_scale = kv_scale
    if KV_WIDEN != WIDEN_NONE:
        # fp8 cache: both dots on fp16 operands (kernels/fp8.py), the query brought into
        # fp16's range by one power of two over both of its parts, folded into the logits
        qmax = finite_abs_max(q_nope)
        if ROPE > 0:
            qmax = tl.maximum(qmax, finite_abs_max(q_pe))
        q_down, q_up = fp16_range(qmax)
        q_nope = (q_nope.to(tl.float32) * q_down).to(tl.float16)
        if ROPE > 0:
            q_pe = (q_pe.to(tl.float32) * q_down).to(tl.float16)
        k_scale = kv_scale * q_up
    qk_scale = scale * k_scale * 1.4426950408889634  # K's dequant folded in; log2 units
    pos_m = seq_len - NUM_TOKENS + tok_m  # [BLOCK_M] last key each row sees
    if TREE:  # each row's packed words (row seq * NUM_TOKENS + token), read once: <= 64
        # drafts a request (the plan's bound)
        tree_rows = tree_ptr + (seq * NUM_TOKENS + tl.where(row_ok, tok_m, 0)) * stride_tree
        tree_w0, tree_w1 = tree_row_words(tree_rows, row_ok, tree_words)  # [BLOCK_M] each

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, RANK_PAD], dtype=tl.float32)

    d_off_r = offs_r.to(tl.int64) * stride_kv_dim  # [RANK_PAD]
    d_off_e = (RANK + offs_e).to(tl.int64) * stride_kv_dim  # [ROPE_PAD]
    bt_row_ptr = block_table_ptr + seq * stride_bt_seq
    # the next tile's block ids are read one iteration ahead: the table's latency overlaps
    # this tile's loads instead of preceding them (a lookup past the table reads nothing)
    page_next = lookup_tile_pages(bt_row_ptr, stride_bt_block, part_start, offs_n,
                                  max_blocks_per_seq, num_blocks, PAGE_SIZE, BLOCK_N)
    for start in range(part_start, part_end, BLOCK_N):
        offs_tok = start + offs_n  # [BLOCK_N]
        page = page_next
        page_next = lookup_tile_pages(bt_row_ptr, stride_bt_block, start + BLOCK_N, offs_n,
                                      max_blocks_per_seq, num_blocks, PAGE_SIZE, BLOCK_N)
        if PAGE_SIZE % BLOCK_N == 0:  # one page for the whole tile (a scalar id)
            tok_ok = offs_tok < tl.where(page >= 0, part_end, start)
        else:
            tok_ok = (offs_tok < part_end) & (page >= 0)
        tok_off = tile_row_offsets(page, start, offs_n, stride_kv_block, stride_kv_slot,
                                   PAGE_SIZE, BLOCK_N)  # [BLOCK_N], clamped ids
        if RANK == RANK_PAD:
            kv_mask = tok_ok[:, None]  # no mask along the row: keeps 16-byte loads
        else:
            kv_mask = tok_ok[:, None] & r_ok[None, :]
        kv = tl.load(kv_ptr + tok_off[:, None] + d_off_r[None, :], mask=kv_mask, other=0.0)
        if KV_WIDEN != WIDEN_NONE:
            kv = widen_kv(kv, KV_WIDEN)
        kv = kv.to(q_nope.dtype)  # [BLOCK_N, RANK_PAD]: K's first part and V
        qk = tl.dot(q_nope, tl.trans(kv))  # [BLOCK_M, BLOCK_N] fp32
        if ROPE > 0:
            pe = tl.load(kv_ptr + tok_off[:, None] + d_off_e[None, :],
                         mask=tok_ok[:, None] & e_ok[None, :], other=0.0)
            # pe: [BLOCK_N, ROPE_PAD]
            if KV_WIDEN != WIDEN_NONE:
                pe = widen_kv(pe, KV_WIDEN)
            qk = tl.dot(q_pe, tl.trans(pe.to(q_pe.dtype)), acc=qk)
        s = qk * qk_scale
        visible = tok_ok[None, :]
        if TREE:  # the drafts are the last NUM_TOKENS keys
            visible = visible & tree_visibility_of_words(
                tree_w0, tree_w1, offs_tok - (seq_len - NUM_TOKENS))
        elif NUM_TOKENS > 1:
            visible = visible & (offs_tok[None, :] <= pos_m[:, None])
        s = tl.where(visible, s, float("-inf"))
        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    result = acc * (kv_scale / l_safe)[:, None]  # [BLOCK_M, RANK_PAD]
    if SPLIT:
        slot_id = seq * num_partitions + part
        row = offs_m.to(tl.int64)
        tl.store(max_logits_ptr + slot_id * stride_ml_slot + row * stride_ml_row, m_i,
                 mask=row_ok)
        tl.store(exp_sums_ptr + slot_id * stride_ml_slot + row * stride_ml_row, l_i,
                 mask=row_ok)
        po_offs = (slot_id * stride_po_slot + row[:, None] * stride_po_row
                   + offs_r[None, :].to(tl.int64) * stride_po_dim)
        tl.store(partial_out_ptr + po_offs, result, mask=row_ok[:, None] & r_ok[None, :])
    else:
        o_row = (seq * stride_o_seq + tok_m.to(tl.int64) * stride_o_tok
                 + head_m.to(tl.int64) * stride_o_head)  # [BLOCK_M]
        tl.store(out_ptr + o_row[:, None] + offs_r[None, :].to(tl.int64) * stride_o_dim,
                 result.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & r_ok[None, :])
        if WRITE_LSE:
            # natural units: log2 units times ln 2
            lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) * 0.6931471805599453,
                           float("-inf"))
            tl.store(lse_ptr + seq * stride_lse_seq + tok_m.to(tl.int64) * stride_lse_tok
                     + head_m.to(tl.int64) * stride_lse_head, lse, mask=row_ok)


@triton.jit(do_not_specialize=["max_blocks_per_seq", "partition_size", "num_partitions"])
def mla_combine_kernel(
    out_ptr, lse_ptr, max_logits_ptr, exp_sums_ptr, partial_out_ptr, seq_lens_ptr,
    max_blocks_per_seq, partition_size, num_partitions,
    stride_o_seq, stride_o_tok, stride_o_head, stride_o_dim,
    stride_lse_seq, stride_lse_tok, stride_lse_head,
    stride_ml_slot, stride_ml_row,
    stride_po_slot, stride_po_row, stride_po_dim,
    NUM_HEADS: tl.constexpr,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    PART_CHUNK: tl.constexpr,  # partitions read a step
    ALIGN: tl.constexpr,       # the decode launch's BLOCK_N (seq_partitions)
    PAGE_SIZE: tl.constexpr,   # the decode launch's (table_keys)
    WRITE_LSE: tl.constexpr,
):
    """Merge the partitions of one (request, query row): grid ``(num_seqs, T * Hq)``.

    ``out = sum_p w_p o_p``, ``w_p = l_p 2^(m_p - M) / sum_q l_q 2^(m_q - M)`` over the
    partitions this sequence has (``seq_partitions``, as the decode launch computed them);
    LSE ``= (M + log2 sum_p l_p 2^(m_p - M)) ln 2``. A row with no key gets zeros and
    ``-inf``."""
    seq = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    _, parts = seq_partitions(table_keys(seq_len, max_blocks_per_seq, PAGE_SIZE),
                              partition_size, num_partitions, True, ALIGN)
    offs_p = tl.arange(0, PART_CHUNK)
    offs_r = tl.arange(0, RANK_PAD)
    r_ok = offs_r < RANK
    slot0 = seq * num_partitions
    big_m = tl.full([1], float("-inf"), dtype=tl.float32)
    total = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([RANK_PAD], dtype=tl.float32)
    for c in range(0, parts, PART_CHUNK):
        p_ok = (c + offs_p) < parts
        slots = slot0 + c + offs_p  # [PART_CHUNK]
        ml_offs = slots * stride_ml_slot + row * stride_ml_row
        m = tl.load(max_logits_ptr + ml_offs, mask=p_ok, other=float("-inf"))
        l = tl.load(exp_sums_ptr + ml_offs, mask=p_ok, other=0.0)
        o = tl.load(partial_out_ptr + slots[:, None] * stride_po_slot + row * stride_po_row
                    + offs_r[None, :].to(tl.int64) * stride_po_dim,
                    mask=p_ok[:, None] & r_ok[None, :], other=0.0)
        # o: [PART_CHUNK, RANK_PAD]
        m_new = tl.maximum(big_m, tl.max(m, 0))  # [1]
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(big_m - m_ref)
        w = tl.where(l > 0.0, l * tl.exp2(m - m_ref), 0.0)  # [PART_CHUNK]
        acc = acc * alpha + tl.sum(w[:, None] * o, 0)
        total = total * alpha + tl.sum(w, 0)
        big_m = m_new
    safe = tl.where(total > 0.0, total, 1.0)
    if parts == 1:
        # one partition holds every key: its partial (what the unsplit launch writes) is
        # the answer as it is, so a split launch of a short sequence (a CUDA graph sized
        # for the cache) gives the unsplit launch's bits ((l * o) / l may round off o)
        result = tl.load(partial_out_ptr + slot0 * stride_po_slot + row * stride_po_row
                         + offs_r.to(tl.int64) * stride_po_dim, mask=r_ok, other=0.0)
    else:
        result = acc / safe  # [RANK_PAD]
    tok = row // NUM_HEADS
    head = row % NUM_HEADS
    o_row = seq * stride_o_seq + tok.to(tl.int64) * stride_o_tok + head.to(tl.int64) * stride_o_head
    tl.store(out_ptr + o_row + offs_r.to(tl.int64) * stride_o_dim,
             result.to(out_ptr.dtype.element_ty), mask=r_ok)
    if WRITE_LSE:
        m_use = tl.where(big_m == float("-inf"), 0.0, big_m)
        lse = tl.where(total > 0.0, (m_use + tl.log2(safe)) * 0.6931471805599453,
                       float("-inf"))  # [1], natural units
        lse_off = (seq * stride_lse_seq + tok.to(tl.int64) * stride_lse_tok
                   + head.to(tl.int64) * stride_lse_head)
        tl.store(lse_ptr + lse_off + tl.arange(0, 1), lse)
