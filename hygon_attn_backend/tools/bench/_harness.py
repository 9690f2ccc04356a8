"""The loop both benchmarks share: check each implementation against the reference,
time it with the one method, turn its time into a row."""

from __future__ import annotations

import os
import sys
import time

from hygon_attn_backend.tools.bench import _timing, output
from hygon_attn_backend.tools.bench.peers import Unavailable


def pick_device():
    """``cuda`` when a GPU is present, ``cpu`` under Triton's interpreter, else None."""
    import torch
    if torch.cuda.is_available():
        return torch.device("cuda")
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    return None


def no_device_message(cmd: str) -> str:
    return (f"hygon-attn bench {cmd} needs a CUDA GPU (or TRITON_INTERPRET=1 for a "
            "functional run on the CPU through Triton's interpreter; its times are no "
            "speed)")


def check_heads(cmd: str, num_q_heads: int, divisors: dict) -> None:
    """Exit with one line unless ``num_q_heads`` is a multiple of every value of
    ``divisors`` (``option -> value``: the KV heads, the G sweep's groups)."""
    for option, value in divisors.items():
        if num_q_heads % value:
            raise SystemExit(f"hygon-attn bench {cmd}: --num-q-heads {num_q_heads} must be a "
                             f"multiple of {option} {value}")


def parse_impls(text: str) -> list:
    """``--impl``: a comma list of ``auto``, ``triton``, ``native`` (no repeats)."""
    impls = [x.strip() for x in str(text).split(",") if x.strip()]
    bad = [x for x in impls if x not in ("auto", "triton", "native")]
    if not impls or bad or len(set(impls)) != len(impls):
        raise ValueError(f"--impl: a comma list of auto, triton, native without repeats, "
                         f"got {text!r}")
    return impls


def start(args, cmd: str):
    """``(impls, peers, device)`` for a ``bench decode|prefill`` run, or None without a
    device (after saying so). A bad ``--impl`` list, heads that ``--num-kv-heads`` does not
    divide, bad ``--compare`` lists and a missing matplotlib stop here, before the run."""
    from hygon_attn_backend.tools.bench.peers import parse_compare

    try:
        impls = parse_impls(args.impl)
    except ValueError as exc:
        raise SystemExit(f"hygon-attn bench {cmd}: {exc}") from None
    check_heads(cmd, args.num_q_heads, {"--num-kv-heads": args.num_kv_heads})
    try:
        peers = parse_compare(args.compare)
    except ValueError as exc:
        raise SystemExit(str(exc)) from exc
    if args.plot:
        output.pyplot()  # fail before the run, not after it, when matplotlib is missing
    _timing.set_l2_flush(getattr(args, "l2_flush", "write"))
    device = pick_device()
    if device is None:
        print(no_device_message(cmd), file=sys.stderr)
        return None
    if device.type == "cpu":
        from hygon_attn_backend.tools import needs

        problem = needs.interpreter_problem(f"hygon-attn bench {cmd}")
        if problem:
            print(problem, file=sys.stderr)
            return None
    return impls, peers, device


def header(device) -> dict:
    import platform
    import torch
    import triton
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else (
        f"cpu ({platform.machine()}), Triton interpreter")
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "gpu": gpu, "torch": torch.__version__,
            "triton": triton.__version__, "python": platform.python_version()}


def run_one(made, check, *, base: dict, graph: bool, rep_ms: float, work: float,
            ceiling: float, device) -> dict:
    """One row: ``made`` is a Runner or the exception its maker raised; ``check(out)``
    returns ``(ok, err, budget)``; ``work`` is bytes (decode) or FLOPs (prefill), turned
    into GB/s or TFLOP/s (both ``work / ms / 1e6`` resp. ``/ 1e9``)."""
    row = dict(base)
    if isinstance(made, Unavailable):
        row.update(impl=row.get("impl") or "?", status=str(made))
        return row
    if isinstance(made, Exception):
        row.update(status=f"error: {type(made).__name__}: {str(made)[:100]}")
        return row
    row.update(impl=made.name, note=made.note)
    try:
        made.out.fill_(float("nan"))  # a row the implementation never writes fails the check
        made.fn()
        if device.type == "cuda":
            import torch
            torch.cuda.synchronize()
        ok, err, budget = check(made.out)
    except Exception as exc:  # a peer that fails on this shape: say so, keep going
        row.update(status=f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
        return row
    row.update(max_err=f"{err:.3g}", budget=f"{budget:.3g}")
    if not ok:
        row.update(status=f"wrong (max err {err:.3g} > budget {budget:.3g})")
        return row
    try:
        timer = _timing.graph_ms if graph else _timing.median_ms
        ms = timer(made.fn, rep_ms, device=device)
    except Exception as exc:  # e.g. a call that cannot be captured in a graph
        row.update(status=f"error timing: {type(exc).__name__}: {str(exc)[:100]}")
        return row
    decode = row["op"] == "decode"
    value = work / ms / (1e6 if decode else 1e9)
    row.update(status="ok", ms=ms, value=value, unit="GB/s" if decode else "TFLOP/s",
               ceiling=ceiling, pct=100 * value / ceiling)
    return row


def run_all(made, check, *, base: dict, device, **kw) -> list:
    """:func:`run_one` for every ``(label, Runner or exception)`` of ``made``, each row
    printed as it completes; the device's cached memory is released after."""
    rows = []
    for label, m in made:
        rows.append(run_one(m, check, base=dict(base, impl=label), device=device, **kw))
        print_row(rows[-1])
    if device.type == "cuda":
        import torch
        torch.cuda.empty_cache()
    return rows


def print_row(row) -> None:
    """One progress line per row."""
    where = f"  {output.shape_label(row)} Hkv={row['num_kv_heads']} P={row['page']} {row['impl']}"
    if row["status"] == "ok":
        print(f"{where} {row.get('note', '')}: {row['ms']:.4f} ms {row['value']:.1f} "
              f"{row['unit']} {row['pct']:.1f}%", flush=True)
    else:
        print(f"{where}: {row['status']}", flush=True)


def emit(rows, meta, args, *, op: str, unit: str, ceiling: float, ceiling_name: str,
         title: str) -> str:
    """Print the table; write --csv, --plot, --markdown, --json where asked."""
    import json
    table = output.format_rows(rows, unit=unit, ceiling_name=ceiling_name)
    print(table)
    if getattr(args, "markdown", ""):
        with open(args.markdown, "w") as fh:
            fh.write(table + "\n")
    if getattr(args, "csv", ""):
        output.write_csv(args.csv, rows)
        print(f"wrote {args.csv}", file=sys.stderr)
    if getattr(args, "plot", ""):
        output.write_plot(args.plot, rows, title=title, unit=unit, ceiling=ceiling,
                          ceiling_name=ceiling_name)
        print(f"wrote {args.plot}", file=sys.stderr)
    if getattr(args, "json", ""):
        with open(args.json, "w") as fh:
            json.dump(dict(meta, rows=rows), fh, indent=1, default=str)
    return table
