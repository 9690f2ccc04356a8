"""EAGLE's multi-step draft decode through ``hygon`` (``--speculative-draft-attention-backend
hygon``, or ``hygon`` as the target's backend with no draft backend named).

SGLang's EAGLE worker (0.5.23, ``speculative/eagle_worker_v2.py``) runs
``speculative_num_steps - 1`` draft decode forwards after the draft extend. It calls
``init_forward_metadata`` of one container once per round (or the CUDA-graph hooks of it)
and then runs step ``i`` with ``container.attn_backends[i]`` as the forward's backend.
Each of the ``B`` requests carries ``topk`` branches, so a step decodes ``B * topk`` rows,
request-major (row ``b * topk + k``); the draft tokens' KV sits in the request's
``req_to_token`` row past its prefix ``L`` (``forward_batch.seq_lens``):

* page size 1, or ``topk == 1``: branch ``k``'s step ``s`` token at position
  ``L + k * num_steps + s``;
* page size ``P > 1`` with ``topk > 1``: branch ``k`` owns ``n = cdiv(L % P + num_steps, P)``
  pages starting at page ``L // P + k * n`` of the row; SGLang copies the prefix's last
  partial page into the head of every branch's first page, so branch ``k``'s sequence is
  the row's first ``L // P`` pages followed by its own ``n``.

Both layouts are one rule over pages (token-level pages for ``P == 1``, where
``L // P = L`` and ``n = num_steps``): branch ``k``'s page ``p`` is the row's page ``p`` for
``p < L // P`` and ``p + k * n`` past it (:func:`branch_block_table`). Step ``i``'s rows
attend to the branch's first ``L + i + 1`` keys (the prefix and the drafts of steps
``0..i``, the step's own token written by the layer first) with our paged decode, one
plan per step.

CUDA graphs: static request and branch tables and per-step key lengths, refilled inside
the graph from the runner's static ``req_pool_indices`` / ``seq_lens`` (static shapes);
the metadata and plans of a batch size are built at capture and reused at replay.
An MLA draft model (``use_mla_backend``: e.g. DeepSeek's NextN / MTP layer) takes
``mla.HygonMLABackend`` steps: the same branch tables and key lengths, each step an
absorbed MLA decode of the ``B * topk`` rows over the latent pool.
Not supported (a clear error): the draft-only KV window
(``--speculative-draft-window-size``), which keeps sink and recent tokens.
"""

from __future__ import annotations

import logging
from typing import List, Optional

import torch

from hygon_attn_backend.integrations.sglang import page_table, warmup
from hygon_attn_backend.integrations.sglang.backend import HygonAttnBackend, HygonForwardMetadata
from hygon_attn_backend.integrations.sglang.mla import HygonMLABackend, is_mla_runner

logger = logging.getLogger(__name__)

__all__ = ["HygonMultiStepDraftBackend", "branch_block_table", "branch_pages"]


def branch_pages(prefix_lens: torch.Tensor, *, num_steps: int, page_size: int):
    """``(shared, own)``: per request, the pages every branch reads from the request's row
    (``[B]`` int64, ``L // P``) and the pages each branch owns past them (``[B]`` int64,
    ``cdiv(L % P + num_steps, P)``; ``num_steps`` for ``P == 1``)."""
    lens = prefix_lens.to(torch.int64)
    if page_size == 1:
        return lens, torch.full_like(lens, num_steps)
    return (torch.div(lens, page_size, rounding_mode="floor"),
            torch.div(lens % page_size + num_steps + page_size - 1, page_size,
                      rounding_mode="floor"))


