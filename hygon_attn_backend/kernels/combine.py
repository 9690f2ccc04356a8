"""Combine of split-KV decode partitions.

Each partition ``p`` of a (sequence, query row) left ``m_p`` (running max, log2 units),
``l_p`` (running sum) and ``o_p = acc_p / l_p`` in the scratch slot
``seq * num_partitions + p``. The output is

    out = sum_p w_p o_p,   w_p = l_p 2^(m_p - M) / sum_q l_q 2^(m_q - M),   M = max_p m_p

over the partitions that exist for this sequence, ``cdiv(seq_len, partition_size)``
(later ones were never written). A sequence of length 0 gets zeros.
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["partition_size", "num_partitions"])
def combine_partitions_kernel(
    out_ptr, max_logits_ptr, exp_sums_ptr, partial_out_ptr, seq_lens_ptr,
    partition_size, num_partitions, num_q_heads,
    stride_o_seq, stride_o_tok, stride_o_head, stride_o_dim,
    stride_ml_slot, stride_ml_row,
    stride_po_slot, stride_po_row, stride_po_dim,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PART_CHUNK: tl.constexpr,  # partitions read per step
):
    seq = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1).to(tl.int64)  # t * num_q_heads + h
    tok = row // num_q_heads
    head = row % num_q_heads

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    parts = tl.minimum(tl.cdiv(seq_len, partition_size), num_partitions)
    offs_p = tl.arange(0, PART_CHUNK)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_ok = offs_d < HEAD_DIM
    slot0 = seq * num_partitions
    ml_row_ptr = row * stride_ml_row

    # pass 1: the global max M
    m_max = tl.full([PART_CHUNK], float("-inf"), dtype=tl.float32)
    for c in range(0, parts, PART_CHUNK):
        p_ok = (c + offs_p) < parts
        slots = slot0 + c + offs_p  # [PART_CHUNK]
        m = tl.load(max_logits_ptr + slots * stride_ml_slot + ml_row_ptr, mask=p_ok,
                    other=float("-inf"))
        m_max = tl.maximum(m_max, m)
    big_m = tl.max(m_max, 0)
    big_m = tl.where(big_m == float("-inf"), 0.0, big_m)

    # pass 2: weights and the weighted sum of partial outputs
    w_sum = tl.zeros([PART_CHUNK], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
    for c in range(0, parts, PART_CHUNK):
        p_ok = (c + offs_p) < parts
        slots = slot0 + c + offs_p  # [PART_CHUNK]
        m = tl.load(max_logits_ptr + slots * stride_ml_slot + ml_row_ptr, mask=p_ok,
                    other=float("-inf"))
        l = tl.load(exp_sums_ptr + slots * stride_ml_slot + ml_row_ptr, mask=p_ok, other=0.0)
        w = tl.where(l > 0.0, l * tl.exp2(m - big_m), 0.0)  # [PART_CHUNK]
        o = tl.load(partial_out_ptr + slots[:, None] * stride_po_slot + row * stride_po_row
                    + offs_d[None, :].to(tl.int64) * stride_po_dim,
                    mask=p_ok[:, None] & d_ok[None, :], other=0.0)
        # o: [PART_CHUNK, HEAD_DIM_PAD]
        acc += tl.sum(w[:, None] * o, 0)
        w_sum += w
    total = tl.sum(w_sum, 0)
    total = tl.where(total > 0.0, total, 1.0)
    result = acc / total  # [HEAD_DIM_PAD]
    o_offs = (seq * stride_o_seq + tok * stride_o_tok + head * stride_o_head
              + offs_d.to(tl.int64) * stride_o_dim)
    tl.store(out_ptr + o_offs, result.to(out_ptr.dtype.element_ty), mask=d_ok)
