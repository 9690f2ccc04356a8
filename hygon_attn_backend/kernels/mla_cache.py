"""Triton kernel writing new tokens' latent rows into the paged MLA cache.

A latent row is ``[kv_c (RANK) | k_pe (ROPE)]``; the cache is ``[num_blocks, P, W]``
with any int64 strides. Slot ``s`` of ``slot_mapping`` is block ``s // P``, offset
``s % P``; a slot outside ``[0, num_slots)`` (``-1`` marks padding) is skipped: nothing
is read or written for it.
"""

import triton
import triton.language as tl

from hygon_attn_backend.kernels.cache import quantize_fp8_bits


@triton.jit
def write_mla_cache_kernel(
    kv_c_ptr, k_pe_ptr, cache_ptr, slot_mapping_ptr, scale_ptr, scale_value, num_slots,
    stride_slot, stride_c_t, stride_c_d, stride_pe_t, stride_pe_d,
    stride_cache_b, stride_cache_s, stride_cache_d,
    RANK: tl.constexpr,           # kv_lora_rank
    ROPE: tl.constexpr,           # rope_dim (0: none)
    PAGE_SIZE: tl.constexpr,
    BLOCK_W: tl.constexpr,        # next power of two of RANK + ROPE
    QUANT: tl.constexpr,          # fp8 cache (passed as uint8): store saturate(x / scale)
    FP8_MAX: tl.constexpr,
    FP8_MANT: tl.constexpr,
    FP8_BIAS: tl.constexpr,
    SCALE_FROM_PTR: tl.constexpr,  # the scale is a 1-element fp32 tensor, else a float
):
    """One program a token writes its whole row. Grid ``(num_tokens,)``."""
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + tok * stride_slot).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    blk = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    offs = tl.arange(0, BLOCK_W)  # [BLOCK_W] column of the row
    limit = tl.where(valid, RANK + ROPE, 0)  # a skipped slot masks every lane
    in_c = offs < tl.minimum(limit, RANK)
    in_pe = (offs >= RANK) & (offs < limit)
    x = tl.load(kv_c_ptr + tok * stride_c_t + offs.to(tl.int64) * stride_c_d, mask=in_c,
                other=0.0).to(tl.float32)
    if ROPE > 0:
        pe_col = tl.where(in_pe, offs - RANK, 0).to(tl.int64)
        pe = tl.load(k_pe_ptr + tok * stride_pe_t + pe_col * stride_pe_d, mask=in_pe,
                     other=0.0).to(tl.float32)
        x = tl.where(in_pe, pe, x)  # [BLOCK_W]
    if QUANT:
        if SCALE_FROM_PTR:
            scale = tl.load(scale_ptr)
        else:
            scale = scale_value
        x = quantize_fp8_bits(x, scale, FP8_MAX, FP8_MANT, FP8_BIAS)  # uint8 codes
    dst = cache_ptr + blk * stride_cache_b + off * stride_cache_s \
        + offs.to(tl.int64) * stride_cache_d
    tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=in_c | in_pe)
