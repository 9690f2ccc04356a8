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
# ... and on AMD/Hygon gfx9 past head_dim 64, where a 64-row program's shared memory
# (Layout<64, D>::BYTES: 79,872 bytes at D=128) is past the 64 KB of LDS: the launch
# (dispatch_rows, csrc/decode_kernel.cuh) takes 32-row programs there
DECODE_MAX_ROWS_LDS64 = 32


def decode_rows_per_program(head_dim: int, *, is_hip: Optional[bool] = None) -> int:
    """The most query rows one native decode program takes (``is_hip`` None: this
    machine's torch)."""
    from hygon_attn_backend import tuning

    hip = tuning.gpu_is_hip() if is_hip is None else is_hip
    return DECODE_MAX_ROWS_LDS64 if hip and head_dim > 64 else DECODE_MAX_ROWS


def decode_grid_programs(*, num_seqs: int, num_kv_heads: int, rows: int,
                         head_dim: int = 128, is_hip: Optional[bool] = None) -> int:
    """Programs per partition of the native decode grid (sequences x KV heads x row
    chunks) for ``rows = G * T`` query rows per KV head."""
    per = decode_rows_per_program(head_dim, is_hip=is_hip)
    return num_seqs * num_kv_heads * -(-rows // per)


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


def decode_layer_args(*, k_scale, v_scale, sinks: Optional[torch.Tensor],
                      soft_cap: Optional[float], sliding_window: Optional[int]) -> tuple:
    """One layer's side of a native decode launch, resolved once (a ``DecodeLayer`` keeps
    it): ``(sinks float32 or None, k scale tensor or None, v scale tensor or None, k scale
    value, v scale value, soft cap, window)``. Tensors are held, not copied, where they are
    float32 already (an in-place update of them is seen by later launches)."""
    k_t, k_val = _scale_pair(k_scale)
    v_t, v_val = _scale_pair(v_scale)
    sinks_f32 = sinks.to(torch.float32).contiguous() if sinks is not None else None
    return (sinks_f32, k_t, v_t, k_val, v_val, float(soft_cap or 0.0), int(sliding_window or 0))


def decode_plan_args(*, partition_size: int, num_partitions: int, loop_stages: int,
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


def paged_decode_resolved(out4: torch.Tensor, q4: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, block_table: torch.Tensor,
                          seq_lens: torch.Tensor, scale: float, layer_args: tuple,
                          plan_args: tuple) -> None:
    """The native decode launch from :func:`decode_layer_args` and :func:`decode_plan_args`
    (what an engine's per-layer call runs: no option is looked at again). q4, out4:
    ``[S, T, Hq, D]``; caches as ``paged_decode_attention`` takes them."""
    sinks, k_t, v_t, k_val, v_val, cap, window = layer_args
    ws, psize, nparts, stages, tile, pdl, max_rows = plan_args
    ml, es, po = ws if ws is not None else (out4, out4, out4)  # unsplit: never read
    _ops().paged_decode(out4, q4, k_cache, v_cache, block_table, seq_lens, sinks, k_t, v_t,
                        ml, es, po, float(scale), k_val, v_val, cap, window, psize, nparts,
                        stages, tile, pdl, max_rows)


# ----------------------------------------------------------------------------- prefill

PREFILL_BLOCK_M = 128  # query rows of a native prefill program (csrc/prefill_sm90.cu)
PREFILL_HEAD_DIM = 128
PREFILL_DTYPES = (torch.float16, torch.bfloat16)  # q, caches and out alike


def prefill_device_unsupported(device: torch.device) -> Optional[str]:
    """None when ``device`` has the native prefill (an NVIDIA sm_90 GPU: the kernel is
    written for sm_90a's wgmma), else the reason."""
    if device.type != "cuda":
        return f"device {device} (the native prefill runs on NVIDIA sm_90 GPUs)"
    if getattr(torch.version, "hip", None):
        return "a HIP GPU (the native prefill is the sm_90 wgmma kernel; HIP runs Triton)"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]} (the native prefill needs sm_90: H100/H200)"
    return None


def prefill_dtype_unsupported(kv_dtype: torch.dtype) -> Optional[str]:
    """Why a KV cache of ``kv_dtype`` cannot run the native prefill (None: it can)."""
    if kv_dtype not in PREFILL_DTYPES:
        return f"KV cache dtype {kv_dtype} (native prefill: float16/bfloat16, no fp8 KV)"
    return None


