"""Benchmark outputs: the markdown table, ``--csv``, ``--plot`` (matplotlib) and the progress bar (tqdm, when installed).

A row is a dict: ``op`` (decode | prefill), the shape (``batch``, ``ctx`` or ``prefix`` and
``extend``, heads, ``head_dim``, ``page``), ``impl``, ``note``, ``status`` (``ok``,
``wrong (...)``, ``not installed``, ``error: ...``) and, when timed, ``ms``, ``value`` (GB/s
for decode, TFLOP/s for prefill), ``ceiling`` (the in-run copy or matmul) and ``pct``.
"""

from __future__ import annotations

import csv

from hygon_attn_backend.tools import needs

CSV_FIELDS = ("op", "batch", "ctx", "prefix", "extend", "num_q_heads", "num_kv_heads",
              "head_dim", "page", "impl", "note", "status", "ms", "value", "unit", "ceiling",
              "pct_of_ceiling", "max_err", "budget")


def progress(items, *, desc: str):
    """``items`` wrapped in a tqdm bar on stderr when tqdm is installed and stderr is a
    terminal; the plain list otherwise."""
    items = list(items)
    try:
        from tqdm import tqdm
    except ImportError:
        return items
    return tqdm(items, desc=desc, disable=None, leave=False)


def shape_label(row: dict) -> str:
    if row["op"] == "decode":
        return f"B={row['batch']} ctx={_k(row['ctx'])}"
    return f"B={row['batch']} {_k(row['prefix'])}+{_k(row['extend'])}"


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def format_rows(rows: list, *, unit: str, ceiling_name: str) -> str:
    """Markdown table of every row (timed or not)."""
    head = ("| shape | Hq/Hkv | page | impl | note | ms | " + unit + " | % of " + ceiling_name
            + " |")
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = (f"| {shape_label(r)} | {r['num_q_heads']}/{r['num_kv_heads']} | {r['page']} | "
                f"{r['impl']} | {r.get('note', '')} |")
        if r["status"] != "ok":
            lines.append(f"{base} {r['status']} | | |")
        else:
            lines.append(f"{base} {r['ms']:.4f} | {r['value']:.1f} | {r['pct']:.1f}% |")
    return "\n".join(lines)


def write_csv(path: str, rows: list) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            rec = {k: r.get(k, "") for k in CSV_FIELDS}
            rec["pct_of_ceiling"] = r.get("pct", "")
            w.writerow(rec)


def pyplot():
    try:
        import matplotlib
    except ImportError as exc:
        raise SystemExit(f"--plot needs matplotlib, not installed: pip install "
                         f"{needs.PLOT}") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def write_plot(path: str, rows: list, *, title: str, unit: str, ceiling: float,
               ceiling_name: str) -> None:
    """Grouped bars: one group per shape (in run order), one bar per implementation, one
    panel per page size; the ceiling as a horizontal line. Rows that were not timed are
    left out (the table and CSV say why)."""
    plt = pyplot()
    timed = [r for r in rows if r["status"] == "ok"]
    pages = sorted({r["page"] for r in timed}, key=str)
    if not timed:
        raise SystemExit("--plot: no timed row to draw")
    fig, axes = plt.subplots(len(pages), 1, figsize=(11, 3.6 * len(pages)), squeeze=False)
    for ax, page in zip(axes[:, 0], pages):
        sub = [r for r in timed if r["page"] == page]
        shapes = list(dict.fromkeys(shape_label(r) for r in sub))
        impls = list(dict.fromkeys(r["impl"] for r in sub))
        width = 0.8 / len(impls)
        for i, impl in enumerate(impls):
            mine = {shape_label(r): r for r in sub if r["impl"] == impl}
            xs = [j + (i - (len(impls) - 1) / 2) * width for j, s in enumerate(shapes)
                  if s in mine]
            bars = ax.bar(xs, [mine[s]["value"] for s in shapes if s in mine], width,
                          label=impl)
            ax.bar_label(bars, labels=[f"{mine[s]['pct']:.0f}%" for s in shapes if s in mine],
                         fontsize=6)
        ax.axhline(ceiling, color="black", linestyle="--", linewidth=1,
                   label=f"{ceiling_name} {ceiling:.0f} {unit}")
        ax.set_xticks(range(len(shapes)))
        ax.set_xticklabels(shapes, fontsize=8)
        ax.set_ylabel(unit)
        ax.set_title(f"{title}, page {page}", fontsize=10)
        ax.legend(fontsize=7, ncol=4, loc="upper left", bbox_to_anchor=(0, -0.12))
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
