"""The SGLang page table as an op: a batch's block table from its ``req_to_token`` rows.

SGLang keeps, per running request, one row of ``ReqToTokenPool.req_to_token``
(``[num_rows, max_context_len] int32``): entry ``j`` is the KV-pool location of token
``j``. With page size ``P`` the paged allocator hands out whole pages, so every entry of
one page shares ``loc // P``, and the block table our kernels read is
``block_table[b, p] = req_to_token[row_b, p * P] // P`` (``P == 1``: the row itself).
One Triton launch (``kernels/page_table.py``) reads exactly the ``B x num_blocks`` entries
it needs; without Triton a torch gather computes the same. The ``out=`` form has static
shapes, so it can be recorded in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch

from hygon_attn_backend.ops._dispatch import triton_runs_on

__all__ = ["req_to_token_table", "launch_req_to_token_table"]


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
    if triton_runs_on(req_to_token.device) and out.stride(1) == 1:
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


def launch_req_to_token_table(req_to_token, rows, out, *, page_size: int,
                              block: int = 256) -> None:
    """``out[b, j] = floor(req_to_token[rows[b], j * page_size] / page_size)`` for
    ``j < out.shape[1]``; a row outside ``[0, num_rows)`` is never read and gives ``-1``
    (absent blocks). ``rows``: ``[B]`` int32/int64; ``out``: ``[B, num_blocks]`` int32
    with unit column stride, ``num_blocks * page_size <= req_to_token.shape[1]``."""
    num_rows, num_blocks = out.shape
    if num_rows == 0 or num_blocks == 0:
        return
    from hygon_attn_backend.kernels.page_table import req_to_token_table_kernel

    grid = (num_rows, -(-num_blocks // block))
    req_to_token_table_kernel[grid](
        req_to_token_ptr=req_to_token, rows_ptr=rows, out_ptr=out,
        num_blocks=num_blocks, num_rows=req_to_token.shape[0],
        stride_r2t_row=req_to_token.stride(0), stride_r2t_col=req_to_token.stride(1),
        stride_out_row=out.stride(0),
        PAGE=page_size, BLOCK=block)
