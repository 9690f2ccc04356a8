"""Error budgets for kernel tests (shared with the fuzzer: ``hygon_attn_backend.tools.fuzz.budget``).

A kernel output ``out`` passes when ``max|out - ref64| <= MULT * max|ref_lowp - ref64| + FLOOR``
where ``ref64`` is :mod:`hygon_attn_backend.reference` in float64 and ``ref_lowp`` the same
reference computed in the input dtype. Also asserts every element is finite (outputs are
poisoned with NaN before a run, so an unwritten element fails here).
"""

import torch

from hygon_attn_backend.tools.fuzz.budget import FLOOR, MULT, budget_error

__all__ = ["FLOOR", "MULT", "assert_within_budget"]


def assert_within_budget(out: torch.Tensor, ref64: torch.Tensor, ref_lowp: torch.Tensor,
                         *, mult: float = MULT, floor: float | None = None, what: str = "out"):
    err, budget, problem = budget_error(out, ref64, ref_lowp, mult=mult, floor=floor, what=what)
    assert problem is None, problem
    return err, budget
