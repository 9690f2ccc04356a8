"""``hygon-attn bench decode|prefill --kv-dtype``: fp8 rows beside the 16-bit ones in one
run, through the command line (subprocess, Triton's interpreter, tiny shapes): exit code,
the rows, their reference check and the ratio to the ``auto`` row."""

import csv
import os
import subprocess
import sys

import pytest
import torch

from tests import support

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CPU wiring tests (the GPU run is in docs/benchmarks.md)")

TINY = ["--block-sizes", "16", "--num-q-heads", "4", "--num-kv-heads", "2", "--head-dim",
        "32", "--dtype", "float16", "--rep-ms", "1"]


def _bench(*argv):
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-m", "hygon_attn_backend", "bench", *argv],
                          cwd=support.REPO, capture_output=True, text=True, timeout=600,
                          env=env)


def _rows(path):
    with open(path) as fh:
        return {r["impl"]: r for r in csv.DictReader(fh)}


def test_decode_kv_dtype_rows_beside_auto(tmp_path):
    out = tmp_path / "d.csv"
    res = _bench("decode", "--kv-dtype", "auto,fp8_e4m3,fp8_e5m2", "--shapes", "2,40",
                 "--groups", "", "--per-head-groups", "", "--partitions", "auto",
                 "--compare", "sdpa", "--csv", str(out), *TINY)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = _rows(out)
    for name in ("hygon", "hygon [fp8_e4m3]", "hygon [fp8_e5m2]"):
        assert rows[name]["status"] == "ok", rows[name]
        assert float(rows[name]["max_err"]) <= float(rows[name]["budget"])
    for kv in ("fp8_e4m3", "fp8_e5m2"):
        assert rows[f"hygon [{kv}]"]["note"].endswith("x auto"), rows[f"hygon [{kv}]"]
        assert rows[f"sdpa flash [{kv}]"]["status"].startswith("no fp8 KV")
    assert "| hygon [fp8_e4m3] |" in res.stdout


def test_prefill_kv_dtype_rows(tmp_path):
    out = tmp_path / "p.csv"
    res = _bench("prefill", "--kv-dtype", "auto,fp8_e5m2", "--shapes", "1,16,20",
                 "--kv-source", "both", "--csv", str(out), *TINY)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = _rows(out)
    for name in ("hygon", "hygon (new K/V dense)", "hygon [fp8_e5m2]",
                 "hygon (new K/V dense) [fp8_e5m2]"):
        assert rows[name]["status"] == "ok", rows[name]
    assert "x auto" in rows["hygon [fp8_e5m2]"]["note"]


def test_kv_dtype_option_refuses_unknown_names():
    res = _bench("decode", "--kv-dtype", "auto,fp4", "--shapes", "2,40")
    assert res.returncode == 2
    assert "--kv-dtype" in res.stderr and "fp4" in res.stderr
