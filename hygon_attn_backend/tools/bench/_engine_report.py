"""Reports of ``hygon-attn bench engine``: the step-time table (hygon beside SGLang's
``triton`` backend), its CSV, and the greedy-token comparison of the offline Engine.

A result row (one per timed point, JSON lines written by the child) holds ``backend``,
``head_dim``, ``page``, ``batch``, ``ctx``, ``status`` and, when timed, ``prefill_s``,
``decode_s`` (median decode step), ``compiles_timed`` / ``loads_timed`` (Triton
compiles and kernel loads inside the timed point) and ``warm_compiles``.
"""

from __future__ import annotations

import csv
import json
from typing import Dict, List, Optional, Tuple

CSV_FIELDS = ("head_dim", "page", "ctx", "batch", "backend", "status", "prefill_ms",
              "decode_ms", "prefill_ratio", "decode_ratio", "compiles_timed", "loads_timed")
GAP_LIMIT = 0.05  # a first difference is accepted where the top-2 logprobs are this close


def read_rows(paths) -> List[dict]:
    """Every JSON line of the children's result files (missing files: none)."""
    rows = []
    for path in paths:
        try:
            with open(path) as fh:
                rows += [json.loads(line) for line in fh if line.strip()]
        except FileNotFoundError:
            continue
    return rows


def _key(r: dict) -> Tuple[int, int, int, int]:
    return (int(r["head_dim"]), int(r["page"]), int(r["ctx"]), int(r["batch"]))


def pair_rows(rows: List[dict], *, ours: str = "hygon", peer: str = "triton") -> List[dict]:
    """One record per (head_dim, page, ctx, batch): both backends' times and
    ``ours / peer`` ratios (None where either is missing)."""
    by: Dict[tuple, Dict[str, dict]] = {}
    for r in rows:
        if r.get("status") == "startup":
            continue
        by.setdefault(_key(r), {})[r["backend"]] = r
    out = []
    for key in sorted(by):
        rec = dict(zip(("head_dim", "page", "ctx", "batch"), key))
        for name, side in (("ours", by[key].get(ours)), ("peer", by[key].get(peer))):
            rec[name] = side
        a, b = rec["ours"], rec["peer"]
        for what in ("prefill_s", "decode_s"):
            va = a.get(what) if a else None
            vb = b.get(what) if b else None
            rec[what.replace("_s", "_ratio")] = va / vb if va and vb else None
        out.append(rec)
    return out


def _ms(side: Optional[dict], what: str) -> str:
    if side is None:
        return "not run"
    if side.get("status") != "ok":
        return side.get("status", "?")
    v = side.get(what)
    if not v:
        return "-"
    runs = side.get(what.replace("_s", "_runs_s")) or []
    text = f"{v * 1e3:.2f}"
    if len(runs) > 1:  # the median and the range of the repeats
        text += f" [{min(runs) * 1e3:.2f}-{max(runs) * 1e3:.2f}]"
    groups = side.get("prefill_groups") or 1
    if what == "prefill_s" and groups > 1:  # the batch was prefilled in several forwards
        text += f" ({groups} fwd)"
    return text


def _ratio(v: Optional[float]) -> str:
    return f"{v:.2f}x" if v else "-"


def _compiles(side: Optional[dict]) -> int:
    if not side or side.get("status") != "ok":
        return 0
    return len(side.get("compiles_timed") or []) + len(side.get("loads_timed") or [])


def format_table(pairs: List[dict], *, ours: str = "hygon", peer: str = "triton") -> str:
    """Markdown: one line per point, prefill latency and median decode step (ms) of both
    backends and the ratios ``ours / peer`` (below 1: ours faster)."""
    lines = [f"| head_dim | page | ctx | batch | prefill ms {ours} / {peer} | ratio | "
             f"decode step ms {ours} / {peer} | ratio | compiles in timed runs |",
             "|---|---|---|---|---|---|---|---|---|"]
    for p in pairs:
        o, t = p["ours"], p["peer"]
        if o and t and o.get("status") != "ok" and o.get("status") == t.get("status"):
            lines.append(f"| {p['head_dim']} | {p['page']} | {_k(p['ctx'])} | {p['batch']} | "
                         f"{o['status']} (both) | | | | |")
            continue
        lines.append(
            f"| {p['head_dim']} | {p['page']} | {_k(p['ctx'])} | {p['batch']} | "
            f"{_ms(o, 'prefill_s')} / {_ms(t, 'prefill_s')} | {_ratio(p['prefill_ratio'])} | "
            f"{_ms(o, 'decode_s')} / {_ms(t, 'decode_s')} | {_ratio(p['decode_ratio'])} | "
            f"{_compiles(o)} / {_compiles(t)} |")
    return "\n".join(lines)


