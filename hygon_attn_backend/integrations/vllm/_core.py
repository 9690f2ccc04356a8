"""Engine-free core of the vLLM backend: per-batch metadata and the forward routing.

Nothing here imports vLLM, so the same code runs in vLLM's worker (through
:mod:`.backend`) and in tests on machines without vLLM (the H200 test machine).

Batch order (vLLM reorders the batch for us, ``reorder_batch_threshold``)::

    tokens: [ decode requests: T tokens each | prefill / extend / chunk requests ]
            |<-- num_decode_tokens -------->|<-- num_prefill_tokens ----------->|

Decode requests (``T`` = 1, or ``1 + num_speculative_tokens`` when verifying drafts, the
same ``T`` for all of them) go to the KV-head-grid decode kernel in one launch;
everything after them (first prefills, later chunks of a chunked prefill, prefix-cache
hits, ragged verification) goes to the prefix-prefill kernel in one launch, which reads
every key, prefix and new, from the paged cache: vLLM has already written the new
tokens' K/V there (``do_kv_cache_update`` runs before ``forward``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from . import _ops

#: vLLM's ``kv_cache_dtype`` strings for fp8 caches, and the torch dtype each stores.
FP8_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


@dataclass
class HygonAttentionMetadata:
    """Per-batch metadata shared by all layers of one KV-cache group.

    Tensors live on the model's device; ``*_cpu`` values are host ints known at build
    time. The decode and prefill fields are views/slices of the batch's tensors.
    """

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [B + 1] int32, packed query offsets
    seq_lens: torch.Tensor  # [B] int32, keys per request (context + new tokens)
    block_table: torch.Tensor  # [B, max_blocks] int32 physical block ids
    slot_mapping: torch.Tensor  # [num_tokens] int64 cache slot of each new token

    num_decodes: int
    num_decode_tokens: int
    decode_query_len: int  # T, tokens per decode request
    decode_seq_lens: Optional[torch.Tensor]  # [num_decodes] int32
    decode_block_table: Optional[torch.Tensor]  # [num_decodes, max_blocks] int32

    num_prefills: int
    num_prefill_tokens: int
    prefill_cu_seqlens_q: Optional[torch.Tensor]  # [num_prefills + 1] int32, from 0
    prefill_seq_lens: Optional[torch.Tensor]  # [num_prefills] int32
    prefill_block_table: Optional[torch.Tensor]  # [num_prefills, max_blocks] int32

    causal: bool = True
    # Scratch and schedules of the public Triton ops (None on the reference path):
    decode_workspace: Optional[Any] = None  # ops.decode.DecodeWorkspace, from the builder
    prefill_plan: Optional[Any] = None  # ops.prefill.PrefillPlan of this batch's prefills


def make_metadata(*, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  block_table: torch.Tensor, slot_mapping: torch.Tensor, num_reqs: int,
                  num_actual_tokens: int, max_query_len: int, max_seq_len: int,
                  num_decodes: int, num_decode_tokens: int,
                  causal: bool = True) -> HygonAttentionMetadata:
    """Split a reordered batch into its decode head and prefill tail.

    ``num_decodes`` / ``num_decode_tokens`` come from the engine's own split (decodes
    first). Decode requests must share one query length ``T``; a batch where they do
    not (zero-length padding rows) is sent whole to the prefill kernel, which handles
    any ragged mix. A non-causal batch also goes whole to the prefill kernel.
    """
    if num_decodes and (num_decode_tokens % num_decodes or not causal):
        num_decodes, num_decode_tokens = 0, 0
    decode_query_len = num_decode_tokens // num_decodes if num_decodes else 0
    num_prefills = num_reqs - num_decodes
    num_prefill_tokens = num_actual_tokens - num_decode_tokens

    md = HygonAttentionMetadata(
        num_actual_tokens=num_actual_tokens, max_query_len=max_query_len,
        max_seq_len=max_seq_len, query_start_loc=query_start_loc, seq_lens=seq_lens,
        block_table=block_table, slot_mapping=slot_mapping,
        num_decodes=num_decodes, num_decode_tokens=num_decode_tokens,
        decode_query_len=decode_query_len, decode_seq_lens=None, decode_block_table=None,
        num_prefills=num_prefills, num_prefill_tokens=num_prefill_tokens,
        prefill_cu_seqlens_q=None, prefill_seq_lens=None, prefill_block_table=None,
        causal=causal)
    if num_decodes:
        md.decode_seq_lens = seq_lens[:num_decodes]
        md.decode_block_table = block_table[:num_decodes]
    if num_prefills:
        md.prefill_cu_seqlens_q = query_start_loc[num_decodes:num_reqs + 1] - num_decode_tokens
        md.prefill_seq_lens = seq_lens[num_decodes:num_reqs]
        md.prefill_block_table = block_table[num_decodes:num_reqs]
    return md


def plan_prefill(md: HygonAttentionMetadata, *, num_q_heads: int, num_kv_heads: int,
                 head_size: int) -> None:
    """Build the prefill kernel's tile schedule once per batch (all layers share it);
    on the device, without a host sync."""
    if not md.num_prefills:
        return
    from hygon_attn_backend.ops.prefill import plan_prefix_prefill

    md.prefill_plan = plan_prefix_prefill(
        md.prefill_cu_seqlens_q, md.prefill_seq_lens, total_q=md.num_prefill_tokens,
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_size)


def kv_cache_views(kv_cache: torch.Tensor, head_size: int, kv_cache_dtype: str = "auto"):
    """K and V views of vLLM's combined cache, no copy.

    kv_cache: logical ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` in any
    physical order (vLLM's ``KVCacheLayout``); K is ``[..., :head_size]``, V the rest.
    Returns two ``[num_blocks, num_kv_heads, block_size, head_size]`` strided views,
    reinterpreted as float8 when ``kv_cache_dtype`` is an fp8 cache stored as bytes.
    """
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size:
        raise ValueError(f"kv_cache must be [num_blocks, num_kv_heads, block_size, "
                         f"2*{head_size}], got shape {tuple(kv_cache.shape)}")
    fp8 = FP8_CACHE_DTYPES.get(kv_cache_dtype)
    if fp8 is not None and kv_cache.dtype != fp8:
        kv_cache = kv_cache.view(fp8)
    return kv_cache[..., :head_size], kv_cache[..., head_size:]


def write_new_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, *, head_size: int, kv_cache_dtype: str = "auto",
                 k_scale=None, v_scale=None, impl: str = "auto") -> None:
    """Write the new tokens' K/V into the cache through our write op.

    key, value: ``[num_tokens(+padding), num_kv_heads, head_size]``; slot_mapping:
    ``[num_tokens]`` (``-1`` = padding, skipped). Rows past ``len(slot_mapping)`` are
    padding and are not read.
    """
    k_cache, v_cache = kv_cache_views(kv_cache, head_size, kv_cache_dtype)
    n = slot_mapping.shape[0]
    fp8 = k_cache.dtype in FP8_CACHE_DTYPES.values()
    _ops.call("write_kv", key[:n], value[:n], k_cache, v_cache, slot_mapping,
              k_scale=k_scale if fp8 else None, v_scale=v_scale if fp8 else None, impl=impl)


def attention(query: torch.Tensor, kv_cache: torch.Tensor, md: HygonAttentionMetadata,
              out: torch.Tensor, *, head_size: int, scale: float,
              kv_cache_dtype: str = "auto", k_scale=None, v_scale=None,
              sliding_window: Optional[int] = None, soft_cap: Optional[float] = None,
              sinks: Optional[torch.Tensor] = None, impl: str = "auto") -> torch.Tensor:
    """Attention for one layer over a reordered batch: at most two launches.

    query: ``[num_tokens(+padding), num_q_heads, head_size]``; out: same shape (rows
    past ``md.num_actual_tokens`` are left as they are). kv_cache: vLLM's combined
    cache (see :func:`kv_cache_views`), already holding the new tokens' K/V.
    """
    k_cache, v_cache = kv_cache_views(kv_cache, head_size, kv_cache_dtype)
    fp8 = k_cache.dtype in FP8_CACHE_DTYPES.values()
    common = dict(scale=scale, k_scale=k_scale if fp8 else None,
                  v_scale=v_scale if fp8 else None, sliding_window=sliding_window,
                  soft_cap=soft_cap, sinks=sinks, impl=impl)
    nd = md.num_decode_tokens
    if md.num_decodes:
        q_dec, o_dec = query[:nd], out[:nd]
        if md.decode_query_len > 1:  # [S*T, Hq, D] -> [S, T, Hq, D], a view
            shape = (md.num_decodes, md.decode_query_len) + tuple(query.shape[1:])
            q_dec, o_dec = q_dec.view(shape), o_dec.view(shape)
        # Grid bound: the batch's longest sequence in eager mode; inside a CUDA graph
        # the block table's capacity (the op's default), so replays with longer
        # sequences stay correct. The workspace covers both (sized in the builder).
        capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
        _ops.call("decode", q_dec, k_cache, v_cache, md.decode_block_table,
                  md.decode_seq_lens, out=o_dec, **common,
                  op_options=dict(workspace=md.decode_workspace,
                                  max_seq_len=None if capturing else md.max_seq_len))
    if md.num_prefills and md.num_prefill_tokens:
        end = md.num_actual_tokens
        # vLLM's metadata is consistent by construction: no host-side value checks
        # (a sync per layer) unless HYGON_ATTN_DEBUG=1 asks for them.
        _ops.call("prefill", query[nd:end], k_cache, v_cache, md.prefill_block_table,
                  md.prefill_cu_seqlens_q, md.prefill_seq_lens, causal=md.causal,
                  out=out[nd:end], **common,
                  op_options=dict(plan=md.prefill_plan, validate=_debug()))
    return out


def _debug() -> bool:
    from hygon_attn_backend.ops._checks import debug_enabled

    return debug_enabled()
