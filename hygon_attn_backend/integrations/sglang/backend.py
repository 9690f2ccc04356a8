"""``HygonAttnBackend``: SGLang's attention-backend interface on our kernels.

SGLang keeps its own memory management untouched: RadixCache decides which prefix a
request reuses, ``ReqToTokenPool`` holds each running request's token locations, the
allocator hands out (pages of) KV slots, and ``MHATokenToKVPool`` stores K and V. Per
forward pass this backend

1. turns the batch's ``req_to_token`` rows into a block table
   (``page_table.req_to_token_table``: token-level for page size 1, one entry per page
   otherwise) in ``init_forward_metadata``;
2. writes the new tokens' K/V with the pool's own ``set_kv_buffer`` (so fp8 scaling,
   HND scatter and layer-wise transfer hooks stay SGLang's);
3. runs prefix prefill for extend / mixed batches (cached prefix read through the block
   table, new tokens from the dense ``k``/``v`` SGLang passes) and paged decode for decode
   batches, reading the pool through strided ``[blocks, H, P, D]`` views (no copy).

CUDA graphs (decode): ``init_cuda_graph_state`` allocates a static block table and
seq-len buffer; ``init_forward_metadata_out_graph`` points the metadata at them;
``init_forward_metadata_in_graph`` refills them from the runner's static
``req_pool_indices`` / ``seq_lens`` with static-shape gathers (recorded into the graph).
Padded graph rows use seq len 1 on row 0 of ``req_to_token`` (SGLang's padding row,
pointing at the padding slot 0).

Start-up: every prefix-prefill kernel specialization the model can reach is compiled
when the backend is built (``warmup.py``), so no extend compiles after serving starts.

Speculative decoding: EAGLE's draft decode steps are ``draft.HygonMultiStepDraftBackend``
(one backend of this class a step); a target-verify batch runs its drafts under the batch's tree mask
(``spec.py``), as a multi-token decode over the pool (the drafts' K/V written first) where
``ops.decode.verify_on_decode`` says so, else as a prefix prefill of the drafts; draft
extend runs as an extend batch.

Decode context parallelism (``--dcp-size`` > 1: each rank holds a shard of every
sequence): ``dcp.DcpGroup`` builds the pass's metadata and runs the layers (masked K/V
write, LSE merge over the group); CUDA graphs and speculative decoding are refused there.

CUDA graphs of verify and draft-extend-v2 batches keep static query offsets, key lengths
and a packed tree-mask buffer beside the decode ones.

Not supported (a clear error, never a wrong answer): dLLM modes, CUDA graphs of other
non-decode batches, cross-attention, different QK and V head dims (MLA models run
``mla.HygonMLABackend``), SWA hybrid pools, quantized (fp4 / custom-method) pools, score
mods.

SGLang versions: 0.5.10 to 0.5.23; the interfaces that differ between them (the KV write
location, the CUDA-graph hooks) go through ``compat.py``.

Environment: ``HYGON_ATTN_IMPL`` = ``auto`` (default) | ``triton`` | ``reference``;
``HYGON_SGLANG_CHECK_PAGES=1`` checks page contiguity of every batch (debugging).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from typing import Optional

import torch

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

from hygon_attn_backend import envs
from hygon_attn_backend.ops._dispatch import select_impl
from hygon_attn_backend.integrations.sglang import warmup
from hygon_attn_backend.ops.decode import (DecodeLayer, DecodePlan, allocate_decode_workspace,
                                           plan_paged_decode, verify_on_decode)
from hygon_attn_backend.ops._device import num_sms_of
from hygon_attn_backend.ops.prefill import PrefillLayer, plan_prefix_prefill
from hygon_attn_backend.ops import tree_mask as tree_pack
from hygon_attn_backend.integrations.sglang import compat, page_table, spec
from hygon_attn_backend.integrations.sglang import dcp as sgl_dcp

logger = logging.getLogger(__name__)



@dataclasses.dataclass
class HygonForwardMetadata:
    """Per-forward metadata, shared by every layer of the pass.

    block_table: ``[B, num_blocks]`` int32 (token locations for P=1, page ids for P>1).
    seq_lens: ``[B]`` int32 key lengths (cached prefix + new tokens).
    cu_seqlens_q: ``[B + 1]`` int32 packed-query offsets (extend / mixed), None for decode.
    max_seq_len: host-side bound of ``seq_lens`` (sizes the decode grid); None: the
    table's capacity.
    graph: True when the static CUDA-graph buffers back this metadata.
    plans: the ops' plans of this pass (``DecodePlan`` / ``PrefillPlan``) by
    ``(Hq, Hkv, D, q dtype, kv dtype)``: built in ``init_forward_metadata`` for the model's
    head layout, and on first use for a layer whose layout differs.
    host_cu_seqlens_q, host_seq_lens: the host copies the prefill plan is built and
    checked from (no device sync).
    tree_mask: ``[B * T, W]`` int32 packed draft visibility of a target-verify batch
    (``spec.packed_tree_mask``), None otherwise (causal).
    """

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: Optional[torch.Tensor] = None
    max_seq_len: Optional[int] = None
    graph: bool = False
    plans: dict = dataclasses.field(default_factory=dict)
    host_cu_seqlens_q: Optional[list] = None
    host_seq_lens: Optional[list] = None
    tree_mask: Optional[torch.Tensor] = None
    #: target verify: drafts a request (0: not a verify batch)
    verify_width: int = 0


def _unsupported_mode(mode) -> Optional[str]:
    if mode.is_dllm_extend():
        return "dLLM extend"
    if mode.is_split_prefill():
        return "split prefill (PD multiplexing)"
    return None


def _verify_width_of(model_runner) -> Optional[int]:
    """Draft tokens per request of this runner's verify batches (its CUDA-graph capture
    width), as SGLang's Triton backend reads it; None when the runner does not say."""
    get = getattr(model_runner, "decode_num_tokens_per_req", None)
    if get is None:
        return None
    try:
        width = int(get())
    except Exception:  # a mock runner, a runner built without speculative config
        return None
    return width if width > 0 else None


