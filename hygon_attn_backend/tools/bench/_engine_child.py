"""One child process of ``hygon-attn bench engine``: ``python -m
hygon_attn_backend.tools.bench._engine_child SPEC.json``.

Mode ``onebatch``: SGLang's static-batch tool ``sglang.benchmark.one_batch`` for one
(backend, model, page size), every batch size and input length in one process (one
start-up). Before the tool parses its arguments, SGLang's plugins are loaded (so
``--attention-backend hygon`` passes its choices check). The tool's per-point function
``latency_test_run_once`` is wrapped so that

* each (batch, input length) first runs once untimed (fresh random prompts, one decode
  step; the tool's own warm-up counts as that pass for its first point), so no kernel
  compiles inside a timed region;
* a batch of more than ``max_prefill_tokens`` prompt tokens is prefilled in groups of
  requests (one forward each, at most that many tokens unless one prompt is longer) whose
  batches are then merged, as SGLang's scheduler merges a finished prefill into its
  running batch, so the decode steps run on the whole batch (``grouped_extend``; the row's
  ``prefill_groups`` says how many forwards the prefill took); points of more than
  ``max_point_tokens`` tokens are skipped (recorded);
* Triton compiles (``knobs.compilation.listener``, cache misses) and kernel loads
  (``knobs.runtime.kernel_load_start_hook``) are counted per phase: a timed point
  reports those inside it (0 expected), a warm pass the kernel names it compiled;
* each timed point is appended to ``result_path`` (JSON lines) as soon as it ends;
* with ``breakdown`` in the spec, the backend's per-step hooks are timed during the timed
  run and one more pass of the point runs under the torch profiler
  (``_engine_breakdown.py``: kernel time by class per prefill and per decode step).

Mode ``tokens``: SGLang's offline ``sglang.Engine`` (no tokenizer, ``input_ids``, greedy,
``top_logprobs_num=2``, radix cache on) over the spec's prompt batches; writes the output
ids, the top-2 logprobs of every step and ``cached_tokens`` per prompt.

Both modes start up unlocked (in parallel with their siblings), then write
``ready_path`` and take an exclusive ``flock`` on ``lock_path`` before any timed or
generating GPU work, holding it until they exit: the measurements never overlap.
"""

from __future__ import annotations

import argparse
import fcntl
import inspect
import json
import os
import statistics
import sys
import time
from typing import Callable, Optional

from hygon_attn_backend.tools.bench import _engine_breakdown as bd


_HELD: list = []


class Gate:
    """Signal ready, then wait for the exclusive lock (once; held until exit)."""

    def __init__(self, ready_path: Optional[str], lock_path: Optional[str]):
        self.ready_path, self.lock_path = ready_path, lock_path
        self._fd = None
        self.waited_s = 0.0

    def __call__(self) -> None:
        if self._fd is not None or not self.lock_path:
            return
        if self.ready_path:
            with open(self.ready_path, "w") as fh:
                fh.write(str(os.getpid()))
        t0 = time.perf_counter()
        self._fd = open(self.lock_path, "a")
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        _HELD.append(self._fd)  # held until the process exits, whatever holds the Gate
        self.waited_s = time.perf_counter() - t0
        print(f"[child] lock taken after {self.waited_s:.1f} s", flush=True)


