"""Where an engine step's time goes (``hygon-attn bench engine --breakdown``).

Inside a child of the engine bench (``_engine_child.py``), for each timed point:

* **host time of the attention backend's per-step hooks** (``init_forward_metadata`` for
  eager passes; ``init_forward_metadata_out_graph`` or
  ``init_forward_metadata_replay_cuda_graph`` before a decode graph replay), measured with
  ``perf_counter`` during the timed run itself and split into the prefill call and the
  decode steps;
* **GPU time by kernel**, from one extra untimed pass of the same point under
  ``torch.profiler`` (CUDA activity only; kernels replayed from a CUDA graph are reported
  one by one): the prefill forward, and the decode steps after the first. Kernels are
  classed by name: the attention kernels of both backends, their per-step metadata
  kernels, and everything else (the model: GEMMs, norms, RoPE, the K/V store, sampling).

SGLang 0.5.23's kernel names (``sglang/kernels/ops/attention/decode_attention.py``,
``extend_attention.py``, ``kv_indices.py``, ``sglang/srt/layers/attention/
triton_backend.py``) and ours (``hygon_attn_backend/kernels``, ``shims/sglang.py``).
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Iterable, List, Optional

# kernel names: ours contain these; SGLang's Triton attention kernels start with these
ATTENTION_KERNELS = ("paged_decode_kernel", "combine_partitions_kernel", "prefix_prefill_kernel",
                     "_lean_attention_decode_kernel")
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


def device_times(events: Iterable) -> Dict[str, float]:
    """``kernel name -> total microseconds`` of the device events of a profile
    (``torch.profiler.profile(...).events()``)."""
    from torch.autograd import DeviceType

    out: Dict[str, float] = {}
    for e in events:
        if getattr(e, "device_type", None) != DeviceType.CUDA:
            continue
        out[e.name] = out.get(e.name, 0.0) + e.time_range.elapsed_us()
    return out


def summarize_kernels(times: Dict[str, float], steps: int, top: int = 3) -> dict:
    """Per-step microseconds by class, and the top attention kernels by time."""
    steps = max(1, steps)
    by = {"attention": 0.0, "metadata": 0.0, "other": 0.0}
    for name, us in times.items():
        by[kernel_class(name)] += us
    attn = sorted(((us, n) for n, us in times.items() if kernel_class(n) == "attention"),
                  reverse=True)[:top]
    return {"attention_us": by["attention"] / steps, "metadata_us": by["metadata"] / steps,
            "other_us": by["other"] / steps, "all_us": sum(by.values()) / steps,
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
        state["extend"] = device_times(prof.events())
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
            device_times(state["decode_prof"].events()), steps)
        out["decode_profiled_steps"] = steps
    return out
