"""``hygon-attn bench engine`` on a CPU: arguments, the planned matrix, the tool's command
line (parsed by SGLang's own parser), the built model, the warm-pass wrapper around
one_batch's per-point function, the lock-serialized child launcher, and the reports."""

import json
import os
import sys

import pytest

from hygon_attn_backend.tools.cli import build_parser
from hygon_attn_backend.tools.bench import _engine_child as child
from hygon_attn_backend.tools.bench import _engine_report as report
from hygon_attn_backend.tools.bench import engine


def _args(*argv):
    return build_parser().parse_args(["bench", "engine", *argv])


def test_defaults_quick_and_overrides():
    cfg = engine.resolve(_args())
    assert cfg["head_dims"] == [64, 128] and cfg["pages"] == [16] and cfg["layers"] == 8
    assert cfg["contexts"] == [4096, 16384, 32768] and cfg["batches"] == [1, 8, 32, 64]
    q = engine.resolve(_args("--quick", "--batches", "8", "1", "8"))
    assert q["head_dims"] == [64] and q["batches"] == [1, 8] and q["contexts"] == [1024]
    assert q["check_head_dim"] == 64
    pts = engine.planned_points(cfg)
    assert (64, 4096) in pts and (8, 32768) in pts and (64, 32768) in pts  # grouped prefill
    assert all(b * c <= cfg["max_point_tokens"] for b, c in pts)
    small = engine.resolve(_args("--max-point-tokens", "262144"))
    assert (64, 16384) not in engine.planned_points(small)
    pool = engine.pool_tokens(cfg, 16)
    assert pool % 16 == 0 and pool >= max(b * (c + cfg["decode_steps"]) for b, c in pts)


def test_specs_and_tool_command_line_parse_with_sglang(tmp_path):
    pytest.importorskip("sglang.benchmark.one_batch")
    args = _args("--head-dims", "128", "--pages", "1", "16")
    specs = engine.plan_specs(engine.resolve(args), args, str(tmp_path))
    bench = [s for s in specs if s["mode"] == "onebatch"]
    assert [(s["backend"], s["page"]) for s in bench] == [
        ("hygon", 1), ("triton", 1), ("hygon", 16), ("triton", 16)]
    assert {s["lock_path"] for s in specs} == {str(tmp_path / "gpu.lock")}
    assert [s["backend"] for s in specs if s["mode"] == "tokens"] == ["hygon", "triton"]
    import argparse

    import sglang.benchmark.one_batch as ob
    from sglang.srt.server_args import ServerArgs

    from hygon_attn_backend.integrations.sglang import register
    assert register()
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ob.BenchArgs.add_cli_args(parser)
    ns = parser.parse_args(child.onebatch_argv(bench[0]))
    assert ns.attention_backend == "hygon" and ns.page_size == 1
    assert ns.batch_size == [1, 8, 32, 64] and ns.input_len == [4096, 16384, 32768]
    assert ns.load_format == "dummy" and ns.max_total_tokens == bench[0]["max_total_tokens"]
    assert ns.disable_prefill_cuda_graph and ns.skip_tokenizer_init


