"""Error budgets derived from the reference's own low-precision error.

A kernel output ``out`` passes when ``max|out - ref64| <= MULT * max|ref_lowp - ref64| + FLOOR``
where ``ref64`` is :mod:`hygon_attn_backend.reference` in float64 and ``ref_lowp`` the same
reference computed in the input dtype, and every element of ``out`` is finite (outputs are
poisoned with NaN before a run, so an unwritten element fails). The test suite and the
fuzzer share these numbers.
"""

from __future__ import annotations

from typing import Optional

import torch

MULT = 4.0
FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}


def budget_error(out: torch.Tensor, ref64: torch.Tensor, ref_lowp: torch.Tensor, *,
                 mult: float = MULT, floor: Optional[float] = None,
                 what: str = "out") -> "tuple[float, float, Optional[str]]":
    """``(max_err, budget, problem)``; ``problem`` is None when ``out`` passes, else a
    message (non-finite elements, shape mismatch, or the error over the budget)."""
    out64 = out.detach().to(torch.float64).cpu()
    ref64 = ref64.detach().to(torch.float64).cpu()
    ref_lowp = ref_lowp.detach().to(torch.float64).cpu()
    if out64.shape != ref64.shape:
        return float("inf"), 0.0, f"{what}: shape {tuple(out64.shape)} != {tuple(ref64.shape)}"
    bad = ~torch.isfinite(out64)
    if bad.any():
        return float("inf"), 0.0, f"{what}: {int(bad.sum())} non-finite elements (unwritten or NaN)"
    ref_err = (ref_lowp - ref64).abs().max().item() if ref64.numel() else 0.0
    err = (out64 - ref64).abs().max().item() if ref64.numel() else 0.0
    if floor is None:
        floor = FLOOR.get(out.dtype, 2e-3)
    budget = mult * ref_err + floor
    if not err <= budget:
        return err, budget, (f"{what}: max abs error {err:.3e} exceeds budget {budget:.3e} "
                             f"(reference's own {out.dtype} error {ref_err:.3e})")
    return err, budget, None
