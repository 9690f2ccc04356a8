"""``hygon-attn simulate`` command line: table, CSV and plot of the simulator's results."""

from __future__ import annotations

import argparse
import csv
import os
import sys

from hygon_attn_backend.tools.argtypes import count

DEFAULT_MANAGERS = "contiguous-max,contiguous-exact,vllm-16,sglang-1,sglang-16"


def add_simulate_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``simulate`` on an argparse ``subparsers`` object; returns the parser."""
    p = subparsers.add_parser(
        "simulate", help="KV memory and prefix reuse of a request trace through the "
                         "engines' own memory managers (CPU, no model)")
    p.add_argument("--trace", default="chat,few-shot,random",
                   help="comma list of built-in traces (chat, few-shot, random) and/or "
                        "JSON-lines files (see hygon_attn_backend/simulate/traces.py)")
    p.add_argument("--managers", default=DEFAULT_MANAGERS,
                   help="comma list: contiguous-max, contiguous-exact, vllm-B, "
                        "vllm-B-nocache, sglang-P (B, P: block / page size)")
    p.add_argument("--memory-tokens", type=count(1), default=32768,
                   help="KV memory in token slots (per layer; the same for every manager)")
    p.add_argument("--max-len", type=count(1), default=2048,
                   help="maximum sequence length (the contiguous-max region size)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--csv", default="", help="write every result to this CSV file")
    p.add_argument("--plot", default="",
                   help="draw this PNG (needs matplotlib: pip install matplotlib)")
    p.set_defaults(func=run_cli)
    return p


def load_traces(spec: str, *, seed: int):
    from hygon_attn_backend.tools.simulate import traces
    out = []
    for name in (x.strip() for x in spec.split(",") if x.strip()):
        if name in traces.BUILTIN:
            out.append((name, traces.builtin(name, seed=seed)))
        elif os.path.exists(name):
            try:
                out.append((os.path.basename(name), traces.load_trace(name, seed=seed)))
            except (OSError, UnicodeDecodeError, ValueError) as exc:
                raise SystemExit(f"hygon-attn simulate: --trace {name}: {exc}") from None
        else:
            raise SystemExit(f"hygon-attn simulate: --trace: {name!r} is neither a built-in trace "
                             f"({', '.join(traces.BUILTIN)}) nor a file")
    return out


def run_all(trace_list, manager_specs, *, memory_tokens: int, max_len: int):
    """Results of every (trace, manager); a manager whose engine is missing is reported
    and skipped."""
    from hygon_attn_backend.tools.simulate.engine import simulate
    from hygon_attn_backend.tools.simulate.managers import make_manager
    results, skipped = [], []
    for trace_name, trace in trace_list:
        for spec in manager_specs:
            try:
                mgr = make_manager(spec, memory_tokens, max_len=max_len)
            except ImportError as exc:
                skipped.append(f"{spec}: not installed ({exc.name})")
                continue
            results.append(simulate(trace, mgr, trace_name=trace_name))
    return results, sorted(set(skipped))


def format_table(results) -> str:
    lines = ["| trace | manager | KV reserved (mean slots) | used | internal waste | "
             "external waste | running (mean / peak) | prefix hit | prefill tokens | "
             "preempted | steps |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(
            f"| {r.trace} | {r.manager} | {r.mean_reserved:.0f} | {r.mean_used:.0f} | "
            f"{100 * r.internal_waste:.1f}% | {100 * r.external_waste:.1f}% | "
            f"{r.mean_running:.1f} / {r.peak_running} | {100 * r.hit_rate:.1f}% | "
            f"{r.prefill_computed} | {r.preemptions} | {r.steps} |")
    return "\n".join(lines)


def write_csv(path: str, results) -> None:
    rows = [r.as_row() for r in results]
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["manager"])
        w.writeheader()
        w.writerows(rows)


def write_plot(path: str, results, *, memory_tokens: int) -> None:
    """Per trace: KV slots (used, internal waste, external waste; mean over steps) with
    the memory as a line, and prefill tokens computed with the prefix hit rate."""
    from hygon_attn_backend.tools.bench.output import pyplot
    plt = pyplot()
    names = list(dict.fromkeys(r.trace for r in results))
    fig, axes = plt.subplots(len(names), 2, figsize=(12, 3.3 * len(names)), squeeze=False)
    for (ax_mem, ax_hit), name in zip(axes, names):
        sub = [r for r in results if r.trace == name]
        labels = [r.manager.replace(", ", "\n") for r in sub]
        xs = range(len(sub))
        used = [r.mean_used for r in sub]
        internal = [r.mean_reserved - r.mean_used for r in sub]
        external = [r.external_waste * r.capacity for r in sub]
        ax_mem.bar(xs, used, label="used")
        ax_mem.bar(xs, internal, bottom=used, label="reserved, unused (internal)")
        ax_mem.bar(xs, external, bottom=[u + i for u, i in zip(used, internal)],
                   label="free, unusable (external)")
        ax_mem.axhline(memory_tokens, color="black", linestyle="--", linewidth=1,
                       label=f"memory {memory_tokens} slots")
        for x, r in zip(xs, sub):
            ax_mem.text(x, memory_tokens * 1.02, f"{r.mean_running:.1f} running",
                        ha="center", fontsize=7)
        ax_mem.set_xticks(list(xs))
        ax_mem.set_xticklabels(labels, fontsize=6)
        ax_mem.set_ylim(0, memory_tokens * 1.12)
        ax_mem.set_ylabel("KV slots (mean)")
        ax_mem.set_title(f"{name}: KV memory", fontsize=9)
        ax_mem.legend(fontsize=6, loc="lower right")
        bars = ax_hit.bar(xs, [r.prefill_computed for r in sub], color="tab:purple")
        ax_hit.bar_label(bars, labels=[f"hit {100 * r.hit_rate:.0f}%" for r in sub],
                         fontsize=7)
        ax_hit.set_xticks(list(xs))
        ax_hit.set_xticklabels(labels, fontsize=6)
        ax_hit.set_ylabel("prefill tokens computed")
        ax_hit.set_title(f"{name}: prefix reuse", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=72)
    plt.close(fig)


def run_cli(args) -> int:
    if args.plot:
        from hygon_attn_backend.tools.bench.output import pyplot
        pyplot()  # fail before the run when matplotlib is missing
    from hygon_attn_backend.tools.simulate.managers import parse_spec

    specs = [x.strip() for x in args.managers.split(",") if x.strip()]
    try:
        if not specs:
            raise ValueError("no manager named")
        for spec in specs:
            parse_spec(spec)
    except ValueError as exc:
        raise SystemExit(f"hygon-attn simulate: --managers: {exc}") from None
    trace_list = load_traces(args.trace, seed=args.seed)
    if not trace_list:
        raise SystemExit("hygon-attn simulate: --trace: no trace named")
    print(f"# simulate: memory {args.memory_tokens} token slots, max_len {args.max_len}, "
          f"{len(trace_list)} trace(s): "
          + ", ".join(f"{n} ({len(t)} requests)" for n, t in trace_list), flush=True)
    try:
        results, skipped = run_all(trace_list, specs, memory_tokens=args.memory_tokens,
                                   max_len=args.max_len)
    except ValueError as exc:  # e.g. a request longer than --max-len or the memory
        raise SystemExit(f"hygon-attn simulate: {exc} (--memory-tokens "
                         f"{args.memory_tokens}, --max-len {args.max_len})") from None
    for line in skipped:
        print(f"skipped {line}")
    print(format_table(results))
    if args.csv:
        write_csv(args.csv, results)
        print(f"wrote {args.csv}", file=sys.stderr)
    if args.plot:
        write_plot(args.plot, results, memory_tokens=args.memory_tokens)
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0
