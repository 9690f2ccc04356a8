"""The fuzzer's CPU slice (Triton interpreter, fp16, tiny shapes, fixed seed) and its
reproducibility. The GPU run (>= 10,000 cases per op) is recorded in docs/reliability.md.
"""

from __future__ import annotations

import io

import pytest
import torch

from hygon_attn_backend import fuzz
from hygon_attn_backend.__main__ import build_parser

CPU = torch.device("cpu")
SLICE = {"decode": 24, "prefill": 24, "write_kv": 32, "copy_blocks": 24}


@pytest.mark.parametrize("op", fuzz.OPS)
def test_cpu_slice_has_no_failures(op):
    log = io.StringIO()
    failures = fuzz.fuzz(op, cases=SLICE[op], seed=20261130, device="cpu", out=log)
    assert failures == 0, log.getvalue()
    assert f"fuzz {op}: {SLICE[op]} cases, 0 failures" in log.getvalue()


@pytest.mark.parametrize("op", ["decode", "write_kv"])
def test_a_case_is_a_function_of_seed_and_index(op):
    profiles = fuzz.profiles_for(op, 7, tiny=True)
    first = fuzz.run_case(op, 7, 3, CPU, profiles)
    again = fuzz.run_case(op, 7, 3, CPU, profiles)
    other = fuzz.run_case(op, 8, 3, CPU, fuzz.profiles_for(op, 8, tiny=True))
    assert first == again and first[0] is None
    assert first[1] != other[1]


def test_a_failure_prints_seed_case_and_rerun_line(monkeypatch):
    """A case that raises is a failure: reported with the line that reruns it alone."""
    from hygon_attn_backend.fuzz import cache

    def broken(rng, prof, device, tiny):
        raise RuntimeError("planted")
    monkeypatch.setattr(cache, "copy_blocks_case", broken)
    log = io.StringIO()
    assert fuzz.fuzz("copy_blocks", cases=3, seed=5, device="cpu", out=log) == 3
    text = log.getvalue()
    assert "FAIL copy_blocks seed=5 case=2: raised RuntimeError: planted" in text
    assert "rerun: hygon-attn fuzz --op copy_blocks --seed 5 --case 2 --device cpu" in text


def test_shards_partition_the_cases():
    logs = [io.StringIO() for _ in range(2)]
    for i, log in enumerate(logs):
        fuzz.fuzz("copy_blocks", cases=5, seed=1, device="cpu", shard=(i, 2), out=log)
    assert "3 cases, 0 failures" in logs[0].getvalue()
    assert "2 cases, 0 failures" in logs[1].getvalue()


def test_cli_registers_fuzz():
    args = build_parser().parse_args(["fuzz", "--op", "prefill", "--cases", "3", "--seed",
                                      "9", "--shard", "1/4", "--device", "cpu"])
    assert (args.op, args.cases, args.seed, args.shard, args.device) == ("prefill", 3, 9,
                                                                         (1, 4), "cpu")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["fuzz", "--op", "nope"])
