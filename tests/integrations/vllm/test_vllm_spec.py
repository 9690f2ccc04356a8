"""Speculative decoding through ``hygon`` in vLLM's engine on its CPU build.

Slow (each engine run starts vLLM; the kernels run in Triton's interpreter): n-gram
speculation with 1..4 speculative tokens and EAGLE with a random-weight EAGLE head give
the greedy tokens of the run without speculation (lossless), and every uniform verify step
(all requests with the same ``T > 1`` tokens) is planned as one multi-token decode
(``num_tokens=T``), never as a prefill. Not slow: on a faked ROCm platform, vLLM's drafter
allow-list takes our metadata when ``hygon`` is selected (``spec_decode``'s wrapper), and
refuses it without the wrapper or for another backend.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

pytest.importorskip("vllm")

from hygon_attn_backend.integrations.vllm import register, spec_decode, step  # noqa: E402
from hygon_attn_backend.tools.demo import engine as demo  # noqa: E402
from tests import support  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("spec_models")
    target = demo.build_tiny_llama(str(root / "target"))
    return target, demo.build_tiny_eagle_head(target, str(root / "eagle"), engine="vllm")


def _run_child(model_dir, specs, tmp_path):
    """Each configuration in a fresh process: vLLM 0.32's CPU worker cannot start a second
    engine in a process whose first one drafted (its Triton-kernel overrides rebind once)."""
    return [run for spec in specs for run in _run_one(model_dir, [spec], tmp_path)]


def _run_one(model_dir, specs, tmp_path):
    result = tmp_path / "runs.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(support.REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                               if p]))
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run([sys.executable, "-m", "tests.integrations.vllm.spec_child", model_dir,
                           str(result), json.dumps(specs)], capture_output=True, text=True,
                          env=env, timeout=1800, cwd=str(support.REPO))
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-6000:])
    return json.loads(result.read_text())


def _check_verify_plans(run):
    """Every uniform verify step (all requests with the same T > 1 tokens) is one decode
    plan of T tokens a request with no prefill; returns how many there were."""
    uniform = 0
    for plan in run["plans"]:
        lens = plan["query_lens"]
        if lens and len(set(lens)) == 1 and lens[0] > 1 and plan["decode_tokens"]:
            uniform += 1
        if lens and len(set(lens)) == 1 and 1 < lens[0] <= 5:
            assert plan["decode_tokens"] == lens[0] and not plan["prefill"], (run["spec"], plan)
    return uniform


@pytest.mark.slow
def test_ngram_speculation_is_lossless_and_verifies_on_decode(models, tmp_path):
    specs = [None] + [{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3,
                       "prompt_lookup_min": 2} for k in (1, 2, 3, 4)]
    base, *spec_runs = _run_child(models[0], specs, tmp_path)
    assert base["tokens"] and all(len(t) for t in base["tokens"])
    uniform = 0
    for run in spec_runs:
        assert run["tokens"] == base["tokens"], run["spec"]
        uniform += _check_verify_plans(run)
    assert uniform > 0, "no uniform verify step was planned: the drafts never reached verify"


@pytest.mark.slow
def test_eagle_speculation_is_lossless_and_verifies_on_decode(models, tmp_path):
    """EAGLE (a random-weight head, 2 speculative tokens: the multi-step drafting loop)
    runs on vLLM's CPU build: its drafts are verified as 3-token decodes, the tokens are the
    run without speculation's."""
    base, run = _run_child(models[0], [None, {"method": "eagle", "model": models[1],
                                              "num_speculative_tokens": 2}], tmp_path)
    assert run["tokens"] == base["tokens"]
    assert _check_verify_plans(run) > 0
    assert any(p["decode_tokens"] == 3 for p in run["plans"])


#: The modules whose metadata classes vLLM 0.32's ROCm allow-list names.
ROCM_LIST_MODULES = ("vllm.models.minimax_m3.common.sparse_attention",
                     "vllm.v1.attention.backends.mla.indexer",
                     "vllm.v1.attention.backends.mla.rocm_aiter_mla_sparse",
                     "vllm.v1.attention.backends.rocm_attn",
                     "vllm.v1.attention.backends.rocm_aiter_fa",
                     "vllm.model_executor.layers.attention.mla_attention",
                     "vllm.v1.attention.backends.flex_attention")


def _proposer(target, eagle, monkeypatch, backend):
    """vLLM's EAGLE proposer built as on a ROCm platform (``is_rocm`` faked while it is
    built). DeepSeek-V4's ROCm module, which its allow-list imports, needs vLLM's ROCm
    build: a stand-in with the two class names takes its place."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    kwargs = dict(model=target, tokenizer=target, max_model_len=256, block_size=32,
                  dtype="float16", enforce_eager=True,
                  speculative_config={"method": "eagle", "model": eagle,
                                      "num_speculative_tokens": 2})
    if backend is not None:
        kwargs["attention_backend"] = backend
    config = EngineArgs(**kwargs).create_engine_config()
    stand_in = types.ModuleType("vllm.models.deepseek_v4.amd.rocm")
    for name in ("DeepseekV4ROCMAiterMLASparseMetadata", "DeepseekV4ROCMAiterSparseSWAMetadata"):
        setattr(stand_in, name, type(name, (), {}))
    monkeypatch.setitem(sys.modules, "vllm.models.deepseek_v4.amd.rocm", stand_in)
    import importlib

    from vllm.v1.spec_decode.eagle import EagleProposer

    for name in ROCM_LIST_MODULES:  # imported on the real platform: faked, some would
        importlib.import_module(name)  # load vLLM's ROCm platform module

    with monkeypatch.context() as m, set_current_vllm_config(config):
        m.setattr(current_platform, "is_rocm", lambda: True)
        return EagleProposer(config, torch.device("cpu"), runner=None)


def _our_metadata():
    z = torch.zeros(1, dtype=torch.int32)
    return step.make_metadata(query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                              seq_lens=z + 1, block_table=z.view(1, 1),
                              slot_mapping=z.long(), num_reqs=1, num_actual_tokens=1,
                              max_query_len=1, max_seq_len=1, num_decodes=1,
                              num_decode_tokens=1)


def test_rocm_drafter_allow_list_takes_hygon(models, monkeypatch):
    """The check vLLM's ``propose()`` makes with more than one speculative token
    (``isinstance(metadata, allowed_attn_types)``) passes for our metadata with ``hygon``
    selected; vLLM's own list (no wrapper) and another backend's refuse it."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata
    from vllm.version import __version__

    register()
    ours = _our_metadata()
    proposer = _proposer(*models, monkeypatch, "hygon")
    assert TritonAttentionMetadata in proposer.allowed_attn_types  # the ROCm list was built
    assert isinstance(ours, proposer.allowed_attn_types)

    other = _proposer(*models, monkeypatch, None)
    assert not isinstance(ours, other.allowed_attn_types)

    assert spec_decode.uninstall()
    try:
        plain = _proposer(*models, monkeypatch, "hygon")
        assert not isinstance(ours, plain.allowed_attn_types)
    finally:
        assert spec_decode.install(__version__)
    assert spec_decode.install(__version__)  # idempotent
