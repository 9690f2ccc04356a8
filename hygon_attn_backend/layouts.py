"""KV cache layouts as stride patterns over one canonical view.

Every kernel reads K and V through views indexed ``[block, kv_head, slot, dim]`` (the
*canonical view*, ``[num_blocks, num_kv_heads, block_size, head_dim]``) with arbitrary
strides, so a layout is only a permutation of the storage axes and no transpose copy is
ever made. This module allocates each layout, produces the canonical views, and
converts between layouts.

Address math (P = physical block number, B = block size, H = kv heads, D = head_dim,
``off`` = slot inside the block, ``h`` = head, ``d`` = channel), in elements:

=============  ==============================================  =============================
layout         storage                                         element offset
=============  ==============================================  =============================
``bshd``       ``[num_blocks, B, H, D]``                        ``((P*B + off)*H + h)*D + d``
``bhsd``       ``[num_blocks, H, B, D]``                        ``((P*H + h)*B + off)*D + d``
``bhds``       ``[num_blocks, H, D, B]`` (V transposed)         ``((P*H + h)*D + d)*B + off``
``split_x``    ``[num_blocks, H, D//x, B, x]`` (legacy K)       ``(((P*H + h)*(D//x) + d//x)*B + off)*x + d%x``
``sglang_nhd`` ``[rows, H, D]``, rows = num_blocks*B (token)    ``((P*B + off)*H + h)*D + d`` (= bshd)
``sglang_hnd`` ``[num_pages, H, B, D]``                         ``((P*H + h)*B + off)*D + d`` (= bhsd)
``vllm``       one K|V tensor, logical ``[num_blocks, H, B, 2D]``, physical order per vLLM's
               ``KVCacheLayout`` (``LBHNC``: ``[N, H, B, 2D]``; ``LBNHC``: ``[N, B, H, 2D]``);
               K is ``[..., :D]``, V is ``[..., D:]``. For ``LBNHC`` with L layers outermost:
               K ``((P*B + off)*H + h)*2D + d``, V the same ``+ D``.
=============  ==============================================  =============================

``x = 16 // element_size`` for ``split_x`` (8 for fp16/bf16): it is not a stride
pattern of the canonical view, so kernels take it as a 5-D tensor on a constexpr path.

SGLang's token pool with page size 1 is ``bshd`` with ``B = 1``; with page size P its
rows group into pages of P consecutive slots. vLLM's cross-layer orders (``BLHNC`` ...)
give per-layer views whose block stride spans all layers: still a stride pattern.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = [
    "LAYOUTS",
    "VLLM_ORDERS",
    "storage_shape",
    "allocate",
    "view",
    "kv_views",
    "vllm_kv_views",
    "allocate_vllm",
    "convert",
    "convert_pair_to_vllm",
    "split_x_factor",
]

# layout -> permutation taking storage axes to canonical [block, head, slot, dim]
_PERMUTE = {
    "bshd": (0, 2, 1, 3),
    "bhsd": (0, 1, 2, 3),
    "bhds": (0, 1, 3, 2),
    "sglang_hnd": (0, 1, 2, 3),
}
LAYOUTS = ("bshd", "bhsd", "bhds", "split_x", "sglang_nhd", "sglang_hnd", "vllm")

# vLLM 0.3x KVCacheLayout names (vllm/v1/kv_cache_layout.py): each is the physical order of
# the logical axes [L, B, H, N, C] (L layer, B block, H head, N slot, C = 2*head_dim).
VLLM_ORDERS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


def split_x_factor(dtype: torch.dtype) -> int:
    """``x`` of vLLM's legacy split-x K cache: 16 bytes of elements."""
    size = torch.empty((), dtype=dtype).element_size()
    return max(1, 16 // size)


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def storage_shape(layout: str, *, num_blocks: int, block_size: int, num_kv_heads: int,
                  head_dim: int, dtype: torch.dtype = torch.float16) -> Tuple[int, ...]:
    """Shape of one cache tensor of ``layout`` (for ``vllm``, the combined K|V tensor in
    its ``LBHNC`` order; see :func:`allocate_vllm` for the others)."""
    _check_layout(layout)
    n, b, h, d = num_blocks, block_size, num_kv_heads, head_dim
    if layout == "bshd":
        return (n, b, h, d)
    if layout in ("bhsd", "sglang_hnd"):
        return (n, h, b, d)
    if layout == "bhds":
        return (n, h, d, b)
    if layout == "split_x":
        x = split_x_factor(dtype)
        if d % x:
            raise ValueError(f"head_dim {d} is not a multiple of split-x factor {x} for {dtype}")
        return (n, h, d // x, b, x)
    if layout == "sglang_nhd":
        return (n * b, h, d)
    return (n, h, b, 2 * d)  # vllm, LBHNC


def allocate(layout: str, *, num_blocks: int, block_size: int, num_kv_heads: int,
             head_dim: int, dtype: torch.dtype, device="cpu",
             fill: Optional[str] = "randn") -> torch.Tensor:
    """Allocate one cache tensor of ``layout``.

    fill: ``"randn"`` (default; tests never run on zeros), ``"empty"`` or ``"zeros"``.
    fp8 dtypes are filled by casting a float32 normal sample.
    """
    shape = storage_shape(layout, num_blocks=num_blocks, block_size=block_size,
                          num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    if fill == "randn":
        return torch.randn(shape, dtype=torch.float32, device=device).to(dtype)
    if fill == "zeros":
        return torch.zeros(shape, dtype=dtype, device=device)
    if fill in (None, "empty"):
        return torch.empty(shape, dtype=dtype, device=device)
    raise ValueError(f"fill must be 'randn', 'zeros' or 'empty', got {fill!r}")


def view(storage: torch.Tensor, layout: str, *, block_size: Optional[int] = None
         ) -> torch.Tensor:
    """Canonical ``[num_blocks, num_kv_heads, block_size, head_dim]`` view of one cache
    tensor (no copy).

    storage: a tensor of ``layout`` (see the module table). ``sglang_nhd`` needs
    ``block_size`` (SGLang's page size; 1 for its token-level pool) and ``rows`` divisible
    by it. ``split_x`` is returned unchanged (5-D): kernels take it as is. ``vllm`` is a
    combined tensor: use :func:`vllm_kv_views`.
    """
    _check_layout(layout)
    if layout in _PERMUTE:
        if storage.dim() != 4:
            raise ValueError(f"storage for layout {layout!r} must be 4-D, got shape "
                             f"{tuple(storage.shape)}")
        return storage.permute(*_PERMUTE[layout])
    if layout == "split_x":
        if storage.dim() != 5:
            raise ValueError(f"storage for layout 'split_x' must be 5-D, got shape "
                             f"{tuple(storage.shape)}")
        return storage
    if layout == "sglang_nhd":
        if storage.dim() != 3:
            raise ValueError(f"storage for layout 'sglang_nhd' must be [rows, H, D], got shape "
                             f"{tuple(storage.shape)}")
        page = 1 if block_size is None else int(block_size)
        rows, h, d = storage.shape
        if page < 1 or rows % page:
            raise ValueError(f"block_size {block_size} must be >= 1 and divide the pool's "
                             f"{rows} rows")
        return storage.view(rows // page, page, h, d).permute(0, 2, 1, 3)
    raise ValueError("layout 'vllm' holds K and V in one tensor: use vllm_kv_views()")


def vllm_kv_views(kv_cache: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """K and V canonical views of vLLM's combined per-layer cache (no copy).

    kv_cache: logical ``[num_blocks, num_kv_heads, block_size, 2 * head_dim]`` in any
    physical order (the per-layer view vLLM hands to a backend's ``forward``).
    Returns ``(kv_cache[..., :D], kv_cache[..., D:])``.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
        raise ValueError(f"kv_cache must be [num_blocks, kv_heads, block_size, 2*head_dim], "
                         f"got shape {tuple(kv_cache.shape)}")
    d = kv_cache.shape[-1] // 2
    return kv_cache[..., :d], kv_cache[..., d:]


def allocate_vllm(order: str, *, num_layers: int, num_blocks: int, block_size: int,
                  num_kv_heads: int, head_dim: int, dtype: torch.dtype, device="cpu"
                  ) -> list:
    """Allocate a multi-layer vLLM cache in physical ``order`` (a ``KVCacheLayout`` name)
    and return its per-layer logical ``[num_blocks, H, block_size, 2D]`` views."""
    if order not in VLLM_ORDERS:
        raise ValueError(f"order must be one of {VLLM_ORDERS}, got {order!r}")
    logical = {"L": num_layers, "B": num_blocks, "H": num_kv_heads, "N": block_size,
               "C": 2 * head_dim}
    physical = torch.randn([logical[a] for a in order], dtype=torch.float32,
                           device=device).to(dtype)
    # permute physical -> logical [L, B, H, N, C]
    perm = [order.index(a) for a in "LBHNC"]
    logical_view = physical.permute(*perm)
    return [logical_view[i] for i in range(num_layers)]


def kv_views(layout: str, k_storage: torch.Tensor, v_storage: Optional[torch.Tensor] = None,
             *, block_size: Optional[int] = None, v_layout: Optional[str] = None):
    """Canonical ``(k_view, v_view)`` for any engine's storage.

    ``layout="vllm"``: ``k_storage`` is the combined tensor and ``v_storage`` must be None.
    Otherwise K and V are separate tensors; ``v_layout`` defaults to ``layout`` (DCU and
    old vLLM pair a ``split_x`` K with a ``bhds`` V).
    """
    if layout == "vllm":
        if v_storage is not None:
            raise ValueError("layout 'vllm' takes one combined tensor; v_storage must be None")
        return vllm_kv_views(k_storage)
    if v_storage is None:
        raise ValueError(f"layout {layout!r} needs v_storage")
    return (view(k_storage, layout, block_size=block_size),
            view(v_storage, v_layout or layout, block_size=block_size))


def _canonical_copy(t: torch.Tensor) -> torch.Tensor:
    """Canonical-view contents of a view (4-D) or split-x K cache (5-D)."""
    if t.dim() == 5:
        n, h, dx, b, x = t.shape
        return t.permute(0, 1, 3, 2, 4).reshape(n, h, b, dx * x)
    return t


def convert(canonical: torch.Tensor, layout: str) -> torch.Tensor:
    """Storage of ``layout`` holding the same cache as ``canonical``.

    canonical: ``[num_blocks, H, B, D]`` view (any strides) or a 5-D split-x K cache.
    Returns a view of the same memory when the strides already match ``layout`` (for
    example converting a ``bshd`` view back to ``bshd``), otherwise a new tensor.
    ``vllm`` holds K and V together: use :func:`convert_pair_to_vllm`.
    """
    _check_layout(layout)
    src = _canonical_copy(canonical)
    n, h, b, d = src.shape
    if layout in _PERMUTE:
        inv = _inverse(_PERMUTE[layout])
        out = src.permute(*inv)
        return out if out.is_contiguous() else out.contiguous()
    if layout == "split_x":
        x = split_x_factor(src.dtype)
        if d % x:
            raise ValueError(f"head_dim {d} is not a multiple of split-x factor {x}")
        return src.reshape(n, h, b, d // x, x).permute(0, 1, 3, 2, 4).contiguous()
    if layout == "sglang_nhd":
        out = src.permute(0, 2, 1, 3)
        out = out if out.is_contiguous() else out.contiguous()
        return out.reshape(n * b, h, d)
    raise ValueError("layout 'vllm' combines K and V: use convert_pair_to_vllm(k, v)")


def convert_pair_to_vllm(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Combined vLLM ``LBHNC`` tensor ``[num_blocks, H, B, 2D]`` from canonical K and V."""
    return torch.cat([_canonical_copy(k), v], dim=-1).contiguous()


def _inverse(perm):
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return tuple(inv)
