"""Tree masks of speculative verify: which draft tokens each draft token sees.

A verify step runs the ``T`` draft tokens of each request as new tokens of a prefix
prefill. With one draft per step (EAGLE ``topk=1``, MTP, n-gram chains) the drafts form a
chain and the shifted causal mask is already right; with ``topk > 1`` they form a tree and
draft ``i`` sees the prefix and only its ancestors. The kernels read the tree as a packed
mask: ``[total_q, W]`` int32, one row per query token, bit ``j % 32`` of word ``j // 32``
set when the row sees new token ``j`` of its request (``W = cdiv(max T, 32)``; bits past
``32 * W`` read as 0). The dense form is never materialised on the device per layer: the
engine builds the packed rows once per step.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from hygon_attn_backend.ops import _checks

__all__ = ["pack_tree_mask", "tree_mask_from_parents", "check_tree_mask", "launch_args"]

_SHIFTS = {}  # device -> int64 [32] bit weights


def pack_tree_mask(visible: torch.Tensor) -> torch.Tensor:
    """Pack a dense draft mask.

    visible: ``[rows, T]`` bool: row ``r`` (a query token) sees new token ``j`` of its
       request. Returns ``[rows, cdiv(T, 32)]`` int32 on ``visible``'s device (no sync).
    """
    _checks.check_tensor("visible", visible, ndim=2, dtypes=(torch.bool,))
    rows, width = visible.shape
    words = max(1, -(-width // 32))
    padded = visible.new_zeros((rows, words * 32))
    padded[:, :width] = visible
    shifts = _SHIFTS.get(visible.device)
    if shifts is None:
        shifts = _SHIFTS[visible.device] = torch.arange(32, dtype=torch.int64,
                                                        device=visible.device)
    packed = (padded.view(rows, words, 32).to(torch.int64) << shifts).sum(-1)  # < 2^32
    # bit 31 is the int32 sign bit: wrap into [-2^31, 2^31)
    return torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed).to(torch.int32)


def tree_mask_from_parents(parents: torch.Tensor) -> torch.Tensor:
    """The dense draft mask of trees given by parent indices.

    parents: ``[B, T]`` int: ``parents[b, i]`` is the draft that draft ``i`` of request
       ``b`` extends, ``-1`` for a child of the prefix; a parent comes before its child
       (``parents[b, i] < i``). Returns ``[B * T, T]`` bool: a draft sees itself and its
       ancestors (pack it with :func:`pack_tree_mask`).
    """
    _checks.check_tensor("parents", parents, ndim=2, dtypes=_checks.INDEX_DTYPES)
    num_seqs, width = parents.shape
    index = torch.arange(width, device=parents.device)
    if width and bool(((parents >= index) | (parents < -1)).any()):
        raise ValueError(f"parents must satisfy -1 <= parents[b, i] < i (a parent before its "
                         f"child), got {parents.tolist()}")
    visible = torch.zeros((num_seqs, width, width), dtype=torch.bool, device=parents.device)
    visible[:, index, index] = True
    for i in range(width):  # ancestors of i = i's parent's ancestors (parents come first)
        p = parents[:, i].long()
        has = p >= 0
        rows = visible[torch.arange(num_seqs, device=parents.device), p.clamp(min=0)]
        visible[:, i] |= rows & has[:, None]
    return visible.reshape(num_seqs * width, width)


def check_tree_mask(tree_mask: torch.Tensor, *, total_q: int, device: torch.device,
                    host_cu_seqlens_q: Optional[Sequence[int]] = None,
                    longest: Optional[int] = None) -> None:
    """A packed tree mask must be ``[total_q, W]`` int32 on ``device`` with rows of unit
    stride; ``32 * W`` must cover the longest request: ``longest`` new tokens, or as the
    host query offsets say."""
    _checks.check_tensor("tree_mask", tree_mask, ndim=2, dtypes=(torch.int32,),
                         device=device, shape=(total_q, None))
    if tree_mask.shape[1] < 1 or (tree_mask.shape[1] > 1 and tree_mask.stride(1) != 1):
        raise ValueError(f"tree_mask must hold >= 1 int32 word per row with unit stride, got "
                         f"{_checks.describe(tree_mask)}")
    if longest is None and host_cu_seqlens_q is not None and len(host_cu_seqlens_q) > 1:
        cu = [int(x) for x in host_cu_seqlens_q]
        longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    if longest is not None:
        if longest > 32 * tree_mask.shape[1]:
            raise ValueError(f"tree_mask {_checks.describe(tree_mask)} holds {32 * tree_mask.shape[1]} "
                             f"draft bits per row, but a request has {longest} new tokens")


def launch_args(tree_mask: Optional[torch.Tensor], placeholder: torch.Tensor) -> dict:
    """The kernels' tree-mask arguments (``tree_ptr``, ``stride_tree``, ``tree_words``,
    ``TREE``, as ``kernels/decode.py`` and ``kernels/prefill.py`` name them) for a plan's
    mask, or for none: ``placeholder`` (any tensor of the plan) stands in, never read."""
    if tree_mask is None:
        return dict(tree_ptr=placeholder, stride_tree=0, tree_words=0, TREE=False)
    return dict(tree_ptr=tree_mask, stride_tree=tree_mask.stride(0),
                tree_words=tree_mask.shape[1], TREE=True)
