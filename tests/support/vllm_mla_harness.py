"""vLLM's MLA scaffolding around our MLA backend, engine-free: a batch of decode and
prefill requests (some with a cached context) through vLLM's real ``VllmConfig``,
``CommonAttentionMetadata`` and MLA metadata builder (its batch split and context
chunks), then our impl's ``do_kv_cache_update``, ``forward_mqa`` and ``forward_mha`` as
``MLAAttention.forward_impl`` calls them, the projections around them (the ``W_UK``
absorption and the ``W_UV`` up-projection) done here as vLLM's layer does them.

The oracle is plain float64 MLA without absorption: each request's keys ``[kv_c W_UK |
k_pe]`` and values ``kv_c W_UV`` for all its tokens (context and new), softmax over the
shifted causal mask with the given scale. Imports vLLM (0.15 to 0.32: what differs
between them, the builder's prefill-backend slot, its context-chunk layout and whether
the CPU platform keeps an fp8 cache, is taken as the installed version has it).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch

from vllm.config import (CacheConfig, ModelConfig, SchedulerConfig, VllmConfig,
                         set_current_vllm_config)
from vllm.v1.attention.backend import CommonAttentionMetadata
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from hygon_attn_backend import reference
from hygon_attn_backend.integrations.vllm import mla_prefill
from hygon_attn_backend.integrations.vllm.mla import HygonMLAImpl, HygonMLAMetadataBuilder
from tests.support.vllm_harness import _known

LAYER = "model.layers.0.self_attn.attn"
MAX_MODEL_LEN = 512


@dataclass
class Dims:
    heads: int = 2
    rank: int = 512  # vLLM's MLA metadata takes head sizes 320 / 512 / 576 only
    rope: int = 64
    nope: int = 16
    v: int = 16


def deepseek_config_dir(path, dims: Dims) -> str:
    """A config-only DeepSeek-V2 folder: vLLM's ModelConfig reads MLA from it."""
    from transformers import DeepseekV2Config

    DeepseekV2Config(vocab_size=256, hidden_size=64, intermediate_size=64,
                     num_hidden_layers=1, num_attention_heads=dims.heads,
                     num_key_value_heads=dims.heads, q_lora_rank=None,
                     kv_lora_rank=dims.rank, qk_nope_head_dim=dims.nope,
                     qk_rope_head_dim=dims.rope, v_head_dim=dims.v, head_dim=dims.rope,
                     first_k_dense_replace=1, max_position_embeddings=MAX_MODEL_LEN
                     ).save_pretrained(path)
    return str(path)


def vllm_config_for(model_dir, *, block_size: int, cache_dtype: str = "auto") -> VllmConfig:
    """An fp8 ``cache_dtype`` comes with chunked prefill and prefix caching off: vLLM 0.18's
    CPU platform refuses fp8 KV with either (the MLA builder's context chunks are planned
    from the batch's context lengths all the same)."""
    model = ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True,
                        dtype="float16", max_model_len=MAX_MODEL_LEN)
    fp8 = cache_dtype != "auto"
    scheduler = SchedulerConfig(**_known(SchedulerConfig, dict(
        max_num_seqs=16, max_num_batched_tokens=MAX_MODEL_LEN, max_model_len=MAX_MODEL_LEN,
        is_encoder_decoder=False, **({"enable_chunked_prefill": False} if fp8 else {}))))
    cache = CacheConfig(block_size=block_size, cache_dtype=cache_dtype,
                        **({"enable_prefix_caching": False} if fp8 else {}))
    return VllmConfig(model_config=model, cache_config=cache, scheduler_config=scheduler)


def fp8_cache_kept(model_dir) -> bool:
    """Whether this vLLM's platform keeps an ``fp8`` KV cache dtype (vLLM 0.15 and 0.18's
    CPU platforms turn it back to ``auto``: no fp8 cache to test there)."""
    return vllm_config_for(model_dir, block_size=4, cache_dtype="fp8").cache_config \
        .cache_dtype == "fp8"


