"""Mask helpers of the prefix-prefill kernel (``@triton.jit`` bodies only).

Row ``i`` (a new token, ``0 <= i < Lq``) of a request with ``Lk`` keys sits at global
position ``diag = i + (Lk - Lq)``; it sees key ``j`` iff ``j <= diag`` (shifted causal)
and, with a sliding window ``W``, ``j > diag - W``::

    L_prefix=4, L_q=3:   prefix      new
                   i=0  1 1 1 1    1 0 0
                   i=1  1 1 1 1    1 1 0
                   i=2  1 1 1 1    1 1 1
"""

import triton
import triton.language as tl


@triton.jit
def tile_visibility(diag, kpos, n, n_limit, window,
                    BOUND: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr):
    """Boolean ``[BLOCK_M, BLOCK_N]`` visibility of one tile.

    diag: ``[BLOCK_M]`` int32 global position of each row's token.
    kpos: ``[BLOCK_N]`` int32 global key positions; n: ``[BLOCK_N]`` int32 key index in
    the walked range, valid while ``n < n_limit`` (checked with ``BOUND``).
    """
    vis = diag[:, None] >= 0  # [BLOCK_M, 1], all true
    if BOUND:
        vis = vis & (n[None, :] < n_limit)
    if CAUSAL:
        vis = vis & (kpos[None, :] <= diag[:, None])
    if WINDOW:
        vis = vis & (kpos[None, :] > diag[:, None] - window)
    return vis
