"""``hygon-attn bench engine``: our backend inside SGLang, beside SGLang's ``triton`` backend,
measured with SGLang's own static-batch tool (``sglang.benchmark.one_batch``), plus a
greedy-token check through the offline ``sglang.Engine`` (GPU with SGLang installed).

* One child process per (backend, head_dim, page size) runs the tool over every batch
  size and context (``_engine_child.py``: plugins loaded first, an untimed warm pass per
  point, Triton compiles counted inside timed points). The model is a random Llama
  built here: ``config.json`` only, weights drawn by SGLang (``--load-format dummy``), or
  ``--model-path``.
* The token check: one Engine per backend on a Llama with seeded random weights written
  here (safetensors), radix cache on: distinct prompts, then shared-prefix prompts
  (cache hits required); first differences reported with the top-2 logprob gap.
* Children start up together (SGLang's start-up is mostly host time); each takes an
  exclusive lock before its GPU work, so measurements never overlap.

Prints the markdown table (prefill latency, median decode step, ratios hygon/triton),
``--csv`` writes it; ``--out`` keeps the children's specs, logs and raw results (without
it they go to a temporary folder, removed when the run ends, however it ends). A machine
without a GPU or SGLang is told so in one line before anything starts; a child that fails
is reported with the last line of its log.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import List, Optional, Sequence

from hygon_attn_backend.tools import needs
from hygon_attn_backend.tools.argtypes import count, positive_float
from hygon_attn_backend.tools.bench import _engine_report as report

HEADS = {64: (16, 4), 128: (32, 8)}  # head_dim -> (query heads, KV heads)
VOCAB = 10240  # one_batch draws prompt ids below 10000
DEFAULTS = dict(head_dims=[64, 128], pages=[16], contexts=[4096, 16384, 32768],
                batches=[1, 8, 32, 64], layers=8, decode_steps=16,
                max_prefill_tokens=262144, max_point_tokens=64 * 32768)
QUICK = dict(head_dims=[64], pages=[16], contexts=[1024], batches=[1, 8], layers=2,
             decode_steps=8, max_prefill_tokens=262144, max_point_tokens=262144)


def add_engine_parser(sub) -> None:
    p = sub.add_parser("engine", help="SGLang engine step times and greedy tokens, hygon "
                                      "beside SGLang's triton backend (GPU + SGLang)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", nargs="+", default=["hygon", "triton"],
                   help="attention backends (the first is 'ours' in the ratios)")
    p.add_argument("--head-dims", type=int, nargs="+", choices=sorted(HEADS),
                   help="built models: 64 (16/4 heads, hidden 1024), 128 (32/8, hidden 4096)")
    p.add_argument("--pages", type=count(1), nargs="+", help="KV page sizes (default 16)")
    p.add_argument("--contexts", type=count(1), nargs="+",
                   help="prompt lengths (one_batch input_len)")
    p.add_argument("--batches", type=count(1), nargs="+", help="batch sizes")
    p.add_argument("--layers", type=count(1), help="decoder layers of the built models (default 8)")
    p.add_argument("--decode-steps", type=count(1),
                   help="one_batch output_len: the median is over output_len - 1 steps")
    p.add_argument("--max-prefill-tokens", type=count(1),
                   help="prompt tokens per prefill forward: a larger batch is prefilled in "
                        "groups of requests, merged before the decode steps (one_batch "
                        "itself prefills a whole batch at once)")
    p.add_argument("--max-point-tokens", type=count(1),
                   help="skip points of more batch x ctx tokens (the KV pool is sized for "
                        "the largest point; default 64 x 32k)")
    p.add_argument("--quick", action="store_true",
                   help="smoke subset: head_dim 64, page 16, ctx 1k, batches 1 and 8, "
                        "2 layers, a short token check")
    p.add_argument("--model-path", help="bench this model instead of the built ones "
                                        "(--head-dims then only labels it)")
    p.add_argument("--no-bench", action="store_true", help="only the token check")
    p.add_argument("--no-check", action="store_true", help="skip the token check")
    p.add_argument("--check-head-dim", type=int, choices=sorted(HEADS), default=None,
                   help="model of the token check (default 128; 64 with --quick)")
    p.add_argument("--check-new-tokens", type=count(1), default=32)
    p.add_argument("--check-contexts", type=count(1), nargs="+", default=[],
                   help="prompt lengths of a third token-check scenario, 'long': one batch "
                        "of one prompt per length (e.g. 16384 32768: split-KV decode)")
    p.add_argument("--mem-fraction", type=positive_float, default=0.85,
                   help="--mem-fraction-static of every child (pools are capped by "
                        "--max-total-tokens computed from the matrix)")
    p.add_argument("--child-timeout", type=positive_float, default=600.0, help="seconds per child")
    p.add_argument("--deadline", type=positive_float, default=None,
                   help="seconds for the whole run: children still running are killed and "
                        "the partial results reported")
    p.add_argument("--repeats", type=count(1), default=1,
                   help="timed runs per point (medians reported, every run kept in the "
                        "raw results; the tool times one prefill per run)")
    p.add_argument("--breakdown", action="store_true",
                   help="per point: host time of the backend's per-step hooks and, from one "
                        "more profiled pass, GPU time of attention, metadata and other "
                        "kernels per prefill and per decode step")
    p.add_argument("--serial", action="store_true",
                   help="start each child after the one before exited (default: all start "
                        "together and take the GPU in turn, unless their KV pools would not "
                        "fit on the GPU together, e.g. 64 x 32k tokens at head_dim 128)")
    p.add_argument("--out", help="work folder (specs, logs, raw results); default a temp dir")
    p.add_argument("--csv", help="write the step-time table as CSV")
    p.set_defaults(func=cmd_engine)


def resolve(args) -> dict:
    """The run's settings: ``--quick`` or the defaults, overridden by explicit flags."""
    base = dict(QUICK if args.quick else DEFAULTS)
    for name in base:
        value = getattr(args, name, None)
        if value is not None:
            base[name] = value
    base["batches"] = sorted(set(base["batches"]))
    base["contexts"] = sorted(set(base["contexts"]))
    base["check_head_dim"] = args.check_head_dim or (64 if args.quick else 128)
    base["check_layers"] = 2 if args.quick else 4
    return base


