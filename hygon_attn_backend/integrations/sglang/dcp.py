"""Decode context parallelism (SGLang ``--dcp-size W``) for ``HygonAttnBackend``.

SGLang 0.5.23 shards every request's K/V over the ``W`` ranks of a DCP group (TP ranks
that hold the same KV heads: ``model_config.get_num_kv_heads(attn_tp_size, dcp_size)``),
one token at a time, and lets the attention backend do the rest. What it hands us:

- the allocator pages ``P * W`` slots while each rank's ``MHATokenToKVPool`` pages ``P``
  rows; a token at slot ``L`` (``out_cache_loc``, ``req_to_token``) belongs to rank
  ``L % W`` (``= position % W``: pages are ``P * W``-aligned) and sits at row ``L // W`` of
  that rank's pool. A global page ``g`` therefore holds, on rank ``w``, exactly the rows of
  local page ``g``: the rank's block table is ``req_to_token[row, b * P * W] // (P * W)``
  (:func:`page_table.req_to_token_table` with ``page_size = P * W``) over the pool viewed
  with page ``P``, for :func:`ops.context_parallel.local_lens` keys a request (SGLang's
  ``get_dcp_lens``);
- ``get_parallel().attn_dcp_size`` / ``attn_dcp_rank`` and ``dcp_group`` (a
  ``GroupCoordinator``).

Per layer on every rank (as SGLang's Triton backend, ``triton_backend.py``):

- cache write: ``set_kv_buffer`` at ``out_cache_loc // W`` under SGLang's own mask
  ``positions % W == rank`` (``dcp_kv_mask``; the pool's masked write addresses NHD rows, so
  an HND pool is refused);
- decode: the queries all-gathered over the group's heads (``dcp_group.all_gather(q,
  dim=1)``, ``[B, W*Hq, D]``), our paged decode on the rank's shard with its LSE, and
  SGLang's ``cp_lse_ag_out_rs_mha`` (rescale by the all-gathered LSEs, all-reduce, keep
  this rank's ``Hq`` heads);
- extend / mixed: the new tokens among themselves (causal) on the rank's own heads over
  the KV heads they read (the step's dense K/V, which every rank has), and the cached
  prefix (not causal) on the shard with all-gathered queries, merged across the ranks by
  ``cp_lse_ag_out_rs_mha``; the two merged by their LSEs
  (:func:`ops.context_parallel.merge_by_lse`). SGLang's ``_forward_extend_dcp``.

Refused under DCP (``NotImplementedError``, naming what to change): HND pools, CUDA graphs,
speculative decoding (target verify, draft extend, draft workers), sliding windows (a
window is in global positions) and attention sinks (each rank would count the sink once);
an extend whose layer passes no ``k``/``v`` (the new tokens are sharded in the pool).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Optional

import torch

from hygon_attn_backend.integrations.sglang import page_table, warmup
from hygon_attn_backend.ops.context_parallel import local_lens, local_max_len, merge_by_lse
from hygon_attn_backend.ops.decode import plan_paged_decode
from hygon_attn_backend.ops.prefill import PrefillLayer, plan_prefix_prefill

__all__ = ["DcpGroup", "DcpForwardMetadata", "rank_kv_heads", "dcp_write_mask"]


def rank_kv_heads(num_q_heads: int, num_kv_heads: int, world_size: int,
                  rank: int) -> slice:
    """The KV heads this rank's own query heads read.

    ``num_q_heads``: the rank's ``Hq`` (``layer.tp_q_head_num``), heads ``[rank * Hq,
    (rank + 1) * Hq)`` of the group's ``W * Hq``; ``num_kv_heads``: the group's replicated
    ``Hkv`` (``layer.tp_k_head_num``). Query head ``h`` of the group reads KV head
    ``h // (W * Hq / Hkv)``. Returns a slice of KV heads (whole GQA groups, or the one KV
    head every head of the rank reads); ValueError when the heads do not divide so (SGLang's
    own split would give a wrong answer there)."""
    for name, value in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads),
                        ("world_size", world_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    total = num_q_heads * world_size
    if total % num_kv_heads:
        raise ValueError(f"num_kv_heads ({num_kv_heads}) must divide the DCP group's query "
                         f"heads ({world_size} x {num_q_heads})")
    group = total // num_kv_heads
    if num_q_heads % group == 0:
        per = num_q_heads // group
        return slice(rank * per, (rank + 1) * per)
    if group % num_q_heads == 0:
        first = rank * num_q_heads // group
        return slice(first, first + 1)
    raise ValueError(f"num_q_heads ({num_q_heads}) a rank is neither a multiple nor a divisor "
                     f"of the GQA group ({group}): a rank's heads would straddle KV heads")


def dcp_write_mask(forward_batch, world_size: int, rank: int, num_tokens: int) -> torch.Tensor:
    """``[num_tokens]`` bool: the new tokens this rank stores (``positions % W == rank``),
    else the batch's own ``dcp_kv_mask`` when its positions do not line up with the write
    locations, as SGLang's Triton backend decides."""
    pos = getattr(forward_batch, "positions", None)
    if pos is not None and pos.numel() == num_tokens:
        return pos % world_size == rank
    mask = getattr(forward_batch, "dcp_kv_mask", None)
    if mask is None:
        raise ValueError(f"forward_batch: decode context parallelism needs positions of the "
                         f"{num_tokens} new tokens (or dcp_kv_mask) to pick the tokens this "
                         f"rank stores; got positions of {None if pos is None else pos.numel()}")
    return mask


