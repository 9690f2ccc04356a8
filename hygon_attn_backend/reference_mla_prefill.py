"""Plain-torch oracle of the multi-head latent attention (MLA) prefill ops: ragged dense
attention with unlike query/key and value head sizes, the LSE merge of two partial
results, and the absorbed MLA extend over a paged latent cache.

Float32 by default, or any ``compute_dtype`` (float64 for the tests' oracle, the input
dtype to measure the reference's own low-precision error). Re-exported by
:mod:`hygon_attn_backend.reference`; imports nothing of ours.

LSE layout: ``[num_heads, num_tokens]`` float32, natural log (what vLLM's
``merge_attn_states`` and FlashAttention's ``return_softmax_lse`` use).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["ragged_attention", "merge_attn_states", "mla_extend_attention"]


def _softmax_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor, scale: float):
    """q ``[Lq, Hq, Dqk]``, k ``[Lk, Hkv, Dqk]``, v ``[Lk, Hkv, Dv]``, mask ``[Lq, Lk]``
    bool. Returns out ``[Lq, Hq, Dv]`` and lse ``[Hq, Lq]``; a row that sees no key gives
    0 and ``-inf``."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale  # [Hq, Lq, Lk]
    s = s.masked_fill(~mask.unsqueeze(0), float("-inf"))
    m = s.amax(dim=-1, keepdim=True) if s.shape[-1] else torch.full_like(s[..., :1],
                                                                         float("-inf"))
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m_safe)
    denom = p.sum(dim=-1, keepdim=True)  # [Hq, Lq, 1]
    out = torch.einsum("hqk,khd->qhd", p, v)
    out = out / torch.where(denom > 0, denom, torch.ones_like(denom)).transpose(0, 1)
    lse = torch.where(denom > 0, torch.log(denom) + m_safe,
                      torch.full_like(denom, float("-inf"))).squeeze(-1)  # [Hq, Lq]
    return out, lse


def shifted_causal_mask(len_q: int, len_k: int, *, device=None) -> torch.Tensor:
    """``[len_q, len_k]`` bool: row ``i`` sees key ``j`` iff ``j <= i + (len_k - len_q)``
    (bottom-right aligned; with ``len_k < len_q`` the first ``len_q - len_k`` rows see
    nothing)."""
    i = torch.arange(len_q, device=device).unsqueeze(1)
    j = torch.arange(len_k, device=device).unsqueeze(0)
    return j <= i + (len_k - len_q)


def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *,
                     scale: Optional[float] = None, causal: bool = True,
                     out: Optional[torch.Tensor] = None, return_lse: bool = False,
                     compute_dtype: torch.dtype = torch.float32):
    """Reference ragged (varlen) dense attention, ``D_QK`` and ``D_V`` unlike allowed.

    q: ``[total_q, Hq, D_QK]``; k: ``[total_k, Hkv, D_QK]``; v: ``[total_k, Hkv, D_V]``
    (``Hq % Hkv == 0``). Request ``b`` owns q rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``
    (``Lq``) and k/v rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` (``Lk``).
    causal: row ``i`` sees key ``j`` iff ``j <= i + (Lk - Lq)`` (bottom-right aligned);
    otherwise every key of its request. scale: default ``1 / sqrt(D_QK)``.
    Returns ``out [total_q, Hq, D_V]`` (q's dtype, or written into ``out``) and, with
    ``return_lse``, ``lse [Hq, total_q]`` float32. A row that sees no key: 0, ``-inf``.
    """
    total_q, num_q_heads, d_qk = q.shape
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(d_qk)
    result = torch.zeros((total_q, num_q_heads, v.shape[2]), dtype=compute_dtype,
                         device=q.device)
    lse = torch.full((num_q_heads, total_q), float("-inf"), dtype=torch.float32,
                     device=q.device)
    cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        len_q, len_k = q1 - q0, k1 - k0
        if len_q <= 0 or len_k <= 0:
            continue
        mask = (shifted_causal_mask(len_q, len_k, device=q.device) if causal else
                torch.ones(len_q, len_k, dtype=torch.bool, device=q.device))
        o, row_lse = _softmax_rows(q[q0:q1].to(compute_dtype), k[k0:k1].to(compute_dtype),
                                   v[k0:k1].to(compute_dtype), mask, sm_scale)
        result[q0:q1] = o
        lse[:, q0:q1] = row_lse.to(torch.float32)
    if out is None:
        out = result.to(q.dtype)
    else:
        out.copy_(result)
    return (out, lse) if return_lse else out


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                      lse_b: torch.Tensor, *, out: Optional[torch.Tensor] = None,
                      out_lse: Optional[torch.Tensor] = None,
                      compute_dtype: torch.dtype = torch.float32):
    """Reference merge of two partial attention results over disjoint key sets.

    out_a, out_b: ``[N, H, D]``; lse_a, lse_b: ``[H, N]`` float32 natural log. Row
    ``(t, h)`` becomes ``(w_a * out_a + w_b * out_b) / (w_a + w_b)`` with ``w = exp(lse -
    max)``, and its LSE ``log(exp(lse_a) + exp(lse_b))``. A partial whose LSE is not finite
    (``-inf``: it saw no key; ``+inf`` or NaN: no defined normaliser) contributes nothing
    and its output values are not read; when neither is finite the row is 0 and its LSE
    ``-inf``. ``out`` may be ``out_a`` or ``out_b``.
    Returns ``(out, out_lse)``: ``[N, H, D]`` in ``out_a``'s dtype (or ``out``) and
    ``[H, N]`` float32 (or ``out_lse``).
    """
    la, lb = lse_a.to(torch.float64), lse_b.to(torch.float64)
    ok_a, ok_b = torch.isfinite(la), torch.isfinite(lb)
    neg = torch.full_like(la, float("-inf"))
    m = torch.maximum(torch.where(ok_a, la, neg), torch.where(ok_b, lb, neg))
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    wa = torch.where(ok_a, torch.exp(torch.where(ok_a, la, 0.0) - m_safe), 0.0)
    wb = torch.where(ok_b, torch.exp(torch.where(ok_b, lb, 0.0) - m_safe), 0.0)
    total = wa + wb
    some = total > 0
    safe = torch.where(some, total, torch.ones_like(total))
    ca = (wa / safe).t().unsqueeze(-1).to(compute_dtype)  # [N, H, 1]
    cb = (wb / safe).t().unsqueeze(-1).to(compute_dtype)
    xa = torch.where(ok_a.t().unsqueeze(-1), out_a.to(compute_dtype), 0.0)
    xb = torch.where(ok_b.t().unsqueeze(-1), out_b.to(compute_dtype), 0.0)
    merged = xa * ca + xb * cb
    lse = torch.where(some, torch.log(safe) + m_safe, neg).to(torch.float32)
    if out is None:
        out = merged.to(out_a.dtype)
    else:
        out.copy_(merged)
    if out_lse is None:
        out_lse = lse
    else:
        out_lse.copy_(lse)
    return out, out_lse


