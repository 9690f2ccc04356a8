"""Engine-free attention math of the vLLM MLA backend (:mod:`.mla`): decode over the
latent cache, the up-projected prefill and its chunked context. Nothing here imports vLLM.

What vLLM's ``MLAAttention.forward_impl`` (0.32) hands a backend, and what each function
does with it:

* decode (``forward_mqa``): the absorbed queries ``[B, H, kv_lora_rank + rope]``
  (``q_nope @ W_UK`` then ``q_pe``) -> :func:`decode` runs the step's
  :class:`~hygon_attn_backend.ops.mla.MLADecodePlan` over the paged latent cache and
  returns the latent output ``[B, H, kv_lora_rank]`` (vLLM multiplies it by ``W_UV``).
* prefill (``forward_mha``): the new tokens' queries ``[N, H, qk_nope + rope]``, their
  normalised latent ``kv_c`` ``[N, kv_lora_rank]`` and rotated ``k_pe`` ``[N, 1, rope]``
  -> :func:`prefill`: ``kv_b_proj`` up-projects ``kv_c`` to ``k_nope | v``, the new
  tokens' causal attention is :func:`~hygon_attn_backend.ops.mla_prefill.ragged_attention`
  and, when requests have a cached context (chunked prefill, prefix-cache hits), each of
  vLLM's context chunks is gathered from the latent cache (:func:`gather_latent`),
  up-projected the same way, attended without a mask and folded in by LSE
  (:func:`~hygon_attn_backend.ops.mla_prefill.merge_attn_states`).

The softmax scale is the model's (``MLAAttention.scale``: ``1 / sqrt(qk_nope + rope)``
times DeepSeek's YaRN ``mscale**2`` where it applies) on both paths: the absorbed decode
logits ``q_nope W_UK . kv_c + q_pe . k_pe`` equal the up-projected ones, so the decode must
not take its op's default ``1 / sqrt(kv_lora_rank + rope)``.
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from hygon_attn_backend.ops.mla import MLADecodePlan
from hygon_attn_backend.ops.mla_prefill import merge_attn_states, ragged_attention

__all__ = ["decode", "prefill", "gather_latent", "ContextChunk"]


def decode(plan: MLADecodePlan, q, kv_cache: torch.Tensor, *, scale: float,
           kv_scale=None):
    """The absorbed decode of one layer.

    plan: the step's decode plan (built with this layer group's scale, heads and dtypes;
       ``num_tokens = T`` query tokens a request).
    q: ``[B * T, H, W]`` or the pair ``(ql_nope [B * T, H, kv_lora_rank], q_pe [B * T, H,
       rope])`` vLLM passes (request-major: request ``b``'s T tokens are rows ``b * T ..``),
       fp16/bf16 (fp32 runs the reference); W = kv_lora_rank + rope.
    kv_cache: ``[num_blocks, page_size, W]`` vLLM's MLA cache (fp8: its float8 view).
    scale: the layer's softmax scale (checked against the plan's).
    kv_scale: an fp8 cache's scale (the layer's ``_k_scale``, a 1-element tensor), else None.
    Returns ``(out [B * T, H, kv_lora_rank], lse [B * T, H] float32 or None)``.
    """
    if isinstance(q, (tuple, list)):
        q = torch.cat(list(q), dim=-1)
    if abs(plan.scale - float(scale)) > 1e-6 * abs(float(scale)):
        raise ValueError(f"scale: the layer's softmax scale {scale} differs from the decode "
                         f"plan's {plan.scale}")
    tokens = plan.num_tokens
    if tokens > 1:  # the uniform block as [B, T, H, W]; flat rows back for vLLM
        if q.dim() != 3 or q.shape[0] != plan.num_seqs * tokens:
            raise ValueError(f"q: the plan's decode block is {plan.num_seqs} requests x "
                             f"{tokens} tokens, got {tuple(q.shape)}")
        q = q.reshape(plan.num_seqs, tokens, *q.shape[1:])
    result = plan.run(q, kv_cache, kv_scale=kv_scale)
    out, lse = result if plan.return_lse else (result, None)
    if tokens > 1:
        out = out.flatten(0, 1)
        lse = None if lse is None else lse.flatten(0, 1)
    return out, lse


class ContextChunk:
    """The fields of one of vLLM's context chunks (``MLACommonPrefillMetadata.ContextChunk``)
    that the context pass reads; vLLM's own object has them all and passes as it is.

    token_slice: the chunk's query rows among the prefill rows; query_start_loc: ``[R + 1]``
    int32 offsets of its R requests' rows, from ``token_slice.start``; request_slice: its
    requests among the prefills (rows of the prefill block table); cu_seq_lens: ``[R + 1]``
    int32 offsets of their context rows in the chunk; starts: ``[R]`` int32 position of
    each request's first context token of the chunk; token_to_seq: ``[K]`` int32 request
    (0..R-1) of each context row; num_context_tokens: K.
    """

    def __init__(self, *, token_slice: slice, query_start_loc: torch.Tensor,
                 request_slice: slice, cu_seq_lens: torch.Tensor, starts: torch.Tensor,
                 token_to_seq: torch.Tensor):
        self.token_slice = token_slice
        self.query_start_loc = query_start_loc
        self.request_slice = request_slice
        self.cu_seq_lens = cu_seq_lens
        self.starts = starts
        self.token_to_seq = token_to_seq
        self.num_context_tokens = int(token_to_seq.shape[0])


def gather_latent(kv_cache: torch.Tensor, block_table: torch.Tensor, chunk) -> torch.Tensor:
    """One chunk's context rows from the paged latent cache.

    kv_cache: ``[num_blocks, page_size, W]``; block_table: ``[R_all, max_blocks]`` the
    prefills' table (``chunk.request_slice`` picks the chunk's rows).
    Returns ``[K, W]`` (K = ``chunk.num_context_tokens``): row ``i`` is request
    ``s = token_to_seq[i]``'s token ``starts[s] + i - cu_seq_lens[s]``.
    """
    page = kv_cache.shape[1]
    seq = chunk.token_to_seq.to(torch.long)
    rows = torch.arange(seq.shape[0], device=kv_cache.device)
    pos = chunk.starts.to(torch.long)[seq] + rows - chunk.cu_seq_lens.to(torch.long)[seq]
    table = block_table[chunk.request_slice].to(torch.long)
    blocks = table[seq, pos // page]
    return kv_cache[blocks, pos % page]


def _up_project(kv_b_proj: Callable, kv_c: torch.Tensor, k_pe: torch.Tensor, *,
                num_heads: int, qk_nope_head_dim: int, v_head_dim: int):
    """``kv_c [N, R]`` -> ``k [N, H, nope + rope]`` (``k_pe [N, 1 or H, rope]`` broadcast
    over the heads) and ``v [N, H, v_head_dim]`` (a view)."""
    kv = kv_b_proj(kv_c)
    if isinstance(kv, (tuple, list)):  # vLLM's linear layers return (out, bias)
        kv = kv[0]
    kv = kv.view(-1, num_heads, qk_nope_head_dim + v_head_dim)
    k_nope, v = kv.split([qk_nope_head_dim, v_head_dim], dim=-1)
    if k_pe.shape[-1] == 0:
        return k_nope, v
    k = torch.empty(k_nope.shape[:-1] + (qk_nope_head_dim + k_pe.shape[-1],),
                    dtype=k_nope.dtype, device=k_nope.device)
    k[..., :qk_nope_head_dim] = k_nope
    k[..., qk_nope_head_dim:] = k_pe
    return k, v


def prefill(q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, *,
            kv_b_proj: Callable, num_heads: int, qk_nope_head_dim: int, v_head_dim: int,
            scale: float, query_start_loc: torch.Tensor, out: torch.Tensor,
            kv_cache: Optional[torch.Tensor] = None,
            block_table: Optional[torch.Tensor] = None,
            chunks: Sequence = (), impl: str = "auto", kv_scale=None) -> torch.Tensor:
    """The up-projected (MHA) MLA prefill of one layer, written into ``out``.

    q: ``[N, H, qk_nope + rope]`` the prefill rows' queries; kv_c: ``[N, kv_lora_rank]``
       their normalised latent; k_pe: ``[N, 1, rope]`` their rotated rope key (all one
       dtype, fp16/bf16; fp32 runs the reference).
    kv_b_proj: ``kv_c [M, kv_lora_rank] -> [M, H * (qk_nope + v)]`` (vLLM's layer; its
       ``(out, bias)`` pair is taken too).
    scale: the model's softmax scale. query_start_loc: ``[P + 1]`` int32 offsets of the P
       prefills' rows (from 0).
    out: ``[N, H * v_head_dim]`` or ``[N, H, v_head_dim]`` q's dtype, written.
    kv_cache, block_table, chunks: the latent cache ``[num_blocks, page, kv_lora_rank +
       rope]``, the prefills' block table and vLLM's context chunks (see
       :class:`ContextChunk`); empty ``chunks``: no request has a cached context.
    impl: the ops' ``impl``. kv_scale: an fp8 cache's scale (float or 1-element tensor):
       context rows are ``code * kv_scale``.
    Returns ``out``.
    """
    dims = dict(num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim,
                v_head_dim=v_head_dim)
    k, v = _up_project(kv_b_proj, kv_c, k_pe, **dims)
    out3 = out.view(-1, num_heads, v_head_dim)
    if not chunks:
        ragged_attention(q, k, v, query_start_loc, query_start_loc, scale=scale, causal=True,
                         out=out3, impl=impl)
        return out
    if kv_cache is None or block_table is None:
        raise ValueError("kv_cache and block_table are needed when chunks are given")
    new_out, new_lse = ragged_attention(q, k, v, query_start_loc, query_start_loc,
                                        scale=scale, causal=True, return_lse=True, impl=impl)
    ctx_out, ctx_lse = context(q, kv_cache, block_table, chunks, kv_b_proj=kv_b_proj,
                               scale=scale, impl=impl, kv_scale=kv_scale, **dims)
    merge_attn_states(ctx_out, ctx_lse, new_out, new_lse, out=out3, impl=impl)
    return out


def context(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
            chunks: Sequence, *, kv_b_proj: Callable, num_heads: int, qk_nope_head_dim: int,
            v_head_dim: int, scale: float, impl: str = "auto", kv_scale=None):
    """The prefill rows' attention to their cached context, chunk by chunk.

    q: ``[N, H, qk_nope + rope]``; kv_cache, block_table, chunks, kv_scale: as
    :func:`prefill` (an fp8 context is dequantised as gathered, chunk by chunk).
    Returns ``(out [N, H, v_head_dim] q's dtype, lse [H, N] float32)``: rows of requests
    without context (no chunk covers them) are 0 with LSE ``-inf`` (no weight in the merge).
    A request split over two chunks (vLLM's continuation) is merged by LSE like the rest:
    each chunk folds into the running result over its own rows.
    """
    n = q.shape[0]
    acc = torch.zeros((n, num_heads, v_head_dim), dtype=q.dtype, device=q.device)
    acc_lse = torch.full((num_heads, n), float("-inf"), dtype=torch.float32, device=q.device)
    rank = kv_cache.shape[2] - (q.shape[2] - qk_nope_head_dim)
    for chunk in chunks:
        latent = gather_latent(kv_cache, block_table, chunk)
        if latent.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            latent = latent.to(torch.float32)
            if kv_scale is not None:
                latent = latent * torch.as_tensor(kv_scale, dtype=torch.float32,
                                                  device=latent.device).reshape(())
        if latent.dtype != q.dtype:
            latent = latent.to(q.dtype)
        k, v = _up_project(kv_b_proj, latent[:, :rank], latent[:, rank:].unsqueeze(1),
                           num_heads=num_heads, qk_nope_head_dim=qk_nope_head_dim,
                           v_head_dim=v_head_dim)
        rows = chunk.token_slice
        part, part_lse = ragged_attention(q[rows], k, v, chunk.query_start_loc,
                                          chunk.cu_seq_lens, scale=scale, causal=False,
                                          return_lse=True, impl=impl)
        merge_attn_states(acc[rows], acc_lse[:, rows], part, part_lse, out=acc[rows],
                          out_lse=acc_lse[:, rows], impl=impl)
    return acc, acc_lse
