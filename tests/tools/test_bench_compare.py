"""``hygon-attn bench decode|prefill --compare/--csv/--plot`` on a CPU: the wiring runs
through Triton's interpreter on tiny shapes (its times are no speed); peers that cannot
run here are reported, never an error; every output is checked against the reference
before it is timed."""

import csv

import pytest
import torch

from hygon_attn_backend.tools import cli
from hygon_attn_backend.tools.bench import _harness, output, peers, problems

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="CPU wiring tests (the GPU run is in docs/benchmarks.md)")

TINY = ["--block-sizes", "16", "--num-q-heads", "4", "--num-kv-heads", "2", "--head-dim",
        "32", "--dtype", "float16", "--rep-ms", "1"]


def _rows(path):
    with open(path) as fh:
        return list(csv.DictReader(fh))


def test_parse_compare():
    assert peers.parse_compare("sglang, SDPA") == ["sglang", "sdpa"]
    assert peers.parse_compare("all") == list(peers.PEERS)
    assert peers.parse_compare("") == []
    with pytest.raises(ValueError, match="flashattn"):
        peers.parse_compare("sdpa,flashattn")


def test_decode_compare_reports_every_peer_and_writes_csv(tmp_path, capsys):
    out = tmp_path / "d.csv"
    argv = ["bench", "decode", "--shapes", "2,40", "--groups", "", "--per-head-groups", "",
            "--partitions", "auto", "--compare", "sglang,vllm,flashinfer,sdpa",
            "--csv", str(out)] + TINY
    assert cli.main(argv) == 0
    rows = {r["impl"]: r for r in _rows(out)}
    assert rows["hygon"]["status"] == "ok" and float(rows["hygon"]["value"]) > 0
    assert float(rows["hygon"]["max_err"]) <= float(rows["hygon"]["budget"])
    for name in ("sdpa flash", "sdpa cudnn"):
        assert rows[name]["status"].startswith("not available on CPU")
    for name in ("vllm unified", "flashinfer"):
        assert rows[name]["status"] in ("not installed",) or "CUDA GPU" in rows[name]["status"]
    sglang = rows["sglang triton"]["status"]
    assert sglang == "ok" or sglang == "not installed", sglang  # its kernel, interpreted
    assert "| hygon |" in capsys.readouterr().out


def test_prefill_compare_writes_csv(tmp_path):
    out = tmp_path / "p.csv"
    argv = ["bench", "prefill", "--shapes", "1,16,20", "--kv-source", "both",
            "--compare", "sdpa", "--csv", str(out)] + TINY
    assert cli.main(argv) == 0
    rows = _rows(out)
    assert [r["impl"] for r in rows] == ["hygon", "hygon (new K/V dense)", "sdpa flash",
                                         "sdpa cudnn"]
    assert all(r["status"] == "ok" for r in rows[:2]), rows
    assert float(rows[0]["pct_of_ceiling"]) > 0


