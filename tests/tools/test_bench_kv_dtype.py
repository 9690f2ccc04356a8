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


def _decode_rows(tmp_path, kv_dtypes: str, peer: str):
    """``bench decode`` at one tiny shape: ``(rows by impl, the process)``."""
    out = tmp_path / "d.csv"
    res = _bench("decode", "--kv-dtype", kv_dtypes, "--shapes", "2,40", "--groups", "",
                 "--per-head-groups", "", "--partitions", "auto", "--compare", peer,
                 "--csv", str(out), *TINY)
    assert res.returncode == 0, res.stderr[-2000:]
    return _rows(out), res


def test_decode_kv_dtype_rows_beside_auto(tmp_path):
    rows, res = _decode_rows(tmp_path, "auto,fp8_e4m3,fp8_e5m2", "sdpa")
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
    res = _bench("prefill", "--fp8-workspace", "auto,sometimes", "--shapes", "1,16,20")
    assert res.returncode == 2
    assert "--fp8-workspace" in res.stderr and "sometimes" in res.stderr


def test_per_head_scale_rows_beside_per_tensor(tmp_path):
    """``*_per_head`` names: the caches quantized with one scale a KV head, our rows checked
    against the reference and related to ``auto``; a peer says it takes per-tensor scales."""
    rows, _ = _decode_rows(tmp_path, "auto,fp8_e4m3_per_head", "sglang")
    ours = rows["hygon [fp8_e4m3_per_head]"]
    assert ours["status"] == "ok" and float(ours["max_err"]) <= float(ours["budget"]), ours
    assert ours["note"].endswith("x auto"), ours
    peer = [r for name, r in rows.items() if name.endswith("[fp8_e4m3_per_head]")
            and not name.startswith(("hygon", "device copy"))]
    assert peer and all(r["status"].startswith(("per-tensor fp8 scales only", "not installed"))
                        for r in peer), peer
    out = tmp_path / "p.csv"
    res = _bench("prefill", "--kv-dtype", "fp8_e5m2_per_head", "--shapes", "1,16,20",
                 "--kv-source", "both", "--csv", str(out), *TINY)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = _rows(out)
    for name in ("hygon [fp8_e5m2_per_head]", "hygon (new K/V dense) [fp8_e5m2_per_head]"):
        assert rows[name]["status"] == "ok", rows[name]


def test_per_head_quantization_scales_each_head_by_its_amax():
    from hygon_attn_backend.tools.bench import problems

    k = torch.randn(3, 4, 2, 8) * torch.tensor([1.0, 10.0]).view(1, 1, 2, 1)
    v = torch.randn(3, 4, 2, 8)
    v[:, :, 1] = 0  # an all-zero head takes scale 1
    k8, v8, ks, vs = problems.quantize_caches(k, v, torch.float8_e4m3fn, per_head=True)
    fmax = torch.finfo(torch.float8_e4m3fn).max
    assert ks.shape == vs.shape == (2,) and ks.dtype == torch.float32
    assert torch.allclose(ks, k.abs().amax(dim=(0, 1, 3)) / fmax)
    assert vs[1] == 1.0 and torch.all(v8[:, :, 1].float() == 0)
    assert k8.float().abs().amax() == fmax  # each head's amax maps to the format's largest


def test_mla_refuses_per_head_scale_names():
    res = _bench("mla", "--kv-dtype", "auto,fp8_e4m3_per_head", "--shapes", "2,40")
    assert res.returncode == 2
    assert "auto, fp8_e4m3, fp8_e5m2 without repeats" in res.stderr  # no per-head names
