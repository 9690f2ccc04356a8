"""``hygon-attn bench decode --dcp W``: one rank's shard of decode context parallelism
(1/W of every sequence, with the LSE) plus the merge, beside the DCP=1 decode, with its
time ratio in the row's note. On a CPU the interpreter runs it at a tiny shape (its times
are no speed); the GPU row is the 128k point of docs/parallel.md."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tests import support
from hygon_attn_backend.tools.bench import decode as bench_decode

TINY = ["--shapes", "2,40", "--block-sizes", "16", "--num-q-heads", "4", "--num-kv-heads",
        "1", "--head-dim", "32", "--partitions", "auto", "--per-head-groups", "",
        "--no-same-bytes-copy", "--rep-ms", "1"]


def _cli(args, tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-m", "hygon_attn_backend", "bench", "decode",
                           *args], capture_output=True, text=True, env=env,
                          cwd=str(support.REPO), timeout=900)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path of the command")
def test_dcp_row_is_checked_timed_and_compared(tmp_path):
    out = tmp_path / "rows.json"
    res = _cli(TINY + ["--dcp", "2", "--json", str(out)], tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    base = [r for r in rows if r["impl"] == "hygon"]
    dcp = [r for r in rows if r["impl"] == "hygon DCP=2 rank (shard + merge)"]
    assert len(base) == 1 and len(dcp) == 1, [r["impl"] for r in rows]
    assert base[0]["status"] == "ok" and dcp[0]["status"] == "ok", dcp[0]
    # the shard's output passed the reference check of its own 20-key problem
    assert float(dcp[0]["max_err"]) <= float(dcp[0]["budget"])
    assert "ctx 20 a rank" in dcp[0]["note"]
    ratio = dcp[0]["ms"] / base[0]["ms"]
    assert f"{ratio:.2f}x hygon (DCP=1)" in dcp[0]["note"]
    assert "hygon DCP=2 rank (shard + merge)" in res.stdout


def test_dcp_option_is_checked(tmp_path):
    res = _cli(["--dcp", "0"], tmp_path)
    assert res.returncode == 2 and "--dcp" in res.stderr, res.stderr


def test_ratio_note_names_the_dcp1_row_or_its_absence():
    rows = [dict(impl="hygon (dcu rule)", status="ok", ms=2.0),
            dict(impl="hygon", status="ok", ms=4.0)]
    assert bench_decode.dcp_ratio_note(1.0, rows) == "0.50x hygon (dcu rule) (DCP=1)"
    assert bench_decode.dcp_ratio_note(1.0, [dict(impl="hygon", status="wrong")]) == \
        "no DCP=1 row of this shape to compare with"
