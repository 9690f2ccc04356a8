"""Timing helpers shared by the benchmarks (GPU only; imported lazily)."""

from __future__ import annotations


def median_ms(fn, rep_ms: float) -> float:
    """Median milliseconds of ``fn`` by CUDA events (``triton.testing.do_bench``), after a
    warm-up of a quarter of the timed window (at least 10 ms)."""
    import triton

    return triton.testing.do_bench(fn, warmup=max(10, rep_ms / 4), rep=rep_ms,
                                   return_mode="median")
