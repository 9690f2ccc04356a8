"""vLLM MLA backend running our MLA ops (DeepSeek-V2/V3-style multi-head latent attention).

Selected by the same ``--attention-backend hygon`` as the dense backend when the model
uses MLA (:mod:`.mla_select`). Built on vLLM's MLA scaffolding (0.15 to 0.32:
``vllm.model_executor.layers.attention.mla_attention``; what differs between those
versions is adapted in :mod:`.compat`): ``MLAAttention.forward_impl``
keeps the parts that are projections, not attention (the ``W_UK`` absorption of the decode
queries, the ``W_UV`` up-projection of the decode output, the decode / prefill split of
the batch), and calls this impl's

* ``do_kv_cache_update``: the new tokens' ``[kv_c | k_pe]`` rows into the paged latent
  cache ``[num_blocks, block_size, kv_lora_rank + rope]`` -> ``ops.mla.write_mla_cache``;
* ``forward_mqa`` (decode: one query token a request, or with speculative decoding the
  ``T = 1 + num_speculative_tokens`` tokens of every verified request, vLLM's uniform
  decode block): the absorbed queries -> the step's ``ops.mla.MLADecodePlan`` with
  ``num_tokens = T`` (:func:`.mla_step.decode`; token ``t`` sees the prefix and drafts
  ``0..t``), planned once per step by :class:`HygonMLAMetadataBuilder` with the layers'
  softmax scale;
* ``forward_mha`` (prefill): :func:`.mla_step.prefill`, our ``ragged_attention`` over the
  up-projected K/V, with vLLM's context chunks folded in by our ``merge_attn_states``. The
  MLA prefill backend vLLM picks for the layer (``get_mla_prefill_backend``) is not
  called (where vLLM has none usable, as on its CPU platform before 0.32, the layer gets
  a placeholder: :mod:`.mla_prefill`).

vLLM's metadata builder (``MLACommonMetadataBuilder``) splits the batch and plans the
context chunks; ours adds the decode plan and the step's context chunks in one form
(:func:`.compat.mla_context_chunks`). fp8 caches (``fp8`` / ``fp8_e4m3``): vLLM
allocates bytes and its layer views them as e4m3 for the attention calls; the write
quantizes with the layer's ``k_scale``, the decode reads the codes with ``_k_scale``, the
context chunks are dequantised as gathered (:func:`.mla_step.context`). vLLM's CPU
platform disables chunked prefill and prefix caching for MLA models, so there the context
path does not run in the engine (its tests drive it through vLLM's own chunk metadata).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import torch

from vllm.model_executor.layers.attention.mla_attention import (
    MLACommonBackend,
    MLACommonDecodeMetadata,
    MLACommonImpl,
    MLACommonMetadata,
    MLACommonMetadataBuilder,
    QueryLenSupport,
)
from vllm.v1.attention.backend import AttentionLayer, AttentionType, MultipleOf

from hygon_attn_backend import envs
from hygon_attn_backend.ops._dispatch import select_impl
from hygon_attn_backend.ops.mla import MLADecodePlan, plan_mla_decode, write_mla_cache

from . import BACKEND_NAME, compat, logger, mla_step
from .step import FP8_CACHE_DTYPES

__all__ = ["HygonMLABackend", "HygonMLAMetadataBuilder", "HygonMLAImpl",
           "HygonMLADecodeMetadata", "HygonMLAMetadata"]

#: vLLM's fp8 ``kv_cache_dtype`` strings for MLA and the format its layer views the byte
#: cache as (``current_platform.fp8_dtype()``: e4m3fn on CUDA and CPU builds): the e4m3
#: ones of the dense backend's
FP8_MLA_CACHE = {name: dtype for name, dtype in FP8_CACHE_DTYPES.items()
                 if dtype == torch.float8_e4m3fn}


def mla_cache_dtype(kv_cache_dtype: str, stored: torch.dtype) -> torch.dtype:
    """The dtype our MLA ops read vLLM's latent cache as: the fp8 format for an fp8
    ``kv_cache_dtype`` (vLLM allocates the cache as bytes), else the stored dtype."""
    return FP8_MLA_CACHE.get(str(kv_cache_dtype), stored)


#: The widest latent row the decode op takes (kv_lora_rank <= 512, rope <= 128; the
#: prefill's extend reads at most 576, DeepSeek's 512 + 64).
MAX_LATENT_WIDTH = 576


class HygonMLABackend(MLACommonBackend):
    """MLA over vLLM's latent cache with our decode and prefill ops."""

    # The Triton interpreter on CPU takes fp16 only; fp32 runs the reference ops.
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    # fp8: vLLM's MLA layer views the byte cache as its platform's fp8 dtype (e4m3)
    supported_kv_cache_dtypes: ClassVar[list[str]] = ["auto", *FP8_MLA_CACHE]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type["HygonMLAImpl"]:
        return HygonMLAImpl

    @staticmethod
    def get_builder_cls() -> type["HygonMLAMetadataBuilder"]:
        return HygonMLAMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]  # pages addressed through the block table, any size

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        return [576]  # DeepSeek-V2/V3: kv_lora_rank 512 + rope 64

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        # Any latent row kv_lora_rank + rope the decode op takes (the tests' small ones).
        return 0 < head_size <= MAX_LATENT_WIDTH

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_combination(cls, head_size, dtype, kv_cache_dtype, block_size, use_mla,
                             has_sink, use_sparse, *rest):
        if not use_mla:
            return "the hygon MLA backend serves MLA layers only"
        if use_sparse:
            return "sparse MLA (DeepSeek-V3.2's indexer) is not supported"
        if kv_cache_dtype not in cls.supported_kv_cache_dtypes and \
                kv_cache_dtype not in ("float16", "bfloat16"):
            return (f"kv_cache_dtype {kv_cache_dtype} (the MLA backend takes auto, fp8 and "
                    "fp8_e4m3)")
        return None


