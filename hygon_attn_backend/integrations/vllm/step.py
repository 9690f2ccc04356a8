"""Engine-free core of the vLLM backend: the per-step plan and the per-layer launches.

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

Per step (the metadata builder): :func:`make_metadata` splits the batch from host values,
:func:`plan_metadata` builds the ops' plans (:class:`~hygon_attn_backend.ops.decode.
DecodePlan`, :class:`~hygon_attn_backend.ops.prefill.PrefillPlan`) once for every layer.
Per layer: :func:`write_new_kv` and :func:`attention` only launch (no allocation, no host
sync, no environment read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hygon_attn_backend import layouts
from hygon_attn_backend.ops.cache import WritePlan, plan_write_kv
from hygon_attn_backend.ops.decode import (DecodeLayer, DecodePlan, DecodeWorkspace,
                                           plan_paged_decode)
from hygon_attn_backend.ops.prefill import PrefillLayer, PrefillPlan, plan_prefix_prefill

from .dcp import ContextParallel, DcpMetadata, plan_step
from .dcp import attention as dcp_attention

#: vLLM's ``kv_cache_dtype`` strings for fp8 caches, and the torch dtype each stores.
FP8_CACHE_DTYPES = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_dtype_for(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype our kernels read from vLLM's cache: fp8 caches (stored as bytes) as
    their float8 format, every other cache in the model's dtype."""
    return FP8_CACHE_DTYPES.get(kv_cache_dtype, model_dtype)


class LayerSpec:
    """What one attention layer fixes for its whole life (built with the layer's impl).

    scale: softmax scale; kv_cache_dtype: vLLM's string (``"auto"``, ``"fp8"``, ...);
    sliding_window / soft_cap / sinks (``[num_heads]`` logits): the layer's options.
    The K/V views of the layer's cache are built on first use and kept (vLLM hands a
    layer the same cache tensor every step).
    """

    __slots__ = ("num_heads", "num_kv_heads", "head_size", "scale", "kv_cache_dtype",
                 "sliding_window", "soft_cap", "sinks", "_kv_src", "_kv", "_decode",
                 "_prefill")

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 kv_cache_dtype: str = "auto", sliding_window: Optional[int] = None,
                 soft_cap: Optional[float] = None, sinks: Optional[torch.Tensor] = None):
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = float(scale)
        self.kv_cache_dtype = kv_cache_dtype
        self.sliding_window = sliding_window
        self.soft_cap = soft_cap or None
        self.sinks = sinks
        self._kv_src = None
        self._kv = None
        self._decode: Optional[DecodeLayer] = None
        self._prefill: dict = {}  # causal -> PrefillLayer (DCP runs both in one step)

    @property
    def fp8(self) -> bool:
        return self.kv_cache_dtype in FP8_CACHE_DTYPES

    def kv_views(self, kv_cache: torch.Tensor):
        """K and V ``[num_blocks, num_kv_heads, block_size, head_size]`` views of vLLM's
        combined cache (logical ``[..., 2 * head_size]``, any physical order), read as
        float8 for an fp8 cache stored as bytes. No copy; cached per cache tensor."""
        if kv_cache is not self._kv_src:
            if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * self.head_size:
                raise ValueError(f"kv_cache must be [num_blocks, num_kv_heads, block_size, "
                                 f"2*{self.head_size}], got shape {tuple(kv_cache.shape)}")
            fp8 = FP8_CACHE_DTYPES.get(self.kv_cache_dtype)
            src = kv_cache.view(fp8) if fp8 is not None and kv_cache.dtype != fp8 else kv_cache
            self._kv = layouts.vllm_kv_views(src)
            self._kv_src = kv_cache
        return self._kv

    def decode_layer(self, kv_cache: torch.Tensor, k_scale, v_scale) -> DecodeLayer:
        """This layer's side of a decode launch over ``kv_cache``, kept across steps while
        the cache and the fp8 scale objects stay the same (vLLM passes the layer's own
        scale tensors, the same objects on every call)."""
        k_cache, v_cache = self.kv_views(kv_cache)
        d = self._decode
        if d is None or d.k_cache is not k_cache or d.k_scale is not k_scale or \
                d.v_scale is not v_scale:
            d = self._decode = DecodeLayer(
                k_cache, v_cache, scale=self.scale, k_scale=k_scale, v_scale=v_scale,
                sliding_window=self.sliding_window, soft_cap=self.soft_cap, sinks=self.sinks)
        return d

    def prefill_layer(self, kv_cache: torch.Tensor, k_scale, v_scale,
                      causal: bool) -> PrefillLayer:
        """This layer's side of a prefix-prefill launch, as :meth:`decode_layer` (one kept
        for each ``causal``)."""
        k_cache, v_cache = self.kv_views(kv_cache)
        p = self._prefill.get(causal)
        if p is None or p.k_cache is not k_cache or p.k_scale is not k_scale or \
                p.v_scale is not v_scale:
            p = self._prefill[causal] = PrefillLayer(
                k_cache, v_cache, scale=self.scale, causal=causal, k_scale=k_scale,
                v_scale=v_scale, sliding_window=self.sliding_window, soft_cap=self.soft_cap,
                sinks=self.sinks)
        return p


