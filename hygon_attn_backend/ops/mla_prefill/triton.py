"""The Triton launches of the MLA prefill ops: the ragged kernel's launch of a plan (built
once per launch variant) and its per-call arguments, and the merge's launch
(``kernels/mla_prefill.py``). Arguments arrive validated; the config comes from
``tuning.choose``."""

from __future__ import annotations

import math

import torch

from hygon_attn_backend.ops._device import next_pow2
from hygon_attn_backend.ops._launch import NO_LAYER, Launch

#: what each call of the ragged kernel supplies, in the order :func:`run_ragged` passes it
PER_CALL = (
    "q_ptr", "k_ptr", "v_ptr", "out_ptr", "lse_ptr", "block_table_ptr", "kv_scale_ptr",
    "stride_qt", "stride_qh", "stride_qd", "stride_kt", "stride_kh", "stride_kd",
    "stride_vt", "stride_vh", "stride_vd", "stride_ot", "stride_oh", "stride_od",
    "stride_lseh", "stride_lset", "stride_bt", "stride_btb", "max_blocks", "num_blocks",
    "stride_kb", "stride_vb", "kv_scale_value")


def make_ragged_launch(plan, *, causal: bool, scale, return_lse: bool,
                       scale_from_ptr: bool = False, config=None) -> Launch:
    """The launch of ``ragged_attention_kernel`` for ``plan`` and one layer's options
    (``scale_from_ptr``: an fp8 cache's scale comes as a 1-element tensor; ``config``: the
    Triton config, default the plan's)."""
    from hygon_attn_backend.kernels.mla_prefill import ragged_attention_kernel

    cfg = plan.config if config is None else config
    fixed = dict(
        cu_seqlens_q_ptr=plan.cu_seqlens_q, cu_seqlens_k_ptr=plan.cu_seqlens_k,
        tile_req_ptr=plan.tile_req, tile_mblock_ptr=plan.tile_mblock,
        sm_scale=float(scale) if scale is not None else 1.0 / math.sqrt(plan.head_dim_qk),
        d_qk=plan.head_dim_qk, d_v=plan.head_dim_v, total_q=plan.total_q,
        total_k=plan.total_k,
        GROUP=plan.group, HEADS=cfg.heads, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        D1=cfg.d1, D2=cfg.d2, DV=cfg.dv, CAUSAL=bool(causal), RETURN_LSE=bool(return_lse),
        PAD_D1=plan.head_dim_qk < cfg.d1,
        PAD_D2=cfg.d2 > 0 and cfg.d1 + cfg.d2 != plan.head_dim_qk,
        PAD_V=cfg.dv != plan.head_dim_v, PAGED=plan.paged, PAGE_SIZE=plan.page_size,
        SCALE_FROM_PTR=bool(scale_from_ptr))
    grid = (plan.tile_req.shape[0], plan.num_kv_heads * (plan.group // cfg.heads), 1)
    return Launch(ragged_attention_kernel, grid, fixed, PER_CALL, num_warps=cfg.num_warps,
                  num_stages=cfg.num_stages)


def run_ragged(launch: Launch, q, k, v, out, lse) -> None:
    """One call (tensors as ``ragged_attention`` takes them, checked); ``lse`` None: a
    placeholder stands in (never written)."""
    lse_t, lse_s = (lse, lse.stride()) if lse is not None else (out, (0, 0))
    launch(NO_LAYER, q, k, v, out, lse_t, q, q, *q.stride(), *k.stride(), *v.stride(),
           *out.stride(), *lse_s, 0, 0, 0, 0, 0, 0, 1.0)


def run_extend(launch: Launch, q, kv_cache, block_table, out, lse, v_head_dim: int,
               kv_scale=None) -> None:
    """One call of the absorbed MLA extend (tensors as ``mla_extend_attention`` takes
    them, checked): ``kv_cache [num_blocks, P, D]`` is K, its first ``v_head_dim`` columns
    V (one KV head); an empty table is never read (any pointer stands in). ``kv_scale``:
    an fp8 cache's scale, a float (None: 1) or the 1-element float32 tensor the launch was
    built for."""
    lse_t, lse_s = (lse, lse.stride()) if lse is not None else (out, (0, 0))
    v = kv_cache[..., :v_head_dim]
    max_blocks = block_table.shape[1]
    bt = block_table if max_blocks and block_table.shape[0] else q
    bt_s = block_table.stride() if bt is block_table else (0, 0)
    sb, ss, sd = kv_cache.stride()
    from_ptr = isinstance(kv_scale, torch.Tensor)
    launch(NO_LAYER, q, kv_cache, v, out, lse_t, bt, kv_scale if from_ptr else q,
           *q.stride(), ss, 0, sd, ss, 0, sd, *out.stride(), *lse_s, *bt_s, max_blocks,
           kv_cache.shape[0], sb, sb,
           1.0 if from_ptr or kv_scale is None else float(kv_scale))


def merge_tile(num_heads: int, head_dim: int) -> "tuple[int, int]":
    """``(BLOCK_H, BLOCK_D)`` of the merge: one program a token and up to 2048 elements
    (``BLOCK_H`` heads of ``BLOCK_D`` columns, the row walked in ``BLOCK_D`` steps).

    Reasoning: the merge is a bandwidth-bound elementwise pass; 2048 elements a program
    on 4 warps are 16 per lane (two 16-byte loads of each input at fp16), enough to hide
    latency, and one token per program keeps the grid ``N`` programs tall for every
    head count."""
    block_d = min(512, max(16, next_pow2(head_dim)))
    block_h = max(1, min(next_pow2(num_heads), 2048 // block_d))
    return block_h, block_d


def run_merge(out, out_lse, out_a, lse_a, out_b, lse_b) -> None:
    """Launch ``merge_states_kernel`` (tensors as ``merge_attn_states`` takes them,
    checked; ``out_lse`` None: not written)."""
    from hygon_attn_backend.kernels.mla_prefill import merge_states_kernel

    num_tokens, num_heads, head_dim = out_a.shape
    if num_tokens == 0 or num_heads == 0:
        return
    block_h, block_d = merge_tile(num_heads, head_dim)
    lo, lo_s = (out_lse, out_lse.stride()) if out_lse is not None else (lse_a, (0, 0))
    grid = (num_tokens, -(-num_heads // block_h))
    merge_states_kernel[grid](
        out, lo, out_a, lse_a, out_b, lse_b, num_heads, head_dim,
        *out_a.stride(), *out_b.stride(), *out.stride(), *lse_a.stride(), *lse_b.stride(),
        *lo_s, BLOCK_H=block_h, BLOCK_D=block_d, WRITE_LSE=out_lse is not None,
        num_warps=4)
