"""Error budgets derived from the reference's own low-precision error.

A kernel output ``out`` passes when ``max|out - ref64| <= MULT * max|ref_lowp - ref64| + FLOOR``
where ``ref64`` is :mod:`hygon_attn_backend.reference` in float64 and ``ref_lowp`` the same
reference computed in the input dtype, and every element of ``out`` is finite (outputs are
poisoned with NaN before a run, so an unwritten element fails). The test suite and the
fuzzer share these numbers.

``FLOOR`` is about two units in the last place of the output dtype at magnitude 1; where the
output is larger it grows to two units in the last place at ``max|ref64|``
(:func:`output_floor`). The output is stored in its dtype, so a kernel that accumulates in
fp32 may land on the neighbouring representable value where the reference, rounding the
same exact value once, does not (seed 1, case 6137 of the prefill fuzz: one key per row, an
fp8 cache with scale, bf16 outputs near 6, one unit apart: 3.1e-2 against a 1.6e-2 floor,
while the low-precision reference rounded exactly as fp64 did, so its own error was 0).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

MULT = 4.0
FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}


def output_floor(dtype: torch.dtype, magnitude: float, floor: float) -> float:
    """``floor``, or two units in the last place of ``dtype`` at ``magnitude`` if larger."""
    if not dtype.is_floating_point or not magnitude > 0 or not math.isfinite(magnitude):
        return floor
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(magnitude))
    return max(floor, 2.0 * ulp)


def budget_error(out: torch.Tensor, ref64: torch.Tensor, ref_lowp: torch.Tensor, *,
                 mult: float = MULT, floor: Optional[float] = None,
                 what: str = "out") -> "tuple[float, float, Optional[str]]":
    """``(max_err, budget, problem)``; ``problem`` is None when ``out`` passes, else a
    message (non-finite elements, shape mismatch, or the error over the budget)."""
    # compared on the output's device: a large prefill output in fp64 is ~1 GB, which a
    # copy to the host and a one-core reduction there would spend seconds on
    dev = out.device
    out64 = out.detach().to(dev, torch.float64)
    ref64 = ref64.detach().to(dev, torch.float64)
    ref_lowp = ref_lowp.detach().to(dev, torch.float64)
    if out64.shape != ref64.shape:
        return float("inf"), 0.0, f"{what}: shape {tuple(out64.shape)} != {tuple(ref64.shape)}"
    bad = ~torch.isfinite(out64)
    if bad.any():
        return float("inf"), 0.0, f"{what}: {int(bad.sum())} non-finite elements (unwritten or NaN)"
    ref_err = (ref_lowp - ref64).abs().max().item() if ref64.numel() else 0.0
    err = (out64 - ref64).abs().max().item() if ref64.numel() else 0.0
    if floor is None:
        magnitude = ref64.abs().max().item() if ref64.numel() else 0.0
        floor = output_floor(out.dtype, magnitude, FLOOR.get(out.dtype, 2e-3))
    budget = mult * ref_err + floor
    if not err <= budget:
        return err, budget, (f"{what}: max abs error {err:.3e} exceeds budget {budget:.3e} "
                             f"(reference's own {out.dtype} error {ref_err:.3e})")
    return err, budget, None


def lse_error(lse: torch.Tensor, ref: torch.Tensor, *, what: str) -> "str | None":
    """What is wrong with a kernel's LSE against the fp64 reference's (None: nothing):
    the rows without a key (``-inf``) must be the same, the rest within ``2e-3`` of
    ``1 + |lse|`` (fp32 sums of at most 64k exps)."""
    lse, ref = lse.double(), ref.to(lse.device, torch.float64)
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(lse), finite):
        return f"{what} lse: -inf rows differ from the reference's (or NaN)"
    if finite.any():
        err = ((lse - ref).abs() / (1.0 + ref.abs()))[finite].max().item()
        if err > 2e-3:
            return f"{what} lse: max error {err:.3e} > 2e-3 (relative to 1 + |lse|)"
    return None
