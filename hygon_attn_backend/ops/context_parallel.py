"""Decode context parallelism's index math and merge, shared by the engine integrations.

Under DCP a request's keys are dealt out over the ``W`` ranks of a group in runs of
``interleave`` tokens (run ``r`` to rank ``r % W``; SGLang deals single tokens, vLLM runs of
``cp_kv_cache_interleave_size``), so rank ``w`` holds an ordinary paged sequence of
:func:`local_lens` tokens, and attention over the whole sequence is the ranks' partial
attention merged by the partials' log-sum-exps (:func:`merge_by_lse` for two key sets on
one rank, ``ops.lse_merge.merge_partials`` for any number). Plain torch, no host sync.
"""

from __future__ import annotations

import torch

from hygon_attn_backend.ops.lse_merge import merge_partials

__all__ = ["local_lens", "local_max_len", "merge_by_lse"]


def local_lens(lens: torch.Tensor, *, world_size: int, rank: int,
               interleave: int = 1) -> torch.Tensor:
    """How many of a sequence's first ``lens`` tokens rank ``rank`` stores (runs of
    ``interleave`` tokens dealt to ranks in turn). ``lens``: any shape, int; returns int32
    of its shape, on its device (no host sync). Mirrors vLLM's ``get_dcp_local_seq_lens``
    and SGLang's ``get_dcp_lens`` (``start=None``)."""
    lens = lens.to(torch.int32)
    span = world_size * interleave
    base = lens // span * interleave
    rest = lens - base * world_size  # tokens past the last whole round, < span
    return base + torch.clamp(rest - rank * interleave, min=0, max=interleave)


def local_max_len(max_len: int, *, world_size: int, interleave: int = 1) -> int:
    """The most tokens one rank stores of a sequence of ``max_len`` tokens."""
    span = world_size * interleave
    return -(-max_len // span) * interleave


def merge_by_lse(out: torch.Tensor, out_a: torch.Tensor, lse_a: torch.Tensor,
                 out_b: torch.Tensor, lse_b: torch.Tensor) -> torch.Tensor:
    """Two disjoint key sets' attention (``[N, H, D]``, natural-log LSEs ``[N, H]``; ``-inf``:
    the set had no key for the row) merged into ``out`` (``[N, H, D]``, any float dtype;
    :func:`merge_partials`); returns ``out``."""
    merge_partials(torch.stack([out_a, out_b.to(out_a.dtype)]),
                   torch.stack([lse_a.float(), lse_b.float()]), out=out)
    return out
