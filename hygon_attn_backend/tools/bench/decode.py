"""``hygon-attn bench decode``: paged decode KV-read GB/s beside an in-run device copy,
and beside the peers named by ``--compare``.

Decode reads each cached K/V byte once: ``2 * B * ctx * Hkv * D * elem`` bytes per call
(q and out are < 0.1% of it at these sizes). Achieved GB/s is those bytes over the median
time of one CUDA-graph replay of the call, the L2 cleared before every replay; 100% is a
device-to-device copy measured in the same run, counting bytes read plus bytes written.
Pages are a random permutation of the cache's blocks. The workspace and every peer's
metadata are built before the graph is captured; each implementation's output is checked
against the reference before it is timed (see :mod:`hygon_attn_backend.tools.bench._timing`).

Our points per (B, ctx) shape and page size: the shipped partition heuristic (``auto``),
the DCU baseline rule, optional forced partition sizes, and the per-query-head variant at
the groups of ``--per-head-groups``; each with every implementation of ``--impl``
(``triton,native`` puts the native kernels of ``csrc/`` beside the Triton ones). Beside
them, a device copy moving the same bytes, timed the same way (``--same-bytes-copy``): at
small batch a call is short enough that fixed costs (launch, the L2 write-back after the
clear, the first wave's ramp) weigh, and this row shows how much of the gap to the big
copy any kernel of that size pays. A G sweep at one shape varies the KV heads at a fixed
query head count.

``--kv-dtype auto,fp8_e4m3,fp8_e5m2`` runs each shape with every cache dtype named (``auto``:
the query's own): the fp8 caches are the same random values quantized with a per-tensor
scale each, every implementation gets them (a peer without fp8 KV says so), the GB/s
count the bytes each cache holds, and an fp8 row's note gives its time over the same
implementation's ``auto`` row of the shape (``0.52x auto``).
"""

from __future__ import annotations

import argparse
import sys

from hygon_attn_backend.tools.argtypes import count, int_list, positive_float, tuple_list
from hygon_attn_backend.tools.bench import _harness, output, problems
from hygon_attn_backend.tools.bench.peers import make_peers, ours_decode

DEFAULT_SHAPES = "1,32768;1,131072;8,8192;64,4096;64,16384;256,2048"
#: Defaults on a GPU and under Triton's CPU interpreter, for the options left unset. The
#: interpreter runs a kernel's programs one by one in Python (seconds a row at the CPU
#: shape, hours at the GPU ones) and its bf16 dot is broken (every bf16 row fails the
#: reference check), so there one small shape in fp16 without the G sweep checks the
#: wiring in under a minute.
GPU_DEFAULTS = dict(shapes=DEFAULT_SHAPES, groups="1,8,16", dtype="bfloat16")
CPU_DEFAULTS = dict(shapes="2,40", groups="", dtype="float16")


def _parse_pairs(text: str):
    return [tuple(int(x) for x in part.split(",")) for part in text.split(";") if part.strip()]


def _parse_partitions(text: str):
    """``auto`` (shipped heuristic), ``auto-fused`` / ``auto-launch`` (its partition size
    with the combine fused into the decode kernel / as a second launch), ``dcu`` (baseline
    rule), ``none`` (one partition), or an integer partition size."""
    items = []
    for part in text.split(","):
        part = part.strip()
        if part:
            named = part in ("auto", "auto-fused", "auto-launch", "dcu", "none")
            items.append(part if named else int(part))
    return items


def _partitions_text(text: str) -> str:
    """``--partitions``: what :func:`_parse_partitions` reads (sizes: multiples of 16)."""
    try:
        items = _parse_partitions(text)
    except ValueError:
        items = []
    if not items or any(isinstance(x, int) and (x < 16 or x % 16) for x in items):
        raise argparse.ArgumentTypeError(
            f"must be a comma list of auto, auto-fused, auto-launch, dcu, none or a "
            f"partition size (a positive multiple of 16), got {text!r}")
    return text