@dataclasses.dataclass
class DcpForwardMetadata:
    """One pass's metadata on this rank.

    block_table: ``[B, num_blocks]`` int32 local page ids (token rows for ``P = 1``).
    local_lens: ``[B]`` int32 keys this rank holds of each request (decode: the whole
    sequence; extend: the cached prefix). cu_seqlens_q / new_lens: ``[B + 1]`` / ``[B]``
    int32 of the new tokens (extend), None for decode. any_prefix: some request of the
    batch has a cached prefix (the same on every rank: decides the collectives).
    plans: built by the first layer of each head layout and dtype.
    """

    block_table: torch.Tensor
    local_lens: torch.Tensor
    max_local_len: Optional[int] = None
    cu_seqlens_q: Optional[torch.Tensor] = None
    host_cu_seqlens_q: Optional[list] = None
    new_lens: Optional[torch.Tensor] = None
    host_new_lens: Optional[list] = None
    any_prefix: bool = True
    plans: dict = dataclasses.field(default_factory=dict)

    @property
    def is_extend(self) -> bool:
        return self.cu_seqlens_q is not None


def _write_loc(loc: torch.Tensor, forward_batch):
    """``KVWriteLoc`` of the rank-local rows, carrying the batch's physical mark (SGLang
    0.5.23); the bare tensor where SGLang has no ``KVWriteLoc``."""
    try:
        from sglang.srt.mem_cache.memory_pool import KVWriteLoc
    except ImportError:
        return loc
    physical = bool(getattr(forward_batch, "out_cache_loc_is_physical", False))
    try:
        return KVWriteLoc(loc, physical=physical)
    except TypeError:  # a KVWriteLoc without the physical mark
        return KVWriteLoc(loc)


def _merge_ranks():
    try:
        from sglang.srt.layers.dcp import cp_lse_ag_out_rs_mha
    except ImportError as e:  # an SGLang without DCP never publishes attn_dcp_size > 1
        raise NotImplementedError("hygon attention backend: decode context parallelism "
                                  "needs SGLang's sglang.srt.layers.dcp (0.5.23)") from e
    return cp_lse_ag_out_rs_mha


