"""Public cache ops: ``write_kv`` (scatter new tokens into the paged cache) and
``copy_blocks`` (copy-on-write of whole blocks).

Both work on every layout of DESIGN.md because they address the cache only through its
strides: pass the canonical ``[num_blocks, kv_heads, P, D]`` views (``layouts`` builds
them from each engine's storage) to ``write_kv``, and the storage tensors (dim 0 = block)
to ``copy_blocks``.
"""

from __future__ import annotations

from typing import Optional

import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops import _checks
from hygon_attn_backend.ops._device import gpu_is_hip
from hygon_attn_backend.ops._dispatch import select_impl
from hygon_attn_backend.ops.cache import native, tuning
from hygon_attn_backend.ops.cache.plan import WritePlan, plan_write_kv

__all__ = ["write_kv", "copy_blocks"]

ScaleLike = _checks.ScaleLike

# copy_blocks moves raw bits: a same-width integer view of every cache dtype.
_BITS_DTYPE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _kernels():
    # Imported on first use: importing Triton kernels is not free, and TRITON_INTERPRET
    # must be set before the @triton.jit decorators run.
    from hygon_attn_backend.kernels import cache as cache_kernels
    return cache_kernels


def _check_no_zero_strides(name: str, t: torch.Tensor) -> None:
    """A written tensor must not alias itself: no stride 0 on an axis longer than 1."""
    for axis, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if size > 1 and stride == 0:
            raise ValueError(f"{name} has stride 0 on axis {axis} (a broadcast view: several "
                             f"elements share one address), got strides {t.stride()} with "
                             f"{_checks.describe(t)}")


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale: ScaleLike = None,
             v_scale: ScaleLike = None, plan: Optional[WritePlan] = None,
             impl: str = "auto") -> None:
    """Write the new tokens' K and V into the paged cache, in place.

    k, v: ``[num_tokens, num_kv_heads, D]`` float16 / bfloat16 / float32, any strides.
    k_cache, v_cache: ``[num_blocks, num_kv_heads, P, D]`` views with any strides (bshd,
       bhsd, V-transposed bhds, the K and V halves of vLLM's combined cache and SGLang's
       pools are all stride patterns of this view), same dtype: float16 / bfloat16 /
       float32 / float8_e4m3fn / float8_e5m2. K may instead be vLLM's split-x K cache
       ``[num_blocks, num_kv_heads, D // x, P, x]`` with ``x = 16 / element_size``.
    slot_mapping: ``[num_tokens]`` int32 / int64 (any stride). Token ``i`` goes to block
       ``slot_mapping[i] // P``, offset ``slot_mapping[i] % P``; ``-1`` marks padding and
       is skipped (nothing is written). The kernel never writes outside the cache: any slot
       outside ``[0, num_blocks * P)`` is skipped; with ``HYGON_ATTN_DEBUG=1`` such slots
       (other than ``-1``) raise ``ValueError`` before launch.
    k_scale, v_scale: scales of fp8 caches on the cache's device (default 1): per tensor
       (a float or a 1-element float32 tensor) or per KV head (``[num_kv_heads]`` float32):
       the cache stores ``k / k_scale`` (head ``h``: ``k[:, h] / k_scale[h]``) saturated to
       the format's finite range. Ignored for other cache dtypes (plain cast).
    plan: a :func:`plan_write_kv` result for this batch's ``slot_mapping`` (built once per
       step, reused by every layer): only the shapes a layer can change are checked.
    impl: ``"auto"`` | ``"triton"`` | ``"native"`` | ``"reference"``.

    Distinct tokens must map to distinct slots (which one wins otherwise is undefined).
    """
    if plan is not None:
        if not isinstance(plan, WritePlan):
            raise ValueError(f"plan must be a WritePlan (plan_write_kv), got "
                             f"{type(plan).__name__}")
        plan.check_call(k, v, k_cache, v_cache, slot_mapping)
        plan.run(k, v, k_cache, v_cache, k_scale=k_scale, v_scale=v_scale)
        return
    _checks.check_tensor("k", k, ndim=3, dtypes=_checks.Q_DTYPES)
    num_tokens, num_kv_heads, head_dim = k.shape
    device = k.device
    _checks.check_tensor("v", v, dtypes=_checks.Q_DTYPES, device=device,
                         shape=(num_tokens, num_kv_heads, head_dim))
    _checks.check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=_checks.INDEX_DTYPES,
                         device=device, shape=(num_tokens,))
    num_blocks, _, page_size, _ = _checks.check_kv_caches(
        k_cache, v_cache, device=device, num_kv_heads=num_kv_heads, head_dim=head_dim)
    _check_no_zero_strides("k_cache", k_cache)
    _check_no_zero_strides("v_cache", v_cache)
    k_scale = _checks.check_scale("k_scale", k_scale, k_cache.dtype, device,
                                  num_kv_heads=num_kv_heads)
    v_scale = _checks.check_scale("v_scale", v_scale, v_cache.dtype, device,
                                  num_kv_heads=num_kv_heads)
    if _checks.debug_enabled() and num_tokens:
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= num_blocks * page_size:
            raise ValueError(f"slot_mapping holds slots in [{lo}, {hi}] but the cache has "
                             f"{num_blocks} blocks x {page_size} = {num_blocks * page_size} "
                             f"slots (-1 marks padding)")
    plan = plan_write_kv(slot_mapping, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         page_size=page_size, impl=impl)
    plan.run(k, v, k_cache, v_cache, k_scale=k_scale, v_scale=v_scale)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_inner_axes(name: str, cache: torch.Tensor) -> tuple[list[int], list[int]]:
    """The axes after dim 0 as ``(sizes, strides)``: size-1 axes dropped, ordered by
    decreasing stride, adjacent axes merged where one is the contiguous continuation of
    the other, padded to four axes with trailing size-1 axes. A block is a set of
    elements, so the order in which they are visited does not change the copy, only how
    coalesced it is."""
    axes = [(s, st) for s, st in zip(cache.shape[1:], cache.stride()[1:]) if s != 1]
    for size, stride in axes:
        if stride == 0:
            raise ValueError(f"{name} has stride 0 on an axis of size {size} (a broadcast "
                             f"view), got strides {cache.stride()} with "
                             f"{_checks.describe(cache)}")
    axes.sort(key=lambda a: -a[1])
    merged: list[tuple[int, int]] = []
    for size, stride in axes:
        if merged and merged[-1][1] == stride * size:
            merged[-1] = (merged[-1][0] * size, stride)
        else:
            merged.append((size, stride))
    if len(merged) > 4:
        raise ValueError(f"{name}: a block must be addressable with at most 4 strided axes, "
                         f"got strides {cache.stride()} with {_checks.describe(cache)}")
    # Pad at the end: size-1 trailing axes make the kernel's div/mod by them fold away
    # (Triton specialises arguments equal to 1), so one contiguous axis costs none.
    merged = merged + [(1, 0)] * (4 - len(merged))
    return [s for s, _ in merged], [st for _, st in merged]


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor, block_mapping: torch.Tensor,
                *, impl: str = "auto") -> None:
    """Copy whole blocks of both caches (copy-on-write of a forked tail block), in place:
    ``cache[dst] = cache[src]`` for every row ``(src, dst)`` of ``block_mapping``.

    k_cache, v_cache: the caches' storage tensors, any dtype of the KV cache, any layout
       whose dim 0 is the block (2 to 5 dims: bshd, bhsd, V-transposed, the 5-D split-x K
       cache, per-layer views of vLLM's combined cache that are non-contiguous across
       dim 0, ...). Both must have the same number of blocks. Blocks are copied bit-exact.
    block_mapping: ``[n, 2]`` int32 / int64 (src, dst) block ids, on the caches' device.

    Semantics are those of ``reference.copy_blocks``: all sources are read before any
    destination is written. The kernel copies every pair concurrently, so it requires the
    set of destinations to be disjoint from the set of sources and the destinations to be
    distinct (a source may be copied to several destinations). This is what a block
    manager's copy-on-write produces (a fresh block per forked tail). With
    ``HYGON_ATTN_DEBUG=1`` this and the id range ``[0, num_blocks)`` are checked on the
    host before launch (``ValueError``); without it, out-of-range pairs are skipped by the
    kernel, never read or written, and overlapping src/dst sets give an undefined result.
    impl: ``"auto"`` | ``"triton"`` | ``"native"`` | ``"reference"``.
    """
    _checks.check_tensor("k_cache", k_cache, ndim=(2, 3, 4, 5), dtypes=_checks.KV_DTYPES)
    device = k_cache.device
    _checks.check_tensor("v_cache", v_cache, ndim=(2, 3, 4, 5), dtypes=_checks.KV_DTYPES,
                         device=device)
    if k_cache.shape[0] != v_cache.shape[0]:
        raise ValueError(f"k_cache and v_cache must have the same number of blocks (dim 0), "
                         f"got k {_checks.describe(k_cache)} and v {_checks.describe(v_cache)}")
    _checks.check_tensor("block_mapping", block_mapping, ndim=2, dtypes=_checks.INDEX_DTYPES,
                         device=device, shape=(None, 2))
    num_blocks = k_cache.shape[0]
    if num_blocks > 1:
        for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            if cache.stride(0) == 0:
                raise ValueError(f"{name} has stride 0 on its block axis, got strides "
                                 f"{cache.stride()} with {_checks.describe(cache)}")
    k_axes = _block_inner_axes("k_cache", k_cache)
    v_axes = _block_inner_axes("v_cache", v_cache)
    num_pairs = block_mapping.shape[0]
    chosen = select_impl(impl, device,
                         native_preferred=tuning.native_preferred(is_hip=gpu_is_hip()))
    if _checks.debug_enabled() and num_pairs:
        _check_block_mapping(block_mapping, num_blocks, disjoint=chosen != "reference")

    if chosen == "reference":
        reference.copy_blocks(k_cache, v_cache, block_mapping)
        return
    if num_pairs == 0:
        return
    kernel = _kernels().copy_blocks_kernel
    for cache, (sizes, strides) in ((k_cache, k_axes), (v_cache, v_axes)):
        numel_inner = 1
        for s in sizes:
            numel_inner *= s
        if numel_inner == 0:
            continue
        if chosen == "native":
            native.copy_blocks(cache, block_mapping, sizes, strides)
            continue
        block, num_warps = tuning.copy_blocks_config(numel_inner)
        bits = cache.view(_BITS_DTYPE[cache.element_size()])
        grid = (num_pairs, _cdiv(numel_inner, block))
        kernel[grid](
            cache_ptr=bits, block_mapping_ptr=block_mapping,
            num_blocks=num_blocks, numel_inner=numel_inner,
            stride_map_n=block_mapping.stride(0), stride_map_c=block_mapping.stride(1),
            stride_blk=cache.stride(0),
            size_1=sizes[0], size_2=sizes[1], size_3=sizes[2], size_4=sizes[3],
            stride_1=strides[0], stride_2=strides[1], stride_3=strides[2],
            stride_4=strides[3],
            BLOCK=block, num_warps=num_warps,
        )


def _check_block_mapping(block_mapping: torch.Tensor, num_blocks: int, *,
                         disjoint: bool) -> None:
    """Debug-mode host checks: ids in range, distinct destinations, and (for the kernel)
    sources disjoint from destinations."""
    _checks.check_block_ids("block_mapping", block_mapping, num_blocks)
    pairs = block_mapping.to("cpu", torch.long)
    src, dst = pairs[:, 0], pairs[:, 1]
    if torch.unique(dst).numel() != dst.numel():
        raise ValueError(f"block_mapping destinations must be distinct, got dst "
                         f"{dst.tolist()[:16]} ({_checks.describe(block_mapping)})")
    both = sorted(set(src.tolist()) & set(dst.tolist())) if disjoint else []
    if both:
        raise ValueError(f"block_mapping sources and destinations must be disjoint for the "
                         f"kernel (all pairs are copied concurrently); blocks {both[:16]} are "
                         f"both ({_checks.describe(block_mapping)})")
