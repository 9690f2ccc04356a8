"""The Triton prefix prefill's launch: a layer's fixed arguments, the launch of a plan
(built once per launch variant) and the per-call launch of ``kernels/prefill.py``
(``prefix_prefill_kernel``). Arguments arrive validated; the tile comes from
``tuning.choose``."""

from __future__ import annotations

import math

import torch

from hygon_attn_backend.ops import _checks, tree_mask
from hygon_attn_backend.ops._device import head_tile
from hygon_attn_backend.ops._launch import LayerArgs, Launch
from hygon_attn_backend.ops.prefill import tuning

# Arguments of prefix_prefill_kernel that change per layer, in the order run() passes them.
#: what a :class:`PrefillLayer` supplies (its ``args``), in order
PER_LAYER = (
    "k_cache_ptr", "v_cache_ptr", "sinks_ptr", "k_scale_ptr", "v_scale_ptr",
    "k_scale_val", "v_scale_val", "k_scale_stride", "v_scale_stride",
    "stride_kb", "stride_kh", "stride_ks", "stride_kd",
    "stride_vb", "stride_vh", "stride_vs", "stride_vd", "num_blocks")
#: what each call supplies
PER_CALL = (
    "q_ptr", "k_new_ptr", "v_new_ptr", "out_ptr", "lse_ptr", "block_table_ptr",
    "stride_qt", "stride_qh", "stride_qd",
    "stride_knt", "stride_knh", "stride_knd",
    "stride_vnt", "stride_vnh", "stride_vnd",
    "stride_ot", "stride_oh", "stride_od",
    "stride_lset", "stride_lseh", "stride_bt", "stride_bt_block", "max_blocks")


def layer_args(k_cache: torch.Tensor, v_cache: torch.Tensor, sinks, k_scale_ptr, v_scale_ptr,
               k_scale_value: float, v_scale_value: float) -> LayerArgs:
    """One layer's launch arguments (``PER_LAYER``); absent sinks / scale pointers: the K
    cache stands in (never read). A scale tensor of more than one element is read per KV
    head."""
    return LayerArgs(
        (k_cache, v_cache, k_cache if sinks is None else sinks,
         k_cache if k_scale_ptr is None else k_scale_ptr,
         k_cache if v_scale_ptr is None else v_scale_ptr),
        (k_scale_value, v_scale_value, _checks.scale_head_stride(k_scale_ptr),
         _checks.scale_head_stride(v_scale_ptr), *k_cache.stride(), *v_cache.stride(),
         k_cache.shape[0]))


def make_launch(plan, q_dtype, head_dim, has_new, return_lse, kv_dtype, page_size, causal,
                 quant, from_ptr, window, soft_cap, has_sinks, scale, cu_seqlens_q,
                 seq_lens_k, k_cache):
    from hygon_attn_backend.kernels.prefill import prefix_prefill_kernel

    if q_dtype not in tuning.PREFILL_Q_DTYPES:
        raise ValueError(f"the Triton prefill takes float16/bfloat16 queries, got {q_dtype}")
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be a 4-D [num_blocks, kv_heads, P, D] view for "
                         f"prefill (the split-x K cache is decode-only), got "
                         f"{_checks.describe(k_cache)}")
    head_dim_pad = head_tile(head_dim, device=k_cache.device)  # as the plan's tile rule
    fixed = dict(
        **tree_mask.launch_args(plan.tree_mask, plan.tile_req),
        cu_seqlens_q_ptr=cu_seqlens_q, seq_lens_k_ptr=seq_lens_k,
        tile_req_ptr=plan.tile_req, tile_mblock_ptr=plan.tile_mblock,
        sm_scale=float(scale) if scale is not None else 1.0 / math.sqrt(head_dim),
        soft_cap=soft_cap if soft_cap else 1.0, window=int(window) if window else 0,
        head_dim=head_dim,
        GROUP=plan.group, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
        HEAD_DIM=head_dim_pad, PAGE_SIZE=page_size, CAUSAL=causal, HAS_K_NEW=has_new,
        RETURN_LSE=return_lse, SCALE_FROM_PTR=from_ptr, WINDOW=bool(window) and causal,
        SOFT_CAP=soft_cap is not None, HAS_SINKS=has_sinks, KV_SCALED=quant,
        PAD_D=head_dim_pad != head_dim,
        TWO_WALKS=plan.two_walks if plan.two_walks is not None else tuning.two_walks(
            head_dim_pad=head_dim_pad, page_size=page_size, block_n=plan.block_n,
            num_warps=plan.num_warps))
    num_kv_heads = plan.num_kv_heads
    grid = (plan.tile_req.shape[0], num_kv_heads, 1)
    return Launch(prefix_prefill_kernel, grid, fixed, PER_CALL, per_layer=PER_LAYER,
                  num_warps=plan.num_warps, num_stages=plan.num_stages)


def run(launch, layer: LayerArgs, q, block_table, k_new, v_new, out, lse, tile_req) -> None:
    """One layer's call (tensors as ``prefix_prefill_attention`` takes them, checked)."""
    # block ids outside [0, num_blocks) and columns past max_blocks are absent keys (the
    # kernel never reads them); an empty table is never read: any pointer stands in
    max_blocks = block_table.shape[1]
    bt = block_table if max_blocks else tile_req.view(1, -1)
    if k_new is not None:
        kn, vn, kn_s, vn_s = k_new, v_new, k_new.stride(), v_new.stride()
    else:  # placeholders, never read
        kn, vn, kn_s, vn_s = q, q, (0, 0, 0), (0, 0, 0)
    lse_t, lse_s = (lse, lse.stride()) if lse is not None else (out, (0, 0))
    launch(layer, q, kn, vn, out, lse_t, bt, *q.stride(), *kn_s, *vn_s, *out.stride(),
           *lse_s, *bt.stride(), max_blocks)
