"""Combine of split-KV decode partitions.

Each partition ``p`` of a (sequence, query row) left ``m_p`` (running max, log2 units),
``l_p`` (running sum) and ``o_p = acc_p / l_p`` in the scratch slot
``seq * num_partitions + p``. The output is

    out = sum_p w_p o_p,   w_p = l_p 2^(m_p - M) / sum_q l_q 2^(m_q - M),   M = max_p m_p

over the partitions that exist for this sequence (later ones were never written). A row
whose partitions are all empty (``l_p = 0``) gets zeros.

:func:`merge_partitions` does it for a group of rows; two callers:
- the decode kernel itself (``FUSED_COMBINE``): the last program of each
  (sequence, head group) to finish merges the group's rows, so a split launch is one
  kernel;
- :func:`combine_partitions_kernel`, a second launch over (sequence, row): the
  two-launch form, kept as the baseline and for workspaces without counters.
"""

import triton
import triton.language as tl


@triton.jit
def seq_partitions(num_keys, partition_size, num_partitions, SEQ_SPLIT: tl.constexpr,
                   ALIGN: tl.constexpr):
    """``(part_size, num_parts)`` of one sequence in a split launch of ``num_partitions``
    partitions (the grid's third axis); ``num_parts >= 1`` (partition 0 always runs).
    ``num_keys``: the keys its table can hold, ``min(seq_len, max_blocks * P)``
    (:func:`table_keys`; keys past the table are absent, never walked).

    SEQ_SPLIT=False: fixed partitions of ``partition_size`` tokens (the forced size); a
    sequence with more keys than the grid's partitions hold (a ``max_seq_len`` below its
    length) spreads them over the grid instead, as SEQ_SPLIT does: no key is skipped.
    SEQ_SPLIT=True: the sequence's own length over the grid's partitions, at least
    ``partition_size`` tokens each (the floor), rounded up to ``ALIGN`` (BLOCK_N, so a
    tile never straddles two partitions or, for pages of >= BLOCK_N slots, two pages).
    A short sequence in a grid sized for a long one (a ragged batch, a CUDA graph sized
    for the cache's capacity) then still spreads over several partitions.
    Mirrored on the host by ``ops.decode.tuning.seq_partitions``.
    """
    if SEQ_SPLIT:
        size = tl.maximum(tl.cdiv(num_keys, num_partitions), partition_size)
        size = tl.cdiv(size, ALIGN) * ALIGN
        parts = tl.cdiv(num_keys, size)
    else:
        spread = tl.cdiv(tl.cdiv(num_keys, num_partitions), ALIGN) * ALIGN
        size = tl.where(num_keys > num_partitions * partition_size, spread, partition_size)
        parts = tl.minimum(tl.cdiv(num_keys, size), num_partitions)
    return size, tl.maximum(parts, 1)


@triton.jit
def table_keys(seq_len, max_blocks_per_seq, PAGE_SIZE: tl.constexpr):
    """The keys a sequence's table row can hold: ``min(seq_len, max_blocks * P)``. Keys
    past it are absent, so no program walks them, whatever ``seq_len`` says."""
    return tl.minimum(seq_len.to(tl.int64),
                      max_blocks_per_seq.to(tl.int64) * PAGE_SIZE).to(tl.int32)


