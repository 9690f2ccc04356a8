"""Public MLA prefill ops: ``ragged_attention`` (dense varlen attention, query/key head
unlike the value head) and ``merge_attn_states`` (two partial results merged by LSE).

Which engine path calls which op (vLLM 0.32, SGLang 0.5.23):

* vLLM, ``MLACommonBaseImpl.forward_mha`` (every MLA backend's prefill: the latent K/V
  up-projected, ``Hq == Hkv``, q/k ``192 = 128 nope + 64 rope``, v ``128``): the new
  tokens' causal attention, ``MLAPrefillBackend.run_prefill_new_tokens`` (``cu_seqlens_q
  = cu_seqlens_k = query_start_loc``, ``causal=True``, LSE when there is a context) ->
  :func:`ragged_attention`; each context chunk, ``run_prefill_context_chunk``
  (``cu_seqlens_k = chunk.cu_seq_lens``, ``causal=False``, LSE) -> :func:`ragged_attention`;
  the chunks folded together (``accumulate_mla_context_chunk``) and into the new tokens'
  result (``merge_attn_states(output, prefix_output, prefix_lse, suffix_output,
  suffix_lse)``), and the context-parallel merge -> :func:`merge_attn_states`. LSE is
  ``[H, N]`` there, as here.
* SGLang, ``DeepseekV2AttentionMLA`` with a backend SGLang does not know (``hygon`` gets
  the ``triton`` handler): ``AttnForwardMethod.MHA`` (an extend with no cached prefix)
  calls ``forward_extend`` with q/k ``[N, H, 192]``, v ``[N, H, 128]`` -> :func:`ragged_attention`
  with ``cu_seqlens_k = cu_seqlens_q``, causal. An extend with a cached prefix, and
  decode, take ``AttnForwardMethod.MLA`` (absorbed): ``forward_extend`` with q ``[N, H,
  576]`` over the paged latent pool (one KV head, v = its first 512 columns; the new
  tokens' rows written first, as ``forward_extend`` does) -> :func:`mla_extend_attention`.

Validate -> plan (``plan.py``: the config from ``tuning.choose``, the tile map) -> launch
(``triton.py``: ``kernels/mla_prefill.py``).
"""

from __future__ import annotations

from typing import Optional

import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops import _checks
from hygon_attn_backend.ops._checks import ScaleLike
from hygon_attn_backend.ops._dispatch import select_impl
from hygon_attn_backend.ops._interpreter import triton_computes
from hygon_attn_backend.ops.mla_prefill import triton, tuning
from hygon_attn_backend.ops.mla_prefill.plan import (RaggedPlan, plan_mla_extend,
                                                     plan_ragged_attention)

__all__ = ["ragged_attention", "merge_attn_states", "mla_extend_attention"]

MERGE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_ragged_call(q, k, v, cu_seqlens_q, cu_seqlens_k, out):
    _checks.check_tensor("q", q, ndim=3, dtypes=_checks.Q_DTYPES)
    device = q.device
    _checks.check_tensor("k", k, ndim=3, dtypes=(q.dtype,), device=device)
    _checks.check_tensor("v", v, ndim=3, dtypes=(q.dtype,), device=device)
    total_q, num_q_heads, d_qk = q.shape
    total_k, num_kv_heads, _ = k.shape
    if k.shape[2] != d_qk:
        raise ValueError(f"k's head size {k.shape[2]} must be q's {d_qk} (q: "
                         f"{_checks.describe(q)}, k: {_checks.describe(k)})")
    if v.shape[:2] != k.shape[:2]:
        raise ValueError(f"v must hold k's {total_k} rows and {num_kv_heads} heads, got v "
                         f"{_checks.describe(v)}, k {_checks.describe(k)}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"q's {num_q_heads} heads must be a multiple of k's {num_kv_heads} "
                         f"heads (q: {_checks.describe(q)}, k: {_checks.describe(k)})")
    for name, width in (("q/k head size", d_qk), ("v head size", v.shape[2])):
        if not 1 <= width <= tuning.MAX_HEAD_DIM:
            raise ValueError(f"the {name} must be in [1, {tuning.MAX_HEAD_DIM}], got {width} "
                             f"(q: {_checks.describe(q)}, v: {_checks.describe(v)})")
    num_seqs = _checks.check_cu_seqlens(cu_seqlens_q, device=device)
    _checks.check_tensor("cu_seqlens_k", cu_seqlens_k, ndim=1, dtypes=_checks.INDEX_DTYPES,
                         device=device, shape=(num_seqs + 1,))
    if out is not None:
        _checks.check_tensor("out", out, dtypes=(q.dtype,), device=device,
                             shape=(total_q, num_q_heads, v.shape[2]))


