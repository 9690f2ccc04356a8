"""Plan once per step, launch per layer: the paged-decode plan.

Everything about a decode launch that depends only on the batch (the implementation to
run, the launch configuration and split count, the workspace, the block table and seq-lens
tensors, the grid and constexprs) is decided in :func:`plan_paged_decode`, once per step
(vLLM's metadata builder, SGLang's ``init_forward_metadata``). :meth:`DecodePlan.run`,
called once per layer, checks only what a layer can change (the query and cache it
passes) and launches: no allocation, no host sync, no environment read.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from hygon_attn_backend import reference, tuning
from hygon_attn_backend.ops import _checks, _native
from hygon_attn_backend.ops._dispatch import select_impl
from hygon_attn_backend.ops._launch import NO_LAYER, LayerArgs, Launch, intern_key

__all__ = ["DecodePlan", "DecodeLayer", "DecodeWorkspace", "DecodeConfig", "plan_paged_decode",
           "allocate_decode_workspace", "decode_launch_config", "num_sms_of"]

DECODE_Q_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
_WHOLE_SEQUENCE = 1 << 30  # partition size of the one-partition launch: covers any sequence

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


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms_of(device: torch.device) -> int:
    """Multiprocessor count of ``device`` (132 for the CPU interpreter, an H200's)."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _num_sms(index)


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _num_partitions_for(partition_size: int, max_context_len: int) -> int:
    return max(1, -(-max(int(max_context_len), 1) // partition_size))


def allocate_decode_workspace(*, max_num_seqs: int, num_q_heads: int, num_kv_heads: int,
                              head_dim: int, max_context_len: int, device,
                              num_tokens: int = 1, partition_size: Optional[int] = None,
                              num_slots: Optional[int] = None) -> DecodeWorkspace:
    """Allocate the split-KV scratch for every call with ``num_seqs <= max_num_seqs``,
    sequences up to ``max_context_len`` and ``num_tokens`` query tokens per sequence.

    The slot count is the largest ``num_seqs * num_partitions`` that the partition rules
    (``partition_size`` if given, else :func:`tuning.decode_partition_size` with the
    environment override, and the native kernel's
    :func:`tuning.native_decode_partition_size` at ``NATIVE_SIZING_PROGRAMS_PER_SM``, an
    occupancy above the kernel's) pick over that range; pass ``num_slots`` to size it
    yourself. A native plan never takes more partitions than its workspace holds.
    """
    device = torch.device(device)
    group = num_q_heads // max(1, num_kv_heads)
    if num_slots is None:
        num_slots = 1
        sms = num_sms_of(device)
        for seqs in range(1, max_num_seqs + 1):
            sizes = [partition_size] if partition_size else [
                tuning.decode_partition_size(
                    num_seqs=seqs, num_kv_heads=num_kv_heads, group=group,
                    max_context_len=max_context_len, num_sms=sms),
                tuning.native_decode_partition_size(  # the smallest native tile, 32
                    programs=_native.decode_grid_programs(
                        num_seqs=seqs, num_kv_heads=num_kv_heads, rows=num_tokens * group,
                        head_dim=head_dim),
                    max_context_len=max_context_len, block_n=32,
                    programs_per_sm=NATIVE_SIZING_PROGRAMS_PER_SM, num_sms=sms)]
            parts = max(_num_partitions_for(size, max_context_len) for size in sizes)
            if parts > 1:
                num_slots = max(num_slots, seqs * parts)
    rows = num_tokens * num_q_heads
    f32 = dict(dtype=torch.float32, device=device)
    return DecodeWorkspace(max_logits=torch.empty((num_slots, rows), **f32),
                           exp_sums=torch.empty((num_slots, rows), **f32),
                           partial_out=torch.empty((num_slots, rows, head_dim), **f32),
                           counters=torch.zeros(max(1, max_num_seqs) * num_q_heads,
                                                dtype=torch.int32, device=device))


NATIVE_SIZING_PROGRAMS_PER_SM = 4  # workspace sizing: the native kernel fits 2-3 (D <= 128)


@dataclass
class DecodeConfig:
    partition_size: int
    num_partitions: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    page_prefetch: bool
    seq_split: bool = False  # each sequence splits its own length (seq_partitions)


def decode_launch_config(*, num_seqs: int, num_q_heads: int, num_kv_heads: int,
                         num_tokens: int, head_dim: int, page_size: int, kv_elem_size: int,
                         max_context_len: int, num_sms: int,
                         partition_size: Optional[int] = None, kv_head_grid: bool = True,
                         rule: str = "measured", tile=None) -> DecodeConfig:
    """The launch configuration the op uses (exposed for the benchmark and tests).
    tile: optional ``(BLOCK_N, num_warps, num_stages, page_prefetch)`` forcing the tile."""
    group = num_q_heads // num_kv_heads
    heads = group if kv_head_grid else 1
    block_m = max(16, next_pow2(num_tokens * heads))
    head_dim_pad = next_pow2(head_dim)
    block_n, num_warps, num_stages, prefetch = tuning.decode_tile_config(
        block_m=block_m, head_dim_pad=head_dim_pad, page_size=page_size,
        kv_elem_size=kv_elem_size, rows=num_tokens * heads, tile=tile)
    # the measured rule fixes the partition count; each sequence then splits its own length
    # (seq_partitions): a forced or environment size keeps fixed partitions
    seq_split = partition_size is None and rule == "measured" and \
        tuning.decode_partition_size_env() is None
    if partition_size is None:
        partition_size = tuning.decode_partition_size(
            num_seqs=num_seqs, num_kv_heads=num_kv_heads, group=group,
            max_context_len=max_context_len, num_sms=num_sms, rule=rule)
    num_partitions = _num_partitions_for(partition_size, max_context_len)
    if num_partitions > 1:
        block_n = min(block_n, partition_size & -partition_size)
    return DecodeConfig(partition_size, num_partitions, block_m, block_n, num_warps, num_stages,
                        prefetch, seq_split=seq_split and num_partitions > 1)


def kernel_partition_size(config: DecodeConfig) -> int:
    """The kernels' ``partition_size`` argument: one partition covering any sequence
    (unsplit), the floor of a per-sequence split, or the fixed size."""
    if config.num_partitions <= 1:
        return _WHOLE_SEQUENCE
    if config.seq_split:
        return tuning.DECODE_MIN_PARTITION
    return config.partition_size


def seq_partitions(seq_len: int, config: DecodeConfig) -> "tuple[int, int]":
    """``(part_size, num_parts)`` of one sequence under ``config`` (a split launch), as
    the kernels compute it (``kernels/combine.py: seq_partitions``)."""
    if config.seq_split:
        size = max(-(-seq_len // config.num_partitions), kernel_partition_size(config))
        size = -(-size // config.block_n) * config.block_n
        parts = -(-seq_len // size)
    else:
        size = config.partition_size
        parts = min(-(-seq_len // size), config.num_partitions)
    return size, max(parts, 1)


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
    if soft_cap is not None and not (isinstance(soft_cap, (int, float)) and soft_cap > 0):
        raise ValueError(f"soft_cap must be a positive float or None, got {soft_cap!r}")
    if sinks is not None:
        _checks.check_tensor("sinks", sinks, ndim=1, device=device, shape=(num_q_heads,),
                             dtypes=(torch.float32, torch.float16, torch.bfloat16))


# Arguments of paged_decode_kernel that change per layer, in the order DecodePlan passes them.
#: what a :class:`DecodeLayer` supplies (its ``args``), in order
_DECODE_PER_LAYER = (
    "k_ptr", "v_ptr", "sinks_ptr", "k_scale_ptr", "v_scale_ptr",
    "k_scale_value", "v_scale_value", "num_blocks",
    "stride_k_block", "stride_k_head", "stride_k_slot", "stride_k_dim", "stride_k_chunk",
    "stride_v_block", "stride_v_head", "stride_v_slot", "stride_v_dim")
#: what each call supplies
_DECODE_PER_CALL = (
    "out_ptr", "q_ptr", "stride_q_seq", "stride_q_tok", "stride_q_head", "stride_q_dim",
    "stride_o_seq", "stride_o_tok", "stride_o_head", "stride_o_dim")
_COMBINE_PER_CALL = ("out_ptr", "stride_o_seq", "stride_o_tok", "stride_o_head", "stride_o_dim")


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
        ks_ = k_cache.stride()
        if len(ks_) == 4:  # [N, H, P, D]; the split-x 5-D K is [N, H, D // x, P, x]
            ks_ = (ks_[0], ks_[1], ks_[2], ks_[3], 0)
        else:
            ks_ = (ks_[0], ks_[1], ks_[3], ks_[4], ks_[2])
        # the layer's launch arguments (_DECODE_PER_LAYER); absent sinks / scale pointers:
        # the K cache stands in (never read)
        self.args = LayerArgs(
            (k_cache, v_cache, k_cache if sinks is None else sinks,
             k_cache if ks is None else ks, k_cache if vs is None else vs),
            (ksv, vsv, v_cache.shape[0], *ks_, *v_cache.stride()))


def value_or_id(x):
    """A tensor's identity, any other option's value: part of a layer key."""
    return id(x) if isinstance(x, torch.Tensor) else x


def remember_layer(layers: dict, key: tuple, layer):
    """Keep the layer binding that :meth:`run` built from a call's caches and options,
    keyed by the ``id()`` of each tensor and the value of each other option, so the next
    call of the same layer (an engine's next step, a benchmark's next repeat) skips
    resolving it again. The binding holds every tensor whose id is in its key, so no id
    can be reused by another tensor while it is kept; at most 128 are kept per plan."""
    if len(layers) >= 128:
        layers.clear()
    layers[key] = layer
    return layer


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
    native_stages: int = 0  # impl "native": its loop (tuning.native_decode_stages)
    native_tile: int = 64   # and the split-N loop's tile (tuning.native_decode_tile)
    native_max_rows: int = 0  # rows a native program takes at most (0: fit to the device)
    # the native launch's side of the plan (_native.decode_plan_args), built on first use
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
            soft_cap: Optional[float] = None, sinks: Optional[torch.Tensor] = None
            ) -> torch.Tensor:
        """Launch for one layer (arguments as :func:`ops.decode.paged_decode_attention`;
        call it through that op with ``plan=``, which checks them against the plan)."""
        key = (id(k_cache), id(v_cache), scale, value_or_id(k_scale), value_or_id(v_scale),
               sliding_window, soft_cap, id(sinks))
        layer = self._layers.get(key)
        if layer is None:
            layer = remember_layer(self._layers, key, DecodeLayer(
                k_cache, v_cache, scale=scale, k_scale=k_scale, v_scale=v_scale,
                sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks))
        return self.run_layer(layer, q, out)

    def run_layer(self, layer: "DecodeLayer", q: torch.Tensor,
                  out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Launch for one layer whose side of the call (caches, options, scales) was
        resolved once in ``layer``: per call only ``q`` and ``out`` are read (shapes as in
        :meth:`run`). What an engine calls per layer; it keeps each layer's
        :class:`DecodeLayer` across steps."""
        if out is None:
            out = torch.empty_like(q)
        if self.impl != "triton" or self.num_seqs == 0 or self.config is None:
            return self._run_other(layer, q, out)
        variant = layer.variant
        if layer.scale is None:  # the plan's default scale
            variant = intern_key(layer.key[:-1] + (self.scale,))
        launches = self._variants.get(variant)
        if launches is None:
            key = layer.key[:-1] + (self.scale if layer.scale is None else layer.scale,)
            launches = self._variants[variant] = self._make_launches(*key)
        decode, combine = launches
        qs = q.stride()
        os_ = out.stride()
        if len(qs) == 3:  # one token per sequence: no token axis
            qs = (qs[0], 0, qs[1], qs[2])
            os_ = (os_[0], 0, os_[1], os_[2])
        decode(layer.args, out, q, *qs, *os_)
        if combine is not None:
            combine(NO_LAYER, out, *os_)
        return out

    def _run_other(self, layer: "DecodeLayer", q: torch.Tensor, out: torch.Tensor):
        """The reference and native paths, an empty batch and an empty table."""
        scale = self.scale if layer.scale is None else layer.scale
        if self.impl == "reference":
            return reference.paged_decode_attention(
                q, layer.k_cache, layer.v_cache, self.block_table, self.seq_lens,
                scale=scale, out=out, k_scale=layer.k_scale, v_scale=layer.v_scale,
                sliding_window=layer.sliding_window, soft_cap=layer.soft_cap,
                sinks=layer.sinks)
        if self.num_seqs == 0:
            return out
        if self.config is None:  # an empty block table: no key is readable
            return out.zero_()
        # native: the layer's and the plan's sides resolved once, then per call q and out
        layer_args = layer.native_args
        if layer_args is None:
            layer_args = layer.native_args = _native.decode_layer_args(
                k_scale=1.0 if layer.k_scale is None else layer.k_scale,
                v_scale=1.0 if layer.v_scale is None else layer.v_scale,
                sinks=layer.sinks, soft_cap=layer.soft_cap,
                sliding_window=layer.sliding_window)
        plan_args = self._native_args
        if plan_args is None:
            cfg = self.config
            plan_args = self._native_args = _native.decode_plan_args(
                partition_size=cfg.partition_size if self.split else _WHOLE_SEQUENCE,
                num_partitions=cfg.num_partitions, loop_stages=self.native_stages,
                loop_tile=self.native_tile, workspace=self.workspace, combine_pdl=self.pdl,
                max_rows=self.native_max_rows)
        _native.paged_decode_resolved(
            out.unsqueeze(1) if out.dim() == 3 else out,
            q.unsqueeze(1) if q.dim() == 3 else q, layer.k_cache, layer.v_cache,
            self.block_table, self.seq_lens, scale, layer_args, plan_args)
        return out

    def _make_launches(self, k_ndim, scales_from_ptr, use_sinks, sliding_window, soft_cap,
                       scale):
        from hygon_attn_backend.kernels.combine import combine_partitions_kernel
        from hygon_attn_backend.kernels.decode import paged_decode_kernel

        check_layer_options(num_q_heads=self.num_q_heads, device=self.device,
                            sliding_window=sliding_window, soft_cap=soft_cap, sinks=None)
        cfg = self.config
        split = self.split
        group = self.num_q_heads // self.num_kv_heads
        heads_per_prog = group if self.kv_head_grid else 1
        head_dim_pad = next_pow2(max(self.head_dim, 16))
        ws = self.workspace
        fused = split and self.fused_combine
        rows_pad = next_pow2(self.num_tokens * heads_per_prog)
        if split:
            scratch = dict(max_logits_ptr=ws.max_logits, exp_sums_ptr=ws.exp_sums,
                           partial_out_ptr=ws.partial_out,
                           counters_ptr=ws.counters if fused else self.seq_lens,
                           stride_ml_slot=ws.max_logits.stride(0),
                           stride_ml_row=ws.max_logits.stride(1),
                           stride_po_slot=ws.partial_out.stride(0),
                           stride_po_row=ws.partial_out.stride(1),
                           stride_po_dim=ws.partial_out.stride(2))
        else:  # scratch pointers are unused by the one-partition launch
            scratch = dict(max_logits_ptr=self.seq_lens, exp_sums_ptr=self.seq_lens,
                           partial_out_ptr=self.seq_lens, counters_ptr=self.seq_lens,
                           stride_ml_slot=0, stride_ml_row=0,
                           stride_po_slot=0, stride_po_row=0, stride_po_dim=1)
        split_x = 16 // self.kv_dtype.itemsize if k_ndim == 5 else 0
        fixed = dict(
            block_table_ptr=self.block_table, seq_lens_ptr=self.seq_lens,
            scale=float(scale),
            soft_cap=float(soft_cap) if soft_cap is not None else 1.0,
            sliding_window=int(sliding_window) if sliding_window is not None else 0,
            max_blocks_per_seq=self.block_table.shape[1],
            partition_size=kernel_partition_size(cfg),
            num_partitions=cfg.num_partitions, num_q_heads=self.num_q_heads,
            stride_bt_seq=self.block_table.stride(0),
            stride_bt_block=self.block_table.stride(1),
            GROUP=group, HEADS_PER_PROG=heads_per_prog, NUM_TOKENS=self.num_tokens,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=self.head_dim,
            HEAD_DIM_PAD=head_dim_pad, PAGE_SIZE=self.page_size, K_SPLIT_X=split_x,
            SPLIT=split, SEQ_SPLIT=cfg.seq_split, SCALES_FROM_PTR=scales_from_ptr,
            USE_SOFT_CAP=soft_cap is not None, USE_WINDOW=sliding_window is not None,
            USE_SINKS=use_sinks, PAGE_PREFETCH=cfg.page_prefetch, FUSED_COMBINE=fused,
            COMBINE_ROWS_PAD=rows_pad,
            COMBINE_CHUNK=tuning.decode_combine_chunk(rows_pad=rows_pad,
                                                      head_dim_pad=head_dim_pad,
                                                      num_warps=cfg.num_warps),
            LAUNCH_DEPENDENTS=self.pdl, **scratch)
        grid = (self.num_q_heads // heads_per_prog, self.num_seqs, cfg.num_partitions)
        decode = Launch(paged_decode_kernel, grid, fixed, _DECODE_PER_CALL,
                        per_layer=_DECODE_PER_LAYER, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        combine = None
        if split and not fused:
            rows = self.num_tokens * self.num_q_heads
            combine_warps = 4
            cfixed = dict(
                max_logits_ptr=ws.max_logits, exp_sums_ptr=ws.exp_sums,
                partial_out_ptr=ws.partial_out, seq_lens_ptr=self.seq_lens,
                partition_size=kernel_partition_size(cfg),
                num_partitions=cfg.num_partitions,
                num_q_heads=self.num_q_heads,
                stride_ml_slot=ws.max_logits.stride(0), stride_ml_row=ws.max_logits.stride(1),
                stride_po_slot=ws.partial_out.stride(0), stride_po_row=ws.partial_out.stride(1),
                stride_po_dim=ws.partial_out.stride(2),
                HEAD_DIM=self.head_dim, HEAD_DIM_PAD=head_dim_pad,
                PART_CHUNK=tuning.decode_combine_chunk(rows_pad=1, head_dim_pad=head_dim_pad,
                                                       num_warps=combine_warps, fused=False),
                SEQ_SPLIT=cfg.seq_split, ALIGN=cfg.block_n, STAGES=1, WAIT_PRIOR=self.pdl)
            combine = Launch(combine_partitions_kernel, (self.num_seqs, rows, 1), cfixed,
                             _COMBINE_PER_CALL, num_warps=combine_warps, num_stages=1,
                             launch_pdl=self.pdl)
        return decode, combine


def plan_paged_decode(block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                      num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
                      q_dtype: torch.dtype, kv_dtype: torch.dtype,
                      num_tokens: int = 1, scale: Optional[float] = None,
                      max_seq_len: Optional[int] = None,
                      partition_size: Optional[int] = None,
                      workspace: Optional[DecodeWorkspace] = None, kv_head_grid: bool = True,
                      tile=None, fused_combine: Optional[bool] = None,
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
    scale: default softmax scale of the layers' calls, else ``1 / sqrt(head_dim)``.
    max_seq_len: host-side bound of ``seq_lens`` sizing the grid (default: the table's
       capacity ``max_blocks * page_size``, what a CUDA graph replayed with longer
       sequences needs). Every ``seq_len`` must be <= it.
    partition_size / tile: force the split-KV partition (a multiple of 16) / the tile
       ``(BLOCK_N, num_warps, num_stages, page_prefetch)``; default the measured rules in
       :mod:`hygon_attn_backend.tuning` (environment overrides included).
    workspace: split-KV scratch (:func:`allocate_decode_workspace`) reused across steps;
       without it a split plan allocates its own here.
    fused_combine: merge the partitions of a split launch inside the decode kernel (one
       launch; needs ``workspace.counters``) or in a second kernel (``False``); default
       :func:`tuning.decode_fused_combine`. Triton only (native has its own combine).
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
    if scale is not None and not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a float or None, got {type(scale).__name__}")
    if partition_size is not None and (not isinstance(partition_size, int)
                                       or partition_size <= 0 or partition_size % 16):
        raise ValueError(f"partition_size must be a positive multiple of 16, got "
                         f"{partition_size!r}")
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 0):
        raise ValueError(f"max_seq_len must be a non-negative int or None, got {max_seq_len!r}")
    if q_dtype not in DECODE_Q_DTYPES:  # float32 queries: the reference serves them
        if impl in ("triton", "native"):
            raise ValueError(f"impl={impl!r} takes float16/bfloat16 queries, got {q_dtype}")
        select_impl(impl, device)  # rejects an unknown impl name
        chosen = "reference"
    else:
        chosen = select_impl(
            impl, device, native_unsupported=_native.decode_unsupported(
                head_dim=head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype,
                kv_head_grid=kv_head_grid),
            native_preferred=tuning.native_preferred(
                "decode", is_hip=tuning.gpu_is_hip(), group=num_q_heads // num_kv_heads,
                head_dim=head_dim, num_tokens=num_tokens, programs=num_seqs * num_kv_heads,
                num_sms=num_sms_of(device),
                same_kv_dtype=kv_dtype == q_dtype))
    max_blocks = block_table.shape[1]
    sm_scale = float(scale) if scale is not None else head_dim ** -0.5
    config = None
    fused = False
    native_stages, native_tile = 0, 64
    if chosen == "native":
        native_tile = tuning.native_decode_tile()
        native_rows = num_tokens * (num_q_heads // num_kv_heads)
        native_programs = _native.decode_grid_programs(
            num_seqs=num_seqs, num_kv_heads=num_kv_heads, rows=native_rows, head_dim=head_dim)
        native_stages = tuning.native_decode_stages()
    if chosen != "reference" and num_seqs and max_blocks:
        max_context = max_seq_len if max_seq_len is not None else max_blocks * page_size
        if chosen == "native" and partition_size is None and \
                tuning.decode_partition_size_env() is None:
            partition_size = _native_partition_size(
                programs=native_programs, rows=native_rows, head_dim=head_dim,
                q_dtype=q_dtype, kv_dtype=kv_dtype, max_context=max_context,
                loop_stages=native_stages, loop_tile=native_tile, device=device,
                max_partitions=None if workspace is None
                else workspace.max_logits.shape[0] // num_seqs)
        config = decode_launch_config(
            num_seqs=num_seqs, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
            num_tokens=num_tokens, head_dim=head_dim, page_size=page_size,
            kv_elem_size=kv_dtype.itemsize,
            max_context_len=max_context, num_sms=num_sms_of(device),
            partition_size=partition_size, kv_head_grid=kv_head_grid, tile=tile)
        if config.num_partitions > 1:
            slots, rows = num_seqs * config.num_partitions, num_tokens * num_q_heads
            if workspace is None:
                workspace = allocate_decode_workspace(
                    max_num_seqs=num_seqs, num_q_heads=num_q_heads,
                    num_kv_heads=num_kv_heads, head_dim=head_dim,
                    max_context_len=max_context, device=device, num_tokens=num_tokens,
                    num_slots=slots)
            fused = chosen == "triton" and workspace.counters is not None and (
                fused_combine if fused_combine is not None
                else tuning.decode_fused_combine(num_partitions=config.num_partitions))
            groups = num_kv_heads if kv_head_grid else num_q_heads  # the grid's first axis
            check_workspace(workspace, slots, rows, head_dim, device,
                            counters=num_seqs * groups if fused else 0)
    return DecodePlan(
        impl=chosen, block_table=block_table, seq_lens=seq_lens, num_seqs=num_seqs,
        num_tokens=num_tokens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, page_size=page_size, q_dtype=q_dtype,
        kv_dtype=kv_dtype, device=device,
        max_seq_len=max_seq_len if max_seq_len is not None else max_blocks * page_size,
        scale=sm_scale, config=config, workspace=workspace, kv_head_grid=kv_head_grid,
        native_stages=native_stages, native_tile=native_tile,
        fused_combine=fused, pdl=chosen in ("triton", "native") and config is not None
        and config.num_partitions > 1 and not fused and tuning.decode_combine_pdl(device))


def _native_partition_size(*, programs, rows, head_dim, q_dtype, kv_dtype, max_context,
                           loop_stages, loop_tile, device, max_partitions) -> int:
    """The native decode's partition size for a grid of ``programs`` per partition with
    ``rows`` query rows per KV head: whole waves of its own occupancy
    (:func:`tuning.native_decode_partition_size`), no more partitions than a caller's
    workspace holds."""
    chunk_rows = min(rows, _native.DECODE_MAX_ROWS)  # the rows of one program
    per_sm = _native.decode_programs_per_sm(
        device_index=device.index if device.index is not None else torch.cuda.current_device(),
        q_dtype=q_dtype, kv_dtype=kv_dtype, head_dim=head_dim, rows=chunk_rows,
        loop_stages=loop_stages, loop_tile=loop_tile)
    return tuning.native_decode_partition_size(
        programs=programs, max_context_len=max_context,
        block_n=_native.decode_block_n(head_dim=head_dim, rows=chunk_rows,
                                       loop_stages=loop_stages, loop_tile=loop_tile),
        programs_per_sm=per_sm,
        num_sms=num_sms_of(device), max_partitions=max_partitions)