def branch_block_table(req_table: torch.Tensor, prefix_lens: torch.Tensor, *, topk: int,
                       num_steps: int, page_size: int, num_blocks: Optional[int] = None,
                       out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Block table of every draft branch, from the requests' block table.

    req_table: ``[B, W]`` int32, the requests' rows as pages (``page_table.req_to_token_table``;
    ``W`` must cover each row's prefix pages and every branch's own pages, entries past it
    are clamped to the last column). prefix_lens: ``[B]`` int prefix lengths ``L``
    (drafts excluded). topk, num_steps, page_size: SGLang's EAGLE settings and the pool's
    page size. num_blocks: the result's width (default ``W``); out: optional
    ``[B * topk, num_blocks]`` int32 destination (static shapes: CUDA-graph safe).

    Returns ``[B * topk, num_blocks]`` int32, row ``b * topk + k`` branch ``k`` of request
    ``b``. Device ops only (no host sync).
    """
    if req_table.dim() != 2 or req_table.dtype != torch.int32:
        raise ValueError(f"req_table must be a 2-D int32 tensor, got {req_table.dtype} "
                         f"{tuple(req_table.shape)}")
    num_seqs, width_in = req_table.shape
    if prefix_lens.shape != (num_seqs,):
        raise ValueError(f"prefix_lens must have shape ({num_seqs},), got "
                         f"{tuple(prefix_lens.shape)}")
    if topk < 1 or num_steps < 1 or page_size < 1:
        raise ValueError(f"topk, num_steps and page_size must be >= 1, got {topk}, "
                         f"{num_steps}, {page_size}")
    width = out.shape[1] if out is not None else (width_in if num_blocks is None
                                                  else int(num_blocks))
    if out is not None and (out.shape[0] != num_seqs * topk or out.dtype != torch.int32):
        raise ValueError(f"out must be int32 of shape {(num_seqs * topk, width)}, got "
                         f"{out.dtype} {tuple(out.shape)}")
    if topk == 1 and width <= width_in:  # one branch: the request's own row
        table = req_table[:, :width]
        return out.copy_(table) if out is not None else table.contiguous()
    shared, own = branch_pages(prefix_lens, num_steps=num_steps, page_size=page_size)
    device = req_table.device
    p = torch.arange(width, device=device, dtype=torch.int64)
    k = torch.arange(topk, device=device, dtype=torch.int64)
    past = p[None, None, :] >= shared.to(device)[:, None, None]  # [B, 1, width]
    src = p[None, None, :] + past * (k[None, :, None] * own.to(device)[:, None, None])
    src = src.clamp_(max=max(width_in - 1, 0))  # [B, topk, width]
    table = torch.gather(req_table[:, None, :].expand(num_seqs, topk, width_in), 2, src)
    table = table.reshape(num_seqs * topk, width)
    return out.copy_(table) if out is not None else table


def _draft_window(model_runner):
    """SGLang's draft-only KV window ``(window, sink)``, ``(0, 0)`` when off or unreadable."""
    try:
        from sglang.srt.speculative.spec_utils import resolve_draft_decode_window

        return tuple(resolve_draft_decode_window(model_runner))
    except Exception:  # a mock runner without the speculative config, an older SGLang
        return (0, 0)