class CompileWatch:
    """Triton compiles and kernel loads, by phase (chains hooks already installed)."""

    def __init__(self):
        self.phase = "startup"
        self.events = []  # (phase, kind, name, seconds)

    def install(self) -> bool:
        try:
            import triton.knobs as knobs
        except ImportError:
            return False
        comp = getattr(knobs, "compilation", None)
        hook = getattr(getattr(knobs, "runtime", None), "kernel_load_start_hook", None)
        if comp is None or not hasattr(comp, "listener") or hook is None:
            return False
        prev = comp.listener

        def listener(*, src, metadata, metadata_group, times, cache_hit):
            if prev is not None:
                prev(src=src, metadata=metadata, metadata_group=metadata_group, times=times,
                     cache_hit=cache_hit)
            if not cache_hit:
                self.events.append((self.phase, "compile", getattr(src, "name", str(src)),
                                    getattr(times, "total", 0) / 1e6))

        def on_load(module, function, name, metadata_group, hash):
            self.events.append((self.phase, "load", name, 0.0))

        comp.listener = listener
        hook.add(on_load)
        return True

    def mark(self) -> int:
        return len(self.events)

    def since(self, mark: int, kind: str) -> list:
        return [e[2] for e in self.events[mark:] if e[1] == kind]


def request_groups(lengths: list, limit: int) -> list:
    """``[(lo, hi), ...]``: consecutive requests whose prompt tokens sum to at most
    ``limit`` (a longer prompt forms a group of its own), covering every request in order."""
    groups, lo, total = [], 0, 0
    for i, n in enumerate(lengths):
        if i > lo and total + n > limit:
            groups.append((lo, i))
            lo, total = i, 0
        total += n
    if lengths:
        groups.append((lo, len(lengths)))
    return groups


def grouped_extend(extend: Callable, limit: int, cat: Callable) -> Callable:
    """``one_batch.extend(reqs, model_runner)`` that prefills the requests in
    :func:`request_groups` of at most ``limit`` tokens and merges the groups' batches
    (``ScheduleBatch.merge_batch``, what SGLang's scheduler does when a prefill joins the
    running batch); returns what ``extend`` returns for the whole batch. ``cat``:
    ``torch.cat``."""

    def run(reqs, model_runner):
        groups = request_groups([len(r.origin_input_ids) for r in reqs], limit)
        if len(groups) <= 1:
            return extend(reqs, model_runner)
        ids, logits, merged = [], [], None
        for lo, hi in groups:
            next_ids, next_logits, batch = extend(reqs[lo:hi], model_runner)
            ids.append(next_ids)
            logits.append(next_logits)
            if merged is None:
                merged = batch
            else:
                merged.merge_batch(batch)
        return cat(ids), (None if any(x is None for x in logits) else cat(logits)), merged

    return run


def _attn_backend(runner):
    """The attention backend behind one_batch's runner wrapper (``_TorchBenchRunner``)."""
    return getattr(getattr(runner, "torch_runner", runner), "attn_backend", None)