@dataclass
class HygonAttentionMetadata:
    """Per-batch metadata shared by all layers of one KV-cache group.

    Tensors live on the model's device; ``*_cpu`` values are host ints known at build
    time. The decode and prefill fields are views/slices of the batch's tensors; the plans
    are built once per step by :func:`plan_metadata`.
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
    # [num_prefills + 1] int32, the prefill rows' offsets in the whole batch (a view of
    # query_start_loc): the Triton launch reads q/out rows there, unsliced
    prefill_query_start_loc: Optional[torch.Tensor] = None

    causal: bool = True
    decode_plan: Optional[DecodePlan] = None
    prefill_plan: Optional[PrefillPlan] = None
    write_plan: Optional[WritePlan] = None
    #: decode context parallelism: the step's sharded launches (``dcp.plan_step``); with
    #: it the decode and prefill plans above are unused
    dcp: Optional["DcpMetadata"] = None

    @property
    def num_launches(self) -> int:
        """Kernel launches of one layer's attention (the K/V write not included)."""
        if self.dcp is not None:
            return self.dcp.num_launches
        return sum(p.num_launches for p in (self.decode_plan, self.prefill_plan) if p)


def make_metadata(*, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                  block_table: torch.Tensor, slot_mapping: torch.Tensor, num_reqs: int,
                  num_actual_tokens: int, max_query_len: int, max_seq_len: int,
                  num_decodes: int, num_decode_tokens: int,
                  causal: bool = True, one_token_decodes: bool = False
                  ) -> HygonAttentionMetadata:
    """Split a reordered batch into its decode head and prefill tail (host values only).

    ``num_decodes`` / ``num_decode_tokens`` come from the engine's own split (decodes
    first). Decode requests must share one query length ``T``; a batch where they do
    not (zero-length padding rows) is sent whole to the prefill kernel, which handles
    any ragged mix (vLLM's split with ``require_uniform=True`` makes this rare: speculative
    verification with drafts of different lengths). A non-causal batch also goes whole to
    the prefill kernel, and with ``one_token_decodes`` (decode context parallelism) so do
    decode requests of more than one token.
    """
    if num_decodes and (num_decode_tokens % num_decodes or not causal or (
            one_token_decodes and num_decode_tokens != num_decodes)):
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
        md.prefill_query_start_loc = query_start_loc[num_decodes:num_reqs + 1]
        md.prefill_cu_seqlens_q = md.prefill_query_start_loc - num_decode_tokens
        md.prefill_seq_lens = seq_lens[num_decodes:num_reqs]
        md.prefill_block_table = block_table[num_decodes:num_reqs]
    return md


def plan_metadata(md: HygonAttentionMetadata, *, num_q_heads: int, num_kv_heads: int,
                  head_size: int, block_size: int, q_dtype: torch.dtype,
                  kv_dtype: torch.dtype, impl: str = "auto",
                  workspace: Optional[DecodeWorkspace] = None, for_graph: bool = False,
                  query_start_loc_cpu: Optional[torch.Tensor] = None,
                  cp: Optional[ContextParallel] = None,
                  decode_lens_buffer: Optional[torch.Tensor] = None) -> None:
    """Build the step's plans into ``md`` (once per step; every layer reuses them).

    The decode grid is sized by the batch's longest sequence, or by the block table's
    capacity when ``for_graph`` (a captured graph is replayed with longer sequences); the
    workspace covers both. The prefill tile map is built on the host from
    ``query_start_loc_cpu`` when given (no device work), else on the device (no sync).
    ``cp``: decode context parallelism over more than one rank: the plans are the sharded
    ones of :func:`dcp.plan_step` (in ``md.dcp``; ``workspace`` sized for the group's
    query heads, ``decode_lens_buffer`` the decode's persistent local lengths).
    """
    md.write_plan = plan_write_kv(md.slot_mapping, num_kv_heads=num_kv_heads,
                                  head_dim=head_size, page_size=block_size, impl=impl)
    remember_write_plan(md.write_plan)
    if cp is not None and cp.world_size > 1:
        md.dcp = plan_step(md, cp, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                           head_size=head_size, block_size=block_size, q_dtype=q_dtype,
                           kv_dtype=kv_dtype, impl=impl, workspace=workspace,
                           decode_lens_buffer=decode_lens_buffer, for_graph=for_graph,
                           query_start_loc_cpu=query_start_loc_cpu)
        return
    if md.num_decodes:
        md.decode_plan = plan_paged_decode(
            md.decode_block_table, md.decode_seq_lens, num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads, head_dim=head_size, page_size=block_size,
            q_dtype=q_dtype, kv_dtype=kv_dtype, num_tokens=md.decode_query_len,
            max_seq_len=None if for_graph else md.max_seq_len, workspace=workspace,
            impl=impl)
    if md.num_prefills and md.num_prefill_tokens:
        host_cu = None
        if query_start_loc_cpu is not None:
            nr = md.num_decodes + md.num_prefills
            host_cu = query_start_loc_cpu[md.num_decodes:nr + 1] - md.num_decode_tokens
        md.prefill_plan = plan_prefix_prefill(
            md.prefill_cu_seqlens_q, md.prefill_seq_lens, total_q=md.num_prefill_tokens,
            num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_size,
            host_cu_seqlens_q=host_cu, q_dtype=q_dtype, kv_dtype=kv_dtype, impl=impl)


