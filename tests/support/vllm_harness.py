"""vLLM's attention-backend harness around our backend: a case from ``vllm_cases`` through
vLLM's real ``VllmConfig`` / ``CommonAttentionMetadata``, our metadata builder, then the
impl's ``do_kv_cache_update`` and ``forward``, as vLLM's worker calls them.

Written for every vLLM version the integration supports (``scripts/compat`` runs it in
each): vLLM's config and metadata classes are given only the fields the installed version
has (vLLM 0.21 has no ``seq_lens_cpu_upper_bound``, for one). Imports vLLM: use it where
vLLM is installed.
"""

from __future__ import annotations

import dataclasses
import inspect

import torch

from vllm.config import (
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import FullAttentionSpec

from hygon_attn_backend.integrations.vllm.backend import (
    HygonAttentionImpl,
    HygonAttentionMetadataBuilder,
)
from tests.support.budget import assert_within_budget
from tests.support.vllm_cases import oracle

MAX_MODEL_LEN = 8192


def _known(cls, kwargs: dict) -> dict:
    """``kwargs`` less the keywords ``cls`` (a dataclass or a class) does not take."""
    names = set(inspect.signature(cls).parameters)  # init-only fields included
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    return {k: v for k, v in kwargs.items() if k in names}


def llama_config_dir(path, num_q_heads: int, num_kv_heads: int, head_size: int) -> str:
    """A config-only Llama folder (no weights): vLLM's ModelConfig reads the heads there."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=256, hidden_size=num_q_heads * head_size, intermediate_size=64,
                num_hidden_layers=1, num_attention_heads=num_q_heads,
                num_key_value_heads=num_kv_heads, head_dim=head_size,
                max_position_embeddings=MAX_MODEL_LEN).save_pretrained(path)
    return str(path)


def vllm_config_for(model_dir, *, block_size, dtype):
    model = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True,
                        dtype=dtype, max_model_len=MAX_MODEL_LEN)
    scheduler = SchedulerConfig(**_known(SchedulerConfig, dict(
        max_num_seqs=64, max_num_batched_tokens=MAX_MODEL_LEN, max_model_len=MAX_MODEL_LEN,
        is_encoder_decoder=False)))
    return VllmConfig(model_config=model, cache_config=CacheConfig(block_size=block_size),
                      scheduler_config=scheduler)


class Layer:
    """What the impl reads from vLLM's Attention layer: the KV scales."""

    def __init__(self, case):
        self._k_scale = case.k_scale
        self._v_scale = case.v_scale
        self._k_scale_float = float(case.k_scale.max())  # vLLM: the largest of per-head scales
        self._v_scale_float = float(case.v_scale.max())


def common_metadata(case) -> CommonAttentionMetadata:
    qsl = case.query_start_loc
    return CommonAttentionMetadata(**_known(CommonAttentionMetadata, dict(
        query_start_loc=qsl, query_start_loc_cpu=qsl.cpu(), seq_lens=case.seq_lens_t,
        num_reqs=len(case.seq_lens), num_actual_tokens=case.num_tokens,
        max_query_len=max(case.query_lens), max_seq_len=max(case.seq_lens),
        block_table_tensor=case.block_table, slot_mapping=case.slot_mapping,
        seq_lens_cpu_upper_bound=case.seq_lens_t.cpu())))


def run_backend(case, vllm_config, *, sliding_window=None, soft_cap=None, sinks=None,
                decode_threshold=None):
    """Builder -> do_kv_cache_update -> forward, as vLLM's worker calls them. Returns the
    output ``[T, Hq, D]`` and the step's metadata."""
    spec = FullAttentionSpec(block_size=case.block_size, num_kv_heads=case.num_kv_heads,
                             head_size=case.head_size, dtype=case.dtype,
                             sliding_window=sliding_window)
    with set_current_vllm_config(vllm_config):
        builder = HygonAttentionMetadataBuilder(spec, ["model.layers.0.self_attn.attn"],
                                                vllm_config, case.query.device)
        if decode_threshold is not None:  # as a speculative config would set it
            builder.reorder_batch_threshold = decode_threshold
        md = builder.build(0, common_metadata(case))
        impl = HygonAttentionImpl(case.num_q_heads, case.head_size, case.head_size ** -0.5,
                                  case.num_kv_heads, None, sliding_window,
                                  case.kv_cache_dtype, soft_cap, sinks=sinks)
    layer = Layer(case)
    impl.do_kv_cache_update(layer, case.key, case.value, case.kv_cache, case.slot_mapping)
    out = torch.full_like(case.query, float("nan"))
    impl.forward(layer, case.query, case.key, case.value, case.kv_cache, md, output=out)
    return out, md


def check(case, out, **options):
    """The output within the error budget of the float64 oracle (low-precision oracle as
    the budget's scale)."""
    ref64 = oracle(case, torch.float64, **options)
    ref_lowp = oracle(case, case.dtype, **options)
    assert_within_budget(out, ref64, ref_lowp)
