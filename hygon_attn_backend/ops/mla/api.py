"""Public op: multi-head latent attention (MLA) decode over a paged latent cache.

validate -> plan (``plan.py``: the implementation and config from ``tuning.choose``, the
workspace) -> launch (``triton.py``: ``kernels/mla_decode.py``; ``native.py``: the sm_90a
kernel of ``csrc/mla_decode_sm90.cu``, with the Triton combine for a split). Engines
build the plan once per step (:func:`plan_mla_decode`) and call :meth:`MLADecodePlan.run`
from every layer.

Cache views: vLLM's MLA cache ``[num_blocks, block_size, 576]`` is passed as it is;
SGLang's ``kv_buffer[layer]`` ``[num_pages * page_size (+ page_size), 1, 576]`` as
``kv_buffer[layer].view(-1, page_size, 576)`` with its page table (``req_to_token``
rows for page size 1, ``req_to_token[:, ::P] // P`` otherwise).
"""

from __future__ import annotations

from typing import Optional

import torch

from hygon_attn_backend.ops import _checks
from hygon_attn_backend.ops.mla.plan import ScaleLike, plan_mla_decode

__all__ = ["mla_decode_attention"]


def mla_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                         seq_lens: torch.Tensor, *, kv_lora_rank: int,
                         scale: Optional[float] = None, kv_scale: ScaleLike = None,
                         out: Optional[torch.Tensor] = None, return_lse: bool = False,
                         max_seq_len: Optional[int] = None,
                         tree_mask: Optional[torch.Tensor] = None, impl: str = "auto"):
    """MLA decode: each query row attends to its request's cached latent rows.

    q: ``[B, Hq, W]`` or ``[B, T, Hq, W]`` float16 / bfloat16 (float32 runs the reference),
       any strides: absorbed queries, ``W = kv_lora_rank + rope_dim`` (``q_nope @ W_UK``
       then ``q_pe``). Token ``t`` of a request sits at ``seq_len - T + t`` and sees keys
       ``j <= seq_len - T + t`` (T = 2..4: MTP verify).
    kv_cache: ``[num_blocks, page_size, W]`` (any strides), q's dtype or float8_e4m3fn /
       float8_e5m2 with ``kv_scale``: one latent row ``[kv_c | k_pe]`` a token; the key is
       the row, the value its first ``kv_lora_rank`` columns.
    block_table: ``[B, max_blocks]`` int32/int64; seq_lens: ``[B]`` int32/int64 (the query
       tokens included). A length ``<= 0`` gives zeros; keys past the table or with a block
       id outside ``[0, num_blocks)`` are absent (never read; ``HYGON_ATTN_DEBUG=1``
       raises on such ids).
    kv_lora_rank: the value width R (1..512); ``rope_dim = W - R`` (0..128).
    scale: softmax scale, a finite float > 0, default ``1 / sqrt(W)``.
    kv_scale: an fp8 cache's per-tensor scale, float or 1-element float32 tensor.
    out: optional ``[B, (T,) Hq, R]`` fp16/bf16/fp32, written in place.
    return_lse: also return ``lse [B, (T,) Hq]`` float32, each row's natural-log softmax
       normaliser (``-inf`` where a row sees no key).
    max_seq_len: host-side bound of ``seq_lens`` (sizes the split; default the table's
       capacity).
    tree_mask: ``[B * T, W]`` int32 packed tree mask of a speculative verify batch: token
       ``t`` sees the keys before the T drafts and draft ``j`` iff bit ``j`` of its row is
       set (``ops.tree_mask``, :func:`plan_mla_decode`).
    impl: ``"auto"`` (the native sm_90a kernel where it covers the call, see
       :func:`plan_mla_decode`; else Triton, or the reference without a GPU) | ``"native"``
       | ``"triton"`` | ``"reference"``.
    Returns ``out`` (q's dtype unless given), or ``(out, lse)``.
    """
    _checks.check_tensor("q", q, ndim=(3, 4), dtypes=_checks.Q_DTYPES)
    device = q.device
    _checks.check_tensor("kv_cache", kv_cache, ndim=3, dtypes=_checks.KV_DTYPES, device=device)
    width = q.shape[-1]
    if kv_cache.shape[2] != width:
        raise ValueError(f"kv_cache rows must be q's width {width} (kv_lora_rank + rope_dim), "
                         f"got {_checks.describe(kv_cache)} for q {_checks.describe(q)}")
    if isinstance(kv_lora_rank, bool) or not isinstance(kv_lora_rank, int) or \
            not 0 < kv_lora_rank <= width:
        raise ValueError(f"kv_lora_rank must be an int in [1, {width}] (q's width), got "
                         f"{kv_lora_rank!r}")
    if kv_cache.shape[1] < 1:
        raise ValueError(f"page_size must be a positive int, got {kv_cache.shape[1]} "
                         f"(kv_cache {_checks.describe(kv_cache)})")
    if kv_cache.dtype not in _checks.FP8_DTYPES and kv_cache.dtype != q.dtype:
        raise ValueError(f"kv_cache dtype must match q's ({q.dtype}) or be fp8, got "
                         f"{_checks.describe(kv_cache)}")
    num_seqs = q.shape[0]
    _checks.check_tensor("block_table", block_table, ndim=2, dtypes=_checks.INDEX_DTYPES,
                         device=device, shape=(num_seqs, None))
    _checks.check_tensor("seq_lens", seq_lens, ndim=1, dtypes=_checks.INDEX_DTYPES,
                         device=device, shape=(num_seqs,))
    kv_scale = _checks.check_scale("kv_scale", kv_scale, kv_cache.dtype, device)
    num_tokens = 1 if q.dim() == 3 else q.shape[1]
    if _checks.debug_enabled():
        _checks.check_used_block_ids("block_table", block_table, seq_lens, kv_cache.shape[0],
                                     kv_cache.shape[1])
    plan = plan_mla_decode(
        block_table=block_table, seq_lens=seq_lens, page_size=kv_cache.shape[1],
        num_q_heads=q.shape[-2], kv_lora_rank=kv_lora_rank, rope_dim=width - kv_lora_rank,
        q_dtype=q.dtype, kv_dtype=kv_cache.dtype, num_tokens=num_tokens, scale=scale,
        max_seq_len=max_seq_len, return_lse=return_lse, tree_mask=tree_mask, impl=impl)
    return plan.run(q, kv_cache, out=out, kv_scale=kv_scale)
