"""The packed tree mask of speculative verify, read inside a tile (``@triton.jit`` only).

Row ``r`` of a verify batch has ``tree_words`` int32 words; bit ``j % 32`` of word
``j // 32`` is set when the row's draft token sees draft ``j`` of its request (bits past
the words are 0). Keys before the drafts (the prefix) are always visible.
"""

import triton
import triton.language as tl


@triton.jit
def tree_visibility(tree_rows, j, tree_words):
    """Boolean ``[BLOCK_M, BLOCK_N]``: tree_rows ``[BLOCK_M]`` pointers to each row's
    words; j ``[BLOCK_N]`` int32 key index among the request's drafts (< 0: a prefix key,
    visible)."""
    jj = tl.maximum(j, 0)
    word = jj // 32
    words = tl.load(tree_rows[:, None] + word[None, :],
                    mask=(j >= 0)[None, :] & (word < tree_words)[None, :],
                    other=0)  # [BLOCK_M, BLOCK_N] int32
    words = tl.where((j >= 0)[None, :], words, -1)  # prefix keys: all bits set
    return ((words >> (jj % 32)[None, :]) & 1) != 0


@triton.jit
def tree_row_words(tree_rows, row_ok, tree_words):
    """``(w0, w1)`` ``[BLOCK_M]`` int32: the first two packed words of each row (0 past
    the row's ``tree_words``), read once before a KV loop (a kernel whose requests have at
    most 64 drafts: :func:`tree_visibility_of_words`)."""
    w0 = tl.load(tree_rows, mask=row_ok, other=0)  # a mask has >= 1 word a row
    w1 = tl.load(tree_rows + tl.minimum(tree_words - 1, 1), mask=row_ok, other=0)
    return w0, tl.where(tree_words > 1, w1, 0)


@triton.jit
def tree_visibility_of_words(w0, w1, j):
    """Boolean ``[BLOCK_M, BLOCK_N]`` from the rows' words ``w0``, ``w1`` ``[BLOCK_M]``
    (:func:`tree_row_words`): j ``[BLOCK_N]`` int32 key index among the drafts (< 0: a
    prefix key, visible; 0..63 a draft). No load inside the loop, so a pipelined KV loop
    keeps no shared-memory buffer for the mask."""
    jj = tl.minimum(tl.maximum(j, 0), 63)
    word = tl.where((jj < 32)[None, :], w0[:, None], w1[:, None])  # [BLOCK_M, BLOCK_N]
    bit = (word >> (jj % 32)[None, :]) & 1
    return (j < 0)[None, :] | (bit != 0)
