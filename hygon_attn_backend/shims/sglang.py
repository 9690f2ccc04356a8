"""Adapters from SGLang's memory structures to what our kernels read.

SGLang keeps, per running request, one row of ``ReqToTokenPool.req_to_token``
(``[num_rows, max_context_len] int32``): entry ``j`` of a request's row is the KV-pool
location of its token ``j``. With page size ``P`` the paged allocator hands out whole pages,
so token ``j`` sits at ``loc = page * P + j % P`` and every entry of one page shares
``loc // P``. Our kernels read a block table ``[B, max_blocks] int32`` instead:

* ``P == 1``: the token-level table *is* the row (``block_table[b, j] = loc of token j``),
  read through the ``[rows, H, 1, D]`` view of the token pool;
* ``P > 1``: one entry per page, ``block_table[b, p] = req_to_token[row, p * P] // P``,
  read through the ``[pages, H, P, D]`` view of the pool (NHD or HND storage alike).

Everything here is vectorised torch (gathers, strided slices, cumsums): no Python loop
over requests or tokens, no host synchronisation unless a size has to be inferred, and
the ``out=`` forms have static shapes so they can be recorded in a CUDA graph. Nothing of
SGLang's radix tree or allocators is touched: these functions only read.

The ``kv_indptr`` / ``kv_indices`` helpers convert between the ragged form SGLang's
Triton backend (and FlashInfer) use and our padded block tables.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from hygon_attn_backend import layouts

__all__ = [
    "req_to_token_table",
    "req_to_token_kv_indices",
    "kv_indices_to_block_table",
    "block_table_to_kv_indices",
    "check_paged_rows",
    "pool_kv_views",
]


def _check_int_tensor(name: str, t: torch.Tensor, ndim: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")


def req_to_token_table(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, *,
                       page_size: int = 1, num_blocks: Optional[int] = None,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Block table of a batch from its ``req_to_token`` rows.

    req_to_token: ``[num_rows, max_context_len]`` int32, SGLang's ``ReqToTokenPool.req_to_token``.
    req_pool_indices: ``[B]`` int32/int64, the batch's rows.
    page_size: the pool's page size ``P`` (1: token-level table).
    num_blocks: table width; default every block a row can hold
        (``ceil(max_context_len / P)``). Entries past a request's length are whatever the
        row holds there (valid pool locations or 0); kernels never read them.
    out: optional ``[B, num_blocks]`` int32 destination (static shape: CUDA-graph safe).

    Returns ``block_table [B, num_blocks]`` int32: ``block_table[b, j] =
    req_to_token[row_b, j]`` for ``P == 1``, ``req_to_token[row_b, j * P] // P`` for ``P > 1``.
    """
    _check_int_tensor("req_to_token", req_to_token, 2)
    _check_int_tensor("req_pool_indices", req_pool_indices, 1)
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    max_blocks = -(-req_to_token.shape[1] // page_size)
    if num_blocks is None:
        num_blocks = out.shape[1] if out is not None else max_blocks
    if not 0 <= num_blocks <= max_blocks:
        raise ValueError(f"num_blocks must be in [0, {max_blocks}] for req_to_token of shape "
                         f"{tuple(req_to_token.shape)} and page_size {page_size}, got {num_blocks}")
    rows = req_pool_indices.to(device=req_to_token.device)
    if out is None:
        out = torch.empty((rows.shape[0], num_blocks), dtype=torch.int32,
                          device=req_to_token.device)
    elif out.shape != (rows.shape[0], num_blocks) or out.dtype != torch.int32:
        raise ValueError(f"out must be int32 of shape {(rows.shape[0], num_blocks)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    from hygon_attn_backend.ops._dispatch import triton_runs_on

    if triton_runs_on(req_to_token.device) and out.stride(1) == 1:
        from hygon_attn_backend.kernels.page_table import launch_req_to_token_table

        # one launch reading only the B x num_blocks entries it needs
        launch_req_to_token_table(req_to_token, rows, out, page_size=page_size)
        return out
    # [B, max_context_len] -> first entry of each page: [B, num_blocks]
    firsts = req_to_token.index_select(0, rows.long())[:, : num_blocks * page_size : page_size]
    if page_size == 1:
        out.copy_(firsts)
    else:
        out.copy_(torch.div(firsts, page_size, rounding_mode="floor"))
    return out


def req_to_token_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                            seq_lens: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """SGLang's token-level ragged form of a batch: ``(kv_indptr, kv_indices)``.

    req_to_token: ``[num_rows, max_context_len]`` int32; req_pool_indices: ``[B]``;
    seq_lens: ``[B]`` int key lengths. Returns ``kv_indptr [B + 1]`` int32 (cumulative
    lengths, starting at 0) and ``kv_indices [sum(seq_lens)]`` int64, the pool locations of
    every request's tokens back to back (what SGLang's Triton backend builds). Sizes the
    output from ``seq_lens`` (one host synchronisation).
    """
    _check_int_tensor("req_to_token", req_to_token, 2)
    _check_int_tensor("req_pool_indices", req_pool_indices, 1)
    _check_int_tensor("seq_lens", seq_lens, 1)
    lens = seq_lens.to(device=req_to_token.device, dtype=torch.long)
    width = int(lens.max().item()) if lens.numel() else 0
    rows = req_pool_indices.to(device=req_to_token.device, dtype=torch.long)
    table = req_to_token.index_select(0, rows)[:, :width]  # [B, width]
    cols = torch.arange(width, device=req_to_token.device)
    valid = cols.unsqueeze(0) < lens.unsqueeze(1)  # [B, width], row-major = ragged order
    kv_indices = table[valid].to(torch.int64)
    kv_indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=req_to_token.device)
    kv_indptr[1:] = torch.cumsum(lens, 0)
    return kv_indptr, kv_indices


def kv_indices_to_block_table(kv_indptr: torch.Tensor, kv_indices: torch.Tensor, *,
                              max_blocks: Optional[int] = None, pad_value: int = 0
                              ) -> torch.Tensor:
    """Padded block table from a ragged ``(kv_indptr, kv_indices)`` pair.

    kv_indptr: ``[B + 1]`` int, non-decreasing, ``kv_indptr[0] == 0``.
    kv_indices: ``[kv_indptr[B]]`` int: token locations (page size 1) or page ids (paged
        form); request ``b`` owns ``kv_indices[kv_indptr[b]:kv_indptr[b + 1]]``.
    max_blocks: table width (default: the longest request; one host synchronisation).
    pad_value: written past each request's end (a valid block id: 0 is SGLang's padding slot).

    Returns ``block_table [B, max_blocks]`` int32.
    """
    _check_int_tensor("kv_indptr", kv_indptr, 1)
    _check_int_tensor("kv_indices", kv_indices, 1)
    if kv_indptr.numel() < 1:
        raise ValueError("kv_indptr must hold at least one element (B + 1)")
    device = kv_indices.device
    starts = kv_indptr[:-1].to(device=device, dtype=torch.long)
    lens = kv_indptr[1:].to(device=device, dtype=torch.long) - starts
    if max_blocks is None:
        max_blocks = int(lens.max().item()) if lens.numel() else 0
    cols = torch.arange(max_blocks, device=device)
    valid = cols.unsqueeze(0) < lens.unsqueeze(1)  # [B, max_blocks]
    table = torch.full((lens.numel(), max_blocks), pad_value, dtype=torch.int32, device=device)
    if kv_indices.numel():
        src = (starts.unsqueeze(1) + cols.unsqueeze(0)).clamp_(max=kv_indices.numel() - 1)
        table = torch.where(valid, kv_indices[src].to(torch.int32), table)
    return table


def block_table_to_kv_indices(block_table: torch.Tensor, num_blocks: torch.Tensor
                              ) -> Tuple[torch.Tensor, torch.Tensor]:
    """Ragged ``(kv_indptr, kv_indices)`` from a padded block table.

    block_table: ``[B, max_blocks]`` int; num_blocks: ``[B]`` int, the used entries of
    each row (the sequence lengths for a token-level table, ``ceil(len / P)`` for a page
    table). Returns ``kv_indptr [B + 1]`` int32 and ``kv_indices [sum(num_blocks)]`` int64.
    """
    _check_int_tensor("block_table", block_table, 2)
    _check_int_tensor("num_blocks", num_blocks, 1)
    if num_blocks.shape[0] != block_table.shape[0]:
        raise ValueError(f"num_blocks must have {block_table.shape[0]} entries (one per row of "
                         f"block_table), got shape {tuple(num_blocks.shape)}")
    device = block_table.device
    lens = num_blocks.to(device=device, dtype=torch.long)
    cols = torch.arange(block_table.shape[1], device=device)
    valid = cols.unsqueeze(0) < lens.unsqueeze(1)
    kv_indices = block_table[valid].to(torch.int64)
    kv_indptr = torch.zeros(lens.numel() + 1, dtype=torch.int32, device=device)
    kv_indptr[1:] = torch.cumsum(lens.clamp(max=block_table.shape[1]), 0)
    return kv_indptr, kv_indices


def check_paged_rows(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, *, page_size: int) -> None:
    """Raise ValueError unless every request's row is page-contiguous.

    The page-table form assumes what SGLang's paged allocator guarantees: within a
    request, token ``j`` sits at ``req_to_token[row, (j // P) * P] // P * P + j % P``.
    A debugging aid (one host synchronisation); the backend runs it when
    ``HYGON_SGLANG_CHECK_PAGES=1``.
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