def planned_points(cfg: dict) -> List[tuple]:
    """``(batch, ctx)`` pairs of at most ``max_point_tokens`` tokens (the rest are
    skipped); those above ``max_prefill_tokens`` are prefilled in groups of requests."""
    return [(b, c) for b in cfg["batches"] for c in cfg["contexts"]
            if b * c <= cfg["max_point_tokens"]]


def pool_tokens(cfg: dict, page: int) -> int:
    """KV pool size for the planned points: the largest batch x (ctx + decode steps),
    plus a page per request and a margin, in whole pages."""
    points = planned_points(cfg) or [(min(cfg["batches"]), min(cfg["contexts"]))]
    need = max(b * (c + cfg["decode_steps"] + page) for b, c in points) + 4096
    return -(-need // page) * page


def llama_config(*, head_dim: int, layers: int, max_positions: int) -> dict:
    """A Llama ``config.json`` for ``head_dim`` (heads from :data:`HEADS`); the MLP is 2x
    hidden, smaller than production Llamas, so attention weighs like a long-context step."""
    hq, hkv = HEADS[head_dim]
    hidden = hq * head_dim
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": hidden, "intermediate_size": 2 * hidden,
            "num_attention_heads": hq, "num_key_value_heads": hkv, "head_dim": head_dim,
            "num_hidden_layers": layers, "vocab_size": VOCAB,
            "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
            "torch_dtype": "float16", "bos_token_id": 1, "eos_token_id": 2}


