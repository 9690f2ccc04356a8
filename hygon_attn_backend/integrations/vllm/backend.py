"""vLLM v1 attention backend running our kernels: backend class, metadata builder, impl.

Selected with ``--attention-backend hygon`` (see :mod:`hygon_attn_backend.integrations.vllm`
for how the name is registered). vLLM keeps its own KVCacheManager, BlockPool and prefix
caching; this backend only reads and writes the per-layer cache tensor vLLM hands it:
logical ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (K = ``[..., :D]``,
V = ``[..., D:]``) in whatever physical order vLLM's ``KVCacheLayout`` resolved to (vLLM
0.32+), or exactly that shape (older vLLM, which allocates ``get_kv_cache_shape``); the
kernels read K and V as two strided views, with no copy.

Written against several vLLM versions: the differences are adapted in :mod:`.compat`.

Capabilities declared here are the ones the kernels and the reference both implement;
the routing of a batch to the kernels is in :mod:`.step` (engine-free).
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch

from vllm.config import VllmConfig
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.attention.backends.utils import split_decodes_and_prefills
from vllm.v1.kv_cache_interface import AttentionSpec

from hygon_attn_backend import envs
from hygon_attn_backend.ops._dispatch import select_impl
from hygon_attn_backend.ops.lse_merge import merge_partials

from . import BACKEND_NAME, compat, logger, step
from .dcp import ContextParallel
from .step import HygonAttentionMetadata

__all__ = [
    "HygonAttentionBackend",
    "HygonAttentionMetadata",
    "HygonAttentionMetadataBuilder",
    "HygonAttentionImpl",
]

#: Head sizes the decode and prefill kernels are tested at (32: by this backend's tests).
SUPPORTED_HEAD_SIZES = [32, 64, 80, 96, 128, 192, 256]


class HygonAttentionBackend(AttentionBackend):
    """Paged decode with a KV-head grid + prefix-prefill, on vLLM's combined K|V cache."""

    # vLLM writes the new K/V through do_kv_cache_update before forward.
    forward_includes_kv_cache_update: bool = False
    # forward writes into the output buffer vLLM passes. vLLM 0.18 and older read this
    # (default False: no buffer, which they refuse with a split KV update); later
    # versions always pass one and have no such attribute.
    accept_output_buffer: bool = True

    # The kernels take fp16/bf16 queries (the Triton interpreter on CPU: fp16 only).
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[str]] = [
        "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["HygonAttentionImpl"]:
        return HygonAttentionImpl

    @staticmethod
    def get_builder_cls() -> type["HygonAttentionMetadataBuilder"]:
        return HygonAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        # Pages are addressed through the block table with any size P >= 1.
        return [MultipleOf(1)]

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return list(SUPPORTED_HEAD_SIZES)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple:
        # The kernels take K/V as [block, kv_head, slot, dim] views with arbitrary
        # strides, so every physical order works. Head-major block interiors first: a
        # decode program reads one KV head's tokens, contiguous in LBHNC.
        layout = compat.kv_cache_layout_enum()
        if layout is None:  # vLLM without layouts: get_kv_cache_shape below decides
            return ()
        return (layout.LBHNC, layout.LBNHC, layout.BLHNC, layout.BLNHC, layout.BHLNC,
                layout.LHBNC)

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, cache_dtype_str: str = "auto"
                           ) -> tuple[int, ...]:
        # vLLM before KVCacheLayout allocates this shape (no stride order declared, so
        # physical = logical: the block-major, head-major interior of LBHNC).
        return (num_blocks, num_kv_heads, block_size, 2 * head_size)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return True  # both kernels mask i - W < j <= i

    @classmethod
    def supports_sink(cls) -> bool:
        return True  # per-head sink logits, both kernels

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_per_head_quant_scales(cls) -> bool:
        return True  # fp8 scales of [num_kv_heads] (the attn_head scheme): every kernel

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                             has_sink, use_sparse, *rest):
        # rest: (use_mm_prefix, device_capability), or (device_capability,) on vLLM
        # whose selector has no use_mm_prefix; neither is read here.
        # A 16-bit cache must hold the model's own dtype (the kernels do not convert).
        named = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(kv_cache_dtype)
        if named is not None and named != dtype:
            return f"kv_cache_dtype {kv_cache_dtype} differs from the model dtype {dtype}"
        return None

    @classmethod
    def supports_device_cpu_query_lens_mismatch(cls) -> bool:
        # The decode/prefill split and the [S, T] decode view come from the host's query
        # lengths: device-trimmed drafts (adaptive verification) would not match them.
        return False


