"""Attention computed over disjoint key sets, merged by the sets' log-sum-exps.

A row's attention over keys ``K = K_1 + ... + K_R`` is ``sum_r w_r out_r`` with
``w_r = exp(lse_r - lse)``, ``lse = ln sum_r exp(lse_r)``: what a context-parallel decode
does with the ranks' shards of a sequence (``integrations.vllm.dcp``), and what a prefix
and its new tokens attended apart need. Plain torch (a few elementwise launches).
"""

from __future__ import annotations

import torch

__all__ = ["merge_partials"]


def merge_partials(outs: torch.Tensor, lses: torch.Tensor):
    """Attention over disjoint key sets merged: ``outs [R, N, H, D]`` (any float dtype)
    with their natural-log ``lses [R, N, H]`` (``-inf``: that set had no key for the row).
    Returns ``(out [N, H, D] float32, lse [N, H] float32)``; a row no set saw gives zeros
    and ``-inf``. The arithmetic of vLLM's DCP combine (``cp_lse_ag_out_rs``), on one
    device."""
    if outs.dim() != 4 or lses.dim() != 3 or tuple(lses.shape) != tuple(outs.shape[:3]):
        raise ValueError(f"outs must be [R, N, H, D] and lses [R, N, H], got outs "
                         f"{list(outs.shape)}, lses {list(lses.shape)}")
    if not outs.dtype.is_floating_point or not lses.dtype.is_floating_point:
        raise ValueError(f"outs and lses must be floating point, got {outs.dtype}, "
                         f"{lses.dtype}")
    lses = lses.float()
    m = lses.amax(dim=0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m)  # [R, N, H]
    total = w.sum(dim=0)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    out = (outs.float() * (w / safe).unsqueeze(-1)).sum(dim=0)
    lse = torch.where(total > 0, torch.log(safe) + m, torch.full_like(m, float("-inf")))
    return out, lse
