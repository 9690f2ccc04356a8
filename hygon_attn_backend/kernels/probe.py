"""One-tile kernel that ``ops/_interpreter.py`` launches to probe what Triton's CPU
interpreter computes: ``c = a @ b`` on one ``[N, N]`` tile in the inputs' dtype, fp32
accumulation, the ``tl.dot`` every attention kernel runs on its Q/K and P/V tiles."""

import triton
import triton.language as tl


@triton.jit
def dot_tile_kernel(a_ptr, b_ptr, c_ptr, N: tl.constexpr):
    """a, b: ``[N, N]`` contiguous (fp16/bf16); c: ``[N, N]`` float32."""
    offs = tl.arange(0, N)
    tile = offs[:, None] * N + offs[None, :]
    a = tl.load(a_ptr + tile)
    b = tl.load(b_ptr + tile)
    tl.store(c_ptr + tile, tl.dot(a, b))
