"""SGLang's memory structures as what our ops read: the batch's block table
(:func:`ops.page_table.req_to_token_table`), the pool's per-layer K/V views, and the
page-contiguity check ``HYGON_ATTN_DEBUG=1`` turns on. Nothing of SGLang's radix tree or
allocators is touched: these functions only read.
"""

from __future__ import annotations

from typing import Tuple

import torch

from hygon_attn_backend import layouts
from hygon_attn_backend.ops.page_table import req_to_token_table

__all__ = ["req_to_token_table", "check_paged_rows", "pool_kv_views"]


def check_paged_rows(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, *, page_size: int) -> None:
    """Raise ValueError unless every request's row is page-contiguous.

    The page-table form assumes what SGLang's paged allocator guarantees: within a
    request, token ``j`` sits at ``req_to_token[row, (j // P) * P] // P * P + j % P``.
    A debugging aid (one host synchronisation); the backend runs it when
    ``HYGON_ATTN_DEBUG=1``.
    """
    lens = seq_lens.to(device=req_to_token.device, dtype=torch.long)
    width = int(lens.max().item()) if lens.numel() else 0
    if width == 0:
        return
    rows = req_pool_indices.to(device=req_to_token.device, dtype=torch.long)
    locs = req_to_token.index_select(0, rows)[:, :width].to(torch.long)  # [B, width]
    cols = torch.arange(width, device=req_to_token.device)
    firsts = locs[:, (cols // page_size) * page_size]
    expect = torch.div(firsts, page_size, rounding_mode="floor") * page_size + cols % page_size
    bad = (locs != expect) & (cols.unsqueeze(0) < lens.unsqueeze(1))
    if bool(bad.any()):
        b, j = (int(x) for x in bad.nonzero()[0])
        raise ValueError(f"req_to_token row {int(rows[b])} is not page-contiguous for page_size "
                         f"{page_size}: token {j} is at {int(locs[b, j])}, expected "
                         f"{int(expect[b, j])}")


def pool_kv_views(pool, layer_id: int) -> Tuple[torch.Tensor, torch.Tensor, int]:
    """Canonical ``[num_blocks, H, P, D]`` K and V views of one layer of an SGLang
    ``MHATokenToKVPool`` (no copy), and the block size they use.

    NHD pool (``[size + P, H, D]`` per layer): ``layouts`` ``sglang_nhd`` with block size
    ``P`` (rows past the last whole page are never addressed and are left out).
    HND pool (``SGLANG_USE_HND_KVCACHE``, ``[num_pages, H, P, D]``): ``sglang_hnd``.
    fp8 pools are returned in their fp8 dtype (the pool's own ``get_key_buffer`` view).
    """
    layout = getattr(pool, "kv_cache_layout", "nhd")
    page_size = int(getattr(pool, "page_size", 1) or 1)
    k_buf = pool.get_key_buffer(layer_id)
    v_buf = pool.get_value_buffer(layer_id)
    if layout == "hnd":
        return (layouts.view(k_buf, "sglang_hnd"), layouts.view(v_buf, "sglang_hnd"), page_size)
    if layout != "nhd":
        raise ValueError(f"SGLang pool layout {layout!r} is not supported by the hygon backend "
                         "(supported: 'nhd', 'hnd')")
    rows = k_buf.shape[0] // page_size * page_size
    return (layouts.view(k_buf[:rows], "sglang_nhd", block_size=page_size),
            layouts.view(v_buf[:rows], "sglang_nhd", block_size=page_size), page_size)
