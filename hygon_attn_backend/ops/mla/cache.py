"""The MLA latent cache write: ``write_mla_cache`` (and its per-step plan).

``kernels/mla_cache.py`` writes each new token's ``[kv_c | k_pe]`` row into the
``[num_blocks, page_size, kv_lora_rank + rope_dim]`` cache through its strides; the rules
are ``write_kv``'s (``ops/cache``): slots outside the cache (``-1``: padding) are skipped,
fp8 caches store ``x / kv_scale`` saturated, rounded exactly as torch rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops import _checks
from hygon_attn_backend.ops._dispatch import select_impl
from hygon_attn_backend.ops._launch import NO_LAYER, Launch
from hygon_attn_backend.ops.mla import tuning

__all__ = ["write_mla_cache", "plan_write_mla_cache", "MLAWritePlan"]

ScaleLike = _checks.ScaleLike

# fp8 formats: (mantissa bits, exponent bias), as ops/cache/plan.py.
_FP8_FORMAT = {torch.float8_e4m3fn: (3, 7), torch.float8_e5m2: (2, 15)}
_PER_CALL = ("kv_c_ptr", "k_pe_ptr", "cache_ptr", "scale_ptr", "scale_value", "num_slots",
             "stride_c_t", "stride_c_d", "stride_pe_t", "stride_pe_d",
             "stride_cache_b", "stride_cache_s", "stride_cache_d")


@dataclass(eq=False)
class MLAWritePlan:
    """A ``write_mla_cache`` launch planned for one batch's ``slot_mapping``; :meth:`run`
    per layer."""

    impl: str
    slot_mapping: torch.Tensor
    num_tokens: int
    kv_lora_rank: int
    rope_dim: int
    page_size: int
    device: torch.device
    _variants: Dict[tuple, Launch] = field(default_factory=dict, repr=False)

    def check_call(self, kv_c, k_pe, kv_cache, slot_mapping) -> None:
        if slot_mapping is not self.slot_mapping:
            raise ValueError("plan: slot_mapping must be the tensor the plan was built with")
        _check_rows(kv_c, k_pe, kv_cache, self.num_tokens, self.kv_lora_rank,
                    self.rope_dim, self.device)
        if kv_cache.shape[1] != self.page_size:
            raise ValueError(f"kv_cache: the plan was built for page_size {self.page_size}, "
                             f"got {_checks.describe(kv_cache)}")

    def run(self, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor, *,
            kv_scale: ScaleLike = None) -> None:
        fp8 = kv_cache.dtype in _checks.FP8_DTYPES
        if self.impl == "reference":
            reference.write_mla_cache(kv_c, k_pe, kv_cache, self.slot_mapping,
                                      kv_scale=kv_scale if fp8 else None)
            return
        if self.num_tokens == 0 or kv_cache.shape[0] == 0:
            return
        from_ptr = fp8 and isinstance(kv_scale, torch.Tensor)
        key = (kv_cache.dtype, kv_c.dtype, k_pe.dtype, from_ptr)
        launch = self._variants.get(key)
        if launch is None:
            launch = self._variants[key] = self._make_launch(kv_cache.dtype, from_ptr)
        value = float(kv_scale) if fp8 and kv_scale is not None and not from_ptr else 1.0
        cache = kv_cache.view(torch.uint8) if fp8 else kv_cache
        if self.rope_dim == 0:  # an empty k_pe may have no address: kv_c stands in
            k_pe = kv_c
        launch(NO_LAYER, kv_c, k_pe, cache, kv_scale if from_ptr else self.slot_mapping,
               value, kv_cache.shape[0] * self.page_size, *kv_c.stride(), *k_pe.stride(),
               *cache.stride())

    def _make_launch(self, kv_dtype, from_ptr) -> Launch:
        from hygon_attn_backend.kernels.mla_cache import write_mla_cache_kernel

        quant = kv_dtype in _checks.FP8_DTYPES
        block_w, num_warps = tuning.write_config(self.kv_lora_rank + self.rope_dim)
        mant, bias = _FP8_FORMAT.get(kv_dtype, (0, 0))
        fixed = dict(slot_mapping_ptr=self.slot_mapping,
                     stride_slot=self.slot_mapping.stride(0), RANK=self.kv_lora_rank,
                     ROPE=self.rope_dim, PAGE_SIZE=self.page_size, BLOCK_W=block_w,
                     QUANT=quant, FP8_MAX=float(torch.finfo(kv_dtype).max) if quant else 0.0,
                     FP8_MANT=mant, FP8_BIAS=bias, SCALE_FROM_PTR=from_ptr)
        return Launch(write_mla_cache_kernel, (self.num_tokens, 1, 1), fixed, _PER_CALL,
                      num_warps=num_warps, num_stages=1)


def _check_rows(kv_c, k_pe, kv_cache, num_tokens, rank, rope, device) -> None:
    _checks.check_tensor("kv_c", kv_c, dtypes=_checks.Q_DTYPES, device=device,
                         shape=(num_tokens, rank))
    _checks.check_tensor("k_pe", k_pe, dtypes=_checks.Q_DTYPES, device=device,
                         shape=(num_tokens, rope))
    _checks.check_tensor("kv_cache", kv_cache, ndim=3, dtypes=_checks.KV_DTYPES, device=device)
    if kv_cache.shape[2] != rank + rope:
        raise ValueError(f"kv_cache rows must be kv_lora_rank + rope_dim = {rank} + {rope} "
                         f"wide, got {_checks.describe(kv_cache)}")
    for axis, (size, stride) in enumerate(zip(kv_cache.shape, kv_cache.stride())):
        if size > 1 and stride == 0:
            raise ValueError(f"kv_cache has stride 0 on axis {axis} (a broadcast view), got "
                             f"strides {kv_cache.stride()} with {_checks.describe(kv_cache)}")


def plan_write_mla_cache(slot_mapping: torch.Tensor, *, kv_lora_rank: int, rope_dim: int,
                         page_size: int, impl: str = "auto") -> MLAWritePlan:
    """Plan ``write_mla_cache`` for one batch (once per step; every layer reuses it).

    slot_mapping: ``[N]`` int32/int64 cache slot of each new token (``-1``: padding);
    kv_lora_rank, rope_dim, page_size: the ``[num_blocks, page_size, kv_lora_rank +
    rope_dim]`` cache every layer passes. impl: ``"auto"`` | ``"triton"`` |
    ``"reference"`` (``"native"`` runs Triton).
    """
    _checks.check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=_checks.INDEX_DTYPES)
    for name, value, least in (("kv_lora_rank", kv_lora_rank, 1), ("rope_dim", rope_dim, 0),
                               ("page_size", page_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")
    chosen = select_impl(impl, slot_mapping.device)  # "native" resolves to "triton"
    return MLAWritePlan(impl=chosen, slot_mapping=slot_mapping,
                        num_tokens=slot_mapping.shape[0], kv_lora_rank=kv_lora_rank,
                        rope_dim=rope_dim, page_size=page_size, device=slot_mapping.device)


def write_mla_cache(kv_c: torch.Tensor, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, *, kv_scale: ScaleLike = None,
                    plan: Optional[MLAWritePlan] = None, impl: str = "auto") -> None:
    """Write new tokens' latent rows ``[kv_c | k_pe]`` into the paged MLA cache, in place.

    kv_c: ``[N, kv_lora_rank]`` float16 / bfloat16 / float32, any strides (vLLM's
       normalized ``kv_c``; SGLang's ``cache_k_nope``).
    k_pe: ``[N, rope_dim]`` (the rotated ``k_pe``; a ``[N, 1, rope_dim]`` tensor passes
       as ``k_pe.squeeze(1)``), rope_dim may be 0.
    kv_cache: ``[num_blocks, page_size, kv_lora_rank + rope_dim]`` any strides, float16 /
       bfloat16 / float32 / float8_e4m3fn / float8_e5m2 (vLLM's MLA cache as it is;
       SGLang's ``kv_buffer[layer]`` ``[num_pages * page_size, 1, W]`` as
       ``.view(-1, page_size, W)``).
    slot_mapping: ``[N]`` int32 / int64; token ``i`` goes to block ``slot // page_size``,
       offset ``slot % page_size``; ``-1`` marks padding and is skipped, as is any slot
       outside ``[0, num_blocks * page_size)`` (``HYGON_ATTN_DEBUG=1`` raises on those
       other than ``-1``).
    kv_scale: an fp8 cache's per-tensor scale (float or 1-element float32 tensor, default
       1): the cache stores ``x / kv_scale`` saturated; ignored for other dtypes.
    plan: a :func:`plan_write_mla_cache` result for this ``slot_mapping``.
    impl: ``"auto"`` | ``"triton"`` | ``"reference"``.

    Distinct tokens must map to distinct slots (which one wins otherwise is undefined).
    """
    if plan is not None:
        if not isinstance(plan, MLAWritePlan):
            raise ValueError(f"plan must be an MLAWritePlan (plan_write_mla_cache), got "
                             f"{type(plan).__name__}")
        plan.check_call(kv_c, k_pe, kv_cache, slot_mapping)
        plan.run(kv_c, k_pe, kv_cache, kv_scale=kv_scale)
        return
    _checks.check_tensor("kv_c", kv_c, ndim=2, dtypes=_checks.Q_DTYPES)
    _checks.check_tensor("k_pe", k_pe, ndim=2, dtypes=_checks.Q_DTYPES, device=kv_c.device)
    num_tokens, rank = kv_c.shape
    _checks.check_tensor("slot_mapping", slot_mapping, ndim=1, dtypes=_checks.INDEX_DTYPES,
                         device=kv_c.device, shape=(num_tokens,))
    _check_rows(kv_c, k_pe, kv_cache, num_tokens, rank, k_pe.shape[1], kv_c.device)
    _checks.check_scale("kv_scale", kv_scale, kv_cache.dtype, kv_c.device)
    num_blocks, page_size = kv_cache.shape[0], kv_cache.shape[1]
    if page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size} (kv_cache "
                         f"{_checks.describe(kv_cache)})")
    if _checks.debug_enabled() and num_tokens:
        bad = slot_mapping[(slot_mapping != -1) & ((slot_mapping < 0) |
                                                   (slot_mapping >= num_blocks * page_size))]
        if bad.numel():
            raise ValueError(f"slot_mapping holds slots {bad[:8].tolist()} outside the cache's "
                             f"{num_blocks} blocks x {page_size} slots (-1 marks padding)")
    plan = plan_write_mla_cache(slot_mapping, kv_lora_rank=rank, rope_dim=k_pe.shape[1],
                                page_size=page_size, impl=impl)
    plan.run(kv_c, k_pe, kv_cache, kv_scale=kv_scale)
