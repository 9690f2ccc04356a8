"""Decode context parallelism (DCP) of the vLLM backend, engine-free.

With ``--decode-context-parallel-size W`` vLLM shards each request's KV cache over the W
ranks of a DCP group (the TP ranks that hold the same KV heads, as GQA with DCP needs
``tensor_parallel_size >= W * num_kv_heads``): positions are dealt out in runs of
``I = cp_kv_cache_interleave_size`` tokens, run ``r`` to rank ``r % W``, so rank ``w``
holds a standard paged sequence of :func:`local_lens` tokens under the request's own
block table (vLLM's slot mapping writes a new token only on its owning rank; the others
get slot ``-1``). Each rank holds ``H`` query heads; the group's ``W * H`` query heads all
read the rank's KV heads.

Per layer, on every rank (:func:`attention`):

- decode rows (one token a request): the queries are all-gathered over the group's heads
  (``[S, W*H, D]``), the paged decode runs on the rank's shard of every key (the new
  token's included: it is already in its owner's cache) and returns each row's
  log-sum-exp; the group's collective then rescales each rank's partial output by the
  LSEs and reduce-scatters the heads (vLLM's ``cp_lse_ag_out_rs``), leaving the rank its
  own ``H`` heads, exactly attended over the whole sequence.
- every other row (prefills, chunks, prefix hits, speculative verification): the context
  (keys before the step's new tokens, visible to every new token) is attended the same
  way, all-gathered queries over the shard with the prefill kernel (not causal) and its
  LSE, merged by the collective; the new tokens attend to each other (causal) from the
  step's own K/V, which every rank has, with the prefill kernel (dense ``k_new``, no
  prefix); the two are merged by their LSEs (:func:`merge_by_lse`). This is the split of
  vLLM's FlashAttention backend.

Not with DCP: sliding windows (a window is in global positions, a shard does not have
them) and attention sinks (a sink would be counted once a rank); the backend refuses
both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from hygon_attn_backend.ops.context_parallel import local_lens, local_max_len, merge_by_lse
from hygon_attn_backend.ops.decode import DecodePlan, DecodeWorkspace, plan_paged_decode
from hygon_attn_backend.ops.prefill import PrefillPlan, plan_prefix_prefill


@dataclass(frozen=True)
class ContextParallel:
    """The DCP group as one rank sees it, and the collectives of a layer call.

    world_size: W ranks; rank: this rank's index in the group; interleave: I tokens a run.
    gather_heads: ``q [N, H, D] -> [N, W*H, D]``, the group's queries, rank-major heads
       (vLLM: ``get_dcp_group().all_gather(q, dim=1)``).
    merge_ranks: ``(out [N, W*H, D], lse [N, W*H] float32) -> (out [N, H, D],
       lse [N, H])``: every rank's partial outputs rescaled by the all-gathered LSEs and
       summed, this rank's heads kept (vLLM: ``cp_lse_ag_out_rs(..., return_lse=True)``).
    """

    world_size: int
    rank: int
    interleave: int = 1
    gather_heads: Optional[Callable[[torch.Tensor], torch.Tensor]] = None
    merge_ranks: Optional[Callable[[torch.Tensor, torch.Tensor],
                                   Tuple[torch.Tensor, torch.Tensor]]] = None

    def __post_init__(self):
        for name in ("world_size", "interleave"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank!r}")


@dataclass
class DcpMetadata:
    """The DCP side of one step's metadata (built by :func:`plan_step`).

    decode_seq_lens: ``[num_decodes]`` int32, the rank's keys of each decode request.
    context_seq_lens / new_seq_lens: ``[num_prefills]`` int32, the rank's context keys of
    each other request / its new tokens.
    """

    cp: ContextParallel
    decode_seq_lens: Optional[torch.Tensor] = None
    decode_plan: Optional[DecodePlan] = None
    context_seq_lens: Optional[torch.Tensor] = None
    context_plan: Optional[PrefillPlan] = None
    new_seq_lens: Optional[torch.Tensor] = None
    new_plan: Optional[PrefillPlan] = None

    @property
    def num_launches(self) -> int:
        """Attention kernel launches of one layer (the collectives and merges not
        included)."""
        return sum(p.num_launches for p in (self.decode_plan, self.context_plan,
                                            self.new_plan) if p)


def plan_step(md, cp: ContextParallel, *, num_q_heads: int, num_kv_heads: int,
              head_size: int, block_size: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
              impl: str = "auto", workspace: Optional[DecodeWorkspace] = None,
              decode_lens_buffer: Optional[torch.Tensor] = None, for_graph: bool = False,
              query_start_loc_cpu: Optional[torch.Tensor] = None) -> DcpMetadata:
    """Plan the DCP launches of a step split by :func:`step.make_metadata` (decode rows of
    one token; everything else in the prefill tail). ``num_q_heads``: the rank's ``H``;
    ``workspace``: split-KV scratch for ``W * H`` query heads; ``decode_lens_buffer``: a
    persistent int32 buffer of at least ``num_decodes`` entries the decode's local lengths
    are written to (a CUDA graph replays it), else a new tensor."""
    dm = DcpMetadata(cp=cp)
    shard = dict(world_size=cp.world_size, rank=cp.rank, interleave=cp.interleave)
    group_heads = num_q_heads * cp.world_size
    # a rank's decode with the LSE runs Triton or the reference (tuning.native_lacks)
    lse_impl = "auto" if impl == "native" else impl
    if md.num_decodes:
        lens = local_lens(md.decode_seq_lens, **shard)
        if decode_lens_buffer is not None:
            decode_lens_buffer[:md.num_decodes].copy_(lens)
            lens = decode_lens_buffer[:md.num_decodes]
        dm.decode_seq_lens = lens
        dm.decode_plan = plan_paged_decode(
            md.decode_block_table, lens, num_q_heads=group_heads, num_kv_heads=num_kv_heads,
            head_dim=head_size, page_size=block_size, q_dtype=q_dtype, kv_dtype=kv_dtype,
            max_seq_len=None if for_graph else local_max_len(
                md.max_seq_len, world_size=cp.world_size, interleave=cp.interleave),
            workspace=workspace, return_lse=True, impl=lse_impl)
    if md.num_prefills and md.num_prefill_tokens:
        cu = md.prefill_cu_seqlens_q
        new = (cu[1:] - cu[:-1]).to(torch.int32)
        dm.new_seq_lens = new
        dm.context_seq_lens = local_lens(md.prefill_seq_lens - new, **shard)
        host_cu = None
        if query_start_loc_cpu is not None:
            nr = md.num_decodes + md.num_prefills
            host_cu = query_start_loc_cpu[md.num_decodes:nr + 1] - md.num_decode_tokens
        common = dict(total_q=md.num_prefill_tokens, num_kv_heads=num_kv_heads,
                      head_dim=head_size, host_cu_seqlens_q=host_cu, q_dtype=q_dtype,
                      kv_dtype=kv_dtype, impl=impl)
        dm.context_plan = plan_prefix_prefill(cu, dm.context_seq_lens,
                                              num_q_heads=group_heads, **common)
        dm.new_plan = plan_prefix_prefill(cu, new, num_q_heads=num_q_heads, has_k_new=True,
                                          **common)
    return dm


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              kv_cache: torch.Tensor, md, out: torch.Tensor, layer, *, k_scale=None,
              v_scale=None) -> torch.Tensor:
    """One layer's attention under DCP (see the module doc). query ``[num_tokens, H, D]``,
    key/value ``[num_tokens, Hkv, D]`` (this step's new tokens), out like query (rows past
    ``md.num_actual_tokens`` are left as they are); ``md``: a step's metadata whose
    ``dcp`` :func:`plan_step` filled; ``layer``: the :class:`step.LayerSpec`."""
    dm: DcpMetadata = md.dcp
    cp = dm.cp
    if not layer.fp8:
        k_scale = v_scale = None
    nd, end = md.num_decode_tokens, md.num_actual_tokens
    if end == 0:
        return out
    q_all = cp.gather_heads(query[:end].contiguous())  # [N, W*H, D]
    if dm.decode_plan is not None:
        q_dec = q_all[:nd]
        part, lse = dm.decode_plan.run_layer(layer.decode_layer(kv_cache, k_scale, v_scale),
                                             q_dec, torch.empty_like(q_dec))
        merged, _ = cp.merge_ranks(part, lse)
        out[:nd].copy_(merged)
    if dm.context_plan is not None:
        cu = md.prefill_cu_seqlens_q
        q_ctx = q_all[nd:end]
        part, lse = dm.context_plan.run_layer(
            layer.prefill_layer(kv_cache, k_scale, v_scale, False), q_ctx,
            md.prefill_block_table, cu, dm.context_seq_lens, out=torch.empty_like(q_ctx),
            return_lse=True)
        ctx_out, ctx_lse = cp.merge_ranks(part, lse)
        q_new = query[nd:end]
        new_out, new_lse = dm.new_plan.run_layer(
            layer.prefill_layer(kv_cache, k_scale, v_scale, True), q_new,
            md.prefill_block_table, cu, dm.new_seq_lens, k_new=key[nd:end],
            v_new=value[nd:end], out=torch.empty_like(q_new), return_lse=True)
        merge_by_lse(out[nd:end], ctx_out, ctx_lse, new_out, new_lse)
    return out
