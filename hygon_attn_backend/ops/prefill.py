"""Public op ``prefix_prefill_attention``: new tokens attend to a paged prefix and themselves.

Validate -> choose a tile config (``tuning.prefill_tile_config``) -> build the tile map
(``plan_prefix_prefill``) -> launch ``kernels.prefill.prefix_prefill_kernel``.

The tile map is built on the device with a few tensor ops and no host sync, over a grid
bounded from shapes alone (``cdiv(total_q, TOK_M) + B`` tiles), so an engine can build a
:class:`PrefillPlan` once per batch outside a captured CUDA graph and replay the launch.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Optional, Union

import torch

from hygon_attn_backend import reference, tuning
from hygon_attn_backend.ops import _checks
from hygon_attn_backend.ops._dispatch import select_impl, triton_interpreter_on

__all__ = ["prefix_prefill_attention", "plan_prefix_prefill", "PrefillPlan"]

ScaleLike = Union[None, float, torch.Tensor]


def _kernels():
    # Imported on first use: TRITON_INTERPRET must be set before @triton.jit runs.
    from hygon_attn_backend.kernels import prefill as prefill_kernels
    return prefill_kernels


@dataclass(frozen=True)
class PrefillPlan:
    """Tile schedule and launch config of one batch (reusable across layers).

    tile_req: ``[max_tiles]`` int32 request of each tile, ``-1`` for an unused slot.
    tile_mblock: ``[max_tiles]`` int32 m-block of each tile inside its request (the
       heaviest m-blocks of a request come first).
    ``max_tiles = cdiv(total_q, block_m // group) + num_seqs`` (a bound from shapes only).
    """

    tile_req: torch.Tensor
    tile_mblock: torch.Tensor
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group: int
    total_q: int
    num_seqs: int


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def _next_pow2(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def _tile_map(cu: torch.Tensor, num_seqs: int, tok_m: int, max_tiles: int):
    """``(tile_req, tile_mblock)`` int32 ``[max_tiles]`` on ``cu``'s device (no sync).

    Request ``b`` owns ``cdiv(Lq_b, tok_m)`` consecutive tiles, its heaviest m-block
    first; slots past the last request's tiles get ``tile_req = -1``.
    """
    len_q = cu[1:] - cu[:-1]  # [B]
    tiles = torch.div(len_q + (tok_m - 1), tok_m, rounding_mode="floor").clamp_(min=0)
    ends = torch.cumsum(tiles, 0)  # [B]
    t = torch.arange(max_tiles, device=cu.device, dtype=torch.int64)
    req = torch.searchsorted(ends, t, right=True)  # first request whose tiles end past t
    if num_seqs == 0:
        return (torch.full_like(t, -1, dtype=torch.int32),
                torch.zeros_like(t, dtype=torch.int32))
    req_c = req.clamp(max=num_seqs - 1)
    mblock = ends[req_c] - 1 - t  # heaviest m-block of each request first
    used = req < num_seqs
    tile_req = torch.where(used, req, -1).to(torch.int32)
    tile_mblock = torch.where(used, mblock, 0).to(torch.int32)
    return tile_req, tile_mblock


def _tile_map_host(cu: list, tok_m: int, max_tiles: int) -> torch.Tensor:
    """:func:`_tile_map` in plain Python from host values: ``[2, max_tiles]`` int32 CPU."""
    req = [-1] * max_tiles
    mblock = [0] * max_tiles
    t = 0
    for b in range(len(cu) - 1):
        n = max(0, -(-(int(cu[b + 1]) - int(cu[b])) // tok_m))
        req[t:t + n] = [b] * n
        mblock[t:t + n] = range(n - 1, -1, -1)
        t += n
    return torch.tensor([req, mblock], dtype=torch.int32)


def plan_prefix_prefill(cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, *,
                        total_q: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                        tile: Optional[tuple] = None,
                        host_cu_seqlens_q: Optional[torch.Tensor] = None) -> PrefillPlan:
    """Build the ``(request, m_block)`` tile map of a ragged batch on ``cu_seqlens_q``'s
    device, without a host sync (safe to call before capturing a graph and reuse).

    cu_seqlens_q: ``[B + 1]`` int32/int64; seq_lens_k: ``[B]`` int32/int64 (only its length
    is used here). total_q, num_q_heads, num_kv_heads, head_dim: the shapes of ``q`` and the
    caches. tile: optional ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` forcing the config
    (else :func:`tuning.prefill_tile_config`). host_cu_seqlens_q: the same values already
    on the host, if the caller has them: the map is then built on the CPU and copied over
    once (fewer device launches than the on-device build).
    """
    _checks.check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=_checks.INDEX_DTYPES)
    num_seqs = cu_seqlens_q.shape[0] - 1
    _checks.check_tensor("seq_lens_k", seq_lens_k, ndim=1, dtypes=_checks.INDEX_DTYPES,
                         shape=(num_seqs,))
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    group = num_q_heads // num_kv_heads
    device = cu_seqlens_q.device
    if tile is None:
        tile = tuning.prefill_tile_config(
            head_dim_pad=max(16, _next_pow2(head_dim)), group=group, total_q=total_q,
            num_kv_heads=num_kv_heads, num_seqs=num_seqs, num_sms=_num_sms(device),
            interpreter=device.type == "cpu" and triton_interpreter_on())
    block_m, block_n, num_warps, num_stages = (int(x) for x in tile)
    if block_m < group:
        raise ValueError(f"tile BLOCK_M={block_m} is smaller than the GQA group {group}")
    tok_m = block_m // group
    max_tiles = -(-total_q // tok_m) + num_seqs
    if host_cu_seqlens_q is not None:
        # the values are already on the host (value checks): build there, one copy over
        both = _tile_map_host(host_cu_seqlens_q.tolist(), tok_m, max_tiles)
        tile_req, tile_mblock = both.to(device, non_blocking=True).unbind(0)
    else:
        tile_req, tile_mblock = _tile_map(cu_seqlens_q.to(torch.int64), num_seqs, tok_m,
                                          max_tiles)
    return PrefillPlan(tile_req=tile_req, tile_mblock=tile_mblock, block_m=block_m,
                       block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                       group=group, total_q=total_q, num_seqs=num_seqs)


def _check_values(cu_seqlens_q, seq_lens_k, block_table, total_q, page_size, has_k_new=False):
    """Host-side checks of the index tensors' values (one sync)."""
    both = torch.cat([cu_seqlens_q.detach().to(torch.int64),
                      seq_lens_k.detach().to(torch.int64)]).cpu()  # one device->host copy
    cu, lens_k = both[:cu_seqlens_q.shape[0]], both[cu_seqlens_q.shape[0]:]
    if cu.numel() and int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens_q must start at 0, got {cu[:4].tolist()}...")
    len_q = cu[1:] - cu[:-1]
    if (len_q < 0).any():
        b = int(torch.nonzero(len_q < 0)[0])
        raise ValueError(f"cu_seqlens_q must be non-decreasing, got cu_seqlens_q[{b}]="
                         f"{int(cu[b])} > cu_seqlens_q[{b + 1}]={int(cu[b + 1])}")
    if cu.numel() and int(cu[-1]) != total_q:
        raise ValueError(f"cu_seqlens_q[-1] ({int(cu[-1])}) must equal q.shape[0] "
                         f"({total_q})")
    if (lens_k < len_q).any():
        b = int(torch.nonzero(lens_k < len_q)[0])
        raise ValueError(f"seq_lens_k[{b}]={int(lens_k[b])} is shorter than request {b}'s "
                         f"query length {int(len_q[b])} (a query cannot exceed its KV "
                         "length)")
    in_cache = lens_k - len_q if has_k_new else lens_k  # k_new: only the prefix is paged
    if in_cache.numel() and int(in_cache.max()) > block_table.shape[1] * page_size:
        raise ValueError(f"block_table with shape {tuple(block_table.shape)} and page size "
                         f"{page_size} holds at most {block_table.shape[1] * page_size} "
                         f"tokens per request, but seq_lens_k needs {int(in_cache.max())}")
    return cu


def prefix_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             seq_lens_k: torch.Tensor, *, scale: Optional[float] = None,
                             causal: bool = True, k_new: Optional[torch.Tensor] = None,
                             v_new: Optional[torch.Tensor] = None,
                             out: Optional[torch.Tensor] = None, return_lse: bool = False,
                             k_scale: ScaleLike = None, v_scale: ScaleLike = None,
                             sliding_window: Optional[int] = None,
                             soft_cap: Optional[float] = None,
                             sinks: Optional[torch.Tensor] = None,
                             plan: Optional[PrefillPlan] = None,
                             validate: Optional[bool] = None, impl: str = "auto"):
    """Prefix-prefill ("extend") attention on a ragged batch over a paged KV cache.

    q: ``[total_q, num_q_heads, D]`` float16/bfloat16 (any strides), the new tokens packed;
       request ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (``Lq_b`` of them).
    k_cache, v_cache: ``[num_blocks, num_kv_heads, P, D]`` views with any strides, q's
       dtype or float8_e4m3fn/float8_e5m2 (with ``k_scale``/``v_scale``); any ``P >= 1``.
    block_table: ``[B, max_blocks]`` int32/int64 physical block ids; token ``t`` of request
       ``b`` is at ``page = block_table[b, t // P]``, ``slot = t % P``. A bad id (negative
       or ``>= num_blocks``) is never read: its keys are absent, as in the reference
       (``HYGON_ATTN_DEBUG=1`` raises instead).
    cu_seqlens_q: ``[B + 1]`` int32/int64, starts at 0, non-decreasing, ends at total_q.
    seq_lens_k: ``[B]`` int32/int64 total key length ``Lk_b = prefix + Lq_b`` (>= Lq_b).
    k_new, v_new: optional ``[total_q, num_kv_heads, D]`` (q's dtype) K/V of the new tokens
       (SGLang passes them): the prefix ``[0, Lk - Lq)`` comes from the cache and the new
       keys from these. Absent (vLLM writes the cache first): all ``Lk`` keys from the cache.
    causal: the shifted causal mask, row ``i`` sees key ``j`` iff ``j <= i + (Lk - Lq)``::

           L_prefix=4, L_q=3:   prefix      new
                          i=0  1 1 1 1    1 0 0
                          i=1  1 1 1 1    1 1 0
                          i=2  1 1 1 1    1 1 1

       ``causal=False``: every row sees all ``Lk`` keys.
    sliding_window: ``W``: also ``j > i + (Lk - Lq) - W`` (causal only, as the reference).
    soft_cap: logits become ``cap * tanh(s / cap)``. sinks: ``[num_q_heads]`` float32 sink
       logits (an always-visible key of value 0), or None.
    out: optional ``[total_q, num_q_heads, D]`` q's dtype output (any strides).
    return_lse: also return ``lse [total_q, num_q_heads]`` float32, natural log of each
       row's softmax normaliser (``-inf`` for a row that sees no key).
    plan: a :func:`plan_prefix_prefill` result for this batch (else built here).
    validate: check index values on the host (one sync); default: on unless a CUDA graph
       is being captured. impl: ``"auto"`` | ``"triton"`` | ``"reference"``.

    Returns ``out`` or ``(out, lse)``. Rows that see no key give 0 (never NaN).
    """
    _checks.check_tensor("q", q, ndim=3, dtypes=(torch.float16, torch.bfloat16))
    total_q, num_q_heads, head_dim = q.shape
    device = q.device
    num_blocks, num_kv_heads, page_size, _ = _checks.check_kv_caches(
        k_cache, v_cache, device=device, head_dim=head_dim)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q's {num_q_heads} heads must be a multiple of the caches' "
                         f"{num_kv_heads} kv heads (q: {_checks.describe(q)}, k_cache: "
                         f"{_checks.describe(k_cache)})")
    if k_cache.dtype not in (q.dtype,) + _checks.FP8_DTYPES:
        raise ValueError(f"k_cache dtype must be q's dtype {q.dtype} or fp8, got "
                         f"{_checks.describe(k_cache)}")
    _checks.check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=_checks.INDEX_DTYPES,
                         device=device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 0:
        raise ValueError(f"cu_seqlens_q must hold B + 1 >= 1 entries, got "
                         f"{_checks.describe(cu_seqlens_q)}")
    _checks.check_tensor("seq_lens_k", seq_lens_k, ndim=1, dtypes=_checks.INDEX_DTYPES,
                         device=device, shape=(num_seqs,))
    _checks.check_tensor("block_table", block_table, ndim=2, dtypes=_checks.INDEX_DTYPES,
                         device=device, shape=(num_seqs, None))
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together, got "
                         f"k_new={'None' if k_new is None else _checks.describe(k_new)}, "
                         f"v_new={'None' if v_new is None else _checks.describe(v_new)}")
    if k_new is not None:
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            _checks.check_tensor(name, t, dtypes=(q.dtype,), device=device,
                                 shape=(total_q, num_kv_heads, head_dim))
    if out is not None:
        _checks.check_tensor("out", out, dtypes=(q.dtype,), device=device,
                             shape=tuple(q.shape))
    if sinks is not None:
        _checks.check_tensor("sinks", sinks, ndim=1, device=device, shape=(num_q_heads,))
    if scale is not None and not float(scale) > 0:
        raise ValueError(f"scale must be > 0 (the kernel's running max relies on it), got "
                         f"{scale}")
    if sliding_window is not None and int(sliding_window) <= 0:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
    if soft_cap is not None and float(soft_cap) < 0:
        raise ValueError(f"soft_cap must be >= 0 or None, got {soft_cap}")
    soft_cap = float(soft_cap) if soft_cap else None
    quant = k_cache.dtype in _checks.FP8_DTYPES
    k_scale_arg = _checks.check_scale("k_scale", k_scale, k_cache.dtype, device) if quant else 1.0
    v_scale_arg = _checks.check_scale("v_scale", v_scale, v_cache.dtype, device) if quant else 1.0
    host_cu = None
    if validate is None:
        validate = device.type != "cuda" or not torch.cuda.is_current_stream_capturing()
    if validate:
        host_cu = _check_values(cu_seqlens_q, seq_lens_k, block_table, total_q, page_size,
                                has_k_new=k_new is not None)
        if _checks.debug_enabled():
            _checks.check_used_block_ids("block_table", block_table, seq_lens_k, num_blocks,
                                         page_size)

    if select_impl(impl, device) == "reference":
        res = reference.prefix_prefill_attention(
            q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale=scale,
            causal=causal, k_new=k_new, v_new=v_new, out=out, return_lse=return_lse,
            k_scale=k_scale if quant else None, v_scale=v_scale if quant else None,
            sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
        return res

    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be a 4-D [num_blocks, kv_heads, P, D] view for the "
                         f"Triton prefill (the split-x K cache is decode-only), got "
                         f"{_checks.describe(k_cache)}")
    if plan is None:
        plan = plan_prefix_prefill(cu_seqlens_q, seq_lens_k, total_q=total_q,
                                   num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                   head_dim=head_dim, host_cu_seqlens_q=host_cu)
    elif (plan.group != num_q_heads // num_kv_heads or plan.total_q != total_q
          or plan.num_seqs != num_seqs):
        raise ValueError(f"plan was built for group={plan.group}, total_q={plan.total_q}, "
                         f"num_seqs={plan.num_seqs}; this call has group="
                         f"{num_q_heads // num_kv_heads}, total_q={total_q}, "
                         f"num_seqs={num_seqs}")
    _checks.check_prefill_plan(plan, total_q=total_q, num_seqs=num_seqs, device=device)
    if out is None:
        out = torch.empty_like(q)
    lse = (torch.empty((total_q, num_q_heads), dtype=torch.float32, device=device)
           if return_lse else None)
    max_tiles = plan.tile_req.shape[0]
    if max_tiles == 0 or total_q == 0:
        return (out, lse) if return_lse else out

    scale_from_ptr = isinstance(k_scale_arg, torch.Tensor) or isinstance(v_scale_arg, torch.Tensor)
    if scale_from_ptr:
        k_scale_t = (k_scale_arg if isinstance(k_scale_arg, torch.Tensor)
                     else torch.full((1,), k_scale_arg, dtype=torch.float32, device=device))
        v_scale_t = (v_scale_arg if isinstance(v_scale_arg, torch.Tensor)
                     else torch.full((1,), v_scale_arg, dtype=torch.float32, device=device))
        k_scale_val = v_scale_val = 1.0
    else:
        k_scale_t = v_scale_t = plan.tile_req  # unused placeholders
        k_scale_val, v_scale_val = float(k_scale_arg), float(v_scale_arg)
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)
    head_dim_pad = max(16, _next_pow2(head_dim))
    has_new = k_new is not None
    kn = k_new if has_new else q
    vn = v_new if has_new else q
    kn_strides = k_new.stride() if has_new else (0, 0, 0)
    vn_strides = v_new.stride() if has_new else (0, 0, 0)
    lse_t = lse if return_lse else out
    lse_strides = lse.stride() if return_lse else (0, 0)
    sinks_t = sinks.to(torch.float32) if sinks is not None else q
    # block ids outside [0, num_blocks) and columns past max_blocks are absent keys (the
    # kernel never reads them); an empty table is never read: any pointer stands in
    max_blocks = block_table.shape[1]
    bt = block_table if max_blocks else plan.tile_req.view(1, -1)
    kernels = _kernels()
    grid = (max_tiles, num_kv_heads)
    kernels.prefix_prefill_kernel[grid](
        q_ptr=q, k_cache_ptr=k_cache, v_cache_ptr=v_cache, k_new_ptr=kn, v_new_ptr=vn,
        out_ptr=out, lse_ptr=lse_t, sinks_ptr=sinks_t,
        block_table_ptr=bt, cu_seqlens_q_ptr=cu_seqlens_q, seq_lens_k_ptr=seq_lens_k,
        tile_req_ptr=plan.tile_req, tile_mblock_ptr=plan.tile_mblock,
        k_scale_ptr=k_scale_t, v_scale_ptr=v_scale_t,
        sm_scale=sm_scale, k_scale_val=k_scale_val, v_scale_val=v_scale_val,
        soft_cap=soft_cap if soft_cap else 1.0,
        window=int(sliding_window) if sliding_window else 0, head_dim=head_dim,
        num_blocks=num_blocks, max_blocks=max_blocks,
        stride_qt=q.stride(0), stride_qh=q.stride(1), stride_qd=q.stride(2),
        stride_kb=k_cache.stride(0), stride_kh=k_cache.stride(1),
        stride_ks=k_cache.stride(2), stride_kd=k_cache.stride(3),
        stride_vb=v_cache.stride(0), stride_vh=v_cache.stride(1),
        stride_vs=v_cache.stride(2), stride_vd=v_cache.stride(3),
        stride_knt=kn_strides[0], stride_knh=kn_strides[1], stride_knd=kn_strides[2],
        stride_vnt=vn_strides[0], stride_vnh=vn_strides[1], stride_vnd=vn_strides[2],
        stride_ot=out.stride(0), stride_oh=out.stride(1), stride_od=out.stride(2),
        stride_lset=lse_strides[0], stride_lseh=lse_strides[1],
        stride_bt=bt.stride(0), stride_bt_block=bt.stride(1),
        GROUP=plan.group, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, HEAD_DIM=head_dim_pad,
        PAGE_SIZE=page_size, CAUSAL=bool(causal), HAS_K_NEW=has_new,
        RETURN_LSE=bool(return_lse), SCALE_FROM_PTR=scale_from_ptr,
        WINDOW=bool(sliding_window) and bool(causal), SOFT_CAP=soft_cap is not None,
        HAS_SINKS=sinks is not None, KV_SCALED=quant, PAD_D=head_dim_pad != head_dim,
        num_warps=plan.num_warps, num_stages=plan.num_stages)
    return (out, lse) if return_lse else out
