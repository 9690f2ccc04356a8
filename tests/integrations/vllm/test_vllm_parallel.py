"""vLLM parallel serving through ``attention_backend="hygon"`` on CPU (slow: each case
starts two engines, one of them with two workers).

Tensor parallelism: TP=2 greedy tokens of the tiny random Llama (``tools.demo.engine``:
prefills, chunked prefill, prefix-cache hits, decode) equal the TP=1 tokens of vLLM's own
CPU backend; 4 query / 2 KV heads (one KV head a rank) and 6 / 2 (three query heads a
rank: a group that is not a power of two). Decode context parallelism: DCP=2 on TP=2
(one KV head, replicated on both ranks, each holding half of every sequence's cache)
against the same TP=1 run, on two GPUs only: vLLM 0.32's CPU build refuses DCP in its
slot mapping ("Context Parallelism is not supported on CPU."). See docs/parallel.md.

The workers run our Triton kernels in the CPU interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py and inherited by the engine's processes).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from hygon_attn_backend.tools.demo import engine as demo  # noqa: E402
from tests.support import vllm_parallel  # noqa: E402


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


def kernels_expected():
    return "Triton kernels" if os.environ.get("TRITON_INTERPRET") == "1" else "reference"


def check_same(ours, theirs):
    assert ours["kernels"].startswith(kernels_expected()), ours["kernels"]
    assert theirs["kernels"] == "vLLM's default"  # a CPU backend on CPU, FlashAttention on GPU
    for i, (a, b) in enumerate(zip(ours["tokens"], theirs["tokens"])):
        assert a == b, f"prompt {i}: hygon {a} vs vLLM's CPU backend {b}"
    assert len(ours["tokens"]) == len(theirs["tokens"]) == 6


@pytest.mark.slow
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (6, 2)])
def test_tp2_hygon_matches_tp1_cpu_backend(models, heads, kv_heads):
    model = models(heads, kv_heads)
    ours = vllm_parallel.generate(model, backend="hygon",
                                  options={"tensor_parallel_size": 2})
    theirs = vllm_parallel.generate(model, backend=None)
    check_same(ours, theirs)


@pytest.mark.gpu
@pytest.mark.slow
def test_dcp2_on_tp2_hygon_matches_tp1_default_backend(models):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("DCP=2 on TP=2 needs two GPUs (vLLM's CPU build refuses DCP)")
    model = models(4, 1)  # GQA with DCP: tensor_parallel_size >= DCP * KV heads
    ours = vllm_parallel.generate(model, backend="hygon", options={
        "tensor_parallel_size": 2, "decode_context_parallel_size": 2})
    theirs = vllm_parallel.generate(model, backend=None)
    check_same(ours, theirs)
