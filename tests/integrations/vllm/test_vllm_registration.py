"""``--attention-backend hygon`` in a real vLLM: registration, CLI parsing, selection,
a spawned process, and vLLM unchanged without the flag."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("vllm")

import hygon_attn_backend.integrations.vllm as hv  # noqa: E402
from hygon_attn_backend.integrations.vllm import cpu_platform  # noqa: E402

BACKEND_CLASS = "hygon_attn_backend.integrations.vllm.backend.HygonAttentionBackend"
CPU_CLASS = "vllm.v1.attention.backends.cpu_attn.CPUAttentionBackend"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """Config-only tiny Llama (head_dim 32): enough for vLLM's engine config."""
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("tiny_llama_config")
    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=256).save_pretrained(path)
    return str(path)


def engine_config(model_dir, *cli):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", model_dir, "--skip-tokenizer-init", "--dtype",
                              "float16", "--max-model-len", "256", *cli])
    return EngineArgs.from_cli_args(args).create_engine_config()


def selected_class(vllm_config, dtype=torch.float16):
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    with set_current_vllm_config(vllm_config):
        cls = get_attn_backend(head_size=32, dtype=dtype, kv_cache_dtype="auto")
    return f"{cls.__module__}.{cls.__qualname__}"


def test_register_is_idempotent():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    first = hv.register()
    second = hv.register()
    assert first is second is E["HYGON"] is E.HYGON
    assert first is E.CUSTOM, "hygon must parse to the CUSTOM slot (survives pickling)"
    assert E.CUSTOM.get_path() == BACKEND_CLASS
    names = [m.name for m in E]
    assert names.count("CUSTOM") == 1 and "HYGON" not in names  # an alias, not a member
    assert cpu_platform.install(hv.vllm_version(), first) is True  # already in place