def _draft_tokens() -> Optional[int]:
    """SGLang's ``speculative_num_draft_tokens`` (runtime context), None when unset."""
    try:
        from sglang.srt.runtime_context import get_spec

        n = get_spec().speculative_num_draft_tokens
    except Exception:  # no runtime context published, an older SGLang
        return None
    return n if isinstance(n, int) and n > 0 else None


def _attention_tp_size() -> Optional[int]:
    """This rank's attention tensor-parallel size, as SGLang's Triton backend reads it:
    ``runtime_context.get_parallel().attn_tp_size`` (SGLang 0.5.23,
    ``sglang/srt/layers/attention/triton_backend.py``), else the older
    ``dp_attention.get_attention_tp_size()``; None when neither answers."""
    try:
        from sglang.srt.runtime_context import get_parallel

        size = getattr(get_parallel(), "attn_tp_size", None)
        if isinstance(size, int) and size > 0:
            return size
    except Exception:  # nothing published yet (RuntimeError / ValueError), an older SGLang
        pass
    try:
        from sglang.srt.layers.dp_attention import get_attention_tp_size

        return int(get_attention_tp_size())
    except (AssertionError, AttributeError, ImportError, TypeError, ValueError):
        return None


def _attention_dcp_size() -> int:
    """This rank's decode-context-parallel width, ``get_parallel().attn_dcp_size`` (SGLang
    0.5.23's ``--dcp-size``); 1 where SGLang has none or has not published it."""
    try:
        from sglang.srt.runtime_context import get_parallel

        size = getattr(get_parallel(), "attn_dcp_size", 1)
    except Exception:  # nothing published yet (RuntimeError / ValueError), an older SGLang
        return 1
    return size if isinstance(size, int) and size > 0 else 1


