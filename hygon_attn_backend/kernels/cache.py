"""Triton kernels that write new tokens into the paged KV cache and copy whole blocks.

Address math (all offsets int64; every cache is reached through its strides):

- canonical view ``[num_blocks, kv_heads, P, D]``, strides ``(s_b, s_h, s_s, s_d)``:
  element ``(blk, h, off, d)`` lives at ``blk*s_b + h*s_h + off*s_s + d*s_d``.
- vLLM's split-x K cache ``[num_blocks, kv_heads, D // X, P, X]`` (``SPLIT_X = X > 0``):
  element ``(blk, h, off, d)`` lives at
  ``blk*s_b + h*s_h + (d // X)*s_d + off*s_s + (d % X)*s_x``.

A slot ``s`` of ``slot_mapping`` is block ``s // P``, offset ``s % P``; slots outside
``[0, num_slots)`` (``-1`` marks padding) are masked: nothing is read or written for them.
"""

import triton
import triton.language as tl


@triton.jit
def quantize_fp8_bits(x, scale, FP8_MAX: tl.constexpr, MANT: tl.constexpr,
                      BIAS: tl.constexpr):
    """fp32 ``x`` -> uint8 codes of ``saturate(x / scale)`` in an fp8 format with MANT
    mantissa bits and exponent bias BIAS, rounded to nearest even; NaN -> 0x7F | sign (a
    NaN's sign bit is whatever the division leaves: not meaningful).

    Integer bit arithmetic instead of a cast: exact on every backend (Triton's
    interpreter mis-rounds fp32 -> fp8 casts that carry into the exponent, and not every
    GPU converts to fp8 in hardware). Same result as torch's ``.to(float8_*)``.
    """
    y = tl.math.div_rn(x, scale)
    is_nan = y != y
    sign = (y.to(tl.int32, bitcast=True) >> 24) & 0x80
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    mag = y.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    # normal target: round the 23-bit mantissa to MANT bits (a carry bumps the exponent),
    # then re-bias the exponent from 127 to BIAS.
    normal = (mag + ((1 << (22 - MANT)) - 1) + ((mag >> (23 - MANT)) & 1)) >> (23 - MANT)
    normal = normal - ((127 - BIAS) << MANT)
    # subnormal target (|y| < 2^(1 - BIAS)): the code is round(|y| / 2^(1 - BIAS - MANT)),
    # i.e. the 24-bit significand shifted right by `shift`; reaching 2^MANT gives the
    # smallest normal code, as it should.
    exp = mag >> 23
    significand = (mag & 0x7FFFFF) | 0x800000
    shift = (23 - MANT + 1 - BIAS + 127) - exp
    shift = tl.minimum(tl.maximum(shift, 1), 31)
    sub = (significand + (1 << (shift - 1)) - 1 + ((significand >> shift) & 1)) >> shift
    code = tl.where(exp >= 128 - BIAS, normal, sub)
    code = tl.where(is_nan, 0x7F, code) | sign
    return code.to(tl.uint8)


