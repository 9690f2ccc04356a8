"""Page addressing helpers of the prefix-prefill kernel (``@triton.jit`` bodies only).

The KV cache is read through the canonical view ``[num_blocks, num_kv_heads, P, D]`` with
arbitrary strides. Token ``t`` of a request lives at ``page = block_table[t // P]``,
``slot = t % P``. The helpers return the int64 offset of each token's row inside the view
(the kv-head offset is already in the base pointer); the caller adds ``offs_d * stride_d``.
"""

import triton
import triton.language as tl


@triton.jit
def paged_row_offsets(block_table_row_ptr, pos, stride_block, stride_slot,
                      PAGE_SIZE: tl.constexpr, MASKED: tl.constexpr, pos_limit):
    """Row offsets of arbitrary token positions (one table entry per token).

    pos: ``[BLOCK_N]`` int32 token positions inside the request. With ``MASKED`` the table
    is read only where ``pos < pos_limit`` (the tile's tail may run past the request).
    Returns ``[BLOCK_N]`` int64 offsets ``page * stride_block + slot * stride_slot``.
    Works for every ``P >= 1`` (``P = 1``: one table entry per token, SGLang's layout).
    """
    if MASKED:
        page = tl.load(block_table_row_ptr + pos // PAGE_SIZE, mask=pos < pos_limit, other=0)
    else:
        page = tl.load(block_table_row_ptr + pos // PAGE_SIZE)
    slot = pos % PAGE_SIZE
    return page.to(tl.int64) * stride_block + slot.to(tl.int64) * stride_slot


@triton.jit
def paged_tile_offsets(block_table_row_ptr, start, offs_n, stride_block, stride_slot,
                       PAGE_SIZE: tl.constexpr):
    """Row offsets of a tile ``[start, start + BLOCK_N)`` that lies inside one page.

    Caller guarantees ``start % BLOCK_N == 0`` and ``PAGE_SIZE % BLOCK_N == 0``: one table
    lookup per tile instead of one per token. offs_n: ``[BLOCK_N]`` int32 ``arange``.
    Returns ``[BLOCK_N]`` int64 offsets.
    """
    page = tl.load(block_table_row_ptr + start // PAGE_SIZE).to(tl.int64)
    slot = (start % PAGE_SIZE + offs_n).to(tl.int64)
    return page * stride_block + slot * stride_slot