def wrap_run_once(run_once: Callable, *, make_reqs: Callable, skip: Callable,
                  record: Callable, gate: Callable, watch: CompileWatch,
                  warm_output_len: int = 2, breakdown: bool = False,
                  profile_steps: int = 6, repeats: int = 1) -> Callable:
    """``one_batch.latency_test_run_once`` with an untimed warm pass per point (module
    docstring). ``make_reqs(batch, input_len)``: fresh prompts; ``skip(batch, input_len)``:
    a reason string or None; ``record(dict)``: one result row. ``breakdown``: time the
    backend's per-step hooks in the timed run and add a profiled pass of
    ``profile_steps`` decode steps after it (``_engine_breakdown.py``). ``repeats``: timed
    runs per point (the first on the tool's prompts, the others on fresh ones); the row
    reports the medians and keeps every run's value (``prefill_runs_s``,
    ``decode_runs_s``)."""
    sig = inspect.signature(run_once)
    warmed = set()
    calls = [0]
    timers = bd.HookTimers() if breakdown else None

    def wrapper(*args, **kwargs):
        gate()
        a = sig.bind(*args, **kwargs).arguments
        bs, il = int(a["batch_size"]), int(a["input_len"])
        first = calls[0] == 0  # the tool's own warm-up pass (always its first call)
        calls[0] += 1
        reason = skip(bs, il)
        if reason is not None and not first:
            record({"batch": bs, "ctx": il, "status": f"skipped ({reason})"})
            return None
        if first:
            watch.phase = "warm"
            mark = watch.mark()
            run_once(**a)
            warmed.add((bs, il))
            print(f"[child] tool warm-up B={bs} ctx={il}: compiled "
                  f"{sorted(set(watch.since(mark, 'compile')))}", flush=True)
            return None
        warm_compiles = []
        if (bs, il) not in warmed:
            watch.phase = "warm"
            mark = watch.mark()
            w = dict(a, reqs=make_reqs(bs, il), output_len=min(warm_output_len, a["output_len"]),
                     log_decode_step=0, profile=False)
            run_once(**w)
            warmed.add((bs, il))
            warm_compiles = sorted(set(watch.since(mark, "compile")))
        undo = None
        if timers is not None:
            timers.install(_attn_backend(a["model_runner"]))
            timers.reset()
            undo = timers.wrap_runner(a["model_runner"])
        watch.phase = "timed"
        mark = watch.mark()
        results = []
        try:
            for i in range(max(1, repeats)):
                res = run_once(**(a if i == 0 else dict(a, reqs=make_reqs(bs, il))))
                if not res:
                    break
                results.append(res)
        finally:
            if undo is not None:
                undo()
        res = results[0] if results else None
        row = {"batch": bs, "ctx": il, "status": "ok" if res else "not run by the tool",
               "compiles_timed": watch.since(mark, "compile"),
               "loads_timed": watch.since(mark, "load"), "warm_compiles": warm_compiles}
        if res:
            for key, name in (("prefill_latency", "prefill"), ("median_decode_latency",
                                                               "decode")):
                values = [r.get(key) for r in results if r.get(key) is not None]
                row[f"{name}_s"] = statistics.median(values) if values else None
                row[f"{name}_runs_s"] = values
        if res and timers is not None:
            row.update(timers.per_call_us())
            watch.phase = "profiled"
            row.update(bd.profile_pass(run_once, dict(
                a, reqs=make_reqs(bs, il), output_len=min(profile_steps, a["output_len"]),
                log_decode_step=0, profile=False)))
        watch.phase = "between"
        record(row)
        return res

    return wrapper


def onebatch_argv(spec: dict) -> list:
    """The tool's command line for one spec (ServerArgs + BenchArgs flags)."""
    argv = ["--model-path", spec["model_path"], "--attention-backend", spec["backend"],
            "--page-size", str(spec["page"]), "--dtype", spec.get("dtype", "float16"),
            "--mem-fraction-static", str(spec["mem_fraction"]),
            "--max-total-tokens", str(spec["max_total_tokens"]),
            "--max-running-requests", str(spec["max_running_requests"]),
            "--disable-prefill-cuda-graph", "--sampling-backend", "pytorch",
            "--grammar-backend", "none", "--skip-tokenizer-init", "--random-seed", "0",
            "--batch-size", *[str(b) for b in spec["batches"]],
            "--input-len", *[str(c) for c in spec["contexts"]],
            "--output-len", str(spec["decode_steps"]), "--result-filename", ""]
    if spec.get("load_format"):
        argv += ["--load-format", spec["load_format"]]
    return argv


def _append(path: str, row: dict) -> None:
    with open(path, "a") as fh:
        fh.write(json.dumps(row) + "\n")
    print(f"[child] result {json.dumps(row)}", flush=True)