# slot_mapping -> its write plan. vLLM hands ``do_kv_cache_update`` the step's slot mapping
# but not the metadata (vllm/model_executor/layers/attention/attention.py,
# unified_kv_cache_update): the first layer of a step plans, the others find the plan by
# the tensor's identity; the builder registers its own plan here too.
_WRITE_PLANS: dict = {}
_MAX_WRITE_PLANS = 8


def remember_write_plan(plan: WritePlan) -> None:
    if len(_WRITE_PLANS) >= _MAX_WRITE_PLANS:
        _WRITE_PLANS.clear()
    _WRITE_PLANS[(id(plan.slot_mapping), plan.num_kv_heads, plan.head_dim,
                  plan.page_size)] = plan


def write_plan_for(slot_mapping: torch.Tensor, layer: LayerSpec, block_size: int, *,
                   impl: str = "auto") -> WritePlan:
    """The write plan of this step's ``slot_mapping`` (built on first use)."""
    plan = _WRITE_PLANS.get((id(slot_mapping), layer.num_kv_heads, layer.head_size,
                             block_size))
    if plan is None or plan.slot_mapping is not slot_mapping:
        plan = plan_write_kv(slot_mapping, num_kv_heads=layer.num_kv_heads,
                             head_dim=layer.head_size, page_size=block_size, impl=impl)
        remember_write_plan(plan)
    return plan


def write_new_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, layer: LayerSpec, *, k_scale=None,
                 v_scale=None, impl: str = "auto") -> None:
    """Write the new tokens' K/V into the cache (one launch).

    key, value: ``[num_tokens(+padding), num_kv_heads, head_size]``; slot_mapping
    ``[num_tokens]`` (``-1`` slots are padding, skipped); rows past ``len(slot_mapping)``
    are padding and are not read.
    """
    k_cache, v_cache = layer.kv_views(kv_cache)
    plan = write_plan_for(slot_mapping, layer, k_cache.shape[2], impl=impl)
    fp8 = layer.fp8
    plan.run(key, value, k_cache, v_cache, k_scale=k_scale if fp8 else None,
             v_scale=v_scale if fp8 else None)


def attention(query: torch.Tensor, kv_cache: torch.Tensor, md: HygonAttentionMetadata,
              out: torch.Tensor, layer: LayerSpec, *, k_scale=None,
              v_scale=None, key: Optional[torch.Tensor] = None,
              value: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention for one layer over a reordered batch: at most two launches of the plans
    in ``md`` (decode: one, or two with a split-KV combine; prefill: one).

    query: ``[num_tokens(+padding), num_q_heads, head_size]``; out: same shape (rows
    past ``md.num_actual_tokens`` are left as they are). kv_cache: vLLM's combined
    cache (see :meth:`LayerSpec.kv_views`), already holding the new tokens' K/V.
    key, value: ``[num_tokens(+padding), num_kv_heads, head_size]``, the step's new K/V:
    read under decode context parallelism only (``md.dcp``, :func:`dcp.attention`).
    """
    if md.dcp is not None:
        return dcp_attention(query, key, value, kv_cache, md, out, layer, k_scale=k_scale,
                             v_scale=v_scale)
    if not layer.fp8:
        k_scale = v_scale = None
    nd = md.num_decode_tokens
    if md.decode_plan is not None:
        if md.decode_query_len > 1:  # [S*T, Hq, D] -> [S, T, Hq, D], a view
            shape = (md.num_decodes, md.decode_query_len) + tuple(query.shape[1:])
            q_dec, o_dec = query[:nd].view(shape), out[:nd].view(shape)
        elif md.decode_plan.impl == "triton":
            # the whole tensors, no slices (two fewer tensor ops per layer): the decode
            # grid covers rows [0, num_decodes) only, read through the strides
            q_dec, o_dec = query, out
        else:
            q_dec, o_dec = query[:nd], out[:nd]
        md.decode_plan.run_layer(layer.decode_layer(kv_cache, k_scale, v_scale), q_dec,
                                 o_dec)
    if md.prefill_plan is not None:
        if md.prefill_plan.impl in ("triton", "native"):
            # the whole tensors and the rows' offsets in them: the kernel addresses q and
            # out rows through cu_seqlens_q, so no slices (the plan's tile map is relative)
            q_pre, o_pre, cu = query, out, md.prefill_query_start_loc
        else:  # the reference writes every row of its out: slices
            end = md.num_actual_tokens
            q_pre, o_pre, cu = query[nd:end], out[nd:end], md.prefill_cu_seqlens_q
        md.prefill_plan.run_layer(layer.prefill_layer(kv_cache, k_scale, v_scale, md.causal),
                                  q_pre, md.prefill_block_table, cu, md.prefill_seq_lens,
                                  out=o_pre)
    return out