def mla_extend_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, *,
                         v_head_dim: int, scale: Optional[float] = None,
                         out: Optional[torch.Tensor] = None, return_lse: bool = False,
                         kv_scale=None, compute_dtype: torch.dtype = torch.float32):
    """Reference absorbed MLA extend: the new tokens attend to a paged latent cache.

    q: ``[total_q, Hq, D]`` (``D = kv_lora_rank + rope``, 576 for DeepSeek V3).
    kv_cache: ``[num_blocks, P, D]`` (any strides), one latent row per token: the key is
       the whole row, the value its first ``v_head_dim`` columns. fp8 (float8_e4m3fn /
       float8_e5m2): the row is ``code * kv_scale`` (a float or 1-element tensor, None: 1).
    block_table: ``[B, max_blocks]``; token ``t`` of request ``b`` is row
       ``kv_cache[block_table[b, t // P], t % P]``; an id outside ``[0, num_blocks)``
       makes its keys absent.
    cu_seqlens_q: ``[B + 1]``; seq_lens_k: ``[B]`` keys a request holds (prefix + new,
       every one in the cache: the engine writes the new tokens' rows first); keys past
       the table's ``max_blocks * P`` are absent. Mask: shifted causal, ``j <= i + (Lk -
       Lq)``.
    Returns ``out [total_q, Hq, v_head_dim]`` and, with ``return_lse``, ``lse [Hq,
    total_q]`` float32. A row that sees no key: 0, ``-inf``.
    """
    total_q, num_q_heads, d = q.shape
    sm_scale = float(scale) if scale is not None else 1.0 / math.sqrt(d)
    result = torch.zeros((total_q, num_q_heads, v_head_dim), dtype=compute_dtype,
                         device=q.device)
    lse = torch.full((num_q_heads, total_q), float("-inf"), dtype=torch.float32,
                     device=q.device)
    num_blocks, page = kv_cache.shape[0], kv_cache.shape[1]
    cu, lens = cu_seqlens_q.tolist(), seq_lens_k.tolist()
    for b in range(len(lens)):
        q0, q1 = int(cu[b]), int(cu[b + 1])
        len_q, len_k = q1 - q0, int(lens[b])
        if len_q <= 0 or len_k <= 0:
            continue
        pos = torch.arange(len_k, device=block_table.device)
        col = pos // page
        ids = torch.full_like(pos, -1)
        in_table = col < block_table.shape[1]
        ids[in_table] = block_table[b, col[in_table]].to(pos.dtype)
        present = (ids >= 0) & (ids < num_blocks)
        rows = torch.zeros((pos.shape[0], d), dtype=compute_dtype, device=q.device)
        if num_blocks and present.any():
            rows[present.to(q.device)] = kv_cache[ids[present], pos[present] % page].to(
                device=q.device, dtype=compute_dtype)
            if kv_cache.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) and \
                    kv_scale is not None:
                rows = rows * torch.as_tensor(kv_scale, dtype=compute_dtype,
                                              device=q.device).reshape(())
        present = present.to(q.device)
        mask = shifted_causal_mask(len_q, len_k, device=q.device) & present
        kv = rows.unsqueeze(1)  # [Lk, 1, D]
        o, row_lse = _softmax_rows(q[q0:q1].to(compute_dtype), kv, kv[..., :v_head_dim],
                                   mask, sm_scale)
        result[q0:q1] = o
        lse[:, q0:q1] = row_lse.to(torch.float32)
    if out is None:
        out = result.to(q.dtype)
    else:
        out.copy_(result)
    return (out, lse) if return_lse else out
