"""Plan once per step, launch per layer: the prefix-prefill plan.

:func:`plan_prefix_prefill` builds the ``(request, m_block)`` tile map of a ragged batch and
chooses the tile config, once per step; :meth:`PrefillPlan.run`, once per layer, checks
only what a layer can change and launches ``kernels.prefill.prefix_prefill_kernel``.

The tile map can be built on the device with a few tensor ops and no host sync, over a
grid bounded from shapes alone (``cdiv(total_q, TOK_M) + B`` tiles), so an engine can plan
outside a captured CUDA graph; given the host copies of the lengths (engines have them) it
is built on the host, its values checked there, and copied over once.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence

import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops import _checks
from hygon_attn_backend.ops._interpreter import triton_computes
from hygon_attn_backend.ops._launch import intern_key, remember_layer, value_or_id
from hygon_attn_backend.ops.prefill import native, triton, tuning
from hygon_attn_backend.ops.prefill import workspace as workspace_mod
from hygon_attn_backend.ops.tree_mask import check_tree_mask

__all__ = ["PrefillPlan", "PrefillLayer", "plan_prefix_prefill", "check_host_lengths"]

ScaleLike = _checks.ScaleLike

def tile_map(cu: torch.Tensor, num_seqs: int, tok_m: int, max_tiles: int):
    """``(tile_req, tile_mblock)`` int32 ``[max_tiles]`` on ``cu``'s device (no sync).

    Request ``b`` owns ``cdiv(Lq_b, tok_m)`` consecutive tiles, its heaviest m-block
    first; slots past the last request's tiles get ``tile_req = -1``.
    """
    len_q = cu[1:] - cu[:-1]  # [B]
    tiles = torch.div(len_q + (tok_m - 1), tok_m, rounding_mode="floor").clamp_(min=0)
    ends = torch.cumsum(tiles, 0)  # [B]
    t = torch.arange(max_tiles, device=cu.device, dtype=torch.int64)
    req = torch.searchsorted(ends, t, right=True)  # first request whose tiles end past t
    if num_seqs == 0:
        return (torch.full_like(t, -1, dtype=torch.int32),
                torch.zeros_like(t, dtype=torch.int32))
    req_c = req.clamp(max=num_seqs - 1)
    mblock = ends[req_c] - 1 - t  # heaviest m-block of each request first
    used = req < num_seqs
    tile_req = torch.where(used, req, -1).to(torch.int32)
    tile_mblock = torch.where(used, mblock, 0).to(torch.int32)
    return tile_req, tile_mblock


_DESCENDING = array("i")  # n - 1, ..., 1, 0 for the largest n seen so far


def _descending(n: int) -> array:
    """``array('i', [n - 1, ..., 0])`` as a slice of one cached run (no Python loop)."""
    global _DESCENDING
    if len(_DESCENDING) < n:
        _DESCENDING = array("i", range(max(n, 2 * len(_DESCENDING)) - 1, -1, -1))
    return _DESCENDING[len(_DESCENDING) - n:]


def tile_map_host(cu: Sequence[int], tok_m: int, max_tiles: int) -> torch.Tensor:
    """:func:`tile_map` from host values: ``[2, max_tiles]`` int32 CPU.

    Built from ``array`` slices, one C-level copy per request: a batch of 64 requests of 4k
    tokens has 8k tiles, and per-element Python lists turned into a tensor cost 2-3 ms of
    host time per step.
    """
    req = array("i")
    mblock = array("i")
    for b in range(len(cu) - 1):
        n = max(0, -(-(int(cu[b + 1]) - int(cu[b])) // tok_m))
        req += array("i", [b]) * n
        mblock += _descending(n)
    del req[max_tiles:], mblock[max_tiles:]
    pad = max_tiles - len(req)
    req += array("i", [-1]) * pad
    mblock += array("i", [0]) * pad
    if not max_tiles:
        return torch.empty((2, 0), dtype=torch.int32)
    return torch.frombuffer(req + mblock, dtype=torch.int32).view(2, max_tiles)


def check_host_lengths(cu: Sequence[int], lens_k: Sequence[int], *, total_q: int,
                       capacity: Optional[int] = None, has_k_new: bool = False) -> None:
    """Check the index values of a batch from host lists (no device access).

    cu: ``cu_seqlens_q`` values (``B + 1``); lens_k: ``seq_lens_k`` values (``B``);
    capacity: tokens a block-table row holds (``max_blocks * page_size``), if known: it
    must hold every key, or only the prefix when the new keys come as ``k_new``.
    """
    if len(cu) and int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens_q must start at 0, got {list(cu[:4])}...")
    for b in range(len(cu) - 1):
        if cu[b + 1] < cu[b]:
            raise ValueError(f"cu_seqlens_q must be non-decreasing, got cu_seqlens_q[{b}]="
                             f"{int(cu[b])} > cu_seqlens_q[{b + 1}]={int(cu[b + 1])}")
    if len(cu) and int(cu[-1]) != total_q:
        raise ValueError(f"cu_seqlens_q[-1] ({int(cu[-1])}) must equal q.shape[0] ({total_q})")
    for b, lk in enumerate(lens_k):
        if lk < cu[b + 1] - cu[b]:
            raise ValueError(f"seq_lens_k[{b}]={int(lk)} is shorter than request {b}'s query "
                             f"length {int(cu[b + 1] - cu[b])} (a query cannot exceed its KV "
                             "length)")
    if capacity is not None and len(lens_k):
        paged = [lk - (cu[b + 1] - cu[b]) if has_k_new else lk for b, lk in enumerate(lens_k)]
        if max(paged) > capacity:
            raise ValueError(f"the block table holds at most {capacity} tokens per request, "
                             f"but seq_lens_k needs {int(max(paged))}")


def check_prefill_options(*, scale, sliding_window, soft_cap) -> None:
    """The per-layer scalar options of prefill."""
    _checks.check_softmax_scale(scale)
    if sliding_window is not None and int(sliding_window) <= 0:
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
    _checks.soft_cap_value(soft_cap)


class PrefillLayer:
    """One layer's side of a prefix-prefill launch, resolved once: its K/V cache views,
    softmax scale, causality, fp8 scales, window, soft cap and sinks, with the launch
    arguments they give (cache strides, scale pointers, part of the variant's key).
    Independent of the batch: an engine builds one per layer and passes it to every
    step's :meth:`PrefillPlan.run_layer` (rebuilt when the caches or options change).
    The tensors' addresses are read once (the binding holds the tensors): a cache whose
    storage is replaced in place (``set_``, a resize) needs a new binding.

    k_cache / v_cache: ``[num_blocks, num_kv_heads, page_size, head_dim]`` views; the
    options as in :func:`ops.prefill.prefix_prefill_attention`.
    """

    __slots__ = ("k_cache", "v_cache", "scale", "causal", "k_scale", "v_scale",
                 "sliding_window", "soft_cap", "sinks", "key", "variant", "args", "native_why",
                 "native_scales")

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                 scale: Optional[float] = None, causal: bool = True, k_scale: ScaleLike = None,
                 v_scale: ScaleLike = None, sliding_window: Optional[int] = None,
                 soft_cap: Optional[float] = None, sinks: Optional[torch.Tensor] = None):
        _checks.check_softmax_scale(scale)
        soft_cap = _checks.soft_cap_value(soft_cap)
        self.k_cache, self.v_cache, self.scale, self.causal = k_cache, v_cache, scale, causal
        self.k_scale, self.v_scale = k_scale, v_scale
        self.sliding_window, self.soft_cap, self.sinks = sliding_window, soft_cap, sinks
        quant = k_cache.dtype in _checks.FP8_DTYPES
        from_ptr, ks, vs, ksv, vsv = _checks.scale_launch_args(k_scale, v_scale,
                                                               k_cache.device, used=quant)
        self.key = (k_cache.dtype, k_cache.shape[2], bool(causal), quant, from_ptr,
                    sliding_window if causal else None, soft_cap, sinks is not None, scale)
        self.variant = intern_key(self.key)
        self.args = triton.layer_args(k_cache, v_cache, sinks, ks, vs, ksv, vsv)
        # why the native prefill cannot read these caches (None: it can)
        self.native_why = (native.layer_unsupported(k_cache, v_cache)
                           if k_cache.device.type == "cuda" else "CPU caches")
        self.native_scales = (native.fp8_scales(k_scale, v_scale) if quant
                              else (None, None, 1.0, 1.0))


@dataclass(eq=False)
class PrefillPlan:
    """Tile schedule and launch config of one batch (reused by every layer).

    tile_req: ``[max_tiles]`` int32 request of each tile, ``-1`` for an unused slot.
    tile_mblock: ``[max_tiles]`` int32 m-block of each tile inside its request (the
       heaviest m-blocks of a request come first).
    ``max_tiles = cdiv(total_q, block_m // group) + num_seqs`` (a bound from shapes only).
    cu_seqlens_q, seq_lens_k: the batch's tensors (a layer's call passes these same ones).
    """

    tile_req: torch.Tensor
    tile_mblock: torch.Tensor
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group: int
    total_q: int
    num_seqs: int
    cu_seqlens_q: Optional[torch.Tensor] = None
    seq_lens_k: Optional[torch.Tensor] = None
    num_kv_heads: int = 0
    head_dim: int = 0
    impl: str = "triton"
    #: what the caller asked for: a plan of ``"auto"`` that chose native runs Triton for a
    #: layer or call the native kernel does not cover; one of ``"native"`` raises instead
    impl_requested: str = "auto"
    #: impl "native": the persistent launch's int32 ``[2]`` work counter (zeros between
    #: launches; a plan's launches run one after another on one stream)
    sched: Optional[torch.Tensor] = None
    #: the Triton kernel's second unmasked walk forced on / off (None: ``tuning.two_walks``)
    two_walks: Optional[bool] = None
    #: ``[total_q, W]`` int32 packed tree mask of a speculative verify batch (``ops/tree_mask.py``),
    #: read by every layer's launch; None: the causal mask
    tree_mask: Optional[torch.Tensor] = None
    #: fp8 caches: the 16-bit workspace the layers' pages are dequantized into
    #: (``workspace.py``), or None: the kernels widen the fp8 tiles themselves
    workspace: Optional[workspace_mod.Workspace] = None
    _variants: Dict[tuple, object] = field(default_factory=dict, repr=False)
    # the layers :meth:`run` built (see _launch.remember_layer)
    _layers: Dict[tuple, "PrefillLayer"] = field(default_factory=dict, repr=False)

    @property
    def num_launches(self) -> int:
        return 1 if self.impl in ("triton", "native") and self.total_q and \
            self.tile_req.shape[0] else 0

    def check_call(self, q, k_cache, cu_seqlens_q, seq_lens_k) -> None:
        """What a layer may get wrong against the plan (cheap: no tensor checks)."""
        num_q_heads = self.group * self.num_kv_heads
        if q.shape[0] != self.total_q or (self.num_kv_heads and (
                q.shape[1] != num_q_heads or q.shape[2] != self.head_dim
                or k_cache.shape[1] != self.num_kv_heads)):
            raise ValueError(f"plan was built for total_q={self.total_q}, {num_q_heads} query "
                             f"/ {self.num_kv_heads} kv heads, head_dim {self.head_dim}; got q "
                             f"{_checks.describe(q)}, k_cache {_checks.describe(k_cache)}")
        if q.shape[1] // k_cache.shape[1] != self.group or cu_seqlens_q.shape[0] - 1 != \
                self.num_seqs:
            raise ValueError(f"plan was built for group={self.group}, total_q={self.total_q}, "
                             f"num_seqs={self.num_seqs}; this call has group="
                             f"{q.shape[1] // k_cache.shape[1]}, total_q={q.shape[0]}, "
                             f"num_seqs={cu_seqlens_q.shape[0] - 1}")
        if self.cu_seqlens_q is not None and (cu_seqlens_q is not self.cu_seqlens_q
                                              or seq_lens_k is not self.seq_lens_k):
            raise ValueError("plan: cu_seqlens_q and seq_lens_k must be the tensors the plan "
                             "was built with")

    def run(self, q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, *, scale=None,
            causal=True, k_new=None, v_new=None, out=None, return_lse=False, k_scale=None,
            v_scale=None, sliding_window=None, soft_cap=None, sinks=None):
        """Launch for one layer (arguments as :func:`ops.prefill.prefix_prefill_attention`,
        already checked; call it through that op with ``plan=``)."""
        key = (id(k_cache), id(v_cache), scale, bool(causal), value_or_id(k_scale),
               value_or_id(v_scale), sliding_window, soft_cap, id(sinks))
        layer = self._layers.get(key)
        if layer is None:
            layer = remember_layer(self._layers, key, PrefillLayer(
                k_cache, v_cache, scale=scale, causal=causal, k_scale=k_scale,
                v_scale=v_scale, sliding_window=sliding_window, soft_cap=soft_cap,
                sinks=sinks))
        return self.run_layer(layer, q, block_table, cu_seqlens_q, seq_lens_k, k_new=k_new,
                              v_new=v_new, out=out, return_lse=return_lse)

    def run_layer(self, layer: "PrefillLayer", q, block_table, cu_seqlens_q, seq_lens_k, *,
                  k_new=None, v_new=None, out=None, return_lse=False):
        """Launch for one layer whose side of the call (caches, options, scales) was
        resolved once in ``layer``; the per-call tensors as in :meth:`run`. What an engine
        calls per layer; it keeps each layer's :class:`PrefillLayer` across steps."""
        if out is None:
            out = torch.empty_like(q)
        if self.tree_mask is not None and (not layer.causal or layer.sliding_window):
            raise ValueError(f"a tree mask needs a causal layer without a sliding window, got "
                             f"causal={layer.causal}, sliding_window={layer.sliding_window}")
        if self.impl == "reference":
            return _run_reference(layer, q, block_table, cu_seqlens_q, seq_lens_k,
                                  k_new=k_new, v_new=v_new, out=out, return_lse=return_lse,
                                  tree_mask=self.tree_mask)
        if self.workspace is not None and layer.k_cache.dtype in _checks.FP8_DTYPES and \
                q.dtype in (torch.float16, torch.bfloat16):
            if self.workspace.prefix_only and k_new is None:
                raise ValueError("this plan's fp8 workspace holds the prefix pages only (planned "
                                 "with has_k_new=True): the call must pass k_new / v_new")
            shadow, ws_table = self.workspace.layer_for(layer, block_table, q.dtype,
                                                        _shadow_layer)
            return self.run_layer(shadow, q, ws_table, cu_seqlens_q, seq_lens_k, k_new=k_new,
                                  v_new=v_new, out=out, return_lse=return_lse)
        lse = (torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device)
               if return_lse else None)
        if self.tile_req.shape[0] == 0 or self.total_q == 0:
            return (out, lse) if return_lse else out
        if self.impl == "native":
            why = layer.native_why or native.call_unsupported(q, out, k_new, v_new,
                                                              layer.k_cache.dtype)
            if why is None:
                native.launch(
                    out, q, layer.k_cache, layer.v_cache, block_table, cu_seqlens_q, seq_lens_k,
                    self.tile_req, self.tile_mblock, self.sched,
                    scale=layer.scale if layer.scale is not None else 1.0 / math.sqrt(q.shape[2]),
                    causal=layer.causal, k_new=k_new, v_new=v_new, lse=lse, sinks=layer.sinks,
                    soft_cap=layer.soft_cap, sliding_window=layer.sliding_window,
                    scales=layer.native_scales)
                return (out, lse) if return_lse else out
            if self.impl_requested == "native":
                raise ValueError(f"impl='native' does not cover this call: {why}")
            # impl="auto" chose native for the batch: this layer runs Triton on the same map
        # the variant: the layer's (interned) key and what the call decides (q's dtype and
        # head size, K/V given with the call, the LSE asked for)
        variant = (layer.variant, q.dtype, q.shape[2], k_new is not None, return_lse)
        launch = self._variants.get(variant)
        if launch is None:
            check_prefill_options(scale=layer.key[8], sliding_window=layer.key[5],
                                  soft_cap=layer.key[6])
            # a plan built without q's dtype: the interpreter's bf16 probe, once a variant
            launch = self._variants[variant] = triton.make_launch(
                self, q.dtype, q.shape[2], k_new is not None, bool(return_lse), *layer.key,
                cu_seqlens_q, seq_lens_k, layer.k_cache) \
                if triton_computes(q.dtype) else _REFERENCE
        if launch is _REFERENCE:
            return _run_reference(layer, q, block_table, cu_seqlens_q, seq_lens_k,
                                  k_new=k_new, v_new=v_new, out=out, return_lse=return_lse,
                                  tree_mask=self.tree_mask)
        triton.run(launch, layer.args, q, block_table, k_new, v_new, out, lse,
                   self.tile_req)
        return (out, lse) if return_lse else out


