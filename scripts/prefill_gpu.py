"""One GPU call for the prefix-prefill kernel: correctness at real sizes, then timings.

Usage (on the GPU machine, from the repository root)::

    python scripts/prefill_gpu.py --out DIR [--workers 8] [--tiles "M,N,w,s;..."]
        [--skip-check] [--bench-args "..."]

Phase 1 runs tests/test_prefill.py's GPU cases (and the > 2^31-element cache case) in a
pool of processes, and at the same time compiles every kernel variant the benchmark will
time (each worker runs the benchmark shapes once), so compiles overlap. Phase 2 times the
benchmark in this process alone (compiles come from Triton's on-disk cache). Logs, JSON
and the markdown table go to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))


def _load_tests():
    spec = importlib.util.spec_from_file_location("test_prefill",
                                                  os.path.join(ROOT, "tests", "test_prefill.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["test_prefill"] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _task(task):
    """Worker body: ("check", index) or ("warm", tile, page, shapes, sources)."""
    import torch
    t0 = time.time()
    try:
        if task[0] == "check":
            mod = _load_tests()
            if task[1] == "big":
                case = mod.Case("g_big_cache", (3000, 50), (200, 300), group=4, kv_heads=8,
                                page=16, head_dim=128, dtype=torch.bfloat16)
                per_block = case.kv_heads * case.page * case.head_dim
                err, budget = mod.run_case(case, torch.device("cuda"),
                                           min_blocks=(2 ** 31) // per_block + 64)
            else:
                case = mod.GPU_CASES[task[1]]
                err, budget = mod.run_case(case, torch.device("cuda"))
            return (f"PASS {case.name:22s} err {err:.3e} budget {budget:.3e} "
                    f"({time.time() - t0:.1f}s)")
        from hygon_attn_backend.bench.peers import ours_prefill
        from hygon_attn_backend.bench.problems import build_prefill
        _, tile, page, shapes, sources, hq, hkv, dim = task
        for batch, prefix, extend in shapes:
            prob = build_prefill(batch=batch, prefix=prefix, extend=extend, page_size=page,
                                 num_q_heads=hq, num_kv_heads=hkv, head_dim=dim,
                                 dtype=torch.bfloat16, device="cuda")
            for src in sources:
                ours_prefill(prob, kv_source=src, tile=tile).fn()
            torch.cuda.synchronize()
            del prob
        return f"WARM tile={tile} page={page} ({time.time() - t0:.1f}s)"
    except Exception:
        return f"FAIL {task[:3]}\n{traceback.format_exc()}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/prefill_out"))
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--tiles", default="")
    ap.add_argument("--shapes", default="")
    ap.add_argument("--block-sizes", default="16,64")
    ap.add_argument("--kv-source", default="cache")
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--rep-ms", type=float, default=100.0)
    ap.add_argument("--tag", default="bench")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    import multiprocessing as mp

    import torch
    import triton
    from hygon_attn_backend.bench import prefill as bench
    print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}", flush=True)
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,clocks.sm,clocks.max.sm,"
                              "temperature.gpu,power.draw", "--format=csv"],
                             capture_output=True, text=True, timeout=20).stdout
        print(smi, flush=True)
    except Exception as exc:
        print(f"nvidia-smi: {exc}")
    shapes = bench._parse_shapes(args.shapes or bench.DEFAULT_SHAPES)
    tiles = bench._parse_tiles(args.tiles)
    pages = [int(x) for x in args.block_sizes.split(",")]
    sources = ["cache", "dense"] if args.kv_source == "both" else [args.kv_source]
    tasks = []
    if not args.skip_check:
        mod = _load_tests()
        tasks += [("check", i) for i in range(len(mod.GPU_CASES))] + [("check", "big")]
    tasks += [("warm", tile, page, shapes, sources, 32, 8, 128) for tile in tiles
              for page in pages]
    t0 = time.time()
    ctx = mp.get_context("spawn")
    lines = []
    with ctx.Pool(args.workers) as pool:
        for line in pool.imap_unordered(_task, tasks):
            print(line, flush=True)
            lines.append(line)
    print(f"phase 1 (checks + compiles): {time.time() - t0:.1f}s", flush=True)
    with open(os.path.join(args.out, "check.log"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    n_fail = sum(line.startswith("FAIL") for line in lines)
    n_pass = sum(line.startswith("PASS") for line in lines)
    print(f"checks: {n_pass} pass, {n_fail} fail", flush=True)

    bargs = argparse.Namespace(
        shapes=args.shapes or bench.DEFAULT_SHAPES, block_sizes=args.block_sizes,
        num_q_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16",
        kv_source=args.kv_source, tiles=args.tiles, compare="" if args.no_peers else "sdpa",
        rep_ms=args.rep_ms, json=os.path.join(args.out, f"{args.tag}.json"),
        markdown=os.path.join(args.out, f"{args.tag}.md"), csv="", plot="")
    t1 = time.time()
    bench.run_prefill_bench(bargs)
    print(f"phase 2 (timings): {time.time() - t1:.1f}s; checks: {n_pass} pass, "
          f"{n_fail} fail", flush=True)


if __name__ == "__main__":
    main()
