"""A small SGLang serving loop on SGLang's own memory structures, for the integration tests.

``Server`` owns what SGLang's scheduler owns (``RadixCache``, ``ReqToTokenPool``, an
``MHATokenToKVPool`` and the token or paged allocator, all SGLang's classes, unchanged) and
drives our ``HygonAttnBackend`` with the ``ForwardBatch`` objects the scheduler would
build: match the prompt against the tree and lock the matched node, allocate slots for
the new tokens, write the request's ``req_to_token`` row, run extend or decode, and on
finish insert the sequence into the tree (page-aligned), free the duplicate and unaligned
slots, unlock and release the row.

``TinyModel`` is one attention layer over token ids (an embedding plus a position table,
projected to q/k/v). ``TinyModel.oracle`` recomputes the attention of any positions of a
full sequence from scratch (dense causal attention, no cache), the "full recompute" the
cached extends are checked against.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import List, Optional

import torch

from sglang.srt.layers.radix_attention import RadixAttention
try:  # SGLang 0.5.17 on: one module per allocator
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
except ImportError:  # 0.5.10: both in mem_cache/allocator.py
    from sglang.srt.mem_cache.allocator import (PagedTokenToKVPoolAllocator,
                                                TokenToKVPoolAllocator)
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

from hygon_attn_backend.integrations.sglang.backend import HygonAttnBackend


def dense_masked_attention(q, k, v, mask, *, scale, dtype):
    """Oracle: q ``[n, Hq, D]`` over ``k, v [L, Hkv, D]`` where ``mask [n, L]`` (bool) is
    true, computed in ``dtype``."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.detach().cpu().to(dtype) for t in (q, k, v))
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    s = s.masked_fill(~mask.cpu().unsqueeze(0), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


def dense_causal_attention(q, k, v, q_positions, *, scale, dtype, window=None, soft_cap=None,
                           sinks=None):
    """Oracle: q ``[n, Hq, D]`` at ``q_positions`` over keys ``k, v [L, Hkv, D]`` (key j at
    position j), causal (``j <= position``), computed in ``dtype``; SGLang's conventions
    for the options: ``window`` W keeps keys ``position - W <= j``, ``soft_cap`` c maps
    logits to ``c * tanh(s / c)``, ``sinks [Hq]`` adds a key of value 0 and logit sink."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.detach().cpu().to(dtype) for t in (q, k, v))
    q_positions = torch.as_tensor(q_positions).cpu()
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if soft_cap:
        s = soft_cap * torch.tanh(s / soft_cap)
    j = torch.arange(k.shape[0]).unsqueeze(0)
    mask = j <= q_positions.unsqueeze(1)  # [n, L]
    if window is not None:
        mask &= j >= q_positions.unsqueeze(1) - window
    s = s.masked_fill(~mask.unsqueeze(0), float("-inf"))
    if sinks is not None:
        sink = sinks.detach().cpu().to(dtype).view(-1, 1, 1).expand(-1, s.shape[1], 1)
        s = torch.cat([s, sink], dim=-1)
        v = torch.cat([v, torch.zeros_like(v[:1])], dim=0)
    p = torch.softmax(s, dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v)


class TinyModel:
    """q/k/v of token ``t`` at position ``i``: ``(emb[t] + pos[i]) @ W``."""

    def __init__(self, *, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 vocab: int = 1000, hidden: int = 64, max_pos: int = 1024, seed: int = 0,
                 device="cpu"):
        g = torch.Generator().manual_seed(seed)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.window = self.soft_cap = self.sinks = None  # attention options (SGLang's meaning)
        self.emb = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
        self.pos = 0.5 * torch.randn(max_pos, hidden, generator=g, dtype=torch.float64)
        self.wq = torch.randn(hidden, num_heads * head_dim, generator=g,
                              dtype=torch.float64) / math.sqrt(hidden)
        self.wk = torch.randn(hidden, num_kv_heads * head_dim, generator=g,
                              dtype=torch.float64) / math.sqrt(hidden)
        self.wv = torch.randn(hidden, num_kv_heads * head_dim, generator=g, dtype=torch.float64)
        self.scale = head_dim ** -0.5

    def qkv(self, tokens, positions):
        """``q [n, Hq*D]``, ``k, v [n, Hkv, D]`` in the model dtype (as SGLang hands them)."""
        x = self.emb[torch.as_tensor(list(tokens))] + self.pos[torch.as_tensor(list(positions))]
        to = dict(dtype=self.dtype, device=self.device)
        q = (x @ self.wq).to(**to)
        k = (x @ self.wk).view(-1, self.num_kv_heads, self.head_dim).to(**to)
        v = (x @ self.wv).view(-1, self.num_kv_heads, self.head_dim).to(**to)
        return q, k, v

    def oracle(self, tokens, positions, dtype=torch.float64, kv_transform=None):
        """Attention output ``[n, Hq, D]`` of ``positions`` of the sequence ``tokens``,
        recomputed from scratch in ``dtype`` (inputs rounded to the model dtype first).
        ``kv_transform(k, v) -> (k, v)`` may alter the keys/values first (fp8 rounding)."""
        q, k, v = self.qkv(tokens, range(len(tokens)))
        if kv_transform is not None:
            k, v = kv_transform(k, v)
        pos = torch.as_tensor(positions)
        q = q.view(-1, self.num_heads, self.head_dim)[pos.to(q.device)]
        return dense_causal_attention(q, k, v, pos, scale=self.scale, dtype=dtype,
                                      window=self.window, soft_cap=self.soft_cap,
                                      sinks=self.sinks)


@dataclass
class Request:
    tokens: List[int]
    row: int
    node: object  # locked tree node of the cached prefix
    cached_len: int  # prefix served by the tree (its slots belong to the tree)
    kv_len: int  # tokens whose K/V are in the pool, reachable through the row
    outputs: list = field(default_factory=list)


class Server:
    """SGLang's memory structures plus our backend, driven like the scheduler does."""

    def __init__(self, model: TinyModel, *, page_size: int, pool_tokens: int = 1024,
                 max_context: int = 256, max_reqs: int = 8, kv_dtype: Optional[torch.dtype] = None,
                 k_scale: Optional[float] = None, seed: int = 0, dcp_size: int = 1,
                 dcp_rank: int = 0):
        """``dcp_size`` > 1: this process is rank ``dcp_rank`` of a DCP group, set up as
        SGLang 0.5.23 does (its ``get_parallel()`` must say so before the backend is built):
        the allocator and the tree page ``page_size * dcp_size`` slots over
        ``pool_tokens * dcp_size``, the pool keeps pages of ``page_size`` rows, the layer
        holds the rank's ``num_heads / dcp_size`` query heads (the model's heads ``[rank *
        Hq, (rank + 1) * Hq)``) and every KV head. Outputs are the rank's heads."""
        self.model = model
        self.dcp_size, self.dcp_rank = dcp_size, dcp_rank
        self.page_size = page_size * dcp_size  # the allocator's page (SGLang's under DCP)
        self.device = model.device
        dev = str(model.device)
        self.pool = MHATokenToKVPool(
            size=pool_tokens, page_size=page_size, dtype=kv_dtype or model.dtype,
            head_num=model.num_kv_heads, head_dim=model.head_dim, layer_num=1, device=dev,
            enable_memory_saver=False, enable_alt_stream=False)
        if self.page_size == 1:
            self.allocator = TokenToKVPoolAllocator(pool_tokens, self.pool.dtype, dev,
                                                    self.pool, need_sort=False)
        else:
            self.allocator = PagedTokenToKVPoolAllocator(pool_tokens * dcp_size, self.page_size,
                                                         self.pool.dtype, dev, self.pool,
                                                         need_sort=False)
        # fragmented free list, as a long-running server has: requests get scattered slots
        g = torch.Generator().manual_seed(seed)
        free = self.allocator.free_pages
        self.allocator.free_pages = free[torch.randperm(free.numel(), generator=g).to(free.device)]
        self.req_to_token_pool = ReqToTokenPool(size=max_reqs, max_context_len=max_context,
                                                device=dev, enable_memory_saver=False)
        self.tree = RadixCache(CacheInitParams(
            disable=False, req_to_token_pool=self.req_to_token_pool,
            token_to_kv_pool_allocator=self.allocator, page_size=self.page_size))
        self.num_heads = model.num_heads // dcp_size  # this rank's query heads
        self.layer = RadixAttention(num_heads=self.num_heads, head_dim=model.head_dim,
                                    scaling=model.scale, num_kv_heads=model.num_kv_heads,
                                    layer_id=0)
        self.layer.sliding_window_size = -1 if model.window is None else model.window
        self.layer.logit_cap = model.soft_cap or 0.0
        if k_scale is not None:
            self.layer.k_scale = torch.tensor(k_scale, device=self.device)
            self.layer.v_scale = torch.tensor(k_scale, device=self.device)
            self.layer.k_scale_float = self.layer.v_scale_float = float(k_scale)
        runner = SimpleNamespace(device=dev, req_to_token_pool=self.req_to_token_pool,
                                 token_to_kv_pool=self.pool, page_size=page_size)
        self.backend = HygonAttnBackend(runner)
        self.backend_calls = 0

    # ------------------------------------------------------------------ scheduling

    def start(self, tokens: List[int]) -> Request:
        """Match ``tokens`` against the tree, lock the hit, take a row, write the prefix."""
        match = self.tree.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
        node = match.last_device_node
        if hasattr(match, "device_prefix_len"):  # SGLang 0.5.17 on
            cached = match.device_prefix_len
            slots = self.tree.path_device_indices(node) if cached else None
        else:  # 0.5.10: the match carries the prefix's slots
            slots = match.device_indices
            cached = len(slots)
        self.tree.inc_lock_ref(node)
        row = _take_row(self.req_to_token_pool)
        if cached:
            self.req_to_token_pool.req_to_token[row, :cached] = slots[:cached].to(torch.int32)
        return Request(tokens=list(tokens), row=row, node=node, cached_len=cached, kv_len=cached)

    def path_slots(self, node) -> torch.Tensor:
        """The KV slots of the tree path ending at ``node`` (root first)."""
        if hasattr(self.tree, "path_device_indices"):  # SGLang 0.5.17 on
            return self.tree.path_device_indices(node)
        parts = []
        while node is not None and node is not self.tree.root_node:
            parts.append(node.value)
            node = node.parent
        return torch.cat(parts[::-1]) if parts else torch.empty(0, dtype=torch.int64)

    def _alloc(self, reqs: List[Request], new_lens: List[int]) -> torch.Tensor:
        dev = self.device
        prefix_cpu = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
        seq_cpu = prefix_cpu + torch.tensor(new_lens, dtype=torch.int64)
        prefix, seq = prefix_cpu.to(dev), seq_cpu.to(dev)
        total = int(sum(new_lens))
        if self.page_size == 1:
            locs = self.allocator.alloc(total)
        else:
            r2t = self.req_to_token_pool.req_to_token
            last = torch.tensor([int(r2t[r.row, r.kv_len - 1]) if r.kv_len else -1 for r in reqs],
                                dtype=torch.int64, device=dev)
            locs = self.allocator.alloc_extend(prefix, prefix_cpu, seq, seq_cpu, last, total)
        assert locs is not None, "KV pool exhausted"
        return locs

    def extend(self, reqs: List[Request], *, mode: ForwardMode = ForwardMode.EXTEND):
        """One extend (or mixed) pass over ``tokens[kv_len:]`` of each request; returns the
        per-request outputs ``[n_b, Hq, D]``."""
        new_lens = [len(r.tokens) - r.kv_len for r in reqs]
        locs = self._alloc(reqs, new_lens)
        r2t = self.req_to_token_pool.req_to_token
        starts = [0]
        for n in new_lens:
            starts.append(starts[-1] + n)
        qs, ks, vs, positions = [], [], [], []
        for r, n, s in zip(reqs, new_lens, starts):
            r2t[r.row, r.kv_len:r.kv_len + n] = locs[s:s + n].to(torch.int32)
            pos = list(range(r.kv_len, r.kv_len + n))
            q, k, v = self.model.qkv(r.tokens[r.kv_len:], pos)
            qs.append(q), ks.append(k), vs.append(v), positions.extend(pos)
        seq_lens = [r.kv_len + n for r, n in zip(reqs, new_lens)]
        batch = self._batch(mode, reqs, seq_lens, locs, positions)
        batch.extend_prefix_lens = torch.tensor([r.kv_len for r in reqs], dtype=torch.int32,
                                                device=self.device)
        batch.extend_prefix_lens_cpu = [r.kv_len for r in reqs]
        batch.extend_seq_lens = torch.tensor(new_lens, dtype=torch.int32, device=self.device)
        batch.extend_seq_lens_cpu = list(new_lens)
        batch.extend_num_tokens = sum(new_lens)
        out = self._run(batch, torch.cat(qs), torch.cat(ks), torch.cat(vs))
        for r, n, s in zip(reqs, new_lens, starts):
            r.kv_len += n
            r.outputs.append(out[s:s + n])
        return [out[s:s + n] for n, s in zip(new_lens, starts)]

    def decode(self, reqs: List[Request], next_tokens: List[int]):
        """One decode step: append ``next_tokens`` (one per request) and attend."""
        for r, t in zip(reqs, next_tokens):
            r.tokens.append(int(t))
        r2t = self.req_to_token_pool.req_to_token
        if self.page_size == 1:
            locs = self.allocator.alloc(len(reqs))
        else:
            seq_cpu = torch.tensor([r.kv_len + 1 for r in reqs], dtype=torch.int64)
            last = torch.tensor([int(r2t[r.row, r.kv_len - 1]) for r in reqs], dtype=torch.int64,
                                device=self.device)
            locs = self.allocator.alloc_decode(seq_cpu.to(self.device), seq_cpu, last)
        positions = [r.kv_len for r in reqs]
        for r, loc in zip(reqs, locs):
            r2t[r.row, r.kv_len] = int(loc)
        q, k, v = self.model.qkv([r.tokens[-1] for r in reqs], positions)
        batch = self._batch(ForwardMode.DECODE, reqs, [r.kv_len + 1 for r in reqs], locs,
                            positions)
        out = self._run(batch, q, k, v)
        for i, r in enumerate(reqs):
            r.kv_len += 1
            r.outputs.append(out[i:i + 1])
        return [out[i:i + 1] for i in range(len(reqs))]

    def decode_graph(self, reqs: List[Request], next_tokens: List[int], *, graph_bs: int,
                     state: dict, legacy: bool = False):
        """One decode step through the CUDA-graph hooks, as SGLang's decode graph runner
        drives them: static input buffers padded to ``graph_bs`` (padding rows use row 0,
        the backend's seq-len fill value and slot 0); ``init_forward_metadata_out_graph``
        before the step, ``init_forward_metadata_in_graph`` inside it. On CUDA the step is
        captured once (after one warm-up run) and replayed; on CPU it runs the same hooks
        eagerly. ``state`` (a dict owned by the caller) keeps the buffers and the graph.
        ``legacy``: drive SGLang 0.5.10's pair instead, as its graph runner does
        (``init_forward_metadata_capture_cuda_graph`` before capture,
        ``init_forward_metadata_replay_cuda_graph`` before each replay, both outside the
        graph)."""
        dev, n = self.device, len(reqs)
        backend = self.backend
        for r, t in zip(reqs, next_tokens):
            r.tokens.append(int(t))
        r2t = self.req_to_token_pool.req_to_token
        if self.page_size == 1:
            locs = self.allocator.alloc(n)
        else:
            seq_cpu = torch.tensor([r.kv_len + 1 for r in reqs], dtype=torch.int64)
            last = torch.tensor([int(r2t[r.row, r.kv_len - 1]) for r in reqs], dtype=torch.int64,
                                device=dev)
            locs = self.allocator.alloc_decode(seq_cpu.to(dev), seq_cpu, last)
        for r, loc in zip(reqs, locs):
            r2t[r.row, r.kv_len] = int(loc)
        positions = [r.kv_len for r in reqs]
        q, k, v = self.model.qkv([r.tokens[-1] for r in reqs], positions)
        fill = backend.get_cuda_graph_seq_len_fill_value()
        first = not state
        if first:
            backend.init_cuda_graph_state(graph_bs, graph_bs)
            state.update(
                rows=torch.zeros(graph_bs, dtype=torch.int64, device=dev),
                seq_lens=torch.full((graph_bs,), fill, dtype=torch.int64, device=dev),
                locs=torch.zeros(graph_bs, dtype=torch.int64, device=dev),
                q=torch.randn(graph_bs, q.shape[1], device=dev).to(q.dtype),
                k=torch.randn(graph_bs, *k.shape[1:], device=dev).to(k.dtype),
                v=torch.randn(graph_bs, *v.shape[1:], device=dev).to(v.dtype))
            state["batch"] = ForwardBatch(
                forward_mode=ForwardMode.DECODE, batch_size=graph_bs,
                input_ids=torch.zeros(graph_bs, dtype=torch.int64, device=dev),
                req_pool_indices=state["rows"], seq_lens=state["seq_lens"],
                out_cache_loc=state["locs"], seq_lens_sum=graph_bs * fill,
                positions=torch.zeros(graph_bs, dtype=torch.int64, device=dev))
        st = state
        st["rows"].zero_()
        st["rows"][:n].copy_(torch.tensor([r.row for r in reqs], device=dev))
        st["seq_lens"].fill_(fill)
        st["seq_lens"][:n].copy_(torch.tensor([r.kv_len + 1 for r in reqs], device=dev))
        st["locs"].zero_()
        st["locs"][:n].copy_(locs.to(torch.int64))
        st["q"][:n].copy_(q), st["k"][:n].copy_(k), st["v"][:n].copy_(v)
        batch = st["batch"]

        def step():
            if not legacy:
                backend.init_forward_metadata_in_graph(batch)
            st["out"] = backend.forward(st["q"], st["k"], st["v"], self.layer, batch)

        if not legacy:
            backend.init_forward_metadata_out_graph(batch, in_capture=first)
        elif first:
            backend.init_forward_metadata_capture_cuda_graph(
                graph_bs, graph_bs, st["rows"], st["seq_lens"], None, ForwardMode.DECODE, None)
        else:
            backend.init_forward_metadata_replay_cuda_graph(
                graph_bs, st["rows"], st["seq_lens"], int(st["seq_lens"].sum()), None,
                ForwardMode.DECODE, None, seq_lens_cpu=st["seq_lens"].cpu())
        if dev.type == "cuda":
            if first:
                step()  # warm-up: lazy allocations happen here, outside the capture
                torch.cuda.synchronize()
                st["graph"] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(st["graph"]):
                    step()
            st["graph"].replay()
            torch.cuda.synchronize()
        else:
            step()
        self.backend_calls += 1
        out = st["out"].view(-1, self.model.num_heads, self.model.head_dim)
        for i, r in enumerate(reqs):
            r.kv_len += 1
            r.outputs.append(out[i:i + 1].clone())
        return [out[i:i + 1].clone() for i in range(n)]

    def verify(self, reqs: List[Request], drafts: List[List[int]], parents: List[int]):
        """One ``TARGET_VERIFY`` pass as SGLang's EAGLE worker builds it: each request's
        ``T = len(parents)`` draft tokens (``drafts[b]``) after its ``kv_len`` cached
        tokens, draft ``i`` the child of draft ``parents[i]`` (-1: of the prefix's last
        token), at position ``kv_len + depth(i)``; the batch's ``spec_info`` is this
        SGLang's own ``EagleVerifyInput`` with its flattened custom mask (per request
        ``[T, kv_len + T]``: the prefix, and each draft's ancestors and itself). The drafts'
        K/V are written to fresh slots (not accepted: ``kv_len`` stays). Returns the
        per-request outputs ``[T, Hq, D]`` and each request's ``[T, kv_len + T]`` mask."""
        width = len(parents)
        depth, visible = [], torch.zeros(width, width, dtype=torch.bool)
        for i, parent in enumerate(parents):
            assert -1 <= parent < i, "parents come before their children"
            depth.append(0 if parent < 0 else depth[parent] + 1)
            visible[i, i] = True
            if parent >= 0:
                visible[i] |= visible[parent]
        locs = self._alloc(reqs, [width] * len(reqs))
        r2t = self.req_to_token_pool.req_to_token
        qs, ks, vs, positions, masks = [], [], [], [], []
        for b, (r, toks) in enumerate(zip(reqs, drafts)):
            assert len(toks) == width
            r2t[r.row, r.kv_len:r.kv_len + width] = \
                locs[b * width:(b + 1) * width].to(torch.int32)
            pos = [r.kv_len + d for d in depth]
            q, k, v = self.model.qkv(toks, pos)
            qs.append(q), ks.append(k), vs.append(v), positions.extend(pos)
            masks.append(torch.cat([torch.ones(width, r.kv_len, dtype=torch.bool), visible], 1))
        batch = self._batch(ForwardMode.TARGET_VERIFY, reqs, [r.kv_len for r in reqs], locs,
                            positions)
        batch.spec_info = _verify_input(
            custom_mask=torch.cat([m.flatten() for m in masks]).to(self.device),
            positions=batch.positions, draft_token_num=width,
            topk=1 if all(p == i - 1 for i, p in enumerate(parents)) else 2,
            seq_lens_cpu=batch.seq_lens_cpu)
        out = self._run(batch, torch.cat(qs), torch.cat(ks), torch.cat(vs))
        return [out[b * width:(b + 1) * width] for b in range(len(reqs))], masks

    def finish(self, req: Request) -> int:
        """Cache the request's tokens in the tree and release it; returns how many of its
        tokens the tree already held (their duplicate slots are freed)."""
        r2t = self.req_to_token_pool.req_to_token
        kv = r2t[req.row, :req.kv_len].to(torch.int64)
        aligned = req.kv_len // self.page_size * self.page_size
        key = RadixKey(array("q", req.tokens[:req.kv_len]))
        result = self.tree.insert(InsertParams(key=key, value=kv[:aligned].clone()))
        if result.prefix_len > req.cached_len:  # computed twice: free this request's copy
            self.allocator.free(kv[req.cached_len:result.prefix_len])
        if aligned < req.kv_len:
            self.allocator.free(kv[aligned:])
        self.tree.dec_lock_ref(req.node)
        _release_row(self.req_to_token_pool, req.row)
        return result.prefix_len

    # ------------------------------------------------------------------ plumbing

    def _batch(self, mode, reqs, seq_lens, locs, positions) -> ForwardBatch:
        dev = self.device
        return ForwardBatch(
            forward_mode=mode, batch_size=len(reqs),
            input_ids=torch.zeros(len(positions), dtype=torch.int64, device=dev),
            req_pool_indices=torch.tensor([r.row for r in reqs], dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=locs.to(torch.int64), seq_lens_sum=int(sum(seq_lens)),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev))

    def _run(self, batch, q, k, v):
        """Run the backend; it must only read the tree and ``req_to_token``."""
        tree_before = tree_snapshot(self.tree)
        rows_before = self.req_to_token_pool.req_to_token.clone()
        self.backend.init_forward_metadata(batch)
        kwargs = {} if self.model.sinks is None else {"sinks": self.model.sinks}
        if self.dcp_size > 1:  # the rank's query heads
            h, d = self.num_heads, self.model.head_dim
            q = q.view(q.shape[0], -1, d)[:, self.dcp_rank * h:(self.dcp_rank + 1) * h]
            q = q.reshape(q.shape[0], h * d)
        out = self.backend.forward(q, k, v, self.layer, batch, **kwargs)
        assert snapshots_equal(tree_before, tree_snapshot(self.tree)), \
            "the backend changed the tree"
        assert torch.equal(rows_before, self.req_to_token_pool.req_to_token), \
            "the backend wrote req_to_token"
        self.backend_calls += 1
        return out.view(-1, self.num_heads, self.model.head_dim)


def _verify_input(**given):
    """This SGLang's ``EagleVerifyInput`` with the ``given`` fields; the fields a verify
    batch's attention does not read (the accept bookkeeping, whose names differ between
    versions) get placeholders."""
    import dataclasses

    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
    from sglang.srt.speculative.eagle_info import EagleVerifyInput

    empty = torch.empty(0, dtype=torch.int64)
    kwargs = {}
    for f in dataclasses.fields(EagleVerifyInput):
        if not f.init:
            continue
        if f.name in given:
            kwargs[f.name] = given[f.name]
        elif f.default is not dataclasses.MISSING or \
                f.default_factory is not dataclasses.MISSING:
            continue
        elif f.name == "capture_hidden_mode":
            kwargs[f.name] = CaptureHiddenMode.NULL
        elif f.name in ("spec_steps", "seq_lens_sum"):
            kwargs[f.name] = 0
        else:
            kwargs[f.name] = empty
    return EagleVerifyInput(**kwargs)


def _take_row(pool: ReqToTokenPool) -> int:
    """One free ``req_to_token`` row (SGLang 0.5.10's pool hands rows to ``Req`` objects
    only: its free list is taken directly)."""
    if hasattr(pool, "alloc_rows"):
        return pool.alloc_rows(1)[0]
    return pool.free_slots.pop(0)


def _release_row(pool: ReqToTokenPool, row: int) -> None:
    if hasattr(pool, "free_rows"):
        pool.free_rows([row])
    else:
        pool.free_slots.append(row)


def tree_snapshot(tree: RadixCache):
    """Structure, lock counts and values of every node (to prove nothing else changed)."""
    nodes = []
    stack = [tree.root_node]
    while stack:
        node = stack.pop()
        value = node.value
        nodes.append((node.id, len(node.key), node.lock_ref,
                      None if not isinstance(value, torch.Tensor) else value.clone(),
                      sorted(c.id for c in node.children.values())))
        stack.extend(node.children.values())
    return sorted(nodes, key=lambda n: n[0])


def snapshots_equal(a, b) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x[:3] != y[:3] or x[4] != y[4]:
            return False
        if (x[3] is None) != (y[3] is None) or (x[3] is not None and not torch.equal(x[3], y[3])):
            return False
    return True
