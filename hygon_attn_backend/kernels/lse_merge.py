"""Attention over disjoint key sets merged by the sets' log-sum-exps, one launch.

Row ``(n, h)`` of ``R`` partial outputs ``o_r`` with natural-log LSEs ``s_r``:

    out = sum_r w_r o_r / sum_r w_r,   w_r = exp(s_r - M),   M = max_r s_r,
    lse = M + ln sum_r w_r

(zeros and ``-inf`` where every ``s_r`` is ``-inf``). ``ops.lse_merge.merge_partials``
launches it on GPUs; its torch form is the same arithmetic.
"""

import triton
import triton.language as tl


@triton.jit
def merge_lse_kernel(outs_ptr, lses_ptr, out_ptr, lse_ptr, num_sets, num_heads, head_dim,
                     so_r, so_n, so_h, so_d, sl_r, sl_n, sl_h, st_n, st_h, st_d, stl_n, stl_h,
                     BLOCK_D: tl.constexpr, WRITE_LSE: tl.constexpr):
    """One program a row ``(n, h)`` (grid ``N * H``): ``outs [R, N, H, D]`` (any float
    dtype), ``lses [R, N, H]`` float -> ``out [N, H, D]`` (its dtype), ``lse [N, H]``
    float32 when WRITE_LSE. Offsets in int64."""
    row = tl.program_id(0).to(tl.int64)
    n = row // num_heads
    h = row % num_heads
    offs_d = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    dmask = offs_d < head_dim
    m = -float("inf")
    for r in range(0, num_sets):
        s = tl.load(lses_ptr + r * sl_r + n * sl_n + h * sl_h).to(tl.float32)
        m = tl.maximum(m, s)
    m_use = tl.where(m == -float("inf"), 0.0, m)
    total = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)  # [BLOCK_D]
    for r in range(0, num_sets):
        s = tl.load(lses_ptr + r * sl_r + n * sl_n + h * sl_h).to(tl.float32)
        w = tl.exp(s - m_use)  # 0 for an empty set
        o = tl.load(outs_ptr + r * so_r + n * so_n + h * so_h + offs_d * so_d, mask=dmask,
                    other=0.0).to(tl.float32)
        acc += tl.where(w > 0.0, w * o, 0.0)  # an empty set's output is never read into
        total += w
    safe = tl.where(total > 0.0, total, 1.0)
    res = acc / safe
    tl.store(out_ptr + n * st_n + h * st_h + offs_d * st_d,
             res.to(out_ptr.dtype.element_ty), mask=dmask)
    if WRITE_LSE:
        lse = tl.where(total > 0.0, tl.log(safe) + m_use, -float("inf"))
        tl.store(lse_ptr + n * stl_n + h * stl_h, lse)
