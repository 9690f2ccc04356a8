"""Start-up warm-up of the prefix-prefill kernel for SGLang: no Triton compile after serving
starts.

Decode kernels compile while SGLang captures its decode CUDA graphs; nothing does that
for extend, so the first request of each new shape used to compile
``prefix_prefill_kernel`` (about a second on the H200's host) inside a live request.
:func:`warm_up_prefill` runs the prefill plan and kernel once on tiny dummy data for every
specialization an engine can reach with this model:

* each tile config :func:`ops.prefill.tuning.tile_config` can return for the model's head
  layout and the device (:func:`prefill_tile_configs`);
* with and without the new-token K/V path (``HAS_K_NEW``: SGLang passes the new K/V, a
  layer may pass None);
* each distinct set of the layers' compile-time options (causal, sliding window, soft cap,
  fp8 KV), taken from the model's own attention layers;
* each class of block-table width Triton specializes on (its row stride: ``== 1``,
  a multiple of 16, other): the backend rounds the table width up to a multiple of
  ``TABLE_WIDTH_ALIGN`` (capped at the row capacity), so only ``TABLE_WIDTH_ALIGN`` and
  the capacity itself occur (:func:`table_widths`);
* on a GPU, the plan an extend batch gets with no tile forced, once per layer variant:
  on sm_90 the native kernel, so its extension is built (first use on the machine) and
  loaded at start-up.

The K/V views are the pool's own (read, never written; block 0 is SGLang's padding page),
so pointer alignment and strides match the engine's. Per-call pointers and strides of
``q`` / ``k_new`` / ``out`` follow SGLang's ``[tokens, heads * D]`` rows.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable, List, Optional, Sequence, Tuple

import torch

from hygon_attn_backend.ops._device import head_tile
from hygon_attn_backend.ops.prefill import tuning
from hygon_attn_backend.ops.prefill import plan_prefix_prefill

logger = logging.getLogger(__name__)

#: block-table widths are rounded up to a multiple of this (a Triton ``% 16`` class)
TABLE_WIDTH_ALIGN = 16


def aligned_table_width(num_blocks: int, max_blocks: int) -> int:
    """``num_blocks`` rounded up to a multiple of :data:`TABLE_WIDTH_ALIGN`, at most
    ``max_blocks``: the table's row stride then takes one of two values' Triton classes
    (see :func:`table_widths`). The extra columns are never read (keys past a request's
    length are masked), and cost a few bytes of gather per request."""
    width = -(-max(1, int(num_blocks)) // TABLE_WIDTH_ALIGN) * TABLE_WIDTH_ALIGN
    return min(int(max_blocks), width)


def table_widths(max_blocks: int) -> List[int]:
    """The block-table widths :func:`aligned_table_width` can produce, one per distinct
    Triton specialization class of the width (``1``, multiple of 16, other)."""
    widths = sorted({min(TABLE_WIDTH_ALIGN, int(max_blocks)), int(max_blocks)})
    seen, out = set(), []
    for w in widths:
        cls = "1" if w == 1 else ("D" if w % 16 == 0 else "")
        if cls not in seen:
            seen.add(cls)
            out.append(w)
    return out


def prefill_tile_configs(*, num_q_heads: int, num_kv_heads: int, head_dim: int,
                         num_sms: int, interpreter: bool = False) -> List[Tuple[int, ...]]:
    """Every ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` that
    :func:`ops.prefill.tuning.tile_config` returns for this head layout on a device with
    ``num_sms`` multiprocessors, for any batch (smallest tile first).

    The rule depends on the batch only through ``total_q`` (new tokens) and ``num_seqs``,
    through program counts that grow with both, and steps up to larger tiles as they grow
    (each tile on one interval of ``total_q``); it returns its largest tile once the
    256-row tiles alone fill the SMs. So for each ``num_seqs`` up to the count whose extra
    tiles alone fill the SMs, the tiles along ``total_q`` (from ``num_seqs`` to the count
    whose 256-row tiles fill the SMs) are found by bisecting for each change.
    """
    group = num_q_heads // num_kv_heads
    head_dim_pad = head_tile(head_dim, device=torch.device("cpu" if interpreter else "cuda"))
    kv = max(1, num_kv_heads)
    max_seqs = -(-num_sms // kv) + 1
    max_tokens = -(-num_sms // kv) * -(-256 // max(1, group)) + 256
    found: List[Tuple[int, ...]] = []
    for num_seqs in range(1, max_seqs + 1):
        def tile_at(total_q, num_seqs=num_seqs):
            return tuple(tuning.tile_config(
                head_dim_pad=head_dim_pad, group=group, total_q=total_q,
                num_kv_heads=num_kv_heads, num_seqs=num_seqs, num_sms=num_sms,
                interpreter=interpreter))
        for cfg in _values_along(tile_at, num_seqs, max(num_seqs, max_tokens)):
            if cfg not in found:
                found.append(cfg)
    return found


def _values_along(value_at: Callable[[int], tuple], lo: int, hi: int) -> List[tuple]:
    """The values of ``value_at(t)`` for ``lo <= t <= hi``, for a function that takes each
    value on one interval of ``t``: one bisection per change of value."""
    values = []
    t = lo
    while True:
        current = value_at(t)
        values.append(current)
        if value_at(hi) == current:
            return values
        a, b = t, hi  # value_at(a) == current != value_at(b)
        while b - a > 1:
            mid = (a + b) // 2
            if value_at(mid) == current:
                a = mid
            else:
                b = mid
        t = b


def layer_variants(states: Iterable) -> list:
    """One representative of each distinct set of compile-time layer options among the
    layers' ``_LayerState`` s (causal, sliding window on, soft cap on, fp8-scaled KV)."""
    seen, out = set(), []
    for st in states:
        key = (st.num_heads, st.num_kv_heads, st.head_dim, bool(st.causal),
               st.sliding_window is not None, st.soft_cap is not None,
               st.k_scale is not None, st.k_view.dtype)
        if key not in seen:
            seen.add(key)
            out.append(st)
    return out


def warm_up_prefill(states: Sequence, *, q_dtype: torch.dtype, page_size: int,
                    max_blocks: int, device: torch.device, num_sms: int,
                    impl: str = "triton", run: Optional[Callable] = None) -> List[tuple]:
    """Run the prefill plan and kernel once per specialization (module docstring).

    states: the model's attention layers as ``_LayerState`` (``num_heads``,
    ``num_kv_heads``, ``head_dim``, ``scale``, ``causal``, ``sliding_window``, ``soft_cap``,
    ``k_scale``, ``v_scale``, ``k_view`` / ``v_view`` ``[num_blocks, Hkv, P, D]``).
    q_dtype: the model's dtype. max_blocks: the block table's row capacity.
    run: ``run(plan, **launch_kwargs)`` (default ``plan.run``; tests pass a recorder).
    Returns the ``(tile, has_k_new, table width, layer options)`` keys it ran, in order.
    """
    run = run or (lambda plan, **kw: plan.run(**kw))
    done: List[tuple] = []
    t0 = time.perf_counter()
    for st in layer_variants(states):
        hq, hkv, d = st.num_heads, st.num_kv_heads, st.head_dim
        tiles = prefill_tile_configs(num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                     num_sms=num_sms)
        # SGLang's rows: q [tokens, Hq * D], k/v [tokens, Hkv * D] (one token here)
        q = torch.zeros((1, hq * d), dtype=q_dtype, device=device).view(-1, hq, d)
        k_new = torch.zeros((1, hkv * d), dtype=q_dtype, device=device).view(-1, hkv, d)
        out = torch.empty_like(q)
        cu = torch.tensor([0, 1], dtype=torch.int32, device=device)
        lens = torch.ones((1,), dtype=torch.int32, device=device)
        opts = (hq, hkv, d, st.causal, st.sliding_window, st.soft_cap)

        def plan_for(tile, has_new, width):
            return plan_prefix_prefill(
                cu, lens, total_q=1, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                tile=tile, host_cu_seqlens_q=[0, 1], host_seq_lens_k=[1],
                capacity=width * page_size, has_k_new=has_new, q_dtype=q_dtype,
                kv_dtype=st.k_view.dtype, impl=impl)

        def launch(plan, has_new, table):
            run(plan, q=q, k_cache=st.k_view, v_cache=st.v_view, block_table=table,
                cu_seqlens_q=cu, seq_lens_k=lens, scale=st.scale, causal=st.causal,
                k_new=k_new if has_new else None, v_new=k_new if has_new else None,
                out=out, k_scale=st.k_scale, v_scale=st.v_scale,
                sliding_window=st.sliding_window, soft_cap=st.soft_cap)

        tables = {w: torch.zeros((1, w), dtype=torch.int32, device=device)
                  for w in table_widths(max_blocks)}
        for width, table in tables.items():
            for tile in tiles:
                for has_new in (True, False):
                    launch(plan_for(tile, has_new, width), has_new, table)
                    done.append((tile, has_new, width, opts))
        if device.type == "cuda":
            # the plan an extend batch gets (no tile forced): on sm_90 the native kernel,
            # whose extension builds on first use: here at start-up, not in a request
            width = max(tables)
            plan = plan_for(None, True, width)
            if plan.impl == "native":
                launch(plan, True, tables[width])
                done.append(("native", True, width, opts))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    logger.info("hygon: prefill warm-up ran %d kernel specializations in %.1f s", len(done),
                time.perf_counter() - t0)
    return done
