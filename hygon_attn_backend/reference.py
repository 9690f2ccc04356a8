"""Plain-torch oracle for every op of the package.

Runs on CPU (and on any device torch supports) in float32 by default, or in any
``compute_dtype`` (float64 for the oracle of tests, the input dtype to measure the
reference's own low-precision error). It is also the CPU fallback of the engine
integrations, so the hot paths are vectorised per sequence rather than per token.

This module imports nothing of ours but its own parts (``reference_mla_prefill``, which
imports nothing of ours; one-way layers, see DESIGN.md).

KV caches are read through the canonical 4-D views
``[num_blocks, num_kv_heads, block_size, head_dim]`` with any strides; vLLM's legacy
split-x K cache ``[num_blocks, num_kv_heads, head_dim // x, block_size, x]`` is
recognised by ``ndim == 5``. Token ``t`` of sequence ``s`` lives at
``page = block_table[s, t // P]``, ``slot = t % P`` where ``P = block_size``.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

__all__ = [
    "paged_decode_attention",
    "mla_decode_attention",
    "mla_decode_reference",
    "write_mla_cache",
    "prefix_prefill_attention",
    "write_kv",
    "copy_blocks",
    "combine_partitions",
    "unpack_tree_mask",
    "quantize_fp8",
    "dequantize_fp8",
    "gather_kv",
    "key_presence",
    "causal_mask",
    "FP8_DTYPES",
]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

ScaleLike = Union[None, float, torch.Tensor]


# ----------------------------------------------------------------------------- fp8


def _scale_value(scale: ScaleLike) -> float:
    if scale is None:
        return 1.0
    if isinstance(scale, torch.Tensor):
        if scale.numel() != 1:
            raise ValueError(f"scale must hold one element, got shape {tuple(scale.shape)}")
        return float(scale.reshape(()).item())
    return float(scale)


def _scale_tensor(scale: ScaleLike, x: torch.Tensor) -> torch.Tensor:
    """The scale as a float32 tensor that broadcasts over ``x`` (``[..., H, D]``): one
    element (per tensor), or ``H`` elements, one per head (axis -2)."""
    if isinstance(scale, torch.Tensor) and scale.numel() > 1:
        heads = x.shape[-2] if x.dim() >= 2 else -1
        if scale.dim() != 1 or scale.numel() != heads:
            raise ValueError(f"a per-head scale must be 1-D with one element per head ({heads}), "
                             f"got shape {tuple(scale.shape)}")
        return scale.to(device=x.device, dtype=torch.float32).view(-1, 1)
    return torch.tensor(_scale_value(scale), dtype=torch.float32, device=x.device)


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype, scale: ScaleLike = None) -> torch.Tensor:
    """Quantize ``x`` to ``dtype`` (float8 e4m3fn / e5m2) as ``x / scale``, saturating
    at the format's finite range (no inf/NaN from out-of-range values). ``scale``: per
    tensor (a float or one element) or per head (``[H]`` for ``x`` of ``[..., H, D]``)."""
    if dtype not in FP8_DTYPES:
        raise ValueError(f"dtype must be one of {FP8_DTYPES}, got {dtype}")
    limit = torch.finfo(dtype).max
    # Divide by a float32 tensor on x's device, not a Python scalar: CUDA torch turns
    # division by a host scalar into multiplication by its reciprocal, which rounds
    # differently from the IEEE division the kernels (and CPU torch) perform.
    y = x.to(torch.float32) / _scale_tensor(scale, x)
    return y.clamp(-limit, limit).to(dtype)


def dequantize_fp8(x: torch.Tensor, scale: ScaleLike = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`quantize_fp8`: ``x.float() * scale`` cast to ``dtype`` (``scale``
    per tensor, or per head for ``x`` of ``[..., H, D]``)."""
    return (x.to(torch.float32) * _scale_tensor(scale, x)).to(dtype)


