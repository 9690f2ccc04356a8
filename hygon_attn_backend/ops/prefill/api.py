"""Public op ``prefix_prefill_attention``: new tokens attend to a paged prefix and themselves.

Validate -> plan (``plan.py``: the config from ``tuning.choose``, the tile map) -> launch
(``triton.py``: ``kernels/prefill.py``; ``native.py``: the sm_90a kernel). Engines build the
:class:`PrefillPlan` once per step and pass ``plan=`` from every layer.
"""

from __future__ import annotations

from typing import Optional

import torch

from hygon_attn_backend.ops import _checks
from hygon_attn_backend.ops.prefill.plan import (PrefillPlan, ScaleLike, check_host_lengths,
                                                 check_prefill_options, plan_prefix_prefill)

__all__ = ["prefix_prefill_attention"]


def _check_values(cu_seqlens_q, seq_lens_k, block_table, total_q, page_size, has_k_new=False):
    """Host-side checks of the index tensors' values (one sync); returns the host copy of
    ``cu_seqlens_q``."""
    both = torch.cat([cu_seqlens_q.detach().to(torch.int64),
                      seq_lens_k.detach().to(torch.int64)]).cpu()  # one device->host copy
    cu = both[:cu_seqlens_q.shape[0]].tolist()
    check_host_lengths(cu, both[cu_seqlens_q.shape[0]:].tolist(), total_q=total_q,
                       capacity=block_table.shape[1] * page_size, has_k_new=has_k_new)
    return cu


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
                             plan: Optional[PrefillPlan] = None,
                             validate: Optional[bool] = None, impl: str = "auto"):
    """Prefix-prefill ("extend") attention on a ragged batch over a paged KV cache.

    q: ``[total_q, num_q_heads, D]`` float16/bfloat16 (any strides), the new tokens packed;
       request ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (``Lq_b`` of them).
    k_cache, v_cache: ``[num_blocks, num_kv_heads, P, D]`` views with any strides, q's
       dtype or float8_e4m3fn/float8_e5m2 (with ``k_scale``/``v_scale``); any ``P >= 1``.
    block_table: ``[B, max_blocks]`` int32/int64 physical block ids; token ``t`` of request
       ``b`` is at ``page = block_table[b, t // P]``, ``slot = t % P``. A bad id (negative
       or ``>= num_blocks``) is never read: its keys are absent, as in the reference
       (``HYGON_ATTN_DEBUG=1`` raises instead).
    cu_seqlens_q: ``[B + 1]`` int32/int64, starts at 0, non-decreasing, ends at total_q.
    seq_lens_k: ``[B]`` int32/int64 total key length ``Lk_b = prefix + Lq_b`` (>= Lq_b).
    k_new, v_new: optional ``[total_q, num_kv_heads, D]`` (q's dtype) K/V of the new tokens
       (SGLang passes them): the prefix ``[0, Lk - Lq)`` comes from the cache and the new
       keys from these. Absent (vLLM writes the cache first): all ``Lk`` keys from the cache.
    scale: softmax scale, a finite float > 0 (else ``ValueError``), default ``1 / sqrt(D)``.
    causal: the shifted causal mask, row ``i`` sees key ``j`` iff ``j <= i + (Lk - Lq)``::

           L_prefix=4, L_q=3:   prefix      new
                          i=0  1 1 1 1    1 0 0
                          i=1  1 1 1 1    1 1 0
                          i=2  1 1 1 1    1 1 1

       ``causal=False``: every row sees all ``Lk`` keys.
    sliding_window: ``W``: also ``j > i + (Lk - Lq) - W`` (causal only, as the reference).
    soft_cap: logits become ``cap * tanh(s / cap)``. sinks: ``[num_q_heads]`` float32 sink
       logits (an always-visible key of value 0), or None.
    tree_mask: ``[total_q, W]`` int32 packed tree mask of a speculative verify batch
       (``ops.tree_mask.pack_tree_mask``): new token ``i`` of a request sees the whole
       prefix and new token ``j`` iff bit ``j % 32`` of word ``j // 32`` of its row is set
       (the causal rule of the new keys replaced; causal, no sliding window). With a plan,
       it is the plan's (``plan_prefix_prefill(tree_mask=)``).
    k_scale, v_scale: fp8 caches' scales, read on the device: per tensor (a float or a
       1-element float32 tensor) or per KV head (``[num_kv_heads]`` float32).
    out: optional ``[total_q, num_q_heads, D]`` q's dtype output (any strides).
    return_lse: also return ``lse [total_q, num_q_heads]`` float32, natural log of each
       row's softmax normaliser (``-inf`` for a row that sees no key).
    plan: a :func:`plan_prefix_prefill` result for this batch (built once per step, reused
       by every layer): the call then checks only what a layer can change and launches;
       ``cu_seqlens_q``/``seq_lens_k`` must be the planned tensors, the tile config and
       ``impl`` come from the plan.
    validate: check index values on the host (one sync); default: on unless a CUDA graph
       is being captured, off with a plan (the planner checks host copies) unless
       ``HYGON_ATTN_DEBUG=1``. impl: ``"auto"`` | ``"triton"`` | ``"native"`` (the sm_90
       wgmma kernel, :func:`plan_prefix_prefill` says what it covers) | ``"reference"``
       (float32 queries run the reference).

    Returns ``out`` or ``(out, lse)``. Rows that see no key give 0 (never NaN).
    """
    if plan is not None:
        if not isinstance(plan, PrefillPlan):
            raise ValueError(f"plan must be a PrefillPlan (plan_prefix_prefill), got "
                             f"{type(plan).__name__}")
        plan.check_call(q, k_cache, cu_seqlens_q, seq_lens_k)
        if tree_mask is not None and tree_mask is not plan.tree_mask:
            raise ValueError("tree_mask must be the tensor the plan was built with "
                             "(plan_prefix_prefill(tree_mask=...))")
        _checks.check_prefill_plan(plan, total_q=q.shape[0], num_seqs=plan.num_seqs,
                                   device=q.device)
        if validate or (validate is None and _checks.debug_enabled()):
            _check_values(cu_seqlens_q, seq_lens_k, block_table, q.shape[0], k_cache.shape[2],
                          has_k_new=k_new is not None)
            _checks.check_used_block_ids("block_table", block_table, seq_lens_k,
                                         k_cache.shape[0], k_cache.shape[2])
        return plan.run(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k,
                        scale=scale, causal=causal, k_new=k_new, v_new=v_new, out=out,
                        return_lse=return_lse, k_scale=k_scale, v_scale=v_scale,
                        sliding_window=sliding_window, soft_cap=soft_cap or None, sinks=sinks)
    _checks.check_tensor("q", q, ndim=3, dtypes=_checks.Q_DTYPES)
    total_q, num_q_heads, head_dim = q.shape
    device = q.device
    num_blocks, num_kv_heads, page_size, _ = _checks.check_kv_caches(
        k_cache, v_cache, device=device, head_dim=head_dim)
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q's {num_q_heads} heads must be a multiple of the caches' "
                         f"{num_kv_heads} kv heads (q: {_checks.describe(q)}, k_cache: "
                         f"{_checks.describe(k_cache)})")
    if k_cache.dtype not in (q.dtype,) + _checks.FP8_DTYPES:
        raise ValueError(f"k_cache dtype must be q's dtype {q.dtype} or fp8, got "
                         f"{_checks.describe(k_cache)}")
    num_seqs = _checks.check_cu_seqlens(cu_seqlens_q, device=device)
    _checks.check_tensor("seq_lens_k", seq_lens_k, ndim=1, dtypes=_checks.INDEX_DTYPES,
                         device=device, shape=(num_seqs,))
    _checks.check_tensor("block_table", block_table, ndim=2, dtypes=_checks.INDEX_DTYPES,
                         device=device, shape=(num_seqs, None))
    if (k_new is None) != (v_new is None):
        raise ValueError("k_new and v_new must be given together, got "
                         f"k_new={'None' if k_new is None else _checks.describe(k_new)}, "
                         f"v_new={'None' if v_new is None else _checks.describe(v_new)}")
    if k_new is not None:
        for name, t in (("k_new", k_new), ("v_new", v_new)):
            _checks.check_tensor(name, t, dtypes=(q.dtype,), device=device,
                                 shape=(total_q, num_kv_heads, head_dim))
    if out is not None:
        _checks.check_tensor("out", out, dtypes=(q.dtype,), device=device,
                             shape=tuple(q.shape))
    if sinks is not None:
        _checks.check_tensor("sinks", sinks, ndim=1, device=device, shape=(num_q_heads,))
    check_prefill_options(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap)
    quant = k_cache.dtype in _checks.FP8_DTYPES
    if quant:
        k_scale = _checks.check_scale("k_scale", k_scale, k_cache.dtype, device,
                                      num_kv_heads=k_cache.shape[1])
        v_scale = _checks.check_scale("v_scale", v_scale, v_cache.dtype, device,
                                      num_kv_heads=k_cache.shape[1])
    else:
        k_scale = v_scale = None
    host_cu = None
    if validate is None:
        validate = device.type != "cuda" or not torch.cuda.is_current_stream_capturing()
    if validate:
        host_cu = _check_values(cu_seqlens_q, seq_lens_k, block_table, total_q, page_size,
                                has_k_new=k_new is not None)
        if _checks.debug_enabled():
            _checks.check_used_block_ids("block_table", block_table, seq_lens_k, num_blocks,
                                         page_size)
    if k_cache.dim() != 4:
        raise ValueError(f"k_cache must be a 4-D [num_blocks, kv_heads, P, D] view for "
                         f"prefill (the split-x K cache is decode-only), got "
                         f"{_checks.describe(k_cache)}")
    plan = plan_prefix_prefill(cu_seqlens_q, seq_lens_k, total_q=total_q,
                               num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, host_cu_seqlens_q=host_cu,
                               impl=impl, q_dtype=q.dtype, kv_dtype=k_cache.dtype,
                               tree_mask=tree_mask)
    return plan.run(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, scale=scale,
                    causal=causal, k_new=k_new, v_new=v_new, out=out, return_lse=return_lse,
                    k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window,
                    soft_cap=soft_cap or None, sinks=sinks)
