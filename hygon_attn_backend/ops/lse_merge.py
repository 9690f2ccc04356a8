"""Attention computed over disjoint key sets, merged by the sets' log-sum-exps.

A row's attention over keys ``K = K_1 + ... + K_R`` is ``sum_r w_r out_r`` with
``w_r = exp(lse_r - lse)``, ``lse = ln sum_r exp(lse_r)``: what a context-parallel decode
does with the ranks' shards of a sequence (``integrations.vllm.dcp``), and what a prefix
and its new tokens attended apart need. One Triton launch on a GPU, plain torch on a CPU.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton

__all__ = ["merge_partials"]


def merge_partials(outs: torch.Tensor, lses: torch.Tensor, *,
                   out: Optional[torch.Tensor] = None):
    """Attention over disjoint key sets merged: ``outs [R, N, H, D]`` (any float dtype)
    with their natural-log ``lses [R, N, H]`` (``-inf``: that set had no key for the row).
    Returns ``(out [N, H, D], lse [N, H] float32)``; a row no set saw gives zeros and
    ``-inf``. ``out``: ``[N, H, D]`` of any float dtype on ``outs``' device, written and
    returned (default: a new float32 tensor). The arithmetic of vLLM's DCP combine
    (``cp_lse_ag_out_rs``), on one device: one Triton launch on a GPU
    (``kernels/lse_merge.py``), plain torch on a CPU."""
    if outs.dim() != 4 or lses.dim() != 3 or tuple(lses.shape) != tuple(outs.shape[:3]):
        raise ValueError(f"outs must be [R, N, H, D] and lses [R, N, H], got outs "
                         f"{list(outs.shape)}, lses {list(lses.shape)}")
    if not outs.dtype.is_floating_point or not lses.dtype.is_floating_point:
        raise ValueError(f"outs and lses must be floating point, got {outs.dtype}, "
                         f"{lses.dtype}")
    if lses.device != outs.device:
        raise ValueError(f"lses must be on outs' device {outs.device}, got {lses.device}")
    shape = tuple(outs.shape[1:])
    if out is not None and (tuple(out.shape) != shape or not out.dtype.is_floating_point
                            or out.device != outs.device):
        raise ValueError(f"out must be a float {list(shape)} tensor on {outs.device}, got "
                         f"{out.dtype} {list(out.shape)} on {out.device}")
    if outs.device.type == "cuda" and outs.shape[0] > 0 and outs.numel() > 0:
        return _merge_triton(outs, lses, out)
    lses = lses.float()
    m = lses.amax(dim=0)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp(lses - m)  # [R, N, H]
    total = w.sum(dim=0)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    # a set with no key (w = 0) adds nothing, whatever its output holds
    merged = torch.where((w > 0).unsqueeze(-1), outs.float() * (w / safe).unsqueeze(-1),
                         0.0).sum(dim=0)
    lse = torch.where(total > 0, torch.log(safe) + m, torch.full_like(m, float("-inf")))
    if out is not None:
        return out.copy_(merged), lse
    return merged, lse


def _merge_triton(outs: torch.Tensor, lses: torch.Tensor, out: Optional[torch.Tensor]):
    from hygon_attn_backend.kernels.lse_merge import merge_lse_kernel
    r, n, h, d = outs.shape
    if out is None:
        out = torch.empty((n, h, d), dtype=torch.float32, device=outs.device)
    lse = torch.empty((n, h), dtype=torch.float32, device=outs.device)
    if n * h == 0:
        return out, lse
    merge_lse_kernel[(n * h,)](
        outs, lses, out, lse, r, h, d, *outs.stride(), *lses.stride(), *out.stride(),
        *lse.stride(), BLOCK_D=max(16, triton.next_power_of_2(d)), WRITE_LSE=True)
    return out, lse