def ragged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *,
                     scale: Optional[float] = None, causal: bool = True,
                     out: Optional[torch.Tensor] = None, return_lse: bool = False,
                     plan: Optional[RaggedPlan] = None, validate: Optional[bool] = None,
                     impl: str = "auto"):
    """Ragged (varlen) dense attention whose value head may differ from the query/key head
    (MLA's up-projected prefill: 192/128).

    q: ``[total_q, Hq, D_QK]`` float16/bfloat16 (float32: the reference), any strides;
       request ``b`` owns rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (``Lq_b``).
    k: ``[total_k, Hkv, D_QK]``, v: ``[total_k, Hkv, D_V]``, q's dtype, any strides
       (vLLM's k with its rope part broadcast over the heads, v a column slice of the
       up-projection); ``Hq`` a multiple of ``Hkv`` (``Hq == Hkv`` for MLA, GQA too);
       ``D_QK``, ``D_V`` in ``[1, 256]``, any width. Request ``b``'s keys are rows
       ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` (``Lk_b``).
    cu_seqlens_q, cu_seqlens_k: ``[B + 1]`` int32/int64, start at 0, non-decreasing;
       ``cu_seqlens_q[-1] == total_q``, ``cu_seqlens_k[-1] <= total_k``.
    scale: softmax scale, a finite float > 0, default ``1 / sqrt(D_QK)``.
    causal: row ``i`` sees key ``j`` iff ``j <= i + (Lk - Lq)`` (bottom-right aligned: the
       queries are the last tokens of their sequence; ``Lk < Lq`` leaves the first ``Lq -
       Lk`` rows without a key); ``False``: every key of its request.
    out: optional ``[total_q, Hq, D_V]`` q's dtype (any strides).
    return_lse: also return ``lse [Hq, total_q]`` float32, natural log of each row's
       softmax normaliser (vLLM's ``merge_attn_states`` layout; ``-inf`` for a row that
       sees no key).
    plan: a :func:`plan_ragged_attention` result for this batch (built once, reused by
       every layer): the call then checks only shapes against it and launches;
       ``cu_seqlens_q``/``cu_seqlens_k`` must be the planned tensors.
    validate: check the offsets on the host (one sync); default on unless a CUDA graph is
       being captured, off with a plan (the planner checks host copies) unless
       ``HYGON_ATTN_DEBUG=1``. Unchecked wild offsets give an undefined answer but never
       a read or write outside q, k, v, out and lse. impl: ``"auto"`` | ``"triton"`` |
       ``"native"`` (the sm_90 kernel at q/k / v heads 128 / 128 and 192 / 128:
       :func:`plan_ragged_attention`) | ``"reference"``.

    Returns ``out`` or ``(out, lse)``. Rows that see no key give 0 (never NaN).
    """
    if plan is not None:
        if not isinstance(plan, RaggedPlan):
            raise ValueError(f"plan must be a RaggedPlan (plan_ragged_attention), got "
                             f"{type(plan).__name__}")
        plan.check_call(q, k, v, cu_seqlens_q, cu_seqlens_k)
        if out is not None:
            _checks.check_tensor("out", out, dtypes=(q.dtype,), device=q.device,
                                 shape=(q.shape[0], q.shape[1], v.shape[2]))
        if validate or (validate is None and _checks.debug_enabled()):
            _validate(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0])
        return plan.run(q, k, v, scale=scale, causal=causal, out=out, return_lse=return_lse)
    _check_ragged_call(q, k, v, cu_seqlens_q, cu_seqlens_k, out)
    _checks.check_softmax_scale(scale)
    if validate is None:
        validate = q.device.type != "cuda" or not torch.cuda.is_current_stream_capturing()
    host = _validate(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0]) if validate else None
    plan = plan_ragged_attention(
        cu_seqlens_q, cu_seqlens_k, total_q=q.shape[0], total_k=k.shape[0],
        num_q_heads=q.shape[1], num_kv_heads=k.shape[1], head_dim_qk=q.shape[2],
        head_dim_v=v.shape[2], host_cu_seqlens_q=None if host is None else host[0],
        host_cu_seqlens_k=None if host is None else host[1], q_dtype=q.dtype, impl=impl)
    return plan.run(q, k, v, scale=scale, causal=causal, out=out, return_lse=return_lse)


def _validate(cu_seqlens_q, cu_seqlens_k, total_q, total_k):
    """Host check of the offsets (one device->host copy); returns their host lists."""
    from hygon_attn_backend.ops.mla_prefill.plan import check_ragged_lengths

    n = cu_seqlens_q.shape[0]
    both = torch.cat([cu_seqlens_q.detach().to(torch.int64),
                      cu_seqlens_k.detach().to(torch.int64)]).cpu().tolist()
    cu_q, cu_k = both[:n], both[n:]
    check_ragged_lengths(cu_q, cu_k, total_q=total_q, total_k=total_k)
    return cu_q, cu_k


