"""Paged KV addressing (@triton.jit functions) shared by the attention kernels.

One rule for every kernel (DESIGN.md "Bounds"): a block id outside ``[0, num_blocks)`` or a
table column past ``max_blocks_per_seq`` is *absent*. :func:`lookup_tile_pages` marks it
``-1``; the caller masks those keys (never loaded, logits ``-inf``) and forms addresses only
from :func:`tile_row_offsets`, which clamps the id first, so even a masked lane never holds
a wild pointer.
"""

import triton
import triton.language as tl


@triton.jit
def lookup_tile_pages(bt_row_ptr, stride_bt_block, start, offs_n, max_blocks_per_seq,
                      num_blocks, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Physical block ids of the KV tile ``[start, start + BLOCK_N)`` of one sequence.

    A scalar when the tile lies inside one page (``PAGE_SIZE % BLOCK_N == 0`` and
    ``start % BLOCK_N == 0``: one table lookup per tile), else ``[BLOCK_N]`` (one per
    token). ``-1`` marks an id that must not be read: past the table's
    ``max_blocks_per_seq`` columns, negative, or ``>= num_blocks``. The table itself is
    only read inside its columns (an empty table is never read).
    """
    if PAGE_SIZE % BLOCK_N == 0:
        blk = start // PAGE_SIZE
    else:
        blk = (start + offs_n) // PAGE_SIZE  # [BLOCK_N]
    in_table = (blk >= 0) & (blk < max_blocks_per_seq)
    blk = tl.minimum(tl.maximum(blk, 0), tl.maximum(max_blocks_per_seq - 1, 0))
    page = tl.load(bt_row_ptr + blk.to(tl.int64) * stride_bt_block, mask=in_table,
                   other=-1).to(tl.int64)
    return tl.where(in_table & (page >= 0) & (page < num_blocks), page, -1)


@triton.jit
def tile_row_offsets(page, start, offs_n, stride_block, stride_slot,
                     PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """int64 ``[BLOCK_N]`` offsets ``page * stride_block + slot * stride_slot`` of the
    tile ``[start, start + BLOCK_N)``, ``page`` as :func:`lookup_tile_pages` returns it
    (scalar or ``[BLOCK_N]``). A ``-1`` (absent) id is clamped to block 0, so the address
    stays inside the cache; the caller masks the load."""
    if PAGE_SIZE % BLOCK_N == 0:
        slot = (start % PAGE_SIZE) + offs_n  # [BLOCK_N], one page for the whole tile
    else:
        slot = (start + offs_n) % PAGE_SIZE  # [BLOCK_N]
    return tl.maximum(page, 0) * stride_block + slot.to(tl.int64) * stride_slot


@triton.jit
def table_row_present(bt_row_ptr, stride_bt_block, num_pages, max_blocks_per_seq, num_blocks,
                      SCAN: tl.constexpr):
    """True when the table row's block ids ``[0, num_pages)`` are all present: inside the
    table's ``max_blocks_per_seq`` columns and in ``[0, num_blocks)``. A kernel checks this
    once per program and then skips the per-key check of those pages (bad ids come only
    from a hostile or broken table). Reads ``SCAN`` ids per step; the table is only read
    inside its columns."""
    n = tl.minimum(num_pages, max_blocks_per_seq)
    offs = tl.arange(0, SCAN)  # [SCAN]
    bad = tl.zeros([SCAN], dtype=tl.int32)
    for start in range(0, n, SCAN):
        cols = start + offs  # [SCAN]
        inside = cols < n
        ids = tl.load(bt_row_ptr + cols.to(tl.int64) * stride_bt_block, mask=inside,
                      other=0).to(tl.int64)  # [SCAN]
        bad += (inside & ((ids < 0) | (ids >= num_blocks))).to(tl.int32)
    return (tl.sum(bad, 0) == 0) & (num_pages <= max_blocks_per_seq)
