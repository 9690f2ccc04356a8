"""Paged decode, Triton against native (csrc/), on a GPU: KV-read GB/s and % of copy.

Method (the project's): each op is captured in a CUDA graph and the graph replay is timed
as ``bench decode`` times it (median; the L2 cleared before every replay by do_bench's
write, or by a read with ``--l2-flush read``), on a cache
whose pages are a random permutation of its blocks; 100% is a device-to-device copy
(bytes read + written) measured in the same run. KV bytes = 2 * sum(seq_len) * Hkv * D *
elem_size. Each implementation plans its own split (Triton: ``tuning.decode_partition_size``,
native: ``tuning.native_decode_partition_size``), except ``native_tparts``: native on the
Triton rule's partition size.

Usage: python scripts/bench_native_decode.py [--rep-ms 200] [--json out.json]
           [--l2-flush write|read] [--shapes "1,32768,32,8;..."] [--variants triton,native,...]
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import triton

from hygon_attn_backend.bench import _timing
from hygon_attn_backend.bench._timing import copy_ceiling
from hygon_attn_backend import tuning
from hygon_attn_backend.ops.decode import allocate_decode_workspace, paged_decode_attention
from hygon_attn_backend.ops.decode_plan import plan_paged_decode

# (batch, context, Hq, Hkv): G = 1 (32/32), G = 4 (32/8), G = 8 (32/4), G = 16 (64/4)
HEADS = ((32, 32), (32, 8), (32, 4), (64, 4))
# native: the planned loop (tuning.native_decode_stages / native_decode_tile), split and
# combine launch; native_nopdl: the same with the combine as a plain launch
# (HYGON_ATTN_DECODE_PDL=0); native_t32 / native_t32_s2: the split-N loop's 32-token tiles
# with 3 / 2 cp.async stages; native_tparts: the planned loop on the Triton rule's partitions;
# native_s2 / native_s3: the planned partitions with 2 / 3 stages of the 64-token loop
VARIANTS = ("triton", "native", "native_nopdl", "native_t32", "native_t32_s2", "native_tparts",
            "native_s2", "native_s3")
ENV = {"native": ("", "", "", ""), "native_nopdl": ("", "", "", "0"),
       "native_t32": ("1", "3", "32", ""), "native_t32_s2": ("1", "2", "32", ""),
       "native_tparts": ("", "", "", ""), "native_s2": ("1", "2", "64", ""),
       "native_s3": ("1", "3", "64", ""),
       "triton": ("", "", "", "")}  # (SPLIT_N, STAGES, TILE, DECODE_PDL); "": unset
ENV_NAMES = ("HYGON_ATTN_NATIVE_SPLIT_N", "HYGON_ATTN_NATIVE_STAGES", "HYGON_ATTN_NATIVE_TILE",
             "HYGON_ATTN_DECODE_PDL")
SHAPES = [(b, c, hq, hkv) for b, c in ((64, 4096), (64, 16384), (256, 2048), (1, 32768))
          for hq, hkv in HEADS] + [(8, 8192, 32, 8), (1, 131072, 32, 8)]


def build(batch, ctx, hq, hkv, *, dim=128, page=16, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    nb = batch * -(-ctx // page)
    k = torch.randn(nb, page, hkv, dim, device="cuda", dtype=dtype, generator=gen)
    v = torch.randn(nb, page, hkv, dim, device="cuda", dtype=dtype, generator=gen)
    table = torch.randperm(nb, device="cuda", generator=gen).reshape(batch, -1).to(torch.int32)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, hq, dim, device="cuda", dtype=dtype, generator=gen)
    return q, k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), table, lens


def native_partitions(batch, ctx, hq, hkv, q, k, ws) -> int:
    """Partitions of the native plan for this shape with this workspace."""
    table = torch.zeros(batch, -(-ctx // 16), dtype=torch.int32, device="cuda")
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    plan = plan_paged_decode(table, lens, num_q_heads=hq, num_kv_heads=hkv,
                             head_dim=q.shape[-1], page_size=16, q_dtype=q.dtype,
                             kv_dtype=k.dtype, workspace=ws, impl="native")
    return plan.config.num_partitions


def time_graph_replay(fn, rep_ms):
    """Median ms of a CUDA-graph replay of ``fn``, the L2 cleared before each replay
    (``bench._timing``: do_bench's write, or a read with ``--l2-flush read``)."""
    return _timing.graph_ms(fn, rep_ms)


def run(rep_ms: float, variants=VARIANTS, shapes=None, dtype=torch.bfloat16):
    copy, _ = copy_ceiling(rep_ms)
    rows = []
    for batch, ctx, hq, hkv, *dim in shapes or SHAPES:
        q, k, v, table, lens = build(batch, ctx, hq, hkv, dim=dim[0] if dim else 128, dtype=dtype)
        # K and V of every token, read once
        nbytes = 2 * batch * ctx * hkv * q.shape[-1] * k.element_size()
        ws = allocate_decode_workspace(max_num_seqs=batch, num_q_heads=hq, num_kv_heads=hkv,
                                       head_dim=q.shape[-1], max_context_len=table.shape[1] * 16,
                                       device=q.device)
        row = {"batch": batch, "ctx": ctx, "hq": hq, "hkv": hkv, "group": hq // hkv,
               "head_dim": q.shape[-1], "dtype": str(q.dtype)}
        triton_size = tuning.decode_partition_size(
            num_seqs=batch, num_kv_heads=hkv, group=hq // hkv, max_context_len=ctx,
            num_sms=torch.cuda.get_device_properties(0).multi_processor_count)
        triton_size = None if triton_size >= ctx else triton_size  # None: unsplit
        outs = {}
        for variant in variants:
            impl = "native" if variant.startswith("native") else variant
            for name, value in zip(ENV_NAMES, ENV[variant]):
                if value:
                    os.environ[name] = value
                else:
                    os.environ.pop(name, None)
            size = triton_size if variant == "native_tparts" else None
            if variant == "native":  # its plan's split (the environment now unset)
                row["native_partitions"] = native_partitions(batch, ctx, hq, hkv, q, k, ws)
            out = torch.empty_like(q)
            outs[variant] = out
            # defaults bind this shape's tensors (the loop deletes them before the next)
            fn = lambda q=q, k=k, v=v, table=table, lens=lens, out=out, ws=ws, impl=impl, \
                size=size: paged_decode_attention(q, k, v, table, lens, out=out, workspace=ws,
                                                  impl=impl, partition_size=size)
            ms = time_graph_replay(fn, rep_ms)
            gbps = nbytes / ms / 1e6
            row[variant] = {"us": 1000 * ms, "gbps": gbps, "pct_copy": 100 * gbps / copy}
        row["native_over_triton"] = row["triton"]["us"] / row["native"]["us"]
        row["max_abs_diff"] = max(float((outs[v].float() - outs["triton"].float()).abs().max())
                                  for v in variants if v != "triton")
        rows.append(row)
        print(f"B={batch:4d} ctx={ctx:6d} G={hq // hkv:2d} ({hq}/{hkv}) D={q.shape[-1]} | triton "
              f"{row['triton']['us']:8.1f} us {row['triton']['gbps']:6.0f} GB/s "
              f"{row['triton']['pct_copy']:5.1f}% | native {row['native']['us']:8.1f} us "
              f"{row['native']['gbps']:6.0f} GB/s {row['native']['pct_copy']:5.1f}% | "
              f"native/triton speed {row['native_over_triton']:.2f}x "
              f"({row['native_partitions']} parts) | " +
              ", ".join(f"{v[7:]} {row[v]['us']:.1f} us {row[v]['pct_copy']:.1f}%"
                        for v in variants[2:]) +
              f" | max|diff| {row['max_abs_diff']:.2e}",
              flush=True)
        del q, k, v, table, lens, ws, outs
        torch.cuda.empty_cache()
    return {"copy_gbps": copy, "rows": rows, "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__, "triton": triton.__version__}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rep-ms", type=float, default=200)
    parser.add_argument("--json", default=None)
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated subset of " + ", ".join(VARIANTS) +
                        " (triton and native first)")
    parser.add_argument("--l2-flush", choices=_timing.L2_FLUSHES, default="write",
                        help="how the L2 is cleared before each replay (bench decode's option)")
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument("--shapes", default=None,
                        help="';'-separated B,ctx,Hq,Hkv[,D] (default: the 18 shapes above, D 128)")
    args = parser.parse_args()
    _timing.set_l2_flush(args.l2_flush)
    dtype = getattr(torch, args.dtype)
    shapes = [tuple(int(x) for x in item.split(",")) for item in args.shapes.split(";")] \
        if args.shapes else None
    if shapes and any(len(s) not in (4, 5) for s in shapes):
        parser.error("--shapes: B,ctx,Hq,Hkv[,D] items separated by ';'")
    variants = tuple(args.variants.split(","))
    if variants[:2] != ("triton", "native") or not set(variants) <= set(VARIANTS):
        parser.error(f"--variants must start with triton,native and name only {VARIANTS}")
    result = run(args.rep_ms, variants, shapes, dtype)
    result["l2_flush"] = args.l2_flush
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
