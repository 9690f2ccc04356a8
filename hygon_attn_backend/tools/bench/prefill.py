"""``hygon-attn bench prefill``: prefix-prefill TFLOP/s beside an in-run bf16 matmul, and
beside the peers named by ``--compare``.

For each ``(B, prefix, extend)`` shape and page size the kernel runs over a paged cache
(pages a random permutation of the blocks) holding every key of a request as vLLM passes
them (``--kv-source cache``), or with the new tokens' K/V as packed tensors as SGLang
passes them (``--kv-source dense``). Work is the unmasked FLOPs only:
``4 * D * Hq * (extend * prefix + extend * (extend + 1) / 2)`` per request. The plan is
built once outside the timed call (``plan_prefix_prefill(..., tile=)``), host checks are
off, each call is timed eagerly with the L2 cleared before it; 100% is a bf16 ``8192^3``
matmul measured in the same run. Every output is checked against the reference before it
is timed. ``sdpa`` runs the dense equivalent (bottom-right causal mask).
``--kv-dtype`` puts fp8 caches beside the 16-bit one, as ``bench decode`` does.
"""

from __future__ import annotations

import argparse
import sys

from hygon_attn_backend.tools.argtypes import count, int_list, tuple_list
from hygon_attn_backend.tools.bench import _harness, output, problems
from hygon_attn_backend.tools.bench.decode import (_add_common, add_kv_dtype_option, labelled,
                                                   relate_to_auto)
from hygon_attn_backend.tools.bench.peers import make_peers, ours_prefill

DEFAULT_SHAPES = "1,0,8192;1,4096,4096;8,2048,512;32,1024,128;4,16384,1024"


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


def _tiles_text(text: str) -> str:
    """``--tiles``: what :func:`_parse_tiles` reads (four positive integers or
    ``default`` a config)."""
    try:
        tiles = _parse_tiles(text)
    except ValueError:
        tiles = [()]
    if any(t is not None and (len(t) != 4 or min(t) < 1) for t in tiles):
        raise argparse.ArgumentTypeError(f"must be BLOCK_M,BLOCK_N,warps,stages[;...] "
                                         f"(positive integers) or 'default', got {text!r}")
    return text


#: ``--fp8-workspace`` values -> ``plan_prefix_prefill(fp8_workspace=)``
WS_MODES = {"auto": None, "on": True, "off": False}


def _ws_modes_text(text: str) -> str:
    """``--fp8-workspace``: a comma list of :data:`WS_MODES` names."""
    modes = [x.strip() for x in str(text).split(",") if x.strip()]
    if not modes or any(x not in WS_MODES for x in modes):
        raise argparse.ArgumentTypeError(f"must be a comma list of auto, on, off, got "
                                         f"{text!r}")
    return ",".join(modes)