def _load_cache(cache_rows: torch.Tensor, scale: ScaleLike, dtype: torch.dtype) -> torch.Tensor:
    if cache_rows.dtype in FP8_DTYPES:
        return dequantize_fp8(cache_rows, scale, dtype)
    return cache_rows.to(dtype)


# ----------------------------------------------------------------------------- paging


def as_canonical_view(cache: torch.Tensor) -> torch.Tensor:
    """Return the ``[num_blocks, num_kv_heads, block_size, head_dim]`` view of a cache.

    4-D tensors are returned as they are. A 5-D tensor is vLLM's legacy split-x K cache
    ``[num_blocks, num_kv_heads, head_dim // x, block_size, x]``; its canonical form is
    ``permute(0, 1, 3, 2, 4)`` flattened over the last two axes (a copy: the split-x
    order is no stride pattern).
    """
    if cache.dim() == 4:
        return cache
    if cache.dim() == 5:
        n, h, dx, b, x = cache.shape
        return cache.permute(0, 1, 3, 2, 4).reshape(n, h, b, dx * x)
    raise ValueError(f"cache must be 4-D or 5-D (split-x K), got shape {tuple(cache.shape)}")


def _block_ids(cache: torch.Tensor, block_table_row: torch.Tensor, start: int, stop: int
               ) -> torch.Tensor:
    """int64 ``[max(0, stop - start)]`` block id of each token ``[start, stop)``, ``-1``
    where absent (see :func:`key_presence`); an empty range (``stop <= start``) has none."""
    view = as_canonical_view(cache)
    num_blocks, page_size = view.shape[0], view.shape[2]
    row = block_table_row.to(device=view.device, dtype=torch.long)
    cols = torch.arange(start, max(start, stop), device=view.device) // page_size
    if row.shape[0] == 0 or num_blocks == 0:  # no readable block: every key absent
        return torch.full_like(cols, -1)
    ids = row[cols.clamp(max=row.shape[0] - 1)]  # no host sync (engines call this per step)
    ok = (cols < row.shape[0]) & (ids >= 0) & (ids < num_blocks)
    return torch.where(ok, ids, -1)


def key_presence(cache: torch.Tensor, block_table_row: torch.Tensor, start: int, stop: int
                 ) -> torch.Tensor:
    """Boolean ``[stop - start]``: which tokens ``[start, stop)`` of one sequence exist.

    The bounds rule every kernel follows: token ``t`` is *absent* when its table column
    ``t // P`` is past the row's end or its block id is outside ``[0, num_blocks)``; an
    absent key is never read and no query sees it (as if masked). A row that sees no key
    gives 0.
    """
    return _block_ids(cache, block_table_row, start, stop) >= 0