@dataclass
class HygonMLADecodeMetadata(MLACommonDecodeMetadata):
    """vLLM's decode metadata plus the step's decode plan (shared by every layer)."""

    plan: Optional[MLADecodePlan] = None


@dataclass
class HygonMLAMetadata(MLACommonMetadata):
    """vLLM's MLA metadata plus the step's context chunks as :func:`.mla_step.context`
    reads them (:func:`.compat.mla_context_chunks`; empty: no prefill has a context)."""

    context_chunks: tuple = ()


class HygonMLAMetadataBuilder(MLACommonMetadataBuilder[HygonMLAMetadata]):
    """vLLM's MLA builder (batch split, context chunks) plus our decode plan per step.

    ``UNIFORM``: with speculative decoding vLLM raises the decode threshold to ``1 +
    num_speculative_tokens`` and hands the decode path a uniform block of ``T`` query
    tokens a request (MTP / EAGLE verify), which the MLA decode serves as ``num_tokens =
    T`` (causal within the block)."""

    query_len_support: ClassVar[QueryLenSupport] = QueryLenSupport.UNIFORM

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device, metadata_cls=None,
                 supports_dcp_with_varlen: bool = False):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device,
                         metadata_cls=metadata_cls or HygonMLAMetadata,
                         supports_dcp_with_varlen=supports_dcp_with_varlen)
        if self.dcp_world_size > 1:
            raise NotImplementedError("the hygon MLA backend does not take decode context "
                                      "parallelism")
        layer = vllm_config.compilation_config.static_forward_context[layer_names[0]]
        self.scale = float(layer.scale)
        self.q_dtype = self.model_config.dtype
        # vLLM 0.15 to 0.21 set their own page_size on CUDA only
        self.latent_page_size = int(kv_cache_spec.block_size)
        self.kv_dtype = mla_cache_dtype(vllm_config.cache_config.cache_dtype,
                                        kv_cache_spec.dtype)
        self.impl = envs.impl()
        use_triton = select_impl(self.impl, torch.device(device)) == "triton"
        logger.info("hygon attention backend (MLA): %s (HYGON_ATTN_IMPL=%s) for layers %s",
                    "Triton kernels" if use_triton else "reference ops (plain torch)",
                    self.impl, ", ".join(layer_names))

    def build(self, common_prefix_len, common_attn_metadata, fast_build: bool = False):
        md = super().build(common_prefix_len, common_attn_metadata, fast_build)
        if isinstance(md, HygonMLAMetadata):
            md.context_chunks = tuple(compat.mla_context_chunks(md.prefill))
        return md

    def _build_decode(self, block_table_tensor, seq_lens_device, max_seq_len,
                      query_start_loc_cpu, query_start_loc_device, num_decode_tokens,
                      max_query_len=None, dcp_tot_seq_lens_device=None):
        # vLLM calls this by keyword; max_query_len is absent before 0.32
        dims = self.mla_dims
        num_decodes = block_table_tensor.shape[0]
        tokens, rest = divmod(int(num_decode_tokens), max(num_decodes, 1))
        if rest or tokens < 1:
            raise ValueError(f"hygon MLA decode: {num_decode_tokens} decode tokens over "
                             f"{num_decodes} requests is not a uniform block")
        plan = plan_mla_decode(
            block_table=block_table_tensor, seq_lens=seq_lens_device,
            page_size=self.latent_page_size, num_q_heads=self.num_heads,
            kv_lora_rank=dims.kv_lora_rank, rope_dim=dims.qk_rope_head_dim,
            q_dtype=self.q_dtype, kv_dtype=self.kv_dtype, num_tokens=tokens,
            scale=self.scale, max_seq_len=int(max_seq_len), impl=self.impl)
        return HygonMLADecodeMetadata(block_table=block_table_tensor, seq_lens=seq_lens_device,
                                      dcp_tot_seq_lens=dcp_tot_seq_lens_device, plan=plan)


