"""Public op: paged decode attention (KV-head grid, split-KV partitions, combine).

validate -> choose config (hygon_attn_backend.tuning) -> launch
(kernels/decode.py, kernels/combine.py).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Union

import torch

from hygon_attn_backend import reference, tuning
from hygon_attn_backend.ops import _checks, _native
from hygon_attn_backend.ops._dispatch import select_impl

__all__ = ["paged_decode_attention", "DecodeWorkspace", "allocate_decode_workspace",
           "decode_launch_config"]

DECODE_Q_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256
_WHOLE_SEQUENCE = 1 << 30  # partition size of the one-partition launch: covers any sequence

ScaleLike = Union[None, float, torch.Tensor]


@dataclass
class DecodeWorkspace:
    """Scratch of split-KV decode, allocated once and reused (CUDA-graph safe).

    Slot ``seq * num_partitions + part`` of each tensor holds one partition of one
    sequence; row ``t * num_q_heads + h`` one query row.

    max_logits: ``[num_slots, num_rows]`` float32, running max in log2 units.
    exp_sums: ``[num_slots, num_rows]`` float32, running sum (0: empty partition).
    partial_out: ``[num_slots, num_rows, head_dim]`` float32, ``acc / l`` of the partition.
    """

    max_logits: torch.Tensor
    exp_sums: torch.Tensor
    partial_out: torch.Tensor

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


def _lowbit(n: int) -> int:
    return n & -n


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _num_partitions_for(partition_size: int, max_context_len: int) -> int:
    return max(1, -(-max(int(max_context_len), 1) // partition_size))


def allocate_decode_workspace(*, max_num_seqs: int, num_q_heads: int, num_kv_heads: int,
                              head_dim: int, max_context_len: int, device,
                              num_tokens: int = 1, partition_size: Optional[int] = None,
                              num_slots: Optional[int] = None) -> DecodeWorkspace:
    """Allocate the split-KV scratch for every call with ``num_seqs <= max_num_seqs``,
    sequences up to ``max_context_len`` and ``num_tokens`` query tokens per sequence.

    The slot count is the largest ``num_seqs * num_partitions`` that the partition rule
    (``partition_size`` if given, else :func:`tuning.decode_partition_size` with the
    environment override) picks over that range; pass ``num_slots`` to size it yourself.
    """
    device = torch.device(device)
    group = num_q_heads // max(1, num_kv_heads)
    if num_slots is None:
        num_slots = 1
        sms = num_sms_of(device)
        for seqs in range(1, max_num_seqs + 1):
            size = partition_size or tuning.decode_partition_size(
                num_seqs=seqs, num_kv_heads=num_kv_heads, group=group,
                max_context_len=max_context_len, num_sms=sms)
            parts = _num_partitions_for(size, max_context_len)
            if parts > 1:
                num_slots = max(num_slots, seqs * parts)
    rows = num_tokens * num_q_heads
    f32 = dict(dtype=torch.float32, device=device)
    return DecodeWorkspace(max_logits=torch.empty((num_slots, rows), **f32),
                           exp_sums=torch.empty((num_slots, rows), **f32),
                           partial_out=torch.empty((num_slots, rows, head_dim), **f32))


@dataclass
class DecodeConfig:
    partition_size: int
    num_partitions: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    page_prefetch: bool


def decode_launch_config(*, num_seqs: int, num_q_heads: int, num_kv_heads: int,
                         num_tokens: int, head_dim: int, page_size: int, kv_elem_size: int,
                         max_context_len: int, num_sms: int,
                         partition_size: Optional[int] = None, kv_head_grid: bool = True,
                         rule: str = "measured") -> DecodeConfig:
    """The launch configuration the op uses (exposed for the benchmark and tests)."""
    group = num_q_heads // num_kv_heads
    heads = group if kv_head_grid else 1
    block_m = max(16, _next_pow2(num_tokens * heads))
    head_dim_pad = _next_pow2(head_dim)
    block_n, num_warps, num_stages, prefetch = tuning.decode_tile_config(
        block_m=block_m, head_dim_pad=head_dim_pad, page_size=page_size,
        kv_elem_size=kv_elem_size)
    if partition_size is None:
        partition_size = tuning.decode_partition_size(
            num_seqs=num_seqs, num_kv_heads=num_kv_heads, group=group,
            max_context_len=max_context_len, num_sms=num_sms, rule=rule)
    num_partitions = _num_partitions_for(partition_size, max_context_len)
    if num_partitions > 1:
        block_n = min(block_n, _lowbit(partition_size))
    return DecodeConfig(partition_size, num_partitions, block_m, block_n, num_warps, num_stages,
                        prefetch)


def _check_options(q, num_q_heads, *, scale, partition_size, sliding_window, soft_cap, sinks,
                   max_seq_len):
    if scale is not None and not isinstance(scale, (int, float)):
        raise ValueError(f"scale must be a float or None, got {type(scale).__name__}")
    if partition_size is not None and (not isinstance(partition_size, int)
                                       or partition_size <= 0 or partition_size % 16):
        raise ValueError(f"partition_size must be a positive multiple of 16, got {partition_size!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
        raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window!r}")
    if soft_cap is not None and not (isinstance(soft_cap, (int, float)) and soft_cap > 0):
        raise ValueError(f"soft_cap must be a positive float or None, got {soft_cap!r}")
    if sinks is not None:
        _checks.check_tensor("sinks", sinks, ndim=1, device=q.device, shape=(num_q_heads,),
                             dtypes=(torch.float32, torch.float16, torch.bfloat16))
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 0):
        raise ValueError(f"max_seq_len must be a non-negative int or None, got {max_seq_len!r}")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                           scale: Optional[float] = None, out: Optional[torch.Tensor] = None,
                           k_scale: ScaleLike = None, v_scale: ScaleLike = None,
                           partition_size: Optional[int] = None,
                           sliding_window: Optional[int] = None,
                           soft_cap: Optional[float] = None,
                           sinks: Optional[torch.Tensor] = None,
                           workspace: Optional[DecodeWorkspace] = None,
                           max_seq_len: Optional[int] = None,
                           kv_head_grid: bool = True,
                           impl: str = "auto") -> torch.Tensor:
    """Paged decode attention: each query token attends to its sequence's cached keys.

    q: ``[num_seqs, Hq, D]`` fp16/bf16 (one token per sequence), or
       ``[num_seqs, T, Hq, D]`` (T speculative tokens; token ``t`` is at position
       ``seq_len - T + t`` and sees keys ``j <= seq_len - T + t``). Any strides.
    k_cache, v_cache: ``[num_blocks, Hkv, P, D]`` canonical views with any strides (every
       layout of ``hygon_attn_backend.layouts``), dtype = q's, or fp8 e4m3fn/e5m2 with
       per-tensor ``k_scale``/``v_scale``. ``k_cache`` may be vLLM's legacy 5-D split-x
       K cache ``[num_blocks, Hkv, D // x, P, x]``. ``Hq % Hkv == 0``; D in 1..256
       (64, 80, 96, 128, 192, 256 are the tested sizes); any block size P >= 1.
    block_table: ``[num_seqs, max_blocks]`` int32/int64 physical block ids; token ``j`` of
       sequence ``s`` is slot ``j % P`` of block ``block_table[s, j // P]``.
    seq_lens: ``[num_seqs]`` int32/int64 key lengths (>= T). A length of 0 gives zeros.
    scale: softmax scale, default ``1 / sqrt(D)``.
    out: optional ``q``-shaped output (fp16/bf16/fp32), written in place and returned.
    k_scale, v_scale: float or 1-element float32 tensor (read on the device: no sync).
    partition_size: tokens per split-KV partition, a multiple of 16; default
       :func:`tuning.decode_partition_size` (env ``HYGON_ATTN_PARTITION_SIZE`` /
       ``PA_PARTITION_SIZE`` override it). One partition writes ``out`` directly; several
       write scratch that a combine kernel merges.
    sliding_window: W: a token at position ``i`` sees keys ``i - W < j <= i`` (supported).
    soft_cap: logits become ``cap * tanh(logit / cap)`` (supported).
    sinks: ``[Hq]`` per-head sink logits (natural units): an extra always-visible key with
       value 0 (supported).
    workspace: preallocated :class:`DecodeWorkspace` (:func:`allocate_decode_workspace`);
       with it the op allocates nothing and never syncs with the host, so it can be
       captured in a CUDA graph. Without it, split launches allocate scratch per call.
    max_seq_len: host-side upper bound of ``seq_lens`` used to size the grid (default
       ``max_blocks * P``, the table's capacity). A split launch does not read keys past
       ``num_partitions * partition_size``, so it must be >= every ``seq_len``.
    kv_head_grid: False runs the per-query-head variant (benchmark baseline).
    impl: ``"auto"`` | ``"triton"`` | ``"native"`` (csrc/; D in 64/80/96/128/192/256) |
       ``"reference"``.

    Bad block ids (negative or >= num_blocks) and table entries past ``max_blocks`` are
    never read: those keys are skipped (``HYGON_ATTN_DEBUG=1`` raises instead).
    Returns ``out`` (q's shape, q's dtype unless ``out`` is given).
    """
    _checks.check_tensor("q", q, ndim=(3, 4), dtypes=DECODE_Q_DTYPES)
    device = q.device
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    num_seqs, num_tokens, num_q_heads, head_dim = q4.shape
    num_blocks, num_kv_heads, page_size, _ = _checks.check_kv_caches(
        k_cache, v_cache, device=device, head_dim=head_dim)
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"q's {num_q_heads} heads must be a multiple of k_cache's "
                         f"{num_kv_heads} kv heads (q {_checks.describe(q)})")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"q head_dim must be <= {MAX_HEAD_DIM}, got {_checks.describe(q)}")
    fp8 = k_cache.dtype in _checks.FP8_DTYPES
    if not fp8 and k_cache.dtype != q.dtype:
        raise ValueError(f"k_cache dtype must match q's ({q.dtype}) or be fp8, got "
                         f"{_checks.describe(k_cache)}")
    _checks.check_tensor("block_table", block_table, ndim=2, dtypes=_checks.INDEX_DTYPES,
                         device=device, shape=(num_seqs, None))
    _checks.check_tensor("seq_lens", seq_lens, ndim=1, dtypes=_checks.INDEX_DTYPES,
                         device=device, shape=(num_seqs,))
    if out is not None:
        _checks.check_tensor("out", out, dtypes=_checks.Q_DTYPES, device=device,
                             shape=tuple(q.shape))
    _check_options(q, num_q_heads, scale=scale, partition_size=partition_size,
                   sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks,
                   max_seq_len=max_seq_len)
    k_sc = _checks.check_scale("k_scale", k_scale, k_cache.dtype, device)
    v_sc = _checks.check_scale("v_scale", v_scale, v_cache.dtype, device)
    max_blocks = block_table.shape[1]
    if _checks.debug_enabled():
        _debug_checks(block_table, seq_lens, num_blocks, page_size, num_tokens)

    chosen = select_impl(impl, device, native_unsupported=_native.decode_supported(q, k_cache),
                         native_preferred=tuning.native_preferred(
                             "decode", is_hip=tuning.gpu_is_hip(), group=num_q_heads // num_kv_heads))
    if chosen == "reference":
        return reference.paged_decode_attention(
            q, k_cache, v_cache, block_table, seq_lens, scale=scale, out=out,
            k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window,
            soft_cap=soft_cap, sinks=sinks)

    if out is None:
        out = torch.empty_like(q)
    out4 = out.unsqueeze(1) if out.dim() == 3 else out
    if num_seqs == 0:
        return out
    if max_blocks == 0:  # an empty table: no key is readable
        return out.zero_()
    sm_scale = float(scale) if scale is not None else head_dim ** -0.5
    max_context = max_seq_len if max_seq_len is not None else max_blocks * page_size
    cfg = decode_launch_config(
        num_seqs=num_seqs, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        num_tokens=num_tokens, head_dim=head_dim, page_size=page_size,
        kv_elem_size=k_cache.element_size(), max_context_len=max_context,
        num_sms=num_sms_of(device), partition_size=partition_size, kv_head_grid=kv_head_grid)
    split = cfg.num_partitions > 1
    num_rows = num_tokens * num_q_heads
    if split:
        if workspace is None:
            workspace = allocate_decode_workspace(
                max_num_seqs=num_seqs, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, max_context_len=max_context, device=device,
                num_tokens=num_tokens, num_slots=num_seqs * cfg.num_partitions)
        _check_workspace(workspace, num_seqs * cfg.num_partitions, num_rows, head_dim, device)
        ws = workspace
    else:
        dummy = out4  # scratch pointers are unused by the one-partition launch
        ws = DecodeWorkspace(dummy, dummy, dummy)

    if chosen == "native":
        _native.paged_decode(out4, q4, k_cache, v_cache, block_table, seq_lens, scale=sm_scale,
                             k_scale=k_sc, v_scale=v_sc, soft_cap=soft_cap,
                             sliding_window=sliding_window, sinks=sinks,
                             partition_size=cfg.partition_size if split else _WHOLE_SEQUENCE,
                             num_partitions=cfg.num_partitions, workspace=ws)
        return out

    from hygon_attn_backend.kernels.decode import paged_decode_kernel

    group = num_q_heads // num_kv_heads
    heads_per_prog = group if kv_head_grid else 1
    if k_cache.dim() == 5:
        skb, skh, skc, sks, skd = k_cache.stride()
        split_x = k_cache.shape[4]
    else:
        skb, skh, sks, skd = k_cache.stride()
        skc, split_x = 0, 0
    svb, svh, svs, svd = v_cache.stride()
    scales_from_ptr = isinstance(k_sc, torch.Tensor) or isinstance(v_sc, torch.Tensor)
    k_scale_t = k_sc if isinstance(k_sc, torch.Tensor) else None
    v_scale_t = v_sc if isinstance(v_sc, torch.Tensor) else None
    if scales_from_ptr:
        k_scale_t = k_scale_t if k_scale_t is not None else torch.full(
            (1,), float(k_sc), dtype=torch.float32, device=device)
        v_scale_t = v_scale_t if v_scale_t is not None else torch.full(
            (1,), float(v_sc), dtype=torch.float32, device=device)
    grid = (num_q_heads // heads_per_prog, num_seqs, cfg.num_partitions)
    paged_decode_kernel[grid](
        out_ptr=out4, q_ptr=q4, k_ptr=k_cache, v_ptr=v_cache, block_table_ptr=block_table,
        seq_lens_ptr=seq_lens, sinks_ptr=sinks if sinks is not None else q4,
        k_scale_ptr=k_scale_t if scales_from_ptr else q4,
        v_scale_ptr=v_scale_t if scales_from_ptr else q4,
        max_logits_ptr=ws.max_logits, exp_sums_ptr=ws.exp_sums,
        partial_out_ptr=ws.partial_out,
        scale=sm_scale,
        k_scale_value=1.0 if scales_from_ptr else float(k_sc),
        v_scale_value=1.0 if scales_from_ptr else float(v_sc),
        soft_cap=float(soft_cap) if soft_cap is not None else 1.0,
        sliding_window=int(sliding_window) if sliding_window is not None else 0,
        num_blocks=num_blocks, max_blocks_per_seq=max_blocks,
        partition_size=cfg.partition_size if split else _WHOLE_SEQUENCE,
        num_partitions=cfg.num_partitions, num_q_heads=num_q_heads,
        stride_q_seq=q4.stride(0), stride_q_tok=q4.stride(1), stride_q_head=q4.stride(2),
        stride_q_dim=q4.stride(3),
        stride_o_seq=out4.stride(0), stride_o_tok=out4.stride(1),
        stride_o_head=out4.stride(2), stride_o_dim=out4.stride(3),
        stride_k_block=skb, stride_k_head=skh, stride_k_slot=sks, stride_k_dim=skd,
        stride_k_chunk=skc,
        stride_v_block=svb, stride_v_head=svh, stride_v_slot=svs, stride_v_dim=svd,
        stride_bt_seq=block_table.stride(0), stride_bt_block=block_table.stride(1),
        stride_ml_slot=ws.max_logits.stride(0), stride_ml_row=ws.max_logits.stride(1),
        stride_po_slot=ws.partial_out.stride(0), stride_po_row=ws.partial_out.stride(1),
        stride_po_dim=ws.partial_out.stride(2) if split else 1,
        GROUP=group, HEADS_PER_PROG=heads_per_prog, NUM_TOKENS=num_tokens,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=_next_pow2(max(head_dim, 16)), PAGE_SIZE=page_size, K_SPLIT_X=split_x,
        SPLIT=split, SCALES_FROM_PTR=scales_from_ptr, USE_SOFT_CAP=soft_cap is not None,
        USE_WINDOW=sliding_window is not None, USE_SINKS=sinks is not None,
        PAGE_PREFETCH=cfg.page_prefetch,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if split:
        from hygon_attn_backend.kernels.combine import combine_partitions_kernel

        combine_partitions_kernel[(num_seqs, num_rows)](
            out_ptr=out4, max_logits_ptr=ws.max_logits, exp_sums_ptr=ws.exp_sums,
            partial_out_ptr=ws.partial_out, seq_lens_ptr=seq_lens,
            partition_size=cfg.partition_size, num_partitions=cfg.num_partitions,
            num_q_heads=num_q_heads,
            stride_o_seq=out4.stride(0), stride_o_tok=out4.stride(1),
            stride_o_head=out4.stride(2), stride_o_dim=out4.stride(3),
            stride_ml_slot=ws.max_logits.stride(0), stride_ml_row=ws.max_logits.stride(1),
            stride_po_slot=ws.partial_out.stride(0), stride_po_row=ws.partial_out.stride(1),
            stride_po_dim=ws.partial_out.stride(2),
            HEAD_DIM=head_dim, HEAD_DIM_PAD=_next_pow2(max(head_dim, 16)),
            PART_CHUNK=16 if head_dim <= 128 else 8, num_warps=4,
        )
    return out


def _check_workspace(ws: DecodeWorkspace, slots: int, rows: int, head_dim: int, device):
    if not isinstance(ws, DecodeWorkspace):
        raise ValueError(f"workspace must be a DecodeWorkspace, got {type(ws).__name__}")
    for name in ("max_logits", "exp_sums", "partial_out"):
        t = getattr(ws, name)
        if t.dtype != torch.float32 or t.device != device:
            raise ValueError(f"workspace.{name} must be float32 on {device}, got {_checks.describe(t)}")
    if ws.max_logits.shape[0] < slots or ws.max_logits.shape[1] < rows or \
            ws.exp_sums.shape[:2] != ws.max_logits.shape[:2] or \
            ws.partial_out.shape[0] < slots or ws.partial_out.shape[1] < rows or \
            ws.partial_out.shape[2] < head_dim:
        raise ValueError(f"workspace too small: this call needs {slots} slots x {rows} rows x "
                         f"{head_dim} dims, got max_logits {tuple(ws.max_logits.shape)}, "
                         f"partial_out {tuple(ws.partial_out.shape)} (allocate_decode_workspace)")


def _debug_checks(block_table, seq_lens, num_blocks, page_size, num_tokens):
    """HYGON_ATTN_DEBUG=1: value checks that sync with the host."""
    lens = seq_lens.to(torch.int64)
    if bool((lens < 0).any()):
        raise ValueError(f"seq_lens holds negative lengths (min {int(lens.min())})")
    if lens.numel() and bool((lens[lens > 0] < num_tokens).any()):
        raise ValueError(f"seq_lens must be >= the {num_tokens} query tokens of a sequence")
    capacity = block_table.shape[1] * page_size
    if lens.numel() and int(lens.max()) > capacity:
        raise ValueError(f"block_table has {block_table.shape[1]} blocks of {page_size} "
                         f"slots ({capacity} tokens) but seq_lens holds {int(lens.max())}")
    needed = (lens + page_size - 1) // page_size
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    used = cols.unsqueeze(0) < needed.unsqueeze(1)
    _checks.check_block_ids("block_table", block_table, num_blocks, used)
