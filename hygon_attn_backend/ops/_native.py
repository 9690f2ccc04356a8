"""Launch wrappers of the native kernels (``csrc/``, ``torch.ops.hygon_attn.*``).

The public ops (ops/cache.py, ops/decode.py) validate their arguments and choose the
configuration; these wrappers only turn already-validated tensors into the native ops'
arguments. Scale arguments are what ``_checks.check_scale`` returns: a float or a
1-element float32 tensor.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

from hygon_attn_backend import native

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
NATIVE_HEAD_DIMS = (64, 80, 96, 128, 192, 256)


def _ops():
    return native.load()


def _scale_pair(scale):
    """``(tensor or None, float)`` for a native op's ``Tensor? scale, float scale_value``."""
    if isinstance(scale, torch.Tensor):
        return scale.reshape(1).to(torch.float32).contiguous(), 1.0
    return None, float(scale)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale, v_scale) -> None:
    """k, v: ``[T, H, D]``; k_cache 4-D view or 5-D split-x; v_cache 4-D view; any strides."""
    fp8 = k_cache.dtype in FP8_DTYPES
    k_t, k_val = _scale_pair(k_scale if fp8 else 1.0)
    v_t, v_val = _scale_pair(v_scale if fp8 else 1.0)
    _ops().write_kv(k, v, k_cache, v_cache, slot_mapping, k_t, v_t, k_val, v_val)


def copy_blocks(cache: torch.Tensor, block_mapping: torch.Tensor, sizes: Sequence[int],
                strides: Sequence[int]) -> None:
    """One cache (dim 0 = block); ``sizes``/``strides``: the 4 merged inner axes."""
    _ops().copy_blocks(cache, block_mapping, list(sizes), list(strides))


def decode_unsupported(*, head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                       kv_head_grid: bool = True) -> Optional[str]:
    """None when the native decode covers calls of this shape, else the reason it does not."""
    if head_dim not in NATIVE_HEAD_DIMS:
        return f"head_dim {head_dim} (native: {NATIVE_HEAD_DIMS})"
    if kv_dtype not in FP8_DTYPES and kv_dtype != q_dtype:
        return f"k_cache dtype {kv_dtype} with q {q_dtype}"
    if not kv_head_grid:
        return "kv_head_grid=False (the per-query-head variant is Triton's)"
    return None


DECODE_MAX_ROWS = 64  # query rows per native decode program; more run in row chunks


def decode_grid_programs(*, num_seqs: int, num_kv_heads: int, rows: int) -> int:
    """Programs per partition of the native decode grid (sequences x KV heads x row
    chunks) for ``rows = G * T`` query rows per KV head."""
    return num_seqs * num_kv_heads * -(-rows // DECODE_MAX_ROWS)


def decode_block_n(*, head_dim: int, rows: int, loop_stages: int, loop_tile: int) -> int:
    """KV tokens per tile of the native decode for ``rows`` query rows per program:
    ``loop_tile`` where the split-N loop runs (``loop_stages`` > 0, up to 16 rows, head_dim
    <= 128: ``SplitN`` in decode_kernel.cuh), else the shared-softmax loop's
    ``Layout::BLOCK_N`` (64, 32 past D=128)."""
    if head_dim > 128:
        return 32
    return loop_tile if loop_stages and rows <= 16 else 64


@functools.lru_cache(maxsize=None)
def decode_programs_per_sm(*, device_index: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                           head_dim: int, rows: int, loop_stages: int, loop_tile: int) -> int:
    """Native decode programs that fit on one SM at once (the runtime's occupancy
    calculator for the instantiation a launch of ``rows = G * T`` query rows per KV head
    would take; 16-byte aligned K/V rows assumed)."""
    with torch.cuda.device(device_index):
        n = int(_ops().decode_programs_per_sm(q_dtype, kv_dtype, head_dim, rows, loop_stages,
                                              loop_tile))
    if n < 1:
        raise RuntimeError(f"native decode: no occupancy for head_dim={head_dim}, rows={rows}, "
                           f"loop_stages={loop_stages}, loop_tile={loop_tile} "
                           f"({q_dtype}, KV {kv_dtype})")
    return n


def paged_decode(out4: torch.Tensor, q4: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor, *,
                 scale: float, k_scale, v_scale, soft_cap: Optional[float],
                 sliding_window: Optional[int], sinks: Optional[torch.Tensor],
                 partition_size: int, num_partitions: int, loop_stages: int,
                 loop_tile: int, workspace, combine_pdl: bool = False) -> None:
    """q4, out4: ``[S, T, Hq, D]``; caches as ``paged_decode_attention`` takes them;
    ``workspace`` (a ``DecodeWorkspace``) is read only when ``num_partitions > 1``;
    ``loop_stages``, ``loop_tile``: :func:`tuning.native_decode_stages`,
    :func:`tuning.native_decode_tile`; ``combine_pdl``: the combine of a split launch as a
    programmatic dependent launch (:func:`tuning.decode_combine_pdl`)."""
    k_t, k_val = _scale_pair(k_scale)
    v_t, v_val = _scale_pair(v_scale)
    sinks_f32 = sinks.to(torch.float32).contiguous() if sinks is not None else None
    if num_partitions > 1:
        ml, es, po = workspace.max_logits, workspace.exp_sums, workspace.partial_out
    else:
        ml = es = po = out4  # unused by a one-partition launch
    _ops().paged_decode(out4, q4, k_cache, v_cache, block_table, seq_lens, sinks_f32, k_t, v_t,
                        ml, es, po, float(scale), k_val, v_val, float(soft_cap or 0.0),
                        int(sliding_window or 0), int(partition_size), int(num_partitions),
                        int(loop_stages), int(loop_tile), bool(combine_pdl))
