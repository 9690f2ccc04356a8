"""The dequantizing page gather of the fp8 prefill's workspace (``ops/prefill/workspace.py``).

Program ``(w, h)`` reads page ``page_map[w]`` of KV head ``h`` from an fp8 cache (any
strides) and writes ``code * scale`` (``scale_ptr[h * scale_stride]``: stride 0 per tensor,
1 per KV head) rounded to the workspace's 16-bit dtype into page
``w`` of the contiguous workspace ``[W, H, P, D]``; a page id of ``-1`` (an absent page:
its table entry was a bad id) is not read and its page is not written (the workspace
table marks it absent too). Offsets are int64.
"""

import triton
import triton.language as tl


@triton.jit
def dequant_pages_kernel(
    src_ptr, dst_ptr, page_map_ptr, scale_ptr, scale_value, scale_stride,
    stride_sb, stride_sh, stride_sp, stride_sd,
    num_kv_heads,
    PAGE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr, SCALE_FROM_PTR: tl.constexpr,
):
    w = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    src_page = tl.load(page_map_ptr + w).to(tl.int64)
    if src_page < 0:
        return
    scale = tl.load(scale_ptr + h * scale_stride) if SCALE_FROM_PTR else scale_value
    offs_p = tl.arange(0, BLOCK_P)  # [BLOCK_P] slots of the page
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D] channels
    src = src_ptr + src_page * stride_sb + h * stride_sh
    dst = dst_ptr + ((w * num_kv_heads + h) * PAGE) * HEAD_DIM
    for p0 in range(0, PAGE, BLOCK_P):
        p = p0 + offs_p
        mask = (p[:, None] < PAGE) & (offs_d[None, :] < HEAD_DIM)
        codes = tl.load(src + p[:, None].to(tl.int64) * stride_sp
                        + offs_d[None, :].to(tl.int64) * stride_sd, mask=mask)
        val = codes.to(tl.float32) * scale  # [BLOCK_P, BLOCK_D]
        tl.store(dst + p[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :],
                 val.to(dst_ptr.dtype.element_ty), mask=mask)
