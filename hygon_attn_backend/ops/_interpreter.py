"""What Triton's CPU interpreter (``TRITON_INTERPRET=1``) computes right, probed once per
process.

The interpreter runs kernels in numpy, which has no bfloat16; with some numpy / Triton
pairs (numpy 2.4 with Triton 3.9 among them, what ``make test`` builds) its ``tl.dot`` on bf16 tiles
returns garbage (errors of ~1e10 on a 16x16 product) without an error, so every attention
kernel would too. Before the first bf16 attention launch in the interpreter,
:func:`bf16_dot_works` runs one 16x16 bf16 ``tl.dot`` (``kernels/probe.py``) and compares it
with torch; where it is wrong the ops run the reference for bf16 queries instead (with one
:class:`InterpreterDtypeWarning` saying why), never a wrong answer. fp16, and anything
outside the interpreter (a GPU), is never probed and costs nothing.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

PROBE_N = 16  # the smallest tile tl.dot takes


def triton_interpreter_on() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).
    Must be set before the kernels are imported: ``@triton.jit`` reads it then."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


class InterpreterDtypeWarning(RuntimeWarning):
    """Triton's CPU interpreter computes this dtype wrong here: the reference serves it."""


@functools.cache
def bf16_dot_works() -> bool:
    """Whether the interpreter's ``tl.dot`` of two bf16 ``[16, 16]`` tiles equals torch's.

    The inputs are small integers (-3..3), exact in bf16, so the fp32-accumulated product
    is exact too and the comparison needs no tolerance beyond rounding noise."""
    from hygon_attn_backend.kernels.probe import dot_tile_kernel

    n = PROBE_N
    idx = torch.arange(n * n, dtype=torch.int64).view(n, n)
    a = ((idx * 5 + 2) % 7 - 3).to(torch.bfloat16)  # every value of -3..3, no pattern
    b = ((idx * 3 + 1) % 7 - 3).to(torch.bfloat16)  # that a row and a column share
    c = torch.full((n, n), float("nan"), dtype=torch.float32)
    dot_tile_kernel[(1,)](a, b, c, N=n)
    want = a.float() @ b.float()
    return bool(torch.isfinite(c).all()) and bool(((c - want).abs() <= 1e-3).all())


_WARNED: set = set()


def triton_computes(dtype: torch.dtype) -> bool:
    """Whether Triton's attention kernels give the right answer for ``dtype`` queries
    here: always outside the interpreter and for every dtype but bf16; in the interpreter,
    bf16 when :func:`bf16_dot_works` (probed once). Warns once when it says no."""
    if dtype != torch.bfloat16 or not triton_interpreter_on():
        return True
    if bf16_dot_works():
        return True
    if dtype not in _WARNED:
        _WARNED.add(dtype)
        warnings.warn(
            "Triton's CPU interpreter computes bfloat16 tl.dot wrong with this numpy / "
            "Triton pair (a 16x16 probe product differs from torch's): bfloat16 attention "
            "runs the torch reference instead (float16 still runs the Triton kernels)",
            InterpreterDtypeWarning, stacklevel=3)
    return False