@triton.jit
def write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    k_scale_ptr, v_scale_ptr, k_scale_value, v_scale_value, k_scale_stride, v_scale_stride,
    num_slots, num_kv_heads,
    stride_slot,
    stride_k_t, stride_k_h, stride_k_d,
    stride_v_t, stride_v_h, stride_v_d,
    stride_kc_b, stride_kc_h, stride_kc_s, stride_kc_d, stride_kc_x,
    stride_vc_b, stride_vc_h, stride_vc_s, stride_vc_d,
    PAGE_SIZE: tl.constexpr,      # P, tokens per block
    HEAD_DIM: tl.constexpr,       # D
    BLOCK_D: tl.constexpr,        # next power of two >= D
    BLOCK_H: tl.constexpr,        # kv heads per program
    SPLIT_X: tl.constexpr,        # 0: 4-D K view; X > 0: 5-D split-x K cache
    QUANT: tl.constexpr,          # fp8 cache (passed as uint8): store saturate(x / scale)
    FP8_MAX: tl.constexpr,        # largest finite value of the fp8 format
    FP8_MANT: tl.constexpr,       # fp8 mantissa bits (e4m3fn: 3, e5m2: 2)
    FP8_BIAS: tl.constexpr,       # fp8 exponent bias (e4m3fn: 7, e5m2: 15)
    SCALE_FROM_PTR: tl.constexpr,  # scales are 1-element fp32 tensors, else floats
):
    """One program per (token, group of BLOCK_H kv heads): writes K and V of that token.

    Grid: ``(num_tokens, cdiv(num_kv_heads, BLOCK_H))``.
    """
    pid_t = tl.program_id(0).to(tl.int64)
    pid_h = tl.program_id(1)

    slot = tl.load(slot_mapping_ptr + pid_t * stride_slot).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)
    blk = slot // PAGE_SIZE
    off = slot % PAGE_SIZE

    # A skipped slot masks every lane (an all-false mask moves no memory).
    heads_limit = tl.where(valid, num_kv_heads, 0)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (offs_h[:, None] < heads_limit) & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]
    h64 = offs_h.to(tl.int64)[:, None]  # [BLOCK_H, 1]
    d64 = offs_d.to(tl.int64)[None, :]  # [1, BLOCK_D]

    # k, v: [BLOCK_H, BLOCK_D]
    k = tl.load(k_ptr + pid_t * stride_k_t + h64 * stride_k_h + d64 * stride_k_d, mask=mask)
    v = tl.load(v_ptr + pid_t * stride_v_t + h64 * stride_v_h + d64 * stride_v_d, mask=mask)

    if QUANT:
        if SCALE_FROM_PTR:
            # per tensor (stride 0) or per KV head (stride 1): [BLOCK_H, 1]
            h_ok = offs_h[:, None] < num_kv_heads
            k_scale = tl.load(k_scale_ptr + h64 * k_scale_stride, mask=h_ok, other=1.0)
            v_scale = tl.load(v_scale_ptr + h64 * v_scale_stride, mask=h_ok, other=1.0)
        else:
            k_scale = k_scale_value
            v_scale = v_scale_value
        # uint8 fp8 codes: [BLOCK_H, BLOCK_D]
        k = quantize_fp8_bits(k.to(tl.float32), k_scale, FP8_MAX, FP8_MANT, FP8_BIAS)
        v = quantize_fp8_bits(v.to(tl.float32), v_scale, FP8_MAX, FP8_MANT, FP8_BIAS)

    if SPLIT_X > 0:
        k_dim_off = (d64 // SPLIT_X) * stride_kc_d + (d64 % SPLIT_X) * stride_kc_x
    else:
        k_dim_off = d64 * stride_kc_d
    k_dst = k_cache_ptr + blk * stride_kc_b + h64 * stride_kc_h + off * stride_kc_s + k_dim_off
    v_dst = v_cache_ptr + blk * stride_vc_b + h64 * stride_vc_h + off * stride_vc_s \
        + d64 * stride_vc_d
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)  # plain cast or fp8 codes
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def copy_blocks_kernel(
    cache_ptr, block_mapping_ptr,
    num_blocks, numel_inner,
    stride_map_n, stride_map_c,
    stride_blk,
    size_1, size_2, size_3, size_4,
    stride_1, stride_2, stride_3, stride_4,
    BLOCK: tl.constexpr,  # elements of one block copied per program
):
    """Copy ``cache[dst] = cache[src]`` for one (src, dst) pair and one chunk of the block.

    The block's inner index space is up to four axes ``(size_1..size_4)`` with strides
    ``(stride_1..stride_4)`` (host side merges contiguous axes and pads with size 1;
    Triton specialises the size-1 arguments, so their div/mod fold away).
    Grid: ``(num_pairs, cdiv(numel_inner, BLOCK))``. The cache is read and written as
    raw bits (same-width integer view), so every dtype copies exactly.
    """
    pid_n = tl.program_id(0).to(tl.int64)
    pid_e = tl.program_id(1)

    src = tl.load(block_mapping_ptr + pid_n * stride_map_n).to(tl.int64)
    dst = tl.load(block_mapping_ptr + pid_n * stride_map_n + stride_map_c).to(tl.int64)
    valid = (src >= 0) & (src < num_blocks) & (dst >= 0) & (dst < num_blocks)
    src = tl.where(valid, src, 0)
    dst = tl.where(valid, dst, 0)

    offs = pid_e * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] flat index inside the block
    mask = offs < tl.where(valid, numel_inner, 0)  # [BLOCK]; an invalid pair moves nothing
    i4 = offs % size_4
    rest = offs // size_4
    i3 = rest % size_3
    rest = rest // size_3
    i2 = rest % size_2
    i1 = rest // size_2
    inner = (i1.to(tl.int64) * stride_1 + i2.to(tl.int64) * stride_2
             + i3.to(tl.int64) * stride_3 + i4.to(tl.int64) * stride_4)  # [BLOCK]

    vals = tl.load(cache_ptr + src * stride_blk + inner, mask=mask)  # [BLOCK]
    tl.store(cache_ptr + dst * stride_blk + inner, vals, mask=mask)
