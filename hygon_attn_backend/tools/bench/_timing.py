"""Timing and ceilings shared by the benchmarks (torch and Triton imported lazily).

One method for every implementation:

* decode: the call is captured once in a CUDA graph (its workspace and metadata are
  allocated before the capture) and the graph is replayed;
* prefill: the call is timed eagerly, its plan or metadata built before;
* every timed call, replay or eager, is preceded by a pass over a 256 MB buffer that
  evicts the L2. By default that pass is ``triton.testing.do_bench``'s write (``L2_FLUSH
  = "write"``), which leaves the L2 full of dirty lines: the timed call then also pays
  for writing them back, ~50 MB on an H200 (docs/benchmarks.md, method). ``"read"``
  evicts by reading a buffer written once, so the timed call starts on a clean L2, as a
  decode in an engine does (the kernels before it write a few MB at most);
* the median of the timed calls is reported;
* the ceilings (a device-to-device copy counting bytes read plus bytes written, a bf16
  ``8192^3`` matmul) are measured in the same process, with the same method.

On a machine without CUDA (Triton's interpreter) the same calls are timed with the host
clock; those numbers only show that the pipeline runs, never a speed.
"""

from __future__ import annotations

import statistics
import time

COPY_BYTES = 2 << 30  # bytes of the copy ceiling's source buffer on a GPU
MATMUL_N = 8192
FLUSH_BYTES = 256 << 20  # do_bench's L2-eviction buffer
L2_FLUSHES = ("write", "read")
L2_FLUSH = "write"
_flush_buffer = None


def set_l2_flush(mode: str) -> None:
    """How the L2 is evicted before each timed call: ``"write"`` (``do_bench``'s zero
    fill, leaves dirty lines) or ``"read"`` (a read of a buffer written once)."""
    global L2_FLUSH
    if mode not in L2_FLUSHES:
        raise ValueError(f"l2 flush: one of {', '.join(L2_FLUSHES)}, got {mode!r}")
    L2_FLUSH = mode


def on_gpu(device) -> bool:
    return getattr(device, "type", str(device)) == "cuda"


def _host_median_ms(fn, reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def median_ms(fn, rep_ms: float, *, device="cuda") -> float:
    """Median milliseconds of ``fn`` called eagerly, the L2 cleared before every call
    (``triton.testing.do_bench``), after a warm-up of a quarter of the timed window."""
    if not on_gpu(device):
        return _host_median_ms(fn)
    if L2_FLUSH == "read":
        return _read_flush_median_ms(fn, warmup_ms=max(10, rep_ms / 4), rep_ms=rep_ms)
    import triton

    return triton.testing.do_bench(fn, warmup=max(10, rep_ms / 4), rep=rep_ms,
                                   return_mode="median")


def read_flush():
    """The read flush as a callable: a max over a 256 MB buffer written once (made on
    first use), which leaves only clean lines and one scalar in the L2."""
    import torch

    global _flush_buffer
    if _flush_buffer is None:
        _flush_buffer = torch.ones(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    buf = _flush_buffer
    return lambda: torch.amax(buf)


def _read_flush_median_ms(fn, *, warmup_ms: float, rep_ms: float) -> float:
    """``do_bench``'s loop (estimate, warm up, time each call between two events) with the
    L2 evicted by a read (:func:`read_flush`)."""
    import torch

    flush = read_flush()

    def timed(n: int) -> list:
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for start, end in zip(starts, ends):
            flush()
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        return [s.elapsed_time(e) for s, e in zip(starts, ends)]

    fn()
    torch.cuda.synchronize()
    estimate = max(statistics.median(timed(5)), 1e-3)
    timed(max(1, int(warmup_ms / estimate)))
    return statistics.median(timed(max(1, int(rep_ms / estimate))))


def capture_graph(fn):
    """Run ``fn`` twice on a side stream (compiles, lazy allocations), then capture one
    call in a CUDA graph; returns the graph."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def graph_ms(fn, rep_ms: float, *, device="cuda") -> float:
    """Median milliseconds of one replay of ``fn`` captured in a CUDA graph, the L2
    cleared before every replay (``do_bench`` on ``graph.replay``)."""
    if not on_gpu(device):
        return _host_median_ms(fn)
    graph = capture_graph(fn)
    try:
        return median_ms(graph.replay, rep_ms, device=device)
    finally:
        del graph


def copy_ceiling(rep_ms: float, *, device="cuda"):
    """Device-to-device copy in GB/s counting bytes read plus bytes written, and the
    milliseconds of one copy: the better of the eager copy and its graph replay (a graph
    may turn the copy into a slower memcpy node), each with the L2 cleared first."""
    nbytes = COPY_BYTES if on_gpu(device) else 16 << 20
    ms = same_bytes_copy_ms(2 * nbytes, rep_ms, device=device)
    return 2 * nbytes / ms / 1e6, ms


def same_bytes_copy_ms(nbytes: int, rep_ms: float, *, device="cuda") -> float:
    """Milliseconds of a device copy that moves ``nbytes`` (reads half, writes half), timed
    as the decode calls are (the L2 cleared before each), the better of the eager copy and
    its CUDA-graph replay, as :func:`copy_ceiling` (a graph turns the copy into a memcpy
    node: replayed alone it read 63-64% of the copy ceiling at 1-4 GB on the H200,
    2026-12-01).
    The reference for a decode of that many bytes: the fixed costs of a short call (launch,
    the write-back of the L2 the clear dirtied, the ramp of a wave) are in both."""
    import torch

    half = max(16, nbytes // 2 // 16 * 16)
    src = torch.randn(half // 4, device=device, dtype=torch.float32)
    dst = torch.empty_like(src)
    fn = lambda: dst.copy_(src)
    ms = median_ms(fn, rep_ms, device=device)
    return min(ms, graph_ms(fn, rep_ms, device=device)) if on_gpu(device) else ms


def matmul_ceiling(rep_ms: float, *, device="cuda"):
    """bf16 ``8192^3`` matmul in TFLOP/s (random operands), and its milliseconds. On a
    CPU a 512^3 float32 matmul stands in."""
    import torch

    n = MATMUL_N if on_gpu(device) else 512
    dtype = torch.bfloat16 if on_gpu(device) else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    ms = median_ms(lambda: a @ b, rep_ms, device=device)
    return 2.0 * n ** 3 / ms / 1e9, ms
