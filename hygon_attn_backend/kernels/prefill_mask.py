"""Mask helpers of the prefix-prefill kernel (``@triton.jit`` bodies only).

Row ``i`` (a new token, ``0 <= i < Lq``) of a request with ``Lk`` keys sits at global
position ``diag = i + (Lk - Lq)``; it sees key ``j`` iff ``j <= diag`` (shifted causal)
and, with a sliding window ``W``, ``j > diag - W``. With a tree mask (speculative verify:
each new token sees the prefix and only its ancestors among the new tokens) the causal
rule of the new keys is replaced by row ``i``'s bit ``j`` (``TREE``)::

    L_prefix=4, L_q=3:   prefix      new
                   i=0  1 1 1 1    1 0 0
                   i=1  1 1 1 1    1 1 0
                   i=2  1 1 1 1    1 1 1
"""

import triton
import triton.language as tl

from hygon_attn_backend.kernels.tree_mask import tree_visibility


@triton.jit
def tile_visibility(diag, kpos, n, n_limit, window, tree_rows, len_p, tree_words,
                    BOUND: tl.constexpr, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                    TREE: tl.constexpr):
    """Boolean ``[BLOCK_M, BLOCK_N]`` visibility of one tile.

    diag: ``[BLOCK_M]`` int32 global position of each row's token.
    kpos: ``[BLOCK_N]`` int32 global key positions; n: ``[BLOCK_N]`` int32 key index in
    the walked range, valid while ``n < n_limit`` (checked with ``BOUND``).
    TREE: tree_rows ``[BLOCK_M]`` pointers to each row's ``tree_words`` int32 words of the
    packed tree mask (bit ``j % 32`` of word ``j // 32``: the row sees new key ``j``; bits
    past the words are 0); len_p: the prefix length (keys before it are always visible).
    """
    vis = diag[:, None] >= 0  # [BLOCK_M, 1], all true
    if BOUND:
        vis = vis & (n[None, :] < n_limit)
    if CAUSAL:
        vis = vis & (kpos[None, :] <= diag[:, None])
    if WINDOW:
        vis = vis & (kpos[None, :] > diag[:, None] - window)
    if TREE:  # kpos - len_p: the key's index among the request's new keys (< 0: prefix)
        vis = vis & tree_visibility(tree_rows, kpos - len_p, tree_words)
    return vis