def gather_kv(cache: torch.Tensor, block_table_row: torch.Tensor, start: int, stop: int,
              *, scale: ScaleLike = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Gather tokens ``[start, stop)`` of one sequence: returns ``[stop - start, H, D]``.

    cache: canonical view ``[num_blocks, H, P, D]`` (or the 5-D split-x K cache).
    block_table_row: ``[max_blocks]`` integer physical block ids of the sequence.
    Absent tokens (:func:`key_presence`) are never read and come back as zeros; the
    attention functions also mask them out.
    """
    view = as_canonical_view(cache)
    ids = _block_ids(cache, block_table_row, start, stop)
    if view.shape[0] == 0:  # a cache of no blocks: nothing to read, every key absent
        return torch.zeros((ids.shape[0],) + tuple(view.shape[1:2]) + tuple(view.shape[3:]),
                           dtype=dtype, device=view.device)
    slots = torch.arange(start, start + ids.shape[0], device=view.device) % view.shape[2]
    rows = _load_cache(view[ids.clamp(min=0), :, slots, :], scale, dtype)  # [L, H, D]
    return rows.masked_fill((ids < 0).view(-1, 1, 1), 0.0)


def causal_mask(len_q: int, len_k: int, *, device=None, sliding_window: Optional[int] = None,
                num_keys: Optional[int] = None) -> torch.Tensor:
    """Boolean ``[len_q, len_k]`` mask: row ``i`` sees key ``j`` iff ``j <= i + (Lk - Lq)``
    (and, with a sliding window ``W``, ``j > i + (Lk - Lq) - W``). ``num_keys``: only the
    first ``min(num_keys, len_k)`` columns (the keys a table holds of a longer sequence).

    ``len_q=3, len_k=7`` (a prefix of 4)::

        i=0  1 1 1 1  1 0 0
        i=1  1 1 1 1  1 1 0
        i=2  1 1 1 1  1 1 1
    """
    i = torch.arange(len_q, device=device).unsqueeze(1)
    j = torch.arange(len_k if num_keys is None else min(num_keys, len_k),
                     device=device).unsqueeze(0)
    diag = i + (len_k - len_q)
    mask = j <= diag
    if sliding_window is not None:
        mask &= j > diag - sliding_window
    return mask


# ----------------------------------------------------------------------------- core


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
            scale: float, soft_cap: Optional[float], sinks: Optional[torch.Tensor]):
    """q [Lq, Hq, D], k/v [Lk, Hkv, D], mask [Lq, Lk] bool or None.

    Returns out [Lq, Hq, D] and lse [Lq, Hq]: the natural log of the softmax normaliser
    (sinks included). Rows that see no key (and have no sink) give out = 0, lse = -inf.
    """
    len_q, num_q_heads, dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_q_heads // num_kv_heads
    # query head h * G + g reads KV head h; grouped, so K/V are never copied G times
    # (an MLA cache of one latent head at Hq = 128 would be 128 copies of the context)
    qg = q.reshape(len_q, num_kv_heads, group, dim)
    s = torch.einsum("qhgd,khd->hgqk", qg, k).reshape(num_q_heads, len_q, -1) * scale
    # s: [Hq, Lq, Lk]
    if soft_cap is not None and soft_cap > 0:
        s = soft_cap * torch.tanh(s / soft_cap)
    if mask is not None:
        s = s.masked_fill(~mask.unsqueeze(0), float("-inf"))
    m = s.amax(dim=-1, keepdim=True)  # [Hq, Lq, 1]
    if sinks is not None:
        sink = sinks.to(s.dtype).view(-1, 1, 1)
        m = torch.maximum(m, sink)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m_safe)
    denom = p.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sink - m_safe)
    pg = p.reshape(num_kv_heads, group, len_q, -1)
    out = torch.einsum("hgqk,khd->qhgd", pg, v).reshape(len_q, num_q_heads, v.shape[-1])
    safe_denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    out = out / safe_denom.transpose(0, 1)
    lse = (torch.log(denom) + m_safe).squeeze(-1).transpose(0, 1)  # [Lq, Hq]
    return out, lse


def _resolve_scale(scale: Optional[float], head_dim: int) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(head_dim)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                           scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
                           k_scale: ScaleLike = None, v_scale: ScaleLike = None,
                           partition_size: Optional[int] = None,
                           sliding_window: Optional[int] = None,
                           soft_cap: Optional[float] = None,
                           sinks: Optional[torch.Tensor] = None,
                           tree_mask: Optional[torch.Tensor] = None,
                           return_lse: bool = False,
                           compute_dtype: torch.dtype = torch.float32):
    """Reference paged decode attention.

    q: ``[num_seqs, num_q_heads, D]`` (one token per sequence) or
       ``[num_seqs, T, num_q_heads, D]`` (T speculative tokens: token ``t`` is at position
       ``seq_len - T + t`` and sees keys ``j <= seq_len - T + t``).
    k_cache, v_cache: ``[num_blocks, num_kv_heads, P, D]`` views (any strides), fp16/bf16/
       fp32 or fp8 with ``k_scale``/``v_scale``; K may be the 5-D split-x cache.
    block_table: ``[num_seqs, max_blocks]`` int32 physical block ids; a bad id (outside
       ``[0, num_blocks)``) or a column past the table makes its keys absent
       (:func:`key_presence`).
    seq_lens: ``[num_seqs]`` int32 key lengths (>= T); a sequence of length ``<= 0`` gives
       0, as does a row that sees no key (never NaN). Keys past the table's capacity
       ``max_blocks * P`` are absent and never gathered (a wild length costs nothing).
    sinks: ``[num_q_heads]`` float32 per-head sink logits (an extra always-visible key
       with value 0), or None. ``partition_size`` is accepted for API parity and ignored.
    tree_mask: ``[num_seqs * T, W]`` int32 packed tree mask (speculative verify): the T
       tokens are the last T keys of their sequence (the drafts); token ``t`` sees the
       keys before them and draft ``j`` iff :func:`unpack_tree_mask` of its row says so.
    return_lse: also return ``lse`` ``[num_seqs, num_q_heads]`` (``[num_seqs, T,
       num_q_heads]``) float32: ``ln sum_j exp(s_j)`` over the keys a row sees (sinks
       included), ``-inf`` for a row that sees none (a length ``<= 0`` included).

    Returns ``out`` (``q``'s shape and dtype) holding the result, or ``(out, lse)``.
    """
    del partition_size
    squeeze = q.dim() == 3
    q4 = q.unsqueeze(1) if squeeze else q
    num_seqs, num_tokens, num_q_heads, head_dim = q4.shape
    sm_scale = _resolve_scale(scale, head_dim)
    result = torch.zeros(q4.shape, dtype=compute_dtype, device=q.device)
    lse = torch.full(q4.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    lens = seq_lens.tolist()
    capacity = block_table.shape[1] * as_canonical_view(v_cache).shape[2]
    for s in range(num_seqs):
        length = int(lens[s])
        if length <= 0:  # no key (a negative length is none either, as in the kernels)
            continue
        # keys past the table are absent: read up to its capacity, whatever the length
        stop = min(length, capacity)
        k = gather_kv(k_cache, block_table[s], 0, stop, scale=k_scale, dtype=compute_dtype)
        v = gather_kv(v_cache, block_table[s], 0, stop, scale=v_scale, dtype=compute_dtype)
        mask = causal_mask(num_tokens, length, device=q.device, sliding_window=sliding_window,
                           num_keys=stop)
        if tree_mask is not None:
            _apply_tree(mask, tree_mask[s * num_tokens:(s + 1) * num_tokens], length, stop)
        mask &= key_presence(k_cache, block_table[s], 0, stop).to(q.device)
        o, row_lse = _attend(q4[s].to(compute_dtype), k.to(q.device), v.to(q.device), mask,
                             sm_scale, soft_cap, sinks)
        result[s] = o
        lse[s] = row_lse.to(torch.float32)
    result = result.squeeze(1) if squeeze else result
    lse = lse.squeeze(1) if squeeze else lse
    if out is None:
        out = result.to(q.dtype)
    else:
        out.copy_(result)
    return (out, lse) if return_lse else out


def prefix_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_table: torch.Tensor, cu_seqlens_q: torch.Tensor,
                             seq_lens_k: torch.Tensor, *, scale: Optional[float] = None,
                             causal: bool = True, k_new: Optional[torch.Tensor] = None,
                             v_new: Optional[torch.Tensor] = None,
                             out: Optional[torch.Tensor] = None, return_lse: bool = False,
                             k_scale: ScaleLike = None, v_scale: ScaleLike = None,
                             sliding_window: Optional[int] = None,
                             soft_cap: Optional[float] = None,
                             sinks: Optional[torch.Tensor] = None,
                             tree_mask: Optional[torch.Tensor] = None,
                             compute_dtype: torch.dtype = torch.float32):
    """Reference prefix-prefill ("extend") attention on a ragged batch.

    q: ``[total_q, num_q_heads, D]`` packed new tokens; request ``b`` owns rows
       ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (``Lq_b`` of them).
    k_cache, v_cache: ``[num_blocks, num_kv_heads, P, D]`` views (any strides).
    block_table: ``[B, max_blocks]`` int32 physical block ids; bad ids make their keys
       absent (:func:`key_presence`).
    cu_seqlens_q: ``[B + 1]`` int32, non-decreasing, starts at 0.
    seq_lens_k: ``[B]`` int32 total key length ``Lk_b`` (prefix + new), ``Lk_b >= Lq_b``.
    k_new, v_new: optional ``[total_q, num_kv_heads, D]`` keys/values of the new tokens
       (packed like ``q``). Given: the prefix ``[0, Lk - Lq)`` is read from the cache and
       the new tokens from these. Absent: all ``Lk`` keys come from the cache.
    causal: apply ``j <= i + (Lk - Lq)``; otherwise every row sees every key.
    tree_mask: optional ``[total_q, W]`` int32 packed tree mask (speculative verify, with
       ``causal``): new token ``i`` of a request sees the whole prefix and new token ``j``
       iff :func:`unpack_tree_mask` says so (bit ``j % 32`` of word ``j // 32`` of its row;
       bits past ``32 * W`` are 0): the causal rule of the new keys is replaced.
    A row that sees no key (``Lk <= 0``, a window or absent keys) gives 0 and lse ``-inf``.

    Returns ``out [total_q, num_q_heads, D]`` (q's dtype), and with ``return_lse`` also
    ``lse [total_q, num_q_heads]`` float32 (natural log).
    """
    total_q, num_q_heads, head_dim = q.shape
    sm_scale = _resolve_scale(scale, head_dim)
    result = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    lse = torch.full((total_q, num_q_heads), float("-inf"), dtype=torch.float32,
                     device=q.device)
    cu = cu_seqlens_q.tolist()
    lens = seq_lens_k.tolist()
    for b in range(len(lens)):
        q0, q1 = int(cu[b]), int(cu[b + 1])
        len_q, len_k = q1 - q0, int(lens[b])
        if len_q <= 0 or len_k <= 0:  # no query row, or no key: zeros (lse -inf)
            continue
        from_cache = len_k - len_q if k_new is not None else len_k
        k = gather_kv(k_cache, block_table[b], 0, from_cache, scale=k_scale, dtype=compute_dtype)
        v = gather_kv(v_cache, block_table[b], 0, from_cache, scale=v_scale, dtype=compute_dtype)
        present = key_presence(k_cache, block_table[b], 0, from_cache).to(q.device)
        if k_new is not None:
            k = torch.cat([k.to(q.device), k_new[q0:q1].to(compute_dtype)], dim=0)
            v = torch.cat([v.to(q.device), v_new[q0:q1].to(compute_dtype)], dim=0)
            present = torch.cat([present, torch.ones(len_q, dtype=torch.bool, device=q.device)])
        mask = (causal_mask(len_q, len_k, device=q.device, sliding_window=sliding_window)
                if causal else torch.ones(len_q, len_k, dtype=torch.bool, device=q.device))
        if tree_mask is not None:
            mask[:, len_k - len_q:] = unpack_tree_mask(tree_mask[q0:q1], len_q).to(q.device)
        mask &= present
        o, row_lse = _attend(q[q0:q1].to(compute_dtype), k.to(q.device), v.to(q.device), mask,
                             sm_scale, soft_cap, sinks)
        result[q0:q1] = o
        lse[q0:q1] = row_lse.to(torch.float32)
    if out is None:
        out = result.to(q.dtype)
    else:
        out.copy_(result)
    return (out, lse) if return_lse else out


def unpack_tree_mask(tree_mask: torch.Tensor, width: int) -> torch.Tensor:
    """``[rows, width]`` bool from a packed ``[rows, W]`` int32 tree mask: entry ``(r, j)``
    is bit ``j % 32`` of word ``j // 32`` of row ``r``, False for ``j >= 32 * W``."""
    rows, words = tree_mask.shape
    shifts = torch.arange(32, dtype=torch.int64, device=tree_mask.device)
    bits = (tree_mask.to(torch.int64)[:, :, None] >> shifts) & 1  # [rows, W, 32]
    dense = bits.reshape(rows, words * 32).bool()
    if dense.shape[1] < width:
        dense = torch.cat([dense, dense.new_zeros(rows, width - dense.shape[1])], dim=1)
    return dense[:, :width]


def _apply_tree(mask: torch.Tensor, rows: torch.Tensor, length: int, stop: int) -> None:
    """Put one request's draft visibility into its ``[T, keys]`` mask: the T drafts are
    keys ``length - T .. length - 1`` (those below ``stop`` are read), ``rows`` its ``[T,
    W]`` packed tree-mask rows (:func:`unpack_tree_mask`)."""
    num_tokens = mask.shape[0]
    first = length - num_tokens
    drafts = unpack_tree_mask(rows, num_tokens).to(mask.device)
    lo = max(0, first)
    if stop > lo:
        mask[:, lo:stop] = drafts[:, lo - first:stop - first]


def combine_partitions(max_logits: torch.Tensor, exp_sums: torch.Tensor,
                       partial_out: torch.Tensor, *, log2_domain: bool = False,
                       out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Merge split-KV partitions.

    max_logits, exp_sums: ``[..., num_partitions]`` float32 per-partition running max
       ``m_p`` and sum ``l_p`` (``l_p = 0`` marks an empty partition).
    partial_out: ``[..., num_partitions, D]``, each partition's output already divided by
       its own ``l_p``.
    log2_domain: ``m_p`` is in log2 units (kernels that use ``exp2``).

    ``out = sum_p w_p * partial_out_p`` with ``w_p = l_p e^(m_p - M) / sum_p l_p e^(m_p - M)``
    and ``M = max_p m_p``. All-empty rows give 0.
    """
    m = max_logits.to(torch.float64)
    l_ = exp_sums.to(torch.float64)
    big_m = m.amax(dim=-1, keepdim=True)
    big_m = torch.where(torch.isfinite(big_m), big_m, torch.zeros_like(big_m))
    diff = m - big_m
    factor = torch.exp2(diff) if log2_domain else torch.exp(diff)
    w = torch.where(l_ > 0, l_ * factor, torch.zeros_like(l_))
    total = w.sum(dim=-1, keepdim=True)
    w = w / torch.where(total > 0, total, torch.ones_like(total))
    part = torch.nan_to_num(partial_out.to(torch.float64))
    res = (w.unsqueeze(-1) * part).sum(dim=-2)
    return res.to(out_dtype or partial_out.dtype)


# ----------------------------------------------------------------------------- MLA (latent)


def _mla_cache_view(kv_cache: torch.Tensor) -> torch.Tensor:
    """``[num_blocks, P, W]`` latent cache as the ``[num_blocks, 1, P, W]`` canonical view
    (one KV head) that :func:`gather_kv` and :func:`key_presence` read."""
    if kv_cache.dim() != 3:
        raise ValueError(f"kv_cache must be [num_blocks, page_size, width], got shape "
                         f"{tuple(kv_cache.shape)}")
    return kv_cache.unsqueeze(1)


def mla_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, *, kv_lora_rank: int,
                         scale: Optional[float] = None, kv_scale: ScaleLike = None,
                         out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None,
                         return_lse: bool = False,
                         compute_dtype: torch.dtype = torch.float32,
                         tree_mask: Optional[torch.Tensor] = None):
    """Reference multi-head latent attention (MLA) decode over a paged latent cache.

    q: ``[B, Hq, W]`` or ``[B, T, Hq, W]`` absorbed queries, ``W = kv_lora_rank + rope_dim``
       (``q_nope`` already multiplied into the latent space, then ``q_pe``); token ``t``
       sits at position ``seq_len - T + t`` and sees keys ``j <= seq_len - T + t``.
    kv_cache: ``[num_blocks, P, W]`` (any strides): one latent row a token, the key is the
       whole row and the value its first ``kv_lora_rank`` columns. fp8 rows are read as
       ``code * kv_scale``.
    block_table ``[B, max_blocks]`` / seq_lens ``[B]``: as :func:`paged_decode_attention`
       (the same bounds rule: absent keys are never read; a length ``<= 0`` gives zeros).
    scale: softmax scale, default ``1 / sqrt(W)``.
    tree_mask: ``[B * T, W]`` int32 packed tree mask (speculative verify): the T drafts are
       the last T keys; token ``t`` sees the keys before them and draft ``j`` iff
       :func:`unpack_tree_mask` of its row says so (as :func:`paged_decode_attention`).
    out: ``[B, (T,) Hq, kv_lora_rank]``; lse: ``[B, (T,) Hq]`` float32, the natural log of
       each row's softmax normaliser (``-inf`` where a row sees no key).
    Returns ``out`` (q's dtype unless given), or ``(out, lse)`` with ``return_lse`` or
    ``lse``.
    """
    view = _mla_cache_view(kv_cache)
    rank = int(kv_lora_rank)
    squeeze = q.dim() == 3
    q4 = q.unsqueeze(1) if squeeze else q
    num_seqs, num_tokens, num_q_heads, width = q4.shape
    sm_scale = _resolve_scale(scale, width)
    result = torch.zeros((num_seqs, num_tokens, num_q_heads, rank), dtype=compute_dtype,
                         device=q.device)
    lse_all = torch.full((num_seqs, num_tokens, num_q_heads), float("-inf"),
                         dtype=torch.float32, device=q.device)
    lens = seq_lens.tolist()
    capacity = block_table.shape[1] * view.shape[2]
    for s in range(num_seqs):
        length = int(lens[s])
        if length <= 0:
            continue
        stop = min(length, capacity)
        rows = gather_kv(view, block_table[s], 0, stop, scale=kv_scale,
                         dtype=compute_dtype).to(q.device)  # [L, 1, W]
        mask = causal_mask(num_tokens, length, device=q.device, num_keys=stop)
        if tree_mask is not None:
            _apply_tree(mask, tree_mask[s * num_tokens:(s + 1) * num_tokens], length, stop)
        mask &= key_presence(view, block_table[s], 0, stop).to(q.device)
        o, row_lse = _attend(q4[s].to(compute_dtype), rows, rows[..., :rank], mask,
                             sm_scale, None, None)
        result[s] = o
        lse_all[s] = row_lse.to(torch.float32)
    if squeeze:
        result, lse_all = result.squeeze(1), lse_all.squeeze(1)
    if out is None:
        out = result.to(q.dtype)
    else:
        out.copy_(result)
    if lse is not None:
        lse.copy_(lse_all)
    elif return_lse:
        lse = lse_all
    return (out, lse) if lse is not None else out


def write_mla_cache(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, *, kv_scale: ScaleLike = None) -> None:
    """Write new tokens' latent rows into the paged MLA cache (in place).

    kv_c: ``[N, kv_lora_rank]``, k_pe: ``[N, rope_dim]``; kv_cache: ``[num_blocks, P,
    kv_lora_rank + rope_dim]`` (any strides). Token ``i`` goes to block
    ``slot_mapping[i] // P``, offset ``slot_mapping[i] % P``, as ``[kv_c | k_pe]``; a slot
    outside ``[0, num_blocks * P)`` (``-1`` marks padding) is skipped. fp8 caches store
    ``x / kv_scale`` saturated (:func:`quantize_fp8`), others a plain cast.
    """
    slots = slot_mapping.to(device=kv_c.device, dtype=torch.long)
    num_blocks, page_size = kv_cache.shape[0], kv_cache.shape[1]
    keep = (slots >= 0) & (slots < num_blocks * page_size)
    slots = slots[keep]
    vals = torch.cat([kv_c[keep].to(torch.float32), k_pe[keep].to(torch.float32)], dim=1)
    if kv_cache.dtype in FP8_DTYPES:
        vals = quantize_fp8(vals, kv_cache.dtype, kv_scale)
    else:
        vals = vals.to(kv_cache.dtype)
    kv_cache[slots // page_size, slots % page_size, :] = vals


#: the name the MLA decode's oracle is known by beside the op's own
mla_decode_reference = mla_decode_attention


# ----------------------------------------------------------------------------- cache ops


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale: ScaleLike = None,
             v_scale: ScaleLike = None) -> None:
    """Write new tokens into the paged cache (in place).

    k, v: ``[num_tokens, num_kv_heads, D]``.
    k_cache, v_cache: ``[num_blocks, num_kv_heads, P, D]`` views (any strides, written
       through the view); a 5-D split-x K cache is written through its own indexing.
    slot_mapping: ``[num_tokens]`` integer; slot ``s`` is block ``s // P``, offset
       ``s % P``; ``-1`` marks padding and is skipped, as is any slot outside
       ``[0, num_blocks * P)`` (nothing is written for it).
    fp8 caches store ``k / k_scale`` (saturated), others a plain cast.
    """
    slots = slot_mapping.to(device=k.device, dtype=torch.long)
    view = as_canonical_view(k_cache)
    keep = (slots >= 0) & (slots < view.shape[0] * view.shape[2])  # others: skipped
    slots = slots[keep]
    for src, cache, sc in ((k[keep], k_cache, k_scale), (v[keep], v_cache, v_scale)):
        if cache.dtype in FP8_DTYPES:
            vals = quantize_fp8(src, cache.dtype, sc)
        else:
            vals = src.to(cache.dtype)
        if cache.dim() == 5:
            n, h, dx, p, x = cache.shape
            blocks, offs = slots // p, slots % p
            # vals [T, H, D] -> [T, H, D // x, x] placed at cache[blk, :, :, off, :]
            cache[blocks, :, :, offs, :] = vals.reshape(vals.shape[0], h, dx, x)
        else:
            p = cache.shape[2]
            blocks, offs = slots // p, slots % p
            cache[blocks, :, offs, :] = vals


def copy_blocks(k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_mapping: torch.Tensor) -> None:
    """Copy whole blocks (copy-on-write of a forked tail): for each row ``(src, dst)`` of
    ``block_mapping [n, 2]`` set ``cache[dst] = cache[src]`` in both caches.

    All sources are read before any destination is written, so the result is defined
    when a destination is also a source; destinations must be distinct. A pair with an
    id outside ``[0, num_blocks)`` is skipped (nothing is read or written for it).
    k_cache, v_cache: the caches' storage tensors (any layout whose first axis is the
    block; the 5-D split-x K cache too).
    """
    pairs = block_mapping.to(device=k_cache.device, dtype=torch.long).reshape(-1, 2)
    n = k_cache.shape[0]
    pairs = pairs[((pairs >= 0) & (pairs < n)).all(dim=1)]  # a pair with a bad id: skipped
    for cache in (k_cache, v_cache):
        cache[pairs[:, 1]] = cache[pairs[:, 0]].clone()


# ----------------------------------------------------------------------------- MLA prefill
# (its own module; the only module of ours this one imports)
from hygon_attn_backend.reference_mla_prefill import (  # noqa: E402,F401
    merge_attn_states, mla_extend_attention, ragged_attention)
