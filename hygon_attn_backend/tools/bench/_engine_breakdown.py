"""Where an engine step's time goes (``hygon-attn bench engine --breakdown``).

Inside a child of the engine bench (``_engine_child.py``), for each timed point:

* **host time of the attention backend's per-step hooks** (``init_forward_metadata`` for
  eager passes; ``init_forward_metadata_out_graph`` or
  ``init_forward_metadata_replay_cuda_graph`` before a decode graph replay), measured with
  ``perf_counter`` during the timed run itself and split into the prefill call and the
  decode steps;
* **GPU time by kernel**, from one extra untimed pass of the same point under
  ``torch.profiler`` (CUDA activity only; kernels replayed from a CUDA graph are reported
  one by one): the prefill forward, and the decode steps after the first; each class's
  time is the union of its kernels' spans (overlapping kernels counted once). Kernels are
  classed by name: the attention kernels of both backends, their per-step metadata
  kernels, and everything else (the model: GEMMs, norms, RoPE, the K/V store, sampling).

SGLang 0.5.23's kernel names (``sglang/kernels/ops/attention/decode_attention.py``,
``extend_attention.py``, ``kv_indices.py``, ``sglang/srt/layers/attention/
triton_backend.py``) and ours (``hygon_attn_backend/kernels``, ``integrations/sglang/page_table.py``).
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Iterable, List, Optional, Tuple

# kernel names: ours contain these (Triton's; the native ones as the CUDA profiler names
# them: "void hab_decode::paged_decode_kernel<...>(...)", "(anonymous
# namespace)::combine_kernel(HabDecodeParams, bool)", "void
# hab_prefill::prefill_kernel<...>(HabPrefillParams)"); SGLang's Triton attention kernels
# start with these
ATTENTION_KERNELS = ("paged_decode_kernel", "combine_partitions_kernel", "prefix_prefill_kernel",
                     "_lean_attention_decode_kernel", "combine_kernel(HabDecodeParams",
                     "hab_prefill::prefill_kernel")
ATTENTION_PREFIXES = ("_fwd_kernel", "_fwd_grouped_kernel")
METADATA_KERNELS = ("req_to_token_table_kernel", "create_flashinfer_kv_indices",
                    "get_num_kv_splits", "_copy_unified_indices", "_align_window_kv")
HOOKS = ("init_forward_metadata", "init_forward_metadata_out_graph",
         "init_forward_metadata_replay_cuda_graph")


def kernel_class(name: str) -> str:
    """``attention``, ``metadata`` or ``other``."""
    if any(k in name for k in METADATA_KERNELS):
        return "metadata"
    if any(k in name for k in ATTENTION_KERNELS) or name.startswith(ATTENTION_PREFIXES):
        return "attention"
    return "other"


Span = Tuple[str, float, float]  # kernel name, start and end in microseconds


def device_spans(events: Iterable) -> List[Span]:
    """``(kernel name, start us, end us)`` of the device events of a profile
    (``torch.profiler.profile(...).events()``)."""
    from torch.autograd import DeviceType

    return [(e.name, float(e.time_range.start), float(e.time_range.end)) for e in events
            if getattr(e, "device_type", None) == DeviceType.CUDA]


def busy_us(spans: Iterable[Span]) -> float:
    """Microseconds during which at least one of ``spans`` runs (their union). A kernel
    launched as a programmatic dependent launch (the split-KV combine of both backends)
    starts while the kernel before it runs and waits on it: summed, the two would count
    that wait twice."""
    total, end = 0.0, float("-inf")
    for _, a, b in sorted(spans, key=lambda s: s[1]):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summarize_kernels(spans: List[Span], steps: int, top: int = 3) -> dict:
    """Per-step microseconds by class (the union of each class's kernels), and the top
    attention kernels by their summed time."""
    steps = max(1, steps)
    by = {c: busy_us(s for s in spans if kernel_class(s[0]) == c)
          for c in ("attention", "metadata", "other")}
    sums: Dict[str, float] = {}
    for name, a, b in spans:
        if kernel_class(name) == "attention":
            sums[name] = sums.get(name, 0.0) + (b - a)
    attn = sorted(((us, n) for n, us in sums.items()), reverse=True)[:top]
    return {"attention_us": by["attention"] / steps, "metadata_us": by["metadata"] / steps,
            "other_us": by["other"] / steps, "all_us": busy_us(spans) / steps,
            "top_attention": [[n[:60], us / steps] for us, n in attn]}


class HookTimers:
    """``perf_counter`` around the backend's per-step hooks, split by phase (the runner's
    ``extend`` or ``decode`` call that is running)."""

    def __init__(self):
        self.phase: Optional[str] = None
        self.totals: Dict[str, float] = {}
        self.calls: Dict[str, int] = {}
        self.installed: List[str] = []

    def install(self, backend) -> None:
        if self.installed:
            return
        for name in HOOKS:
            fn = getattr(backend, name, None)
            if fn is None:
                continue
            setattr(backend, name, self._timed(fn))
            self.installed.append(name)

    def _timed(self, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if self.phase is not None:
                    self.totals[self.phase] = self.totals.get(self.phase, 0.0) + (
                        time.perf_counter() - t0)
        return wrapper

    def reset(self) -> None:
        self.totals, self.calls = {}, {}

    def wrap_runner(self, runner) -> Callable:
        """Count the runner's extend/decode calls as phases; returns an undo function."""
        orig = {n: getattr(runner, n) for n in ("extend", "decode")}

        def phased(name):
            def call(*args, **kwargs):
                self.phase = name
                self.calls[name] = self.calls.get(name, 0) + 1
                try:
                    return orig[name](*args, **kwargs)
                finally:
                    self.phase = None
            return call

        for n in orig:
            setattr(runner, n, phased(n))
        return lambda: [delattr(runner, n) for n in orig if n in vars(runner)]

    def per_call_us(self) -> dict:
        return {f"{ph}_hooks_host_us": self.totals.get(ph, 0.0) * 1e6 / max(1, self.calls[ph])
                for ph in self.calls}


def profile_pass(run_once: Callable, args: dict, *, skip_decode: int = 1) -> dict:
    """Run the point once more under ``torch.profiler``: the prefill forward and the decode
    steps after the first ``skip_decode``; returns per-step kernel times by class."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    runner = args["model_runner"]
    orig = {n: getattr(runner, n) for n in ("extend", "decode")}
    state = {"decode_calls": 0, "decode_prof": None, "extend": None}

    def extend(*a, **k):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            res = orig["extend"](*a, **k)
            torch.cuda.synchronize()
        state["extend"] = device_spans(prof.events())
        return res

    def decode(*a, **k):
        state["decode_calls"] += 1
        if state["decode_calls"] == skip_decode + 1:
            torch.cuda.synchronize()
            state["decode_prof"] = profile(activities=[ProfilerActivity.CUDA])
            state["decode_prof"].start()
        return orig["decode"](*a, **k)

    runner.extend, runner.decode = extend, decode
    try:
        run_once(**args)
        torch.cuda.synchronize()
    finally:
        for n in orig:
            if n in vars(runner):
                delattr(runner, n)
        if state["decode_prof"] is not None:
            state["decode_prof"].stop()
    out = {}
    if state["extend"] is not None:
        out["prefill_kernels"] = summarize_kernels(state["extend"], 1)
    steps = state["decode_calls"] - skip_decode
    if state["decode_prof"] is not None and steps > 0:
        out["decode_kernels"] = summarize_kernels(
            device_spans(state["decode_prof"].events()), steps)
        out["decode_profiled_steps"] = steps
    return out