def merge_attn_states(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                      lse_b: torch.Tensor, *, out: Optional[torch.Tensor] = None,
                      out_lse: Optional[torch.Tensor] = None, return_lse: bool = False,
                      impl: str = "auto"):
    """Merge two partial attention results over disjoint key sets by their LSE (vLLM's
    chunked-context prefill and context parallelism).

    out_a, out_b: ``[N, H, D]`` float16/bfloat16/float32, one dtype, any strides (slices
       of a larger buffer too). lse_a, lse_b: ``[H, N]`` float32 natural log, any strides
       (what :func:`ragged_attention` returns).
    Row ``(t, h)`` becomes ``(w_a * out_a + w_b * out_b) / (w_a + w_b)``, ``w = exp(lse -
    max(lse_a, lse_b))``, in fp32; its LSE ``log(exp(lse_a) + exp(lse_b))``. A partial
    whose LSE is not finite (``-inf``: a chunk that saw no key; ``+inf`` or NaN: no
    defined normaliser) contributes nothing and its output is not read (it may hold
    anything, NaN included); when neither is finite the row is 0 and its LSE ``-inf``.
    out: optional ``[N, H, D]`` output in ``out_a``'s dtype, any strides; may be
       ``out_a`` or ``out_b`` itself (the merge in place, as vLLM's accumulator does).
    out_lse: optional ``[H, N]`` float32 for the merged LSE (may be ``lse_a`` or
       ``lse_b``); return_lse: return it (allocated when ``out_lse`` is None).
    impl: ``"auto"`` | ``"triton"`` | ``"native"`` (Triton) | ``"reference"``.

    Returns ``out``, or ``(out, out_lse)`` with ``return_lse`` or ``out_lse`` given.
    """
    _checks.check_tensor("out_a", out_a, ndim=3, dtypes=MERGE_DTYPES)
    device = out_a.device
    n, h, _ = out_a.shape
    _checks.check_tensor("out_b", out_b, dtypes=(out_a.dtype,), device=device,
                         shape=tuple(out_a.shape))
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        _checks.check_tensor(name, t, dtypes=(torch.float32,), device=device, shape=(h, n))
    if out is not None:
        _checks.check_tensor("out", out, dtypes=(out_a.dtype,), device=device,
                             shape=tuple(out_a.shape))
    if out_lse is not None:
        _checks.check_tensor("out_lse", out_lse, dtypes=(torch.float32,), device=device,
                             shape=(h, n))
    want_lse = return_lse or out_lse is not None
    chosen = select_impl(impl, device, native_preferred=None)
    if out is None:
        out = torch.empty_like(out_a)
    if want_lse and out_lse is None:
        out_lse = torch.empty((h, n), dtype=torch.float32, device=device)
    if chosen == "reference":
        reference.merge_attn_states(out_a, lse_a, out_b, lse_b, out=out, out_lse=out_lse)
    else:
        triton.run_merge(out, out_lse, out_a, lse_a, out_b, lse_b)
    return (out, out_lse) if want_lse else out


