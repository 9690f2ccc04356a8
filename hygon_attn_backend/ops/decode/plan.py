"""Plan once per step, launch per layer: the paged-decode plan.

Everything about a decode launch that depends only on the batch (the implementation to
run, the launch configuration and split count, the workspace, the block table and seq-lens
tensors, the grid and constexprs) is decided in :func:`plan_paged_decode`, once per step
(vLLM's metadata builder, SGLang's ``init_forward_metadata``), from
:func:`tuning.choose`. :meth:`DecodePlan.run`, called once per layer, checks only what a
layer can change (the query and cache it passes) and launches: no allocation, no host sync,
no environment read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops import _checks
from hygon_attn_backend.ops._device import num_sms_of
from hygon_attn_backend.ops._launch import intern_key, remember_layer, value_or_id
from hygon_attn_backend.ops.decode import native, triton, tuning
from hygon_attn_backend.ops.decode.tuning import DecodeConfig  # noqa: F401 (re-exported)
from hygon_attn_backend.ops.tree_mask import check_tree_mask

__all__ = ["DecodePlan", "DecodeLayer", "DecodeWorkspace", "DecodeConfig", "plan_paged_decode",
           "allocate_decode_workspace"]

MAX_HEAD_DIM = 256

ScaleLike = _checks.ScaleLike


@dataclass
class DecodeWorkspace:
    """Scratch of split-KV decode, allocated once and reused (CUDA-graph safe).

    Slot ``seq * num_partitions + part`` of each tensor holds one partition of one
    sequence; row ``t * num_q_heads + h`` one query row.

    max_logits: ``[num_slots, num_rows]`` float32, running max in log2 units.
    exp_sums: ``[num_slots, num_rows]`` float32, running sum (0: empty partition).
    partial_out: ``[num_slots, num_rows, head_dim]`` float32, ``acc / l`` of the partition.
    counters: ``[num_counters]`` int32, all zero between launches: one per (sequence,
       head group) of the fused combine (``None``: the two-launch combine is used).
    """

    max_logits: torch.Tensor
    exp_sums: torch.Tensor
    partial_out: torch.Tensor
    counters: Optional[torch.Tensor] = None

    @property
    def num_slots(self) -> int:
        return self.max_logits.shape[0]


def allocate_decode_workspace(*, max_num_seqs: int, num_q_heads: int, num_kv_heads: int,
                              head_dim: int, max_context_len: int, device,
                              num_tokens: int = 1, partition_size: Optional[int] = None,
                              num_slots: Optional[int] = None) -> DecodeWorkspace:
    """Allocate the split-KV scratch for every call with ``num_seqs <= max_num_seqs``,
    sequences up to ``max_context_len`` and ``num_tokens`` query tokens per sequence.

    The slot count is the largest ``num_seqs * num_partitions`` that the partition rules
    (``partition_size`` if given, else :func:`tuning.workspace_partitions`: the Triton
    rule with the environment override and the native one) pick over that range; pass
    ``num_slots`` to size it yourself. A native plan never takes more partitions than its
    workspace holds.
    """
    device = torch.device(device)
    if num_slots is None:
        num_slots = 1
        sms = num_sms_of(device)
        for seqs in range(1, max_num_seqs + 1):
            parts = tuning.workspace_partitions(
                num_seqs=seqs, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, num_tokens=num_tokens, max_context_len=max_context_len,
                num_sms=sms, partition_size=partition_size)
            if parts > 1:
                num_slots = max(num_slots, seqs * parts)
    rows = num_tokens * num_q_heads
    f32 = dict(dtype=torch.float32, device=device)
    return DecodeWorkspace(max_logits=torch.empty((num_slots, rows), **f32),
                           exp_sums=torch.empty((num_slots, rows), **f32),
                           partial_out=torch.empty((num_slots, rows, head_dim), **f32),
                           counters=torch.zeros(max(1, max_num_seqs) * num_q_heads,
                                                dtype=torch.int32, device=device))


def check_workspace(ws: DecodeWorkspace, slots: int, rows: int, head_dim: int, device,
                    counters: int = 0):
    if not isinstance(ws, DecodeWorkspace):
        raise ValueError(f"workspace must be a DecodeWorkspace, got {type(ws).__name__}")
    for name in ("max_logits", "exp_sums", "partial_out"):
        t = getattr(ws, name)
        if t.dtype != torch.float32 or t.device != device:
            raise ValueError(f"workspace.{name} must be float32 on {device}, got "
                             f"{_checks.describe(t)}")
    if ws.max_logits.shape[0] < slots or ws.max_logits.shape[1] < rows or \
            ws.exp_sums.shape[:2] != ws.max_logits.shape[:2] or \
            ws.partial_out.shape[0] < slots or ws.partial_out.shape[1] < rows or \
            ws.partial_out.shape[2] < head_dim:
        raise ValueError(f"workspace too small: this call needs {slots} slots x {rows} rows x "
                         f"{head_dim} dims, got max_logits {tuple(ws.max_logits.shape)}, "
                         f"partial_out {tuple(ws.partial_out.shape)} (allocate_decode_workspace)")
    if counters and ws.counters is not None:
        c = ws.counters
        if c.dtype != torch.int32 or c.device != device or c.dim() != 1 or \
                c.shape[0] < counters:
            raise ValueError(f"workspace.counters must be int32 [>= {counters}] on {device}, "
                             f"got {_checks.describe(c)}")


def check_layer_options(*, num_q_heads: int, device, sliding_window, soft_cap, sinks) -> None:
    """The per-layer options of decode (checked once per variant of a plan)."""
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    _checks.soft_cap_value(soft_cap)
    if sinks is not None:
        _checks.check_tensor("sinks", sinks, ndim=1, device=device, shape=(num_q_heads,),
                             dtypes=(torch.float32, torch.float16, torch.bfloat16))


class DecodeLayer:
    """One layer's side of a paged-decode launch, resolved once: its K/V cache views, softmax
    scale, fp8 scales, window, soft cap and sinks, with the launch arguments they give
    (cache strides, scale pointers, the launch variant's key). Independent of the batch: an
    engine builds one per layer and passes it to every step's :meth:`DecodePlan.run_layer`
    (rebuilt when the cache tensors or the options change).
    The tensors' addresses are read once (the binding holds the tensors): a cache whose
    storage is replaced in place (``set_``, a resize) needs a new binding.

    k_cache / v_cache: ``[num_blocks, num_kv_heads, page_size, head_dim]`` views (the
    split-x K: ``[num_blocks, num_kv_heads, head_dim // x, page_size, x]``); the options
    as in :func:`ops.decode.paged_decode_attention` (``scale=None``: the plan's default).
    """

    __slots__ = ("k_cache", "v_cache", "scale", "k_scale", "v_scale", "sliding_window",
                 "soft_cap", "sinks", "key", "variant", "args", "native_args")

    def __init__(self, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
                 scale: Optional[float] = None, k_scale: ScaleLike = None,
                 v_scale: ScaleLike = None, sliding_window: Optional[int] = None,
                 soft_cap: Optional[float] = None, sinks: Optional[torch.Tensor] = None):
        _checks.check_softmax_scale(scale)
        soft_cap = _checks.soft_cap_value(soft_cap)
        self.k_cache, self.v_cache = k_cache, v_cache
        self.native_args = None  # the native launch's side of the layer, built on first use
        self.scale, self.k_scale, self.v_scale = scale, k_scale, v_scale
        self.sliding_window, self.soft_cap, self.sinks = sliding_window, soft_cap, sinks
        from_ptr, ks, vs, ksv, vsv = _checks.scale_launch_args(k_scale, v_scale,
                                                               k_cache.device)
        # the launch variant: its key, and the key as one int for the per-call lookup
        self.key = (k_cache.dim(), from_ptr, sinks is not None, sliding_window, soft_cap,
                    scale)
        self.variant = intern_key(self.key)
        self.args = triton.layer_args(k_cache, v_cache, sinks, ks, vs, ksv, vsv)


@dataclass(eq=False)
class DecodePlan:
    """A paged-decode launch planned for one batch; :meth:`run` per layer.

    Built by :func:`plan_paged_decode`. Holds the batch's ``block_table`` and
    ``seq_lens`` (the per-layer call must pass these same tensors), the resolved
    ``impl``, the launch ``config`` and the split-KV ``workspace``. Layers may differ in
    their cache tensors (same head counts, page size and dtype), softmax scale, fp8
    scales, window, soft cap and sinks: each combination gets its launch arguments fixed
    on first use.
    """

    impl: str
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    num_seqs: int
    num_tokens: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    device: torch.device
    max_seq_len: int
    scale: float
    config: Optional[DecodeConfig]
    workspace: Optional[DecodeWorkspace]
    kv_head_grid: bool = True
    fused_combine: bool = False
    pdl: bool = False  # the combine launch is a programmatic dependent launch (sm_90+)
    native_stages: int = 0  # impl "native": its loop (tuning.native_loop_stages)
    native_tile: int = tuning.NATIVE_LOOP_TILE  # and the split-N loop's tile
    native_max_rows: int = 0  # rows a native program takes at most (0: fit to the device)
    #: ``[num_seqs * num_tokens, W]`` int32 packed tree mask of a verify batch (the drafts
    #: are each sequence's last ``num_tokens`` keys; ``ops.tree_mask``); None: the chain
    tree_mask: Optional[torch.Tensor] = None
    #: each call also returns the rows' log-sum-exp (``run``/``run_layer`` give
    #: ``(out, lse)``); Triton or the reference (``tuning.native_lacks``)
    return_lse: bool = False
    # the native launch's side of the plan (native.plan_args), built on first use
    _native_args: Optional[tuple] = field(default=None, repr=False)
    _variants: Dict[int, tuple] = field(default_factory=dict, repr=False)
    # the layers :meth:`run` built, by the identity of what built them (see remember_layer)
    _layers: Dict[tuple, "DecodeLayer"] = field(default_factory=dict, repr=False)

    @property
    def split(self) -> bool:
        return self.config is not None and self.config.num_partitions > 1

    @property
    def num_launches(self) -> int:
        """Kernel launches per :meth:`run` (decode, plus the combine of a split launch
        unless the decode kernel merges the partitions itself)."""
        if self.impl == "reference" or self.num_seqs == 0:
            return 0
        return 2 if self.split and not self.fused_combine else 1

    def check_call(self, q, k_cache, v_cache, block_table, seq_lens, out) -> None:
        """What a layer may get wrong against the plan (cheap: no tensor checks)."""
        if block_table is not self.block_table or seq_lens is not self.seq_lens:
            raise ValueError("plan: block_table and seq_lens must be the tensors the plan was "
                             "built with (plan_paged_decode(block_table=..., seq_lens=...))")
        want = (self.num_seqs, self.num_q_heads, self.head_dim) if self.num_tokens == 1 \
            and q.dim() == 3 else (self.num_seqs, self.num_tokens, self.num_q_heads,
                                   self.head_dim)
        if tuple(q.shape) != want or q.dtype != self.q_dtype or q.device != self.device:
            raise ValueError(f"plan was built for q of shape {want}, dtype {self.q_dtype} on "
                             f"{self.device}; got {_checks.describe(q)}")
        if k_cache.dtype != self.kv_dtype or v_cache.dtype != self.kv_dtype or \
                v_cache.shape[1:] != (self.num_kv_heads, self.page_size, self.head_dim):
            raise ValueError(f"plan was built for caches [num_blocks, "
                             f"{self.num_kv_heads}, {self.page_size}, {self.head_dim}] of "
                             f"{self.kv_dtype}; got k {_checks.describe(k_cache)}, "
                             f"v {_checks.describe(v_cache)}")
        if out is not None and (out.shape != q.shape or out.device != self.device):
            raise ValueError(f"out must have q's shape {tuple(q.shape)} on {self.device}, got "
                             f"{_checks.describe(out)}")

    def run(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *,
            out: Optional[torch.Tensor] = None, scale: Optional[float] = None,
            k_scale: ScaleLike = None,
            v_scale: ScaleLike = None, sliding_window: Optional[int] = None,
            soft_cap: Optional[float] = None, sinks: Optional[torch.Tensor] = None,
            lse: Optional[torch.Tensor] = None):
        """Launch for one layer (arguments as :func:`ops.decode.paged_decode_attention`;
        call it through that op with ``plan=``, which checks them against the plan)."""
        key = (id(k_cache), id(v_cache), scale, value_or_id(k_scale), value_or_id(v_scale),
               sliding_window, soft_cap, id(sinks))
        layer = self._layers.get(key)
        if layer is None:
            layer = remember_layer(self._layers, key, DecodeLayer(
                k_cache, v_cache, scale=scale, k_scale=k_scale, v_scale=v_scale,
                sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks))
        return self.run_layer(layer, q, out, lse=lse)

    def lse_shape(self, q: torch.Tensor) -> tuple:
        """The LSE of a call with this ``q``: ``[S, Hq]`` (q ``[S, Hq, D]``) or
        ``[S, T, Hq]`` (q ``[S, T, Hq, D]``)."""
        return tuple(q.shape[:-1])

    def run_layer(self, layer: "DecodeLayer", q: torch.Tensor,
                  out: Optional[torch.Tensor] = None, lse: Optional[torch.Tensor] = None):
        """Launch for one layer whose side of the call (caches, options, scales) was
        resolved once in ``layer``: per call only ``q``, ``out`` (and ``lse``) are read
        (shapes as in :meth:`run`). What an engine calls per layer; it keeps each layer's
        :class:`DecodeLayer` across steps.

        With ``return_lse`` the call returns ``(out, lse)``: ``lse`` (given, or allocated)
        float32 of :meth:`lse_shape`, any strides, ``ln sum_j exp(s_j)`` over the keys a row
        sees (sinks included), ``-inf`` for a row that sees none; else ``out``."""
        if out is None:
            out = torch.empty_like(q)
        if self.return_lse:
            lse = self._check_lse(q, lse)
        elif lse is not None:
            raise ValueError("lse was given but the plan was built without return_lse "
                             "(plan_paged_decode(return_lse=True))")
        if self.tree_mask is not None and layer.sliding_window is not None:
            raise ValueError(f"a tree mask needs a layer without a sliding window, got "
                             f"sliding_window={layer.sliding_window}")
        if self.impl != "triton" or self.num_seqs == 0 or self.config is None:
            out = self._run_other(layer, q, out, lse)
            return (out, lse) if self.return_lse else out
        variant = layer.variant
        if layer.scale is None:  # the plan's default scale
            variant = intern_key(layer.key[:-1] + (self.scale,))
        launches = self._variants.get(variant)
        if launches is None:
            key = layer.key[:-1] + (self.scale if layer.scale is None else layer.scale,)
            check_layer_options(num_q_heads=self.num_q_heads, device=self.device,
                                sliding_window=key[3], soft_cap=key[4], sinks=None)
            launches = self._variants[variant] = triton.make_launches(self, *key)
        triton.run(launches, layer.args, q, out, lse)
        return (out, lse) if self.return_lse else out

    def _check_lse(self, q: torch.Tensor, lse: Optional[torch.Tensor]) -> torch.Tensor:
        shape = self.lse_shape(q)
        if lse is None:
            return torch.empty(shape, dtype=torch.float32, device=q.device)
        if tuple(lse.shape) != shape or lse.dtype != torch.float32 or \
                lse.device != q.device:
            raise ValueError(f"lse must be float32 {list(shape)} on {q.device}, got "
                             f"{_checks.describe(lse)}")
        return lse

    def _run_other(self, layer: "DecodeLayer", q: torch.Tensor, out: torch.Tensor,
                   lse: Optional[torch.Tensor] = None):
        """The reference and native paths, an empty batch and an empty table."""
        scale = self.scale if layer.scale is None else layer.scale
        if self.impl == "reference":
            res = reference.paged_decode_attention(
                q, layer.k_cache, layer.v_cache, self.block_table, self.seq_lens,
                scale=scale, out=out, k_scale=layer.k_scale, v_scale=layer.v_scale,
                sliding_window=layer.sliding_window, soft_cap=layer.soft_cap,
                sinks=layer.sinks, tree_mask=self.tree_mask, return_lse=lse is not None)
            if lse is not None:
                lse.copy_(res[1])
                return res[0]
            return res
        if lse is not None and (self.num_seqs == 0 or self.config is None):
            lse.fill_(float("-inf"))  # no key: the empty sum
        if self.num_seqs == 0:
            return out
        if self.config is None:  # an empty block table: no key is readable
            return out.zero_()
        # native: the layer's and the plan's sides resolved once, then per call q and out
        layer_args = layer.native_args
        if layer_args is None:
            layer_args = layer.native_args = native.layer_args(
                k_scale=layer.k_scale, v_scale=layer.v_scale,
                sinks=layer.sinks, soft_cap=layer.soft_cap,
                sliding_window=layer.sliding_window)
        plan_args = self._native_args
        if plan_args is None:
            cfg = self.config
            plan_args = self._native_args = native.plan_args(
                partition_size=cfg.partition_size if self.split else tuning.WHOLE_SEQUENCE,
                num_partitions=cfg.num_partitions, loop_stages=self.native_stages,
                loop_tile=self.native_tile, workspace=self.workspace, combine_pdl=self.pdl,
                max_rows=self.native_max_rows)
        native.launch(
            out.unsqueeze(1) if out.dim() == 3 else out,
            q.unsqueeze(1) if q.dim() == 3 else q, layer.k_cache, layer.v_cache,
            self.block_table, self.seq_lens, scale, layer_args, plan_args)
        return out


def plan_paged_decode(block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                      num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                      q_dtype: torch.dtype, kv_dtype: torch.dtype,
                      num_tokens: int = 1, scale: Optional[float] = None,
                      max_seq_len: Optional[int] = None,
                      partition_size: Optional[int] = None,
                      workspace: Optional[DecodeWorkspace] = None, kv_head_grid: bool = True,
                      tile=None, fused_combine: Optional[bool] = None,
                      native_split_n: bool = True,
                      tree_mask: Optional[torch.Tensor] = None,
                      return_lse: bool = False,
                      impl: str = "auto") -> DecodePlan:
    """Plan paged decode for one batch (once per step; every layer reuses the plan).

    block_table: ``[num_seqs, max_blocks]`` int32/int64; seq_lens: ``[num_seqs]``
       int32/int64 (their values are read on the device only: no host sync). The layers'
       calls pass these same tensors.
    num_q_heads, num_kv_heads, head_dim, page_size, kv_dtype: the query and the caches'
       ``[num_blocks, num_kv_heads, page_size, head_dim]`` views every layer will pass
       (fp8 caches: ``torch.float8_e4m3fn`` / ``float8_e5m2``).
    q_dtype: float16 / bfloat16 (float32 runs the reference with ``impl="auto"``).
    num_tokens: query tokens per sequence (T > 1: speculative decode, q ``[S, T, Hq, D]``).
    scale: default softmax scale of the layers' calls (a finite float > 0), else
       ``1 / sqrt(head_dim)``.
    max_seq_len: host-side bound of ``seq_lens`` sizing the grid (default: the table's
       capacity ``max_blocks * page_size``, what a CUDA graph replayed with longer
       sequences needs). A ``seq_len`` above it gets the same answer, slower (the
       sequence's partitions grow to cover it, up to the table's capacity).
    partition_size / tile: force the split-KV partition (a multiple of 16) / the tile
       ``(BLOCK_N, num_warps, num_stages, page_prefetch)`` of the Triton kernel; default
       the measured rules of ``ops/decode/tuning.py`` (environment overrides included).
    workspace: split-KV scratch (:func:`allocate_decode_workspace`) reused across steps;
       without it a split plan allocates its own here.
    fused_combine: merge the partitions of a split launch inside the decode kernel (one
       launch; needs ``workspace.counters``) or in a second kernel (``False``); default
       :func:`tuning.use_fused_combine`. Triton only (native has its own combine).
    kv_head_grid: ``False`` runs the per-query-head grid (a benchmark baseline; Triton).
    native_split_n: ``False`` runs the native decode's shared-softmax loop where the
       split-N loop would apply (tests and benchmarks of that loop).
    tree_mask: ``[num_seqs * num_tokens, W]`` int32 packed tree mask of a speculative
       verify batch (``ops.tree_mask``): the drafts are each sequence's last
       ``num_tokens`` keys, and token ``t`` sees the keys before them and the drafts its
       row's bits name (in place of the causal chain; layers without a sliding window).
       The plan keeps the tensor (a CUDA graph refills it in place); Triton only (the
       native decode has the chain).
    return_lse: each call also returns the rows' log-sum-exp (natural log, float32,
       ``-inf`` for a row that sees no key), what decode context parallelism merges the
       ranks' partial outputs by. Triton or the reference: ``impl="auto"`` takes Triton
       where it would take native, ``impl="native"`` is refused (``tuning.native_lacks``).
    impl: ``"auto"`` | ``"triton"`` | ``"native"`` (``csrc/``, see ``docs/native.md``) |
       ``"reference"``; ``"auto"`` takes native where ``tuning.native_preferred`` says so.
    """
    device = block_table.device
    _checks.check_tensor("block_table", block_table, ndim=2, dtypes=_checks.INDEX_DTYPES)
    num_seqs = block_table.shape[0]
    _checks.check_tensor("seq_lens", seq_lens, ndim=1, dtypes=_checks.INDEX_DTYPES,
                         device=device, shape=(num_seqs,))
    for name, value in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim), ("page_size", page_size),
                        ("num_tokens", num_tokens)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be <= {MAX_HEAD_DIM}, got {head_dim}")
    if kv_dtype not in _checks.FP8_DTYPES and kv_dtype != q_dtype:
        raise ValueError(f"kv_dtype must be q_dtype ({q_dtype}) or fp8, got {kv_dtype}")
    _checks.check_softmax_scale(scale)
    if partition_size is not None and (not isinstance(partition_size, int)
                                       or partition_size <= 0 or partition_size % 16):
        raise ValueError(f"partition_size must be a positive multiple of 16, got "
                         f"{partition_size!r}")
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 0):
        raise ValueError(f"max_seq_len must be a non-negative int or None, got {max_seq_len!r}")
    if tree_mask is not None:
        check_tree_mask(tree_mask, total_q=num_seqs * num_tokens, device=device,
                        longest=num_tokens)
    max_blocks = block_table.shape[1]
    max_context = max_seq_len if max_seq_len is not None else max_blocks * page_size
    choice = tuning.choose(
        device=device, impl=impl, num_seqs=num_seqs, max_blocks=max_blocks,
        num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        page_size=page_size, q_dtype=q_dtype, kv_dtype=kv_dtype, num_tokens=num_tokens,
        max_context=max_context, partition_size=partition_size, kv_head_grid=kv_head_grid,
        tile=tile, fused_combine=fused_combine,
        workspace_slots=None if workspace is None else workspace.max_logits.shape[0],
        workspace_counters=workspace is None or workspace.counters is not None,
        native_split_n=native_split_n, tree=tree_mask is not None, lse=bool(return_lse))
    config = choice.config
    if config is not None and config.num_partitions > 1:
        slots, rows = num_seqs * config.num_partitions, num_tokens * num_q_heads
        if workspace is None:
            workspace = allocate_decode_workspace(
                max_num_seqs=num_seqs, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, max_context_len=max_context, device=device,
                num_tokens=num_tokens, num_slots=slots)
        groups = num_kv_heads if kv_head_grid else num_q_heads  # the grid's first axis
        check_workspace(workspace, slots, rows, head_dim, device,
                        counters=num_seqs * groups if choice.fused_combine else 0)
    return DecodePlan(
        impl=choice.impl, block_table=block_table, seq_lens=seq_lens, num_seqs=num_seqs,
        num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, page_size=page_size, q_dtype=q_dtype, kv_dtype=kv_dtype,
        device=device, max_seq_len=max_context,
        scale=float(scale) if scale is not None else head_dim ** -0.5, config=config,
        workspace=workspace, kv_head_grid=kv_head_grid, fused_combine=choice.fused_combine,
        pdl=choice.pdl, native_stages=choice.native_stages, native_tile=choice.native_tile,
        tree_mask=tree_mask, return_lse=bool(return_lse))