#: The oracle cases (the tests and ``scripts/compat``'s ``mla`` check run them):
#: name -> (context_lens, query_lens (decodes of 1 first), workspace rows (None: vLLM's
#: default)); block size 4 unless a caller says otherwise.
CASES = {
    "decode_only": ([6, 13, 1], [1, 1, 1], None),
    "prefill_no_context": ([0, 0], [7, 3], None),
    "mixed_context": ([6, 11, 9, 0, 6], [1, 1, 5, 3, 4], None),
    # long contexts over several pages of 16 (the tests' vLLM-layer comparison)
    "long_context": ([20, 37, 33, 0, 18], [1, 1, 5, 3, 4], None),
    # 8-row chunks: request 2's 9 context rows split over two chunks (vLLM 0.28+: a
    # continuation) or three (older: 4 rows a prefill a chunk)
    "chunked_continuation": ([6, 11, 9, 0, 6], [1, 1, 5, 3, 4], 8),
}


@dataclass
class MLACase:
    context_lens: list
    query_lens: list  # decodes (1) first, then prefills
    block_size: int
    dims: Dims
    scale: float
    q: torch.Tensor          # [N, H, nope + rope] the new tokens' queries
    kv_c: list               # per request [L, R] every token's latent (context + new)
    k_pe: list               # per request [L, rope]
    w_kv_b: torch.Tensor     # [R, H * (nope + v)]
    block_table: torch.Tensor
    num_blocks: int


def make_case(context_lens, query_lens, *, dims=Dims(), block_size=4, scale=None,
              seed=0) -> MLACase:
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=gen) * std

    d = dims
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32)
    used = 0
    for i, b in enumerate(blocks):
        table[i, :b] = perm[used:used + b]
        used += b
    return MLACase(
        context_lens=list(context_lens), query_lens=list(query_lens),
        block_size=block_size, dims=d,
        scale=scale if scale is not None else (d.nope + d.rope) ** -0.5,
        q=randn(sum(query_lens), d.heads, d.nope + d.rope),
        kv_c=[randn(s, d.rank, std=0.3) for s in seq_lens],
        k_pe=[randn(s, d.rope) for s in seq_lens],
        w_kv_b=randn(d.rank, d.heads * (d.nope + d.v), std=d.rank ** -0.5),
        block_table=table, num_blocks=num_blocks)


def dequantized(x: torch.Tensor, k_scale: float) -> torch.Tensor:
    """``x`` as an e4m3 cache with scale ``k_scale`` holds it (float64)."""
    return reference.quantize_fp8(x.float(), torch.float8_e4m3fn, k_scale).double() * k_scale


def oracle(case: MLACase, *, k_scale: Optional[float] = None) -> torch.Tensor:
    """``[N, H, v]`` float64. ``k_scale``: an e4m3 cache of that scale; the rows read from
    it (every context row, a decode's new row) are its dequantised values, a prefill's new
    rows (the step's own latent) exact."""
    d = case.dims
    w = case.w_kv_b.double().view(d.rank, d.heads, d.nope + d.v)
    outs, row = [], 0
    for ctx, ql, kv_c, k_pe in zip(case.context_lens, case.query_lens, case.kv_c, case.k_pe):
        if k_scale is not None:
            cached = ctx + ql if ql == 1 else ctx  # decodes (1 row) read their row back
            kv_c = torch.cat([dequantized(kv_c[:cached], k_scale), kv_c[cached:].double()])
            k_pe = torch.cat([dequantized(k_pe[:cached], k_scale), k_pe[cached:].double()])
        kv = torch.einsum("lr,rhd->lhd", kv_c.double(), w)
        k = torch.cat([kv[..., :d.nope], k_pe.double()[:, None].expand(-1, d.heads, -1)], -1)
        v = kv[..., d.nope:]
        q = case.q[row:row + ql].double()
        logits = torch.einsum("qhd,khd->hqk", q, k) * case.scale
        mask = torch.arange(ctx + ql)[None] <= torch.arange(ql)[:, None] + ctx
        logits = logits.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", logits.softmax(-1), v))
        row += ql
    return torch.cat(outs)


class KvBProj:
    """What the impls read of vLLM's ``kv_b_proj`` layer: a call returning ``(out, bias)``
    and its ``weight`` (vLLM stores it ``[out, in]``)."""

    def __init__(self, w: torch.Tensor):
        self.w = w
        self.weight = w.t()
        self.params_dtype = w.dtype

    def __call__(self, x):
        return x @ self.w, None


