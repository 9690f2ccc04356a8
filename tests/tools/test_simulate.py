"""``hygon-attn simulate``: the accounting of small traces, worked out by hand, through
the contiguous baseline and the engines' own managers (vLLM's KVCacheManager, SGLang's
RadixCache and allocators)."""

import json

import pytest

from hygon_attn_backend.tools import cli
from hygon_attn_backend.tools.simulate import engine, managers, traces
from hygon_attn_backend.tools.simulate.traces import TraceRequest


def _req(prompt, output, after=None):
    """A request with explicit prompt ids and generated ids."""
    return TraceRequest(list(prompt), len(output), list(output), after)


def _run(trace, manager):
    return engine.simulate(trace, manager, trace_name="t")


def test_contiguous_max_len_reserves_whole_regions():
    # capacity 100, regions of 40: A [0,40) and B [40,80) fit, C waits for B's region.
    trace = [_req(range(10), [1, 2]), _req(range(20), [3]), _req(range(5), [4])]
    res = _run(trace, managers.ContiguousManager(100, reserve="max-len", max_len=40))
    # step 1: A 10+1, B 20+1 in 80 reserved; B finishes. step 2: A 12, C 5+1 in 80.
    assert res.steps == 2
    assert (res.sum_reserved, res.sum_used) == (160, 32 + 18)
    assert res.internal_waste == pytest.approx(1 - 50 / 160)
    assert res.external_waste == 0
    assert (res.peak_running, res.mean_running) == (2, 2)
    assert (res.prompt_tokens, res.hit_tokens, res.prefill_computed) == (35, 0, 35)


def test_contiguous_exact_counts_external_fragmentation():
    # capacity 10. A (3+1) at [0,4), B (2+3) at [4,9); after A leaves, C (4+1) needs 5
    # slots: 5 are free ([0,4) and [9,10)) but no hole holds 5 -> external waste, twice.
    trace = [_req([1, 2, 3], [9]), _req([4, 5], [9, 9, 9]), _req([6, 7, 8, 9], [9])]
    res = _run(trace, managers.ContiguousManager(10, reserve="exact", max_len=10))
    assert res.steps == 4
    assert res.sum_reserved == 9 + 5 + 5 + 5
    assert res.sum_used == (4 + 3) + 4 + 5 + 5
    assert res.sum_external == 5 + 5
    assert res.external_waste == pytest.approx(10 / (10 * 4))


def test_contiguous_refuses_a_request_longer_than_max_len():
    with pytest.raises(ValueError, match="max_len"):
        _run([_req(range(50), [1])], managers.ContiguousManager(100, max_len=40))


def test_a_request_that_never_fits_is_reported():
    with pytest.raises(ValueError, match="does not fit"):
        _run([_req(range(30), [1])], managers.ContiguousManager(20, reserve="exact",
                                                                max_len=40))


CHAT = [_req(range(1, 9), [101, 102]),  # turn 1: 8 prompt tokens, 2 generated
        _req(list(range(1, 9)) + [101, 102, 9], [103], after=0)]  # turn 2 holds turn 1


def test_sglang_radix_page_1_reuses_the_whole_previous_turn():
    pytest.importorskip("sglang.srt.mem_cache.radix_cache")
    res = _run(CHAT, managers.SglangManager(64, page_size=1))
    # turn 2 (11 tokens) matches its first 10 (the last token is always computed)
    assert (res.prompt_tokens, res.hit_tokens) == (8 + 11, 10)
    assert res.prefill_computed == 8 + 1
    # step 1: turn 1 holds 9 slots; step 2: 10; step 3: turn 2 holds 12 (10 shared + 2)
    assert res.steps == 3
    assert (res.sum_reserved, res.sum_used) == (9 + 10 + 12, 9 + 10 + 12)
    assert res.cached_at_end == 12  # the tree keeps the conversation, evictable


def test_sglang_radix_page_16_caches_only_whole_pages():
    pytest.importorskip("sglang.srt.mem_cache.radix_cache")
    res = _run(CHAT, managers.SglangManager(64, page_size=16))
    assert res.hit_tokens == 0  # 10 tokens are less than one page
    assert res.prefill_computed == 8 + 11
    assert (res.sum_reserved, res.sum_used) == (16 * 3, 9 + 10 + 12)