def write_model(path: str, config: dict, *, weights: bool, seed: int = 0,
                std: float = 0.02) -> str:
    """``config.json`` in ``path``; with ``weights``, a seeded random ``model.safetensors``
    (normal, ``std``; norms 1) in the checkpoint names of ``LlamaForCausalLM``."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(config, fh, indent=1)
    if weights:
        from safetensors.torch import save_file

        save_file(random_llama_weights(config, seed=seed, std=std),
                  os.path.join(path, "model.safetensors"))
    return path


def random_llama_weights(config: dict, *, seed: int = 0, std: float = 0.02) -> dict:
    """``name -> fp16 tensor`` of a Llama checkpoint (CPU)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * std).to(torch.float16)

    out = {"model.embed_tokens.weight": rnd(v, h), "model.norm.weight": torch.ones(h).half(),
           "lm_head.weight": rnd(v, h)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "input_layernorm.weight": torch.ones(h).half(),
                    p + "post_attention_layernorm.weight": torch.ones(h).half(),
                    p + "self_attn.q_proj.weight": rnd(q, h),
                    p + "self_attn.k_proj.weight": rnd(kv, h),
                    p + "self_attn.v_proj.weight": rnd(kv, h),
                    p + "self_attn.o_proj.weight": rnd(h, q),
                    p + "mlp.gate_proj.weight": rnd(f, h), p + "mlp.up_proj.weight": rnd(f, h),
                    p + "mlp.down_proj.weight": rnd(h, f)})
    return out


def check_prompts(*, seed: int = 0, quick: bool = False, long: Sequence[int] = ()) -> dict:
    """Prompt batches of the token check (ids in ``[3, VOCAB)``), sent in order:
    ``distinct`` (lengths that end mid-page), then ``shared_prefix``: one prompt that
    fills the radix cache, then a batch sharing its prefix (cache hits); with ``long``,
    a ``long`` scenario: one batch of one prompt per length."""
    rng = random.Random(seed)

    def ids(n):
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    lens = [5, 17, 100, 333] if quick else [5, 17, 100, 333, 600, 1024, 1500, 2049]
    prefix = ids(300 if quick else 1000)
    tails = [3, 16, 40] if quick else [3, 16, 40, 77, 128, 257]
    out = {"distinct": [[ids(n) for n in lens]],
           "shared_prefix": [[prefix + ids(9)], [prefix + ids(n) for n in tails]]}
    if long:
        out["long"] = [[ids(n) for n in long]]
    return out


