"""Error budgets for kernel tests, derived from the reference's own low-precision error.

A kernel output ``out`` passes when ``max|out - ref64| <= MULT * max|ref_lowp - ref64| + FLOOR``
where ``ref64`` is :mod:`hygon_attn_backend.reference` in float64 and ``ref_lowp`` the same
reference computed in the input dtype. Also asserts every element is finite (outputs are
poisoned with NaN before a run, so an unwritten element fails here).
"""

import torch

MULT = 4.0
FLOOR = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}


def assert_within_budget(out: torch.Tensor, ref64: torch.Tensor, ref_lowp: torch.Tensor,
                         *, mult: float = MULT, floor: float | None = None, what: str = "out"):
    out64 = out.detach().to(torch.float64).cpu()
    ref64 = ref64.detach().to(torch.float64).cpu()
    ref_lowp = ref_lowp.detach().to(torch.float64).cpu()
    assert out64.shape == ref64.shape, f"{what}: shape {tuple(out64.shape)} != {tuple(ref64.shape)}"
    bad = ~torch.isfinite(out64)
    assert not bad.any(), f"{what}: {int(bad.sum())} non-finite elements (unwritten or NaN)"
    ref_err = (ref_lowp - ref64).abs().max().item() if ref64.numel() else 0.0
    err = (out64 - ref64).abs().max().item() if ref64.numel() else 0.0
    if floor is None:
        floor = FLOOR.get(out.dtype, 2e-3)
    budget = mult * ref_err + floor
    assert err <= budget, (f"{what}: max abs error {err:.3e} exceeds budget {budget:.3e} "
                           f"(reference's own {out.dtype} error {ref_err:.3e})")
    return err, budget