class DcpGroup:
    """The DCP side of one ``HygonAttnBackend``: the group, and the metadata and layer
    calls of its passes (the backend delegates to it when ``--dcp-size`` > 1)."""

    def __init__(self, world_size: int, rank: int, group, *, pool_page_size: int):
        if not isinstance(world_size, int) or world_size < 2:
            raise ValueError(f"world_size must be an int >= 2, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
        if group is None:
            raise ValueError("group: decode context parallelism needs "
                             "get_parallel().dcp_group, got None")
        if getattr(group, "world_size", world_size) != world_size or \
                getattr(group, "rank_in_group", rank) != rank:
            raise ValueError(f"group: dcp_group has world_size {group.world_size}, rank "
                             f"{group.rank_in_group}; attn_dcp_size {world_size}, "
                             f"attn_dcp_rank {rank}")
        self.world_size, self.rank, self.group = world_size, rank, group
        self.page_size = int(pool_page_size)
        self.alloc_page_size = self.page_size * world_size
        self._layers: dict = {}  # layer id -> (state, prefix layer, new-token layer, kv heads)

    @classmethod
    def from_runtime(cls, model_runner, pool, *, world_size: int, draft: bool) -> "DcpGroup":
        """This rank's group from SGLang's runtime context, after refusing what DCP does not
        serve here (``NotImplementedError``)."""
        what = f"decode context parallelism (--dcp-size {world_size})"
        layout = getattr(pool, "kv_cache_layout", "nhd")
        if layout != "nhd":
            raise NotImplementedError(
                f"hygon attention backend: {what} needs the NHD KV pool; this pool's layout "
                f"is {layout!r} (SGLang's masked DCP write addresses NHD rows): unset "
                f"SGLANG_USE_HND_KVCACHE")
        if draft or getattr(model_runner, "is_draft_worker", False):
            raise NotImplementedError(f"hygon attention backend: speculative decoding with "
                                      f"{what} is not supported; leave --dcp-size at 1 or "
                                      f"turn speculative decoding off")
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        return cls(world_size, int(parallel.attn_dcp_rank), parallel.dcp_group,
                   pool_page_size=int(getattr(pool, "page_size", 1) or 1))

    def refuse_cuda_graphs(self):
        raise NotImplementedError(f"hygon attention backend: CUDA graphs with decode context "
                                  f"parallelism (--dcp-size {self.world_size}) are not "
                                  f"supported; run with --disable-cuda-graph")

    # ------------------------------------------------------------------ metadata

    def init_forward_metadata(self, backend, forward_batch) -> DcpForwardMetadata:
        """The pass's local block table and lengths (``backend``: the ``HygonAttnBackend``,
        for its ``req_to_token`` and host-length helpers)."""
        mode = forward_batch.forward_mode
        if mode.is_target_verify() or mode.is_draft_extend_v2():
            raise NotImplementedError(f"hygon attention backend: {mode.name} (speculative "
                                      f"decoding) with decode context parallelism "
                                      f"(--dcp-size {self.world_size}) is not supported")
        W, r = self.world_size, self.rank
        bs = forward_batch.batch_size
        rows = forward_batch.req_pool_indices[:bs]
        seq_lens = forward_batch.seq_lens[:bs].to(torch.int32)
        host_lens = backend._host_seq_lens(forward_batch)
        req_to_token = backend.req_to_token
        max_blocks = -(-req_to_token.shape[1] // self.alloc_page_size)
        num_blocks = max_blocks
        if host_lens:
            num_blocks = warmup.aligned_table_width(
                -(-max(host_lens) // self.alloc_page_size), max_blocks)
        block_table = page_table.req_to_token_table(req_to_token, rows,
                                                    page_size=self.alloc_page_size,
                                                    num_blocks=num_blocks)
        if backend.check_pages:
            page_table.check_paged_rows(req_to_token, rows, seq_lens,
                                        page_size=self.alloc_page_size)
        shard = dict(world_size=W, rank=r)
        if mode.is_decode_or_idle():
            meta = DcpForwardMetadata(
                block_table=block_table, local_lens=local_lens(seq_lens, **shard),
                max_local_len=local_max_len(max(host_lens), world_size=W)
                if host_lens else None)
        else:
            if forward_batch.extend_seq_lens is None:
                raise NotImplementedError(f"hygon attention backend: a {mode.name} batch "
                                          "without extend_seq_lens is not supported")
            new = forward_batch.extend_seq_lens[:bs].to(torch.int32)
            cu = torch.zeros(bs + 1, dtype=torch.int32, device=seq_lens.device)
            cu[1:] = torch.cumsum(new, 0)
            ext_cpu = getattr(forward_batch, "extend_seq_lens_cpu", None)
            if ext_cpu is None:
                raise ValueError("forward_batch: an extend batch needs extend_seq_lens_cpu "
                                 "(the host copy of the extend lengths)")
            host_new = [int(n) for n in list(ext_cpu)[:bs]]
            if host_lens is not None:
                any_prefix = any(s > n for s, n in zip(host_lens, host_new))
            else:  # no host copy: one sync
                any_prefix = bool((seq_lens > new).any())
            meta = DcpForwardMetadata(
                block_table=block_table, local_lens=local_lens(seq_lens - new, **shard),
                cu_seqlens_q=cu, host_cu_seqlens_q=[0] + list(itertools.accumulate(host_new)),
                new_lens=new, host_new_lens=host_new, any_prefix=any_prefix)
        return meta

    def _plans(self, backend, meta, st, q_dtype, kv_heads: slice):
        """The pass's plans for one head layout (built by its first layer)."""
        key = (st.num_heads, st.num_kv_heads, st.head_dim, q_dtype)
        plans = meta.plans.get(key)
        if plans is not None:
            return plans
        W = self.world_size
        group_heads = st.num_heads * W
        impl = "auto" if backend.impl == "native" else backend.impl  # the LSE: Triton or ref
        if not meta.is_extend:
            plans = dict(decode=plan_paged_decode(
                meta.block_table, meta.local_lens, num_q_heads=group_heads,
                num_kv_heads=st.num_kv_heads, head_dim=st.head_dim, page_size=self.page_size,
                q_dtype=q_dtype, kv_dtype=backend.kv_dtype, max_seq_len=meta.max_local_len,
                workspace=backend._decode_workspace(group_heads, st.num_kv_heads,
                                                    st.head_dim, q_dtype),
                return_lse=True, impl=impl))
        else:
            total_q = meta.host_cu_seqlens_q[-1]
            common = dict(total_q=total_q, head_dim=st.head_dim,
                          host_cu_seqlens_q=meta.host_cu_seqlens_q, q_dtype=q_dtype,
                          kv_dtype=backend.kv_dtype, impl=impl)
            plans = dict(new=plan_prefix_prefill(
                meta.cu_seqlens_q, meta.new_lens, num_q_heads=st.num_heads,
                num_kv_heads=kv_heads.stop - kv_heads.start, host_seq_lens_k=meta.host_new_lens,
                has_k_new=True, **common))
            if meta.any_prefix:  # local prefix lengths may be below the query lengths
                plans["prefix"] = plan_prefix_prefill(
                    meta.cu_seqlens_q, meta.local_lens, num_q_heads=group_heads,
                    num_kv_heads=st.num_kv_heads, **common)
        meta.plans[key] = plans
        return plans

    # ------------------------------------------------------------------ forward

    def _layer(self, st):
        """``(prefix layer, new-token layer, kv heads)`` of a checked ``_LayerState``."""
        entry = self._layers.get(st.layer.layer_id)
        if entry is not None and entry[0] is st:
            return entry[1:]
        what = f"decode context parallelism (--dcp-size {self.world_size})"
        if st.sliding_window is not None:
            raise NotImplementedError(f"hygon attention backend: sliding-window attention "
                                      f"with {what} is not supported (a window is in global "
                                      f"positions, a rank's shard has local ones)")
        kv_heads = rank_kv_heads(st.num_heads, st.num_kv_heads, self.world_size, self.rank)
        opts = dict(scale=st.scale, k_scale=st.k_scale, v_scale=st.v_scale,
                    soft_cap=st.soft_cap)
        prefix = PrefillLayer(st.k_view, st.v_view, causal=False, **opts)
        new = PrefillLayer(st.k_view[:, kv_heads], st.v_view[:, kv_heads], causal=st.causal,
                           **opts)
        self._layers[st.layer.layer_id] = (st, prefix, new, kv_heads)
        return prefix, new, kv_heads

    def save_kv(self, backend, layer, forward_batch, k, v, num_kv_heads: int,
                head_dim: int) -> None:
        """Store the new tokens this rank owns: SGLang's masked ``set_kv_buffer`` at
        ``out_cache_loc // W``. k, v: ``[N, Hkv, D]`` (or ``[N, Hkv * D]``)."""
        k = k.view(-1, num_kv_heads, head_dim)
        v = v.view(-1, num_kv_heads, head_dim)
        loc = forward_batch.out_cache_loc
        if loc.numel() != k.shape[0]:
            raise ValueError(f"forward_batch.out_cache_loc holds {loc.numel()} locations for "
                             f"{k.shape[0]} new tokens")
        mask = dcp_write_mask(forward_batch, self.world_size, self.rank, k.shape[0])
        where = _write_loc(loc // self.world_size, forward_batch)
        pool = backend.token_to_kv_pool
        if layer.k_scale is None:
            pool.set_kv_buffer(layer, where, k, v, dcp_kv_mask=mask)
        else:  # set_kv_buffer divides by the scales in place: keep the caller's k/v intact
            pool.set_kv_buffer(layer, where, k.clone(), v.clone(), layer.k_scale,
                               layer.v_scale, dcp_kv_mask=mask)

    def forward(self, backend, q, k, v, layer, forward_batch, *, save_kv_cache: bool,
                sinks, kwargs, decode: bool) -> torch.Tensor:
        """One layer's attention under DCP. q: ``[N, Hq * D]`` (or ``[N, Hq, D]``) this rank's
        query heads; k, v: ``[N, Hkv, D]`` the new tokens' K/V (the group's KV heads).
        Returns ``[N, Hq * D]`` in q's dtype, attended over the whole sequence."""
        st = backend._layer(layer, kwargs)
        if sinks is not None:
            raise NotImplementedError(f"hygon attention backend: attention sinks with decode "
                                      f"context parallelism (--dcp-size {self.world_size}) "
                                      f"are not supported (each rank would count the sink)")
        prefix_layer, new_layer, kv_heads = self._layer(st)
        if (k is None) != (v is None):
            raise ValueError("k and v must both be tensors or both be None")
        if k is not None and save_kv_cache:
            self.save_kv(backend, layer, forward_batch, k, v, st.num_kv_heads, st.head_dim)
        meta: DcpForwardMetadata = backend.forward_metadata
        if decode == meta.is_extend:
            raise ValueError(f"forward_batch: a {'decode' if decode else 'extend'} call on "
                             f"the metadata of {'an extend' if meta.is_extend else 'a decode'} "
                             f"batch")
        q3 = q.reshape(-1, st.num_heads, st.head_dim)
        out = q.new_empty((q3.shape[0], st.num_heads * st.head_dim))
        if q3.shape[0] == 0:  # an idle batch: every rank has none, no collective
            return out
        plans = self._plans(backend, meta, st, q.dtype, kv_heads)
        merge = _merge_ranks()
        if decode:
            q_all = self.group.all_gather(q3.contiguous(), dim=1)  # [B, W*Hq, D]
            part, lse = plans["decode"].run_layer(st.decode_layer(None), q_all,
                                                  torch.empty_like(q_all))
            merged = merge(part.float(), lse, self.group)
            return out.copy_(merged.reshape(out.shape))
        if k is None:
            raise ValueError("k: an extend under decode context parallelism needs the new "
                             "tokens' k and v (they are sharded in the pool)")
        k3 = k.view(-1, st.num_kv_heads, st.head_dim)[:, kv_heads].contiguous()
        v3 = v.view(-1, st.num_kv_heads, st.head_dim)[:, kv_heads].contiguous()
        out3 = out.view(-1, st.num_heads, st.head_dim)
        new_out, new_lse = plans["new"].run_layer(
            new_layer, q3, meta.block_table, meta.cu_seqlens_q, meta.new_lens, k_new=k3,
            v_new=v3, out=torch.empty_like(q3), return_lse=True)
        if "prefix" not in plans:  # no request has a cached prefix
            return out.copy_(new_out.reshape(out.shape))
        q_all = self.group.all_gather(q3.contiguous(), dim=1)
        part, lse = plans["prefix"].run_layer(
            prefix_layer, q_all, meta.block_table, meta.cu_seqlens_q, meta.local_lens,
            out=torch.empty_like(q_all), return_lse=True)
        ctx_out, ctx_lse = merge(part.float(), lse, self.group, return_lse=True)
        merge_by_lse(out3, ctx_out, ctx_lse, new_out, new_lse)
        return out