def add_decode_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``decode`` on an argparse ``subparsers`` object; returns the parser."""
    p = subparsers.add_parser("decode", help="paged decode GB/s vs an in-run copy and peers")
    p.add_argument("--shapes", default=None, type=tuple_list("B", "ctx"),
                   help=f"';'-separated B,ctx pairs (default: {DEFAULT_SHAPES}; on a CPU "
                        f"under Triton's interpreter {CPU_DEFAULTS['shapes']})")
    p.add_argument("--block-sizes", default="16,64", type=int_list(),
                   help="page sizes, comma-separated")
    p.add_argument("--num-q-heads", type=count(1), default=32)
    p.add_argument("--num-kv-heads", type=count(1), default=8)
    p.add_argument("--head-dim", type=count(1), default=128)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16"],
                   help="default: bfloat16; float16 on a CPU (the interpreter's bf16 dot "
                        "is broken)")
    p.add_argument("--partitions", default="auto,dcu", type=_partitions_text,
                   help="comma list: auto, auto-fused / auto-launch (auto's partition size "
                        "with the combine fused / a second launch), dcu, none or a size")
    p.add_argument("--group-shape", default="64,4096", type=tuple_list("B", "ctx", single=True),
                   help="B,ctx of the G sweep")
    p.add_argument("--groups", default=None, type=int_list(empty=True),
                   help="GQA groups of the G sweep (Hq fixed, Hkv = Hq / G); '' skips it "
                        "(default: 1,8,16; '' on a CPU)")
    p.add_argument("--per-head-groups", default="8", type=int_list(empty=True),
                   help="groups at which the per-query-head variant is also timed")
    p.add_argument("--same-bytes-copy", action=argparse.BooleanOptionalAction, default=True,
                   help="time a device copy moving each shape's KV bytes beside it (the "
                        "reference for short calls; default on)")
    add_kv_dtype_option(p)
    p.add_argument("--dcp", type=count(1), default=1, metavar="W",
                   help="also time one rank of decode context parallelism over W ranks at "
                        "each shape: its 1/W of every sequence with the LSE, plus the merge "
                        "of W partial outputs; the row's note is its time over the DCP=1 "
                        "decode's ('auto' row; the target is <= 0.6x for W=2 at 128k)")
    p.add_argument("--impl", default="auto",
                   help="our implementations, comma list of auto, triton, native (e.g. "
                        "'triton,native': each partition choice is timed with both)")
    _add_common(p, rep_ms=60.0)
    p.set_defaults(func=_cli, bench_func=_cli)
    return p


def kv_dtype_list(text: str, *, per_head: bool = True) -> str:
    """``--kv-dtype``: a comma list of :data:`problems.KV_DTYPES` names (no repeats; the
    ``*_per_head`` ones only where ``per_head``)."""
    allowed = [n for n in problems.KV_DTYPES if per_head or not problems.per_head_name(n)]
    names = [x.strip() for x in str(text).split(",") if x.strip()]
    if not names or len(set(names)) != len(names) or any(n not in allowed for n in names):
        raise argparse.ArgumentTypeError(
            f"must be a comma list of {', '.join(allowed)} without repeats, got {text!r}")
    return ",".join(names)


def add_kv_dtype_option(p, *, per_head: bool = True) -> None:
    """``--kv-dtype`` (decode and prefill; ``per_head``: the per-KV-head scale names too)."""
    heads = (", fp8_e4m3_per_head, fp8_e5m2_per_head (one scale a KV head)" if per_head
             else "")
    p.add_argument("--kv-dtype", default="auto",
                   type=lambda text: kv_dtype_list(text, per_head=per_head),
                   help="KV cache dtypes, comma list of auto (the query's dtype), fp8_e4m3, "
                        f"fp8_e5m2 (per-tensor scales){heads}: each shape runs with each "
                        "(default: auto)")


def relate_to_auto(rows: list) -> None:
    """Append to each timed fp8 row's note its time over the ``auto`` row of the same
    shape, page and implementation label (rows carry ``kv_dtype`` and ``label``)."""
    key = lambda r: (r.get("batch"), r.get("ctx"), r.get("prefix"), r.get("extend"),
                     r.get("num_q_heads"), r.get("num_kv_heads"), r.get("page"),
                     r.get("label"))
    auto = {key(r): r for r in rows if r.get("kv_dtype") == "auto" and r["status"] == "ok"}
    for r in rows:
        base = auto.get(key(r))
        if r.get("kv_dtype", "auto") != "auto" and r["status"] == "ok" and base:
            ratio = f"{r['ms'] / base['ms']:.2f}x auto"
            r["note"] = f"{r['note']}, {ratio}" if r.get("note") else ratio


def labelled(rows: list, kv_name: str) -> list:
    """Rows of one cache dtype: ``kv_dtype`` and the implementation's ``label`` recorded,
    the dtype appended to the impl name unless it is ``auto``."""
    for r in rows:
        r["kv_dtype"], r["label"] = kv_name, r.get("impl", "?")
        if kv_name != "auto":
            r["impl"] = f"{r['label']} [{kv_name}]"
    return rows


def _add_common(p, *, rep_ms: float) -> None:
    """Options both benchmarks share."""
    p.add_argument("--compare", default="",
                   help="peers to run beside ours: comma list of sglang, vllm, flashinfer, "
                        "sdpa (or 'all'); one not installed here is reported, not an error")
    p.add_argument("--rep-ms", type=positive_float, default=rep_ms,
                   help="timed milliseconds per point")
    p.add_argument("--l2-flush", default="write", choices=["write", "read"],
                   help="how the L2 is evicted before each timed call: 'write' "
                        "(triton.testing.do_bench's zero fill; the call also writes back "
                        "the dirty lines it leaves) or 'read' (a read of a buffer written "
                        "once: a clean L2, as in an engine's step)")
    p.add_argument("--csv", default="", help="write every row to this CSV file")
    p.add_argument("--plot", default="",
                   help="draw this PNG (needs matplotlib: pip install matplotlib)")
    p.add_argument("--json", default="", help="write all results to this JSON file")
    p.add_argument("--markdown", default="", help="write the table to this file")


def _cli(args) -> int:
    return 0 if run_decode_bench(args) else 1


def _partition_size(choice, prob, device):
    """The partition size our op gets for ``choice`` (passed as an argument)."""
    from hygon_attn_backend.ops._device import num_sms_of
    from hygon_attn_backend.ops.decode import tuning
    if choice in ("auto", "dcu"):
        return tuning.triton_partition_size(
            num_seqs=prob.batch, num_kv_heads=prob.num_kv_heads,
            group=prob.num_q_heads // prob.num_kv_heads, max_context_len=prob.ctx,
            num_sms=num_sms_of(device), rule="dcu" if choice == "dcu" else "measured")
    if choice == "none":
        return -(-prob.ctx // 16) * 16
    return int(choice)


def _our_label(choice) -> str:
    return {"auto": "hygon", "auto-fused": "hygon (fused combine)",
            "auto-launch": "hygon (combine launch)", "dcu": "hygon (dcu rule)",
            "none": "hygon (1 partition)"}.get(choice, "hygon (forced)")


def run_decode_bench(args) -> dict:
    """Run the decode benchmark described by ``args`` (see :func:`add_decode_parser`);
    print a markdown table and return all numbers as a dict ({} without a device)."""
    import torch
    from hygon_attn_backend.tools.bench import _timing

    started = _harness.start(args, "decode")
    if started is None:
        return {}
    impls, peers, device = started
    for name, value in (GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    _harness.check_heads("decode", args.num_q_heads, {
        "--groups": int(g) for g in str(args.groups).split(",") if g.strip()})
    dtype = getattr(torch, args.dtype)
    hq, dim = args.num_q_heads, args.head_dim
    pages = [int(x) for x in str(args.block_sizes).split(",") if x]
    partitions = _parse_partitions(args.partitions)
    per_head_groups = {int(x) for x in str(args.per_head_groups).split(",") if x}
    meta = _harness.header(device)
    copy, copy_ms = _timing.copy_ceiling(args.rep_ms, device=device)
    meta.update(copy_gbps=copy, dtype=args.dtype, num_q_heads=hq, head_dim=dim, peers=peers,
                l2_flush=_timing.L2_FLUSH)
    print(f"# decode bench: {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, "
          f"{args.dtype}, Hq={hq}, D={dim}; graph replay, L2 cleared before every replay "
          f"(by a {_timing.L2_FLUSH}), pages permuted", flush=True)
    print(f"device copy (read + write): {copy:.0f} GB/s = 100%", flush=True)
    jobs = [(b, c, args.num_kv_heads) for b, c in _parse_pairs(args.shapes)]
    if args.groups:
        gb, gc = _parse_pairs(args.group_shape)[0]
        jobs += [(gb, gc, hq // int(g)) for g in str(args.groups).split(",") if g]
    rows = []
    kv_names = args.kv_dtype.split(",")
    meta.update(kv_dtypes=kv_names)
    points = len(jobs) * len(pages) * len(kv_names)
    done = 0
    for batch, ctx, hkv in output.progress(jobs, desc="decode shapes"):
        for page in pages:
            for kv_name in kv_names:
                done += 1
                print(f"[{done}/{points}] B={batch} ctx={ctx} Hkv={hkv} page {page} "
                      f"kv {kv_name}", flush=True)
                rows += _decode_point(args, batch=batch, ctx=ctx, hkv=hkv, page=page,
                                      kv_name=kv_name, dtype=dtype, impls=impls,
                                      partitions=partitions, peers=peers,
                                      per_head_groups=per_head_groups, copy=copy,
                                      device=device)
    relate_to_auto(rows)
    _harness.emit(rows, meta, args, op="decode", unit="GB/s", ceiling=copy,
                  ceiling_name="copy", title=f"decode {args.dtype}, Hq={hq}, D={dim}")
    return dict(meta, rows=rows)


def _decode_point(args, *, batch, ctx, hkv, page, kv_name, dtype, impls, partitions, peers,
                  per_head_groups, copy, device) -> list:
    """Every row of one (shape, page, cache dtype): ours, the peers, the same-bytes copy."""
    hq, dim = args.num_q_heads, args.head_dim
    rows = []
    prob = problems.build_decode(batch=batch, ctx=ctx, page_size=page,
                                 num_q_heads=hq, num_kv_heads=hkv, head_dim=dim,
                                 dtype=dtype, device=device,
                                 kv_dtype=problems.kv_dtype_of(kv_name),
                                 per_head=problems.per_head_name(kv_name))
    base = dict(op="decode", batch=batch, ctx=ctx, num_q_heads=hq, num_kv_heads=hkv,
                head_dim=dim, page=page)
    made = []
    for impl in impls:
        for choice in partitions:
            # the shipped rule is planned by the op itself (per-sequence split)
            auto = isinstance(choice, str) and choice.startswith("auto")
            size = None if auto else _partition_size(choice, prob, device)
            label = _our_label(choice) + (f" [{impl}]" if len(impls) > 1 else "")
            made.append(_make(lambda: ours_decode(
                prob, partition_size=size, impl=impl,
                fused_combine={"auto-fused": True, "auto-launch": False}.get(choice),
                label=label), label))
    if hq // hkv in per_head_groups:
        size = _partition_size("auto", prob, device)
        made.append(_make(lambda: ours_decode(prob, partition_size=size,
                                              kv_head_grid=False,
                                              label="hygon per-q-head"),
                          "hygon per-q-head"))
    for name in peers:
        made += make_peers(name, prob, "decode")
    rows += labelled(_harness.run_all(
        made, lambda out: problems.check_decode(prob, out), base=base, graph=True,
        rep_ms=args.rep_ms, work=prob.kv_bytes(), ceiling=copy, device=device),
        kv_name)
    if args.dcp > 1:
        rows += labelled(_dcp_rows(args.dcp, base, rows, dtype=dtype, copy=copy,
                                   rep_ms=args.rep_ms, device=device), kv_name)
    if args.same_bytes_copy:
        rows += labelled([_same_bytes_copy_row(prob.kv_bytes(), base, copy,
                                               args.rep_ms, device)], kv_name)
        _harness.print_row(rows[-1])
    prob = made = None  # free the caches before the next shape
    return rows


def dcp_ratio_note(shard_ms: float, rows: list) -> str:
    """The DCP row's note: its time over the DCP=1 decode's (the ``hygon`` row of the same
    shape: the shipped rule), or why there is no ratio."""
    base = next((r for r in rows if r.get("impl", "").startswith("hygon")
                 and "DCP" not in r["impl"] and r.get("status") == "ok"), None)
    if base is None:
        return "no DCP=1 row of this shape to compare with"
    return f"{shard_ms / base['ms']:.2f}x {base['impl']} (DCP=1)"


def _dcp_rows(world: int, base: dict, rows: list, *, dtype, copy: float, rep_ms: float,
              device) -> list:
    """The ``--dcp W`` row of one shape: a rank's shard (``ceil(ctx / W)`` keys a
    sequence, the same heads) decoded with its LSE, plus the merge of W partials."""
    from hygon_attn_backend.tools.bench.peers import ours_dcp_shard
    shard = problems.build_decode(batch=base["batch"], ctx=-(-base["ctx"] // world),
                                  page_size=base["page"], num_q_heads=base["num_q_heads"],
                                  num_kv_heads=base["num_kv_heads"],
                                  head_dim=base["head_dim"], dtype=dtype, device=device)
    label = f"hygon DCP={world} rank (shard + merge)"
    made = [_make(lambda: ours_dcp_shard(shard, world_size=world, label=label), label)]
    # the shard reads 1/W of the keys: GB/s counts what this rank reads
    out = _harness.run_all(made, lambda o: problems.check_decode(shard, o), base=base,
                           graph=True, rep_ms=rep_ms, work=shard.kv_bytes(), ceiling=copy,
                           device=device)
    for row in out:
        if row.get("status") == "ok":
            row["note"] = f"{row.get('note', '')}; {dcp_ratio_note(row['ms'], rows)}"
            print(f"  {label}: {row['note']}", flush=True)
    return out


def _same_bytes_copy_row(nbytes: int, base: dict, copy: float, rep_ms: float, device) -> dict:
    """A row for a device copy moving the shape's KV bytes, timed as the decode calls."""
    from hygon_attn_backend.tools.bench import _timing
    ms = _timing.same_bytes_copy_ms(nbytes, rep_ms, device=device)
    value = nbytes / ms / 1e6
    return dict(base, impl="device copy, same bytes", note="reference, not attention",
                status="ok", ms=ms, value=value, unit="GB/s", ceiling=copy,
                pct=100 * value / copy)


def _make(factory, label):
    try:
        return label, factory()
    except Exception as exc:  # e.g. a forced partition size the op refuses
        return label, exc


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hygon-attn-bench-decode")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_decode_parser(sub)
    args = parser.parse_args(["decode"] + list(argv if argv is not None else sys.argv[1:]))
    return run_decode_bench(args)


if __name__ == "__main__":
    main()
