"""Argument validation shared by the public ops.

Every failure is a ``ValueError`` that names the argument and shows its shape, dtype or
device, so a wrong call is diagnosable from the message alone. Checks that need the
tensors' values (slot ranges, block ids) force a host sync and run only in debug mode
(``HYGON_ATTN_DEBUG=1``), or when a caller asks for them.
"""

from __future__ import annotations

import math
import numbers
from typing import Iterable, Optional, Sequence, Union

import torch

from hygon_attn_backend import envs

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32) + FP8_DTYPES
INDEX_DTYPES = (torch.int32, torch.int64)

#: an fp8 scale: a float, or a float32 tensor read on the device (1 element, or one per
#: KV head where the op takes per-head scales)
ScaleLike = Union[None, float, torch.Tensor]


def as_scale_tensor(scale: ScaleLike, device) -> torch.Tensor:
    """A per-tensor scale as the 1-element float32 tensor kernels read on the device
    (``None`` is 1)."""
    if isinstance(scale, torch.Tensor):
        return scale
    return torch.full((1,), 1.0 if scale is None else float(scale), dtype=torch.float32,
                      device=device)


def scale_launch_args(k_scale: ScaleLike, v_scale: ScaleLike, device, *, used: bool = True):
    """How a kernel takes a call's K/V scales: ``(from_ptr, k_ptr, v_ptr, k_value, v_value)``.

    A tensor scale (either one) makes both pointers (``from_ptr``: one compiled variant for
    both forms, the values unused); else the values as floats (``None`` is 1) and no
    pointers (``None``: the launch passes a placeholder). ``used=False`` (a cache that is
    not fp8): no scale applies, whatever was passed.
    """
    if not used:
        return False, None, None, 1.0, 1.0
    if isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor):
        return True, as_scale_tensor(k_scale, device), as_scale_tensor(v_scale, device), \
            1.0, 1.0
    return (False, None, None, 1.0 if k_scale is None else float(k_scale),
            1.0 if v_scale is None else float(v_scale))


def native_scale_pair(scale):
    """``(tensor or None, float)`` for a native op's ``Tensor? scale, float scale_value``
    (``scale``: a float, or a tensor of 1 or num_kv_heads elements, as :func:`check_scale`
    returns; the native op reads a tensor of more than one element per KV head)."""
    if isinstance(scale, torch.Tensor):
        return scale.reshape(-1).to(torch.float32).contiguous(), 1.0
    return None, float(scale)


def rows_aligned(t: torch.Tensor, elems: int) -> bool:
    """Innermost stride 1 and every row start a multiple of ``elems`` elements from a base
    aligned to as many elements (the native kernels' 16-byte copies / 4-byte stores). Runs
    per call on the per-layer path: one stride() and shape read, no generator."""
    strides, shape = t.stride(), t.shape
    if strides[-1] != 1 and shape[-1] > 1:
        return False
    if t.data_ptr() % (elems * t.element_size()):
        return False
    for s, n in zip(strides[:-1], shape[:-1]):
        if s % elems and n > 1:
            return False
    return True


def debug_enabled() -> bool:
    """``HYGON_ATTN_DEBUG=1`` turns on value checks that sync with the host."""
    return envs.debug()


def describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def check_tensor(name: str, t, *, ndim: Optional[Sequence[int] | int] = None,
                 dtypes: Optional[Iterable[torch.dtype]] = None,
                 device: Optional[torch.device] = None,
                 shape: Optional[Sequence[Optional[int]]] = None,
                 last_dim_contiguous: bool = False) -> torch.Tensor:
    """Check one tensor argument; ``shape`` entries of ``None`` match anything."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if t.dim() not in allowed:
            raise ValueError(f"{name} must have {' or '.join(map(str, allowed))} dims, "
                             f"got {describe(t)}")
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, "
                             f"got {describe(t)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (like q), got {describe(t)}")
    if shape is not None:
        if len(shape) != t.dim() or any(s is not None and s != d for s, d in zip(shape, t.shape)):
            want = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
            raise ValueError(f"{name} must have shape {want}, got {describe(t)}")
    if last_dim_contiguous and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dim (stride 1), got "
                         f"strides {t.stride()} with {describe(t)}")
    return t


def check_cu_seqlens(cu_seqlens_q: torch.Tensor, *,
                     device: Optional[torch.device] = None) -> int:
    """Check a ragged batch's ``cu_seqlens_q`` (``[B + 1]`` int32/int64); returns ``B``."""
    check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=INDEX_DTYPES, device=device)
    num_seqs = cu_seqlens_q.shape[0] - 1
    if num_seqs < 0:
        raise ValueError(f"cu_seqlens_q must hold B + 1 >= 1 entries, got "
                         f"{describe(cu_seqlens_q)}")
    return num_seqs


def check_kv_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, *, device: torch.device,
                    num_kv_heads: Optional[int] = None, head_dim: Optional[int] = None):
    """Validate a K/V cache pair given as canonical views.

    k_cache: ``[num_blocks, H, P, D]`` (any strides) or the 5-D split-x K cache
    ``[num_blocks, H, D // x, P, x]``; v_cache: ``[num_blocks, H, P, D]``.
    Returns ``(num_blocks, num_kv_heads, block_size, head_dim)``.
    """
    check_tensor("k_cache", k_cache, ndim=(4, 5), dtypes=KV_DTYPES, device=device)
    check_tensor("v_cache", v_cache, ndim=4, dtypes=KV_DTYPES, device=device)
    if k_cache.dim() == 5:
        n, h, dx, p, x = k_cache.shape
        k_shape = (n, h, p, dx * x)
        if x * k_cache.element_size() != 16:
            raise ValueError(f"k_cache (split-x, 5-D) needs x = 16 / element_size = "
                             f"{16 // k_cache.element_size()}, got x={x} with {describe(k_cache)}")
    else:
        k_shape = tuple(k_cache.shape)
    if k_shape[2] < 1:
        raise ValueError(f"page_size must be a positive int, got {k_shape[2]} (the caches' "
                         f"block_size axis: k_cache {describe(k_cache)})")
    if k_shape != tuple(v_cache.shape):
        raise ValueError(f"k_cache and v_cache must describe the same [num_blocks, kv_heads, "
                         f"block_size, head_dim], got k {k_shape} and v {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache must share a dtype, got {k_cache.dtype} and "
                         f"{v_cache.dtype}")
    if num_kv_heads is not None and k_shape[1] != num_kv_heads:
        raise ValueError(f"k_cache has {k_shape[1]} kv heads but {num_kv_heads} were expected "
                         f"({describe(k_cache)})")
    if head_dim is not None and k_shape[3] != head_dim:
        raise ValueError(f"k_cache head_dim {k_shape[3]} does not match the head_dim "
                         f"{head_dim} of the query/new keys ({describe(k_cache)})")
    return k_shape


def soft_cap_value(soft_cap) -> Optional[float]:
    """The logit soft cap of an attention op, one rule for every op, plan, layer binding
    and implementation: ``None`` or ``0`` (no cap, as the engines pass it) gives None; a
    finite float ``> 0`` is the cap; a negative, NaN or inf cap is a ``ValueError``."""
    if soft_cap is None:
        return None
    if isinstance(soft_cap, bool) or not isinstance(soft_cap, numbers.Real) or \
            not math.isfinite(soft_cap) or soft_cap < 0:
        raise ValueError(f"soft_cap must be a finite float >= 0 (0: no cap) or None, got "
                         f"{soft_cap!r}")
    return float(soft_cap) if soft_cap > 0 else None


