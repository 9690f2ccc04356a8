"""Speculative verify batches as SGLang builds them, in the form the ops take.

A ``TARGET_VERIFY`` batch (SGLang 0.5.23, ``ForwardMode.TARGET_VERIFY``) carries ``T``
draft tokens per request (``spec_info.num_tokens_per_req``, else the runner's
``decode_num_tokens_per_req()``); ``forward_batch.seq_lens`` are the prefix lengths
(drafts excluded) and the drafts' K/V come with each layer's call. The drafts' visibility
is ``spec_info.custom_mask``: per request, a flattened bool ``[T, prefix + T]`` row-major
block, the requests back to back (block ``b`` starts at ``sum(T * (prefix_b' + T))`` over
the requests before it). As SGLang's own Triton backend reads it, the prefix columns are
not consulted (every draft sees the whole prefix); the last ``T`` columns become the
packed tree mask of ``ops.tree_mask``.
"""

from __future__ import annotations

from typing import Optional

import torch

from hygon_attn_backend.ops.tree_mask import pack_tree_mask

__all__ = ["verify_width", "packed_tree_mask"]


def verify_width(spec_info, default: Optional[int]) -> int:
    """Draft tokens per request of a verify batch: the batch's own uniform width when it
    sets one, else ``default`` (the runner's capture width)."""
    width = getattr(spec_info, "num_tokens_per_req", -1) if spec_info is not None else -1
    if width is None or width <= 0:
        width = getattr(spec_info, "draft_token_num", None) if spec_info is not None else None
    if width is None or width <= 0:
        width = default
    if width is None or width <= 0:
        raise ValueError("hygon attention backend: a target-verify batch without its draft "
                         "width (spec_info.num_tokens_per_req / draft_token_num)")
    return int(width)


def packed_tree_mask(custom_mask: torch.Tensor, prefix_lens: torch.Tensor, width: int,
                     out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B * T, cdiv(T, 32)]`` int32 packed tree mask from SGLang's flattened custom mask.

    custom_mask: ``[>= sum_b T * (prefix_b + T)]`` bool (or integer, nonzero = visible);
    prefix_lens: ``[B]`` int prefix lengths (on the mask's device); width: ``T``.
    out: optional preallocated result (a CUDA graph's static buffer), filled in place.
    Device ops only (no host sync).
    """
    lens = prefix_lens.to(torch.int64)
    num_seqs = lens.shape[0]
    block = width * (lens + width)  # [B] mask entries of each request
    starts = torch.cumsum(block, 0) - block  # [B]
    i = torch.arange(width, device=lens.device, dtype=torch.int64)
    index = (starts[:, None, None] + i[None, :, None] * (lens + width)[:, None, None]
             + lens[:, None, None] + i[None, None, :])  # [B, T (row), T (draft)]
    flat = custom_mask.reshape(-1)
    index = index.clamp_(max=max(flat.shape[0] - 1, 0))
    visible = flat[index] != 0 if flat.dtype != torch.bool else flat[index]
    packed = pack_tree_mask(visible.reshape(num_seqs * width, width))
    if out is not None:
        out.copy_(packed)
        return out
    return packed