def test_without_a_device_bench_says_what_it_needs(monkeypatch, capsys):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert cli.main(["bench", "decode", "--compare", "sdpa"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


def _decode_problem():
    return problems.build_decode(batch=2, ctx=40, page_size=16, num_q_heads=4,
                                 num_kv_heads=2, head_dim=32, dtype=torch.float16,
                                 device="cpu")


def test_a_wrong_output_is_reported_and_not_timed():
    prob = _decode_problem()
    timed = []

    def fn():
        timed.append(1)
        out.copy_(prob.q)  # not attention
    out = torch.empty_like(prob.q)
    row = _harness.run_one(peers.Runner("bad", fn, out), lambda o: problems.check_decode(prob, o),
                           base=dict(op="decode", impl="bad"), graph=True, rep_ms=1,
                           work=prob.kv_bytes(), ceiling=1.0, device=prob.q.device)
    assert row["status"].startswith("wrong"), row
    assert "ms" not in row and len(timed) == 1


def test_an_unwritten_output_is_wrong():
    prob = _decode_problem()
    out = torch.empty_like(prob.q)
    row = _harness.run_one(peers.Runner("lazy", lambda: None, out),
                           lambda o: problems.check_decode(prob, o),
                           base=dict(op="decode", impl="lazy"), graph=True, rep_ms=1,
                           work=1, ceiling=1.0, device=prob.q.device)
    assert row["status"].startswith("wrong")


@pytest.mark.parametrize("prefix", [0, 16])
def test_sdpa_dense_equivalent_matches_the_reference(prefix):
    """The dense tensors and masks the SDPA peer builds (math backend on a CPU)."""
    prob = problems.build_prefill(batch=2, prefix=prefix, extend=20, page_size=16,
                                  num_q_heads=4, num_kv_heads=2, head_dim=32,
                                  dtype=torch.float16, device="cpu")
    runner = peers.sdpa_prefill(prob, "math")
    runner.fn()
    ok, err, budget = problems.check_prefill(prob, runner.out)
    assert ok, (err, budget)
    dprob = _decode_problem()
    runner = peers.sdpa_decode(dprob, "math")
    runner.fn()
    assert problems.check_decode(dprob, runner.out)[0]


def test_prefill_problem_stores_the_new_tokens_in_the_cache():
    prob = problems.build_prefill(batch=2, prefix=5, extend=7, page_size=4, num_q_heads=2,
                                  num_kv_heads=1, head_dim=8, dtype=torch.float16,
                                  device="cpu")
    slots = prob.token_slots(5, 12)  # [2, 7]
    rows = prob.k_store.view(-1, 1, 8)[slots.reshape(-1)]
    assert torch.equal(rows, prob.k_new)
    assert sorted(prob.block_table.reshape(-1).tolist()) == list(range(2 * 3))


def test_plot_draws_the_ceiling(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [dict(op="decode", batch=b, ctx=c, page=16, impl=i, status="ok", value=v,
                 pct=v / 40, num_q_heads=32, num_kv_heads=8)
            for b, c in ((1, 32768), (8, 8192)) for i, v in (("hygon", 30), ("sdpa flash", 20))]
    rows.append(dict(rows[0], impl="vllm unified", status="not installed"))
    png = tmp_path / "d.png"
    output.write_plot(str(png), rows, title="t", unit="GB/s", ceiling=40, ceiling_name="copy")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_parser_knows_the_new_flags_and_simulate():
    parser = cli.build_parser()
    for op in ("decode", "prefill"):
        args = parser.parse_args(["bench", op, "--compare", "sglang,sdpa", "--csv", "a.csv",
                                  "--plot", "a.png"])
        assert (args.compare, args.csv, args.plot) == ("sglang,sdpa", "a.csv", "a.png")
    args = parser.parse_args(["simulate", "--trace", "chat", "--memory-tokens", "4096"])
    assert args.command == "simulate" and args.memory_tokens == 4096
    assert args.func.__module__.endswith("simulate.cli")


def test_an_unknown_peer_is_a_usage_error():
    with pytest.raises(SystemExit, match="unknown peer"):
        cli.main(["bench", "decode", "--compare", "sdpa,nope"])


def test_decode_impl_list_times_each_and_reports_what_cannot_run(tmp_path):
    """--impl triton,native: one row per implementation; native needs a GPU, so on the
    CPU its row says why instead of failing the run."""
    out = tmp_path / "d.csv"
    argv = ["bench", "decode", "--shapes", "2,40", "--groups", "", "--per-head-groups", "",
            "--partitions", "auto", "--impl", "triton,native", "--csv", str(out)] + TINY
    assert cli.main(argv) == 0
    rows = {r["impl"]: r for r in _rows(out)}
    assert set(rows) == {"hygon [triton]", "hygon [native]", "device copy, same bytes"}
    assert rows["hygon [triton]"]["status"] == "ok"
    copy = rows["device copy, same bytes"]  # the reference row, on by default
    assert copy["status"] == "ok" and float(copy["value"]) > 0
    assert "needs CUDA/HIP tensors" in rows["hygon [native]"]["status"]
    assert cli.main(argv + ["--no-same-bytes-copy"]) == 0
    assert "device copy, same bytes" not in {r["impl"] for r in _rows(out)}
    with pytest.raises(SystemExit, match="--impl"):
        cli.main(["bench", "decode", "--impl", "triton,cuda"])
    with pytest.raises(SystemExit, match="without repeats"):
        cli.main(["bench", "decode", "--impl", "native,native"])


def test_l2_flush_choice_reaches_the_timer_and_the_report(tmp_path, capsys):
    """--l2-flush read: the run says how the L2 was evicted (header and JSON); the next
    run without the flag is back on do_bench's write; a bad choice is a usage error."""
    import json

    from hygon_attn_backend.tools.bench import _timing
    out = tmp_path / "d.json"
    argv = ["bench", "decode", "--shapes", "2,40", "--groups", "", "--per-head-groups", "",
            "--partitions", "auto", "--no-same-bytes-copy", "--json", str(out)] + TINY
    assert cli.main(argv + ["--l2-flush", "read"]) == 0
    assert "(by a read)" in capsys.readouterr().out
    assert json.loads(out.read_text())["l2_flush"] == "read"
    assert _timing.L2_FLUSH == "read"
    assert cli.main(argv) == 0
    assert "(by a write)" in capsys.readouterr().out and _timing.L2_FLUSH == "write"
    with pytest.raises(SystemExit):
        cli.main(argv + ["--l2-flush", "dirty"])
    with pytest.raises(ValueError, match="l2 flush"):
        _timing.set_l2_flush("dirty")