def add_prefill_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``prefill`` on an argparse ``subparsers`` object; returns the parser."""
    p = subparsers.add_parser("prefill", help="prefix-prefill TFLOP/s vs matmul and peers")
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   type=tuple_list("B", "prefix", "extend", lows=[1, 0, 1]),
                   help=f"';'-separated B,prefix,extend triples (default: {DEFAULT_SHAPES})")
    p.add_argument("--block-sizes", default="16,64", type=int_list(),
                   help="page sizes, comma-separated")
    p.add_argument("--num-q-heads", type=count(1), default=32)
    p.add_argument("--num-kv-heads", type=count(1), default=8)
    p.add_argument("--head-dim", type=count(1), default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--kv-source", default="cache", choices=["cache", "dense", "both"],
                   help="new tokens' K/V from the cache (vLLM) or dense tensors (SGLang)")
    p.add_argument("--tiles", default="", type=_tiles_text,
                   help="';'-separated BLOCK_M,BLOCK_N,warps,stages configs to sweep "
                        "(passed to plan_prefix_prefill), 'default' for the heuristic")
    add_kv_dtype_option(p)
    p.add_argument("--impl", default="auto",
                   help="our implementations, comma list of auto, triton, native (e.g. "
                        "triton,native: both in one run)")
    p.add_argument("--fp8-workspace", default="auto", type=_ws_modes_text,
                   help="fp8 caches: comma list of auto (the plan's rule), on, off: the "
                        "layers through a 16-bit workspace or not (e.g. on,off: both)")
    _add_common(p, rep_ms=100.0)
    p.set_defaults(func=_cli)
    return p


def _cli(args) -> int:
    return 0 if run_prefill_bench(args) else 1


def run_prefill_bench(args) -> dict:
    """Run the prefill benchmark described by ``args`` (see :func:`add_prefill_parser`);
    print a markdown table and return all numbers as a dict ({} without a device)."""
    import torch
    from hygon_attn_backend.tools.bench import _timing

    started = _harness.start(args, "prefill")
    if started is None:
        return {}
    impls, peers, device = started
    dtype = getattr(torch, args.dtype)
    hq, hkv, dim = args.num_q_heads, args.num_kv_heads, args.head_dim
    pages = [int(x) for x in str(args.block_sizes).split(",") if x]
    tiles = _parse_tiles(args.tiles)
    sources = ["cache", "dense"] if args.kv_source == "both" else [args.kv_source]
    ws_modes = str(args.fp8_workspace).split(",")
    meta = _harness.header(device)
    mm, mm_ms = _timing.matmul_ceiling(args.rep_ms, device=device)
    meta.update(matmul_tflops=mm, dtype=args.dtype, num_q_heads=hq, num_kv_heads=hkv,
                head_dim=dim, peers=peers, l2_flush=_timing.L2_FLUSH)
    print(f"# prefill bench: {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, "
          f"{args.dtype}, Hq={hq}, Hkv={hkv}, D={dim}; plan outside the timed call, L2 "
          f"cleared before every call (by a {_timing.L2_FLUSH}), pages permuted")
    print(f"matmul ceiling: {mm:.1f} TFLOP/s ({mm_ms:.3f} ms) = 100%")
    rows = []
    kv_names = args.kv_dtype.split(",")
    meta.update(kv_dtypes=kv_names)
    points = [(shape, page, kv) for shape in _parse_shapes(args.shapes) for page in pages
              for kv in kv_names]
    for (batch, prefix, extend), page, kv_name in output.progress(points,
                                                                  desc="prefill shapes"):
        prob = problems.build_prefill(batch=batch, prefix=prefix, extend=extend,
                                      page_size=page, num_q_heads=hq, num_kv_heads=hkv,
                                      head_dim=dim, dtype=dtype, device=device,
                                      kv_dtype=problems.kv_dtype_of(kv_name),
                                      per_head=problems.per_head_name(kv_name))
        base = dict(op="prefill", batch=batch, prefix=prefix, extend=extend,
                    num_q_heads=hq, num_kv_heads=hkv, head_dim=dim, page=page)
        made = []
        for tile in tiles:
            for src in sources:
                for impl, ws in ((i, w) for i in impls
                                 for w in (ws_modes if prob.fp8 else ["auto"])):
                    label = "hygon" if src == "cache" else "hygon (new K/V dense)"
                    label += f" [{impl}]" if len(impls) > 1 else ""
                    label += f" [workspace {ws}]" if len(ws_modes) > 1 else ""
                    try:
                        made.append((label, ours_prefill(prob, kv_source=src, tile=tile,
                                                         label=label, impl=impl,
                                                         fp8_workspace=WS_MODES[ws])))
                    except Exception as exc:  # e.g. a swept tile the op refuses
                        made.append((label, exc))
        for name in peers:
            made += make_peers(name, prob, "prefill")
        rows += labelled(_harness.run_all(
            made, lambda out: problems.check_prefill(prob, out), base=base, graph=False,
            rep_ms=args.rep_ms, work=prob.flops(), ceiling=mm, device=device), kv_name)
        prob = made = None  # free the caches before the next shape
    relate_to_auto(rows)
    _harness.emit(rows, meta, args, op="prefill", unit="TFLOP/s", ceiling=mm,
                  ceiling_name="matmul",
                  title=f"prefill {args.dtype}, Hq={hq}, Hkv={hkv}, D={dim}")
    return dict(meta, rows=rows)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hygon-attn-bench-prefill")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_prefill_parser(sub)
    args = parser.parse_args(["prefill"] + list(argv if argv is not None else sys.argv[1:]))
    return args.func(args)


if __name__ == "__main__":
    main()
