"""fp8 KV widening for the decode kernel (@triton.jit functions).

An fp8 cache (e4m3fn or e5m2) is widened to fp16, which holds every finite value of both
formats exactly, and both dots run on fp16 operands: the bf16 route (fp8 -> f16 -> f32 ->
bf16) costs four conversions a pair of elements where fp16 costs one, and fp16 keeps 3
more bits of P and of the query than bf16 does.

``WIDEN`` (a constexpr, chosen by ``ops.decode.tuning.kv_widen``):

* ``WIDEN_NONE``: a 16-bit cache, cast to the query's dtype (no fp16 dots);
* ``WIDEN_CAST``: Triton's fp8 -> fp16 cast (any backend, the CPU interpreter). On sm_90
  Triton moves that cast behind the shared-memory load of the dot operand, which then
  reads fp8 K a byte at a time;
* ``WIDEN_E4M3_CVT`` / ``WIDEN_E5M2_CVT``: the ``cvt.rn.f16x2.e4m3x2`` / ``e5m2x2``
  instruction (sm_89+) on the tile as loaded: the fp16 tile then takes the 16-bit path
  to the tensor cores (16-byte shared stores, ``ldmatrix``).
"""

import triton
import triton.language as tl

#: the host's names of the modes (``ops.decode.tuning.kv_widen``) and their codes
WIDEN_CODES = {"none": 0, "cast": 1, "e4m3_cvt": 2, "e5m2_cvt": 3}
WIDEN_NONE = tl.constexpr(WIDEN_CODES["none"])
WIDEN_CAST = tl.constexpr(WIDEN_CODES["cast"])
WIDEN_E4M3_CVT = tl.constexpr(WIDEN_CODES["e4m3_cvt"])
WIDEN_E5M2_CVT = tl.constexpr(WIDEN_CODES["e5m2_cvt"])


@triton.jit
def widen_kv(x, WIDEN: tl.constexpr):
    """fp8 tile ``x`` (any shape) -> the same values in fp16 (exact). The asm is marked
    impure only so that Triton keeps it on the tile as loaded (a pure one is moved behind
    the dot operand's shared-memory load, as the cast is)."""
    if WIDEN == WIDEN_E4M3_CVT:
        y = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
            "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False,
            pack=4)
    elif WIDEN == WIDEN_E5M2_CVT:
        y = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; "
            "cvt.rn.f16x2.e5m2x2 $0, lo; cvt.rn.f16x2.e5m2x2 $1, hi; }",
            "=r,=r,r", [x.to(tl.uint8, bitcast=True)], dtype=tl.float16, is_pure=False,
            pack=4)
    else:
        y = x.to(tl.float16)
    return y


@triton.jit
def finite_abs_max(q):
    """The largest finite ``|q|`` of the 2-D tile ``q`` (a float32 scalar; NaN and inf
    entries are left out: they compare false)."""
    qa = tl.abs(q.to(tl.float32))
    qa = tl.where(qa < float("inf"), qa, 0.0)
    return tl.max(tl.max(qa, 1), 0)


@triton.jit
def fp16_range(qmax):
    """``(down, up)``: powers of two with ``qmax * down`` inside fp16's range (``up = 1 /
    down = 1`` unless ``qmax >= 2^16``, which only bf16 holds: below it every bf16 value is
    <= 65280 < fp16's 65504)."""
    exp = ((qmax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2 qmax)
    shift = tl.maximum(exp - 15, 0)
    down = ((127 - shift) << 23).to(tl.float32, bitcast=True)
    up = ((127 + shift) << 23).to(tl.float32, bitcast=True)
    return down, up


@triton.jit
def fp16_query(q):
    """``(q16, up)``: the query tile ``q`` (fp16/bf16, ``[M, D]``) as fp16 scaled by a
    power of two ``1 / up`` so that its largest finite magnitude fits fp16 (``up = 1``
    unless some ``|q| >= 2^16``, which only bf16 holds). Exact but for bits below fp16's
    range when ``up > 1``; NaN and inf entries are left out of the range (their rows stay
    NaN, the other rows are unchanged).
    """
    down, up = fp16_range(finite_abs_max(q))
    return (q.to(tl.float32) * down).to(tl.float16), up
