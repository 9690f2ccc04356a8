"""The Triton paged decode's launches: a layer's fixed arguments, the decode and combine
launches of a plan (built once per launch variant), and the per-call launch.

Kernels: ``kernels/decode.py`` (``paged_decode_kernel``), ``kernels/combine.py``
(``combine_partitions_kernel``). Arguments arrive validated; the config comes from
``tuning.choose``.
"""

from __future__ import annotations

import torch

from hygon_attn_backend.ops import _checks, tree_mask
from hygon_attn_backend.ops._device import next_pow2
from hygon_attn_backend.ops._launch import NO_LAYER, LayerArgs, Launch
from hygon_attn_backend.ops.decode import tuning

# Arguments of paged_decode_kernel that change per layer, in the order a plan passes them.
#: what a layer binding supplies (its ``args``), in order
DECODE_PER_LAYER = (
    "k_ptr", "v_ptr", "sinks_ptr", "k_scale_ptr", "v_scale_ptr",
    "k_scale_value", "v_scale_value", "k_scale_stride", "v_scale_stride", "num_blocks",
    "stride_k_block", "stride_k_head", "stride_k_slot", "stride_k_dim", "stride_k_chunk",
    "stride_v_block", "stride_v_head", "stride_v_slot", "stride_v_dim")
#: what each call supplies
DECODE_PER_CALL = (
    "out_ptr", "q_ptr", "stride_q_seq", "stride_q_tok", "stride_q_head", "stride_q_dim",
    "stride_o_seq", "stride_o_tok", "stride_o_head", "stride_o_dim")
COMBINE_PER_CALL = ("out_ptr", "stride_o_seq", "stride_o_tok", "stride_o_head", "stride_o_dim")
#: what each call of a plan that returns the log-sum-exp supplies besides (the LSE buffer
#: after the tensors, its strides after the scalars)
LSE_PER_CALL = ("lse_ptr",), ("stride_lse_seq", "stride_lse_tok", "stride_lse_head")
#: the LSE arguments of a plan that does not return it (never read)
NO_LSE = dict(stride_lse_seq=0, stride_lse_tok=0, stride_lse_head=0)


def _with_lse(per_call):
    """``per_call`` with the LSE buffer after its tensors and its strides at the end."""
    tensors = tuple(n for n in per_call if n.endswith("_ptr"))
    return tensors + LSE_PER_CALL[0] + tuple(per_call[len(tensors):]) + LSE_PER_CALL[1]


def layer_args(k_cache: torch.Tensor, v_cache: torch.Tensor, sinks, k_scale_ptr, v_scale_ptr,
               k_scale_value: float, v_scale_value: float) -> LayerArgs:
    """One layer's launch arguments (``DECODE_PER_LAYER``); absent sinks / scale pointers:
    the K cache stands in (never read). A scale tensor of more than one element is read
    per KV head."""
    ks_ = k_cache.stride()
    if len(ks_) == 4:  # [N, H, P, D]; the split-x 5-D K is [N, H, D // x, P, x]
        ks_ = (ks_[0], ks_[1], ks_[2], ks_[3], 0)
    else:
        ks_ = (ks_[0], ks_[1], ks_[3], ks_[4], ks_[2])
    return LayerArgs(
        (k_cache, v_cache, k_cache if sinks is None else sinks,
         k_cache if k_scale_ptr is None else k_scale_ptr,
         k_cache if v_scale_ptr is None else v_scale_ptr),
        (k_scale_value, v_scale_value, _checks.scale_head_stride(k_scale_ptr),
         _checks.scale_head_stride(v_scale_ptr), v_cache.shape[0], *ks_, *v_cache.stride()))


