"""``hygon-attn bench decode``: paged decode KV-read GB/s against an in-run device copy.

Decode reads each cached K/V byte once: ``2 * sum(seq_lens) * Hkv * D * elem`` bytes per
call (q and out are < 0.1% of it at these sizes). Achieved GB/s is those bytes over the
median time of the op replayed in a CUDA graph (as the engines run decode); 100% is a
device-to-device copy of a 2 GiB buffer measured in the same run, counting bytes read
plus bytes written. Pages are shuffled (a random permutation of the cache's blocks).

Points per (B, ctx) shape and page size: the shipped heuristic, the DCU baseline rule,
an optional sweep of forced partition sizes and tile configs, and the per-query-head
variant of the same kernel (KV-head grid off). A G sweep at one shape varies the KV
heads at a fixed query head count.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEFAULT_SHAPES = "1,32768;1,131072;8,8192;64,4096;64,16384;256,2048"
COPY_BYTES = 2 << 30


def kv_bytes(seq_lens, num_kv_heads: int, head_dim: int, elem_size: int) -> int:
    """Bytes of K and V one decode call must read."""
    return 2 * sum(seq_lens) * num_kv_heads * head_dim * elem_size


def _parse_pairs(text: str):
    out = []
    for part in text.split(";"):
        if part.strip():
            out.append(tuple(int(x) for x in part.split(",")))
    return out


def _parse_partitions(text: str):
    """``auto`` (shipped heuristic), ``dcu`` (baseline rule), ``none`` (one partition), or
    an integer partition size."""
    items = []
    for part in text.split(","):
        part = part.strip()
        if part:
            items.append(part if part in ("auto", "dcu", "none") else int(part))
    return items


def add_decode_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``decode`` on an argparse ``subparsers`` object; returns the parser."""
    p = subparsers.add_parser("decode", help="paged decode KV-read GB/s vs an in-run copy")
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help="';'-separated B,ctx pairs (default: issue 3's six)")
    p.add_argument("--block-sizes", default="16,64", help="page sizes, comma-separated")
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--layout", default="bshd", choices=["bshd", "bhsd"],
                   help="cache storage order (bshd: vLLM flash / SGLang; bhsd: DCU)")
    p.add_argument("--partitions", default="auto,dcu",
                   help="comma list: auto, dcu, none or a partition size")
    p.add_argument("--tiles", default="",
                   help="';'-separated BLOCK_N,warps,stages[,prefetch 0/1] to sweep "
                        "(default: heuristic)")
    p.add_argument("--group-shape", default="64,4096", help="B,ctx of the G sweep")
    p.add_argument("--groups", default="1,8,16",
                   help="GQA groups of the G sweep (Hq fixed, Hkv = Hq / G); '' skips it")
    p.add_argument("--per-head-groups", default="8",
                   help="groups at which the per-query-head variant is also timed")
    p.add_argument("--rep-ms", type=float, default=60.0, help="timed milliseconds per point")
    p.add_argument("--json", default="", help="write all results to this JSON file")
    p.add_argument("--markdown", default="", help="write the table to this file")
    p.set_defaults(func=_cli, bench_func=_cli)
    return p


def _cli(args) -> int:
    run_decode_bench(args)
    return 0


def _time_graph(fn, rep_ms):
    import triton
    return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")