@pytest.fixture(scope="module")
def fresh_vllm(model_dir):
    """One fresh interpreter with vLLM's plugins disabled (as if we were not installed):
    the backend vLLM picks and the enum's members; then, with vLLM's config imported (as
    when vLLM calls plugins), the time register() takes and the modules it imported."""
    code = textwrap.dedent(f"""
        import json, sys, time, torch
        from vllm.engine.arg_utils import EngineArgs
        from vllm.config import set_current_vllm_config
        from vllm.v1.attention.selector import get_attn_backend
        from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
        cfg = EngineArgs(model={model_dir!r}, skip_tokenizer_init=True, dtype="float16",
                         max_model_len=256).create_engine_config()
        with set_current_vllm_config(cfg):
            cls = get_attn_backend(head_size=32, dtype=torch.float16, kv_cache_dtype="auto")
        res = {{"cls": cls.__module__ + "." + cls.__qualname__,
                "members": [m.name for m in E]}}
        ours_before = {{m for m in sys.modules if m.startswith("hygon_attn_backend")}}
        t = time.perf_counter()
        from hygon_attn_backend.integrations.vllm import register
        member = register()
        res["seconds"] = time.perf_counter() - t
        res["member"] = member.name
        res["modules"] = sorted(m for m in sys.modules if m.startswith("hygon_attn_backend"))
        res["before"] = sorted(ours_before)
        print(json.dumps(res))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, VLLM_PLUGINS=""), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_register_is_cheap_and_lazy(fresh_vllm):
    """register() imports no kernel, op or backend module (what would make it costly in
    every vLLM process); its time is reported, not asserted (no timed unit tests)."""
    res = fresh_vllm
    assert res["before"] == [], "vLLM loaded our plugin although VLLM_PLUGINS was empty"
    assert res["member"] == "CUSTOM"
    heavy = [m for m in res["modules"] if m.split(".")[1:2] in (["ops"], ["kernels"])
             or m.endswith((".backend", ".step", "._ops", ".reference"))]
    assert heavy == [], f"register() imported {heavy} ({res['seconds']:.3f} s)"


@pytest.mark.parametrize("version", ["0.14.1", "0.35.0", "1.0.0", "dev"])
def test_unsupported_version_changes_nothing(version, monkeypatch, caplog):
    """Outside the supported range: one warning line naming the version and the range,
    and vLLM's enum, overrides and CPU selector exactly as before."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    monkeypatch.setattr(hv, "_registered_member", None)
    monkeypatch.setattr(hv, "vllm_version", lambda: version)
    before = (dict(E.__members__), E.CUSTOM.is_overridden(),
              CpuPlatform.__dict__["get_attn_backend_cls"])
    with caplog.at_level("WARNING", logger="vllm.hygon_attn_backend"):
        assert hv.register() is None
    after = (dict(E.__members__), E.CUSTOM.is_overridden(),
             CpuPlatform.__dict__["get_attn_backend_cls"])
    assert after == before
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.hygon_attn_backend"]
    assert len(lines) == 1, lines
    assert f"vLLM {version} is outside the supported range 0.15 to 0.34" in lines[0]
    assert "left unchanged" in lines[0]
    assert not hv.is_supported_version(version)
    # the CPU patch is gated to the versions whose selector it was written for
    assert cpu_platform.install(version, E.CUSTOM) is False


def test_supported_range_bounds():
    assert hv.is_supported_version("0.15.0") and hv.is_supported_version("0.21.0")
    assert hv.is_supported_version("0.34.9") and not hv.is_supported_version("0.14.1")
    assert hv.unsupported_reason(hv.vllm_version()) is None


def test_missing_capability_refuses_without_changes(monkeypatch, caplog):
    """A vLLM in the range that lacks what registration needs: refused before any change."""
    from vllm.v1.attention.backends import registry

    monkeypatch.setattr(hv, "_registered_member", None)
    monkeypatch.delattr(registry, "register_backend")
    with caplog.at_level("WARNING", logger="vllm.hygon_attn_backend"):
        assert hv.register() is None
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm.hygon_attn_backend"]
    assert len(lines) == 1 and "lacks register_backend" in lines[0], lines


def test_cli_flag_selects_hygon(model_dir):
    """`--attention-backend hygon` parses, and vLLM's own selector returns our class."""
    hv.register()
    cfg = engine_config(model_dir, "--attention-backend", "hygon")
    assert hv.is_selected(cfg.attention_config.backend)
    assert selected_class(cfg) == BACKEND_CLASS
    # and vLLM's CUDA-style validation runs against our declarations
    with pytest.raises(ValueError, match="dtype not supported"):
        selected_class(cfg, dtype=torch.float32)


@pytest.mark.slow
def test_without_flag_vllm_is_unchanged(model_dir, fresh_vllm):
    """Registered, but no flag: the same backend as a vLLM with plugins disabled, and the
    CPU selector's original answers for other explicit choices."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
    from vllm.v1.attention.selector import AttentionSelectorConfig

    hv.register()
    cfg = engine_config(model_dir)
    assert cfg.attention_config.backend is None
    assert selected_class(cfg) == CPU_CLASS
    sel = AttentionSelectorConfig(head_size=32, dtype=torch.float16, kv_cache_dtype="auto",
                                  block_size=16)
    assert CpuPlatform.get_attn_backend_cls(E.TRITON_ATTN, sel) == CPU_CLASS
    assert CpuPlatform.get_attn_backend_cls(None, sel) == CPU_CLASS

    plain = fresh_vllm
    assert plain["cls"] == CPU_CLASS
    assert plain["members"] == [m.name for m in E]


def test_cpu_patch_uninstall_restores_vllm():
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.selector import AttentionSelectorConfig

    member = hv.register()
    sel = AttentionSelectorConfig(head_size=32, dtype=torch.float16, kv_cache_dtype="auto",
                                  block_size=16)
    assert CpuPlatform.get_attn_backend_cls(member, sel) == BACKEND_CLASS
    try:
        assert cpu_platform.uninstall()
        assert CpuPlatform.get_attn_backend_cls(member, sel) == CPU_CLASS  # vLLM's answer
    finally:
        assert cpu_platform.install(hv.vllm_version(), member)
    assert CpuPlatform.get_attn_backend_cls(member, sel) == BACKEND_CLASS


def _spawned_child(vllm_config, queue):
    """Runs in a spawned process: ``vllm_config`` was unpickled before this line, with no
    plugin loaded; then vLLM's own plugin loader runs, as in a worker."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    before = {"backend": repr(vllm_config.attention_config.backend),
              "custom_registered": E.CUSTOM.is_overridden()}
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    queue.put({**before, "selected": selected_class(vllm_config)})


@pytest.mark.slow
def test_spawned_process_sees_hygon(model_dir):
    hv.register()
    cfg = engine_config(model_dir, "--attention-backend", "hygon")
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_spawned_child, args=(cfg, queue))
    proc.start()
    try:
        res = queue.get(timeout=300)
    finally:
        proc.join(timeout=60)
    assert proc.exitcode == 0
    assert res["backend"] == "<AttentionBackendEnum.CUSTOM: None>"
    assert res["custom_registered"] is False  # unpickled before any plugin ran
    assert res["selected"] == BACKEND_CLASS
