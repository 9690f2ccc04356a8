"""The Triton MLA decode's launches: the decode and combine launches of a plan (built once
per launch variant) and the per-call launch.

Kernels: ``kernels/mla_decode.py`` (``mla_decode_kernel``, ``mla_combine_kernel``).
Arguments arrive validated; the config comes from ``tuning.choose``.
"""

from __future__ import annotations

import torch

from hygon_attn_backend.ops._device import next_pow2
from hygon_attn_backend.ops._launch import NO_LAYER, Launch

#: what each call supplies to the decode launch (tensors first, then scalars)
DECODE_PER_CALL = (
    "out_ptr", "lse_ptr", "q_ptr", "kv_ptr", "kv_scale_ptr", "kv_scale_value", "num_blocks",
    "stride_q_seq", "stride_q_tok", "stride_q_head", "stride_q_dim",
    "stride_o_seq", "stride_o_tok", "stride_o_head", "stride_o_dim",
    "stride_lse_seq", "stride_lse_tok", "stride_lse_head",
    "stride_kv_block", "stride_kv_slot", "stride_kv_dim")
COMBINE_PER_CALL = ("out_ptr", "lse_ptr", "stride_o_seq", "stride_o_tok", "stride_o_head",
                    "stride_o_dim", "stride_lse_seq", "stride_lse_tok", "stride_lse_head")
COMBINE_WARPS = 4


def combine_chunk(rank_pad: int, num_warps: int = COMBINE_WARPS) -> int:
    """Partitions the combine reads a step, a ``[chunk, rank_pad]`` fp32 tile: 64 values a
    thread (the combine is latency-bound with registers to spare), 64 partitions at most."""
    return max(1, min(64, 64 * 32 * num_warps // rank_pad))


def make_launches(plan, scales_from_ptr: bool):
    """``(decode, combine or None)`` launches of ``plan`` for one variant (how the layer
    passes its fp8 scale)."""
    from hygon_attn_backend.kernels.fp8 import WIDEN_CODES
    from hygon_attn_backend.kernels.mla_decode import mla_combine_kernel, mla_decode_kernel
    from hygon_attn_backend.ops.decode.tuning import kv_widen
    from hygon_attn_backend.ops.tree_mask import launch_args as tree_args

    cfg = plan.config
    ws = plan.workspace
    rank_pad = next_pow2(max(16, plan.kv_lora_rank))
    rope_pad = next_pow2(max(16, plan.rope_dim))
    rows = plan.num_tokens * plan.num_q_heads
    if cfg.split:
        scratch = dict(max_logits_ptr=ws.max_logits, exp_sums_ptr=ws.exp_sums,
                       partial_out_ptr=ws.partial_out,
                       stride_ml_slot=ws.max_logits.stride(0),
                       stride_ml_row=ws.max_logits.stride(1),
                       stride_po_slot=ws.partial_out.stride(0),
                       stride_po_row=ws.partial_out.stride(1),
                       stride_po_dim=ws.partial_out.stride(2))
    else:  # unused by the one-partition launch
        scratch = dict(max_logits_ptr=plan.seq_lens, exp_sums_ptr=plan.seq_lens,
                       partial_out_ptr=plan.seq_lens, stride_ml_slot=0, stride_ml_row=0,
                       stride_po_slot=0, stride_po_row=0, stride_po_dim=1)
    fixed = dict(
        block_table_ptr=plan.block_table, seq_lens_ptr=plan.seq_lens,
        scale=float(plan.scale), max_blocks_per_seq=plan.block_table.shape[1],
        partition_size=cfg.kernel_partition_size, num_partitions=cfg.num_partitions,
        stride_bt_seq=plan.block_table.stride(0), stride_bt_block=plan.block_table.stride(1),
        NUM_HEADS=plan.num_q_heads, NUM_TOKENS=plan.num_tokens, RANK=plan.kv_lora_rank,
        RANK_PAD=rank_pad, ROPE=plan.rope_dim, ROPE_PAD=rope_pad, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, PAGE_SIZE=plan.page_size, SPLIT=cfg.split,
        SCALES_FROM_PTR=scales_from_ptr, WRITE_LSE=plan.return_lse and not cfg.split,
        # the dense decode's rule: an fp8 tile widened to fp16 as loaded, fp16 dots
        KV_WIDEN=WIDEN_CODES[kv_widen(kv_dtype=plan.kv_dtype, device=plan.device)],
        **tree_args(plan.tree_mask, plan.seq_lens), **scratch)
    grid = (-(-rows // cfg.block_m), plan.num_seqs, cfg.num_partitions)
    decode = Launch(mla_decode_kernel, grid, fixed, DECODE_PER_CALL,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    combine = None
    if cfg.split:
        cfixed = dict(
            max_logits_ptr=ws.max_logits, exp_sums_ptr=ws.exp_sums,
            partial_out_ptr=ws.partial_out, seq_lens_ptr=plan.seq_lens,
            max_blocks_per_seq=plan.block_table.shape[1],
            partition_size=cfg.kernel_partition_size, num_partitions=cfg.num_partitions,
            stride_ml_slot=ws.max_logits.stride(0), stride_ml_row=ws.max_logits.stride(1),
            stride_po_slot=ws.partial_out.stride(0), stride_po_row=ws.partial_out.stride(1),
            stride_po_dim=ws.partial_out.stride(2),
            NUM_HEADS=plan.num_q_heads, RANK=plan.kv_lora_rank, RANK_PAD=rank_pad,
            PART_CHUNK=combine_chunk(rank_pad), ALIGN=cfg.block_n, PAGE_SIZE=plan.page_size,
            WRITE_LSE=plan.return_lse)
        combine = Launch(mla_combine_kernel, (plan.num_seqs, rows, 1), cfixed,
                         COMBINE_PER_CALL, num_warps=COMBINE_WARPS, num_stages=1)
    return decode, combine


def _strides4(t: torch.Tensor) -> tuple:
    """``[S, (T,) H, X]`` strides as ``(seq, tok, head, x)`` (no token axis: 0)."""
    s = t.stride()
    return (s[0], 0, s[1], s[2]) if t.dim() == 3 else tuple(s)


def _strides_lse(t: torch.Tensor) -> tuple:
    s = t.stride()
    return (s[0], 0, s[1]) if t.dim() == 2 else tuple(s)


def run(launches, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor, lse,
        kv_scale_ptr, kv_scale_value: float) -> None:
    """One layer's call: ``q [S, (T,) Hq, W]``, ``out [S, (T,) Hq, R]``, ``lse [S, (T,) Hq]``
    or None (then ``out`` stands in as the never-written pointer); ``kv_scale_ptr`` a
    1-element float32 tensor or None (the value is used)."""
    decode, _ = launches
    ls = _strides_lse(lse) if lse is not None else (0, 0, 0)
    decode(NO_LAYER, out, lse if lse is not None else out, q, kv_cache,
           kv_scale_ptr if kv_scale_ptr is not None else out, kv_scale_value,
           kv_cache.shape[0], *_strides4(q), *_strides4(out), *ls, *kv_cache.stride())
    run_combine(launches, out, lse)


def run_combine(launches, out: torch.Tensor, lse) -> None:
    """The combine of a split launch once the decode (Triton or native) filled the scratch
    (nothing for one partition: the decode wrote ``out`` and ``lse``)."""
    _, combine = launches
    if combine is None:
        return
    ls = _strides_lse(lse) if lse is not None else (0, 0, 0)
    combine(NO_LAYER, out, lse if lse is not None else out, *_strides4(out), *ls)
