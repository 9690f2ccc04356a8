"""``hygon-attn bench cache``: write_kv and copy_blocks bandwidth beside a device copy.

Both ops are pure data movement, so the figure of merit is achieved GB/s (bytes read
plus bytes written) over a device-to-device copy of the same byte count timed in the
same run.
"""

from __future__ import annotations

import argparse

from hygon_attn_backend.tools.argtypes import count, positive_float
from hygon_attn_backend.tools.bench._timing import median_ms


def run_cache_bench(args) -> int:
    import torch

    from hygon_attn_backend import layouts
    from hygon_attn_backend.ops.cache import copy_blocks, write_kv

    if not torch.cuda.is_available():
        raise SystemExit("hygon-attn bench cache needs a CUDA GPU")
    dev = torch.device("cuda")
    dtype = getattr(torch, args.dtype)
    h, p, d, nb = args.num_kv_heads, args.block_size, args.head_dim, args.num_blocks
    rows = []
    copy_cache = {}
    for layout in args.layouts.split(","):
        k_store = layouts.allocate(layout, num_blocks=nb, block_size=p, num_kv_heads=h,
                                   head_dim=d, dtype=dtype, device=dev)
        v_store = layouts.allocate(layout, num_blocks=nb, block_size=p, num_kv_heads=h,
                                   head_dim=d, dtype=dtype, device=dev)
        kv, vv = layouts.kv_views(layout, k_store, v_store, block_size=p)
        k = torch.randn(args.num_tokens, h, d, device=dev).to(dtype)
        v = torch.randn(args.num_tokens, h, d, device=dev).to(dtype)
        slots = torch.randperm(nb * p, device=dev)[: args.num_tokens]
        perm = torch.randperm(nb, device=dev)
        pairs = torch.stack([perm[: args.num_pairs], perm[args.num_pairs: 2 * args.num_pairs]], 1)
        elem = k.element_size()
        work = {
            "write_kv": (2 * 2 * k.numel() * elem,  # read k, v; write both
                         lambda: write_kv(k, v, kv, vv, slots)),
            "copy_blocks": (2 * 2 * args.num_pairs * h * p * d * elem,  # read+write K and V
                            lambda: copy_blocks(k_store, v_store, pairs)),
        }
        for op, (nbytes, fn) in work.items():
            if nbytes not in copy_cache:
                src = torch.empty(nbytes // 2, dtype=torch.uint8, device=dev)
                dst = torch.empty_like(src)
                copy_cache[nbytes] = nbytes / median_ms(lambda: dst.copy_(src), args.rep_ms) / 1e6
            ms = median_ms(fn, args.rep_ms)
            gbps = nbytes / ms / 1e6
            rows.append((layout, op, nbytes, ms, gbps, copy_cache[nbytes]))
    lines = [f"GPU {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
             f"{args.dtype}, kv heads {h}, head_dim {d}, block {p}, tokens {args.num_tokens}, "
             f"block pairs {args.num_pairs}", "",
             "| layout | op | MB moved | ms (median) | GB/s | copy GB/s | % of copy |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for layout, op, nbytes, ms, gbps, copy in rows:
        lines.append(f"| {layout} | {op} | {nbytes / 1e6:.1f} | {ms:.4f} | {gbps:.0f} | "
                     f"{copy:.0f} | {100 * gbps / copy:.0f}% |")
    text = "\n".join(lines)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


def add_cache_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``cache`` on an argparse ``subparsers`` object; returns the parser."""
    p = subparsers.add_parser("cache", help="write_kv / copy_blocks GB/s vs an in-run copy")
    p.add_argument("--layouts", default="bshd,bhsd", help="comma-separated storage layouts")
    p.add_argument("--num-kv-heads", type=count(1), default=8)
    p.add_argument("--head-dim", type=count(1), default=128)
    p.add_argument("--block-size", type=count(1), default=16)
    p.add_argument("--num-blocks", type=count(1), default=8192)
    p.add_argument("--num-tokens", type=count(1), default=65536)
    p.add_argument("--num-pairs", type=count(1), default=2048)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--rep-ms", type=positive_float, default=50.0)
    p.add_argument("--markdown", default="")
    p.set_defaults(func=run_cache_bench)
    return p
