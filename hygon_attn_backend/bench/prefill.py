"""``hygon-attn bench prefill``: prefix-prefill TFLOP/s against an in-run bf16 matmul.

For each ``(B, prefix, extend)`` shape the kernel runs over a paged cache (pages shuffled,
every key of a request in the cache as vLLM passes them, or ``--kv-source dense`` for the
new tokens' K/V as SGLang passes them), for each page size. Work is counted as the
unmasked FLOPs only: ``4 * D * Hq * (extend * prefix + extend * (extend + 1) / 2)`` per
request. The same run measures a bf16 ``8192^3`` matmul (100%) and dense causal SDPA
(cuDNN and flash backends, K/V expanded to all query heads, bottom-right causal mask) on
the same lengths, as a ceiling.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from hygon_attn_backend.bench._timing import median_ms

DEFAULT_SHAPES = "1,0,8192;1,4096,4096;8,2048,512;32,1024,128;4,16384,1024"


def prefill_flops(batch: int, prefix: int, extend: int, num_q_heads: int, head_dim: int,
                  causal: bool = True) -> float:
    """Unmasked FLOPs (QK^T and PV, 2 FLOPs per multiply-add) of ``batch`` equal requests."""
    if causal:
        pairs = extend * prefix + extend * (extend + 1) / 2
    else:
        pairs = extend * (prefix + extend)
    return 4.0 * head_dim * num_q_heads * pairs * batch


def _parse_shapes(text: str):
    shapes = []
    for part in text.split(";"):
        part = part.strip()
        if part:
            b, p, e = (int(x) for x in part.split(","))
            shapes.append((b, p, e))
    return shapes


def _parse_tiles(text):
    if not text:
        return [None]
    return [None if part.strip() == "default" else tuple(int(x) for x in part.split(","))
            for part in text.split(";") if part.strip()]


def add_prefill_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``prefill`` on an argparse ``subparsers`` object; returns the parser."""
    p = subparsers.add_parser("prefill", help="prefix-prefill TFLOP/s vs matmul and SDPA")
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   help="';'-separated B,prefix,extend triples (default: issue 4's five)")
    p.add_argument("--block-sizes", default="16,64", help="page sizes, comma-separated")
    p.add_argument("--num-q-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--kv-source", default="cache", choices=["cache", "dense", "both"],
                   help="new tokens' K/V from the cache (vLLM) or dense tensors (SGLang)")
    p.add_argument("--tiles", default="",
                   help="';'-separated BLOCK_M,BLOCK_N,warps,stages configs to sweep, "
                        "'default' for the tuning heuristic (the default)")
    p.add_argument("--no-peers", action="store_true", help="skip the SDPA peers")
    p.add_argument("--rep-ms", type=float, default=100.0, help="timed milliseconds per point")
    p.add_argument("--json", default="", help="write all results to this JSON file")
    p.add_argument("--markdown", default="", help="write the table to this file")
    p.set_defaults(func=run_prefill_bench)
    return p


def _matmul_tflops(rep_ms):
    import torch
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = median_ms(lambda: a @ b, rep_ms)
    return 2.0 * n ** 3 / ms / 1e9, ms


