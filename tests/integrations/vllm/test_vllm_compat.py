"""The version adapters of ``integrations.vllm.compat``, exercised on the installed vLLM
by removing the newer names it has (as the older vLLM versions lack them); each older
version itself is measured by ``scripts/compat/run.py`` (docs/compat.md)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from hygon_attn_backend.integrations.vllm import compat  # noqa: E402
from hygon_attn_backend.integrations.vllm.backend import (  # noqa: E402
    HygonAttentionBackend,
    HygonAttentionMetadataBuilder,
)
from tests.support.vllm_harness import llama_config_dir, vllm_config_for  # noqa: E402


@pytest.fixture(scope="module")
def vllm_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_8_2_64")
    return vllm_config_for(llama_config_dir(path, 8, 2, 64), block_size=16, dtype="float16")


def make_builder(vllm_config):
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    with set_current_vllm_config(vllm_config):
        return HygonAttentionMetadataBuilder(spec, ["model.layers.0.self_attn.attn"],
                                             vllm_config, torch.device("cpu"))


def test_version_parsing_and_range():
    assert compat.version_tuple("0.21.0") == (0, 21)
    assert compat.version_tuple("0.33.1rc2+cpu") == (0, 33)
    assert compat.version_tuple("dev") is None and compat.version_tuple("7") is None
    assert compat.in_range("0.15.0", compat.SUPPORTED_RANGE)
    assert not compat.in_range("0.14.9", compat.SUPPORTED_RANGE)
    assert compat.range_text(((0, 15), (0, 34))) == "0.15 to 0.34"


def test_supports_combination_takes_both_calling_conventions():
    """vLLM 0.21 and older pass 8 positionals (no use_mm_prefix), later ones 9."""
    b = HygonAttentionBackend
    nine = ("bfloat16", 16, False, False, False, False, None)
    eight = ("bfloat16", 16, False, False, False, None)
    for rest in (nine, eight):
        assert "differs from the model dtype" in b.supports_combination(64, torch.float16, *rest)
        assert b.supports_combination(64, torch.bfloat16, *rest) is None


def test_kv_cache_shape_is_the_logical_layout_kv_views_read():
    """vLLM without KVCacheLayout allocates get_kv_cache_shape as is (no stride order):
    the step's K/V views of that tensor address [block, head, slot, dim]."""
    from hygon_attn_backend.integrations.vllm import step

    shape = HygonAttentionBackend.get_kv_cache_shape(5, 16, 2, 64)
    assert shape == (5, 2, 16, 128)
    cache = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).view(shape)
    spec = step.LayerSpec(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125,
                          kv_cache_dtype="auto", sliding_window=None, soft_cap=None,
                          sinks=None)
    k, v = spec.kv_views(cache)
    assert k.shape == v.shape == (5, 2, 16, 64)
    assert torch.equal(k[3, 1, 7], cache[3, 1, 7, :64])
    assert torch.equal(v[3, 1, 7], cache[3, 1, 7, 64:])


def test_without_kv_cache_layout_no_layout_is_declared(monkeypatch):
    import vllm.v1.kv_cache_interface as kvi

    assert [x.name for x in HygonAttentionBackend.supported_kv_cache_layouts()][0] == "LBHNC"
    monkeypatch.delattr(kvi, "KVCacheLayout")
    assert compat.kv_cache_layout_enum() is None
    assert HygonAttentionBackend.supported_kv_cache_layouts() == ()


def test_decode_query_len_without_vllms_function(vllm_config, monkeypatch):
    """Where vLLM has no max_decode_query_len, the builder's reorder threshold (1 + the
    speculative tokens) sizes the decode workspace: the same number here."""
    import vllm.v1.attention.backend as vb

    builder = make_builder(vllm_config)
    theirs = compat.max_decode_query_len(vllm_config, builder)
    monkeypatch.delattr(vb, "max_decode_query_len")
    builder.reorder_batch_threshold = 1
    assert compat.max_decode_query_len(vllm_config, builder) == theirs == 1
    builder.reorder_batch_threshold = 4  # 3 speculative tokens
    assert compat.max_decode_query_len(vllm_config, builder) == 4


