"""The fp8 prefix prefill through a 16-bit workspace: once a layer, the cache pages a batch
reads (with dense new keys: its prefix pages) are dequantized (``code * scale``, rounded
to q's dtype, as the reference's low-precision path rounds them) into a contiguous
workspace, and the 16-bit prefill runs on it.

Why: the fp8 prefill kernels widen every K/V tile on the producers, once per (tile of
queries, KV head) that reads it, and that widening bounds them (0.74-0.77x the bf16
prefill's TFLOP/s, ``docs/benchmarks.md``); beside dense new keys the native kernel takes
no fp8 cache at all, so SGLang's fp8 extend ran the Triton prefill. Through the workspace
both run the 16-bit kernels; with no prefix there is nothing to dequantize.

The workspace table has the block table's shape: entry ``(b, j)`` is workspace page ``w``
for a page the batch reads (``j < cdiv(Lk_b, P)``, ``Lk_b`` the prefix with dense new
keys) whose id is valid, ``-1`` otherwise (an absent page stays absent). Built from the
lengths' host copies at plan time; the page map (workspace page -> cache block) is
gathered from the block table on the device, no sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

import torch

from hygon_attn_backend.ops import _checks


def use_workspace(*, num_seqs: int, pages: int) -> bool:
    """Whether an fp8 batch runs through the workspace under ``fp8_workspace=None``: when
    it has no page to dequantize (dense new keys and no prefix, SGLang's extend of a new
    prompt). The layers then run the 16-bit kernels on the dense keys, as for a 16-bit
    cache (on sm_90 the native prefill, which reads no fp8 beside dense keys), where they
    ran the fp8 Triton prefill: on the H200 the bf16 native prefill ran 74.5-74.8% of the
    matmul and the e4m3 Triton one 36.1-37.1% at (1, 0 + 8k) and (4, 16k + 1k)
    (``docs/benchmarks.md``, 2026-12-04).

    With pages to dequantize the pass moves 3 bytes an element of them (1 read, 2 written)
    and the 16-bit prefill then reads 2 where the fp8 one reads 1; the products cost
    ``2 * Lq * G`` FLOPs an element for ``Lq`` queries of ``G`` heads a KV head, so the pass
    over the prefill's time is about ``2 * eff * ridge / (Lq * G)`` (``ridge`` 185 FLOP a
    byte on the H200, ``eff`` about 0.7): 25% at 1,024 rows a request, 6% at 4,096. That
    pass has not been timed beside the native fp8 prefill (1.3x the bf16 time) yet, so the
    rule does not take it; ``fp8_workspace=True`` does (``bench prefill --fp8-workspace
    auto,on,off`` times both).
    """
    return num_seqs > 0 and pages == 0


@dataclass(eq=False)
class Workspace:
    """The workspace of one plan: which table entries it holds, its buffers (allocated at
    the first layer, reused by every layer: a plan's layers run one after another on one
    stream) and the 16-bit layers over them.

    rows / cols: ``[W]`` int64 device, the table entry of each workspace page.
    """

    rows: torch.Tensor
    cols: torch.Tensor
    num_seqs: int
    width: int
    page_size: int
    #: the pages are the prefix's (planned for dense new keys): a call must pass k_new
    prefix_only: bool = False
    _bufs: Optional[tuple] = None
    _table: Optional[tuple] = None  # (block_table, page_map, ws_table) of the last table
    _layers: Dict[int, tuple] = field(default_factory=dict, repr=False)

    @property
    def num_pages(self) -> int:
        return int(self.rows.shape[0])

    def tables(self, block_table: torch.Tensor, num_blocks: int):
        """``(page_map [W] int64, ws_table [B, width] int32)`` for ``block_table`` (kept
        while the same tensor comes back: every layer of a step passes it)."""
        if self._table is not None and self._table[0] is block_table:
            return self._table[1], self._table[2]
        ids = block_table[self.rows, self.cols].to(torch.int64)
        valid = (ids >= 0) & (ids < num_blocks)
        page_map = torch.where(valid, ids, -1)
        dst = torch.arange(self.num_pages, device=ids.device, dtype=torch.int32)
        ws_table = torch.full((self.num_seqs, self.width), -1, dtype=torch.int32,
                              device=ids.device)
        ws_table[self.rows, self.cols] = torch.where(valid, dst, -1)
        self._table = (block_table, page_map, ws_table)
        return page_map, ws_table

    def buffers(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device):
        shape = (self.num_pages, num_kv_heads, self.page_size, head_dim)
        if self._bufs is None or self._bufs[0].shape != shape or self._bufs[0].dtype != dtype:
            self._bufs = (torch.empty(shape, dtype=dtype, device=device),
                          torch.empty(shape, dtype=dtype, device=device))
            self._layers.clear()
        return self._bufs

    def layer_for(self, layer, block_table: torch.Tensor, q_dtype: torch.dtype, make_shadow):
        """Fill the workspace from ``layer``'s fp8 caches (two launches) and return
        ``(16-bit layer over it, ws_table)``; ``make_shadow(layer, ws_k, ws_v)`` builds
        that layer once per buffers (the plan's ``PrefillLayer`` with ``layer``'s options)."""
        k_cache, v_cache = layer.k_cache, layer.v_cache
        _, hkv, page, dim = k_cache.shape
        ws_k, ws_v = self.buffers(hkv, dim, q_dtype, k_cache.device)
        page_map, ws_table = self.tables(block_table, k_cache.shape[0])
        for src, dst, sc in ((k_cache, ws_k, layer.k_scale), (v_cache, ws_v, layer.v_scale)):
            dequant_pages(src, dst, page_map, sc)
        entry = self._layers.get(id(layer))
        if entry is None or entry[0] is not layer:
            entry = self._layers[id(layer)] = (layer, make_shadow(layer, ws_k, ws_v))
        return entry[1], ws_table


def page_counts(host_lens: Sequence[int], page_size: int, width: int) -> list:
    """Pages each request reads: ``min(cdiv(Lk_b, P), width)`` (a negative length: 0)."""
    return [min(-(-max(int(lk), 0) // page_size), width) for lk in host_lens]


def build(counts: Sequence[int], *, page_size: int, width: int, device,
          prefix_only: bool = False) -> Workspace:
    """The workspace map of a batch: request ``b`` reads table columns
    ``0 .. counts[b] - 1`` (:func:`page_counts`)."""
    rows, cols = [], []
    for b, n in enumerate(counts):
        rows += [b] * n
        cols += range(n)
    both = torch.tensor([rows, cols], dtype=torch.int64).to(device, non_blocking=True)
    return Workspace(rows=both[0], cols=both[1], num_seqs=len(counts), width=width,
                     page_size=page_size, prefix_only=prefix_only)


def dequant_pages(src: torch.Tensor, dst: torch.Tensor, page_map: torch.Tensor,
                  scale) -> None:
    """``dst[w] = src[page_map[w]] * scale`` in ``dst``'s dtype, for ``page_map[w] >= 0``.

    src: ``[num_blocks, H, P, D]`` fp8 view (any strides); dst: ``[W, H, P, D]``
    contiguous 16-bit; page_map: ``[W]`` int64; scale: float, float32 tensor of 1 or ``H``
    elements (per KV head) or None (1)."""
    from hygon_attn_backend.kernels.fp8_workspace import dequant_pages_kernel
    from hygon_attn_backend.ops._device import next_pow2

    num_pages, hkv, page, dim = dst.shape
    if num_pages == 0 or hkv == 0:
        return
    from_ptr = isinstance(scale, torch.Tensor)
    block_d = max(16, next_pow2(dim))
    block_p = max(1, min(next_pow2(page), 4096 // block_d))
    dequant_pages_kernel[(num_pages, hkv)](
        src, dst, page_map, scale if from_ptr else page_map,
        1.0 if from_ptr or scale is None else float(scale), _checks.scale_head_stride(scale),
        *src.stride(), hkv,
        PAGE=page, HEAD_DIM=dim, BLOCK_P=block_p, BLOCK_D=block_d,
        SCALE_FROM_PTR=from_ptr, num_warps=4)


__all__ = ["Workspace", "build", "use_workspace", "dequant_pages", "page_counts"]