class HygonAttentionMetadataBuilder(AttentionMetadataBuilder[HygonAttentionMetadata]):
    """Splits each batch into decode head / prefill tail and keeps the kernels' scratch.

    CUDA graphs (``UNIFORM_BATCH``): a uniform decode batch (every request with the same
    1 + num_speculative_tokens tokens) is one decode launch that reads only persistent
    buffers (vLLM's seq_lens and block table, the workspace allocated here), allocates
    nothing and never syncs with the host; inside a capture its grid is sized by the
    block table's capacity, so a replay with longer sequences stays correct. A mixed
    batch is two launches split at a host-known request count that changes from batch
    to batch at equal token counts, so one graph per size cannot replay it: such
    batches run eagerly (``ALWAYS`` would be a false claim).
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH

    def __init__(self, kv_cache_spec: AttentionSpec, layer_names: list[str],
                 vllm_config: VllmConfig, device: torch.device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        # Decodes first, up to 1 + num_speculative_tokens tokens each.
        self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
        model_config = vllm_config.model_config
        self.block_size = kv_cache_spec.block_size
        self.num_kv_heads = kv_cache_spec.num_kv_heads
        self.head_size = kv_cache_spec.head_size
        self.num_heads = compat.num_attention_heads(vllm_config, layer_names)
        self.q_dtype = model_config.dtype
        self.kv_dtype = step.kv_dtype_for(vllm_config.cache_config.cache_dtype,
                                           model_config.dtype)
        self.impl = envs.impl()
        self.use_triton = select_impl(self.impl, torch.device(device)) == "triton"
        self.workspace = None
        # decode context parallelism: the rank's shard of every sequence (.dcp)
        self.cp = context_parallel(vllm_config, kv_cache_spec, device)
        world = 1 if self.cp is None else self.cp.world_size
        self.dcp_lens = None if self.cp is None else torch.zeros(
            vllm_config.scheduler_config.max_num_seqs, dtype=torch.int32, device=device)
        logger.info("hygon attention backend: %s (HYGON_ATTN_IMPL=%s) for layers %s",
                    "Triton kernels, native where impl=auto's rule takes it"
                    if self.use_triton else "reference ops (plain torch)",
                    self.impl, ", ".join(layer_names))
        if self.use_triton:
            # Split-KV scratch for every decode batch this engine can form, allocated once
            # (no allocation inside a captured graph): up to max_num_seqs sequences of
            # up to the block table's capacity, T = 1 + num_speculative_tokens each.
            from hygon_attn_backend.ops.decode import allocate_decode_workspace

            max_blocks = -(-model_config.max_model_len // self.block_size)
            # under DCP a rank's decode runs the group's W * H query heads
            self.workspace = allocate_decode_workspace(
                max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
                num_q_heads=self.num_heads * world, num_kv_heads=self.num_kv_heads,
                head_dim=self.head_size, max_context_len=max_blocks * self.block_size,
                device=device, num_tokens=compat.max_decode_query_len(vllm_config, self))

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> HygonAttentionMetadata:
        return self._build(common_attn_metadata, for_graph=False)

    def _build(self, cm: CommonAttentionMetadata, *, for_graph: bool) -> HygonAttentionMetadata:
        """Split the batch and plan every launch of the step (once for all layers)."""
        if not isinstance(cm.causal, bool):
            raise NotImplementedError("the hygon backend does not take per-request causal flags")
        causal = cm.causal
        num_decodes, _, num_decode_tokens, _ = split_decodes_and_prefills(
            cm, decode_threshold=self.reorder_batch_threshold or 1, require_uniform=True)
        md = step.make_metadata(
            query_start_loc=cm.query_start_loc, seq_lens=cm.seq_lens,
            block_table=cm.block_table_tensor, slot_mapping=cm.slot_mapping,
            num_reqs=cm.num_reqs, num_actual_tokens=cm.num_actual_tokens,
            max_query_len=cm.max_query_len, max_seq_len=cm.max_seq_len,
            num_decodes=num_decodes, num_decode_tokens=num_decode_tokens, causal=causal,
            one_token_decodes=self.cp is not None)
        step.plan_metadata(
            md, num_q_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            head_size=self.head_size, block_size=self.block_size, q_dtype=self.q_dtype,
            kv_dtype=self.kv_dtype, impl=self.impl, workspace=self.workspace,
            for_graph=for_graph, query_start_loc_cpu=cm.query_start_loc_cpu, cp=self.cp,
            decode_lens_buffer=self.dcp_lens)
        return md

    def build_for_cudagraph_capture(self, common_attn_metadata: CommonAttentionMetadata
                                    ) -> HygonAttentionMetadata:
        # The decode grid covers the block table's capacity: replays run longer sequences.
        md = self._build(common_attn_metadata, for_graph=True)
        # Capture with short sequences (the kernels' launch does not depend on them).
        md.seq_lens.fill_(1)
        return md


def context_parallel(vllm_config: VllmConfig, kv_cache_spec,
                     device: torch.device) -> Optional[ContextParallel]:
    """This rank's decode-context-parallel group with vLLM's collectives, or None without
    DCP (one rank, or a cache vLLM does not shard, such as a replicated draft's).

    The merge is vLLM's own combine on a GPU. On a CPU its correction kernel (Triton,
    through vLLM's launcher) cannot run, so the ranks' partial outputs and LSEs are
    all-gathered over the group and merged with ``ops.lse_merge`` (the same arithmetic,
    W times the bytes moved)."""
    world, rank = compat.dcp_world_and_rank(kv_cache_spec, vllm_config.parallel_config)
    if world <= 1:
        return None
    from vllm.distributed.parallel_state import get_dcp_group
    from vllm.v1.attention.ops.dcp import cp_lse_ag_out_rs, dcp_a2a_lse_reduce

    parallel = vllm_config.parallel_config
    # the combine vLLM's own backends use: all-gather the LSEs and reduce-scatter the heads,
    # or all-to-all (--dcp-comm-backend a2a)
    combine = (dcp_a2a_lse_reduce if getattr(parallel, "dcp_comm_backend", None) == "a2a"
               else cp_lse_ag_out_rs)

    def gather_heads(q):
        return get_dcp_group().all_gather(q, dim=1)

    def merge_ranks(out, lse):
        return combine(out, lse, get_dcp_group(), return_lse=True, is_lse_base_on_e=True)

    def merge_ranks_gathered(out, lse):
        group = get_dcp_group()
        outs = group.all_gather(out.contiguous(), dim=0).view((world,) + tuple(out.shape))
        lses = group.all_gather(lse.contiguous(), dim=0).view((world,) + tuple(lse.shape))
        merged, merged_lse = merge_partials(outs, lses)
        heads = out.shape[1] // world
        mine = slice(rank * heads, (rank + 1) * heads)
        return merged[:, mine].to(out.dtype), merged_lse[:, mine]

    return ContextParallel(world_size=world, rank=rank,
                           interleave=int(getattr(parallel, "cp_kv_cache_interleave_size", 1)),
                           gather_heads=gather_heads,
                           merge_ranks=merge_ranks if torch.device(device).type == "cuda"
                           else merge_ranks_gathered)


class HygonAttentionImpl(AttentionImpl[HygonAttentionMetadata]):
    """Per-layer attention: writes new K/V with our cache kernel, then routes the batch.

    Decode context parallelism (vLLM's ``--decode-context-parallel-size``): the decode
    returns its log-sum-exp (``can_return_lse_for_decode``, natural log:
    ``lse_base_on_e``) and the step runs the sharded launches of :mod:`.dcp`; vLLM sets
    ``dcp_world_size`` / ``dcp_rank`` / ``need_to_return_lse_for_decode`` on the instance.
    """

    can_return_lse_for_decode: bool = True
    lse_base_on_e: bool = True
    supports_dcp: bool = True

    def __init__(self, num_heads: int, head_size: int, scale: float,
                 num_kv_heads: Optional[int] = None,
                 alibi_slopes: Optional[list[float]] = None,
                 sliding_window: Optional[int] = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: Optional[float] = None,
                 attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: Optional[str] = None,
                 sinks: Optional[torch.Tensor] = None, **unsupported) -> None:
        if alibi_slopes is not None:
            raise NotImplementedError("the hygon backend does not implement ALiBi")
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError(f"the hygon backend implements decoder attention "
                                      f"only, got {attn_type}")
        if sliding_window is not None and not HygonAttentionBackend.supports_sliding_window():
            raise NotImplementedError("the hygon backend does not implement sliding windows")
        if sinks is not None and not HygonAttentionBackend.supports_sink():
            raise NotImplementedError("the hygon backend does not implement attention sinks")
        if unsupported:
            raise NotImplementedError(f"the hygon backend does not take {sorted(unsupported)}")
        if getattr(self, "dcp_world_size", 1) > 1 and (sliding_window is not None
                                                        or sinks is not None):
            # a window is in global positions, a rank's shard has local ones; a sink would
            # be counted once a rank
            raise NotImplementedError("the hygon backend's decode context parallelism does "
                                      "not take sliding windows or attention sinks")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads "
                             f"{self.num_kv_heads}")
        self.sliding_window = sliding_window
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = logits_soft_cap if logits_soft_cap else None
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        self.sinks = sinks
        self.impl = envs.impl()
        self.layer_spec = step.LayerSpec(
            num_heads=num_heads, num_kv_heads=self.num_kv_heads, head_size=head_size,
            scale=self.scale, kv_cache_dtype=kv_cache_dtype, sliding_window=sliding_window,
            soft_cap=self.logits_soft_cap, sinks=sinks)

    def do_kv_cache_update(self, layer: AttentionLayer, key: torch.Tensor,
                           value: torch.Tensor, kv_cache: torch.Tensor,
                           slot_mapping: torch.Tensor) -> None:
        """key, value: ``[num_tokens, num_kv_heads, head_size]``; slot_mapping
        ``[num_tokens]`` (``-1`` = padding)."""
        if kv_cache.numel() == 0:
            return
        step.write_new_kv(key, value, kv_cache, slot_mapping, self.layer_spec,
                           k_scale=layer._k_scale, v_scale=layer._v_scale, impl=self.impl)

    def forward(self, layer: AttentionLayer, query: torch.Tensor, key: torch.Tensor,
                value: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: HygonAttentionMetadata, output: torch.Tensor,
                output_scale: Optional[torch.Tensor] = None,
                output_block_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """query: ``[num_tokens, num_heads, head_size]``; output: same shape, written in
        place for the first ``num_actual_tokens`` rows."""
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("the hygon backend does not fuse output quantization")
        if attn_metadata is None:  # vLLM's memory-profiling run
            return output.fill_(0)
        return step.attention(query, kv_cache, attn_metadata, output, self.layer_spec,
                               k_scale=layer._k_scale, v_scale=layer._v_scale, key=key,
                               value=value)
