"""``hygon-attn bench mla-prefill`` as a user runs it (subprocess): a tiny shape through
Triton's CPU interpreter (its times are no speed; the rows' reference checks are real),
and the options it refuses."""

import json

import torch

from tests.tools.test_cli import run_cli

HAS_CUDA = torch.cuda.is_available()


def test_bench_mla_prefill_tiny_shape_runs_and_checks(tmp_path):
    out = tmp_path / "rows.json"
    res = run_cli("bench", "mla-prefill", "--shapes", "2,3,17", "--num-heads", "2",
                  "--head-dim-qk", "48", "--head-dim-v", "32", "--dtype", "float16",
                  "--mask", "both", "--rep-ms", "1", "--compare", "sdpa",
                  "--tiles", "default;16,32,4,1", "--json", str(out),
                  env=None if HAS_CUDA else {"TRITON_INTERPRET": "1"}, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "| shape | Hq/Hkv | page | impl |" in res.stdout
    rows = json.loads(out.read_text())["rows"]
    ours = [r for r in rows if r["impl"] == "hygon"]
    assert len(ours) == 4  # two tiles x two masks
    assert {r["page"] for r in ours} == {"causal", "no mask"}
    for r in ours:  # each output was checked against the reference before it was timed
        assert r["status"] == "ok", r
        assert float(r["max_err"]) <= float(r["budget"])
        assert r["value"] > 0 and r["ms"] > 0
    assert any("tile 16,32,4,1, QK 32+16" in r["note"] for r in ours)
    peers = [r for r in rows if r["impl"].startswith("sdpa")]
    assert peers and all(r["status"] == "ok" if HAS_CUDA else "not available on CPU"
                         in r["status"] for r in peers)


def test_bench_mla_prefill_refuses_bad_options():
    res = run_cli("bench", "mla-prefill", "--compare", "xyz")
    assert res.returncode != 0 and "--compare: unknown peer(s) ['xyz']" in res.stderr
    res = run_cli("bench", "mla-prefill", "--impl", "native,sdpa")
    assert res.returncode != 0 and "--impl: a comma list of auto, triton, native" in res.stderr
    res = run_cli("bench", "mla-prefill", "--tiles", "16,16")
    assert res.returncode == 2 and "--tiles" in res.stderr
    res = run_cli("bench", "mla-prefill", "--shapes", "1,2")
    assert res.returncode == 2 and "--shapes" in res.stderr


def test_bench_mla_prefill_extend_op(tmp_path):
    out = tmp_path / "rows.json"
    res = run_cli("bench", "mla-prefill", "--op", "extend", "--shapes", "2,5,6",
                  "--num-heads", "4", "--head-dim-qk", "72", "--head-dim-v", "64",
                  "--block-size", "4", "--dtype", "float16", "--rep-ms", "1",
                  "--json", str(out),
                  env=None if HAS_CUDA else {"TRITON_INTERPRET": "1"}, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["status"] for r in rows] == ["ok"]
    assert rows[0]["page"] == "extend P=4" and rows[0]["num_kv_heads"] == 1
    assert float(rows[0]["max_err"]) <= float(rows[0]["budget"])
