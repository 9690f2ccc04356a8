"""Registration with SGLang: the ``sglang.srt.plugins`` entry point, the choices of
``--attention-backend`` / ``--prefill-attention-backend`` / ``--decode-attention-backend``,
the lazy factory, and "without the flag nothing changes".

The checks that need a clean interpreter (what SGLang looks like before and after our
plugin loads) run in a subprocess.
"""

import json
import os
import subprocess
import sys
import textwrap
from importlib.metadata import entry_points

import pytest

from tests import support

pytest.importorskip("sglang.srt.arg_groups.choices")

from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES  # noqa: E402
from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS  # noqa: E402
from sglang.srt.server_args import prepare_server_args  # noqa: E402

from hygon_attn_backend.integrations import sglang as integration  # noqa: E402

REPO = str(support.REPO)


def _run_clean(code: str) -> dict:
    """Run ``code`` in a fresh interpreter (repo on the path); it prints one JSON line."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [REPO] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_register_is_idempotent():
    assert integration.register() is True
    factory = ATTENTION_BACKENDS["hygon"]
    n_choices = len(ATTENTION_BACKEND_CHOICES)
    assert integration.register() is True
    assert integration.register() is True
    assert ATTENTION_BACKEND_CHOICES.count("hygon") == 1
    assert len(ATTENTION_BACKEND_CHOICES) == n_choices
    assert ATTENTION_BACKENDS["hygon"] is factory
    from sglang.srt.arg_groups.choices import DRAFT_ATTENTION_BACKEND_CHOICES

    assert DRAFT_ATTENTION_BACKEND_CHOICES.count("hygon") == 1


def test_draft_worker_keeps_hygon():
    """SGLang's draft worker takes ``hygon`` when named (or inherited from the target)
    instead of falling back to flashinfer / triton."""
    from sglang.srt.runtime_context import get_context
    from sglang.srt.speculative.draft_worker_common import (
        resolve_draft_worker_attention_backend,
    )

    integration.register()
    args = prepare_server_args(["--model-path", "unused-model", "--attention-backend", "hygon",
                                "--speculative-draft-attention-backend", "hygon"])
    get_context().set_server_args(args)
    assert resolve_draft_worker_attention_backend(algo_label="EAGLE") == "hygon"


@pytest.mark.parametrize("flags, field_values", [
    (["--attention-backend", "hygon"], {"attention_backend": "hygon"}),
    (["--prefill-attention-backend", "hygon"], {"prefill_attention_backend": "hygon"}),
    (["--decode-attention-backend", "hygon"], {"decode_attention_backend": "hygon"}),
    (["--prefill-attention-backend", "hygon", "--decode-attention-backend", "triton"],
     {"prefill_attention_backend": "hygon", "decode_attention_backend": "triton"}),
])
def test_flags_parse(flags, field_values):
    integration.register()
    args = prepare_server_args(["--model-path", "unused-model"] + flags)
    for name, value in field_values.items():
        assert getattr(args, name) == value


def test_entry_point_is_declared():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "hygon"]
    if not eps:
        pytest.skip("package not installed (pip install -e .): no entry points to check")
    assert eps[0].value == "hygon_attn_backend.integrations.sglang:register"
    assert eps[0].load() is integration.register


def test_plugin_load_adds_only_our_name_and_imports_nothing_heavy():
    """In a fresh SGLang process: before our plugin, 'hygon' is rejected; after
    ``register()`` (what ``load_plugins()`` runs), the choices are the old ones plus
    'hygon', every other backend factory is the same object, our backend module, Triton
    and the kernels are not imported, and a command line without the flag parses to the
    same arguments as before."""
    result = _run_clean("""
        import json, sys
        from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        from sglang.srt.server_args import prepare_server_args
        choices_before = list(ATTENTION_BACKEND_CHOICES)
        factories_before = dict(ATTENTION_BACKENDS)
        argv = ["--model-path", "m", "--page-size", "16"]
        plain_before = prepare_server_args(argv)
        try:
            prepare_server_args(argv + ["--attention-backend", "hygon"])
            rejected = False
        except SystemExit:
            rejected = True
        heavy_before = {m for m in ("triton",) if m in sys.modules}
        from hygon_attn_backend.integrations.sglang import register
        register()
        plain_after = prepare_server_args(argv)
        fields = ("attention_backend", "prefill_attention_backend", "decode_attention_backend",
                  "page_size", "model_path")
        print(json.dumps({
            "rejected_before": rejected,
            "choices_added": [c for c in ATTENTION_BACKEND_CHOICES if c not in choices_before],
            "choices_kept": ATTENTION_BACKEND_CHOICES[:len(choices_before)] == choices_before,
            "factories_same": all(ATTENTION_BACKENDS[k] is f for k, f in factories_before.items()),
            "factories_added": sorted(set(ATTENTION_BACKENDS) - set(factories_before)),
            "plain_same": all(getattr(plain_before, f) == getattr(plain_after, f)
                              for f in fields),
            "plain_backend": plain_after.attention_backend,
            "backend_module_loaded":
                "hygon_attn_backend.integrations.sglang.backend" in sys.modules,
            "kernels_loaded": any(m.startswith("hygon_attn_backend.kernels") or
                                  m.startswith("hygon_attn_backend.ops.") for m in sys.modules),
            "triton_newly_loaded": "triton" in sys.modules and "triton" not in heavy_before,
        }))
    """)
    assert result["rejected_before"], "'hygon' must not be a choice before the plugin loads"
    assert result["choices_added"] == ["hygon"]
    assert result["choices_kept"] and result["factories_same"]
    assert result["factories_added"] == ["hygon"]
    assert result["plain_same"] and result["plain_backend"] is None
    assert not result["backend_module_loaded"], "the backend must load only when selected"
    assert not result["kernels_loaded"] and not result["triton_newly_loaded"]


def test_load_plugins_runs_our_register():
    """SGLang's own ``load_plugins()`` (the call every SGLang process makes) finds the
    entry point and registers 'hygon'."""
    if not [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "hygon"]:
        pytest.skip("package not installed (pip install -e .): the entry point is not visible")
    result = _run_clean("""
        import json
        from sglang.srt.plugins import load_plugins
        from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
        from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
        load_plugins()
        load_plugins()
        print(json.dumps({"choices": ATTENTION_BACKEND_CHOICES.count("hygon"),
                          "factory": "hygon" in ATTENTION_BACKENDS}))
    """)
    assert result == {"choices": 1, "factory": True}


def test_factory_builds_our_backend_and_refuses_what_it_cannot_serve():
    """The registered factory returns ``HygonAttnBackend``; pools it cannot read are
    refused at construction with a clear error instead of wrong answers later."""
    import torch
    from types import SimpleNamespace

    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    from hygon_attn_backend.integrations.sglang.backend import HygonAttnBackend

    integration.register()
    pool = MHATokenToKVPool(size=64, page_size=16, dtype=torch.float16, head_num=2, head_dim=16,
                            layer_num=1, device="cpu", enable_memory_saver=False,
                            enable_alt_stream=False)
    rows = ReqToTokenPool(size=2, max_context_len=64, device="cpu", enable_memory_saver=False)
    runner = SimpleNamespace(device="cpu", req_to_token_pool=rows, token_to_kv_pool=pool)
    backend = ATTENTION_BACKENDS["hygon"](runner)
    assert isinstance(backend, HygonAttnBackend)
    assert backend.page_size == 16 and backend.max_blocks == 4
    assert backend.get_cuda_graph_seq_len_fill_value() == 1
    pool.kv_cache_layout = "vectorized_5d"
    with pytest.raises(NotImplementedError, match="vectorized_5d"):
        ATTENTION_BACKENDS["hygon"](runner)
