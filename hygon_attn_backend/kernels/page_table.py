"""Triton kernel that turns SGLang's ``req_to_token`` rows into a block table.

``req_to_token [num_rows, max_context_len]`` holds the pool location of every token of a
request; with page size ``P`` the tokens of a page are consecutive locations, so block
``j`` of row ``r`` is ``req_to_token[r, j * P] // P`` (floor division). The kernel reads
exactly those ``B x num_blocks`` entries (a gather of whole rows would read ``P`` times
more) and writes the int32 table in one launch: CUDA-graph safe (static shapes, no
allocation), one program per (request, chunk of ``BLOCK`` columns).
"""

import triton
import triton.language as tl


@triton.jit
def req_to_token_table_kernel(
    req_to_token_ptr, rows_ptr, out_ptr,
    num_blocks, num_rows,
    stride_r2t_row, stride_r2t_col, stride_out_row,
    PAGE: tl.constexpr,   # page size P (tokens per block)
    BLOCK: tl.constexpr,  # table columns per program
):
    b = tl.program_id(0)
    chunk = tl.program_id(1)
    row = tl.load(rows_ptr + b).to(tl.int64)
    row_ok = (row >= 0) & (row < num_rows)  # a bad row is never read: its blocks are -1
    cols = chunk * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] block index j
    mask = cols < num_blocks
    src = req_to_token_ptr + tl.where(row_ok, row, 0) * stride_r2t_row \
        + cols.to(tl.int64) * (PAGE * stride_r2t_col)
    readable = cols < tl.where(row_ok, num_blocks, 0)  # [BLOCK] mask; none for a bad row
    loc = tl.load(src, mask=readable, other=0).to(tl.int64)  # [BLOCK] page firsts
    if PAGE > 1:
        # floor division (torch's rounding), also for a negative location
        q = loc // PAGE
        loc = q - ((q * PAGE != loc) & (loc < 0)).to(tl.int64)
    loc = tl.where(row_ok, loc, -1)  # an absent block for the attention kernels
    out = out_ptr + b.to(tl.int64) * stride_out_row + cols
    tl.store(out, loc.to(tl.int32), mask=mask)