def entry_point_dir(work: str) -> Optional[str]:
    """A folder holding a ``.dist-info`` that declares our ``sglang.srt.plugins`` entry
    point, for a checkout that is not pip-installed (SGLang's ``load_plugins`` finds
    plugins only through entry points); None when the entry point is installed."""
    import importlib.metadata as md

    if any(ep.name == "hygon" for ep in md.entry_points(group="sglang.srt.plugins")):
        return None
    site = os.path.join(work, "site")
    info = os.path.join(site, "hygon_attn_backend-0.0.0.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as fh:
        fh.write("Metadata-Version: 2.1\nName: hygon-attn-backend\nVersion: 0.0.0\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as fh:
        fh.write("[sglang.srt.plugins]\nhygon = hygon_attn_backend.integrations.sglang:register\n")
    return site


def plan_specs(cfg: dict, args, work: str) -> List[dict]:
    """Children's specs (models are written by :func:`write_models`)."""
    specs = []
    lock = os.path.join(work, "gpu.lock")
    max_ctx = max(cfg["contexts"]) + cfg["decode_steps"] + 64
    if not args.no_bench:
        head_dims = cfg["head_dims"] if not args.model_path else cfg["head_dims"][:1]
        for hd in head_dims:
            model = args.model_path or os.path.join(work, f"llama-d{hd}")
            for page in cfg["pages"]:
                for backend in args.backends:
                    name = f"onebatch-{backend}-d{hd}-p{page}"
                    specs.append({
                        "mode": "onebatch", "name": name, "backend": backend, "head_dim": hd,
                        "page": page, "model_path": model,
                        "load_format": None if args.model_path else "dummy",
                        "build": None if args.model_path else llama_config(
                            head_dim=hd, layers=cfg["layers"], max_positions=max_ctx),
                        "batches": cfg["batches"], "contexts": cfg["contexts"],
                        "decode_steps": cfg["decode_steps"],
                        "max_prefill_tokens": cfg["max_prefill_tokens"],
                        "max_point_tokens": cfg["max_point_tokens"],
                        "max_total_tokens": pool_tokens(cfg, page),
                        "max_running_requests": max(cfg["batches"]) + 8,
                        "mem_fraction": args.mem_fraction,
                        "breakdown": bool(getattr(args, "breakdown", False)),
                        "repeats": max(1, int(getattr(args, "repeats", 1) or 1))})
    if not args.no_check:
        hd = cfg["check_head_dim"]
        long = list(getattr(args, "check_contexts", None) or [])
        prompts = check_prompts(quick=args.quick, long=long)
        positions = max([8192] + [n + args.check_new_tokens + 64 for n in long])
        for backend in args.backends:
            specs.append({
                "mode": "tokens", "name": f"tokens-{backend}-d{hd}", "backend": backend,
                "head_dim": hd, "page": cfg["pages"][0],
                "model_path": os.path.join(work, f"llama-d{hd}-check"),
                "build": llama_config(head_dim=hd, layers=cfg["check_layers"],
                                      max_positions=positions),
                "weights": True, "scenarios": prompts, "new_tokens": args.check_new_tokens,
                "graph_bs": 16, "max_total_tokens": 65536 + sum(long) + 1024 * len(long),
                "mem_fraction": args.mem_fraction})
    for s in specs:
        s["ready_path"] = os.path.join(work, s["name"] + ".ready")
        s["result_path"] = os.path.join(work, s["name"] + (".jsonl" if s["mode"] == "onebatch"
                                                           else ".json"))
        s["lock_path"] = lock
    return specs


def write_models(specs: List[dict]) -> None:
    done = set()
    for s in specs:
        if s.get("build") and s["model_path"] not in done:
            done.add(s["model_path"])
            t0 = time.perf_counter()
            write_model(s["model_path"], s["build"], weights=bool(s.get("weights")))
            print(f"model {s['model_path']} written in {time.perf_counter() - t0:.1f} s",
                  flush=True)


def launch(specs: List[dict], *, work: str, env: dict, child_timeout: float,
           deadline: Optional[float], command=None, poll_s: float = 1.0) -> dict:
    """Start every child, release the GPU lock once all are ready (or gone), wait; kill a
    child past its timeout or the deadline. Returns ``name -> exit code`` (None: killed)."""
    command = command or (lambda spec_path: [sys.executable, "-m",
                                             "hygon_attn_backend.tools.bench._engine_child",
                                             spec_path])
    lock_fd = open(specs[0]["lock_path"], "a")
    fcntl.flock(lock_fd, fcntl.LOCK_EX)  # held until every child is ready
    t_start = time.perf_counter()
    end = t_start + deadline if deadline else None
    procs = {}
    for s in specs:
        spec_path = os.path.join(work, s["name"] + ".spec.json")
        with open(spec_path, "w") as fh:
            json.dump(s, fh)
        log = open(os.path.join(work, s["name"] + ".log"), "w")
        p = subprocess.Popen(command(spec_path), stdout=log, stderr=subprocess.STDOUT, env=env,
                             start_new_session=True)
        limit = t_start + child_timeout
        procs[s["name"]] = (p, s, min(limit, end) if end else limit)
    codes, released, seen_lines = {}, False, {}
    try:
        while len(codes) < len(procs):
            now = time.perf_counter()
            for name, (p, s, limit) in procs.items():
                if name in codes:
                    continue
                rc = p.poll()
                if rc is None and now > limit:
                    _kill(p)
                    codes[name] = None
                    print(f"[{now - t_start:6.1f}s] {name}: killed (time limit)", flush=True)
                elif rc is not None:
                    codes[name] = rc
                    why = "" if rc == 0 else f": {failure_reason(work, name)}"
                    print(f"[{now - t_start:6.1f}s] {name}: exit {rc}{why}", flush=True)
                _echo_results(s, seen_lines, now - t_start)
            if not released and all(n in codes or os.path.exists(s["ready_path"])
                                    for n, (_, s, _) in procs.items()):
                fcntl.flock(lock_fd, fcntl.LOCK_UN)
                released = True
                print(f"[{now - t_start:6.1f}s] all children started: GPU lock released",
                      flush=True)
            time.sleep(poll_s)
    finally:  # interrupted too: no child outlives the run
        for name, (p, _, _) in procs.items():
            if p.poll() is None:
                _kill(p)
        lock_fd.close()
    return codes


def _kill(proc) -> None:
    """Kill a child and everything it started (its process group) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def failure_reason(work: str, name: str) -> str:
    """The last non-blank line of a child's log (where its error is), or a note that it
    left none."""
    try:
        with open(os.path.join(work, name + ".log"), errors="replace") as fh:
            lines = [line.strip() for line in fh if line.strip()]
    except OSError:
        lines = []
    return lines[-1][:300] if lines else "no log output"


PROCESS_RESERVE_BYTES = 6 << 30  # an engine's weights, activations, graphs and context
GPU_USABLE_FRACTION = 0.9


def kv_pool_bytes(spec: dict) -> int:
    """KV-cache bytes of a child's pool (fp16 K and V of every layer), 0 when unknown (a
    ``--model-path`` model: no config in the spec)."""
    cfg = spec.get("build")
    if not cfg:
        return 0
    per_token = (2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
                 * cfg["num_hidden_layers"])
    return int(spec.get("max_total_tokens", 0)) * per_token


def pools_need_serial(specs: List[dict], gpu_bytes: Optional[int]) -> bool:
    """Whether the children, all started at once, would not fit on a GPU of ``gpu_bytes``:
    their KV pools plus a reserve each above 90% of it (each engine sizes its pool at
    start-up, so a later one gets what the others left and its tool skips the point)."""
    if not gpu_bytes:
        return False
    need = sum(kv_pool_bytes(s) + PROCESS_RESERVE_BYTES for s in specs)
    return need > GPU_USABLE_FRACTION * gpu_bytes


def gpu_total_bytes() -> Optional[int]:
    """Memory of GPU 0, None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def launch_serially(specs: List[dict], *, work: str, env: dict, child_timeout: float,
                    deadline: Optional[float], command=None, poll_s: float = 1.0) -> dict:
    """:func:`launch` one child at a time, each started after the one before exited (for
    KV pools too large for two engines on the GPU at once); the deadline covers them all,
    and children never started are reported as killed (None)."""
    t_start = time.perf_counter()
    codes = {}
    for s in specs:
        left = None if deadline is None else deadline - (time.perf_counter() - t_start)
        if left is not None and left <= 0:
            codes[s["name"]] = None
            print(f"{s['name']}: not started (deadline)", flush=True)
            continue
        codes.update(launch([s], work=work, env=env, child_timeout=child_timeout,
                            deadline=left, command=command, poll_s=poll_s))
    return codes


def _echo_results(spec: dict, seen: dict, t: float) -> None:
    if spec["mode"] != "onebatch":
        return
    rows = report.read_rows([spec["result_path"]])
    for r in rows[seen.get(spec["name"], 0):]:
        if r.get("status") == "ok":
            print(f"[{t:6.1f}s] {spec['name']} B={r['batch']} ctx={r['ctx']}: prefill "
                  f"{r['prefill_s'] * 1e3:.1f} ms, decode {r['decode_s'] * 1e3:.3f} ms, "
                  f"compiles in timed run {len(r['compiles_timed'])}", flush=True)
        elif r.get("status") != "startup":
            print(f"[{t:6.1f}s] {spec['name']} B={r['batch']} ctx={r['ctx']}: {r['status']}",
                  flush=True)
    seen[spec["name"]] = len(rows)


def summarize(specs: List[dict], codes: dict, backends: List[str]) -> tuple:
    """``(markdown text, step-time pairs, token reports)`` of a finished run."""
    ours, peer = backends[0], backends[1] if len(backends) > 1 else backends[0]
    rows = report.read_rows([s["result_path"] for s in specs if s["mode"] == "onebatch"])
    pairs = report.pair_rows(rows, ours=ours, peer=peer)
    parts = []
    if pairs:
        parts.append(report.format_table(pairs, ours=ours, peer=peer))
        if any("decode_kernels" in r for r in rows):
            parts.append(report.format_breakdown(pairs, ours=ours, peer=peer))
    for r in rows:
        if r.get("status") == "startup":
            parts.append(f"{r['backend']} d{r['head_dim']} p{r['page']}: Triton compiles "
                         f"during start-up: {', '.join(r['startup_compiles']) or 'none'}")
    token_reports = {}
    checks = [s for s in specs if s["mode"] == "tokens"]
    by_backend = {}
    for s in checks:
        try:
            with open(s["result_path"]) as fh:
                by_backend[s["backend"]] = json.load(fh)
        except (FileNotFoundError, json.JSONDecodeError):
            parts.append(f"token check {s['name']}: no result (exit {codes.get(s['name'])})")
    if ours in by_backend and peer in by_backend and ours != peer:
        rep = report.compare_tokens(by_backend[ours], by_backend[peer])
        token_reports[(ours, peer)] = rep
        label = f"head_dim {checks[0]['head_dim']}, page {checks[0]['page']}"
        parts.append(report.format_tokens(rep, label=label, ours=ours, peer=peer))
    failed = [n for n, c in codes.items() if c != 0]
    if failed:
        work = os.path.dirname(specs[0]["result_path"])
        parts.append("children that failed or were killed:\n" + "\n".join(
            f"- {n}: " + ("killed (time limit)" if codes[n] is None else
                          f"exit {codes[n]}: {failure_reason(work, n)}") for n in failed))
    return "\n\n".join(parts), pairs, token_reports


def missing_prerequisites() -> list:
    """What the engine bench needs and this machine lacks, each as a phrase ([] when
    nothing is missing): a GPU that torch sees, SGLang."""
    import importlib.util

    import torch

    missing = []
    if not torch.cuda.is_available():
        missing.append(f"a CUDA or ROCm GPU (torch {torch.__version__} sees none)")
    if importlib.util.find_spec("sglang") is None:
        missing.append(f"SGLang (not installed: pip install '{needs.SGLANG}')")
    return missing


def cmd_engine(args) -> int:
    missing = missing_prerequisites()
    if missing:
        print(f"hygon-attn bench engine: needs {' and '.join(missing)}", file=sys.stderr)
        return 2
    cfg = resolve(args)
    work = args.out or tempfile.mkdtemp(prefix="hygon-engine-")
    os.makedirs(work, exist_ok=True)
    try:
        return _run_engine(args, cfg, work)
    finally:
        if not args.out:  # the models and logs of a temporary folder (GBs): never left
            shutil.rmtree(work, ignore_errors=True)


def _run_engine(args, cfg: dict, work: str) -> int:
    specs = plan_specs(cfg, args, work)
    if not specs:
        raise SystemExit("hygon-attn bench engine: nothing to run (--no-bench and --no-check)")
    write_models(specs)
    env = dict(os.environ)
    site = entry_point_dir(work)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    extra = [p for p in (site, root) if p]
    env["PYTHONPATH"] = os.pathsep.join(extra + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    kept = "" if args.out else " (temporary: removed at the end; --out keeps one)"
    print(f"engine bench: {len(specs)} children, work folder {work}{kept}; points "
          f"{planned_points(cfg)}", flush=True)
    serial = bool(getattr(args, "serial", False))
    if not serial and pools_need_serial(specs, gpu_total_bytes()):
        serial = True
        print("engine bench: the children's KV pools do not fit on the GPU together: "
              "starting them one after another (--serial)", flush=True)
    if serial:
        codes = launch_serially(specs, work=work, env=env, child_timeout=args.child_timeout,
                                deadline=args.deadline)
    else:
        codes = launch(specs, work=work, env=env, child_timeout=args.child_timeout,
                       deadline=args.deadline)
    text, pairs, token_reports = summarize(specs, codes, args.backends)
    with open(os.path.join(work, "summary.md"), "w") as fh:
        fh.write(text + "\n")
    print(text)
    if args.csv:
        report.write_csv(args.csv, pairs, ours=args.backends[0],
                         peer=args.backends[1] if len(args.backends) > 1 else args.backends[0])
    ok = all(c == 0 for c in codes.values()) and all(r["ok"] for r in token_reports.values())
    return 0 if ok else 1
