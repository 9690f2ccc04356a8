"""Engine faults keep tokens right (CPU end to end, slow): vLLM preemption with recompute
and a request aborted mid-decode give the same greedy tokens with ``hygon`` as with
vLLM's own CPU backend under the same faults; SGLang's radix cache evicting under memory
pressure serves every request equal to a full recompute (tests/support/sglang_harness.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests import support

REPO = str(support.REPO)


def _first_difference(a, b, gaps):
    step = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return step, (gaps[step] if step < len(gaps) else float("nan"))


def _vllm_run(model_dir, backend, tmp_path):
    result = tmp_path / f"{backend}.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]),
               VLLM_CPU_KVCACHE_SPACE="1")
    if backend == "hygon" and os.environ.get("TRITON_INTERPRET") == "1":
        env["HYGON_ATTN_IMPL"] = "triton"  # our kernels, in Triton's interpreter
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "support", "vllm_faults.py"),
                           model_dir, backend, str(result)],
                          capture_output=True, text=True, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(result.read_text())


@pytest.mark.slow
def test_vllm_preemption_and_abort_match_default_backend(tmp_path):
    pytest.importorskip("vllm")
    from hygon_attn_backend.tools.demo import engine as demo

    model_dir = demo.build_tiny_llama(str(tmp_path / "model"))
    ours = _vllm_run(model_dir, "hygon", tmp_path)
    theirs = _vllm_run(model_dir, "default", tmp_path)
    assert ours["preempt"]["preemptions"] > 0, "the small KV cache must force preemption"
    for fault in ("preempt", "abort"):
        for i, (a, b) in enumerate(zip(ours[fault]["tokens"], theirs[fault]["tokens"])):
            step, gap = _first_difference(a, b, theirs[fault]["gaps"][i])
            assert a == b, (f"{fault} request {i}: first difference at step {step}, "
                            f"default backend's top-2 gap there {gap:.4f}")
    assert ours["abort"]["finished_ids"] == ["abort-0", "abort-2"]
    # the survivors of the abort generate what the same prompts generate without it
    assert ours["abort"]["tokens"] == [ours["preempt"]["tokens"][0],
                                       ours["preempt"]["tokens"][2]]


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_sglang_radix_eviction_under_memory_pressure(page_size, device):
    """A pool too small for the conversation history: the tree must evict unlocked leaves
    to serve new requests, and every extend and decode still equals a full recompute."""
    pytest.importorskip("sglang.srt.mem_cache.radix_cache")
    import random

    import torch

    from tests.support.budget import assert_within_budget
    from tests.support.sglang_harness import Server, TinyModel
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    model = TinyModel(num_heads=8, num_kv_heads=2, head_dim=32, dtype=torch.float16,
                      device=device)
    srv = Server(model, page_size=page_size, pool_tokens=256, max_context=256, max_reqs=4)
    rng = random.Random(page_size)
    evicted = 0
    for turn in range(8):
        prompt = [rng.randrange(1, 1000) for _ in range(60 + 7 * turn)]
        needed = len(prompt) + 2 + page_size
        while srv.allocator.available_size() < needed:
            before = srv.allocator.available_size()
            srv.tree.evict(EvictParams(num_tokens=needed))
            assert srv.allocator.available_size() > before, "nothing left to evict"
            evicted += 1
        req = srv.start(prompt)
        (out,) = srv.extend([req])
        positions = list(range(req.cached_len, len(prompt)))
        ref64 = model.oracle(prompt, positions, dtype=torch.float64)
        assert_within_budget(out, ref64, model.oracle(prompt, positions, dtype=model.dtype),
                             what=f"turn {turn} extend")
        (out,) = srv.decode([req], [rng.randrange(1, 1000)])
        full = req.tokens[:req.kv_len]
        ref64 = model.oracle(full, [req.kv_len - 1], dtype=torch.float64)
        assert_within_budget(out, ref64, model.oracle(full, [req.kv_len - 1],
                                                      dtype=model.dtype),
                             what=f"turn {turn} decode")
        srv.finish(req)
    assert evicted > 0, "the pool must run out and the tree evict"