def prefill_backend_cls():
    """The MLA prefill backend vLLM's CPU build gives a layer: its SDPA one (0.32), else
    the placeholder ``hygon`` puts in that slot (0.21 to 0.28 have none usable); None on
    a vLLM without prefill backends (0.15, 0.18: the impl prefills itself)."""
    try:
        from vllm.v1.attention.backends.mla.prefill.cpu_sdpa import CPUSDPAMLAPrefillBackend
    except ImportError:
        try:
            return mla_prefill.placeholder_class()
        except ImportError:
            return None
    return CPUSDPAMLAPrefillBackend


def _builder(case: MLACase, vllm_config, workspace_rows, builder_cls):
    d = case.dims
    slot = prefill_backend_cls()
    layer = SimpleNamespace(
        q_lora_rank=None, kv_lora_rank=d.rank, qk_nope_head_dim=d.nope,
        qk_rope_head_dim=d.rope, v_head_dim=d.v, scale=case.scale,
        prefill_backend=None if slot is None else slot(
            num_heads=d.heads, scale=case.scale, kv_lora_rank=d.rank, qk_nope_head_dim=d.nope,
            qk_rope_head_dim=d.rope, v_head_dim=d.v, vllm_config=vllm_config))
    vllm_config.compilation_config.static_forward_context[LAYER] = layer
    fp8 = vllm_config.cache_config.cache_dtype != "auto"
    spec = MLAAttentionSpec(block_size=case.block_size, num_kv_heads=1,
                            head_size=d.rank + d.rope,
                            dtype=torch.uint8 if fp8 else torch.float16)
    builder = builder_cls(spec, [LAYER], vllm_config, torch.device("cpu"))
    if workspace_rows is not None:  # small chunks: splits (and continuations, 0.28+)
        builder.chunked_prefill_workspace_size = workspace_rows
        builder.chunked_prefill_workspace = builder.chunked_prefill_workspace[:workspace_rows]
    return builder


@contextlib.contextmanager
def host_memory_unpinned():
    """Within: ``torch.empty`` / ``torch.zeros`` ignore ``pin_memory`` on a host without
    CUDA. vLLM 0.21 and 0.25's MLA builder pins its context-chunk tensors unconditionally
    (``pin_memory=True``), which needs a CUDA driver; vLLM's CPU engine never builds those
    chunks for an MLA model (its CPU platform turns chunked prefill and prefix caching off),
    so only this harness meets them on a CPU host. 0.28 and newer ask
    ``is_pin_memory_available()`` and need nothing."""
    if torch.cuda.is_available():
        yield
        return
    real = {name: getattr(torch, name) for name in ("empty", "zeros")}

    def unpinned(fn):
        def call(*args, pin_memory=False, **kwargs):
            return fn(*args, **kwargs)
        return call

    try:
        for name, fn in real.items():
            setattr(torch, name, unpinned(fn))
        yield
    finally:
        for name, fn in real.items():
            setattr(torch, name, fn)


