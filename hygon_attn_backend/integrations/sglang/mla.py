"""``HygonMLABackend``: ``--attention-backend hygon`` for MLA models (DeepSeek V2/V3,
Kimi K2 and other ``AttentionArch.MLA`` models) on SGLang's ``MLATokenToKVPool``.

The pool stores one latent row a token and layer, ``kv_buffer[layer]`` ``[slots, 1, W]``
with ``W = kv_lora_rank + qk_rope_head_dim`` (576 = 512 + 64 for DeepSeek V3):
``get_key_buffer`` is the whole row (the key), ``get_value_buffer`` a view of its first
``kv_lora_rank`` columns (the value). Slot ``s`` of page ``p`` is row ``p * P + s``, so
``kv_buffer[layer][:rows].view(-1, P, W)`` is the ``[num_blocks, P, W]`` cache the MLA ops
read with the block table the dense backend already builds (token locations for ``P = 1``,
page ids otherwise).

SGLang's DeepSeek attention picks a forward method per batch; for a backend it does not
know (``hygon``) it takes the Triton backend's handler:

* decode, target verify, draft extend, and an extend with a cached (radix) prefix:
  ``AttnForwardMethod.MLA`` (absorbed). The ``attn_mqa`` layer (``Hq`` heads, one KV
  head, ``qk_head_dim = W``, ``v_head_dim = kv_lora_rank``) gets ``q [N, Hq * W]``,
  ``k [N, 1, W]`` (the new rows), ``v [N, 1, kv_lora_rank]``. The rows are written with
  the pool's ``set_kv_buffer``, then ``ops.mla`` (decode: ``plan_mla_decode``; verify:
  the same plan with ``num_tokens = T``, under the batch's packed tree mask when SGLang
  gives one, an EAGLE tree of ``topk > 1`` included) or ``ops.mla_prefill``
  (``plan_mla_extend``: every key from the pool, shifted causal; draft extend and causal
  verify chains of more than 4 drafts) runs over the pool.
  ``k = v = None`` means the rows are already in the pool.
* an extend with no cached prefix: ``AttnForwardMethod.MHA``. The ``attn_mha`` layer
  (``Hq == Hkv``, q/k ``qk_nope + rope`` (192), v ``v_head_dim`` (128), up-projected by
  the model, which writes the latent rows itself: ``save_kv_cache=False``) runs
  ``ops.mla_prefill.ragged_attention`` over the new tokens, causal.

Both layers of one model share a ``layer_id``; their state is kept apart.

Metadata, CUDA graphs (decode, verify and draft-extend-v2 graphs) and the speculative
batches' static buffers are the dense backend's (``backend.py``): the same block table,
lengths, query offsets and packed tree mask; only the plans differ.

fp8 latent pools (``--kv-cache-dtype fp8_e4m3`` / ``fp8_e5m2``): SGLang's MLA pool casts
each row to the format without a scale (``MLATokenToKVPool.set_kv_buffer``), so the
kernels read the codes with scale 1.

Not supported (a clear error): a layer with a KV scale (``k_scale``: the MLA pool writes
unscaled), DSA (sparse) pools, sliding windows, logit capping, cross-attention, an
MHA-method extend over a cached prefix (SGLang's chunked-prefix paths). The multi-step
draft decode of an MLA draft model takes one of these a step (``draft.py``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

from hygon_attn_backend.integrations.sglang import compat
from hygon_attn_backend.integrations.sglang.backend import HygonAttnBackend, _attention_tp_size
from hygon_attn_backend.ops.mla import (MLADecodePlan, allocate_mla_decode_workspace,
                                        plan_mla_decode)
from hygon_attn_backend.ops.mla_prefill import (plan_mla_extend, plan_ragged_attention,
                                                ragged_attention)

logger = logging.getLogger(__name__)

__all__ = ["HygonMLABackend", "is_mla_runner"]

#: query tokens a request the MLA decode kernel serves for a verify batch without a custom
#: mask (causal chains up to this length run on it; longer ones as an extend; a batch with
#: a mask runs on it at any width)
MLA_DECODE_MAX_TOKENS = 4


def is_mla_runner(model_runner) -> bool:
    """Whether SGLang serves this runner's model with an MLA latent pool
    (``model_runner.use_mla_backend``, set for ``AttentionArch.MLA`` models)."""
    return bool(getattr(model_runner, "use_mla_backend", False))


@dataclasses.dataclass
class _MLALayer:
    """One ``RadixAttention`` layer of an MLA model, checked once.

    absorbed: the ``attn_mqa`` layer (one KV head over the latent pool, ``qk_dim = W``,
    ``v_dim = kv_lora_rank``); else the ``attn_mha`` layer of the MHA extend.
    """

    layer: object
    absorbed: bool
    num_heads: int
    num_kv_heads: int
    qk_dim: int
    v_dim: int
    scale: float

    @classmethod
    def build(cls, layer, *, kv_lora_rank: int, latent_dim: int) -> "_MLALayer":
        def refuse(what):
            raise NotImplementedError(f"hygon attention backend: MLA layer {layer.layer_id}: "
                                      f"{what} is not supported")

        if layer.is_cross_attention:
            refuse("cross-attention")
        if layer.logit_cap is not None and layer.logit_cap > 0:
            refuse("logit capping")
        if layer.sliding_window_size is not None and layer.sliding_window_size > -1:
            refuse("a sliding window")
        if layer.k_scale is not None:
            refuse("a KV scale (k_scale; SGLang's MLA pool writes fp8 rows unscaled)")
        absorbed = (layer.tp_k_head_num == 1 and layer.qk_head_dim == latent_dim
                    and layer.v_head_dim == kv_lora_rank)
        return cls(layer=layer, absorbed=absorbed, num_heads=layer.tp_q_head_num,
                   num_kv_heads=layer.tp_k_head_num, qk_dim=layer.qk_head_dim,
                   v_dim=layer.v_head_dim, scale=float(layer.scaling))


class HygonMLABackend(HygonAttnBackend):
    """Attention backend ``hygon`` for MLA models (the dense backend's metadata and
    CUDA-graph buffers, MLA plans and forwards)."""

    def __init__(self, model_runner, *, draft_rows_per_request: Optional[int] = None):
        """draft_rows_per_request: one step of the multi-step draft decode (the dense
        backend's argument, ``draft.HygonMultiStepDraftBackend``)."""
        pool = model_runner.token_to_kv_pool
        rank = getattr(pool, "kv_lora_rank", None)
        rope = getattr(pool, "qk_rope_head_dim", None)
        if not isinstance(rank, int) or not isinstance(rope, int):
            raise NotImplementedError(f"hygon attention backend: an MLA model needs SGLang's "
                                      f"MLATokenToKVPool, got {type(pool).__name__}")
        if getattr(pool, "use_dsa", False):
            raise NotImplementedError("hygon attention backend: DSA (sparse MLA) pools are "
                                      "not supported")
        if getattr(pool, "kv_cache_dim", rank + rope) != rank + rope:
            raise NotImplementedError(f"hygon attention backend: MLA pool rows of "
                                      f"{pool.kv_cache_dim} columns (expected kv_lora_rank "
                                      f"{rank} + rope {rope})")
        super().__init__(model_runner, draft_rows_per_request=draft_rows_per_request)
        self.kv_lora_rank = rank
        self.rope_dim = rope
        self.latent_dim = rank + rope
        self._mla_layers: dict = {}
        #: the absorbed layers' softmax scale, once a layer has run (plans are then built
        #: in init_forward_metadata, before the layers; until then by the first layer)
        self._scale: Optional[float] = None
        self._model_heads = self._mla_heads(model_runner)
        logger.info("hygon attention backend: MLA latent pool %d + %d, %s, page_size=%d",
                    rank, rope, pool.dtype, self.page_size)

    def _mla_heads(self, model_runner):
        """``(Hq, 1, W, dtype)`` of the absorbed layers on this attention-TP rank, or None
        when the runner does not say."""
        mc = getattr(model_runner, "model_config", None)
        dtype = getattr(model_runner, "dtype", None)
        tp = _attention_tp_size()
        heads = getattr(mc, "num_attention_heads", None)
        if not isinstance(heads, int) or dtype is None or tp is None or heads % tp:
            return None
        return (heads // tp, 1, self.latent_dim, dtype)

    def _warm_up_prefill(self, model, dtype) -> None:
        """No start-up compilation for MLA: its kernels compile on the first batch of each
        shape (SGLang's own warm-up and graph capture run those)."""
        del model, dtype

    # ------------------------------------------------------------------ metadata

    def _plan(self, meta, num_q_heads, num_kv_heads, head_dim, q_dtype, *, extend):
        """The base class's planning hook (``init_forward_metadata`` and the graph
        hooks): the absorbed plan, once the layers' scale is known."""
        del num_kv_heads
        if self._scale is None or head_dim != self.latent_dim:
            return None
        return self._mla_plan(meta, num_q_heads, q_dtype, self._scale, extend=extend)

    def _mla_plan(self, meta, num_q_heads: int, q_dtype, scale: float, *, extend: bool):
        """The absorbed plan of ``meta`` (built once a pass): a decode plan for decode, for
        a verify batch under a tree mask (any width: the extend kernel takes no mask) and
        for causal verify chains of up to ``MLA_DECODE_MAX_TOKENS``, else an extend plan."""
        width = meta.verify_width
        tree = meta.tree_mask if width else None
        on_decode = not extend or tree is not None or 0 < width <= MLA_DECODE_MAX_TOKENS
        key = ("mla", num_q_heads, q_dtype, scale, on_decode)  # the mask is the meta's
        plan = meta.plans.get(key)
        if plan is not None:
            return plan
        if on_decode:
            tokens = width or 1
            plan = plan_mla_decode(
                block_table=meta.block_table, seq_lens=meta.seq_lens,
                page_size=self.page_size, num_q_heads=num_q_heads,
                kv_lora_rank=self.kv_lora_rank, rope_dim=self.rope_dim, q_dtype=q_dtype,
                kv_dtype=self.kv_dtype, num_tokens=tokens, scale=scale,
                max_seq_len=None if meta.graph else meta.max_seq_len,
                workspace=self._mla_workspace(num_q_heads, q_dtype, tokens), tree_mask=tree,
                impl=self.impl)
        else:
            if meta.host_cu_seqlens_q is None:
                raise ValueError("hygon attention backend: an extend batch needs "
                                 "extend_seq_lens_cpu (the host copy of the extend lengths)")
            plan = plan_mla_extend(
                meta.cu_seqlens_q, meta.seq_lens, total_q=meta.host_cu_seqlens_q[-1],
                num_q_heads=num_q_heads, head_dim=self.latent_dim,
                v_head_dim=self.kv_lora_rank, page_size=self.page_size,
                host_cu_seqlens_q=meta.host_cu_seqlens_q, host_seq_lens_k=meta.host_seq_lens,
                capacity=meta.block_table.shape[1] * self.page_size, q_dtype=q_dtype,
                impl=self.impl)
        meta.plans[key] = plan
        return plan

    def _mla_workspace(self, num_q_heads: int, q_dtype, num_tokens: int):
        """Split-KV scratch of the MLA decode for every batch this backend serves (eager
        and graph), per heads and query tokens; allocated once, never inside a capture."""
        if not self._triton_here or q_dtype not in (torch.float16, torch.bfloat16):
            return None
        key = ("mla", num_q_heads, num_tokens)
        if key not in self._decode_workspaces:
            self._decode_workspaces[key] = allocate_mla_decode_workspace(
                # a draft step decodes topk rows a request (draft.py)
                max_num_seqs=max(1, self._graph_max_bs, self.req_to_token.shape[0])
                * self._rows_per_request,
                num_q_heads=num_q_heads, kv_lora_rank=self.kv_lora_rank,
                max_context_len=self.max_blocks * self.page_size, device=self.device,
                num_tokens=num_tokens)
        return self._decode_workspaces[key]

    def _mha_plan(self, meta, st: _MLALayer, q_dtype):
        """The MHA extend's ragged plan (keys are the new tokens: ``cu_seqlens_k =
        cu_seqlens_q``), once a pass; refused over a cached prefix."""
        key = ("mha", st.num_heads, st.num_kv_heads, st.qk_dim, st.v_dim, q_dtype)
        plan = meta.plans.get(key)
        if plan is not None:
            return plan
        cu = meta.host_cu_seqlens_q
        if cu is None:
            raise ValueError("hygon attention backend: an extend batch needs "
                             "extend_seq_lens_cpu (the host copy of the extend lengths)")
        if meta.host_seq_lens is not None and any(
                n != cu[b + 1] - cu[b] for b, n in enumerate(meta.host_seq_lens)):
            raise NotImplementedError("hygon attention backend: an MHA-method MLA extend over "
                                      "a cached prefix is not supported (the absorbed "
                                      "method serves prefixes)")
        plan = plan_ragged_attention(
            meta.cu_seqlens_q, meta.cu_seqlens_q, total_q=cu[-1], total_k=cu[-1],
            num_q_heads=st.num_heads, num_kv_heads=st.num_kv_heads, head_dim_qk=st.qk_dim,
            head_dim_v=st.v_dim, host_cu_seqlens_q=cu, host_cu_seqlens_k=cu,
            q_dtype=q_dtype, impl=self.impl)
        meta.plans[key] = plan
        return plan

    # ------------------------------------------------------------------ forward

    def _layer(self, layer, kwargs) -> _MLALayer:
        unknown = [k for k, v in kwargs.items() if v is not None] if kwargs else ()
        if unknown:
            raise NotImplementedError(f"hygon attention backend: unsupported options "
                                      f"{sorted(unknown)}")
        key = (layer.layer_id, layer.tp_k_head_num, layer.qk_head_dim, layer.v_head_dim)
        st = self._mla_layers.get(key)
        if st is None or st.layer is not layer:
            st = self._mla_layers[key] = _MLALayer.build(
                layer, kv_lora_rank=self.kv_lora_rank, latent_dim=self.latent_dim)
        if st.absorbed and self._scale is None:
            self._scale = st.scale
        return st

    def _latent_cache(self, layer) -> torch.Tensor:
        """``[num_blocks, P, W]`` view of the layer's latent rows (no copy; rows past the
        last whole page are never addressed)."""
        buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)  # [slots, 1, W]
        rows = buf.shape[0] // self.page_size * self.page_size
        return buf[:rows].view(-1, self.page_size, buf.shape[-1])

    def _save_latent(self, layer, forward_batch, k, v) -> None:
        """The new tokens' latent rows into the pool (``k [N, 1, W]``; the pool keeps
        ``v``'s columns as a view of ``k``'s)."""
        self.token_to_kv_pool.set_kv_buffer(layer, compat.write_loc(forward_batch, layer),
                                            k, v)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       sinks=None, **kwargs):
        """An extend / mixed / verify / draft-extend batch of an MLA model.

        Absorbed layer: q ``[N, Hq * W]`` (or ``[N, Hq, W]``), k ``[N, 1, W]`` and v
        ``[N, 1, kv_lora_rank]`` the new rows (None: already in the pool). MHA layer:
        q, k ``[N, H, D_qk]``, v ``[N, H, D_v]``, the new tokens only.
        Returns ``[N, Hq * v_head_dim]`` in q's dtype.
        """
        if sinks is not None:
            raise NotImplementedError("hygon attention backend: attention sinks are not "
                                      "supported for MLA")
        st = self._layer(layer, kwargs)
        if (k is None) != (v is None):
            raise ValueError("k and v must both be tensors or both be None")
        meta = self.forward_metadata
        if not st.absorbed:
            if k is None:
                raise NotImplementedError("hygon attention backend: an MHA-method MLA "
                                          "extend needs the new tokens' k and v")
            q3 = q.reshape(-1, st.num_heads, st.qk_dim)
            k3 = k.reshape(-1, st.num_kv_heads, st.qk_dim)
            v3 = v.reshape(-1, st.num_kv_heads, st.v_dim)
            out = q.new_empty((q3.shape[0], st.num_heads * st.v_dim))
            plan = self._mha_plan(meta, st, q.dtype)
            ragged_attention(q3, k3, v3, meta.cu_seqlens_q, meta.cu_seqlens_q, scale=st.scale,
                             causal=True, out=out.view(-1, st.num_heads, st.v_dim), plan=plan)
            return out
        if k is not None:
            if not save_kv_cache:
                raise NotImplementedError("hygon attention backend: the absorbed MLA extend "
                                          "reads the new rows from the pool; "
                                          "save_kv_cache=False with k given is not supported")
            self._save_latent(layer, forward_batch, k, v)
        q3 = q.reshape(-1, st.num_heads, st.qk_dim)
        out = q.new_empty((q3.shape[0], st.num_heads * st.v_dim))
        plan = self._mla_plan(meta, st.num_heads, q.dtype, st.scale, extend=True)
        cache = self._latent_cache(layer)
        if isinstance(plan, MLADecodePlan):  # a verify batch on the decode kernel
            width = meta.verify_width
            plan.run(q3.view(-1, width, st.num_heads, st.qk_dim), cache,
                     out=out.view(-1, width, st.num_heads, st.v_dim))
            return out
        plan.run_extend(q3, cache, meta.block_table, scale=st.scale,
                        out=out.view(-1, st.num_heads, st.v_dim))
        return out

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       sinks=None, **kwargs):
        """Absorbed MLA decode: one query token a request.

        q: ``[bs, Hq * W]`` (or ``[bs, Hq, W]``); k ``[bs, 1, W]``, v ``[bs, 1,
        kv_lora_rank]`` the new rows (written first; None: already in the pool).
        Returns ``[bs, Hq * kv_lora_rank]`` in q's dtype.
        """
        if sinks is not None:
            raise NotImplementedError("hygon attention backend: attention sinks are not "
                                      "supported for MLA")
        st = self._layer(layer, kwargs)
        if not st.absorbed:
            raise NotImplementedError(f"hygon attention backend: MLA decode needs the absorbed "
                                      f"layer (one KV head, qk {self.latent_dim}, v "
                                      f"{self.kv_lora_rank}), got layer {layer.layer_id} with "
                                      f"{st.num_kv_heads} KV heads, qk {st.qk_dim}, v "
                                      f"{st.v_dim}")
        if k is not None and v is not None and save_kv_cache:
            self._save_latent(layer, forward_batch, k, v)
        meta = self.forward_metadata
        q3 = q.reshape(-1, st.num_heads, st.qk_dim)
        out = q.new_empty((q3.shape[0], st.num_heads * st.v_dim))
        plan = self._mla_plan(meta, st.num_heads, q.dtype, st.scale, extend=False)
        plan.run(q3, self._latent_cache(layer), out=out.view(-1, st.num_heads, st.v_dim))
        return out