def make_launches(plan, k_ndim, scales_from_ptr, use_sinks, sliding_window, soft_cap, scale):
    """``(decode, combine or None)`` launches of ``plan`` for one layer variant."""
    from hygon_attn_backend.kernels.combine import combine_partitions_kernel
    from hygon_attn_backend.kernels.decode import paged_decode_kernel
    from hygon_attn_backend.kernels.fp8 import WIDEN_CODES

    cfg = plan.config
    split = plan.split
    group = plan.num_q_heads // plan.num_kv_heads
    heads_per_prog = group if plan.kv_head_grid else 1
    head_dim_pad = next_pow2(max(plan.head_dim, 16))
    ws = plan.workspace
    fused = split and plan.fused_combine
    rows_pad = next_pow2(plan.num_tokens * heads_per_prog)
    if split:
        scratch = dict(max_logits_ptr=ws.max_logits, exp_sums_ptr=ws.exp_sums,
                       partial_out_ptr=ws.partial_out,
                       counters_ptr=ws.counters if fused else plan.seq_lens,
                       stride_ml_slot=ws.max_logits.stride(0),
                       stride_ml_row=ws.max_logits.stride(1),
                       stride_po_slot=ws.partial_out.stride(0),
                       stride_po_row=ws.partial_out.stride(1),
                       stride_po_dim=ws.partial_out.stride(2))
    else:  # scratch pointers are unused by the one-partition launch
        scratch = dict(max_logits_ptr=plan.seq_lens, exp_sums_ptr=plan.seq_lens,
                       partial_out_ptr=plan.seq_lens, counters_ptr=plan.seq_lens,
                       stride_ml_slot=0, stride_ml_row=0,
                       stride_po_slot=0, stride_po_row=0, stride_po_dim=1)
    split_x = 16 // plan.kv_dtype.itemsize if k_ndim == 5 else 0
    fixed = dict(
        **tree_mask.launch_args(plan.tree_mask, plan.seq_lens),
        block_table_ptr=plan.block_table, seq_lens_ptr=plan.seq_lens,
        scale=float(scale),
        soft_cap=float(soft_cap) if soft_cap is not None else 1.0,
        sliding_window=int(sliding_window) if sliding_window is not None else 0,
        max_blocks_per_seq=plan.block_table.shape[1],
        partition_size=tuning.kernel_partition_size(cfg),
        num_partitions=cfg.num_partitions, num_q_heads=plan.num_q_heads,
        stride_bt_seq=plan.block_table.stride(0),
        stride_bt_block=plan.block_table.stride(1),
        GROUP=group, HEADS_PER_PROG=heads_per_prog, NUM_TOKENS=plan.num_tokens,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=plan.head_dim,
        HEAD_DIM_PAD=head_dim_pad, PAGE_SIZE=plan.page_size, K_SPLIT_X=split_x,
        SPLIT=split, SEQ_SPLIT=cfg.seq_split, SCALES_FROM_PTR=scales_from_ptr,
        USE_SOFT_CAP=soft_cap is not None, USE_WINDOW=sliding_window is not None,
        USE_SINKS=use_sinks, PAGE_PREFETCH=cfg.page_prefetch, FUSED_COMBINE=fused,
        COMBINE_ROWS_PAD=rows_pad,
        COMBINE_CHUNK=tuning.combine_chunk(rows_pad=rows_pad, head_dim_pad=head_dim_pad,
                                           num_warps=cfg.num_warps),
        LAUNCH_DEPENDENTS=plan.pdl,
        KV_WIDEN=WIDEN_CODES[tuning.kv_widen(kv_dtype=plan.kv_dtype,
                                             device=plan.device)],
        **scratch)
    lse = plan.return_lse
    # the LSE is written by whoever writes the output: the one-partition or fused decode,
    # or the combine launch
    decode_lse = lse and (not split or fused)
    fixed.update(RETURN_LSE=decode_lse, **({} if decode_lse else
                                           dict(NO_LSE, lse_ptr=plan.seq_lens)))
    grid = (plan.num_q_heads // heads_per_prog, plan.num_seqs, cfg.num_partitions)
    decode = Launch(paged_decode_kernel, grid, fixed,
                    _with_lse(DECODE_PER_CALL) if decode_lse else DECODE_PER_CALL,
                    per_layer=DECODE_PER_LAYER, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages)
    combine = None
    if split and not fused:
        rows = plan.num_tokens * plan.num_q_heads
        combine_warps = 4
        cfixed = dict(
            max_logits_ptr=ws.max_logits, exp_sums_ptr=ws.exp_sums,
            partial_out_ptr=ws.partial_out, seq_lens_ptr=plan.seq_lens,
            max_blocks_per_seq=plan.block_table.shape[1],
            partition_size=tuning.kernel_partition_size(cfg),
            num_partitions=cfg.num_partitions,
            num_q_heads=plan.num_q_heads,
            stride_ml_slot=ws.max_logits.stride(0), stride_ml_row=ws.max_logits.stride(1),
            stride_po_slot=ws.partial_out.stride(0), stride_po_row=ws.partial_out.stride(1),
            stride_po_dim=ws.partial_out.stride(2),
            HEAD_DIM=plan.head_dim, HEAD_DIM_PAD=head_dim_pad,
            PART_CHUNK=tuning.combine_chunk(rows_pad=1, head_dim_pad=head_dim_pad,
                                            num_warps=combine_warps, fused=False),
            SEQ_SPLIT=cfg.seq_split, ALIGN=cfg.block_n, PAGE_SIZE=plan.page_size, STAGES=1,
            WAIT_PRIOR=plan.pdl, RETURN_LSE=lse,
            **({} if lse else dict(NO_LSE, lse_ptr=plan.seq_lens)))
        combine = Launch(combine_partitions_kernel, (plan.num_seqs, rows, 1), cfixed,
                         _with_lse(COMBINE_PER_CALL) if lse else COMBINE_PER_CALL,
                         num_warps=combine_warps, num_stages=1,
                         launch_pdl=plan.pdl)
    return decode, combine


def run(launches, layer_args: LayerArgs, q: torch.Tensor, out: torch.Tensor,
        lse=None) -> None:
    """One layer's call: ``q``/``out`` ``[S, Hq, D]`` or ``[S, T, Hq, D]``; ``lse``
    ``[S, Hq]`` / ``[S, T, Hq]`` float32 when the plan returns it (else None)."""
    decode, combine = launches
    qs = q.stride()
    os_ = out.stride()
    if len(qs) == 3:  # one token per sequence: no token axis
        qs = (qs[0], 0, qs[1], qs[2])
        os_ = (os_[0], 0, os_[1], os_[2])
    if lse is None:
        decode(layer_args, out, q, *qs, *os_)
        if combine is not None:
            combine(NO_LAYER, out, *os_)
        return
    ls = lse.stride()
    ls = (ls[0], 0, ls[1]) if len(ls) == 2 else ls
    if combine is None:
        decode(layer_args, out, q, lse, *qs, *os_, *ls)
    else:
        decode(layer_args, out, q, *qs, *os_)
        combine(NO_LAYER, out, lse, *os_, *ls)
