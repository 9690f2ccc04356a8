"""``hygon-attn bench verify`` on a CPU (Triton's interpreter): the CLI runs the tiny
shape, checks every row against the reference before timing it, and prints the chain's
and the tree's rows: our verify on the decode and prefill structures, our plain decode of
the same batch, SGLang's Triton verify (run here when SGLang is installed, a row saying why
not otherwise), FlashInfer's custom-mask prefill (a row saying it needs a CUDA GPU) and the
device copy."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests import support

TINY = ["--batch", "2", "--prefix", "40", "--chain", "3", "--tree=-1,0,0,1", "--num-q-heads",
        "4", "--num-kv-heads", "2", "--head-dim", "32", "--rep-ms", "1"]


def _run(args, tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(
        [str(support.REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                               if p]))
    return subprocess.run([sys.executable, "-m", "hygon_attn_backend", "bench", "verify"]
                          + args, capture_output=True, text=True, env=env, timeout=900,
                          cwd=str(tmp_path))


def test_bench_verify_prints_every_row(tmp_path):
    out = tmp_path / "verify.json"
    proc = _run(TINY + ["--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| B=2")]
    impls = ["hygon decode, same batch", "hygon verify (decode)", "hygon verify (prefill)",
             "sglang triton verify", "flashinfer fa2 verify", "device copy, same bytes"]
    for case, ctx in (("chain 3", 43), ("tree 4", 44)):
        mine = [line for line in table if f"ctx={ctx} " in line]
        assert [next(i for i in impls if f"| {i} |" in line) for line in mine] == impls, mine
    rows = json.loads(out.read_text())["rows"]
    ours = [r for r in rows if r["impl"].startswith("hygon")]
    assert len(ours) == 6 and all(r["status"] == "ok" for r in ours), ours
    verify = [r for r in ours if r["impl"].startswith("hygon verify")]
    assert all("x decode" in r["note"] for r in verify)
    sglang = [r for r in rows if r["impl"] == "sglang triton verify"]
    if importlib.util.find_spec("sglang") is not None:
        assert all(r["status"] == "ok" for r in sglang), sglang
    else:
        assert all(r["status"] == "not installed" for r in sglang), sglang
    flashinfer = [r for r in rows if r["impl"] == "flashinfer fa2 verify"]
    assert len(flashinfer) == 2 and all(r["status"] == "needs a CUDA GPU"
                                        for r in flashinfer), flashinfer


@pytest.mark.parametrize("tree", ["0", "-1,1", "a"])
def test_bench_verify_refuses_a_bad_tree(tree, tmp_path):
    proc = _run(["--tree=" + tree], tmp_path)
    assert proc.returncode == 2
    assert "--tree" in proc.stderr and "parent" in proc.stderr
