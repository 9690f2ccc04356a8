"""The native cache ops (``csrc/cache_kernels.cu``, ``torch.ops.hygon_attn.write_kv`` /
``copy_blocks``): the launches of already-validated tensors."""

from __future__ import annotations

from typing import Sequence

import torch

from hygon_attn_backend import native
from hygon_attn_backend.ops._checks import FP8_DTYPES, native_scale_pair


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, k_scale, v_scale) -> None:
    """k, v: ``[T, H, D]``; k_cache 4-D view or 5-D split-x; v_cache 4-D view; any strides;
    scales a float or a tensor of 1 or H elements (read for fp8 caches only)."""
    fp8 = k_cache.dtype in FP8_DTYPES
    k_t, k_val = native_scale_pair(k_scale if fp8 else 1.0)
    v_t, v_val = native_scale_pair(v_scale if fp8 else 1.0)
    native.load().write_kv(k, v, k_cache, v_cache, slot_mapping, k_t, v_t, k_val, v_val)


def copy_blocks(cache: torch.Tensor, block_mapping: torch.Tensor, sizes: Sequence[int],
                strides: Sequence[int]) -> None:
    """One cache (dim 0 = block); ``sizes``/``strides``: the 4 merged inner axes."""
    native.load().copy_blocks(cache, block_mapping, list(sizes), list(strides))
