"""``hygon-attn bench overhead``: host cost of one attention call, in microseconds.

Engines call attention once per layer per step; outside a CUDA graph the host time of
that call is paid ``num_layers`` times, and when it exceeds the GPU time the GPU waits.
This measures it the way the cost shows up: a tiny problem (the GPU work of one call is a
few microseconds) called ``--calls`` times back to back with no sync; the wall time over
the calls, read before the final sync, is the host's time per call. Every row is one
per-layer call as the op or the engine integration makes it, with everything that
depends only on the batch (plans, workspaces, metadata) built once outside the loop.

Rows: each op plain (checks, config and scratch per call) and with its plan; the vLLM
backend's per-layer path (``integrations/vllm/step.py``: K/V write + attention, as
``HygonAttentionImpl.do_kv_cache_update`` + ``forward`` run it) for a decode batch and a
mixed batch; SGLang's ``forward_decode`` / ``forward_extend`` when SGLang is installed.
``--profile FILE`` also writes a cProfile listing of each row (top functions by own time).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time

from hygon_attn_backend.tools.argtypes import count, int_list
from hygon_attn_backend.tools.bench._overhead_shapes import DECODE, EXTEND, MIXED  # noqa: F401


def add_overhead_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("overhead", help="host microseconds per attention call")
    p.add_argument("--block-sizes", default="16,64", type=int_list(),
                   help="page sizes, comma-separated")
    p.add_argument("--num-q-heads", type=count(1), default=32)
    p.add_argument("--num-kv-heads", type=count(1), default=8)
    p.add_argument("--head-dim", type=count(1), default=128)
    p.add_argument("--calls", type=count(1), default=300, help="calls per measurement")
    p.add_argument("--repeats", type=count(1), default=5,
                   help="measurements per row (the median is reported)")
    p.add_argument("--profile", default=None,
                   help="write the cProfile listing of every row to this file")
    p.add_argument("--json", default=None, help="write the rows as JSON to this file")
    p.set_defaults(func=run)
    return p


def time_calls(fn, calls: int) -> "tuple[float, float]":
    """``(host_us, wall_us)`` per call of ``calls`` calls back to back: host = wall clock
    before the final sync, wall = after it."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / calls * 1e6, (t2 - t0) / calls * 1e6


def measure_rows(rows, *, calls: int, repeats: int) -> list:
    """Median ``(host_us, wall_us)`` of each row, the rows measured round-robin (a drift
    of the host's speed during the run then touches every row alike)."""
    for _, fn in rows:
        for _ in range(10):  # warm-up: compiles, first-use plans
            fn()
    samples = [[] for _ in rows]
    for _ in range(repeats):
        for i, (_, fn) in enumerate(rows):
            samples[i].append(time_calls(fn, calls))
    result = []
    for s in samples:
        host = sorted(x[0] for x in s)
        wall = sorted(x[1] for x in s)
        result.append((host[len(host) // 2], wall[len(wall) // 2]))
    return result


def profile_listing(fn, *, calls: int, top: int = 25) -> str:
    import torch

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def run(args) -> int:
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench overhead needs a CUDA GPU (host cost of real launches)")
    from hygon_attn_backend.tools.bench import _overhead_cases as cases

    dev = torch.device("cuda")
    named = []  # (name, page, fn)
    rows = []
    for page in (int(x) for x in args.block_sizes.split(",")):
        shape = dict(num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads,
                     head_dim=args.head_dim, page_size=page, device=dev)
        for name, fn in cases.all_rows(**shape):
            if fn is None:
                rows.append(dict(row=name, page=page, host_us=None, wall_us=None))
            else:
                named.append((name, page, fn))
    timed = measure_rows([(n, f) for n, _, f in named], calls=args.calls,
                         repeats=args.repeats)
    for (name, page, fn), (host, wall) in zip(named, timed):
        rows.append(dict(row=name, page=page, host_us=host, wall_us=wall))
        if args.profile:
            with open(args.profile, "a") as f:
                f.write(f"\n## {name}, page {page}\n")
                f.write(profile_listing(fn, calls=args.calls))
    _print(rows, args)
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(dict(rows=rows, device=torch.cuda.get_device_name(),
                           torch=torch.__version__, triton=_triton_version()), f, indent=1)
    return 0


def _triton_version() -> str:
    import triton

    return triton.__version__


def _print(rows, args) -> None:
    import torch

    print(f"# host us per call ({args.calls} calls back to back, no sync; median of "
          f"{args.repeats}); {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"triton {_triton_version()}; Hq/Hkv {args.num_q_heads}/{args.num_kv_heads}, "
          f"D {args.head_dim}")
    print(f"# decode B={DECODE['num_seqs']} ctx {DECODE['ctx']}; extend B={EXTEND['num_seqs']} "
          f"prefix {EXTEND['prefix']} + {EXTEND['new']} new; mixed {MIXED['num_decodes']} "
          f"decodes + {MIXED['num_extends']} extends")
    pages = sorted({r["page"] for r in rows})
    names = list(dict.fromkeys(r["row"] for r in rows))
    print("| call | " + " | ".join(f"page {p}: host / wall us" for p in pages) + " |")
    print("| --- |" + " --- |" * len(pages))
    for name in names:
        cells = []
        for p in pages:
            r = next(x for x in rows if x["row"] == name and x["page"] == p)
            cells.append("not available" if r["host_us"] is None
                         else f"{r['host_us']:.1f} / {r['wall_us']:.1f}")
        print(f"| {name} | " + " | ".join(cells) + " |")