_REFERENCE = "reference"  # a variant the reference serves (_interpreter.triton_computes)


def _run_reference(layer: "PrefillLayer", q, block_table, cu_seqlens_q, seq_lens_k, *,
                   k_new, v_new, out, return_lse, tree_mask):
    return reference.prefix_prefill_attention(
        q, layer.k_cache, layer.v_cache, block_table, cu_seqlens_q, seq_lens_k,
        scale=layer.scale, causal=layer.causal, k_new=k_new, v_new=v_new, out=out,
        return_lse=return_lse, k_scale=layer.k_scale, v_scale=layer.v_scale,
        sliding_window=layer.sliding_window, soft_cap=layer.soft_cap, sinks=layer.sinks,
        tree_mask=tree_mask)


def plan_prefix_prefill(cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor, *,
                        total_q: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                        tile: Optional[tuple] = None,
                        host_cu_seqlens_q: Optional[torch.Tensor] = None,
                        host_seq_lens_k: Optional[torch.Tensor] = None,
                        capacity: Optional[int] = None, has_k_new: bool = False,
                        q_dtype: Optional[torch.dtype] = None,
                        kv_dtype: Optional[torch.dtype] = None,
                        two_walks: Optional[bool] = None,
                        tree_mask: Optional[torch.Tensor] = None,
                        fp8_workspace: Optional[bool] = None,
                        page_size: Optional[int] = None, max_blocks: Optional[int] = None,
                        impl: str = "auto") -> PrefillPlan:
    """Plan prefix prefill for one ragged batch (once per step; every layer reuses it).

    cu_seqlens_q: ``[B + 1]`` int32/int64; seq_lens_k: ``[B]`` int32/int64 (the layers'
    calls pass these same tensors). total_q, num_q_heads, num_kv_heads, head_dim: the
    shapes of ``q`` and the caches. tile: optional ``(BLOCK_M, BLOCK_N, num_warps,
    num_stages)`` forcing the Triton tile (else :func:`tuning.tile_config`).
    host_cu_seqlens_q / host_seq_lens_k: the same values on the host (list or CPU tensor),
    if the caller has them (engines do): the values are then checked here (``capacity``:
    tokens per block-table row, ``max_blocks * page_size``) and the tile map is built on the
    host and copied over once; without them it is built on the device with no host sync
    (safe before capturing a graph), and nothing is checked.
    has_k_new: the layers' calls pass the new tokens' K/V dense (``k_new``/``v_new``): the
    host check then bounds only the prefix by ``capacity``, and with an fp8 cache
    ``"auto"`` plans Triton (the native prefill reads the keys from an fp8 cache only).
    q_dtype: the queries' dtype, if known (float32 runs the reference with ``"auto"``).
    kv_dtype: the KV cache's dtype, if known.
    impl: ``"auto"`` | ``"triton"`` | ``"native"`` | ``"reference"``. ``"native"`` is the
    sm_90a wgmma kernel (``csrc/prefill_sm90.cu``: head_dim 128, fp16/bf16 q, KV of q's
    dtype or fp8, tiles of 128 rows); on a GPU without it (HIP, not sm_90) it runs Triton,
    as the engines pass one ``HYGON_ATTN_IMPL`` to every op; on an sm_90 GPU a call it does
    not cover raises.
    ``"auto"`` takes it where :func:`tuning.native_preferred` says so, unless ``tile``
    forces a Triton tile of another height.
    two_walks: force the Triton kernel's second unmasked walk on or off (None:
    :func:`tuning.two_walks`; tests and benchmarks).
    fp8_workspace: with an fp8 cache (``kv_dtype``) and the host lengths, ``page_size`` and
    ``max_blocks`` (the block table's width) given: True runs the layers through the
    16-bit workspace (``workspace.py``: the pages dequantized once a layer, then the
    16-bit kernels), False never, None where :func:`workspace.use_workspace` says so (no
    page to dequantize: dense new keys without a prefix).
    tree_mask: ``[total_q, W]`` int32 packed tree mask of a speculative verify batch
    (``ops.tree_mask``: new token ``i`` sees the prefix and the new tokens its row's bits
    name, in place of the causal rule; causal layers without a window). The plan keeps the
    tensor: every layer reads it, and a CUDA graph replays it refilled in place. It runs
    the Triton kernel (the native prefill has the causal and window masks only).
    """
    _checks.check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=_checks.INDEX_DTYPES)
    num_seqs = cu_seqlens_q.shape[0] - 1
    _checks.check_tensor("seq_lens_k", seq_lens_k, ndim=1, dtypes=_checks.INDEX_DTYPES,
                         shape=(num_seqs,))
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    group = num_q_heads // num_kv_heads
    device = cu_seqlens_q.device
    if tree_mask is not None:
        check_tree_mask(tree_mask, total_q=total_q, device=device,
                        host_cu_seqlens_q=None if host_cu_seqlens_q is None
                        else _host_list(host_cu_seqlens_q))
    ws = _fp8_workspace(fp8_workspace, host_cu_seqlens_q, host_seq_lens_k, kv_dtype=kv_dtype,
                        q_dtype=q_dtype, impl=impl, has_k_new=has_k_new, num_seqs=num_seqs,
                        page_size=page_size, max_blocks=max_blocks, device=device)
    # through the workspace the kernels read 16-bit pages: the choice is a 16-bit cache's
    chosen, tile = tuning.choose(device=device, impl=impl, total_q=total_q, num_seqs=num_seqs,
                                 num_kv_heads=num_kv_heads, group=group, head_dim=head_dim,
                                 q_dtype=q_dtype, kv_dtype=kv_dtype if ws is None else q_dtype,
                                 tile=tile, tree=tree_mask is not None,
                                 dense_new_keys=has_k_new)
    block_m, block_n, num_warps, num_stages = tile
    if block_m < group:
        raise ValueError(f"tile BLOCK_M={block_m} is smaller than the GQA group {group}")
    tok_m = block_m // group
    max_tiles = -(-total_q // tok_m) + num_seqs
    if host_cu_seqlens_q is not None:
        cu = _host_list(host_cu_seqlens_q)
        if host_seq_lens_k is not None:
            check_host_lengths(cu, _host_list(host_seq_lens_k), total_q=total_q,
                               capacity=capacity, has_k_new=has_k_new)
        # one transfer for both rows; the row length rounded up to 4 int32 keeps the second
        # row 16-byte aligned, so Triton compiles the same kernel for every tile count
        row = -(-max_tiles // 4) * 4
        both = tile_map_host(cu, tok_m, row)
        tile_req, tile_mblock = both.to(device, non_blocking=True)[:, :max_tiles].unbind(0)
    else:
        tile_req, tile_mblock = tile_map(cu_seqlens_q.to(torch.int64), num_seqs, tok_m,
                                          max_tiles)
    return PrefillPlan(tile_req=tile_req, tile_mblock=tile_mblock, block_m=block_m,
                       block_n=block_n, num_warps=num_warps, num_stages=num_stages,
                       group=group, total_q=total_q, num_seqs=num_seqs,
                       cu_seqlens_q=cu_seqlens_q, seq_lens_k=seq_lens_k,
                       num_kv_heads=num_kv_heads, head_dim=head_dim, impl=chosen,
                       impl_requested=impl,
                       sched=torch.zeros(2, dtype=torch.int32, device=device)
                       if chosen == "native" else None, two_walks=two_walks,
                       tree_mask=tree_mask, workspace=ws)


def _shadow_layer(layer: "PrefillLayer", k_cache, v_cache) -> "PrefillLayer":
    """``layer``'s options over the 16-bit workspace caches (no fp8 scales)."""
    return PrefillLayer(k_cache, v_cache, scale=layer.scale, causal=layer.causal,
                        sliding_window=layer.sliding_window, soft_cap=layer.soft_cap,
                        sinks=layer.sinks)


def _fp8_workspace(requested, host_cu, host_lens, *, kv_dtype, q_dtype, impl, has_k_new,
                   num_seqs, page_size, max_blocks, device) -> Optional[workspace_mod.Workspace]:
    """The plan's 16-bit workspace for an fp8 cache (``workspace.py``), or None.
    ``requested``: True always (raises without the host lengths, ``page_size`` and
    ``max_blocks``), False never, None where :func:`workspace.use_workspace` says so. With
    dense new keys (``has_k_new``) it holds the prefix pages only: the kernels read the new
    keys from ``k_new`` / ``v_new``."""
    if requested not in (None, True, False):
        raise ValueError(f"fp8_workspace must be None, True or False, got {requested!r}")
    if kv_dtype not in _checks.FP8_DTYPES or requested is False or impl == "reference":
        return None
    if host_cu is None or host_lens is None or page_size is None or max_blocks is None:
        if requested:
            raise ValueError("fp8_workspace=True needs host_cu_seqlens_q, host_seq_lens_k, "
                             "page_size and max_blocks")
        return None
    if q_dtype not in (torch.float16, torch.bfloat16):
        if requested:
            raise ValueError(f"fp8_workspace=True needs q_dtype float16 or bfloat16, got "
                             f"{q_dtype}")
        return None
    cu, lens = _host_list(host_cu), _host_list(host_lens)
    if has_k_new:  # the cache holds the prefix
        lens = [int(lk) - (int(cu[b + 1]) - int(cu[b])) for b, lk in enumerate(lens)]
    page, width = int(page_size), int(max_blocks)
    counts = workspace_mod.page_counts(lens, page, width)
    if requested or workspace_mod.use_workspace(num_seqs=num_seqs, pages=sum(counts)):
        return workspace_mod.build(counts, page_size=page, width=width, device=device,
                                   prefix_only=has_k_new)
    return None


def _host_list(values) -> list:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)