def run_onebatch(spec: dict) -> int:
    from sglang.srt.plugins import load_plugins

    load_plugins()  # before the parser: 'hygon' joins the attention-backend choices
    import sglang.benchmark.one_batch as ob
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ob.BenchArgs.add_cli_args(parser)
    args = parser.parse_args(onebatch_argv(spec))
    server_args = ServerArgs.from_cli_args(args)
    bench_args = ob.BenchArgs.from_cli_args(args)
    watch = CompileWatch()
    print(f"[child] compile watch installed: {watch.install()}", flush=True)
    limit = int(spec["max_prefill_tokens"])
    point_limit = int(spec.get("max_point_tokens") or limit)
    base = {"backend": spec["backend"], "head_dim": spec["head_dim"], "page": spec["page"],
            "layers": (spec.get("build") or {}).get("num_hidden_layers")}

    def record(row):
        if row.get("batch") and row.get("ctx"):
            row["prefill_groups"] = len(request_groups([row["ctx"]] * row["batch"], limit))
        _append(spec["result_path"], {**base, **row})

    import torch

    ob.get_tokenizer = lambda *a, **k: None  # prompts are token ids: no tokenizer needed
    # the tool prefills a whole batch in one forward: above `limit` tokens, in groups
    # (sglang/benchmark/one_batch.py: _TorchBenchRunner.extend calls the module's extend)
    ob.extend = grouped_extend(ob.extend, limit, torch.cat)
    ob.latency_test_run_once = wrap_run_once(
        ob.latency_test_run_once,
        make_reqs=lambda bs, il: ob.prepare_synthetic_inputs_for_latency_test(bs, il),
        skip=lambda bs, il: (f"{bs} x {il} tokens > {point_limit}"
                             if bs * il > point_limit else None),
        record=record, gate=Gate(spec.get("ready_path"), spec.get("lock_path")), watch=watch,
        breakdown=bool(spec.get("breakdown")), repeats=int(spec.get("repeats", 1)))
    ob.main(server_args, bench_args)
    startup = [e[2] for e in watch.events if e[0] == "startup" and e[1] == "compile"]
    record({"batch": 0, "ctx": 0, "status": "startup",
            "startup_compiles": sorted(set(startup))})
    return 0


def top2_of(meta: dict) -> list:
    """``[[logprob, token_id], [logprob, token_id]]`` per output step from an Engine
    result's ``meta_info['output_top_logprobs']`` (entries ``(logprob, id, text)``)."""
    steps = []
    for entry in meta.get("output_top_logprobs") or []:
        steps.append([[float(e[0]), int(e[1])] for e in (entry or [])[:2]])
    return steps


def run_tokens(spec: dict) -> int:
    # SGLang's Rust radix-tree core rejects its own insert on the H200 image ("insert value
    # must be an int64 tensor, got Uint8", both backends): its Python core instead
    os.environ.setdefault("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import sglang

    engine = sglang.Engine(
        model_path=spec["model_path"], attention_backend=spec["backend"],
        skip_tokenizer_init=True, sampling_backend="pytorch", grammar_backend="none",
        disable_prefill_cuda_graph=True, cuda_graph_max_bs_decode=spec["graph_bs"],
        page_size=spec["page"], dtype="float16", mem_fraction_static=spec["mem_fraction"],
        max_total_tokens=spec["max_total_tokens"], random_seed=0, log_level="warning")
    gate = Gate(spec.get("ready_path"), spec.get("lock_path"))
    gate()
    out = {"backend": spec["backend"], "scenarios": {}}
    params = {"temperature": 0.0, "max_new_tokens": spec["new_tokens"], "ignore_eos": True}
    try:
        for name, batches in spec["scenarios"].items():
            rows = []
            for prompts in batches:
                res = engine.generate(input_ids=prompts, sampling_params=params,
                                      return_logprob=True, top_logprobs_num=2)
                for r in res:
                    meta = r.get("meta_info", {})
                    rows.append({"output_ids": list(r["output_ids"]), "top2": top2_of(meta),
                                 "cached_tokens": int(meta.get("cached_tokens") or 0)})
            out["scenarios"][name] = rows
            print(f"[child] scenario {name}: {len(rows)} prompts", flush=True)
    finally:
        with open(spec["result_path"], "w") as fh:
            json.dump(out, fh)
        engine.shutdown()
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as fh:
        spec = json.load(fh)
    return {"onebatch": run_onebatch, "tokens": run_tokens}[spec["mode"]](spec)


if __name__ == "__main__":
    sys.exit(main())
