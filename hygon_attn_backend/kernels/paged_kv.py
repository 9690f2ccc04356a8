"""Paged KV addressing (@triton.jit functions) shared by the attention kernels."""

import triton
import triton.language as tl


@triton.jit
def lookup_tile_pages(bt_row_ptr, stride_bt_block, start, offs_n, max_blocks_per_seq,
                      num_blocks, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Physical block ids of the KV tile ``[start, start + BLOCK_N)`` of one sequence.

    A scalar when the tile lies inside one page (``PAGE_SIZE % BLOCK_N == 0``: one table
    lookup per tile), else ``[BLOCK_N]`` (one per token). ``-1`` marks an id that must not
    be read: past the table's ``max_blocks_per_seq`` columns, negative, or
    ``>= num_blocks``. The table itself is only read inside its columns.
    """
    if PAGE_SIZE % BLOCK_N == 0:
        blk = start // PAGE_SIZE
    else:
        blk = (start + offs_n) // PAGE_SIZE  # [BLOCK_N]
    in_table = blk < max_blocks_per_seq
    blk = tl.minimum(blk, max_blocks_per_seq - 1)
    page = tl.load(bt_row_ptr + blk * stride_bt_block).to(tl.int64)
    return tl.where(in_table & (page >= 0) & (page < num_blocks), page, -1)
