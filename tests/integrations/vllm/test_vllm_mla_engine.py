"""End to end in vLLM's engine: a tiny random-weight DeepSeek-V2-style (MLA) model built
here (``tests/support/vllm_mla.py``, no download) generates the same greedy tokens with
``attention_backend="hygon"`` (our MLA backend: Triton kernels, in the interpreter on a
CPU) as with vLLM's own CPU MLA backend. On vLLM's CPU platform an MLA model runs
without chunked prefill or prefix caching (vLLM turns both off), so the batch is prefills
then decodes (four prompts of lengths 23, 5, 40, 1; how many of them share the first
steps depends on when the engine process receives them). Two models: plain RoPE, and
DeepSeek-V2's YaRN (its mscale changes the softmax scale). Both runs take vLLM's RoPE as
plain torch (``vllm_mla.NATIVE_OPS``): vLLM's CPU RoPE kernel mis-reads the MLA layer's
views, and the tokens then depend on the batching, whichever backend runs."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm")

from hygon_attn_backend.integrations.vllm import compat, mla_select  # noqa: E402
from hygon_attn_backend.tools.demo.engine import DEEPSEEK_YARN  # noqa: E402
from tests.support import vllm_mla  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not mla_select.mla_available(),
                       reason=f"the MLA backend is written against vLLM "
                              f"{compat.range_text(compat.MLA_RANGE)}"),
]


#: DeepSeek-V2's YaRN: vLLM folds ``mscale(factor, mscale_all_dim)**2`` (1.30 here) into
#: the layers' softmax scale, which both our paths must take (not 1/sqrt(qk_head_dim)).
YARN = DEEPSEEK_YARN


@pytest.fixture(scope="module", params=[pytest.param(None, id="plain"),
                                        pytest.param(YARN, id="yarn")])
def tiny_deepseek(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_deepseek"))
    return vllm_mla.build_tiny_deepseek(path, rope_scaling=request.param)


def test_greedy_tokens_match_vllms_cpu_mla(tiny_deepseek):
    # named, not left to vLLM: on a host with AMX tiles vLLM's CPU platform prefers its
    # AMX_MLA backend, whose products round differently; CPU_MLA is the one on every x86
    theirs = vllm_mla.generate(tiny_deepseek, "CPU_MLA")
    assert "Using CPU_MLA backend" in theirs["log"]
    assert "hygon attention backend" not in theirs["log"]
    env = {"HYGON_ATTN_IMPL": "auto"}
    if os.environ.get("TRITON_INTERPRET") == "1":
        env["TRITON_INTERPRET"] = "1"
    ours = vllm_mla.generate(tiny_deepseek, "hygon", env=env)
    assert "HygonMLABackend" in ours["log"]
    expected = "Triton kernels" if env.get("TRITON_INTERPRET") or _has_cuda() \
        else "reference ops"
    assert f"hygon attention backend (MLA): {expected}" in ours["log"]
    assert len(ours["tokens"]) == len(vllm_mla.prompts())
    for i, (a, b) in enumerate(zip(ours["tokens"], theirs["tokens"])):
        assert a == b, (f"prompt {i}: ours {a} vs vLLM's {b}; vLLM's top-2 logprob gaps "
                        f"{theirs['gaps'][i]}")


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def test_ngram_speculation_is_lossless_and_verifies_on_the_decode(tmp_path_factory):
    """n-gram speculation (2 tokens) on the tiny DeepSeek through ``hygon``: the greedy
    tokens equal the unspeculated run's, and the verify steps ran as uniform MLA decodes of
    ``T = 3`` tokens a request (vLLM's decode threshold ``1 + num_speculative_tokens``),
    not as prefills."""
    model = vllm_mla.build_tiny_deepseek(str(tmp_path_factory.mktemp("tiny_ds_spec")))
    env = {"HYGON_ATTN_IMPL": "auto"}
    if os.environ.get("TRITON_INTERPRET") == "1":
        env["TRITON_INTERPRET"] = "1"
    plain = vllm_mla.generate(model, "hygon", env=env, repeating=True)
    spec = vllm_mla.generate(model, "hygon", env=env, repeating=True, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
        "prompt_lookup_max": 4})
    assert set(plain["decode_tokens"]) == {1}
    assert 3 in spec["decode_tokens"], spec["decode_tokens"]
    for i, (a, b) in enumerate(zip(spec["tokens"], plain["tokens"])):
        assert a == b, (f"prompt {i}: speculative {a} vs plain {b}; top-2 logprob gaps "
                        f"{plain['gaps'][i]}")


def test_mtp_speculation_is_lossless_and_verifies_on_the_decode(tmp_path_factory):
    """DeepSeek's MTP (vLLM's ``mtp`` method, 2 speculative tokens) on a tiny DeepSeek-V3
    with one MTP layer (``build_tiny_deepseek(mtp=True)``), target and drafter through
    ``hygon``: greedy tokens equal the unspeculated run's, every verify step a uniform MLA
    decode of ``T = 3`` tokens a request."""
    from hygon_attn_backend.tools.demo import engine as demo

    model = demo.build_tiny_deepseek(str(tmp_path_factory.mktemp("tiny_ds_mtp")), mtp=True)
    env = {"HYGON_ATTN_IMPL": "auto"}
    if os.environ.get("TRITON_INTERPRET") == "1":
        env["TRITON_INTERPRET"] = "1"
    plain = vllm_mla.generate(model, "hygon", env=env, repeating=True)
    spec = vllm_mla.generate(model, "hygon", env=env, repeating=True, speculative_config={
        "method": "mtp", "num_speculative_tokens": 2})
    assert "DeepSeekMTPModel" in spec["log"] and set(plain["decode_tokens"]) == {1}
    assert 3 in spec["decode_tokens"], spec["decode_tokens"]
    for i, (a, b) in enumerate(zip(spec["tokens"], plain["tokens"])):
        assert a == b, (f"prompt {i}: MTP {a} vs plain {b}; top-2 logprob gaps "
                        f"{plain['gaps'][i]}")