def copy_gbps(rep_ms: float):
    """Device-to-device copy bandwidth (bytes read + written) in GB/s, and its ms: the
    best of ``torch`` ``copy_`` timed eagerly and replayed in a CUDA graph (a graph may
    turn the copy into a memcpy node that runs slower), so 100% is the faster copy."""
    import torch
    import triton
    src = torch.randn(COPY_BYTES // 4, device="cuda", dtype=torch.float32)
    dst = torch.empty_like(src)
    fn = lambda: dst.copy_(src)
    eager = triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median")
    graph = _time_graph(fn, rep_ms)
    ms = min(eager, graph)
    nbytes = 2 * src.numel() * src.element_size()
    print(f"copy of {COPY_BYTES >> 30} GiB: eager {nbytes / eager / 1e6:.0f} GB/s, graph "
          f"{nbytes / graph / 1e6:.0f} GB/s")
    del src, dst
    return nbytes / ms / 1e6, ms


def _build(batch, ctx, page, hq, hkv, dim, dtype, layout, seed=0):
    import torch
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per = -(-ctx // page)
    nb = batch * blocks_per
    if layout == "bshd":
        k = torch.randn(nb, page, hkv, dim, device="cuda", dtype=dtype, generator=gen)
        v = torch.randn(nb, page, hkv, dim, device="cuda", dtype=dtype, generator=gen)
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    else:
        k = torch.randn(nb, hkv, page, dim, device="cuda", dtype=dtype, generator=gen)
        v = torch.randn(nb, hkv, page, dim, device="cuda", dtype=dtype, generator=gen)
    perm = torch.randperm(nb, device="cuda", generator=gen)
    table = perm.reshape(batch, blocks_per).to(torch.int32)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, hq, dim, device="cuda", dtype=dtype, generator=gen)
    return q, k, v, table, lens


def _set_tile_env(tile):
    names = ("HYGON_ATTN_DECODE_BLOCK_N", "HYGON_ATTN_DECODE_WARPS", "HYGON_ATTN_DECODE_STAGES",
             "HYGON_ATTN_DECODE_PREFETCH")
    tile = tuple(tile or ()) + (None,) * (len(names) - len(tile or ()))
    for name, val in zip(names, tile):
        if val is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = str(val)


def _point(q, k, v, table, lens, *, partition, tile, kv_head_grid, rep_ms, nbytes, copy):
    """Time one configuration; returns a result dict (or an error entry)."""
    import torch
    from hygon_attn_backend import tuning
    from hygon_attn_backend.ops.decode import (allocate_decode_workspace, decode_launch_config,
                                               num_sms_of, paged_decode_attention)
    batch, hq, dim = q.shape
    hkv, page = k.shape[1], k.shape[2]
    max_ctx = table.shape[1] * page
    _set_tile_env(tile)
    rule = "dcu" if partition == "dcu" else "measured"
    if partition in ("auto", "dcu"):
        size = tuning.decode_partition_size(num_seqs=batch, num_kv_heads=hkv, group=hq // hkv,
                                            max_context_len=max_ctx,
                                            num_sms=num_sms_of(q.device), rule=rule)
    elif partition == "none":
        size = -(-max_ctx // 16) * 16
    else:
        size = int(partition)
    cfg = decode_launch_config(num_seqs=batch, num_q_heads=hq, num_kv_heads=hkv, num_tokens=1,
                               head_dim=dim, page_size=page, kv_elem_size=k.element_size(),
                               max_context_len=max_ctx, num_sms=num_sms_of(q.device),
                               partition_size=size, kv_head_grid=kv_head_grid)
    entry = {"page": page, "partition": partition, "partition_size": size,
             "num_partitions": cfg.num_partitions, "kv_head_grid": kv_head_grid,
             "tile": [cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages,
                      int(cfg.page_prefetch)]}
    try:
        ws = allocate_decode_workspace(max_num_seqs=batch, num_q_heads=hq, num_kv_heads=hkv,
                                       head_dim=dim, max_context_len=max_ctx, device=q.device,
                                       partition_size=size)
        out = torch.empty_like(q)
        fn = lambda: paged_decode_attention(q, k, v, table, lens, out=out, workspace=ws,
                                            partition_size=size, kv_head_grid=kv_head_grid)
        fn()
        torch.cuda.synchronize()
        ms = _time_graph(fn, rep_ms)
    except Exception as exc:  # e.g. out of resources for a swept tile
        entry["error"] = f"{type(exc).__name__}: {exc}"[:200]
        return entry
    finally:
        _set_tile_env(None)
    gbps = nbytes / ms / 1e6
    entry.update(ms=ms, gbps=gbps, pct_copy=100 * gbps / copy)
    return entry


def run_decode_bench(args) -> dict:
    """Run the decode benchmark described by ``args`` (see :func:`add_decode_parser`);
    print a markdown table and return all numbers as a dict."""
    import torch
    import triton

    if not torch.cuda.is_available():
        print("bench decode needs a CUDA GPU", file=sys.stderr)
        return {}
    dtype = getattr(torch, args.dtype)
    hq, hkv, dim = args.num_q_heads, args.num_kv_heads, args.head_dim
    pages = [int(x) for x in str(args.block_sizes).split(",") if x]
    partitions = _parse_partitions(args.partitions)
    tiles = _parse_pairs(args.tiles) or [None]
    per_head_groups = {int(x) for x in str(args.per_head_groups).split(",") if x}
    copy, copy_ms = copy_gbps(args.rep_ms)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__,
              "copy_gbps": copy, "dtype": args.dtype, "num_q_heads": hq,
              "num_kv_heads": hkv, "head_dim": dim, "layout": args.layout, "rows": []}
    print(f"# decode bench: {result['gpu']}, torch {torch.__version__}, triton "
          f"{triton.__version__}, {args.dtype}, Hq={hq}, Hkv={hkv}, D={dim}, {args.layout}")
    print(f"device copy: {copy:.0f} GB/s ({copy_ms:.3f} ms for {COPY_BYTES >> 30} GiB) = 100%")

    jobs = [(b, c, hq, hkv) for b, c in _parse_pairs(args.shapes)]
    if args.groups:
        gb, gc = _parse_pairs(args.group_shape)[0]
        jobs += [(gb, gc, hq, hq // int(g)) for g in str(args.groups).split(",") if g]
    for batch, ctx, jhq, jhkv in jobs:
        group = jhq // jhkv
        nbytes = kv_bytes([ctx] * batch, jhkv, dim, torch.empty((), dtype=dtype).element_size())
        row = {"batch": batch, "ctx": ctx, "num_q_heads": jhq, "num_kv_heads": jhkv,
               "group": group, "mbytes": nbytes / 1e6, "points": []}
        for page in pages:
            q, k, v, table, lens = _build(batch, ctx, page, jhq, jhkv, dim, dtype, args.layout)
            common = dict(rep_ms=args.rep_ms, nbytes=nbytes, copy=copy)
            for partition in partitions:
                for tile in tiles:
                    row["points"].append(_point(q, k, v, table, lens, partition=partition,
                                                tile=tile, kv_head_grid=True, **common))
            if group in per_head_groups:  # same partition choices: best against best
                for partition in partitions:
                    row["points"].append(_point(q, k, v, table, lens, partition=partition,
                                                tile=None, kv_head_grid=False, **common))
            del q, k, v, table, lens
            torch.cuda.empty_cache()
        result["rows"].append(row)
        print(format_table({"copy_gbps": copy, "rows": [row]}, header=False), flush=True)
    table_md = format_table(result)
    print(table_md)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(table_md + "\n")
    return result


def format_table(result: dict, header: bool = True) -> str:
    """Markdown table: one line per (shape, page, partition rule, tile, variant)."""
    lines = []
    if header:
        lines += [f"device copy: {result['copy_gbps']:.0f} GB/s (100%)", "",
                  "| B | ctx | Hq/Hkv | page | variant | partition (n) | tile M,N,w,s,pf | us | "
                  "GB/s | % copy |", "|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        head = f"| {row['batch']} | {row['ctx']} | {row['num_q_heads']}/{row['num_kv_heads']}"
        for p in row["points"]:
            variant = "kv-head grid" if p["kv_head_grid"] else "per-q-head"
            part = f"{p['partition']}:{p['partition_size']} ({p['num_partitions']})"
            tile = ",".join(str(x) for x in p["tile"])
            if "error" in p:
                lines.append(f"{head} | {p['page']} | {variant} | {part} | {tile} | "
                             f"error: {p['error'][:60]} | | |")
                continue
            lines.append(f"{head} | {p['page']} | {variant} | {part} | {tile} | "
                         f"{1000 * p['ms']:.1f} | {p['gbps']:.0f} | {p['pct_copy']:.1f} |")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hygon-attn-bench-decode")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_decode_parser(sub)
    args = parser.parse_args(["decode"] + list(argv if argv is not None else sys.argv[1:]))
    return run_decode_bench(args)


if __name__ == "__main__":
    main()