def test_vllm_block_hash_reuse_hits_only_full_blocks():
    pytest.importorskip("vllm.v1.core.kv_cache_manager")
    res = _run(CHAT, managers.VllmManager(64, block_size=4))
    # turn 1's full blocks: tokens 0-3 and 4-7 (its third block, 8-9, is partial)
    assert res.hit_tokens == 8
    assert res.prefill_computed == 8 + 3
    # blocks of 4: 9 tokens -> 3 blocks, 10 -> 3, turn 2's 12 -> 3
    assert (res.sum_reserved, res.sum_used) == (12 * 3, 9 + 10 + 12)


SHARED = [_req([7] * 8 + [1], [11]), _req([7] * 8 + [2], [12])]  # concurrent, one prefix


@pytest.mark.parametrize("spec,reserved", [("sglang-1", 12), ("vllm-4", 16)])
def test_concurrent_requests_share_one_copy_of_a_prefix(spec, reserved):
    pytest.importorskip("sglang.srt.mem_cache.radix_cache")
    pytest.importorskip("vllm.v1.core.kv_cache_manager")
    res = _run(SHARED, managers.make_manager(spec, 64, max_len=64))
    assert res.steps == 1 and res.peak_running == 2
    assert res.hit_tokens == 8  # the second request reads the first one's prefix
    # 8 shared slots + 2 per request; vLLM holds 2 shared blocks + one partial block each
    assert res.sum_used == 12
    assert res.sum_reserved == reserved


def test_vllm_preempts_the_last_admitted_request_when_blocks_run_out():
    pytest.importorskip("vllm.v1.core.kv_cache_manager")
    # 2 blocks of 4. A (4 + 4) and B (3 + 2) are admitted; A's first token needs a third
    # block: B is preempted and prefilled again after A has finished.
    trace = [_req([1, 2, 3, 4], [5, 6, 7, 8]), _req([9, 10, 11], [12, 13])]
    res = _run(trace, managers.VllmManager(8, block_size=4))
    assert res.preemptions == 1
    assert res.prefill_computed == 4 + 3 + 3
    assert res.steps == 4 + 2
    # sampled after each step's tokens: A alone at 5..8 tokens (2 blocks), then B at 4
    # (1 block) and 5 (2 blocks)
    assert res.sum_used == 5 + 6 + 7 + 8 + 4 + 5
    assert res.sum_reserved == 8 * 4 + 4 + 8
    assert res.peak_running == 1


def test_trace_file_reader(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": [1, 2, 3], "output_len": 2},
        {"prompt_len": 5, "output_len": 1, "after": 0},
        {"prompt": [1, 2], "output": [8, 9], "output_len": 2}]) + "\n")
    trace = traces.load_trace(str(path))
    assert [len(r.prompt) for r in trace] == [3, 5, 2]
    assert trace[1].after == 0 and trace[0].after is None
    assert trace[2].output == [8, 9] and len(trace[0].output) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt_len": 3, "output_len": 1, "after": 4}) + "\n")
    with pytest.raises(ValueError, match="after"):
        traces.load_trace(str(bad))


def test_builtin_chat_turns_extend_the_previous_turn():
    trace = traces.chat_trace(conversations=2, turns=3)
    for i, r in enumerate(trace):
        if r.after is not None:
            prev = trace[r.after]
            assert r.prompt[:prev.final_len] == prev.prompt + prev.output, i
    assert sum(r.after is None for r in trace) == 2


def test_cli_writes_table_and_csv(tmp_path, capsys):
    pytest.importorskip("sglang.srt.mem_cache.radix_cache")
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": list(range(1, 9)), "output": [101, 102], "output_len": 2},
        {"prompt": list(range(1, 9)) + [101, 102, 9], "output_len": 1, "after": 0}]))
    out_csv = tmp_path / "s.csv"
    argv = ["simulate", "--trace", str(path), "--managers", "contiguous-max,sglang-1",
            "--memory-tokens", "64", "--max-len", "32", "--csv", str(out_csv)]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "SGLang radix reuse, page 1" in text and "contiguous (max-len)" in text
    rows = out_csv.read_text().splitlines()
    assert len(rows) == 3 and rows[0].startswith("manager,")
    assert ",10," in rows[2]  # the radix manager's hit tokens


def test_cli_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "s.png"
    assert cli.main(["simulate", "--trace", "random", "--managers", "contiguous-max",
                     "--plot", str(png)]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_plot_without_matplotlib_says_how_to_get_it(tmp_path):
    try:
        import matplotlib  # noqa: F401
        pytest.skip("matplotlib is installed here")
    except ImportError:
        pass
    with pytest.raises(SystemExit, match=r"needs matplotlib, not installed: pip install matplotlib"):
        cli.main(["simulate", "--trace", "random", "--plot", str(tmp_path / "s.png")])
    assert not (tmp_path / "s.png").exists()