@triton.jit
def merge_partitions(out_ptr, max_logits_ptr, exp_sums_ptr, partial_out_ptr,
                     seq, num_parts, num_partitions, num_q_heads, tok0, head0,
                     stride_o_seq, stride_o_tok, stride_o_head, stride_o_dim,
                     stride_ml_slot, stride_ml_row,
                     stride_po_slot, stride_po_row, stride_po_dim,
                     ROWS: tl.constexpr,       # real rows: tokens x heads of the group
                     ROWS_PAD: tl.constexpr,   # next power of two of ROWS
                     HEADS: tl.constexpr,      # heads per token in the group
                     HEAD_DIM: tl.constexpr,
                     HEAD_DIM_PAD: tl.constexpr,
                     PART_CHUNK: tl.constexpr,  # partitions read per step
                     STAGES: tl.constexpr = 1,  # loads in flight (1 when fused: below)
                     lse_ptr=None, stride_lse_seq=0, stride_lse_tok=0, stride_lse_head=0,
                     RETURN_LSE: tl.constexpr = False):
    """Merge partitions ``[0, num_parts)`` of rows ``r < ROWS``: token
    ``tok0 + r // HEADS``, query head ``head0 + r % HEADS``; one pass, online rescale.
    RETURN_LSE: also store each row's ``ln(sum_p l_p 2^m_p)`` (``-inf`` if all empty)."""
    offs_p = tl.arange(0, PART_CHUNK)
    offs_r = tl.arange(0, ROWS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    r_ok = offs_r < ROWS
    d_ok = offs_d < HEAD_DIM
    tok_r = tok0 + offs_r // HEADS  # [ROWS_PAD]
    head_r = head0 + offs_r % HEADS  # [ROWS_PAD]
    srow = tok_r.to(tl.int64) * num_q_heads + head_r  # scratch row = t * Hq + h
    slot0 = seq * num_partitions

    big_m = tl.full([ROWS_PAD], float("-inf"), dtype=tl.float32)
    total = tl.zeros([ROWS_PAD], dtype=tl.float32)
    acc = tl.zeros([ROWS_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    # fused into decode: one stage (a pipelined loop would hold a shared-memory ring of o
    # tiles for the whole kernel, which costs occupancy in the KV loop); the combine
    # kernel alone may pipeline 
    for c in tl.range(0, num_parts, PART_CHUNK, num_stages=STAGES):
        p_ok = (c + offs_p) < num_parts
        slots = slot0 + c + offs_p  # [PART_CHUNK]
        ok = p_ok[:, None] & r_ok[None, :]  # [PART_CHUNK, ROWS_PAD]
        ml_offs = slots[:, None] * stride_ml_slot + srow[None, :] * stride_ml_row
        m = tl.load(max_logits_ptr + ml_offs, mask=ok, other=float("-inf"))
        l = tl.load(exp_sums_ptr + ml_offs, mask=ok, other=0.0)
        o = tl.load(partial_out_ptr + slots[:, None, None] * stride_po_slot
                    + srow[None, :, None] * stride_po_row
                    + offs_d[None, None, :].to(tl.int64) * stride_po_dim,
                    mask=ok[:, :, None] & d_ok[None, None, :], other=0.0)
        # o: [PART_CHUNK, ROWS_PAD, HEAD_DIM_PAD]
        m_new = tl.maximum(big_m, tl.max(m, 0))  # [ROWS_PAD]
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(big_m - m_ref)
        w = tl.where(l > 0.0, l * tl.exp2(m - m_ref[None, :]), 0.0)  # [PART_CHUNK, ROWS_PAD]
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0)
        total = total * alpha + tl.sum(w, 0)
        big_m = m_new
    if RETURN_LSE:
        lse = tl.where(total > 0.0, (big_m + tl.log2(tl.where(total > 0.0, total, 1.0)))
                       * 0.6931471805599453, float("-inf"))  # [ROWS_PAD] natural log
        tl.store(lse_ptr + seq * stride_lse_seq + tok_r.to(tl.int64) * stride_lse_tok
                 + head_r.to(tl.int64) * stride_lse_head, lse, mask=r_ok)
    if num_parts == 1:
        # one partition holds every key: its partial (acc / l, as the unsplit launch
        # computes it) is the answer, taken as it is ((l * o) / l may round off o), so a
        # split launch of a short sequence (a CUDA graph sized for the cache) gives the
        # unsplit launch's bits
        result = tl.load(partial_out_ptr + slot0 * stride_po_slot
                         + srow[:, None] * stride_po_row
                         + offs_d[None, :].to(tl.int64) * stride_po_dim,
                         mask=r_ok[:, None] & d_ok[None, :], other=0.0)
    else:
        result = acc / tl.where(total > 0.0, total, 1.0)[:, None]  # [ROWS_PAD, HEAD_DIM_PAD]
    o_offs = (seq * stride_o_seq + tok_r[:, None].to(tl.int64) * stride_o_tok
              + head_r[:, None].to(tl.int64) * stride_o_head
              + offs_d[None, :].to(tl.int64) * stride_o_dim)
    tl.store(out_ptr + o_offs, result.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & d_ok[None, :])


@triton.jit(do_not_specialize=["max_blocks_per_seq", "partition_size", "num_partitions"])
def combine_partitions_kernel(
    out_ptr, max_logits_ptr, exp_sums_ptr, partial_out_ptr, seq_lens_ptr,
    max_blocks_per_seq, partition_size, num_partitions, num_q_heads,
    stride_o_seq, stride_o_tok, stride_o_head, stride_o_dim,
    stride_ml_slot, stride_ml_row,
    stride_po_slot, stride_po_row, stride_po_dim,
    lse_ptr, stride_lse_seq, stride_lse_tok, stride_lse_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PART_CHUNK: tl.constexpr,  # partitions read per step
    SEQ_SPLIT: tl.constexpr,   # the decode launch's partitioning (seq_partitions)
    ALIGN: tl.constexpr,
    PAGE_SIZE: tl.constexpr,   # the decode launch's (table_keys)
    STAGES: tl.constexpr = 1,  # loads of partition chunks in flight
    WAIT_PRIOR: tl.constexpr = False,  # launched early (sm_90 PDL): wait for the decode grid
    RETURN_LSE: tl.constexpr = False,  # also write each row's log-sum-exp (natural log)
):
    seq = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1)  # t * num_q_heads + h
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    _, parts = seq_partitions(table_keys(seq_len, max_blocks_per_seq, PAGE_SIZE),
                              partition_size, num_partitions, SEQ_SPLIT, ALIGN)
    if WAIT_PRIOR:
        # every write of the decode grid before it is visible after this (griddepcontrol)
        tl.extra.cuda.gdc_wait()
    merge_partitions(out_ptr, max_logits_ptr, exp_sums_ptr, partial_out_ptr,
                     seq, parts, num_partitions, num_q_heads,
                     row // num_q_heads, row % num_q_heads,
                     stride_o_seq, stride_o_tok, stride_o_head, stride_o_dim,
                     stride_ml_slot, stride_ml_row, stride_po_slot, stride_po_row,
                     stride_po_dim, ROWS=1, ROWS_PAD=1, HEADS=1, HEAD_DIM=HEAD_DIM,
                     HEAD_DIM_PAD=HEAD_DIM_PAD, PART_CHUNK=PART_CHUNK, STAGES=STAGES,
                     lse_ptr=lse_ptr, stride_lse_seq=stride_lse_seq,
                     stride_lse_tok=stride_lse_tok, stride_lse_head=stride_lse_head,
                     RETURN_LSE=RETURN_LSE)