def test_heads_without_vllms_per_layer_count(vllm_config, monkeypatch):
    import vllm.v1.attention.backends.utils as vu

    monkeypatch.delattr(vu, "get_num_attention_heads_from_layers")
    assert compat.num_attention_heads(vllm_config, ["model.layers.0.self_attn.attn"]) == 8
    assert make_builder(vllm_config).num_heads == 8


def test_dcp_without_vllms_world_and_rank_function(vllm_config, monkeypatch):
    """vLLM 0.15 has no get_dcp_world_size_and_rank: one rank (a builder still builds),
    and a DCP size above 1 is refused by name instead of an ImportError."""
    import types

    import vllm.distributed.parallel_state as ps

    monkeypatch.delattr(ps, "get_dcp_world_size_and_rank")
    spec = types.SimpleNamespace(dcp_sharded=True)
    assert compat.dcp_world_and_rank(spec, vllm_config.parallel_config) == (1, 0)
    assert make_builder(vllm_config).num_heads == 8
    wide = types.SimpleNamespace(decode_context_parallel_size=2)
    with pytest.raises(NotImplementedError, match="decode_context_parallel_size=2"):
        compat.dcp_world_and_rank(spec, wide)


def test_call_with_supported_drops_only_unknown_keywords():
    def old(cls, selected, config):  # vLLM 0.15's CPU selector: no num_heads
        return (selected, config)

    def new(cls, selected, config, num_heads=None):
        return (selected, config, num_heads)

    def any_kw(cls, selected, config, **kw):
        return kw

    assert compat.call_with_supported(old, None, "b", "c", num_heads=4) == ("b", "c")
    assert compat.call_with_supported(new, None, "b", "c", num_heads=4) == ("b", "c", 4)
    assert compat.call_with_supported(any_kw, None, "b", "c", num_heads=4) == {"num_heads": 4}


def test_capabilities_of_the_installed_vllm():
    assert compat.missing_capabilities() == []
    assert compat.can_add_members() is hasattr(
        __import__("vllm.v1.attention.backends.registry",
                   fromlist=["AttentionBackendEnum"]).AttentionBackendEnum, "register")


def _vllm_checks():
    import importlib
    import sys

    from tests import support

    folder = str(support.REPO / "scripts" / "compat")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module("vllm_checks")
    finally:
        sys.path.remove(folder)


def test_compat_mla_check_gets_the_oracle_only_in_range(monkeypatch, tmp_path):
    """``scripts/compat/vllm_checks``: ``mla`` is one of the CPU builds' checks (not of the
    --no-deps ones); ``only`` runs the named checks alone; a version in ``MLA_RANGE`` gets
    the oracle's folder (made once), one outside it none (its probe answers n/a)."""
    import json
    import pathlib
    import subprocess

    checks = _vllm_checks()
    assert "mla" in checks.CHECKS["full"] and "mla" not in checks.CHECKS["interface"]
    made, seen = [], []
    monkeypatch.setattr(checks, "mla_oracle", lambda repo: made.append(repo) or tmp_path)
    monkeypatch.setattr(checks, "_preload_for", lambda python: [])

    def probe(cmd, **kwargs):
        name = cmd[cmd.index("--check") + 1]
        seen.append((name, kwargs["env"].get("HYGON_MLA_ORACLE")))
        line = "CHECK " + json.dumps({"check": name, "result": "pass", "reason": ""})
        return subprocess.CompletedProcess(cmd, 0, stdout=line + "\n", stderr="")

    monkeypatch.setattr(checks.subprocess, "run", probe)
    python, repo = pathlib.Path("/no/python"), pathlib.Path("/no/repo")
    rows = checks.run_checks("0.14.1", python, repo, only=["mla"])  # below MLA_RANGE
    assert [r["check"] for r in rows] == ["mla"] and seen == [("mla", None)] and not made
    seen.clear()
    rows = checks.run_checks("0.25.1", python, repo, only=["register", "mla"])
    assert [r["check"] for r in rows] == ["register", "mla"]
    assert seen == [("register", None), ("mla", str(tmp_path))] and made == [repo]


def test_compat_driver_takes_named_checks_for_vllm_only():
    import subprocess
    import sys

    from tests import support

    run = support.REPO / "scripts" / "compat" / "run.py"
    proc = subprocess.run([sys.executable, str(run), "--engine", "sglang", "--checks",
                           "mla"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--checks needs --engine vllm" in proc.stderr
