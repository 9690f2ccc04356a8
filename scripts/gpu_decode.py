"""One GPU call for paged decode: tests at real sizes, then the benchmark sweeps.

Usage (on the GPU machine, from the repository root)::

    python scripts/gpu_decode.py --out DIR [--plan sweep|final] [--skip-tests]

Phase 1 runs tests/test_decode.py on the GPU (pytest-xdist workers) and, at the same
time, compiles every kernel variant the benchmark will time (one process per benchmark
shape, timing nothing), so compiles overlap. Phase 2 times the benchmarks in this
process alone (kernels come from Triton's on-disk cache). Logs, JSON and markdown tables
go to ``--out``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

SHAPES = ["1,32768", "1,131072", "8,8192", "64,4096", "64,16384", "256,2048"]
# decode tile sweeps need a tile argument of the op (the benchmark never sets the
# environment): until the op takes one, the plans sweep partition sizes only
PLANS = {
    # sweep 1: partition-rule sweep over issue 3's shapes, G sweep, per-query-head variant
    "sweep": [
        dict(name="partitions", shapes=SHAPES, groups="1,8,16",
             partitions="auto,dcu,256,512,1024,2048,4096,none"),
    ],
    # the shipped configuration (auto) against the DCU rule, for docs/bench-decode.md,
    # plus small checks of the tile and partition choices around it
    "docs": [
        dict(name="docs", shapes=SHAPES, groups="1,8,16", partitions="auto,dcu", timeout=120),
    ],
    "final": [
        dict(name="final", shapes=SHAPES, groups="1,8,16", partitions="auto,dcu", timeout=120),
    ],
}


def _bench_argv(cfg, shapes, groups, rep_ms, out=None):
    argv = [sys.executable, "-m", "hygon_attn_backend.bench.decode",
            "--shapes", ";".join(shapes), "--groups", groups,
            "--partitions", cfg["partitions"],
            "--rep-ms", str(rep_ms), "--block-sizes", cfg.get("pages", "16,64")]
    if out:
        argv += ["--json", out + ".json", "--markdown", out + ".md"]
    return argv


def _run(argv, log, timeout=None):
    t0 = time.time()
    with open(log, "w") as fh:
        try:
            rc = subprocess.call(argv, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT,
                                 timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return rc, time.time() - t0


def summarize(path):
    """One line per (shape, Hkv, page): every implementation's % of the copy."""
    import json
    res = json.load(open(path))
    print(f"== {os.path.basename(path)}: copy {res['copy_gbps']:.0f} GB/s")
    groups = {}
    for row in res["rows"]:
        key = (row["batch"], row["ctx"], row["num_q_heads"], row["num_kv_heads"], row["page"])
        groups.setdefault(key, []).append(row)
    for (b, ctx, hq, hkv, page), rows in groups.items():
        cells = [f"{r['impl']} {r['pct']:.1f}%" if r["status"] == "ok"
                 else f"{r['impl']} {r['status'][:60]}" for r in rows]
        print(f"B{b} ctx{ctx} {hq}/{hkv} P{page}: " + " | ".join(cells))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--plan", default="sweep", choices=sorted(PLANS))
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--rep-ms", type=float, default=40.0)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
    os.environ["PYTHONUNBUFFERED"] = "1"
    plan = PLANS[args.plan]
    t0 = time.time()

    warm = []
    for cfg in plan:
        for shape in cfg["shapes"]:
            warm.append(_bench_argv(cfg, [shape], "", 1.0))
        for g in filter(None, cfg["groups"].split(",")):
            warm.append(_bench_argv(cfg, [], g, 1.0))
    pool = ThreadPoolExecutor(max_workers=args.workers)
    os.makedirs("/tmp/decode-warm", exist_ok=True)  # $OUT returns at most 8 files
    futures = [pool.submit(_run, a, f"/tmp/decode-warm/warm{i}.log", 150)
               for i, a in enumerate(warm)]
    test_rc = None
    if not args.skip_tests:
        test_rc, dt = _run([sys.executable, "-m", "pytest", "-q", "-rs", "-n", "6", "--timeout", "300",
                            "tests/test_decode.py"], os.path.join(args.out, "pytest.log"), 150)
        print(f"pytest rc={test_rc} ({dt:.0f}s)", flush=True)
        os.system(f"tail -5 {os.path.join(args.out, 'pytest.log')}")
    warm_rc = [f.result() for f in futures]
    print(f"warm-up compiles: rc {[r for r, _ in warm_rc]} ({time.time() - t0:.0f}s)", flush=True)
    for i, (rc, _) in enumerate(warm_rc):
        if rc:
            os.system(f"tail -8 /tmp/decode-warm/warm{i}.log")
    for cfg in plan:
        base = os.path.join(args.out, cfg["name"])
        rc, dt = _run(_bench_argv(cfg, cfg["shapes"], cfg["groups"], args.rep_ms, out=base),
                      base + ".log", cfg.get("timeout", 90))
        print(f"bench {cfg['name']}: rc={rc} ({dt:.0f}s)", flush=True)
    # a short summary last (the reply carries the end of the output; tables are files)
    for cfg in plan:
        js = os.path.join(args.out, cfg["name"] + ".json")
        if os.path.exists(js):
            summarize(js)
        else:
            os.system(f"tail -20 {os.path.join(args.out, cfg['name'] + '.log')}")
    print(f"total {time.time() - t0:.0f}s; tests rc={test_rc}")


if __name__ == "__main__":
    main()
