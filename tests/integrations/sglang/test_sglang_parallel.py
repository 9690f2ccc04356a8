"""SGLang tensor parallelism through ``attention_backend="hygon"``: the offline Engine of
examples/sglang_offline.py (its three rounds: prefills, RadixCache prefix hits, decode) at
``tp_size=2`` generates the same greedy tokens as SGLang's own backend at TP=1
(``torch_native`` on a CPU, ``triton`` on GPUs), on the tiny random Llama of
``tools.demo.engine`` with 4 query / 2 KV heads (one KV head a rank) and 6 / 2 (three
query heads a rank: a group that is not a power of two). Each rank's start-up line says
which heads its backend plans for, read from SGLang's parallel state. Slow: two engine
start-ups a case. See docs/parallel.md.

On a CPU the ranks talk over gloo and run our Triton kernels in the interpreter
(TRITON_INTERPRET=1, set by tests/conftest.py and inherited by the engine's processes).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from hygon_attn_backend.tools.demo import engine as demo
from tests import support

pytest.importorskip("sglang")

REPO = str(support.REPO)
EXAMPLE = os.path.join(REPO, "examples", "sglang_offline.py")
#: (query heads, KV heads) of the model; every case runs at TP=2
CASES = [(4, 2), (6, 2)]
TP = 2
STARTUP = re.compile(r"TP(\d+)\] hygon attention backend: .*? heads a rank: (\d+) q / (\d+) kv "
                     r"\((.*)\)")


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def run_engine(model_dir: str, *, backend: str, tp_size: int, timeout: float = 900.0) -> dict:
    """The example's workload on one engine in a fresh process: ``{"output_ids", "cached",
    "ranks": {tp rank: (q heads, kv heads, kernels)}}`` (``ranks`` from the hygon backend's
    start-up line of each rank's log; empty for another backend)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(
        os.pathsep) if p])
    cmd = [sys.executable, EXAMPLE, "--child", "--backend", backend, "--model", model_dir,
           "--device", _device(), "--tp-size", str(tp_size), "--log-level", "info"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout,
                          cwd=REPO)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{backend} at TP={tp_size} failed:\n{log[-6000:]}"
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["ranks"] = {int(m.group(1)): (int(m.group(2)), int(m.group(3)), m.group(4))
                    for m in STARTUP.finditer(log)}
    return res


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    made = {}

    def build(heads, kv_heads):
        if (heads, kv_heads) not in made:
            path = str(tmp_path_factory.mktemp(f"tiny_llama_{heads}_{kv_heads}"))
            made[heads, kv_heads] = demo.build_tiny_llama(
                path, num_heads=heads, num_kv_heads=kv_heads,
                hidden=demo.HIDDEN if demo.HIDDEN % heads == 0 else 16 * heads)
        return made[heads, kv_heads]

    return build


@pytest.mark.slow
@pytest.mark.parametrize("heads,kv_heads", CASES)
def test_tp2_hygon_matches_tp1_sglang_backend(models, heads, kv_heads):
    if not [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "hygon"]:
        pytest.skip("package not installed (pip install -e .): SGLang's scheduler processes "
                    "find the backend through the entry point")
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() < TP:
        pytest.skip(f"TP={TP} on GPUs needs {TP} of them")
    model = models(heads, kv_heads)
    ours = run_engine(model, backend="hygon", tp_size=TP)
    reference = "triton" if _device() == "cuda" else "torch_native"
    theirs = run_engine(model, backend=reference, tp_size=1)

    assert sorted(ours["ranks"]) == list(range(TP)), ours["ranks"]
    for rank, (q, kv, kernels) in ours["ranks"].items():
        assert (q, kv) == (heads // TP, kv_heads // TP), f"rank {rank}: {q} q / {kv} kv"
        assert kernels.startswith("Triton kernels"), f"rank {rank}: {kernels}"
    assert theirs["ranks"] == {}, "the reference run used the hygon backend"
    assert len(ours["output_ids"]) == len(theirs["output_ids"]) == 4
    for i, (a, b) in enumerate(zip(ours["output_ids"], theirs["output_ids"])):
        assert a == b, f"request {i}: hygon at TP={TP} {a} vs {reference} at TP=1 {b}"
    # chat B's first turn and chat A's second were served partly from the radix cache
    assert ours["cached"][1] > 0 and ours["cached"][3] > 0, ours["cached"]


def test_cpu_omp_bind_gives_each_rank_its_own_cores(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert demo.cpu_omp_bind(2) == "0|1"
    assert demo.cpu_omp_bind(1) == "0-1"
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    assert demo.cpu_omp_bind(2) == "0-3|4-7"
    assert demo.cpu_omp_bind(3) == "0-1|2-3|4-5"
    monkeypatch.setattr(os, "cpu_count", lambda: 1)
    assert demo.cpu_omp_bind(2) == "0|0"  # more ranks than cores: they share the last one
    with pytest.raises(ValueError, match="workers"):
        demo.cpu_omp_bind(0)
