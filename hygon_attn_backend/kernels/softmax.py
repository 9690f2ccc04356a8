"""Online-softmax pieces (@triton.jit functions) shared by the attention kernels.

All running state is fp32 and in log2 units: logits are pre-multiplied by
``log2(e)`` so the kernels use ``exp2``.
"""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # log2(e), for exp2


@triton.jit
def tanh_f32(x):
    """tanh in fp32 through exp2 (no libdevice: also runs in the CPU interpreter).

    ``tanh(x) = 1 - 2 / (exp(2x) + 1)``; saturates to +-1 without NaN for large |x|.
    """
    e = tl.exp2(x * (2.0 * 1.4426950408889634))
    return 1.0 - 2.0 / (e + 1.0)


@triton.jit
def soft_cap_log2(s_nat, soft_cap):
    """Logit soft cap ``cap * tanh(s / cap)`` on natural-unit logits, returned in log2
    units (times log2(e))."""
    return soft_cap * tanh_f32(s_nat / soft_cap) * 1.4426950408889634


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """One tile of the online softmax.

    s: ``[BLOCK_M, BLOCK_N]`` fp32 logits in log2 units, ``-inf`` where masked.
    m_i, l_i: ``[BLOCK_M]`` fp32 running max (log2 units) and running sum.
    Returns ``(p, alpha, m_new, l_new)``: ``p = exp2(s - m_new)`` and the factor ``alpha``
    that rescales the previous accumulator. A row that has seen no key keeps
    ``m = -inf`` and gets ``p = 0``, ``alpha = 0`` (never ``-inf - -inf = NaN``).
    """
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])  # [BLOCK_M, BLOCK_N]
    l_new = l_i * alpha + tl.sum(p, 1)
    return p, alpha, m_new, l_new
