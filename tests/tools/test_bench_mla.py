"""``hygon-attn bench mla`` on the CPU (Triton's interpreter): the table's rows, each
checked against the reference before it is timed, and its option errors."""

import os
import subprocess
import sys


def _run(*args):
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-m", "hygon_attn_backend", "bench", "mla", *args],
                          capture_output=True, text=True, env=env, timeout=600)


def test_bench_mla_rows_on_the_interpreter():
    res = _run("--kv-lora-rank", "32", "--rope-dim", "16", "--block-sizes", "16",
               "--mtp", "2", "--tiles", "16,16,4,1", "--rep-ms", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    table = res.stdout[res.stdout.index("| shape |"):]
    rows = [line for line in table.splitlines() if line.startswith("| B=")]
    impls = [line.split("|")[4].strip() for line in rows]
    assert impls == ["hygon", "hygon (tile (16, 16, 4, 1))", "device copy, same bytes",
                     "hygon q_len 2", "hygon q_len 2 (tile (16, 16, 4, 1))"], table
    assert all("wrong" not in line and "error" not in line for line in rows), table
    assert "x q_len 1" in rows[3]


def test_bench_mla_refuses_a_bad_tile_and_peer():
    res = _run("--tiles", "16,16,4")
    assert res.returncode != 0 and "--tiles must be 'BLOCK_M,BLOCK_N,warps,stages" in res.stderr
    res = _run("--compare", "flashmla")
    assert res.returncode != 0 and "unknown peer(s) ['flashmla']" in res.stderr


def test_bench_mla_fp8_rows_beside_the_16_bit_ones():
    """``--kv-dtype``: every point once a cache dtype, the fp8 rows checked against the
    reference with their scale, labelled, related to the ``auto`` row; a peer without an
    fp8 latent path says so instead of a time."""
    res = _run("--kv-lora-rank", "32", "--rope-dim", "16", "--block-sizes", "16", "--mtp", "",
               "--kv-dtype", "auto,fp8_e4m3", "--compare", "sglang", "--rep-ms", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    table = res.stdout[res.stdout.index("| shape |"):]
    rows = {line.split("|")[4].strip(): line for line in table.splitlines()
            if line.startswith("| B=")}
    assert "hygon" in rows and "hygon [fp8_e4m3]" in rows, table
    fp8 = rows["hygon [fp8_e4m3]"]
    assert "x auto" in fp8 and "wrong" not in fp8 and "error" not in fp8, table
    assert "16-bit caches only" in rows["sglang [fp8_e4m3]"], table
    res = _run("--kv-dtype", "fp8_e4m3,fp8_e4m3")
    assert res.returncode != 0 and "--kv-dtype" in res.stderr
