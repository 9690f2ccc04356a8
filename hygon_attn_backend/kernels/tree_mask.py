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
