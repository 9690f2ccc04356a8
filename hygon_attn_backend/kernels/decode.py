"""Paged decode attention with a KV-head grid (the DCU ``REUSE_KV_TIMES`` idea).

Grid ``(num_kv_heads, num_seqs, num_partitions)`` with ``HEADS_PER_PROG = GROUP``: one
program loads each K/V tile of its KV head once and computes every query head of the
GQA group (and every speculative token of the sequence) against it. The rows of the
group are padded to ``BLOCK_M >= 16`` so both dots run on the tensor cores.

The same kernel with ``HEADS_PER_PROG = 1`` and grid ``(num_q_heads, ...)`` is the
per-query-head variant (one program per query head, re-reading the KV of its group G
times); it is kept as a benchmark baseline.

Row ``r`` of the M tile is token ``t = r // HEADS_PER_PROG`` of the sequence and query
head ``head0 + r % HEADS_PER_PROG``; token ``t`` sits at position
``seq_len - NUM_TOKENS + t`` and sees keys ``j <= seq_len - NUM_TOKENS + t``; with ``TREE``
(speculative verify of a draft tree) it sees the keys before the drafts and the drafts its
row of the packed tree mask names (``kernels/tree_mask.py``).

SPLIT=False: the program covers the whole sequence and writes the output.
SPLIT=True: it covers ``[part * size, (part + 1) * size)`` (``kernels/combine.py:
seq_partitions``: ``size`` = ``partition_size``, or with SEQ_SPLIT the sequence's own
length over the grid's partitions, ``partition_size`` the floor) and
writes ``(m, l, acc / l)`` to the scratch slot ``seq * num_partitions + part``;
(RETURN_LSE: each row's log-sum-exp ``ln(sum_j exp(s_j))`` too, written by whoever writes
the output: the one-partition program or the merge; ``-inf`` for a row that saw no key);
partitions that start past the sequence's keys exit at once. No program walks past the
table's capacity ``max_blocks_per_seq * PAGE_SIZE`` (``table_keys``: keys there are
absent), so a wild ``seq_len`` costs no more than the table; a sequence with more keys than
the grid's fixed partitions hold (a ``max_seq_len`` below its length) spreads them over
the grid (``seq_partitions``), so none is skipped. Then either a second launch merges
the partitions (``kernels/combine.py``), or, with FUSED_COMBINE, the kernel does: each
program bumps the counter of its (sequence, head group) after its scratch is written; the
one that sees ``num_parts - 1`` (the last to finish) resets the counter to 0 for the next
launch and merges the group's rows (``merge_partitions``). Partition 0 always runs, so a
sequence of length 0 still gets its (zero) output written.
"""

import triton
import triton.language as tl

from hygon_attn_backend.kernels.combine import merge_partitions, seq_partitions, table_keys
from hygon_attn_backend.kernels.fp8 import WIDEN_NONE, fp16_query, widen_kv
from hygon_attn_backend.kernels.paged_kv import lookup_tile_pages, tile_row_offsets
from hygon_attn_backend.kernels.softmax import online_softmax_step, soft_cap_log2
from hygon_attn_backend.kernels.tree_mask import tree_visibility


@triton.jit(do_not_specialize=["scale", "k_scale_value", "v_scale_value",
                               "soft_cap", "sliding_window", "num_blocks",
                               "max_blocks_per_seq", "partition_size", "num_partitions"])
