"""What the split decode's combine costs inside a replayed graph (Triton path, a GPU).

For each shape the same plan is timed four ways, each as a CUDA-graph replay with the L2
cleared before it (``bench._timing``, both flushes): the whole call (decode kernel +
combine kernel, the combine a programmatic dependent launch where the plan says so), the
decode kernel alone (its partials written, never merged: a diagnostic, the output is not
the answer), the combine kernel alone (it merges the partials the last decode left), and
the fused form (the last program of each (sequence, KV head) merges: one launch). Forced
partition counts (``--parts``) are timed beside the rule's. 100% is the device copy
measured in the same run (bytes read + written); the KV bytes are read once.

Usage: python scripts/decode_combine_cost.py [--rep-ms 50] [--shapes "1,32768,32,8;..."]
           [--parts "8,8192:4,16;1,32768:32,128"] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from hygon_attn_backend.bench import _timing
from hygon_attn_backend.bench._timing import copy_ceiling
from hygon_attn_backend.ops.decode import allocate_decode_workspace, plan_paged_decode
from hygon_attn_backend.ops.decode_plan import DecodeLayer

from bench_native_decode import build  # scripts/ is on the path when a script runs

DEFAULT_SHAPES = "1,32768,32,8;8,8192,32,8;1,131072,32,8;64,4096,64,4"


def forms(plan, layer, q, out):
    """(name, fn) of the plan's call, its decode kernel alone and its combine alone."""
    plan.run_layer(layer, q, out)  # builds the launches
    key, (decode, combine) = next(iter(plan._variants.items()))
    yield "call", lambda: plan.run_layer(layer, q, out)
    if combine is None:
        return
    qs, os_ = q.stride(), out.stride()
    qs, os_ = (qs[0], 0, qs[1], qs[2]), (os_[0], 0, os_[1], os_[2])
    yield "decode only", lambda: decode(layer.args, out, q, *qs, *os_)
    from hygon_attn_backend.ops._launch import NO_LAYER

    yield "combine only", lambda: combine(NO_LAYER, out, *os_)


def time_shape(batch, ctx, hq, hkv, parts_list, rep_ms, copy_gbps):
    q, kc, vc, table, lens = build(batch, ctx, hq, hkv)  # bhsd views of bshd pages
    nbytes = 2 * batch * ctx * hkv * q.shape[-1] * kc.element_size()
    ws = allocate_decode_workspace(max_num_seqs=batch, num_q_heads=hq, num_kv_heads=hkv,
                                   head_dim=q.shape[-1], max_context_len=ctx, device="cuda",
                                   num_slots=batch * (256 if batch <= 8 else 16))
    layer = DecodeLayer(kc, vc)
    rows = []
    ref = None
    for parts in [None] + list(parts_list):
        size = None if parts is None else -(-ctx // parts)
        for fused in (False, True):
            plan = plan_paged_decode(table, lens, num_q_heads=hq, num_kv_heads=hkv,
                                     head_dim=q.shape[-1], page_size=16, q_dtype=q.dtype,
                                     kv_dtype=kc.dtype, max_seq_len=ctx, workspace=ws,
                                     partition_size=size, fused_combine=fused, impl="triton")
            if fused and not plan.fused_combine:
                continue  # unsplit: nothing to fuse
            out = torch.empty_like(q)
            for name, fn in forms(plan, layer, q, out):
                label = "fused call" if fused else name
                ms = _timing.graph_ms(fn, rep_ms)
                row = {"batch": batch, "ctx": ctx, "hq": hq, "hkv": hkv,
                       "parts": plan.config.num_partitions,
                       "rule": parts is None, "pdl": plan.pdl, "form": label,
                       "us": 1000 * ms, "pct_copy": 100 * nbytes / ms / 1e6 / copy_gbps}
                if name == "call":
                    plan.run_layer(layer, q, out)
                    torch.cuda.synchronize()
                    ref = out.clone() if ref is None else ref
                    row["max_abs_diff"] = float((out.float() - ref.float()).abs().max())
                rows.append(row)
                print(f"B={batch:4d} ctx={ctx:6d} {hq}/{hkv} parts {row['parts']:3d}"
                      f"{' (rule)' if parts is None else '       '} pdl={int(plan.pdl)} "
                      f"{label:13s} {row['us']:8.1f} us {row['pct_copy']:6.1f}%"
                      + (f"  max|diff| {row['max_abs_diff']:.1e}" if 'max_abs_diff' in row
                         else ""), flush=True)
    del q, kc, vc, table, lens, ws
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rep-ms", type=float, default=50)
    ap.add_argument("--shapes", default=DEFAULT_SHAPES)
    ap.add_argument("--parts", default="", help="B,ctx:P1,P2;... forced partition counts")
    ap.add_argument("--json")
    args = ap.parse_args()
    forced = {}
    for item in filter(None, args.parts.split(";")):
        shape, counts = item.split(":")
        forced[tuple(int(x) for x in shape.split(","))] = [int(x) for x in counts.split(",")]
    result = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "triton": triton.__version__, "runs": {}}
    for flush in _timing.L2_FLUSHES:
        _timing.set_l2_flush(flush)
        copy, _ = copy_ceiling(args.rep_ms)
        print(f"## L2 flush: {flush}; copy {copy:.0f} GB/s", flush=True)
        rows = []
        for spec in args.shapes.split(";"):
            b, c, hq, hkv = (int(x) for x in spec.split(","))
            rows += time_shape(b, c, hq, hkv, forced.get((b, c), []), args.rep_ms, copy)
        result["runs"][flush] = {"copy_gbps": copy, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
