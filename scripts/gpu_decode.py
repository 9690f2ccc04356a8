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
TILES = "32,4,2;32,4,3;64,4,2;64,4,3;64,8,3;128,4,2;128,4,3;128,8,3"
PLANS = {
    # sweep 1: partition-rule sweep over issue 3's shapes, G sweep, per-query-head variant
    "sweep": [
        dict(name="partitions", shapes=SHAPES, groups="1,8,16",
             partitions="auto,dcu,256,512,1024,2048,4096,none", tiles=""),
        dict(name="tiles", shapes=["64,4096", "1,32768"], groups="",
             partitions="auto", tiles=TILES),
    ],
    # the shipped configuration (auto) against the DCU rule, for docs/bench-decode.md,
    # plus small checks of the tile and partition choices around it
    "docs": [
        dict(name="docs", shapes=SHAPES, groups="1,8,16", partitions="auto,dcu", tiles="",
             timeout=120),
    ],
    "final": [
        dict(name="final", shapes=SHAPES, groups="1,8,16", partitions="auto,dcu", tiles="",
             timeout=120),
        dict(name="tiles2", shapes=["1,32768", "1,131072", "8,8192", "64,4096"], groups="",
             partitions="auto",
             tiles="16,4,3,1;16,4,3,0;32,4,2,1;32,4,2,0;64,4,2,1;64,4,2,0;128,4,2,1",
             timeout=100),
    ],
}


def _bench_argv(cfg, shapes, groups, rep_ms, out=None):
    argv = [sys.executable, "-m", "hygon_attn_backend.bench.decode",
            "--shapes", ";".join(shapes), "--groups", groups,
            "--partitions", cfg["partitions"], "--tiles", cfg["tiles"],
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
    """One line per (shape, page, variant): auto, dcu, and the best point with its config."""
    import json
    res = json.load(open(path))
    print(f"== {os.path.basename(path)}: copy {res['copy_gbps']:.0f} GB/s")

    def fmt(p):
        return (f"{p['partition']}:{p['partition_size']}({p['num_partitions']})"
                f"/{','.join(map(str, p['tile'][1:]))} {p['pct_copy']:.1f}%")

    for row in res["rows"]:
        for page, grid in sorted({(p["page"], p["kv_head_grid"]) for p in row["points"]}):
            pts = [p for p in row["points"] if p["page"] == page and p["kv_head_grid"] == grid]
            ok = [p for p in pts if "error" not in p]
            named = {}
            for p in ok:
                if p["partition"] in ("auto", "dcu"):
                    named.setdefault(p["partition"], p)
            best = max(ok, key=lambda p: p["pct_copy"]) if ok else None
            line = (f"B{row['batch']} ctx{row['ctx']} {row['num_q_heads']}/{row['num_kv_heads']}"
                    f" P{page} {'kv' if grid else 'qh'}: "
                    + " ".join(fmt(p) for p in named.values())
                    + f" | best {fmt(best) if best else '-'}")
            if len(ok) < len(pts):
                line += f" | {len(pts) - len(ok)} errors: {[p['error'][:80] for p in pts if 'error' in p][:1]}"
            print(line)


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