def paged_decode_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, block_table_ptr, seq_lens_ptr, sinks_ptr,
    k_scale_ptr, v_scale_ptr, max_logits_ptr, exp_sums_ptr, partial_out_ptr, counters_ptr,
    tree_ptr, scale, k_scale_value, v_scale_value, k_scale_stride, v_scale_stride, soft_cap,
    sliding_window,
    num_blocks, max_blocks_per_seq, partition_size, num_partitions, num_q_heads,
    stride_q_seq, stride_q_tok, stride_q_head, stride_q_dim,
    stride_o_seq, stride_o_tok, stride_o_head, stride_o_dim,
    stride_k_block, stride_k_head, stride_k_slot, stride_k_dim, stride_k_chunk,
    stride_v_block, stride_v_head, stride_v_slot, stride_v_dim,
    stride_bt_seq, stride_bt_block,
    stride_ml_slot, stride_ml_row,
    stride_po_slot, stride_po_row, stride_po_dim,
    stride_tree, tree_words,
    lse_ptr, stride_lse_seq, stride_lse_tok, stride_lse_head,
    GROUP: tl.constexpr,            # query heads per KV head
    HEADS_PER_PROG: tl.constexpr,   # GROUP (KV-head grid) or 1 (per-query-head grid)
    NUM_TOKENS: tl.constexpr,       # query tokens per sequence (speculative decode)
    BLOCK_M: tl.constexpr,          # >= 16, >= NUM_TOKENS * HEADS_PER_PROG
    BLOCK_N: tl.constexpr,          # tokens per KV tile
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,     # next power of two of HEAD_DIM
    PAGE_SIZE: tl.constexpr,
    K_SPLIT_X: tl.constexpr,        # 0: 4-D K view; x: 5-D split-x K [N, H, D//x, P, x]
    SPLIT: tl.constexpr,
    SEQ_SPLIT: tl.constexpr,        # SPLIT: each sequence's length over the partitions
    SCALES_FROM_PTR: tl.constexpr,  # k/v scales are 1-element tensors (no host sync)
    USE_SOFT_CAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SINKS: tl.constexpr,
    PAGE_PREFETCH: tl.constexpr,    # read the next tile's block ids one iteration ahead
    FUSED_COMBINE: tl.constexpr,    # SPLIT only: the last program of a group merges it
    COMBINE_ROWS_PAD: tl.constexpr,  # next power of two of NUM_TOKENS * HEADS_PER_PROG
    COMBINE_CHUNK: tl.constexpr,    # partitions the merge reads per step
    LAUNCH_DEPENDENTS: tl.constexpr = False,  # let the combine launch start (sm_90 PDL)
    TREE: tl.constexpr = False,     # NUM_TOKENS drafts under a packed tree mask
    KV_WIDEN: tl.constexpr = 0,     # kernels/fp8.py: fp8 caches widen to fp16, fp16 dots
    RETURN_LSE: tl.constexpr = False,  # also write each row's log-sum-exp (natural log)
):
    if LAUNCH_DEPENDENTS:
        # programmatic dependent launch: the combine grid may be scheduled once every
        # program of this grid has started; it waits for this grid's writes (gdc_wait)
        tl.extra.cuda.gdc_launch_dependents()
    head_prog = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    part = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    # the walk ends at the table's capacity whatever seq_len says (keys past it are
    # absent); the query positions still follow seq_len
    key_end = table_keys(seq_len, max_blocks_per_seq, PAGE_SIZE)
    if SPLIT:
        part_size, num_parts = seq_partitions(key_end, partition_size, num_partitions,
                                              SEQ_SPLIT, BLOCK_N)
        if part >= num_parts:
            return
    else:
        part_size = partition_size
    part_start = part * part_size
    part_end = tl.minimum(part_start + part_size, key_end)

    head0 = head_prog * HEADS_PER_PROG
    kv_head = (head0 // GROUP).to(tl.int64)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    tok_m = offs_m // HEADS_PER_PROG  # [BLOCK_M] token of each row
    head_m = head0 + offs_m % HEADS_PER_PROG  # [BLOCK_M] query head of each row
    row_ok = offs_m < NUM_TOKENS * HEADS_PER_PROG
    d_ok = offs_d < HEAD_DIM

    q_offs = (seq * stride_q_seq + tok_m[:, None].to(tl.int64) * stride_q_tok
              + head_m[:, None].to(tl.int64) * stride_q_head
              + offs_d[None, :].to(tl.int64) * stride_q_dim)
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    # q: [BLOCK_M, HEAD_DIM_PAD]

    if SCALES_FROM_PTR:
        # per tensor (stride 0) or per KV head (stride 1)
        k_scale = tl.load(k_scale_ptr + kv_head * k_scale_stride).to(tl.float32)
        v_scale = tl.load(v_scale_ptr + kv_head * v_scale_stride).to(tl.float32)
    else:
        k_scale = k_scale_value
        v_scale = v_scale_value
    if KV_WIDEN != WIDEN_NONE:
        # fp8 KV: both dots in fp16 (kernels/fp8.py); the query's power-of-two range
        # scale folds into the logit scale
        q, q_up = fp16_query(q)
        k_scale = k_scale * q_up
    sm_scale = scale * k_scale  # natural units, K's dequant scale folded in
    qk_scale = sm_scale * 1.4426950408889634  # log2(e), for exp2

    # last key position each row may see (causal rule of speculative tokens)
    pos_m = seq_len - NUM_TOKENS + tok_m  # [BLOCK_M]
    # TREE: [BLOCK_M] each row's packed mask words (row seq * NUM_TOKENS + token; padding
    # rows read the sequence's first token's)
    tree_rows = tree_ptr + (seq * NUM_TOKENS + tl.where(row_ok, tok_m, 0)) * stride_tree

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    if USE_SINKS:
        # a sink is one extra key with value 0 and logit sinks[h]: start the state from it
        # (partition 0 only, so the combine counts it once)
        sink = tl.load(sinks_ptr + head_m, mask=row_ok, other=float("-inf")).to(tl.float32)
        has_sink = row_ok & (part == 0)
        m_i = tl.where(has_sink, sink * 1.4426950408889634, m_i)
        l_i = tl.where(has_sink, 1.0, l_i)

    loop_start = part_start
    if USE_WINDOW:
        # keys before the earliest visible one of the first token are skipped whole tiles
        first_key = tl.maximum(seq_len - NUM_TOKENS - sliding_window + 1, 0)
        loop_start = tl.maximum(part_start, (first_key // BLOCK_N) * BLOCK_N)

    d_off_k = offs_d.to(tl.int64) * stride_k_dim
    if K_SPLIT_X > 0:
        d_off_k = ((offs_d // K_SPLIT_X).to(tl.int64) * stride_k_chunk
                   + (offs_d % K_SPLIT_X).to(tl.int64) * stride_k_dim)
    d_off_v = offs_d.to(tl.int64) * stride_v_dim
    k_head_ptr = k_ptr + kv_head * stride_k_head
    v_head_ptr = v_ptr + kv_head * stride_v_head
    bt_row_ptr = block_table_ptr + seq * stride_bt_seq

    # the causal / tree mask bites only in the tiles holding the drafts (the last
    # NUM_TOKENS keys): the loop before them runs unmasked (``MASKED=False``), the draft
    # tiles after it (usually one) read the mask; a sequence shorter than its drafts
    # (bad input) masks every tile
    if TREE or NUM_TOKENS > 1:
        draft_tile = (tl.maximum(seq_len - NUM_TOKENS, 0) // BLOCK_N) * BLOCK_N
        main_end = tl.minimum(part_end, tl.maximum(loop_start, draft_tile))
    else:
        main_end = part_end

    page_next = lookup_tile_pages(bt_row_ptr, stride_bt_block, loop_start, offs_n,
                                  max_blocks_per_seq, num_blocks, PAGE_SIZE, BLOCK_N)
    for masked in tl.static_range(2):  # compile-time: the unmasked loop, then the draft tiles
        for start in range(loop_start if masked == 0 else main_end,
                           main_end if masked == 0 else part_end, BLOCK_N):
            m_i, l_i, acc, page_next = _attend_tile(
                q, m_i, l_i, acc, page_next, start, part_end, seq_len, pos_m, tree_rows,
                tree_words, offs_m, offs_n, d_ok, d_off_k, d_off_v, k_head_ptr, v_head_ptr,
                bt_row_ptr, stride_bt_block, stride_k_block, stride_k_slot, stride_v_block,
                stride_v_slot, max_blocks_per_seq, num_blocks, sm_scale, qk_scale, soft_cap,
                sliding_window, NUM_TOKENS=NUM_TOKENS, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
                HEAD_DIM_PAD=HEAD_DIM_PAD, PAGE_SIZE=PAGE_SIZE, PAGE_PREFETCH=PAGE_PREFETCH,
                USE_SOFT_CAP=USE_SOFT_CAP, USE_WINDOW=USE_WINDOW, TREE=TREE,
                MASKED=masked == 1, KV_WIDEN=KV_WIDEN)

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    result = acc * (v_scale / l_safe)[:, None]  # [BLOCK_M, HEAD_DIM_PAD]
    if SPLIT:
        row = tok_m.to(tl.int64) * num_q_heads + head_m  # scratch row = t * Hq + h
        slot_id = seq * num_partitions + part
        tl.store(max_logits_ptr + slot_id * stride_ml_slot + row * stride_ml_row, m_i,
                 mask=row_ok)
        tl.store(exp_sums_ptr + slot_id * stride_ml_slot + row * stride_ml_row, l_i,
                 mask=row_ok)
        po_offs = (slot_id * stride_po_slot + row[:, None] * stride_po_row
                   + offs_d[None, :].to(tl.int64) * stride_po_dim)
        tl.store(partial_out_ptr + po_offs, result, mask=row_ok[:, None] & d_ok[None, :])
        if FUSED_COMBINE:
            # every thread's scratch stores precede the counter bump (CTA barrier, then a
            # gpu-scope acq_rel atomic); the last program's reads follow its acquire
            tl.debug_barrier()
            counter = counters_ptr + seq * tl.num_programs(0) + head_prog
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == num_parts - 1:
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
                merge_partitions(out_ptr, max_logits_ptr, exp_sums_ptr, partial_out_ptr,
                                 seq, num_parts, num_partitions, num_q_heads, 0, head0,
                                 stride_o_seq, stride_o_tok, stride_o_head, stride_o_dim,
                                 stride_ml_slot, stride_ml_row,
                                 stride_po_slot, stride_po_row, stride_po_dim,
                                 ROWS=NUM_TOKENS * HEADS_PER_PROG, ROWS_PAD=COMBINE_ROWS_PAD,
                                 HEADS=HEADS_PER_PROG, HEAD_DIM=HEAD_DIM,
                                 HEAD_DIM_PAD=HEAD_DIM_PAD, PART_CHUNK=COMBINE_CHUNK,
                                 lse_ptr=lse_ptr, stride_lse_seq=stride_lse_seq,
                                 stride_lse_tok=stride_lse_tok,
                                 stride_lse_head=stride_lse_head, RETURN_LSE=RETURN_LSE)
    else:
        o_offs = (seq * stride_o_seq + tok_m[:, None].to(tl.int64) * stride_o_tok
                  + head_m[:, None].to(tl.int64) * stride_o_head
                  + offs_d[None, :].to(tl.int64) * stride_o_dim)
        tl.store(out_ptr + o_offs, result.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & d_ok[None, :])
        if RETURN_LSE:  # rows that saw no key: -inf (m_i is in log2 units)
            lse = tl.where(l_i > 0.0, (m_i + tl.log2(l_safe)) * 0.6931471805599453,
                           float("-inf"))
            tl.store(lse_ptr + seq * stride_lse_seq + tok_m.to(tl.int64) * stride_lse_tok
                     + head_m.to(tl.int64) * stride_lse_head, lse, mask=row_ok)


@triton.jit
def _attend_tile(q, m_i, l_i, acc, page_next, start, part_end, seq_len, pos_m, tree_rows,
                 tree_words, offs_m, offs_n, d_ok, d_off_k, d_off_v, k_head_ptr, v_head_ptr,
                 bt_row_ptr, stride_bt_block, stride_k_block, stride_k_slot, stride_v_block,
                 stride_v_slot, max_blocks_per_seq, num_blocks, sm_scale, qk_scale, soft_cap,
                 sliding_window, NUM_TOKENS: tl.constexpr, BLOCK_N: tl.constexpr,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, PAGE_SIZE: tl.constexpr,
                 PAGE_PREFETCH: tl.constexpr, USE_SOFT_CAP: tl.constexpr,
                 USE_WINDOW: tl.constexpr, TREE: tl.constexpr, MASKED: tl.constexpr,
                 KV_WIDEN: tl.constexpr):
    """One KV tile ``[start, start + BLOCK_N)`` into the online softmax state ``(m_i [BLOCK_M],
    l_i [BLOCK_M], acc [BLOCK_M, HEAD_DIM_PAD])``. ``page_next``: the tile's block ids when
    PAGE_PREFETCH (returned: the next tile's, read here so their latency overlaps this
    tile's loads), else unused (the tile reads its own). MASKED: apply the speculative
    tokens' causal rule or the tree mask (only tiles holding drafts need it)."""
    offs_tok = start + offs_n  # [BLOCK_N]
    if PAGE_PREFETCH:
        page = page_next
        page_next = lookup_tile_pages(bt_row_ptr, stride_bt_block, start + BLOCK_N, offs_n,
                                      max_blocks_per_seq, num_blocks, PAGE_SIZE, BLOCK_N)
    else:
        page = lookup_tile_pages(bt_row_ptr, stride_bt_block, start, offs_n,
                                 max_blocks_per_seq, num_blocks, PAGE_SIZE, BLOCK_N)
    if PAGE_SIZE % BLOCK_N == 0:
        # one page for the whole tile (page is a scalar); a bad id masks every token
        tok_ok = offs_tok < tl.where(page >= 0, part_end, start)
    else:
        tok_ok = (offs_tok < part_end) & (page >= 0)
    # addresses from the clamped id: never a wild pointer, even in a masked lane
    tok_off_k = tile_row_offsets(page, start, offs_n, stride_k_block, stride_k_slot,
                                 PAGE_SIZE, BLOCK_N)  # [BLOCK_N]
    tok_off_v = tile_row_offsets(page, start, offs_n, stride_v_block, stride_v_slot,
                                 PAGE_SIZE, BLOCK_N)  # [BLOCK_N]

    if HEAD_DIM == HEAD_DIM_PAD:
        k_mask = tok_ok[None, :]  # no mask along D: keeps 16-byte loads
        v_mask = tok_ok[:, None]
    else:
        k_mask = tok_ok[None, :] & d_ok[:, None]
        v_mask = tok_ok[:, None] & d_ok[None, :]
    k = tl.load(k_head_ptr + tok_off_k[None, :] + d_off_k[:, None], mask=k_mask, other=0.0)
    # k: [HEAD_DIM_PAD, BLOCK_N] (K^T)
    if KV_WIDEN != WIDEN_NONE:
        k = widen_kv(k, KV_WIDEN)
    qk = tl.dot(q, k.to(q.dtype))  # [BLOCK_M, BLOCK_N] fp32
    if USE_SOFT_CAP:
        s = soft_cap_log2(qk * sm_scale, soft_cap)
    else:
        s = qk * qk_scale
    visible = tok_ok[None, :] & (offs_m >= 0)[:, None]  # [BLOCK_M, BLOCK_N]
    if MASKED:
        if TREE:  # the drafts are the last NUM_TOKENS keys
            visible = visible & tree_visibility(
                tree_rows, offs_tok - (seq_len - NUM_TOKENS), tree_words)
        else:
            visible = visible & (offs_tok[None, :] <= pos_m[:, None])
    if USE_WINDOW:
        visible = visible & (offs_tok[None, :] > pos_m[:, None] - sliding_window)
    s = tl.where(visible, s, float("-inf"))

    p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
    v = tl.load(v_head_ptr + tok_off_v[:, None] + d_off_v[None, :], mask=v_mask, other=0.0)
    # v: [BLOCK_N, HEAD_DIM_PAD]
    if KV_WIDEN != WIDEN_NONE:
        v = widen_kv(v, KV_WIDEN)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_i, l_i, acc, page_next