def check_softmax_scale(scale) -> None:
    """The softmax scale of an attention op: ``None`` (``1 / sqrt(head_dim)``) or a finite
    real number ``> 0``; one rule for every op, plan, layer binding and implementation.
    A scale ``<= 0`` is no attention layer's (it flattens or inverts the softmax; the
    prefill kernel takes a tile's running max before scaling, which needs it positive),
    and NaN or inf give no defined logit."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise ValueError(f"scale must be a finite float > 0 or None, got "
                         f"{type(scale).__name__} {scale!r}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a finite float > 0 or None, got {scale!r}")


def check_scale(name: str, scale, cache_dtype: torch.dtype, device: torch.device, *,
                num_kv_heads: Optional[int] = None):
    """fp8 caches need a scale: per tensor (a float or a 1-element tensor) or, where the op
    passes ``num_kv_heads``, per KV head (a 1-D tensor of ``num_kv_heads`` elements);
    others accept None or a scale of 1. Returns the scale as a float32 tensor of 1 or
    ``num_kv_heads`` elements, or a float (kernels take either)."""
    if scale is None:
        return 1.0
    if isinstance(scale, torch.Tensor):
        per_head = (num_kv_heads is not None and num_kv_heads > 1 and scale.dim() == 1
                    and scale.numel() == num_kv_heads)
        if scale.numel() != 1 and not per_head:
            what = ("a float, a 1-element tensor or a 1-D tensor of num_kv_heads = "
                    f"{num_kv_heads} elements" if num_kv_heads is not None
                    else "a float or a 1-element tensor")
            raise ValueError(f"{name} must be {what}, got {describe(scale)}")
        if scale.device != device:
            raise ValueError(f"{name} must be on {device}, got {describe(scale)}")
        if not scale.dtype.is_floating_point:
            raise ValueError(f"{name} must be a floating-point tensor, got {describe(scale)}")
        return scale.reshape(-1).to(torch.float32).contiguous()
    return float(scale)


def scale_head_stride(scale: ScaleLike) -> int:
    """The element stride a kernel steps a scale by per KV head: 1 for a per-head tensor
    (more than one element), 0 for a per-tensor scale."""
    return 1 if isinstance(scale, torch.Tensor) and scale.numel() > 1 else 0


def check_block_ids(name: str, table: torch.Tensor, num_blocks: int, used: Optional[torch.Tensor] = None):
    """Debug-mode check that every used block id is in ``[0, num_blocks)``."""
    vals = table if used is None else table[used]
    if vals.numel() == 0:
        return
    lo, hi = int(vals.min()), int(vals.max())
    if lo < 0 or hi >= num_blocks:
        raise ValueError(f"{name} holds block ids in [{lo}, {hi}] but the cache has "
                         f"{num_blocks} blocks")


def check_used_block_ids(name: str, table: torch.Tensor, seq_lens: torch.Tensor,
                         num_blocks: int, page_size: int) -> None:
    """Debug-mode check of the table columns that ``seq_lens`` uses (one host sync):
    every id in ``[0, num_blocks)``. Unused columns may hold anything."""
    needed = (seq_lens.to(torch.int64).clamp(min=0) + page_size - 1) // page_size  # [B]
    cols = torch.arange(table.shape[1], device=table.device)
    check_block_ids(name, table, num_blocks, cols.unsqueeze(0) < needed.unsqueeze(1))


def check_prefill_plan(plan, *, total_q: int, num_seqs: int, device: torch.device) -> None:
    """A prefill plan must cover this batch: its tile map on ``device`` with at least
    ``cdiv(total_q, block_m // group) + num_seqs`` slots (fewer would leave rows unwritten)."""
    for name in ("tile_req", "tile_mblock"):
        check_tensor(f"plan.{name}", getattr(plan, name), ndim=1, dtypes=(torch.int32,),
                     device=device)
    need = -(-total_q // max(1, plan.block_m // plan.group)) + num_seqs
    if plan.tile_req.shape[0] < need or plan.tile_mblock.shape[0] < need:
        raise ValueError(f"plan too small: this batch needs {need} tile slots, the plan holds "
                         f"{plan.tile_req.shape[0]} (build it with plan_prefix_prefill for "
                         f"this batch)")
