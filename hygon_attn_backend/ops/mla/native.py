"""The native MLA decode (the sm_90a wgmma kernel, ``csrc/mla_decode_sm90.cu``,
``torch.ops.hygon_attn.mla_decode``): what it covers and its launch. Arguments arrive
validated (``api.py``, ``plan.py``); the choice is ``tuning.native_preferred``'s."""

from __future__ import annotations

from typing import Optional

import torch

from hygon_attn_backend import native
from hygon_attn_backend.ops import _checks
from hygon_attn_backend.ops._device import sm90_unsupported

RANK = 512     # the kernel's value width (kv_lora_rank)
ROPE = 64      # and rope channels: 576-wide latent rows
ROWS = 64      # query rows of a program (T x Hq rows of a request in blocks of 64)
BLOCK_N = 64   # keys a tile: the split's alignment, which the Triton combine must share
DTYPES = (torch.float16, torch.bfloat16)
#: the fp8 caches it widens to fp16 (a per-tensor scale)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def device_unsupported(device: torch.device) -> Optional[str]:
    """None when ``device`` has the native MLA decode (an NVIDIA sm_90 GPU), else why."""
    return sm90_unsupported(device, "the native MLA decode")


def shape_unsupported(*, kv_lora_rank: int, rope_dim: int, q_dtype: torch.dtype,
                      kv_dtype: torch.dtype) -> Optional[str]:
    """None when the native MLA decode covers a batch of these widths and dtypes, else the
    reason it does not (the device is :func:`device_unsupported`'s question)."""
    if (kv_lora_rank, rope_dim) != (RANK, ROPE):
        return f"latent rows {kv_lora_rank} + {rope_dim} (native MLA decode: {RANK} + {ROPE})"
    if q_dtype not in DTYPES or (kv_dtype != q_dtype and kv_dtype not in FP8_DTYPES):
        return (f"q {q_dtype} with a {kv_dtype} cache (native MLA decode: float16/bfloat16 q "
                "with a cache of q's dtype, float8_e4m3fn or float8_e5m2)")
    return None


def call_unsupported(q: torch.Tensor, kv_cache: torch.Tensor,
                     out: torch.Tensor) -> Optional[str]:
    """Why one call's tensors cannot run the native MLA decode (None: they can)."""
    if out.dtype != q.dtype:
        return f"out dtype {out.dtype} (the native kernel writes q's {q.dtype})"
    for name, t, nbytes in (("q", q, 16), ("kv_cache", kv_cache, 16), ("out", out, 4)):
        if not _checks.rows_aligned(t, nbytes // t.element_size()):
            return (f"{name} rows not {nbytes}-byte aligned with a contiguous last dim "
                    f"(strides {tuple(t.stride())})")
    return None


def launch(plan, q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
           lse: Optional[torch.Tensor], kv_scale_ptr: Optional[torch.Tensor] = None,
           kv_scale_value: float = 1.0) -> None:
    """The decode launch of ``plan`` (impl ``"native"``) for one layer, the tensors checked
    (:func:`call_unsupported`); a split plan's combine follows (the caller's). An fp8
    cache's scale: ``kv_scale_ptr`` (a 1-element float32 tensor, read on the device) or
    ``kv_scale_value``."""
    q4 = q if q.dim() == 4 else q.unsqueeze(1)
    out4 = out if out.dim() == 4 else out.unsqueeze(1)
    cfg, ws = plan.config, plan.workspace
    split = cfg.split
    lse3 = None
    if lse is not None and not split:
        lse3 = lse if lse.dim() == 3 else lse.unsqueeze(1)
    native.load().mla_decode(
        out4, lse3, ws.max_logits if split else None, ws.exp_sums if split else None,
        ws.partial_out if split else None, q4, kv_cache, plan.block_table, plan.seq_lens,
        kv_scale_ptr, float(kv_scale_value), float(plan.scale), int(cfg.num_partitions),
        int(cfg.kernel_partition_size))


__all__ = ["RANK", "ROPE", "ROWS", "BLOCK_N", "DTYPES", "FP8_DTYPES", "device_unsupported", "shape_unsupported",
           "call_unsupported", "launch"]