class HygonMultiStepDraftBackend:
    """One ``HygonAttnBackend`` per EAGLE draft decode step (``attn_backends[i]``: step
    ``i`` of ``speculative_num_steps - 1``), with the metadata of all steps built at once."""

    def __init__(self, model_runner, topk: int, speculative_num_steps: int):
        if topk < 1 or speculative_num_steps < 2:
            raise ValueError(f"a multi-step draft backend needs topk >= 1 and "
                             f"speculative_num_steps >= 2, got {topk} and "
                             f"{speculative_num_steps}")
        window = _draft_window(model_runner)
        if window[0] > 0:
            raise NotImplementedError(
                "hygon attention backend: the draft-only KV window "
                "(--speculative-draft-window-size) is not supported")
        self.topk = int(topk)
        self.speculative_num_steps = int(speculative_num_steps)
        self.device = torch.device(model_runner.device)
        # an MLA draft model (DeepSeek's MTP layer as EAGLE's draft): each step is an
        # absorbed MLA decode over the latent pool, on the same branch tables
        step_cls = HygonMLABackend if is_mla_runner(model_runner) else HygonAttnBackend
        self.attn_backends: List[HygonAttnBackend] = [
            step_cls(model_runner, draft_rows_per_request=self.topk)
            for _ in range(self.speculative_num_steps - 1)]
        first = self.attn_backends[0]
        workspaces = first._decode_workspaces
        for child in self.attn_backends[1:]:  # the steps run one after another
            child._decode_workspaces = workspaces
        self.req_to_token = first.req_to_token
        self.page_size = first.page_size
        self.max_blocks = first.max_blocks
        self._graph_max_bs = 0
        self._graph_req_table: Optional[torch.Tensor] = None
        self._graph_table: Optional[torch.Tensor] = None
        self._graph_lens: Optional[torch.Tensor] = None
        self._graph_meta: dict = {}

    # ------------------------------------------------------------------ tables

    def _request_width(self, max_prefix: Optional[int]) -> int:
        """Pages of the requests' table: every prefix page and every branch's own pages."""
        if max_prefix is None:
            return self.max_blocks
        steps, page = self.speculative_num_steps, self.page_size
        own = -(-(page - 1 + steps) // page)
        return min(self.max_blocks, -(-max_prefix // page) + self.topk * own)

    def _branch_width(self, max_prefix: Optional[int]) -> int:
        """Pages of a branch's table (prefix and every step's draft), aligned as the
        decode batches' tables are (few Triton specializations)."""
        if max_prefix is None:
            return self.max_blocks
        need = -(-(max_prefix + self.speculative_num_steps) // self.page_size)
        return warmup.aligned_table_width(need, self.max_blocks)

    def _publish(self, metas) -> None:
        for child, meta in zip(self.attn_backends, metas):
            child.forward_metadata = meta
            if child._model_heads is not None:
                child._plan(meta, *child._model_heads, extend=False)  # cached in meta.plans

    # ------------------------------------------------------------------ eager

    def init_forward_metadata(self, forward_batch) -> None:
        """Every step's metadata for one draft round: the branches' block table (shared)
        and step ``i``'s key lengths ``L + i + 1`` a branch."""
        bs = forward_batch.batch_size
        rows = forward_batch.req_pool_indices[:bs]
        prefix = forward_batch.seq_lens[:bs]
        lens_cpu = getattr(forward_batch, "seq_lens_cpu", None)
        max_prefix = int(lens_cpu[:bs].max()) if lens_cpu is not None and bs else None
        req_table = page_table.req_to_token_table(
            self.req_to_token, rows, page_size=self.page_size,
            num_blocks=self._request_width(max_prefix))
        table = branch_block_table(req_table, prefix, topk=self.topk,
                                   num_steps=self.speculative_num_steps,
                                   page_size=self.page_size,
                                   num_blocks=self._branch_width(max_prefix))
        branch_prefix = prefix.to(torch.int32).repeat_interleave(self.topk)
        metas = [HygonForwardMetadata(
            block_table=table, seq_lens=branch_prefix + (i + 1),
            max_seq_len=None if max_prefix is None else max_prefix + i + 1)
            for i in range(len(self.attn_backends))]
        self._publish(metas)

    # ------------------------------------------------------------------ CUDA graphs

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int, **kwargs) -> None:
        """Static buffers of the captured draft rounds: the requests' ``[max_bs, max_blocks]``
        and the branches' ``[max_bs * topk, max_blocks]`` tables, and ``[steps - 1,
        max_bs * topk]`` key lengths (filled with 1, the padding length)."""
        del max_num_tokens, kwargs
        self._graph_max_bs = max_bs
        self._graph_meta = {}
        rows = max_bs * self.topk
        self._graph_req_table = torch.zeros((max_bs, self.max_blocks), dtype=torch.int32,
                                            device=self.device)
        self._graph_table = torch.zeros((rows, self.max_blocks), dtype=torch.int32,
                                        device=self.device)
        self._graph_lens = torch.ones((len(self.attn_backends), rows), dtype=torch.int32,
                                      device=self.device)
        workspaces = {}  # sized for max_bs: rebuilt on (re)capture
        for child in self.attn_backends:
            child._graph_max_bs = max_bs
            child._decode_workspaces = workspaces

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        """Point every step's metadata at the static buffers (built once a batch size, at
        capture; a replay reuses it, the graph refilling the buffers)."""
        del in_capture
        if self._graph_table is None:
            raise RuntimeError("init_cuda_graph_state must run before graph metadata")
        bs = forward_batch.batch_size
        metas = self._graph_meta.get(bs)
        if metas is None:
            rows = bs * self.topk
            metas = self._graph_meta[bs] = [HygonForwardMetadata(
                block_table=self._graph_table[:rows], seq_lens=self._graph_lens[i, :rows],
                graph=True) for i in range(len(self.attn_backends))]
        self._publish(metas)

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        """Refill the static tables and key lengths from the batch (static shapes, no host
        sync; recorded into the graph)."""
        bs = forward_batch.batch_size
        rows = bs * self.topk
        prefix = forward_batch.seq_lens[:bs]
        req_table = page_table.req_to_token_table(
            self.req_to_token, forward_batch.req_pool_indices[:bs], page_size=self.page_size,
            out=self._graph_req_table[:bs])
        branch_block_table(req_table, prefix, topk=self.topk,
                           num_steps=self.speculative_num_steps, page_size=self.page_size,
                           out=self._graph_table[:rows])
        branch_prefix = prefix.to(torch.int32).repeat_interleave(self.topk)
        for i in range(len(self.attn_backends)):
            torch.add(branch_prefix, i + 1, out=self._graph_lens[i, :rows])

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1