def test_built_model_matches_transformers_llama(tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch
    from safetensors.torch import load_file

    cfg = engine.llama_config(head_dim=64, layers=2, max_positions=512)
    cfg.update(hidden_size=128, intermediate_size=256, num_attention_heads=2,
               num_key_value_heads=1, vocab_size=300)
    engine.write_model(str(tmp_path), cfg, weights=True)
    ours = load_file(str(tmp_path / "model.safetensors"))
    hf_cfg = transformers.LlamaConfig.from_pretrained(str(tmp_path))
    with torch.device("meta"):
        ref = transformers.LlamaForCausalLM(hf_cfg).state_dict()
    assert {k: tuple(v.shape) for k, v in ours.items()} == {
        k: tuple(v.shape) for k, v in ref.items() if "rotary" not in k}
    assert all(v.dtype == torch.float16 for v in ours.values())
    again = engine.random_llama_weights(cfg, seed=0)
    assert torch.equal(again["lm_head.weight"], ours["lm_head.weight"])  # seeded


class _Watch(child.CompileWatch):
    """Compiles appear when the fake run first sees a (batch, ctx) shape."""


def _fake_tool(watch, seen_shapes):
    calls = []

    def run_once(run_name, model_runner, rank_print, reqs, batch_size, input_len, output_len,
                 log_decode_step, profile, profile_record_shapes, profile_activities,
                 profile_prefix, profile_stage, tp_rank, profile_start_step=None,
                 profile_steps=None):
        calls.append((watch.phase, batch_size, input_len, output_len, reqs))
        if (batch_size, input_len) not in seen_shapes:
            seen_shapes.add((batch_size, input_len))
            watch.events.append((watch.phase, "compile", f"k{batch_size}_{input_len}", 1.0))
        return {"prefill_latency": 0.001 * batch_size, "median_decode_latency": 0.0005}

    return run_once, calls


def test_wrapper_warms_each_point_once_and_times_without_compiles():
    watch, rows, gate_calls = _Watch(), [], []
    run_once, calls = _fake_tool(watch, set())
    wrapped = child.wrap_run_once(
        run_once, make_reqs=lambda b, c: f"fresh-{b}-{c}",
        skip=lambda b, c: "too big" if b * c > 100 else None, record=rows.append,
        gate=lambda: gate_calls.append(1), watch=watch)
    # the tool: its warm-up (keywords), then the sweep (positional)
    wrapped("r", None, print, "tool-warm", 1, 10, 8, log_decode_step=0, profile=False,
            profile_record_shapes=False, profile_activities=("CPU",), profile_prefix="",
            profile_stage="all", tp_rank=0)
    for b, c in ((1, 10), (8, 10), (64, 10), (8, 10)):
        wrapped("r", None, print, f"timed-{b}", b, c, 16, 0, False, False, ("CPU",),
                "profile", "all", 0, None, None)
    assert len(gate_calls) == 5
    # (1,10): warmed by the tool's warm-up; (8,10): one warm pass (fresh prompts, 2 steps),
    # then timed; (64,10) skipped; the repeated (8,10) is not warmed again
    assert [(p, b, o, r) for p, b, _, o, r in calls] == [
        ("warm", 1, 8, "tool-warm"), ("timed", 1, 16, "timed-1"),
        ("warm", 8, 2, "fresh-8-10"), ("timed", 8, 16, "timed-8"), ("timed", 8, 16, "timed-8")]
    ok = [r for r in rows if r["status"] == "ok"]
    assert len(ok) == 3 and all(r["compiles_timed"] == [] for r in ok)
    assert ok[1]["warm_compiles"] == ["k8_10"] and ok[1]["prefill_s"] == pytest.approx(0.008)
    assert [r["status"] for r in rows if r["status"] != "ok"] == ["skipped (too big)"]


def test_wrapper_reports_a_compile_inside_a_timed_point():
    watch, rows = _Watch(), []
    shapes = set()
    run_once, _ = _fake_tool(watch, shapes)

    def make_reqs(b, c):
        shapes.add((b, c))  # the warm pass "misses" this shape: the timed run compiles
        return "fresh"

    wrapped = child.wrap_run_once(run_once, make_reqs=make_reqs, skip=lambda b, c: None,
                                  record=rows.append, gate=lambda: None, watch=watch)
    wrapped("r", None, print, "w", 1, 10, 4, 0, False, False, (), "", "all", 0)
    shapes.discard((2, 10))
    wrapped("r", None, print, "t", 2, 10, 4, 0, False, False, (), "profile", "all", 0)
    assert rows[-1]["compiles_timed"] == []  # the fake compiles on first sight only
    watch.events.append(("x", "compile", "late", 1.0))
    assert watch.since(0, "compile")[-1] == "late"


def test_launcher_serializes_gpu_work_after_every_start(tmp_path):
    """Fake children: each sleeps (start-up), takes the gate, records its lock window."""
    script = tmp_path / "fake_child.py"
    script.write_text(
        "import json, sys, time\n"
        f"sys.path.insert(0, {os.getcwd()!r})\n"
        "from hygon_attn_backend.tools.bench._engine_child import Gate\n"
        "spec = json.load(open(sys.argv[1]))\n"
        "time.sleep(spec['startup'])\n"
        "Gate(spec['ready_path'], spec['lock_path'])()\n"
        "t0 = time.time(); time.sleep(0.3)\n"
        "open(spec['result_path'], 'w').write(json.dumps([t0, time.time()]))\n")
    specs = []
    for i, startup in enumerate((0.6, 0.0, 0.2)):
        specs.append({"name": f"c{i}", "mode": "tokens", "startup": startup,
                      "ready_path": str(tmp_path / f"c{i}.ready"),
                      "result_path": str(tmp_path / f"c{i}.json"),
                      "lock_path": str(tmp_path / "gpu.lock")})
    t_launch = __import__("time").time()
    codes = engine.launch(specs, work=str(tmp_path), env=dict(os.environ), child_timeout=30,
                          deadline=None, command=lambda p: [sys.executable, str(script), p],
                          poll_s=0.05)
    assert codes == {"c0": 0, "c1": 0, "c2": 0}
    windows = sorted(json.loads((tmp_path / f"c{i}.json").read_text()) for i in range(3))
    assert windows[0][0] >= t_launch + 0.6  # nobody ran before the slowest start-up
    for a, b in zip(windows, windows[1:]):
        assert b[0] >= a[1] - 0.01  # never two at once


def test_serial_launcher_starts_each_child_after_the_last_exited(tmp_path):
    """--serial: no two children alive at once (their KV pools would not both fit); the
    deadline covers the whole run, and a child it leaves no time for is not started."""
    script = tmp_path / "fake_child.py"
    script.write_text(
        "import json, sys, time\n"
        "t0 = time.time()\n"
        "spec = json.load(open(sys.argv[1]))\n"
        "time.sleep(spec['work'])\n"
        "open(spec['result_path'], 'w').write(json.dumps([t0, time.time()]))\n")
    specs = [{"name": f"c{i}", "mode": "tokens", "work": work,
              "ready_path": str(tmp_path / f"c{i}.ready"),
              "result_path": str(tmp_path / f"c{i}.json"),
              "lock_path": str(tmp_path / "gpu.lock")} for i, work in enumerate((0.3, 0.1, 5))]
    codes = engine.launch_serially(specs, work=str(tmp_path), env=dict(os.environ),
                                   child_timeout=30, deadline=3.0, poll_s=0.05,
                                   command=lambda p: [sys.executable, "-S", "-I",
                                                      str(script), p])
    assert codes == {"c0": 0, "c1": 0, "c2": None}  # c2 outlives the deadline: killed
    first, second = (json.loads((tmp_path / f"c{i}.json").read_text()) for i in range(2))
    assert second[0] >= first[1]  # the second process began after the first one ended
    late = [dict(specs[0], name="late")]
    assert engine.launch_serially(late, work=str(tmp_path), env=dict(os.environ),
                                  child_timeout=30, deadline=0.0) == {"late": None}


def test_pools_too_large_together_start_one_after_another(tmp_path):
    """64 x 32k at head_dim 128: two 69 GB pools do not fit on a 141 GB GPU together; the
    16k points do; a --model-path model (no config) never forces it."""
    def specs_for(ctx):
        args = _args("--head-dims", "128", "--contexts", str(ctx), "--batches", "64",
                     "--no-check", "--max-point-tokens", str(64 * 32768))
        return engine.plan_specs(engine.resolve(args), args, str(tmp_path))

    big, small = specs_for(32768), specs_for(16384)
    assert len(big) == 2 and 68e9 < engine.kv_pool_bytes(big[0]) < 72e9
    h200 = 150_000_000_000
    assert engine.pools_need_serial(big, h200)
    assert not engine.pools_need_serial(small, h200)
    assert not engine.pools_need_serial(big, None)
    assert engine.kv_pool_bytes(dict(big[0], build=None)) == 0


def test_launcher_kills_a_child_past_its_time(tmp_path):
    specs = [{"name": "slow", "mode": "tokens", "ready_path": str(tmp_path / "r"),
              "result_path": str(tmp_path / "x"), "lock_path": str(tmp_path / "l")}]
    codes = engine.launch(specs, work=str(tmp_path), env=dict(os.environ), child_timeout=0.5,
                          deadline=None, poll_s=0.05,
                          command=lambda p: [sys.executable, "-c", "import time; time.sleep(30)"])
    assert codes == {"slow": None}


def _row(backend, hd, b, ctx, pre, dec, **kw):
    return {"backend": backend, "head_dim": hd, "page": 16, "batch": b, "ctx": ctx,
            "status": "ok", "prefill_s": pre, "decode_s": dec, "compiles_timed": [],
            "loads_timed": [], **kw}


def test_table_csv_and_ratios(tmp_path):
    rows = [_row("hygon", 128, 8, 16384, 0.8, 0.004), _row("triton", 128, 8, 16384, 1.0, 0.005),
            _row("hygon", 64, 1, 4096, 0.1, 0.002, loads_timed=["prefix_prefill_kernel"]),
            {"backend": "triton", "head_dim": 64, "page": 16, "batch": 1, "ctx": 4096,
             "status": "skipped (big)"},
            {"backend": "hygon", "head_dim": 64, "page": 16, "batch": 0, "ctx": 0,
             "status": "startup", "startup_compiles": []}]
    path = tmp_path / "r.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pairs = report.pair_rows(report.read_rows([str(path), str(tmp_path / "missing")]))
    assert [(p["head_dim"], p["batch"]) for p in pairs] == [(64, 1), (128, 8)]
    assert pairs[1]["prefill_ratio"] == pytest.approx(0.8)
    assert pairs[1]["decode_ratio"] == pytest.approx(0.8) and pairs[0]["decode_ratio"] is None
    text = report.format_table(pairs)
    assert "| 128 | 16 | 16k | 8 | 800.00 / 1000.00 | 0.80x | 4.00 / 5.00 | 0.80x | 0 / 0 |" \
        in text
    assert "skipped (big)" in text and "| 1 / 0 |" in text
    report.write_csv(str(tmp_path / "t.csv"), pairs)
    lines = (tmp_path / "t.csv").read_text().splitlines()
    assert lines[0].split(",") == list(report.CSV_FIELDS) and len(lines) == 5
    assert "128,16,16384,8,hygon,ok,800.0000,4.0000,0.8000,0.8000,0,0" in lines


def _out(ids, gaps, cached=0):
    return {"output_ids": ids, "cached_tokens": cached,
            "top2": [[[-0.1, t], [-0.1 - g, t + 1]] for t, g in zip(ids, gaps)]}


def test_token_comparison_gaps_and_cache_hits():
    a = {"scenarios": {"distinct": [_out([1, 2, 3], [1, 1, 1]), _out([4, 5, 6], [1, 0.01, 1])],
                       "shared_prefix": [_out([7], [1]), _out([8], [1], cached=992)]}}
    b = {"scenarios": {"distinct": [_out([1, 2, 3], [1, 1, 1]), _out([4, 9, 6], [1, 0.02, 1])],
                       "shared_prefix": [_out([7], [1]), _out([8], [1], cached=992)]}}
    rep = report.compare_tokens(a, b)
    d = rep["scenarios"]["distinct"]
    assert d["identical"] == 1 and d["diffs"][0]["index"] == 1
    assert d["diffs"][0]["gap_a"] == pytest.approx(0.01) and rep["ok"]
    assert rep["scenarios"]["shared_prefix"]["cached_a"] == 992
    a["scenarios"]["distinct"][1]["top2"][1][1][0] = -5.0  # a real disagreement
    b["scenarios"]["distinct"][1]["top2"][1][1][0] = -5.0
    assert not report.compare_tokens(a, b)["ok"]
    for side in (a, b):
        side["scenarios"]["shared_prefix"][1]["cached_tokens"] = 0
    rep = report.compare_tokens(a, a)
    assert not rep["scenarios"]["shared_prefix"]["ok"] and rep["scenarios"]["distinct"]["ok"]
    assert "| shared_prefix | 2 | 1 | 2 | 0 / 0 | none | NO |" in report.format_tokens(
        rep, label="x")


def test_top2_and_prompts():
    meta = {"output_top_logprobs": [[(-0.5, 11, None), (-0.9, 12, None), (-3, 1, None)]]}
    assert child.top2_of(meta) == [[[-0.5, 11], [-0.9, 12]]]
    p = engine.check_prompts(quick=True)
    first, second = p["shared_prefix"]
    assert len(first) == 1 and all(x[:300] == first[0][:300] for x in second)
    assert all(3 <= t < engine.VOCAB for batch in p["distinct"] for x in batch for t in x)
    assert p == engine.check_prompts(quick=True)
    assert "long" not in p
    long = engine.check_prompts(quick=True, long=[40, 70])["long"]
    assert [len(x) for x in long[0]] == [40, 70] and len(long) == 1


def test_long_token_check_sizes_the_model_and_the_pool(tmp_path):
    args = _args("--no-bench", "--check-contexts", "16384", "32768")
    specs = engine.plan_specs(engine.resolve(args), args, str(tmp_path))
    assert [s["backend"] for s in specs] == ["hygon", "triton"]
    for s in specs:
        assert [len(x) for x in s["scenarios"]["long"][0]] == [16384, 32768]
        assert s["build"]["max_position_embeddings"] >= 32768 + args.check_new_tokens
        assert s["max_total_tokens"] >= 65536 + 16384 + 32768
    plain = _args("--no-bench")
    spec = engine.plan_specs(engine.resolve(plain), plain, str(tmp_path))[0]
    assert "long" not in spec["scenarios"] and spec["max_total_tokens"] == 65536


def test_entry_point_dist_info(tmp_path, monkeypatch):
    import importlib.metadata as md

    monkeypatch.setattr(md, "entry_points", lambda group=None: [])
    site = engine.entry_point_dir(str(tmp_path))
    monkeypatch.undo()
    found = [ep for d in md.distributions(path=[site])
             for ep in d.entry_points if ep.group == "sglang.srt.plugins"]
    assert [(ep.name, ep.value) for ep in found] == [
        ("hygon", "hygon_attn_backend.integrations.sglang:register")]


def test_breakdown_classes_kernels_of_both_backends():
    from hygon_attn_backend.tools.bench import _engine_breakdown as bd

    assert bd.kernel_class("paged_decode_kernel") == "attention"
    assert bd.kernel_class("combine_partitions_kernel") == "attention"
    assert bd.kernel_class("prefix_prefill_kernel") == "attention"
    # the native kernels, as the CUDA profiler names them
    assert bd.kernel_class("void hab_decode::paged_decode_kernel<HabBf16, 16, 128, 32, 64>"
                           "(HabDecodeParams, hab_decode::Flags, int)") == "attention"
    assert bd.kernel_class("(anonymous namespace)::combine_kernel(HabDecodeParams, bool)") \
        == "attention"
    assert bd.kernel_class("void hab_prefill::prefill_kernel<true, false>(HabPrefillParams)") \
        == "attention"
    assert bd.kernel_class("(anonymous namespace)::write_kv_kernel(HabWriteKvParams)") == "other"
    assert bd.kernel_class("_fwd_grouped_kernel_stage1") == "attention"  # SGLang triton
    assert bd.kernel_class("_fwd_kernel_stage2") == "attention"
    assert bd.kernel_class("_fwd_kernel") == "attention"  # SGLang's extend kernel
    assert bd.kernel_class("req_to_token_table_kernel") == "metadata"
    assert bd.kernel_class("create_flashinfer_kv_indices_triton") == "metadata"
    assert bd.kernel_class("_rms_norm_fwd_kernel") == "other"  # not a prefix match
    assert bd.kernel_class("nvjet_hsh_128x256_gemm") == "other"
    spans = [("req_to_token_table_kernel", 0.0, 4.0), ("paged_decode_kernel", 10.0, 810.0),
             ("gemm", 810.0, 1110.0)]
    s = bd.summarize_kernels(spans, steps=4)
    assert s["attention_us"] == 200.0 and s["other_us"] == 75.0 and s["metadata_us"] == 1.0
    assert s["all_us"] == pytest.approx(276.0)
    assert s["top_attention"] == [["paged_decode_kernel", 200.0]]
    # a combine launched as a dependent launch waits inside the decode kernel's span:
    # the class counts the union, the top list each kernel's own time
    pdl = spans + [("combine_partitions_kernel", 600.0, 830.0)]
    s = bd.summarize_kernels(pdl, steps=4)
    assert s["attention_us"] == pytest.approx(205.0)  # 10..830
    assert s["all_us"] == pytest.approx(276.0)
    assert s["top_attention"][1] == ["combine_partitions_kernel", 57.5]
    assert bd.busy_us([("a", 0, 10), ("b", 2, 5), ("c", 20, 25)]) == 15


def test_hook_timers_split_host_time_by_phase():
    from hygon_attn_backend.tools.bench import _engine_breakdown as bd

    class Backend:
        def __init__(self):
            self.seen = []

        def init_forward_metadata(self, fb):
            self.seen.append(("eager", fb))

        def init_forward_metadata_out_graph(self, fb, in_capture=False):
            self.seen.append(("graph", fb))

    class Runner:
        def __init__(self, backend):
            self.backend = backend

        def extend(self, reqs):
            self.backend.init_forward_metadata(reqs)
            return "extended"

        def decode(self, ids, batch):
            self.backend.init_forward_metadata_out_graph(batch)
            return "decoded"

    backend = Backend()
    runner = Runner(backend)
    timers = bd.HookTimers()
    timers.install(backend)
    timers.install(backend)  # idempotent: one wrapper
    assert timers.installed == ["init_forward_metadata", "init_forward_metadata_out_graph"]
    undo = timers.wrap_runner(runner)
    assert runner.extend("r") == "extended"
    for i in range(3):
        assert runner.decode(None, i) == "decoded"
    backend.init_forward_metadata("outside")  # no phase: not counted
    undo()
    assert "extend" not in vars(runner) and "decode" not in vars(runner)
    assert backend.seen == [("eager", "r"), ("graph", 0), ("graph", 1), ("graph", 2),
                            ("eager", "outside")]
    per = timers.per_call_us()
    assert set(per) == {"extend_hooks_host_us", "decode_hooks_host_us"}
    assert timers.calls == {"extend": 1, "decode": 3} and all(v >= 0 for v in per.values())


def test_breakdown_table_pairs_attention_time():
    o = {"status": "ok", "layers": 8, "decode_hooks_host_us": 40.0,
         "decode_kernels": {"attention_us": 800.0, "metadata_us": 5.0, "other_us": 900.0},
         "prefill_kernels": {"attention_us": 12000.0, "all_us": 30000.0}}
    t = {"status": "ok", "layers": 8, "decode_hooks_host_us": 60.0,
         "decode_kernels": {"attention_us": 1000.0, "metadata_us": 9.0, "other_us": 900.0},
         "prefill_kernels": {"attention_us": 20000.0, "all_us": 38000.0}}
    text = report.format_breakdown([{"head_dim": 128, "page": 16, "ctx": 16384, "batch": 8,
                                     "ours": o, "peer": t}])
    row = text.splitlines()[2]
    assert "800 / 1000 (100 / 125)" in row and "| 0.80x |" in row and "| 0.60x |" in row
    assert "12.00 / 20.00" in row and "40 / 60" in row


def test_breakdown_flag_reaches_the_specs(tmp_path):
    specs = engine.plan_specs(engine.resolve(_args("--quick", "--breakdown")),
                              _args("--quick", "--breakdown", "--no-check"), str(tmp_path))
    assert specs and all(s["breakdown"] for s in specs)
    specs = engine.plan_specs(engine.resolve(_args("--quick")), _args("--quick", "--no-check"),
                              str(tmp_path))
    assert not any(s["breakdown"] for s in specs)


def test_repeats_report_the_median_and_every_run(tmp_path):
    watch, rows = _Watch(), []
    lat = iter([0.030, 0.010, 0.020])  # prefill latency of the three timed runs

    def run_once(run_name, model_runner, rank_print, reqs, batch_size, input_len, output_len,
                 log_decode_step, profile, profile_record_shapes, profile_activities,
                 profile_prefix, profile_stage, tp_rank, profile_start_step=None,
                 profile_steps=None):
        if watch.phase != "timed":
            return {"prefill_latency": 1.0, "median_decode_latency": 1.0}
        calls.append(reqs)
        return {"prefill_latency": next(lat), "median_decode_latency": 0.002}

    calls = []
    wrapped = child.wrap_run_once(
        run_once, make_reqs=lambda b, c: f"fresh-{len(calls)}", skip=lambda b, c: None,
        record=rows.append, gate=lambda: None, watch=watch, repeats=3)
    wrapped("r", None, print, "tool-warm", 1, 10, 8, log_decode_step=0, profile=False,
            profile_record_shapes=False, profile_activities=("CPU",), profile_prefix="",
            profile_stage="all", tp_rank=0)
    wrapped("r", None, print, "tool-reqs", 1, 10, 8, 0, False, False, ("CPU",), "p", "all", 0)
    assert calls == ["tool-reqs", "fresh-1", "fresh-2"]  # the tool's prompts, then fresh
    (row,) = rows
    assert row["prefill_s"] == 0.020 and row["prefill_runs_s"] == [0.030, 0.010, 0.020]
    assert row["decode_s"] == 0.002
    pair = {"head_dim": 64, "page": 16, "ctx": 10, "batch": 1, "ours": row, "peer": None,
            "prefill_ratio": None, "decode_ratio": None}
    assert "20.00 [10.00-30.00]" in report.format_table([pair])
    args = _args("--quick", "--repeats", "3", "--no-check")
    specs = engine.plan_specs(engine.resolve(args), args, str(tmp_path))
    assert all(s["repeats"] == 3 for s in specs)


def test_request_groups_cover_every_request_within_the_limit():
    assert child.request_groups([], 10) == []
    assert child.request_groups([4, 4, 4], 100) == [(0, 3)]
    assert child.request_groups([4, 4, 4, 4, 4], 8) == [(0, 2), (2, 4), (4, 5)]
    assert child.request_groups([20, 3, 3], 10) == [(0, 1), (1, 3)]  # a long prompt alone
    groups = child.request_groups([32768] * 64, 262144)
    assert groups == [(i, i + 8) for i in range(0, 64, 8)]


def test_grouped_extend_prefills_groups_and_merges_their_batches():
    """Above the limit: one extend per group, the batches merged in order, the next ids
    and logits concatenated; at or below it: the tool's extend unchanged."""

    class Req:
        def __init__(self, n):
            self.origin_input_ids = [0] * n

    class Batch:
        def __init__(self, reqs):
            self.reqs = list(reqs)

        def merge_batch(self, other):
            self.reqs = self.reqs + other.reqs

    calls = []

    def extend(reqs, runner):
        calls.append(len(reqs))
        ids = [len(calls)] * len(reqs)
        return ids, [x * 10 for x in ids], Batch(reqs)

    cat = lambda parts: [x for p in parts for x in p]  # noqa: E731
    run = child.grouped_extend(extend, 8, cat)
    reqs = [Req(4) for _ in range(5)]
    ids, logits, batch = run(reqs, "runner")
    assert calls == [2, 2, 1]
    assert ids == [1, 1, 2, 2, 3] and logits == [10, 10, 20, 20, 30]
    assert batch.reqs == reqs
    calls.clear()
    ids, _, batch = run(reqs[:2], "runner")
    assert calls == [2] and batch.reqs == reqs[:2]


def test_report_marks_a_prefill_taken_in_several_forwards():
    side = {"status": "ok", "prefill_s": 1.5, "prefill_groups": 8}
    assert report._ms(side, "prefill_s") == "1500.00 (8 fwd)"
    assert report._ms(dict(side, prefill_groups=1), "prefill_s") == "1500.00"
    assert report._ms(dict(side, decode_s=0.002), "decode_s") == "2.00"


def test_a_failing_child_is_reported_with_the_last_line_of_its_log(tmp_path, capsys):
    specs = [{"name": "bad", "mode": "tokens", "ready_path": str(tmp_path / "r"),
              "result_path": str(tmp_path / "bad.json"), "lock_path": str(tmp_path / "l")}]
    code = "import sys; print('loading'); sys.exit('RuntimeError: no CUDA GPUs are available')"
    codes = engine.launch(specs, work=str(tmp_path), env=dict(os.environ), child_timeout=30,
                          deadline=None, poll_s=0.05,
                          command=lambda p: [sys.executable, "-c", code])
    assert codes == {"bad": 1}
    assert "bad: exit 1: RuntimeError: no CUDA GPUs are available" in capsys.readouterr().out
    text, _, _ = engine.summarize(specs, codes, ["hygon", "triton"])
    assert "- bad: exit 1: RuntimeError: no CUDA GPUs are available" in text


def test_an_interrupted_launch_leaves_no_child_running(tmp_path, monkeypatch):
    import time as time_module

    pid_file = tmp_path / "pid"
    specs = [{"name": "c", "mode": "tokens", "ready_path": str(tmp_path / "r"),
              "result_path": str(tmp_path / "c.json"), "lock_path": str(tmp_path / "l")}]
    code = (f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); "
            "time.sleep(60)")
    real_sleep = time_module.sleep

    def interrupt(_seconds):  # Ctrl-C once the child is up
        for _ in range(200):
            if pid_file.exists() and pid_file.read_text():
                break
            real_sleep(0.05)
        raise KeyboardInterrupt

    monkeypatch.setattr(engine.time, "sleep", interrupt)
    with pytest.raises(KeyboardInterrupt):
        engine.launch(specs, work=str(tmp_path), env=dict(os.environ), child_timeout=60,
                      deadline=None, command=lambda p: [sys.executable, "-c", code])
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_missing_gpu_and_sglang_are_named(monkeypatch):
    import importlib.util

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sglang" else real(name, *a))
    missing = engine.missing_prerequisites()
    assert len(missing) == 2
    assert missing[0].startswith("a CUDA or ROCm GPU (torch ")
    assert missing[1].startswith("SGLang (not installed: pip install 'sglang>=")


@pytest.mark.parametrize("keep", [False, True])
def test_the_work_folder_is_removed_however_the_run_ends_unless_out_names_it(
        tmp_path, monkeypatch, keep):
    """A temporary work folder holds GBs of models: gone after the run, also after an
    interrupt; --out keeps its folder."""
    import tempfile

    monkeypatch.setattr(engine, "missing_prerequisites", lambda: [])
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []

    def run(args, cfg, work):
        seen.append(work)
        (tmp_path / "marker").write_text("x")
        open(os.path.join(work, "model.safetensors"), "w").write("weights")
        raise KeyboardInterrupt

    monkeypatch.setattr(engine, "_run_engine", run)
    out = tmp_path / "kept"
    args = _args("--quick", *(["--out", str(out)] if keep else []))
    with pytest.raises(KeyboardInterrupt):
        engine.cmd_engine(args)
    (work,) = seen
    assert os.path.exists(os.path.join(work, "model.safetensors")) == keep
    assert (work == str(out)) == keep
    if not keep:
        assert not [p for p in tmp_path.iterdir() if p.name.startswith("hygon-engine-")]
