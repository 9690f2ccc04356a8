"""Public op: paged decode attention (KV-head grid, split-KV partitions, combine).

validate -> plan (``plan.py``: the config from ``tuning.choose``, the workspace) -> launch
(``triton.py``: ``kernels/decode.py``, ``kernels/combine.py``; ``native.py``: ``csrc/``).
Engines build the plan once per step and pass ``plan=`` from every layer.
"""

from __future__ import annotations

from typing import Optional

import torch

from hygon_attn_backend.ops import _checks
from hygon_attn_backend.ops.decode.plan import (MAX_HEAD_DIM, DecodePlan, DecodeWorkspace,
                                                ScaleLike, check_layer_options,
                                                plan_paged_decode)

__all__ = ["paged_decode_attention"]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                           scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
                           k_scale: ScaleLike = None, v_scale: ScaleLike = None,
                           partition_size: Optional[int] = None,
                           sliding_window: Optional[int] = None,
                           soft_cap: Optional[float] = None,
                           sinks: Optional[torch.Tensor] = None,
                           workspace: Optional[DecodeWorkspace] = None,
                           max_seq_len: Optional[int] = None,
                           fused_combine: Optional[bool] = None,
                           tree_mask: Optional[torch.Tensor] = None,
                           return_lse: bool = False,
                           plan: Optional[DecodePlan] = None,
                           impl: str = "auto"):
    """Paged decode attention: each query token attends to its sequence's cached keys.

    q: ``[num_seqs, Hq, D]`` fp16/bf16 (fp32 runs the reference; one token per sequence), or
       ``[num_seqs, T, Hq, D]`` (T speculative tokens; token ``t`` is at position
       ``seq_len - T + t`` and sees keys ``j <= seq_len - T + t``). Any strides.
    k_cache, v_cache: ``[num_blocks, Hkv, P, D]`` canonical views with any strides (every
       layout of ``hygon_attn_backend.layouts``), dtype = q's, or fp8 e4m3fn/e5m2 with
       per-tensor ``k_scale``/``v_scale``. ``k_cache`` may be vLLM's legacy 5-D split-x
       K cache ``[num_blocks, Hkv, D // x, P, x]``. ``Hq % Hkv == 0``; D in 1..256
       (64, 80, 96, 128, 192, 256 are the tested sizes); any block size P >= 1.
    block_table: ``[num_seqs, max_blocks]`` int32/int64 physical block ids; token ``j`` of
       sequence ``s`` is slot ``j % P`` of block ``block_table[s, j // P]``.
    seq_lens: ``[num_seqs]`` int32/int64 key lengths (>= T). A length <= 0 gives zeros.
       Keys past the table (``seq_len > max_blocks * P``) are absent and never walked: a
       sequence costs at most its table's capacity, whatever its ``seq_len``.
    scale: softmax scale, a finite float > 0 (else ``ValueError``), default ``1 / sqrt(D)``.
    out: optional ``q``-shaped output (fp16/bf16/fp32), written in place and returned.
    k_scale, v_scale: fp8 caches' scales, read on the device (no sync): per tensor (a
       float or a 1-element float32 tensor) or per KV head (``[Hkv]`` float32): a cached
       code ``c`` of head ``h`` stands for ``c * k_scale[h]``.
    partition_size: tokens per split-KV partition, a multiple of 16; default
       :func:`tuning.triton_partition_size` (env ``HYGON_ATTN_PARTITION_SIZE`` /
       ``PA_PARTITION_SIZE`` override it). One partition writes ``out`` directly; several
       write scratch that a combine kernel merges.
    sliding_window: W: a token at position ``i`` sees keys ``i - W < j <= i`` (supported).
    soft_cap: logits become ``cap * tanh(logit / cap)`` (supported).
    sinks: ``[Hq]`` per-head sink logits (natural units): an extra always-visible key with
       value 0 (supported).
    workspace: preallocated :class:`DecodeWorkspace` (:func:`allocate_decode_workspace`);
       with it the op allocates nothing and never syncs with the host, so it can be
       captured in a CUDA graph. Without it, split launches allocate scratch per call.
    max_seq_len: host-side upper bound of ``seq_lens`` used to size the grid (default
       ``max_blocks * P``, the table's capacity). A ``seq_len`` above it gets the same
       answer, slower: its partitions grow to cover it (up to the table's capacity).
    fused_combine: a split launch merges its partitions inside the decode kernel (one
       launch) instead of a second kernel; default :func:`tuning.use_fused_combine`.
    return_lse: also return ``lse`` ``[num_seqs, Hq]`` (``[num_seqs, T, Hq]``) float32,
       ``ln sum_j exp(s_j)`` over the keys each row sees (sinks included; ``-inf`` for a
       row that sees none): what a context-parallel decode merges the ranks' outputs by.
       Triton or the reference: ``impl="auto"`` takes Triton where it would take native,
       ``impl="native"`` is refused (``tuning.native_lacks``). With ``plan=`` it is the
       plan's (``plan_paged_decode(return_lse=...)``).
    plan: a :func:`plan_paged_decode` result for this batch (built once per step, reused by
       every layer): the call then checks only what a layer can change (q's shape and
       dtype, the caches' shape and dtype, ``block_table``/``seq_lens`` must be the
       planned tensors) and launches; the batch-level options (partition_size, workspace,
       max_seq_len, fused_combine, impl) come from the plan.
    impl: ``"auto"`` | ``"triton"`` | ``"native"`` (``csrc/``; D in 64/80/96/128/192/256) |
       ``"reference"``.

    Bad block ids (negative or >= num_blocks) and table entries past ``max_blocks`` are
    never read: those keys are skipped (``HYGON_ATTN_DEBUG=1`` raises instead).
    Returns ``out`` (q's shape, q's dtype unless ``out`` is given), or ``(out, lse)``.
    """
    if plan is not None:
        if not isinstance(plan, DecodePlan):
            raise ValueError(f"plan must be a DecodePlan (plan_paged_decode), got "
                             f"{type(plan).__name__}")
        plan.check_call(q, k_cache, v_cache, block_table, seq_lens, out)
        if tree_mask is not None and tree_mask is not plan.tree_mask:
            raise ValueError("tree_mask must be the tensor the plan was built with "
                             "(plan_paged_decode(tree_mask=...))")
        if return_lse and not plan.return_lse:
            raise ValueError("return_lse=True needs a plan built with return_lse=True "
                             "(plan_paged_decode(return_lse=True))")
        return plan.run(q, k_cache, v_cache, out=out, scale=scale, k_scale=k_scale,
                        v_scale=v_scale,
                        sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    _checks.check_tensor("q", q, ndim=(3, 4), dtypes=_checks.Q_DTYPES)
    device = q.device
    num_seqs, num_q_heads, head_dim = q.shape[0], q.shape[-2], q.shape[-1]
    num_tokens = 1 if q.dim() == 3 else q.shape[1]
    num_blocks, num_kv_heads, page_size, _ = _checks.check_kv_caches(
        k_cache, v_cache, device=device, head_dim=head_dim)
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"q's {num_q_heads} heads must be a multiple of k_cache's "
                         f"{num_kv_heads} kv heads (q {_checks.describe(q)})")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"q head_dim must be <= {MAX_HEAD_DIM}, got {_checks.describe(q)}")
    fp8 = k_cache.dtype in _checks.FP8_DTYPES
    if not fp8 and k_cache.dtype != q.dtype:
        raise ValueError(f"k_cache dtype must match q's ({q.dtype}) or be fp8, got "
                         f"{_checks.describe(k_cache)}")
    _checks.check_tensor("block_table", block_table, ndim=2, dtypes=_checks.INDEX_DTYPES,
                         device=device, shape=(num_seqs, None))
    _checks.check_tensor("seq_lens", seq_lens, ndim=1, dtypes=_checks.INDEX_DTYPES,
                         device=device, shape=(num_seqs,))
    if out is not None:
        _checks.check_tensor("out", out, dtypes=_checks.Q_DTYPES, device=device,
                             shape=tuple(q.shape))
    check_layer_options(num_q_heads=num_q_heads, device=device,
                        sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    k_scale = _checks.check_scale("k_scale", k_scale, k_cache.dtype, device,
                                  num_kv_heads=num_kv_heads)
    v_scale = _checks.check_scale("v_scale", v_scale, v_cache.dtype, device,
                                  num_kv_heads=num_kv_heads)
    if _checks.debug_enabled():
        _debug_checks(block_table, seq_lens, num_blocks, page_size, num_tokens)
    plan = plan_paged_decode(
        block_table, seq_lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, page_size=page_size, q_dtype=q.dtype,
        kv_dtype=k_cache.dtype, num_tokens=num_tokens, scale=scale, max_seq_len=max_seq_len,
        partition_size=partition_size, workspace=workspace,
        fused_combine=fused_combine, tree_mask=tree_mask, return_lse=return_lse, impl=impl)
    return plan.run(q, k_cache, v_cache, out=out, k_scale=k_scale, v_scale=v_scale,
                    sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)


def _debug_checks(block_table, seq_lens, num_blocks, page_size, num_tokens):
    """HYGON_ATTN_DEBUG=1: value checks that sync with the host."""
    lens = seq_lens.to(torch.int64)
    if bool((lens < 0).any()):
        raise ValueError(f"seq_lens holds negative lengths (min {int(lens.min())})")
    if lens.numel() and bool((lens[lens > 0] < num_tokens).any()):
        raise ValueError(f"seq_lens must be >= the {num_tokens} query tokens of a sequence")
    capacity = block_table.shape[1] * page_size
    if lens.numel() and int(lens.max()) > capacity:
        raise ValueError(f"block_table has {block_table.shape[1]} blocks of {page_size} "
                         f"slots ({capacity} tokens) but seq_lens holds {int(lens.max())}")
    needed = (lens + page_size - 1) // page_size
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    used = cols.unsqueeze(0) < needed.unsqueeze(1)
    _checks.check_block_ids("block_table", block_table, num_blocks, used)
