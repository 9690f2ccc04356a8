"""Plan once per step, launch per layer: the cache-write plan.

vLLM writes the new tokens' K/V once per layer (``do_kv_cache_update``) with the same
``slot_mapping``: :func:`plan_write_kv` fixes the launch once per step and
:meth:`WritePlan.run` launches ``kernels.cache.write_kv_kernel`` for one layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict

import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops import _checks
from hygon_attn_backend.ops._device import gpu_is_hip
from hygon_attn_backend.ops._dispatch import select_impl
from hygon_attn_backend.ops.cache import native, tuning
from hygon_attn_backend.ops._launch import NO_LAYER, Launch

__all__ = ["WritePlan", "plan_write_kv"]

ScaleLike = _checks.ScaleLike

# fp8 formats: (mantissa bits, exponent bias).
FP8_FORMAT = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}

# Arguments of write_kv_kernel that change per layer, in the order WritePlan passes them.
_PER_CALL = (
    "k_ptr", "v_ptr", "k_cache_ptr", "v_cache_ptr", "k_scale_ptr", "v_scale_ptr",
    "k_scale_value", "v_scale_value", "k_scale_stride", "v_scale_stride", "num_slots",
    "stride_k_t", "stride_k_h", "stride_k_d", "stride_v_t", "stride_v_h", "stride_v_d",
    "stride_kc_b", "stride_kc_h", "stride_kc_s", "stride_kc_d", "stride_kc_x",
    "stride_vc_b", "stride_vc_h", "stride_vc_s", "stride_vc_d")


@dataclass(eq=False)
class WritePlan:
    """A ``write_kv`` launch planned for one batch's ``slot_mapping``; :meth:`run` per layer."""

    impl: str
    slot_mapping: torch.Tensor
    num_tokens: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    device: torch.device
    _variants: Dict[tuple, object] = field(default_factory=dict, repr=False)

    @property
    def num_launches(self) -> int:
        return 1 if self.impl != "reference" and self.num_tokens else 0

    def check_call(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        """What a layer may get wrong against the plan (cheap: no tensor checks)."""
        if slot_mapping is not self.slot_mapping:
            raise ValueError("plan: slot_mapping must be the tensor the plan was built with")
        want = (self.num_tokens, self.num_kv_heads, self.head_dim)
        if k.shape != want or v.shape != want:
            raise ValueError(f"plan was built for k/v of shape {want}, got k "
                             f"{_checks.describe(k)}, v {_checks.describe(v)}")
        if v_cache.shape[1:] != (self.num_kv_heads, self.page_size, self.head_dim) \
                or k_cache.dtype != v_cache.dtype:
            raise ValueError(f"plan was built for caches [num_blocks, "
                             f"{self.num_kv_heads}, {self.page_size}, {self.head_dim}]; got k "
                             f"{_checks.describe(k_cache)}, v {_checks.describe(v_cache)}")

    def run(self, k, v, k_cache, v_cache, *, k_scale: ScaleLike = None,
            v_scale: ScaleLike = None) -> None:
        if self.impl == "reference":
            reference.write_kv(k, v, k_cache, v_cache, self.slot_mapping, k_scale=k_scale,
                               v_scale=v_scale)
            return
        if self.num_tokens == 0:
            return
        if self.impl == "native":
            n = self.num_tokens
            native.write_kv(k[:n], v[:n], k_cache, v_cache, self.slot_mapping,
                             k_scale=1.0 if k_scale is None else k_scale,
                             v_scale=1.0 if v_scale is None else v_scale)
            return
        quant = k_cache.dtype in _checks.FP8_DTYPES
        from_ptr, ksp, vsp, ksv, vsv = _checks.scale_launch_args(k_scale, v_scale,
                                                                 self.device, used=quant)
        key = (k_cache.dim(), k_cache.dtype, k.dtype, from_ptr)
        launch = self._variants.get(key)
        if launch is None:
            launch = self._variants[key] = self._make_launch(*key)
        if not from_ptr:  # unused placeholders
            ksp = vsp = self.slot_mapping
        kcs = k_cache.stride()
        kcs = (kcs[0], kcs[1], kcs[2], kcs[3], 0) if len(kcs) == 4 else \
            (kcs[0], kcs[1], kcs[3], kcs[2], kcs[4])  # split-x [N, H, D // x, P, x]
        if quant:
            # The kernel computes the fp8 codes itself (exact rounding on every backend).
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        launch(NO_LAYER, k, v, k_cache, v_cache, ksp, vsp, ksv, vsv,
               _checks.scale_head_stride(ksp) if from_ptr else 0,
               _checks.scale_head_stride(vsp) if from_ptr else 0,
               v_cache.shape[0] * self.page_size,
               *k.stride(), *v.stride(), *kcs, *v_cache.stride())

    def _make_launch(self, k_ndim, kv_dtype, k_dtype, from_ptr):
        from hygon_attn_backend.kernels.cache import write_kv_kernel

        quant = kv_dtype in _checks.FP8_DTYPES
        block_h, num_warps = tuning.write_config(self.num_kv_heads, self.head_dim)
        fp8_mant, fp8_bias = FP8_FORMAT.get(kv_dtype, (0, 0))
        fixed = dict(
            slot_mapping_ptr=self.slot_mapping, num_kv_heads=self.num_kv_heads, stride_slot=self.slot_mapping.stride(0),
            PAGE_SIZE=self.page_size, HEAD_DIM=self.head_dim,
            BLOCK_D=1 << max(0, (self.head_dim - 1).bit_length()), BLOCK_H=block_h,
            SPLIT_X=16 // kv_dtype.itemsize if k_ndim == 5 else 0,
            QUANT=quant, FP8_MAX=float(torch.finfo(kv_dtype).max) if quant else 0.0,
            FP8_MANT=fp8_mant, FP8_BIAS=fp8_bias, SCALE_FROM_PTR=from_ptr)
        grid = (self.num_tokens, -(-self.num_kv_heads // block_h), 1)
        return Launch(write_kv_kernel, grid, fixed, _PER_CALL, num_warps=num_warps,
                      num_stages=1)


def plan_write_kv(slot_mapping: torch.Tensor, *, num_kv_heads: int, head_dim: int,
                  page_size: int, impl: str = "auto") -> WritePlan:
    """Plan ``write_kv`` for one batch (once per step; every layer reuses it).

    slot_mapping: ``[num_tokens]`` int32/int64 cache slot of each new token (``-1``:
    padding, skipped); the layers' calls pass this same tensor. num_kv_heads, head_dim,
    page_size: the caches' ``[num_blocks, num_kv_heads, page_size, head_dim]`` views every
    layer will pass (rows of ``k``/``v`` past ``num_tokens`` are never read).
    impl may also be ``"native"`` (``csrc/``). impl: ``"auto"`` | ``"triton"`` | ``"reference"``.
    """
    _checks.check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=_checks.INDEX_DTYPES)
    for name, value in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("page_size", page_size)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    chosen = select_impl(impl, slot_mapping.device, native_preferred=tuning.native_preferred(
        is_hip=gpu_is_hip()))
    num_tokens = slot_mapping.shape[0] if num_kv_heads and head_dim else 0
    return WritePlan(impl=chosen, slot_mapping=slot_mapping, num_tokens=num_tokens,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                     device=slot_mapping.device)