def _model_heads(model_runner):
    """``(Hq, Hkv, D, dtype)`` of the model's attention layers on this attention-TP rank, read
    as SGLang's own Triton backend reads them, or None when the runner does not say (the
    plans are then built by the first layer of each pass)."""
    mc = getattr(model_runner, "model_config", None)
    dtype = getattr(model_runner, "dtype", None)
    tp = _attention_tp_size()
    if mc is None or dtype is None or tp is None:
        return None
    dcp = _attention_dcp_size()  # DCP ranks replicate the group's KV heads
    try:
        kv = mc.get_num_kv_heads(tp) if dcp == 1 else mc.get_num_kv_heads(tp, dcp)
        return (mc.num_attention_heads // tp, kv, mc.head_dim, dtype)
    except (AttributeError, TypeError, ZeroDivisionError):
        return None


@dataclasses.dataclass
class _LayerState:
    """One ``RadixAttention`` layer as the kernels see it, checked once."""

    layer: object
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    causal: bool
    sliding_window: Optional[int]
    soft_cap: Optional[float]
    k_scale: Optional[float]
    v_scale: Optional[float]
    k_view: torch.Tensor
    v_view: torch.Tensor
    _decode: Optional[DecodeLayer] = dataclasses.field(default=None, repr=False)
    _prefill: Optional[PrefillLayer] = dataclasses.field(default=None, repr=False)

    def decode_layer(self, sinks) -> DecodeLayer:
        """This layer's side of a decode launch, built on first use and kept across steps
        (``sinks``: SGLang passes the layer's parameter, the same tensor on every call)."""
        d = self._decode
        if d is None or d.sinks is not sinks:
            d = self._decode = DecodeLayer(
                self.k_view, self.v_view, scale=self.scale, k_scale=self.k_scale,
                v_scale=self.v_scale, sliding_window=self.sliding_window,
                soft_cap=self.soft_cap, sinks=sinks)
        return d

    def prefill_layer(self, sinks) -> PrefillLayer:
        """This layer's side of a prefix-prefill launch, as :meth:`decode_layer`."""
        p = self._prefill
        if p is None or p.sinks is not sinks:
            p = self._prefill = PrefillLayer(
                self.k_view, self.v_view, scale=self.scale, causal=self.causal,
                k_scale=self.k_scale, v_scale=self.v_scale,
                sliding_window=self.sliding_window, soft_cap=self.soft_cap, sinks=sinks)
        return p

    @classmethod
    def build(cls, layer, pool) -> "_LayerState":
        if layer.is_cross_attention:
            raise NotImplementedError("hygon attention backend: cross-attention is not supported")
        if layer.qk_head_dim != layer.v_head_dim:
            raise NotImplementedError(f"hygon attention backend: qk_head_dim {layer.qk_head_dim} "
                                      f"!= v_head_dim {layer.v_head_dim} is not supported")
        soft_cap = None
        if layer.logit_cap is not None and layer.logit_cap > 0:
            if layer.logit_capping_method != "tanh":
                raise NotImplementedError(f"hygon attention backend: logit capping method "
                                          f"{layer.logit_capping_method!r} (only 'tanh')")
            soft_cap = float(layer.logit_cap)
        window = None
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            # SGLang's window W lets query position i see keys i - W .. i: W + 1 keys.
            window = int(layer.sliding_window_size) + 1
        k_scale = v_scale = None
        if layer.k_scale is not None:
            k_scale, v_scale = float(layer.k_scale_float), float(layer.v_scale_float)
        k_view, v_view, _ = page_table.pool_kv_views(pool, layer.layer_id)
        return cls(layer=layer, num_heads=layer.tp_q_head_num, num_kv_heads=layer.tp_k_head_num,
                   head_dim=layer.qk_head_dim, scale=float(layer.scaling),
                   causal=layer.attn_type != AttentionType.ENCODER_ONLY,
                   sliding_window=window, soft_cap=soft_cap, k_scale=k_scale, v_scale=v_scale,
                   k_view=k_view, v_view=v_view)


class HygonAttnBackend(*compat.backend_bases(AttentionBackend)):
    """Attention backend ``hygon`` for dense MHA/GQA/MQA models."""

    def __init__(self, model_runner, *, draft_rows_per_request: Optional[int] = None):
        """draft_rows_per_request: set for one step of the multi-step draft decode
        (``draft.HygonMultiStepDraftBackend``): its decode batches hold that many rows a
        request (EAGLE's ``topk`` branches), and it serves no prefill (no warm-up)."""
        super().__init__()
        self._rows_per_request = draft_rows_per_request or 1
        self.device = torch.device(model_runner.device)
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        pool = self.token_to_kv_pool
        if isinstance(pool, SWAKVPool):
            raise NotImplementedError("hygon attention backend: hybrid sliding-window KV pools "
                                      "are not supported; use a model without SWA layers")
        layout = getattr(pool, "kv_cache_layout", "nhd")
        if layout not in ("nhd", "hnd"):
            raise NotImplementedError(f"hygon attention backend: KV pool layout {layout!r} is not "
                                      "supported (supported: 'nhd', 'hnd')")
        if getattr(pool, "is_quantized_kv_cache", False):
            raise NotImplementedError("hygon attention backend: quantized KV-cache methods are not "
                                      "supported (fp8 KV via --kv-cache-dtype is)")
        dcp_size = _attention_dcp_size()  # --dcp-size: each rank holds a shard (dcp.py)
        self._dcp = None if dcp_size == 1 else sgl_dcp.DcpGroup.from_runtime(
            model_runner, pool, world_size=dcp_size, draft=draft_rows_per_request is not None)
        self.page_size = int(getattr(pool, "page_size", 1) or 1)
        self.max_blocks = -(-self.req_to_token.shape[1] // self.page_size)
        self.impl = envs.impl()
        self._triton_here = select_impl(self.impl, self.device) == "triton"
        self.check_pages = envs.debug()
        self.kv_dtype = pool.dtype  # fp8 pools: the float8 format (stored as bytes)
        self._model_heads = _model_heads(model_runner)
        self._verify_width = _verify_width_of(model_runner)
        self._layers: dict = {}
        self._warned: set = set()
        self.forward_metadata: Optional[HygonForwardMetadata] = None
        self._graph_block_table: Optional[torch.Tensor] = None
        self._graph_seq_lens: Optional[torch.Tensor] = None
        self._graph_max_bs = 0
        self._graph_meta: dict = {}  # batch size -> metadata over the static graph buffers
        self._graph_spec: dict = {}  # tokens a request -> static verify / draft-extend buffers
        # split-KV decode scratch per (Hq, Hkv, D), eager and graph alike: allocated by the
        # first pass (the warm-up that precedes capture), so captured launches allocate
        # nothing
        self._decode_workspaces: dict = {}
        heads = self._model_heads
        logger.info("hygon attention backend: page_size=%d layout=%s impl=%s heads a rank: %s "
                    "(%s)", self.page_size, layout, self.impl,
                    f"{heads[0]} q / {heads[1]} kv" if heads else "from the first layer",
                    "Triton kernels, native where impl=auto's rule takes it"
                    if self._triton_here else "torch reference")
        if self._triton_here and self.device.type == "cuda" and draft_rows_per_request is None:
            self._warm_up_prefill(getattr(model_runner, "model", None),
                                  getattr(model_runner, "dtype", None))

    def _warm_up_prefill(self, model, dtype) -> None:
        """Compile every prefill specialization this model can reach, at start-up
        (``warmup.py``); the model's attention layers give heads and per-layer options,
        ``dtype`` the queries' dtype."""
        if model is None or dtype not in (torch.float16, torch.bfloat16):
            return
        states = []
        for module in model.modules():
            if isinstance(module, RadixAttention):
                try:
                    states.append(self._layer(module, None))
                except NotImplementedError:  # refused at its first forward, as before
                    continue
        warmup.warm_up_prefill(states, q_dtype=dtype, page_size=self.page_size,
                               max_blocks=self.max_blocks, device=self.device,
                               num_sms=num_sms_of(self.device), impl=self.impl)

    # ------------------------------------------------------------------ metadata

    @staticmethod
    def _host_seq_lens(forward_batch) -> Optional[list]:
        """The batch's key lengths from SGLang's host copy (no device sync), or None when
        the batch carries none."""
        lens_cpu = getattr(forward_batch, "seq_lens_cpu", None)
        if lens_cpu is None:
            return None
        return [int(x) for x in lens_cpu[: forward_batch.batch_size].tolist()]

    def init_forward_metadata(self, forward_batch):
        """Once per forward pass: block table, seq lens, (extend) packed-query offsets, and
        the plans every layer launches from."""
        mode = forward_batch.forward_mode
        reason = _unsupported_mode(mode)
        if reason is not None:
            raise NotImplementedError(f"hygon attention backend: {reason} is not supported")
        if self._dcp is not None:
            self.forward_metadata = self._dcp.init_forward_metadata(self, forward_batch)
            return
        if mode.is_target_verify():
            return self._init_verify_metadata(forward_batch)
        bs = forward_batch.batch_size
        rows = forward_batch.req_pool_indices[:bs]
        seq_lens = forward_batch.seq_lens[:bs].to(torch.int32)
        host_lens = self._host_seq_lens(forward_batch)
        max_seq_len = max(host_lens) if host_lens else None
        num_blocks = self.max_blocks
        if max_seq_len is not None:  # width rounded up: few Triton specializations
            num_blocks = warmup.aligned_table_width(-(-max_seq_len // self.page_size),
                                                    self.max_blocks)
        block_table = page_table.req_to_token_table(self.req_to_token, rows,
                                               page_size=self.page_size, num_blocks=num_blocks)
        if self.check_pages and self.page_size > 1:
            page_table.check_paged_rows(self.req_to_token, rows, seq_lens, page_size=self.page_size)
        meta = HygonForwardMetadata(block_table=block_table, seq_lens=seq_lens,
                                    max_seq_len=max_seq_len, host_seq_lens=host_lens)
        if not mode.is_decode_or_idle():
            if forward_batch.extend_seq_lens is None:
                raise NotImplementedError(f"hygon attention backend: a {mode.name} batch "
                                          "without extend_seq_lens is not supported")
            extend_lens = forward_batch.extend_seq_lens[:bs]
            meta.cu_seqlens_q = torch.zeros(bs + 1, dtype=torch.int32, device=seq_lens.device)
            meta.cu_seqlens_q[1:] = torch.cumsum(extend_lens, 0)
            ext_cpu = getattr(forward_batch, "extend_seq_lens_cpu", None)
            if ext_cpu is not None:
                meta.host_cu_seqlens_q = [0] + list(itertools.accumulate(
                    int(n) for n in list(ext_cpu)[:bs]))
        self.forward_metadata = meta
        if self._model_heads is not None:
            self._plan(meta, *self._model_heads, extend=not mode.is_decode_or_idle())

    def _init_verify_metadata(self, forward_batch):
        """A target-verify batch: ``T`` drafts per request over the request's cached prefix
        (``forward_batch.seq_lens``), under the batch's tree mask (``spec.packed_tree_mask``;
        none given: the causal chain); :meth:`_plan` runs them as a multi-token decode or a
        prefix prefill (``verify_on_decode``)."""
        info = forward_batch.spec_info
        if getattr(info, "ragged_verify_layout", None) is not None:
            raise NotImplementedError("hygon attention backend: ragged verify layouts "
                                      "(a draft width per request) are not supported")
        width = spec.verify_width(info, self._verify_width)
        bs = len(forward_batch.req_pool_indices)
        rows = forward_batch.req_pool_indices[:bs]
        prefix = forward_batch.seq_lens[:bs].to(torch.int32)
        host_prefix = self._host_seq_lens(forward_batch)
        num_blocks = self.max_blocks
        if host_prefix:  # the drafts' slots too (a layer may pass k=None: all from the pool)
            num_blocks = warmup.aligned_table_width(
                -(-(max(host_prefix) + width) // self.page_size), self.max_blocks)
        block_table = page_table.req_to_token_table(self.req_to_token, rows,
                                                    page_size=self.page_size,
                                                    num_blocks=num_blocks)
        meta = HygonForwardMetadata(block_table=block_table, seq_lens=prefix + width,
                                    host_seq_lens=None if host_prefix is None
                                    else [n + width for n in host_prefix],
                                    max_seq_len=None if not host_prefix
                                    else max(host_prefix) + width, verify_width=width)
        meta.cu_seqlens_q = torch.arange(0, (bs + 1) * width, width, dtype=torch.int32,
                                         device=prefix.device)
        meta.host_cu_seqlens_q = list(range(0, (bs + 1) * width, width))
        mask = getattr(info, "custom_mask", None)
        if mask is not None:
            if host_prefix is not None:
                need = sum(width * (n + width) for n in host_prefix)
                if mask.numel() < need:
                    raise ValueError(f"hygon attention backend: spec_info.custom_mask holds "
                                     f"{mask.numel()} entries, this verify batch needs {need} "
                                     f"(T={width} drafts over prefixes {host_prefix})")
            meta.tree_mask = spec.packed_tree_mask(mask, prefix, width)
        self.forward_metadata = meta
        if self._model_heads is not None:
            self._plan(meta, *self._model_heads, extend=True)

    def _plan(self, meta, num_q_heads, num_kv_heads, head_dim, q_dtype, *, extend):
        """The plan of ``meta`` for one head layout (built once per forward pass)."""
        key = (num_q_heads, num_kv_heads, head_dim, q_dtype)
        plan = meta.plans.get(key)
        if plan is not None:
            return plan
        if meta.verify_width and verify_on_decode(num_tokens=meta.verify_width,
                                                  group=num_q_heads // num_kv_heads):
            # the drafts as a multi-token decode over the pool (written before the call)
            plan = plan_paged_decode(
                meta.block_table, meta.seq_lens, num_q_heads=num_q_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=self.page_size,
                q_dtype=q_dtype, kv_dtype=self.kv_dtype, num_tokens=meta.verify_width,
                max_seq_len=None if meta.graph else meta.max_seq_len,
                workspace=self._decode_workspace(num_q_heads, num_kv_heads, head_dim, q_dtype,
                                                 num_tokens=meta.verify_width),
                tree_mask=meta.tree_mask, impl=self.impl)
        elif extend:
            total_q = meta.host_cu_seqlens_q[-1] if meta.host_cu_seqlens_q is not None \
                else None
            if total_q is None:
                raise ValueError("hygon attention backend: an extend batch needs "
                                 "extend_seq_lens_cpu (the host copy of the extend lengths)")
            plan = plan_prefix_prefill(
                meta.cu_seqlens_q, meta.seq_lens, total_q=total_q, num_q_heads=num_q_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim,
                host_cu_seqlens_q=meta.host_cu_seqlens_q, host_seq_lens_k=meta.host_seq_lens,
                capacity=meta.block_table.shape[1] * self.page_size, q_dtype=q_dtype,
                kv_dtype=self.kv_dtype, tree_mask=meta.tree_mask, impl=self.impl,
                page_size=self.page_size, max_blocks=meta.block_table.shape[1],
                has_k_new=True)  # the layers pass the new tokens' K/V
        else:
            plan = plan_paged_decode(
                meta.block_table, meta.seq_lens, num_q_heads=num_q_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=self.page_size,
                q_dtype=q_dtype, kv_dtype=self.kv_dtype,
                max_seq_len=None if meta.graph else meta.max_seq_len,
                workspace=self._decode_workspace(num_q_heads, num_kv_heads, head_dim,
                                                 q_dtype),
                impl=self.impl)
        if plan.impl == "reference" and self._triton_here and q_dtype not in (
                torch.float16, torch.bfloat16) and q_dtype not in self._warned:
            self._warned.add(q_dtype)
            logger.warning("hygon: %s queries run on the torch reference (the Triton kernels "
                           "take fp16/bf16)", q_dtype)
        meta.plans[key] = plan
        return plan

    def _decode_workspace(self, num_q_heads: int, num_kv_heads: int, head_dim: int, q_dtype,
                          num_tokens: int = 1):
        """Split-KV scratch for every batch size this backend serves (eager and graph) and
        the full context, per head layout and query tokens a request (verify: the drafts);
        allocated once, never inside a capture."""
        if not self._triton_here or q_dtype not in (torch.float16, torch.bfloat16):
            return None
        key = (num_q_heads, num_kv_heads, head_dim, num_tokens)
        if key not in self._decode_workspaces:
            self._decode_workspaces[key] = allocate_decode_workspace(
                max_num_seqs=max(1, self._graph_max_bs, self.req_to_token.shape[0])
                * self._rows_per_request,
                num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                max_context_len=self.max_blocks * self.page_size, device=self.device,
                num_tokens=num_tokens)
        return self._decode_workspaces[key]

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, **kwargs):
        """Static buffers the captured decode graphs read: ``[max_bs, max_blocks]`` block
        table and ``[max_bs]`` seq lens (filled with 1, the padding length)."""
        del max_num_tokens, kwargs
        if self._dcp is not None:
            self._dcp.refuse_cuda_graphs()
        self._graph_max_bs = max_bs
        self._decode_workspaces = {}  # sized for max_bs: rebuilt on (re)capture
        self._graph_meta = {}
        self._graph_block_table = torch.zeros((max_bs, self.max_blocks), dtype=torch.int32,
                                              device=self.device)
        self._graph_seq_lens = torch.ones((max_bs,), dtype=torch.int32, device=self.device)
        self._graph_spec = {}  # tokens a request -> static buffers (_spec_buffers)

    def _spec_buffers(self, width: int) -> dict:
        """Static buffers of verify and draft-extend-v2 graphs with ``width`` tokens a
        request: ``cu`` ``[max_bs + 1]`` int32 query offsets (fixed), ``lens`` ``[max_bs]``
        int32 key lengths (prefix + new tokens), ``tree`` ``[max_bs * width, W]`` int32
        packed mask, and ``chain`` (the causal chain's packed rows, ``tree``'s shape, for a
        verify batch without a custom mask)."""
        bufs = self._graph_spec.get(width)
        if bufs is None:
            max_bs = self._graph_max_bs
            chain = tree_pack.pack_tree_mask(torch.tril(torch.ones(
                (width, width), dtype=torch.bool, device=self.device))).repeat(max_bs, 1)
            bufs = self._graph_spec[width] = dict(
                cu=torch.arange(0, (max_bs + 1) * width, width, dtype=torch.int32,
                                device=self.device),
                lens=torch.ones((max_bs,), dtype=torch.int32, device=self.device),
                tree=chain.clone(), chain=chain)
        return bufs

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """Point the metadata at the static graph buffers (capture and replay alike)."""
        del in_capture
        mode = forward_batch.forward_mode
        if mode.is_target_verify() or mode.is_draft_extend_v2():
            return self._spec_out_graph(forward_batch)
        if not mode.is_decode_or_idle():
            raise NotImplementedError(f"hygon attention backend: CUDA graphs are supported for "
                                      f"decode only, got {mode.name}")
        if self._graph_block_table is None:
            raise RuntimeError("init_cuda_graph_state must run before graph metadata")
        bs = forward_batch.batch_size
        # Everything here depends on the batch size only (static buffer slices, plans
        # for the capacity): built at capture, reused at every replay, where the graph
        # replays the captured launches and this metadata only serves an eager fallback.
        # Rebuilt per step it cost ~100 us of host time.
        meta = self._graph_meta.get(bs)
        if meta is None:
            meta = HygonForwardMetadata(block_table=self._graph_block_table[:bs],
                                        seq_lens=self._graph_seq_lens[:bs], graph=True)
            self._graph_meta[bs] = meta
        self.forward_metadata = meta
        if self._model_heads is not None:
            self._plan(meta, *self._model_heads, extend=False)  # cached in meta.plans

    def _graph_width(self, forward_batch) -> int:
        """Tokens a request of a verify / draft-extend-v2 graph batch: the batch's uniform
        width, else the runner's (verify) or the speculative config's draft tokens (draft
        extend v2, as SGLang's Triton backend sizes it)."""
        info = forward_batch.spec_info
        if forward_batch.forward_mode.is_target_verify():
            return spec.verify_width(info, self._verify_width)
        return spec.verify_width(info, _draft_tokens() or self._verify_width)

    def _spec_out_graph(self, forward_batch):
        """Verify and draft-extend-v2 graphs: the metadata over the static buffers (built
        at capture, reused by every replay of the batch size). A verify batch's tree mask
        is packed into the static mask buffer here, outside the graph, at capture and at
        every replay (its source changes size with the prefixes; padded rows may read stale
        bits, their output is discarded); draft extend is the causal chain."""
        bs = forward_batch.batch_size
        info = forward_batch.spec_info
        verify = forward_batch.forward_mode.is_target_verify()
        width = self._graph_width(forward_batch)
        bufs = self._spec_buffers(width)
        key = ("verify" if verify else "draft_extend", bs, width)
        meta = self._graph_meta.get(key)
        if meta is None:
            meta = HygonForwardMetadata(
                block_table=self._graph_block_table[:bs], seq_lens=bufs["lens"][:bs],
                cu_seqlens_q=bufs["cu"][:bs + 1], graph=True,
                host_cu_seqlens_q=list(range(0, (bs + 1) * width, width)),
                tree_mask=bufs["tree"][:bs * width] if verify else None,
                verify_width=width if verify else 0)
            self._graph_meta[key] = meta
        if verify:
            mask = getattr(info, "custom_mask", None) if info is not None else None
            if mask is None:
                meta.tree_mask.copy_(bufs["chain"][:bs * width])
            else:
                spec.packed_tree_mask(mask, forward_batch.seq_lens[:bs], width,
                                      out=meta.tree_mask)
        self.forward_metadata = meta
        if self._model_heads is not None:
            self._plan(meta, *self._model_heads, extend=True)  # cached in meta.plans

    def init_forward_metadata_in_graph(self, forward_batch):
        """Refill the static buffers from the batch (static shapes, no host sync)."""
        bs = forward_batch.batch_size
        page_table.req_to_token_table(self.req_to_token, forward_batch.req_pool_indices[:bs],
                                 page_size=self.page_size, out=self._graph_block_table[:bs])
        mode = forward_batch.forward_mode
        if mode.is_target_verify() or mode.is_draft_extend_v2():
            width = self._graph_width(forward_batch)
            lens = self._spec_buffers(width)["lens"][:bs]
            lens.copy_(forward_batch.seq_lens[:bs])
            if mode.is_draft_extend_v2():  # seq_lens count the extend: keep the prefix
                ext = getattr(forward_batch.spec_info, "extend_seq_lens_tensor", None)
                if ext is not None:
                    lens.sub_(ext[:bs].to(lens.dtype))
                lens.clamp_(min=0)
            lens.add_(width)  # keys: the prefix and the request's new tokens
            return
        self._graph_seq_lens[:bs].copy_(forward_batch.seq_lens[:bs])

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    # ------------------------------------------------------------------ forward

    def _layer(self, layer, kwargs) -> _LayerState:
        """The layer's checked options and cache views (built on its first call)."""
        unknown = [k for k, v in kwargs.items() if v is not None] if kwargs else ()
        if unknown:
            raise NotImplementedError(f"hygon attention backend: unsupported options "
                                      f"{sorted(unknown)}")
        state = self._layers.get(layer.layer_id)
        if state is None or state.layer is not layer:
            state = self._layers[layer.layer_id] = _LayerState.build(
                layer, self.token_to_kv_pool)
        return state

    def _save_kv(self, layer, forward_batch, k, v):
        loc = compat.write_loc(forward_batch, layer)
        if layer.k_scale is None:
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k, v)
        else:
            # set_kv_buffer divides by the scales in place: keep the caller's k/v intact.
            self.token_to_kv_pool.set_kv_buffer(layer, loc, k.clone(), v.clone(),
                                                layer.k_scale, layer.v_scale)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       sinks=None, **kwargs):
        """Prefix prefill of an extend / mixed batch.

        q: ``[num_tokens, Hq * D]`` (or ``[num_tokens, Hq, D]``); k, v: ``[num_tokens, Hkv, D]``
        new tokens (None: already in the pool at ``out_cache_loc``).
        Returns ``[num_tokens, Hq * D]`` in q's dtype.
        """
        if self._dcp is not None:
            return self._dcp.forward(self, q, k, v, layer, forward_batch, sinks=sinks,
                                     save_kv_cache=save_kv_cache, kwargs=kwargs, decode=False)
        st = self._layer(layer, kwargs)
        if (k is None) != (v is None):
            raise ValueError("k and v must both be tensors or both be None")
        if k is not None and save_kv_cache:
            self._save_kv(layer, forward_batch, k, v)
        meta = self.forward_metadata
        q3 = q.reshape(-1, st.num_heads, st.head_dim)
        out = q.new_empty((q3.shape[0], st.num_heads * st.head_dim))
        plan = self._plan(meta, st.num_heads, st.num_kv_heads, st.head_dim, q.dtype,
                          extend=True)
        if isinstance(plan, DecodePlan):  # a verify batch on the decode structure
            width = meta.verify_width
            plan.run_layer(st.decode_layer(sinks),
                           q3.reshape(-1, width, st.num_heads, st.head_dim),
                           out.view(-1, width, st.num_heads, st.head_dim))
            return out
        k_new = v_new = None
        if k is not None:  # SGLang passes [tokens, Hkv, D]; a flat [tokens, Hkv * D] too
            k_new = k if k.dim() == 3 else k.view(-1, st.num_kv_heads, st.head_dim)
            v_new = v if v.dim() == 3 else v.view(-1, st.num_kv_heads, st.head_dim)
        plan.run_layer(st.prefill_layer(sinks), q3, meta.block_table, meta.cu_seqlens_q,
                       meta.seq_lens, k_new=k_new, v_new=v_new,
                       out=out.view(-1, st.num_heads, st.head_dim))
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       sinks=None, **kwargs):
        """Paged decode: one query token per request.

        q: ``[bs, Hq * D]``; k, v: ``[bs, Hkv, D]`` the new token's K/V (written first).
        Returns ``[bs, Hq * D]`` in q's dtype.
        """
        if self._dcp is not None:
            return self._dcp.forward(self, q, k, v, layer, forward_batch, sinks=sinks,
                                     save_kv_cache=save_kv_cache, kwargs=kwargs, decode=True)
        st = self._layer(layer, kwargs)
        if k is not None and v is not None and save_kv_cache:
            self._save_kv(layer, forward_batch, k, v)
        meta = self.forward_metadata
        q3 = q.reshape(-1, st.num_heads, st.head_dim)
        out = q.new_empty((q3.shape[0], st.num_heads * st.head_dim))
        plan = self._plan(meta, st.num_heads, st.num_kv_heads, st.head_dim, q.dtype,
                          extend=False)
        plan.run_layer(st.decode_layer(sinks), q3, out.view(-1, st.num_heads, st.head_dim))
        return out
