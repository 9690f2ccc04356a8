"""The native ragged attention (the sm_90a wgmma prefill kernel, ``csrc/prefill_sm90.cu``,
in its ragged mode: ``torch.ops.hygon_attn.ragged_prefill``): what it covers and its
launch. Arguments arrive validated (``api.py``, ``plan.py``); the choice is
``tuning.choose``'s."""

from __future__ import annotations

from typing import Optional

import torch

from hygon_attn_backend import native
from hygon_attn_backend.ops import _checks
from hygon_attn_backend.ops.prefill import native as prefill_native

BLOCK_M = prefill_native.BLOCK_M  # query rows of a program: the tile map's 128 // group tokens
#: (q/k head, v head) pairs the kernel is built for: the prefill's 128 / 128 and MLA's
#: up-projected 192 / 128 (128 nope + 64 rope)
HEAD_DIMS = ((128, 128), (192, 128))
DTYPES = (torch.float16, torch.bfloat16)
#: the widest GQA group: Triton's 128-row tile packs at most 64 heads
#: (``tuning.heads_per_tile``), and a call the native kernel does not take runs Triton on
#: the same tile map
MAX_GROUP = 64
#: the Triton tile a call the native kernel does not take runs on the native tile map
#: (128 rows: the same tokens a tile)
FALLBACK_TILE = (BLOCK_M, 64, 8, 3)


def device_unsupported(device: torch.device) -> Optional[str]:
    """None when ``device`` has the native ragged attention (an NVIDIA sm_90 GPU), else
    why."""
    return prefill_native.device_unsupported(device)


def shape_unsupported(*, head_dim_qk: int, head_dim_v: int, q_dtype: Optional[torch.dtype],
                      group: int) -> Optional[str]:
    """None when the native kernel covers a batch of these heads and dtype (None: not known
    yet), else the reason it does not."""
    if (int(head_dim_qk), int(head_dim_v)) not in HEAD_DIMS:
        return (f"q/k head {head_dim_qk}, v head {head_dim_v} (native ragged attention: "
                + ", ".join(f"{a} / {b}" for a, b in HEAD_DIMS) + ")")
    if q_dtype is not None and q_dtype not in DTYPES:
        return f"q dtype {q_dtype} (native ragged attention: float16/bfloat16)"
    if group > MAX_GROUP:
        return f"GQA group {group} > {MAX_GROUP}"
    return None


def call_unsupported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     out: torch.Tensor) -> Optional[str]:
    """Why one call's tensors cannot run the native kernel (None: they can): 16-byte
    aligned rows (its copies), 4-byte aligned output pairs."""
    for name, t, elems in (("q", q, 8), ("k", k, 8), ("v", v, 8), ("out", out, 2)):
        if not _checks.rows_aligned(t, elems):
            return (f"{name} rows not {2 * elems}-byte aligned with a contiguous last dim "
                    f"(strides {tuple(t.stride())})")
    return None


def launch(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           lse: Optional[torch.Tensor], cu_seqlens_q: torch.Tensor,
           cu_seqlens_k: torch.Tensor, tile_req: torch.Tensor, tile_mblock: torch.Tensor,
           sched: torch.Tensor, *, scale: float, causal: bool) -> None:
    """One launch: tensors as ``ragged_attention`` takes them, checked
    (:func:`call_unsupported`); ``lse`` ``[Hq, total_q]`` float32 or None; the plan's tile
    map of ``128 // group``-token blocks and its int32 ``[2]`` work counter (zeros; the
    kernel leaves it zero)."""
    native.load().ragged_prefill(out, q, k, v, lse, cu_seqlens_q, cu_seqlens_k, tile_req,
                                 tile_mblock, sched, float(scale), bool(causal))