def common_metadata(case: MLACase) -> CommonAttentionMetadata:
    seq_lens = [c + q for c, q in zip(case.context_lens, case.query_lens)]
    qsl = torch.tensor([0] + torch.tensor(case.query_lens).cumsum(0).tolist(),
                       dtype=torch.int32)
    slots = []
    for i, (c, q) in enumerate(zip(case.context_lens, case.query_lens)):
        for pos in range(c, c + q):
            blk = int(case.block_table[i, pos // case.block_size])
            slots.append(blk * case.block_size + pos % case.block_size)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    return CommonAttentionMetadata(**_known(CommonAttentionMetadata, dict(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=sl,
        num_reqs=len(seq_lens), num_actual_tokens=int(qsl[-1]),
        max_query_len=max(case.query_lens), max_seq_len=max(seq_lens),
        block_table_tensor=case.block_table, slot_mapping=torch.tensor(slots,
                                                                       dtype=torch.int64),
        seq_lens_cpu_upper_bound=sl.clone())))


def run(case: MLACase, model_dir, *, workspace_rows=None, vllm_cpu_mla: bool = False,
        k_scale: Optional[float] = None, spec_tokens: int = 0):
    """Builder -> ``do_kv_cache_update`` (new tokens) -> decode + prefill, as vLLM calls
    them. Returns ``(out [N, H, v] float16, metadata)``. ``vllm_cpu_mla``: run vLLM's own
    CPU MLA backend (``CPUMLAImpl``, vLLM's builder) on the same inputs instead of ours
    (block size 16 only: its decode kernel's). ``k_scale``: an ``fp8`` cache (vLLM's bytes,
    viewed as e4m3 for the attention calls as vLLM's MLA layer does) of that scale.
    ``spec_tokens``: the decode threshold a speculative config of that many tokens gives a
    builder that takes uniform multi-token decodes (``1 + spec_tokens``, what vLLM's
    ``_init_reorder_batch_threshold`` sets; the case lists its decodes first, as vLLM's
    batch reorder does)."""
    d = case.dims
    h16 = torch.float16
    fp8 = k_scale is not None
    vllm_config = vllm_config_for(model_dir, block_size=case.block_size,
                                  cache_dtype="fp8" if fp8 else "auto")
    w = case.w_kv_b.to(h16)
    with set_current_vllm_config(vllm_config):
        builder_cls, impl_cls = (HygonMLAMetadataBuilder, HygonMLAImpl)
        if vllm_cpu_mla:
            from vllm.model_executor.layers.attention.mla_attention import (
                MLACommonMetadataBuilder)
            from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

            builder_cls, impl_cls = MLACommonMetadataBuilder, CPUMLAImpl
        builder = _builder(case, vllm_config, workspace_rows, builder_cls)
        if spec_tokens:
            builder.reorder_batch_threshold = 1 + spec_tokens
        with host_memory_unpinned():
            md = builder.build(0, common_metadata(case))
        impl = impl_cls(d.heads, d.rank + d.rope, case.scale, 1, None, None,
                        "fp8" if fp8 else "auto", None,
                            "decoder", None, q_lora_rank=None, kv_lora_rank=d.rank,
                            qk_nope_head_dim=d.nope, qk_rope_head_dim=d.rope,
                            qk_head_dim=d.nope + d.rope, v_head_dim=d.v,
                            kv_b_proj=KvBProj(w))
    cache = torch.zeros(case.num_blocks, case.block_size, d.rank + d.rope,
                        dtype=torch.uint8 if fp8 else h16)
    rows = cache.view(torch.float8_e4m3fn) if fp8 else cache  # what attention reads

    def stored(x):  # a row as the cache holds it
        return reference.quantize_fp8(x.float(), torch.float8_e4m3fn, k_scale) if fp8 \
            else x.to(h16)

    # the context rows, as earlier steps wrote them (vLLM's layout: [kv_c | k_pe] a row)
    for i, ctx in enumerate(case.context_lens):
        for pos in range(ctx):
            blk = int(case.block_table[i, pos // case.block_size])
            rows[blk, pos % case.block_size, :d.rank] = stored(case.kv_c[i][pos])
            rows[blk, pos % case.block_size, d.rank:] = stored(case.k_pe[i][pos])
    new_c = torch.cat([c[ctx:] for c, ctx in zip(case.kv_c, case.context_lens)]).to(h16)
    new_pe = torch.cat([p[ctx:] for p, ctx in zip(case.k_pe, case.context_lens)]).to(h16)
    scale_t = torch.tensor([k_scale if fp8 else 1.0], dtype=torch.float32)
    impl.do_kv_cache_update(new_c, new_pe.unsqueeze(1), cache, md.slot_mapping,
                            "fp8" if fp8 else "auto", scale_t if fp8 else None)
    cache = rows
    layer = SimpleNamespace(_k_scale=scale_t)

    q = case.q.to(h16)
    out = torch.full((q.shape[0], d.heads * d.v), float("nan"), dtype=h16)
    nd = md.num_decode_tokens
    if md.num_prefills:
        impl.forward_mha(q[nd:], new_c[nd:], new_pe[nd:].unsqueeze(1), cache, md,
                         scale_t if fp8 else None, output=out[nd:])
    if nd:
        w3 = w.view(d.rank, d.heads, d.nope + d.v)
        w_uk, w_uv = w3[..., :d.nope], w3[..., d.nope:]
        ql_nope = torch.einsum("bhp,rhp->bhr", q[:nd, :, :d.nope], w_uk)
        latent, _ = impl.forward_mqa((ql_nope, q[:nd, :, d.nope:]), cache, md, layer)
        out[:nd] = torch.einsum("bhr,rhv->bhv", latent, w_uv).reshape(nd, -1)
    return out.view(-1, d.heads, d.v), md