def _build_batch(batch, prefix, extend, page, hq, hkv, dim, dtype, gen_seed=0):
    """Shuffled paged cache holding every request's prefix + new keys; packed q."""
    import torch
    gen = torch.Generator(device="cuda").manual_seed(gen_seed)
    len_k = prefix + extend
    blocks_per = -(-len_k // page)
    num_blocks = batch * blocks_per
    k_cache = torch.randn(num_blocks, hkv, page, dim, device="cuda", dtype=dtype, generator=gen)
    v_cache = torch.randn(num_blocks, hkv, page, dim, device="cuda", dtype=dtype, generator=gen)
    perm = torch.randperm(num_blocks, device="cuda", generator=gen)
    block_table = perm.reshape(batch, blocks_per).to(torch.int32)
    total_q = batch * extend
    q = torch.randn(total_q, hq, dim, device="cuda", dtype=dtype, generator=gen)
    k_new = torch.randn(total_q, hkv, dim, device="cuda", dtype=dtype, generator=gen)
    v_new = torch.randn(total_q, hkv, dim, device="cuda", dtype=dtype, generator=gen)
    cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * extend
    lens_k = torch.full((batch,), len_k, device="cuda", dtype=torch.int32)
    return q, k_cache, v_cache, block_table, cu, lens_k, k_new, v_new


def _sdpa_ms(backend_name, batch, prefix, extend, hq, dim, dtype, rep_ms):
    """Dense causal SDPA (bottom-right mask) on the same lengths, or None if refused."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}[backend_name]
    len_k = prefix + extend
    q = torch.randn(batch, hq, extend, dim, device="cuda", dtype=dtype)
    k = torch.randn(batch, hq, len_k, dim, device="cuda", dtype=dtype)
    v = torch.randn(batch, hq, len_k, dim, device="cuda", dtype=dtype)
    if prefix == 0:
        variants = [("is_causal", dict(is_causal=True))]
    else:
        from torch.nn.attention.bias import causal_lower_right
        bool_mask = torch.ones(extend, len_k, device="cuda", dtype=torch.bool).tril(prefix)
        variants = [("causal_lower_right", dict(attn_mask=causal_lower_right(extend, len_k))),
                    ("bool mask", dict(attn_mask=bool_mask))]
    errors = []
    for label, kw in variants:
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, k, v, **kw)
                torch.cuda.synchronize()
                return median_ms(lambda: F.scaled_dot_product_attention(q, k, v, **kw),
                              rep_ms), label
        except Exception as exc:  # a backend that refuses this mask: try the next
            errors.append(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:60]}")
    return "n/a (" + "; ".join(errors) + ")", None


def _host_overhead(shape, page, hq, hkv, dim, dtype, n=50):
    """Host microseconds per call (launches queued, no sync inside the timed loop, except
    the plain call's own value checks)."""
    import torch
    from hygon_attn_backend.ops.prefill import plan_prefix_prefill, prefix_prefill_attention
    batch, prefix, extend = shape
    q, kc, vc, bt, cu, lk, _, _ = _build_batch(batch, prefix, extend, page, hq, hkv, dim, dtype)
    out = torch.empty_like(q)
    plan = plan_prefix_prefill(cu, lk, total_q=q.shape[0], num_q_heads=hq, num_kv_heads=hkv,
                               head_dim=dim)
    fns = {
        "plan": lambda: plan_prefix_prefill(cu, lk, total_q=q.shape[0], num_q_heads=hq,
                                            num_kv_heads=hkv, head_dim=dim),
        "launch with plan": lambda: prefix_prefill_attention(
            q, kc, vc, bt, cu, lk, out=out, plan=plan, validate=False),
        "call, validate=False": lambda: prefix_prefill_attention(
            q, kc, vc, bt, cu, lk, out=out, validate=False),
        "plain call": lambda: prefix_prefill_attention(q, kc, vc, bt, cu, lk, out=out),
    }
    res = {}
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        res[name] = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
    return res


def run_prefill_bench(args) -> dict:
    """Run the prefill benchmark described by ``args`` (see :func:`add_prefill_parser`);
    print a markdown table and return all numbers as a dict."""
    import torch
    import triton
    from hygon_attn_backend.ops.prefill import plan_prefix_prefill, prefix_prefill_attention

    if not torch.cuda.is_available():
        print("bench prefill needs a CUDA GPU", file=sys.stderr)
        return {}
    dtype = getattr(torch, args.dtype)
    hq, hkv, dim = args.num_q_heads, args.num_kv_heads, args.head_dim
    shapes = _parse_shapes(args.shapes)
    pages = [int(x) for x in str(args.block_sizes).split(",") if x]
    tiles = _parse_tiles(args.tiles)
    sources = ["cache", "dense"] if args.kv_source == "both" else [args.kv_source]
    mm_tflops, mm_ms = _matmul_tflops(args.rep_ms)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "triton": triton.__version__,
        "matmul_tflops": mm_tflops, "dtype": args.dtype, "num_q_heads": hq,
        "num_kv_heads": hkv, "head_dim": dim, "rows": [],
    }
    print(f"# prefill bench: {result['gpu']}, torch {torch.__version__}, triton "
          f"{triton.__version__}, {args.dtype}, Hq={hq}, Hkv={hkv}, D={dim}")
    print(f"bf16 8192^3 matmul: {mm_tflops:.1f} TFLOP/s ({mm_ms:.3f} ms) = 100%")
    for batch, prefix, extend in shapes:
        flops = prefill_flops(batch, prefix, extend, hq, dim)
        row = {"batch": batch, "prefix": prefix, "extend": extend, "gflop": flops / 1e9,
               "ours": [], "peers": {}}
        for page in pages:
            q, kc, vc, bt, cu, lk, kn, vn = _build_batch(batch, prefix, extend, page, hq, hkv,
                                                          dim, dtype)
            out = torch.empty_like(q)
            for tile in tiles:
                plan = plan_prefix_prefill(cu, lk, total_q=q.shape[0], num_q_heads=hq,
                                           num_kv_heads=hkv, head_dim=dim, tile=tile)
                for src in sources:
                    kw = dict(k_new=kn, v_new=vn) if src == "dense" else {}
                    fn = (lambda kw=kw, plan=plan: prefix_prefill_attention(
                        q, kc, vc, bt, cu, lk, out=out, plan=plan, validate=False, **kw))
                    try:
                        ms = median_ms(fn, args.rep_ms)
                    except Exception as exc:  # e.g. out of shared memory for a swept tile
                        row["ours"].append({"page": page, "source": src, "tile": tile,
                                            "error": f"{type(exc).__name__}: {exc}"[:200]})
                        continue
                    tf = flops / ms / 1e9
                    row["ours"].append({
                        "page": page, "source": src,
                        "tile": [plan.block_m, plan.block_n, plan.num_warps, plan.num_stages],
                        "ms": ms, "tflops": tf, "pct_matmul": 100 * tf / mm_tflops})
                    print(f"  ({batch},{prefix},{extend}) P={page} {src} tile="
                          f"{row['ours'][-1]['tile']}: {ms:.3f} ms {tf:.1f} TFLOP/s "
                          f"{100 * tf / mm_tflops:.1f}%", flush=True)
            # the plain call (plan + host checks inside) once per page size, default tile
            plain = lambda: prefix_prefill_attention(q, kc, vc, bt, cu, lk, out=out)
            row.setdefault("plain_call_ms", {})[page] = median_ms(plain, args.rep_ms)
            del q, kc, vc, bt, kn, vn, out
        if not args.no_peers:
            for name in ("cudnn", "flash"):
                ms, mask_kind = _sdpa_ms(name, batch, prefix, extend, hq, dim, dtype,
                                         args.rep_ms)
                if isinstance(ms, float):
                    tf = flops / ms / 1e9
                    row["peers"][name] = {"ms": ms, "tflops": tf, "mask": mask_kind,
                                          "pct_matmul": 100 * tf / mm_tflops}
                    print(f"  ({batch},{prefix},{extend}) sdpa {name}: {ms:.3f} ms {tf:.1f} "
                          f"TFLOP/s {100 * tf / mm_tflops:.1f}%", flush=True)
                else:
                    row["peers"][name] = {"error": ms}
        result["rows"].append(row)
        torch.cuda.empty_cache()
    result["host_us"] = _host_overhead(shapes[-1], pages[0], hq, hkv, dim, dtype)
    print("host time per call (us): " + ", ".join(f"{k} {v:.0f}"
                                                  for k, v in result["host_us"].items()))
    table = format_table(result)
    print(table)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(table + "\n")
    return result


def format_table(result: dict) -> str:
    """Markdown table: one line per (shape, page, source, tile) plus the peers."""
    mm = result["matmul_tflops"]
    lines = [f"matmul bf16 8192^3: {mm:.1f} TFLOP/s (100%)", "",
             "| B | prefix | extend | GFLOP | impl | page | K/V new | tile (M,N,w,s) | ms | "
             "TFLOP/s | % matmul |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        head = f"| {row['batch']} | {row['prefix']} | {row['extend']} | {row['gflop']:.1f}"
        for o in row["ours"]:
            tile = ",".join(str(x) for x in o["tile"]) if o.get("tile") else "-"
            if "error" in o:
                lines.append(f"{head} | hygon | {o['page']} | {o['source']} | {tile} | "
                             f"error: {o['error'][:60]} | | |")
                continue
            lines.append(f"{head} | hygon | {o['page']} | {o['source']} | {tile} | "
                         f"{o['ms']:.3f} | {o['tflops']:.1f} | {o['pct_matmul']:.1f} |")
        for page, ms in row.get("plain_call_ms", {}).items():
            tf = row["gflop"] / ms
            lines.append(f"{head} | hygon plain call | {page} | cache | default | {ms:.3f} | "
                         f"{tf:.1f} | {100 * tf / mm:.1f} |")
        for name, p in row["peers"].items():
            if "error" in p:
                lines.append(f"{head} | sdpa {name} (dense) | - | - | - | {p['error'][:70]} | | |")
            else:
                lines.append(f"{head} | sdpa {name} (dense, {p['mask']}) | - | - | - | "
                             f"{p['ms']:.3f} | "
                             f"{p['tflops']:.1f} | {p['pct_matmul']:.1f} |")
    if result.get("host_us"):
        lines += ["", "host time per call, us (B, prefix, extend = last shape, first page "
                  "size): " + ", ".join(f"{k} {v:.0f}" for k, v in result["host_us"].items())]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hygon-attn-bench-prefill")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_prefill_parser(sub)
    args = parser.parse_args(["prefill"] + list(argv if argv is not None else sys.argv[1:]))
    return args.func(args)


if __name__ == "__main__":
    main()
