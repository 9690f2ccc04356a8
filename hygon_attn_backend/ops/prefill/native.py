"""The native prefix prefill (the sm_90a wgmma kernel, ``csrc/prefill_sm90.cu``,
``torch.ops.hygon_attn.prefix_prefill``): what it covers and its launch. Arguments arrive
validated (``api.py``, ``plan.py``); nothing here chooses a config."""

from __future__ import annotations

from typing import Optional

import torch

from hygon_attn_backend import native
from hygon_attn_backend.ops import _checks
from hygon_attn_backend.ops._device import sm90_unsupported

BLOCK_M = 128  # query rows of a native prefill program (csrc/prefill_sm90.cu)
TILE = (BLOCK_M, 128, 8, 3)  # the Triton tile a layer it does not cover runs on its map
HEAD_DIM = 128
DTYPES = (torch.float16, torch.bfloat16)  # q and out; the caches q's dtype or fp8


def device_unsupported(device: torch.device) -> Optional[str]:
    """None when ``device`` has the native prefill (an NVIDIA sm_90 GPU: the kernel is
    written for sm_90a's wgmma), else the reason."""
    return sm90_unsupported(device, "the native prefill")


def dtype_unsupported(kv_dtype: torch.dtype) -> Optional[str]:
    """Why a KV cache of ``kv_dtype`` cannot run the native prefill (None: it can)."""
    if kv_dtype not in DTYPES and kv_dtype not in _checks.FP8_DTYPES:
        return (f"KV cache dtype {kv_dtype} (native prefill: float16/bfloat16, "
                "float8_e4m3fn/float8_e5m2)")
    return None


def shape_unsupported(*, head_dim: int, q_dtype: Optional[torch.dtype],
                      kv_dtype: Optional[torch.dtype], group: int) -> Optional[str]:
    """None when the native prefill covers a batch of these shapes and dtypes (None: not
    known yet), else the reason it does not. The device is :func:`device_unsupported`'s
    question."""
    if head_dim != HEAD_DIM:
        return f"head_dim {head_dim} (native prefill: {HEAD_DIM})"
    if q_dtype is not None and q_dtype not in DTYPES:
        return f"q dtype {q_dtype} (native prefill: float16/bfloat16)"
    why = dtype_unsupported(kv_dtype) if kv_dtype is not None else None
    if why is not None:
        return why
    if group > BLOCK_M:
        return f"GQA group {group} > {BLOCK_M}"
    return None


def layer_unsupported(k_cache: torch.Tensor, v_cache: torch.Tensor) -> Optional[str]:
    """Why one layer's caches cannot run the native prefill (None: they can; the caller
    checks that q has the caches' dtype)."""
    why = dtype_unsupported(k_cache.dtype) or dtype_unsupported(v_cache.dtype)
    if why is None and v_cache.dtype != k_cache.dtype:
        why = f"KV cache dtypes {k_cache.dtype} / {v_cache.dtype} differ"
    if why is not None:
        return why
    elems = 16 if k_cache.dtype in _checks.FP8_DTYPES else 8  # 16-byte copies
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not _checks.rows_aligned(t, elems):
            return (f"{name} rows not 16-byte aligned with a contiguous last dim (strides "
                    f"{tuple(t.stride())})")
    return None


def call_unsupported(q: torch.Tensor, out: torch.Tensor, k_new: Optional[torch.Tensor],
                     v_new: Optional[torch.Tensor], kv_dtype: torch.dtype) -> Optional[str]:
    """Why one call's tensors cannot run the native prefill with caches of ``kv_dtype``
    (None: they can)."""
    if kv_dtype in _checks.FP8_DTYPES:
        if q.dtype not in DTYPES:
            return f"q dtype {q.dtype} with an fp8 KV cache"
        if k_new is not None:
            return "dense k_new / v_new with an fp8 KV cache (the native kernel reads fp8 only)"
    elif q.dtype != kv_dtype:
        return f"q dtype {q.dtype} with KV cache {kv_dtype}"
    for name, t, elems in (("q", q, 8), ("out", out, 2), ("k_new", k_new, 8),
                           ("v_new", v_new, 8)):
        if t is not None and not _checks.rows_aligned(t, elems):
            return (f"{name} rows not {2 * elems}-byte aligned with a contiguous last dim "
                    f"(strides {tuple(t.stride())})")
    return None


def launch(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_table: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor,
           tile_req: torch.Tensor, tile_mblock: torch.Tensor, sched: torch.Tensor, *,
           scale: float, causal: bool, k_new: Optional[torch.Tensor],
           v_new: Optional[torch.Tensor], lse: Optional[torch.Tensor],
           sinks: Optional[torch.Tensor], soft_cap: Optional[float],
           sliding_window: Optional[int], scales: tuple = (None, None, 1.0, 1.0)) -> None:
    """The native prefill launch: tensors as ``prefix_prefill_attention`` takes them,
    already checked (:func:`layer_unsupported`, :func:`call_unsupported`);
    ``tile_req``/``tile_mblock`` the plan's map of ``128 // group``-token blocks; ``sched``:
    the plan's int32 ``[2]`` work counter of the persistent launch (zeros; the kernel
    leaves it zero); ``scales``: an fp8 cache's ``(k tensor or None, v tensor or None,
    k value, v value)`` (:func:`fp8_scales`). The consumers run their ping-pong turns and
    in-warpgroup overlap."""
    sinks_f32 = sinks.to(torch.float32).contiguous() if sinks is not None else None
    native.load().prefix_prefill(out, q, k_cache, v_cache, k_new, v_new, lse, sinks_f32,
                                 block_table, cu_seqlens_q, seq_lens_k, tile_req, tile_mblock,
                                 sched, float(scale), float(soft_cap or 0.0), bool(causal),
                                 int(sliding_window or 0), True, True, *scales)


def fp8_scales(k_scale, v_scale) -> tuple:
    """``(k tensor or None, v tensor or None, k value, v value)`` of the native launch for
    checked fp8 scales (a float, a tensor of 1 or num_kv_heads elements, or None: 1)."""
    k_t, k_v = _checks.native_scale_pair(1.0 if k_scale is None else k_scale)
    v_t, v_v = _checks.native_scale_pair(1.0 if v_scale is None else v_scale)
    return k_t, v_t, k_v, v_v