class HygonMLAImpl(MLACommonImpl[MLACommonMetadata]):
    """The attention of one MLA layer: our ops behind vLLM's MLA impl interface."""

    can_return_lse_for_decode: bool = False

    def __init__(self, num_heads, head_size, scale, num_kv_heads, alibi_slopes,
                 sliding_window, kv_cache_dtype, logits_soft_cap, attn_type,
                 kv_sharing_target_layer_name, **mla_args):
        if attn_type != AttentionType.DECODER:
            raise NotImplementedError("the hygon MLA backend serves decoder self-attention")
        for name, value in (("alibi_slopes", alibi_slopes),
                            ("sliding_window", sliding_window),
                            ("logits_soft_cap", logits_soft_cap)):
            if value:
                raise NotImplementedError(f"the hygon MLA backend does not take {name}")
        compat.init_mla_common_impl(super().__init__, self, num_heads, head_size, scale,
                                    num_kv_heads, alibi_slopes, sliding_window,
                                    kv_cache_dtype, logits_soft_cap, attn_type,
                                    kv_sharing_target_layer_name, **mla_args)
        if self.indexer is not None:
            raise NotImplementedError("sparse MLA (an indexer) is not supported")
        # The absorbed query reaches forward_mqa unquantised: fp8 query input is not taken.
        self.supports_quant_query_input = False
        self.fp8_dtype = FP8_MLA_CACHE.get(str(kv_cache_dtype))  # None: a 16-bit cache
        self.fp8 = self.fp8_dtype is not None
        self._use_flashinfer_concat_mla_k = False
        self.ops_impl = envs.impl()

    def fused_output_quant_supported(self, quant_key) -> bool:
        return False

    def forward(self, layer, q, k_c_normed, k_pe, kv_cache, attn_metadata, output=None,
                output_scale=None, output_block_scale=None):
        """A layer's whole MLA attention, where vLLM's layer hands it to the impl: vLLM 0.15's
        ``MLAAttention.forward`` calls ``impl.forward`` (0.18 and newer run the projections
        in the layer and call ``do_kv_cache_update`` / ``forward_mha`` / ``forward_mqa``,
        never this). The flow of their layer: the new rows into the cache, the prefill
        rows (after the decode rows, as vLLM's batch reorder puts them) through
        :meth:`forward_mha`, the decode rows' ``q_nope`` absorbed by ``W_UK`` into the
        latent, :meth:`forward_mqa`, its latent output up-projected by ``W_UV``.

        q ``[N, H, qk_nope + rope]``, k_c_normed ``[N, kv_lora_rank]``, k_pe ``[N, 1,
        rope]``, kv_cache vLLM's latent cache, output ``[N, H * v_head_dim]`` (written;
        returned). No metadata (vLLM's profile run): output zero-filled."""
        if output is None:
            raise ValueError("the hygon MLA backend writes into vLLM's output buffer")
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("the hygon MLA backend does not write quantised output")
        if attn_metadata is None:
            return output.fill_(0)
        n = attn_metadata.num_actual_tokens
        out, q, k_c_normed, k_pe = output[:n], q[:n], k_c_normed[:n], k_pe[:n]
        self.do_kv_cache_update(k_c_normed, k_pe, kv_cache, attn_metadata.slot_mapping,
                                self.kv_cache_dtype, layer._k_scale)
        if self.fp8:
            kv_cache = kv_cache.view(self.fp8_dtype)
        nd = attn_metadata.num_decode_tokens
        if attn_metadata.num_prefills:
            self.forward_mha(q[nd:], k_c_normed[nd:], k_pe[nd:], kv_cache, attn_metadata,
                             layer._k_scale, output=out[nd:])
        if attn_metadata.num_decodes:
            q_nope, q_pe = q[:nd].split([self.qk_nope_head_dim, self.qk_rope_head_dim],
                                        dim=-1)
            # (H, B, nope) x W_UK_T (H, nope, kv_lora_rank) -> (B, H, kv_lora_rank)
            ql_nope = torch.bmm(q_nope.transpose(0, 1), self.W_UK_T).transpose(0, 1)
            latent, _ = self.forward_mqa((ql_nope, q_pe), kv_cache, attn_metadata, layer)
            self._v_up_proj(latent, out=out[:nd])
        return output

    def do_kv_cache_update(self, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                           kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           kv_cache_dtype: str, k_scale: torch.Tensor) -> None:
        """kv_c_normed ``[N, kv_lora_rank]``, k_pe ``[N, 1, rope]``, kv_cache ``[blocks,
        page, kv_lora_rank + rope]``, slot_mapping ``[N']`` (``N' <= N``; -1 pads)."""
        if kv_cache.numel() == 0:
            return
        slots = slot_mapping.flatten()
        n = min(slots.shape[0], kv_c_normed.shape[0])
        if self.fp8:  # vLLM's byte cache: the codes of x / k_scale
            kv_cache = kv_cache.view(self.fp8_dtype)
        write_mla_cache(kv_c_normed[:n], k_pe[:n].reshape(n, -1), kv_cache, slots[:n],
                        kv_scale=k_scale if self.fp8 else None, impl=self.ops_impl)

    def forward_mqa(self, q, kv_c_and_k_pe_cache: torch.Tensor,
                    attn_metadata: MLACommonMetadata, layer: AttentionLayer):
        decode = attn_metadata.decode
        if not isinstance(decode, HygonMLADecodeMetadata) or decode.plan is None:
            raise ValueError("attn_metadata.decode: no hygon decode plan (metadata not "
                             "built by HygonMLAMetadataBuilder)")
        if decode.plan.num_tokens > 1 and not getattr(attn_metadata, "causal", True):
            raise NotImplementedError("the hygon MLA backend does not take non-causal "
                                      "multi-token decode blocks (parallel drafting)")
        return mla_step.decode(decode.plan, q, kv_c_and_k_pe_cache, scale=self.scale,
                               kv_scale=layer._k_scale if self.fp8 else None)

    def _forward_decode(self, q, kv_c_and_k_pe_cache, attn_metadata, layer):
        """vLLM 0.15's name for :meth:`forward_mqa` (abstract on its ``MLACommonImpl``)."""
        return self.forward_mqa(q, kv_c_and_k_pe_cache, attn_metadata, layer)

    def forward_mha(self, q: torch.Tensor, kv_c_normed: torch.Tensor, k_pe: torch.Tensor,
                    kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: MLACommonMetadata,
                    k_scale: torch.Tensor, output: torch.Tensor,
                    output_scale: Optional[torch.Tensor] = None) -> None:
        if output_scale is not None:
            raise NotImplementedError("the hygon MLA backend does not write quantised output")
        prefill = attn_metadata.prefill
        chunks = getattr(attn_metadata, "context_chunks", None)
        if chunks is None:  # metadata not built by our builder
            chunks = compat.mla_context_chunks(prefill)
        mla_step.prefill(
            q, kv_c_normed, k_pe, kv_b_proj=self.kv_b_proj, num_heads=self.num_heads,
            qk_nope_head_dim=self.qk_nope_head_dim, v_head_dim=self.v_head_dim,
            scale=self.scale, query_start_loc=prefill.query_start_loc, out=output,
            kv_cache=kv_c_and_k_pe_cache, block_table=prefill.block_table,
            chunks=chunks, impl=self.ops_impl,
            kv_scale=k_scale if self.fp8 else None)