def _bd(side: Optional[dict], phase: str, what: str, scale: float = 1.0,
        digits: int = 0) -> str:
    v = ((side or {}).get(f"{phase}_kernels") or {}).get(what)
    return "-" if v is None else f"{v * scale:.{digits}f}"


def _bd_ratio(p: dict, phase: str) -> str:
    a = ((p["ours"] or {}).get(f"{phase}_kernels") or {}).get("attention_us")
    b = ((p["peer"] or {}).get(f"{phase}_kernels") or {}).get("attention_us")
    return f"{a / b:.2f}x" if a and b else "-"


def _hooks(side: Optional[dict], phase: str) -> str:
    v = (side or {}).get(f"{phase}_hooks_host_us")
    return "-" if v is None else f"{v:.0f}"


def format_breakdown(pairs: List[dict], *, ours: str = "hygon", peer: str = "triton") -> str:
    """Markdown of ``--breakdown``: per decode step, GPU microseconds of the attention
    kernels (all layers; per layer beside it), the metadata kernels and everything else,
    and host microseconds of the backend's per-step hooks; per prefill, the attention and
    all kernels. ``ours / peer`` of the attention kernels (below 1: ours faster)."""
    lines = [f"| head_dim | page | ctx | batch | decode attention us/step {ours} / {peer} "
             f"(per layer) | ratio | decode metadata kernels us | decode other kernels us | "
             f"decode hooks host us | prefill attention ms {ours} / {peer} | ratio | "
             f"prefill all kernels ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in pairs:
        o, t = p["ours"], p["peer"]
        if not any(side and "decode_kernels" in side for side in (o, t)):
            continue
        layers = (o or t or {}).get("layers") or 0
        per_layer = "-"
        if layers:
            per_layer = f"{_bd(o, 'decode', 'attention_us', 1 / layers)} / " \
                        f"{_bd(t, 'decode', 'attention_us', 1 / layers)}"
        lines.append(
            f"| {p['head_dim']} | {p['page']} | {_k(p['ctx'])} | {p['batch']} | "
            f"{_bd(o, 'decode', 'attention_us')} / {_bd(t, 'decode', 'attention_us')} "
            f"({per_layer}) | {_bd_ratio(p, 'decode')} | "
            f"{_bd(o, 'decode', 'metadata_us')} / {_bd(t, 'decode', 'metadata_us')} | "
            f"{_bd(o, 'decode', 'other_us')} / {_bd(t, 'decode', 'other_us')} | "
            f"{_hooks(o, 'decode')} / {_hooks(t, 'decode')} | "
            f"{_bd(o, 'prefill', 'attention_us', 1e-3, 2)} / "
            f"{_bd(t, 'prefill', 'attention_us', 1e-3, 2)} | {_bd_ratio(p, 'prefill')} | "
            f"{_bd(o, 'prefill', 'all_us', 1e-3, 2)} / {_bd(t, 'prefill', 'all_us', 1e-3, 2)} |")
    return "\n".join(lines)


def _k(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def write_csv(path: str, pairs: List[dict], *, ours: str = "hygon", peer: str = "triton"):
    """One CSV line per (point, backend); the ratios repeated on both lines."""
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=CSV_FIELDS)
        w.writeheader()
        for p in pairs:
            for name, side in ((ours, p["ours"]), (peer, p["peer"])):
                ok = bool(side) and side.get("status") == "ok"
                w.writerow({
                    "head_dim": p["head_dim"], "page": p["page"], "ctx": p["ctx"],
                    "batch": p["batch"], "backend": name,
                    "status": side.get("status") if side else "not run",
                    "prefill_ms": f"{side['prefill_s'] * 1e3:.4f}" if ok and side.get(
                        "prefill_s") else "",
                    "decode_ms": f"{side['decode_s'] * 1e3:.4f}" if ok and side.get(
                        "decode_s") else "",
                    "prefill_ratio": f"{p['prefill_ratio']:.4f}" if p["prefill_ratio"] else "",
                    "decode_ratio": f"{p['decode_ratio']:.4f}" if p["decode_ratio"] else "",
                    "compiles_timed": len(side.get("compiles_timed") or []) if ok else "",
                    "loads_timed": len(side.get("loads_timed") or []) if ok else ""})


def first_difference(a: dict, b: dict) -> Optional[dict]:
    """Where two greedy outputs of one prompt first differ: ``index``, each side's token
    and the top-2 logprob gap there (``gap_a``, ``gap_b``; None if not reported), or
    None when identical."""
    ia, ib = a["output_ids"], b["output_ids"]
    for i in range(max(len(ia), len(ib))):
        ta = ia[i] if i < len(ia) else None
        tb = ib[i] if i < len(ib) else None
        if ta != tb:
            return {"index": i, "token_a": ta, "token_b": tb,
                    "gap_a": _gap(a, i), "gap_b": _gap(b, i)}
    return None


def _gap(side: dict, i: int) -> Optional[float]:
    top = side.get("top2") or []
    if i >= len(top) or len(top[i]) < 2:
        return None
    return abs(top[i][0][0] - top[i][1][0])


def compare_tokens(ours: dict, peer: dict) -> dict:
    """Per scenario: prompts, identical count, first differences, and cache hits
    (``cached_tokens`` summed) on each side. ``ok``: every prompt identical or first
    differing where either side's top-2 gap is below :data:`GAP_LIMIT`, and, in a
    ``shared_prefix`` scenario, cache hits on both sides."""
    report = {"scenarios": {}, "ok": True}
    for name, rows_a in ours["scenarios"].items():
        rows_b = peer["scenarios"].get(name, [])
        diffs = []
        for i, (a, b) in enumerate(zip(rows_a, rows_b)):
            d = first_difference(a, b)
            if d is not None:
                diffs.append({"prompt": i, **d})
        hits_a = sum(r.get("cached_tokens", 0) for r in rows_a)
        hits_b = sum(r.get("cached_tokens", 0) for r in rows_b)
        ok = len(rows_a) == len(rows_b) and all(
            min(g for g in (d["gap_a"], d["gap_b"], float("inf")) if g is not None)
            < GAP_LIMIT for d in diffs)
        if name.startswith("shared_prefix"):
            ok = ok and hits_a > 0 and hits_b > 0
        report["scenarios"][name] = {
            "prompts": len(rows_a), "identical": len(rows_a) - len(diffs), "diffs": diffs,
            "tokens": sum(len(r["output_ids"]) for r in rows_a), "cached_a": hits_a,
            "cached_b": hits_b, "ok": ok}
        report["ok"] = report["ok"] and ok
    return report


def format_tokens(report: dict, *, label: str, ours: str = "hygon",
                  peer: str = "triton") -> str:
    lines = [f"Greedy tokens, {label}: {ours} vs {peer}",
             f"| scenario | prompts | tokens each | identical | cached tokens {ours} / {peer} | "
             "first differences (prompt@step, top-2 gap) | ok |", "|---|---|---|---|---|---|---|"]
    for name, s in report["scenarios"].items():
        diffs = ", ".join(
            f"{d['prompt']}@{d['index']} gap {_fmt_gap(d['gap_a'])}/{_fmt_gap(d['gap_b'])}"
            for d in s["diffs"]) or "none"
        lines.append(f"| {name} | {s['prompts']} | {s['tokens'] // max(1, s['prompts'])} | "
                     f"{s['identical']} | {s['cached_a']} / {s['cached_b']} | {diffs} | "
                     f"{'yes' if s['ok'] else 'NO'} |")
    return "\n".join(lines)


def _fmt_gap(g: Optional[float]) -> str:
    return "?" if g is None else f"{g:.3f}"
