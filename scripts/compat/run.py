"""Engine-version compatibility matrix: build each version's environment (cached), run its
checks against this checkout, print a table (version x check -> pass / fail / n/a).

    python scripts/compat/run.py [--engine vllm|sglang|all] [--versions a,b] [--ci]
                                 [--cache DIR] [--markdown FILE] [--build-only]
                                 [--checks a,b (vllm)]

``make compat`` runs every version of every engine. ``--ci``: the oldest and the newest
supported version of each engine (each engine module's ``CI_VERSIONS``). Each engine is a
module beside this file (``vllm_checks``, ``sglang_checks``) exposing ``VERSIONS``,
``CI_VERSIONS``, ``build_env(version, cache_dir) -> python`` and ``run_checks(version,
python, repo) -> rows`` (dicts with engine, version, check, result, reason); an engine
whose module is absent is skipped with a note. An environment that cannot be built is
one ``env`` row with result ``fail`` and the reason. Exit status: 1 if any row failed.
``--build-only`` builds the environments and runs no check (CI builds them while its test
suite runs, then runs the checks on the cached environments).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

import compat_envs as envs  # noqa: E402

ENGINES = ["vllm", "sglang"]


def load_engine(name: str):
    """The engine's checks module, or None when this checkout has none."""
    try:
        return importlib.import_module(f"{name}_checks")
    except ModuleNotFoundError as exc:
        if exc.name == f"{name}_checks":
            return None
        raise


def run_engine(module, engine: str, versions, cache: pathlib.Path,
               build_only: bool = False, only=None) -> list[dict]:
    """Build each version's environment and run its checks (``build_only``: one ``env``
    row per version instead, ``pass`` with the build time; ``only``: those checks alone,
    for an engine module whose ``run_checks`` takes ``only``)."""
    rows = []
    for version in versions:
        start = time.time()
        try:
            python = module.build_env(version, cache)
        except Exception as exc:  # recorded in the table, the next version still runs
            reason = str(exc).strip().splitlines()
            rows.append({"engine": engine, "version": version, "check": "env",
                         "result": "fail", "reason": (reason[0] if reason else repr(exc))[:300]})
            envs.log(f"{engine} {version}: environment failed: {exc}")
            continue
        envs.log(f"{engine} {version}: environment {python} ({time.time() - start:.0f} s)")
        if build_only:
            rows.append({"engine": engine, "version": version, "check": "env",
                         "result": "pass", "reason": f"{python} ({time.time() - start:.0f} s)"})
            continue
        extra = {"only": only} if only else {}
        got = module.run_checks(version, pathlib.Path(python), REPO, **extra)
        rows.extend(got)
        envs.log(f"{engine} {version}: checks done in {time.time() - start:.0f} s")
    return rows


def table(rows: list[dict]) -> str:
    """A markdown table: one row per (engine, version), one column per check, each cell
    the result; the reasons below it, one line per non-pass cell (and per pass, short)."""
    checks = []
    for r in rows:
        if r["check"] not in checks:
            checks.append(r["check"])
    keys = []
    for r in rows:
        if (r["engine"], r["version"]) not in keys:
            keys.append((r["engine"], r["version"]))
    cell = {(r["engine"], r["version"], r["check"]): r for r in rows}
    lines = ["| engine | version | " + " | ".join(checks) + " |",
             "| --- | --- | " + " | ".join("---" for _ in checks) + " |"]
    for engine, version in keys:
        vals = [cell[(engine, version, c)]["result"] if (engine, version, c) in cell else ""
                for c in checks]
        lines.append(f"| {engine} | {version} | " + " | ".join(vals) + " |")
    lines.append("")
    for r in rows:
        if r.get("reason"):
            lines.append(f"- {r['engine']} {r['version']} {r['check']}: {r['result']}: "
                         f"{r['reason']}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=ENGINES + ["all"], default="all")
    parser.add_argument("--versions", help="comma-separated versions (one engine only)")
    parser.add_argument("--ci", action="store_true",
                        help="the oldest and newest supported version of each engine")
    parser.add_argument("--cache", type=pathlib.Path, default=None,
                        help="environment cache (default ~/.cache/hygon-attn-compat, "
                             "or HYGON_COMPAT_CACHE)")
    parser.add_argument("--markdown", type=pathlib.Path, help="also write the table here")
    parser.add_argument("--json", type=pathlib.Path,
                        help="also write the rows here (a JSON list of the row dicts)")
    parser.add_argument("--build-only", action="store_true",
                        help="build (or find) the environments, run no check")
    parser.add_argument("--checks", help="comma-separated check names (--engine vllm only)")
    args = parser.parse_args(argv)
    if args.versions and args.engine == "all":
        parser.error("--versions needs one --engine")
    only = [c.strip() for c in args.checks.split(",") if c.strip()] if args.checks else None
    if only and args.engine != "vllm":
        parser.error("--checks needs --engine vllm")
    cache = args.cache or envs.default_cache()
    os.environ["HYGON_COMPAT_CACHE"] = str(cache)  # the engine modules' default_cache()
    envs.log(f"environment cache {cache} ({envs.disk_free_gb(cache):.0f} GB free)")

    rows, notes = [], []
    for engine in (ENGINES if args.engine == "all" else [args.engine]):
        module = load_engine(engine)
        if module is None:
            notes.append(f"{engine}: no scripts/compat/{engine}_checks.py in this checkout")
            continue
        if args.versions:
            versions = [v.strip() for v in args.versions.split(",") if v.strip()]
        else:
            versions = list(module.CI_VERSIONS if args.ci else module.VERSIONS)
        rows.extend(run_engine(module, engine, versions, cache, args.build_only, only))

    text = table(rows) if rows else "no checks ran\n"
    if notes:
        text += "\n" + "\n".join(f"note: {n}" for n in notes) + "\n"
    print(text, end="")
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    count = {k: sum(r["result"] == k for r in rows) for k in ("pass", "fail", "n/a")}
    # the plain closing line CI logs are read for (n/a cells count as skipped)
    print(f"compat: {count['pass']} passed, {count['fail']} failed, {count['n/a']} skipped")
    return 1 if any(r["result"] == "fail" for r in rows) or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