def mla_extend_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, *,
                         v_head_dim: int, scale: Optional[float] = None,
                         out: Optional[torch.Tensor] = None, return_lse: bool = False,
                         kv_scale: ScaleLike = None,
                         plan: Optional[RaggedPlan] = None, validate: Optional[bool] = None,
                         impl: str = "auto"):
    """The absorbed MLA extend (SGLang's ``AttnForwardMethod.MLA`` for an extend with a
    cached prefix): the new tokens attend to a paged latent cache, one KV head.

    q: ``[total_q, Hq, D]`` float16/bfloat16 (float32: the reference), any strides; ``D =
       kv_lora_rank + rope`` (576 for DeepSeek V3, at most 576); request ``b`` owns rows
       ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (``Lq_b``).
    kv_cache: ``[num_blocks, P, D]`` q's dtype or float8_e4m3fn / float8_e5m2, any strides
       (SGLang's MLA pool ``[slots, 1, D]`` is ``view(-1, P, D)``): one latent row per
       token; the key is the whole row, the value its first ``v_head_dim`` columns (512).
       An fp8 row is ``code * kv_scale``.
    block_table: ``[B, max_blocks]`` int32/int64; token ``t`` of request ``b`` is slot
       ``t % P`` of block ``block_table[b, t // P]``; an id outside ``[0, num_blocks)`` is
       never read (its keys are absent).
    cu_seqlens_q: ``[B + 1]`` (starts at 0, non-decreasing, ends at total_q); seq_lens_k:
       ``[B]`` every key of a request, prefix and new, all in the cache (the engine writes
       the new rows first), ``Lk_b >= Lq_b`` and within the table. Mask: shifted causal,
       row ``i`` sees key ``j`` iff ``j <= i + (Lk - Lq)``.
    scale: softmax scale (finite, > 0), default ``1 / sqrt(D)``. out: optional ``[total_q,
       Hq, v_head_dim]`` q's dtype. return_lse: also ``lse [Hq, total_q]`` float32.
    kv_scale: an fp8 cache's per-tensor scale, a float or a 1-element float32 tensor (read
       on the device), default 1; ignored for a 16-bit cache.
    plan: a :func:`plan_mla_extend` result for this batch (once per step, every layer);
       validate / impl as :func:`ragged_attention`.

    Returns ``out`` or ``(out, lse)``. Rows that see no key give 0.
    """
    if plan is not None:
        if not isinstance(plan, RaggedPlan) or not plan.paged:
            raise ValueError(f"plan must be a plan_mla_extend plan, got "
                             f"{type(plan).__name__}")
        if cu_seqlens_q is not plan.cu_seqlens_q or seq_lens_k is not plan.cu_seqlens_k:
            raise ValueError("plan: cu_seqlens_q and seq_lens_k must be the tensors the "
                             "plan was built with")
    _checks.check_tensor("q", q, ndim=3, dtypes=_checks.Q_DTYPES)
    device = q.device
    total_q, num_q_heads, head_dim = q.shape
    _checks.check_tensor("kv_cache", kv_cache, ndim=3,
                         dtypes=(q.dtype,) + tuple(_checks.FP8_DTYPES), device=device,
                         shape=(None, None, head_dim))
    kv_scale = _checks.check_scale("kv_scale", kv_scale, kv_cache.dtype, device)
    if kv_cache.shape[1] < 1:
        raise ValueError(f"page_size must be a positive int, got {kv_cache.shape[1]} "
                         f"(kv_cache {_checks.describe(kv_cache)})")
    if not 1 <= int(v_head_dim) <= head_dim <= tuning.MAX_LATENT_DIM:
        raise ValueError(f"need 1 <= v_head_dim <= head_dim <= {tuning.MAX_LATENT_DIM}, got "
                         f"v_head_dim={v_head_dim} with q {_checks.describe(q)}")
    num_seqs = _checks.check_cu_seqlens(cu_seqlens_q, device=device)
    _checks.check_tensor("seq_lens_k", seq_lens_k, ndim=1, dtypes=_checks.INDEX_DTYPES,
                         device=device, shape=(num_seqs,))
    _checks.check_tensor("block_table", block_table, ndim=2, dtypes=_checks.INDEX_DTYPES,
                         device=device, shape=(num_seqs, None))
    if out is not None:
        _checks.check_tensor("out", out, dtypes=(q.dtype,), device=device,
                             shape=(total_q, num_q_heads, v_head_dim))
    _checks.check_softmax_scale(scale)
    if plan is not None:
        if plan.total_q != total_q or plan.group != num_q_heads or \
                plan.head_dim_qk != head_dim or plan.head_dim_v != v_head_dim or \
                plan.page_size != kv_cache.shape[1]:
            raise ValueError(f"plan was built for total_q={plan.total_q}, {plan.group} heads, "
                             f"{plan.head_dim_qk}/{plan.head_dim_v}, page {plan.page_size}; "
                             f"got q {_checks.describe(q)}, v_head_dim={v_head_dim}, "
                             f"kv_cache {_checks.describe(kv_cache)}")
        validate = bool(validate) or (validate is None and _checks.debug_enabled())
    elif validate is None:
        validate = device.type != "cuda" or not torch.cuda.is_current_stream_capturing()
    host_cu = host_lens = None
    if validate:
        from hygon_attn_backend.ops.prefill.plan import check_host_lengths

        both = torch.cat([cu_seqlens_q.detach().to(torch.int64),
                          seq_lens_k.detach().to(torch.int64)]).cpu().tolist()
        host_cu, host_lens = both[:num_seqs + 1], both[num_seqs + 1:]
        check_host_lengths(host_cu, host_lens, total_q=total_q,
                           capacity=block_table.shape[1] * kv_cache.shape[1])
        if _checks.debug_enabled():
            _checks.check_used_block_ids("block_table", block_table, seq_lens_k,
                                         kv_cache.shape[0], kv_cache.shape[1])
    if plan is None:
        plan = plan_mla_extend(cu_seqlens_q, seq_lens_k, total_q=total_q,
                               num_q_heads=num_q_heads, head_dim=head_dim,
                               v_head_dim=int(v_head_dim), page_size=kv_cache.shape[1],
                               host_cu_seqlens_q=host_cu, q_dtype=q.dtype, impl=impl)
    return plan.run_extend(q, kv_cache, block_table, scale=scale, out=out,
                           return_lse=return_lse, kv_scale=kv_scale)