def prefill_shape_unsupported(*, head_dim: int, q_dtype: Optional[torch.dtype],
                              kv_dtype: Optional[torch.dtype], group: int) -> Optional[str]:
    """None when the native prefill (sm_90a wgmma, ``csrc/prefill_sm90.cu``) covers a batch
    of these shapes and dtypes (None: not known yet), else the reason it does not. The
    device is :func:`prefill_device_unsupported`'s question."""
    if head_dim != PREFILL_HEAD_DIM:
        return f"head_dim {head_dim} (native prefill: {PREFILL_HEAD_DIM})"
    if q_dtype is not None and q_dtype not in PREFILL_DTYPES:
        return f"q dtype {q_dtype} (native prefill: float16/bfloat16)"
    why = prefill_dtype_unsupported(kv_dtype) if kv_dtype is not None else None
    if why is not None:
        return why
    if group > PREFILL_BLOCK_M:
        return f"GQA group {group} > {PREFILL_BLOCK_M}"
    return None


def _rows_aligned(t: torch.Tensor, elems: int) -> bool:
    """Innermost stride 1 and every row start a multiple of ``elems`` elements from a base
    aligned to as many elements (the kernel's 16-byte copies / 4-byte stores). Runs per
    call for q and out: one stride() and shape read, no generator (2.4 -> 1.6 us for the
    two on the CPU host of scripts/native_host_cost.py)."""
    strides, shape = t.stride(), t.shape
    if strides[-1] != 1 and shape[-1] > 1:
        return False
    if t.data_ptr() % (elems * t.element_size()):
        return False
    for s, n in zip(strides[:-1], shape[:-1]):
        if s % elems and n > 1:
            return False
    return True


def prefill_layer_unsupported(k_cache: torch.Tensor, v_cache: torch.Tensor) -> Optional[str]:
    """Why one layer's caches cannot run the native prefill (None: they can; the caller
    checks that q has the caches' dtype)."""
    why = prefill_dtype_unsupported(k_cache.dtype) or prefill_dtype_unsupported(v_cache.dtype)
    if why is None and v_cache.dtype != k_cache.dtype:
        why = f"KV cache dtypes {k_cache.dtype} / {v_cache.dtype} differ"
    if why is not None:
        return why
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not _rows_aligned(t, 8):
            return (f"{name} rows not 16-byte aligned with a contiguous last dim (strides "
                    f"{tuple(t.stride())})")
    return None


def prefill_call_unsupported(q: torch.Tensor, out: torch.Tensor,
                             k_new: Optional[torch.Tensor],
                             v_new: Optional[torch.Tensor]) -> Optional[str]:
    """Why one call's tensors cannot run the native prefill (None: they can)."""
    for name, t, elems in (("q", q, 8), ("out", out, 2), ("k_new", k_new, 8),
                           ("v_new", v_new, 8)):
        if t is not None and not _rows_aligned(t, elems):
            return (f"{name} rows not {2 * elems}-byte aligned with a contiguous last dim "
                    f"(strides {tuple(t.stride())})")
    return None


def prefix_prefill(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, block_table: torch.Tensor,
                   cu_seqlens_q: torch.Tensor, seq_lens_k: torch.Tensor,
                   tile_req: torch.Tensor, tile_mblock: torch.Tensor,
                   sched: Optional[torch.Tensor], *, scale: float,
                   causal: bool, k_new: Optional[torch.Tensor], v_new: Optional[torch.Tensor],
                   lse: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
                   soft_cap: Optional[float], sliding_window: Optional[int],
                   pingpong: bool = True, overlap: bool = True) -> None:
    """The native prefill launch: tensors as ``prefix_prefill_attention`` takes them,
    already checked (:func:`prefill_layer_unsupported`, :func:`prefill_call_unsupported`);
    ``tile_req``/``tile_mblock`` the plan's map of ``128 // group``-token blocks; ``sched``:
    the plan's int32 ``[2]`` work counter (zeros; the kernel leaves it zero) for a
    persistent launch, or None for one program per work item; ``pingpong``, ``overlap``:
    the consumers' two overlaps (``HabPrefillParams``), as the plan read them."""
    sinks_f32 = sinks.to(torch.float32).contiguous() if sinks is not None else None
    _ops().prefix_prefill(out, q, k_cache, v_cache, k_new, v_new, lse, sinks_f32, block_table,
                          cu_seqlens_q, seq_lens_k, tile_req, tile_mblock,
                          sched, float(scale),
                          float(soft_cap or 0.0), bool(causal), int(sliding_window or 0),
                          bool(pingpong), bool(overlap))
