"""The native paged decode (``csrc/``, ``torch.ops.hygon_attn.paged_decode``): what it
covers, its grid and occupancy facts, and the launch from a plan and a layer binding.
Arguments arrive validated (``api.py``, ``plan.py``); nothing here chooses a config."""

from __future__ import annotations

import functools
from typing import Optional

import torch

from hygon_attn_backend import native
from hygon_attn_backend.ops._checks import FP8_DTYPES, native_scale_pair
from hygon_attn_backend.ops._device import gpu_is_hip

HEAD_DIMS = (64, 80, 96, 128, 192, 256)
MAX_ROWS = 64  # query rows per native decode program; more run in row chunks
# ... and on AMD/Hygon gfx9 past head_dim 64, where a 64-row program's shared memory
# (Layout<64, D>::BYTES: 79,872 bytes at D=128) is past the 64 KB of LDS: the launch
# (dispatch_rows, csrc/decode_kernel.cuh) takes 32-row programs there
MAX_ROWS_LDS64 = 32


def unsupported(*, head_dim: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                kv_head_grid: bool = True) -> Optional[str]:
    """None when the native decode covers calls of this shape, else the reason it does not."""
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (native: {HEAD_DIMS})"
    if kv_dtype not in FP8_DTYPES and kv_dtype != q_dtype:
        return f"k_cache dtype {kv_dtype} with q {q_dtype}"
    if not kv_head_grid:
        return "the per-query-head grid (a Triton baseline)"
    return None


def rows_per_program(head_dim: int, *, is_hip: Optional[bool] = None) -> int:
    """The most query rows one native decode program takes (``is_hip`` None: this
    machine's torch)."""
    hip = gpu_is_hip() if is_hip is None else is_hip
    return MAX_ROWS_LDS64 if hip and head_dim > 64 else MAX_ROWS


def grid_programs(*, num_seqs: int, num_kv_heads: int, rows: int, head_dim: int = 128,
                  is_hip: Optional[bool] = None) -> int:
    """Programs per partition of the native decode grid (sequences x KV heads x row
    chunks) for ``rows = G * T`` query rows per KV head."""
    per = rows_per_program(head_dim, is_hip=is_hip)
    return num_seqs * num_kv_heads * -(-rows // per)


def block_n(*, head_dim: int, rows: int, loop_stages: int, loop_tile: int) -> int:
    """KV tokens per tile of the native decode for ``rows`` query rows per program:
    ``loop_tile`` where the split-N loop runs (``loop_stages`` > 0, up to 16 rows, head_dim
    <= 128: ``SplitN`` in decode_kernel.cuh), else the shared-softmax loop's
    ``Layout::BLOCK_N`` (64, 32 past D=128)."""
    if head_dim > 128:
        return 32
    return loop_tile if loop_stages and rows <= 16 else 64


@functools.lru_cache(maxsize=None)
def programs_per_sm(*, device_index: int, q_dtype: torch.dtype, kv_dtype: torch.dtype,
                    head_dim: int, rows: int, loop_stages: int, loop_tile: int) -> int:
    """Native decode programs that fit on one SM at once (the runtime's occupancy
    calculator for the instantiation a launch of ``rows = G * T`` query rows per KV head
    would take; 16-byte aligned K/V rows assumed)."""
    with torch.cuda.device(device_index):
        n = int(native.load().decode_programs_per_sm(q_dtype, kv_dtype, head_dim, rows,
                                                     loop_stages, loop_tile))
    if n < 1:
        raise RuntimeError(f"native decode: no occupancy for head_dim={head_dim}, rows={rows}, "
                           f"loop_stages={loop_stages}, loop_tile={loop_tile} "
                           f"({q_dtype}, KV {kv_dtype})")
    return n


def layer_args(*, k_scale, v_scale, sinks: Optional[torch.Tensor],
               soft_cap: Optional[float], sliding_window: Optional[int]) -> tuple:
    """One layer's side of a native decode launch, resolved once (a ``DecodeLayer`` keeps
    it): ``(sinks float32 or None, k scale tensor or None, v scale tensor or None, k scale
    value, v scale value, soft cap, window)``. Tensors are held, not copied, where they are
    float32 already (an in-place update of them is seen by later launches)."""
    k_t, k_val = native_scale_pair(1.0 if k_scale is None else k_scale)
    v_t, v_val = native_scale_pair(1.0 if v_scale is None else v_scale)
    sinks_f32 = sinks.to(torch.float32).contiguous() if sinks is not None else None
    return (sinks_f32, k_t, v_t, k_val, v_val, float(soft_cap or 0.0), int(sliding_window or 0))


def plan_args(*, partition_size: int, num_partitions: int, loop_stages: int,
              loop_tile: int, workspace, combine_pdl: bool = False,
              max_rows: int = 0) -> tuple:
    """One plan's side of a native decode launch, resolved once: the workspace's three
    tensors (None unsplit), partition size and count, the loop's stages and tile, the
    combine's programmatic launch, the rows a program takes at most
    (``HabDecodeParams::max_rows``: 0 lets the launch fit them to the device)."""
    ws = ((workspace.max_logits, workspace.exp_sums, workspace.partial_out)
          if num_partitions > 1 else None)
    return (ws, int(partition_size), int(num_partitions), int(loop_stages), int(loop_tile),
            bool(combine_pdl), int(max_rows))


def launch(out4: torch.Tensor, q4: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, block_table: torch.Tensor, seq_lens: torch.Tensor,
           scale: float, layer: tuple, plan: tuple) -> None:
    """The native decode launch from :func:`layer_args` and :func:`plan_args` (what an
    engine's per-layer call runs: no option is looked at again). q4, out4: ``[S, T, Hq,
    D]``; caches as ``paged_decode_attention`` takes them."""
    sinks, k_t, v_t, k_val, v_val, cap, window = layer
    ws, psize, nparts, stages, tile, pdl, max_rows = plan
    ml, es, po = ws if ws is not None else (out4, out4, out4)  # unsplit: never read
    native.load().paged_decode(out4, q4, k_cache, v_cache, block_table, seq_lens, sinks, k_t,
                               v_t, ml, es, po, float(scale), k_val, v_val, cap, window,
                               psize, nparts, stages, tile, pdl, max_rows)
