"""Where a split decode's time goes, Triton and native side by side (a GPU).

For each shape and each (impl, partition count, native tile) the call is captured in a
CUDA graph and timed as ``bench decode`` times it (median replay, the L2 cleared before
each by do_bench's write and by a read), then replayed ``--profile`` times under
``torch.profiler`` with the L2 cleared by a read before each replay: the mean device time
of each kernel in the graph (the decode kernel, the combine kernel) and their sum. The
difference between a replay and its kernels' sum is what the graph spends between them
(the decode grid's drain, the combine's launch and ramp). 100% is the device copy
measured in the same run (bytes read + written); the KV bytes are read once.

Usage: python scripts/decode_split_profile.py [--rep-ms 100] [--profile 20] [--json out.json]
           [--cases "8,8192,32,8:triton:0;8,8192,32,8:native:4:64;..."]
A case is B,ctx,Hq,Hkv:impl:partitions[:native tile[:NAME=VALUE,...]]; partitions 0: the
impl's own rule, tile 0 or empty: the default; the last field sets environment variables
for that case only (e.g. ``HYGON_ATTN_DECODE_PDL=0``), read when it is planned;
a name ``tuning.NAME`` sets that module constant of ``hygon_attn_backend.tuning`` instead.
The case ``noop`` times a graph of one 4-byte kernel the same way: the floor of any call
under this method (the graph's launch, the kernel's, the flush's write-back).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton

from hygon_attn_backend import tuning
from hygon_attn_backend.bench import _timing
from hygon_attn_backend.bench._timing import copy_ceiling
from hygon_attn_backend.ops.decode import allocate_decode_workspace, paged_decode_attention

from bench_native_decode import build  # scripts/ is on the path when a script runs

DEFAULT_CASES = ";".join(
    [f"1,32768,32,8:{c}" for c in ("triton:0", "native:0", "native:16", "native:32", "native:64",
                                   "native:32:32", "native:64:32")] +
    [f"8,8192,32,8:{c}" for c in ("triton:0", "triton:4", "native:0", "native:4", "native:8",
                                  "native:16", "native:8:32", "native:16:32")] +
    [f"1,131072,32,8:{c}" for c in ("triton:0", "native:0", "native:32", "native:64",
                                    "native:64:32")])


def kernel_times(graph, reps: int):
    """Mean device microseconds per replay of each kernel of ``graph`` (read flush first)."""
    flush = _timing.read_flush()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush()
            graph.replay()
        torch.cuda.synchronize()
    times = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = ev.name
        if "reduce" in name.lower() or "amax" in name.lower():
            continue  # the flush
        times[name] = times.get(name, 0.0) + ev.device_time_total / reps
    return times


def run_case(shape, impl, parts, tile, rep_ms, prof_reps, copy, env=None):
    env = dict(env or {})
    consts = {k[len("tuning."):]: int(env.pop(k)) for k in list(env) if k.startswith("tuning.")}
    saved = {name: os.environ.get(name) for name in env}
    saved_consts = {name: getattr(tuning, name) for name in consts}
    os.environ.update(env)
    for name, value in consts.items():
        setattr(tuning, name, value)
    try:
        return _run_case(shape, impl, parts, tile, rep_ms, prof_reps, copy)
    finally:
        for name, value in saved_consts.items():
            setattr(tuning, name, value)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _run_case(shape, impl, parts, tile, rep_ms, prof_reps, copy):
    batch, ctx, hq, hkv = shape
    q, k, v, table, lens = build(batch, ctx, hq, hkv)
    nbytes = 2 * batch * ctx * hkv * q.shape[-1] * k.element_size()
    ws = allocate_decode_workspace(max_num_seqs=batch, num_q_heads=hq, num_kv_heads=hkv,
                                   head_dim=q.shape[-1], max_context_len=ctx, device="cuda",
                                   num_slots=batch * 256)
    if tile:
        os.environ["HYGON_ATTN_NATIVE_TILE"] = str(tile)
    else:
        os.environ.pop("HYGON_ATTN_NATIVE_TILE", None)
    size = -(-ctx // parts) if parts else None
    out = torch.empty_like(q)
    fn = lambda: paged_decode_attention(q, k, v, table, lens, out=out, workspace=ws, impl=impl,
                                        partition_size=size)
    row = {"shape": list(shape), "impl": impl, "parts": parts, "tile": tile}
    for flush in ("write", "read"):
        _timing.set_l2_flush(flush)
        ms = _timing.graph_ms(fn, rep_ms)
        row[flush] = {"us": 1000 * ms, "pct_copy": 100 * nbytes / ms / 1e6 / copy}
    graph = _timing.capture_graph(fn)
    row["kernels_us"] = kernel_times(graph, prof_reps)
    del graph
    ref = paged_decode_attention(q, k, v, table, lens, impl="reference")
    row["max_abs_diff"] = float((out.float() - ref.float()).abs().max())
    os.environ.pop("HYGON_ATTN_NATIVE_TILE", None)
    return row


def run_noop(rep_ms, prof_reps):
    x = torch.zeros(1, device="cuda")
    fn = lambda: x.add_(1)
    row = {"shape": [], "impl": "noop", "parts": 0, "tile": 0}
    for flush in ("write", "read"):
        _timing.set_l2_flush(flush)
        row[flush] = {"us": 1000 * _timing.graph_ms(fn, rep_ms), "pct_copy": 0.0}
    graph = _timing.capture_graph(fn)
    row["kernels_us"] = kernel_times(graph, prof_reps)
    row["max_abs_diff"] = 0.0
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rep-ms", type=float, default=100)
    parser.add_argument("--profile", type=int, default=20, help="profiled replays a case")
    parser.add_argument("--cases", default=DEFAULT_CASES)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    _timing.set_l2_flush("write")
    copy, _ = copy_ceiling(args.rep_ms)
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, triton "
          f"{triton.__version__}; copy {copy:.0f} GB/s (write flush)", flush=True)
    rows = []
    for case in args.cases.split(";"):
        if case == "noop":
            row = run_noop(args.rep_ms, args.profile)
            rows.append(row)
            print(f"noop (one 4-byte kernel)    write {row['write']['us']:7.1f} us | read "
                  f"{row['read']['us']:7.1f} us | kernels {sum(row['kernels_us'].values()):.1f} us",
                  flush=True)
            continue
        parts = case.split(":")
        if len(parts) not in (3, 4, 5):
            parser.error(f"--cases: B,ctx,Hq,Hkv:impl:partitions[:tile[:NAME=VALUE,...]], "
                         f"got {case!r}")
        shape = tuple(int(x) for x in parts[0].split(","))
        tile = int(parts[3]) if len(parts) >= 4 and parts[3] else 0
        env = dict(kv.split("=", 1) for kv in parts[4].split(",")) if len(parts) == 5 else {}
        row = run_case(shape, parts[1], int(parts[2]), tile, args.rep_ms, args.profile, copy,
                       env)
        row["env"] = env
        rows.append(row)
        kern = ", ".join(f"{name[:40]} {us:.1f}" for name, us in sorted(
            row["kernels_us"].items(), key=lambda kv: -kv[1]))
        print(f"{case:28s} write {row['write']['us']:7.1f} us {row['write']['pct_copy']:5.1f}% | "
              f"read {row['read']['us']:7.1f} us {row['read']['pct_copy']:5.1f}% | kernels "
              f"(read flush) sum {sum(row['kernels_us'].values()):6.1f}: {kern} | "
              f"max|diff| {row['max_abs_diff']:.1e}", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_gbps": copy, "rows": rows, "device": torch.cuda.get_device_name(0),
                       "torch": torch.__version__, "triton": triton.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
