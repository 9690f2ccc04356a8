"""``integrations/sglang/compat.py``: the adapters between SGLang versions, on the installed
SGLang, and the forms of the other versions (0.5.10's CUDA-graph hooks and spawn hook,
the refusal of a version missing an extension point) driven directly.
"""

import logging
import random
import types

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.radix_cache")

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend  # noqa: E402

from hygon_attn_backend.integrations import sglang as integration  # noqa: E402
from hygon_attn_backend.integrations.sglang import compat  # noqa: E402
from hygon_attn_backend.integrations.sglang.backend import HygonAttnBackend  # noqa: E402
from tests.support.sglang_harness import Server, TinyModel  # noqa: E402

HEADS = dict(num_heads=4, num_kv_heads=2, head_dim=16)


def test_installed_version_has_every_extension_point():
    assert compat.unsupported_reason() is None
    choices, add = compat.choices_api()
    assert isinstance(choices, list) and callable(add)
    backends, reg = compat.registry_api()
    assert isinstance(backends, dict) and callable(reg)


def test_backend_bases_follow_the_graph_hooks_of_the_base_class():
    class Old(AttentionBackend.__mro__[-1]):  # a base without init_forward_metadata_out_graph
        pass

    assert compat.backend_bases(Old) == (compat.LegacyGraphHooks, Old)
    if hasattr(AttentionBackend, "init_forward_metadata_out_graph"):
        assert compat.backend_bases(AttentionBackend) == (AttentionBackend,)
        assert compat.LegacyGraphHooks not in HygonAttnBackend.__mro__
    else:
        assert compat.LegacyGraphHooks in HygonAttnBackend.__mro__


def test_write_loc_is_what_this_set_kv_buffer_takes(device):
    """One decode token written through ``compat.write_loc`` lands in the pool's slot."""
    model = TinyModel(dtype=torch.float16, seed=3, device=device, **HEADS)
    srv = Server(model, page_size=16, seed=3)
    req = srv.start([5, 6, 7])
    srv.extend([req])
    slot = int(srv.req_to_token_pool.req_to_token[req.row, 2])
    _, k, _ = model.qkv([7], [2])
    torch.testing.assert_close(srv.pool.get_key_buffer(0)[slot], k[0])


@pytest.mark.parametrize("page_size", [1, 16])
def test_legacy_graph_hooks_decode_like_the_new_pair(page_size, device):
    """SGLang 0.5.10's capture / replay pair, mapped onto our out-graph / in-graph hooks,
    gives each decode step of a padded static batch the same output as the new pair and
    as the from-scratch oracle."""

    outs = {}
    for legacy in (False, True):
        rng = random.Random(21)
        model = TinyModel(dtype=torch.float16, seed=21, device=device, **HEADS)
        srv = Server(model, page_size=page_size, seed=21)
        if legacy:  # the backend as 0.5.10 builds it: the legacy pair on top
            for name in ("init_forward_metadata_capture_cuda_graph",
                         "init_forward_metadata_replay_cuda_graph"):
                setattr(srv.backend, name, types.MethodType(
                    getattr(compat.LegacyGraphHooks, name), srv.backend))
            srv.backend._batch = compat.LegacyGraphHooks._batch
        reqs = [srv.start([rng.randrange(1, 1000) for _ in range(n)]) for n in (19, 33)]
        srv.extend(reqs)
        state, steps = {}, []
        for _ in range(3):
            step = srv.decode_graph(reqs, [rng.randrange(1, 1000) for _ in reqs], graph_bs=4,
                                    state=state, legacy=legacy)
            for r, out in zip(reqs, step):
                want = model.oracle(r.tokens, [r.kv_len - 1])
                torch.testing.assert_close(out.double().cpu(), want, atol=2e-2, rtol=2e-2)
            steps.append(torch.cat(step))
        outs[legacy] = torch.stack(steps)
    torch.testing.assert_close(outs[True], outs[False], atol=0, rtol=0)


def _fake_engine(func):
    return type("Engine", (), {"run_scheduler_process_func": staticmethod(func)})


def test_spawn_hook_replaces_only_sglangs_own_entry(monkeypatch, caplog):
    def sglang_entry(*args):
        return args

    sglang_entry.__module__ = "sglang.srt.managers.scheduler"
    engine = _fake_engine(sglang_entry)
    monkeypatch.setattr(compat, "_engine_class", lambda: engine)
    assert compat.install_spawn_hook() is True
    assert engine.run_scheduler_process_func is compat.run_scheduler_process
    assert compat.install_spawn_hook() is True  # idempotent

    def app_entry(*args):
        return args

    mine = _fake_engine(app_entry)
    monkeypatch.setattr(compat, "_engine_class", lambda: mine)
    with caplog.at_level(logging.WARNING):
        assert compat.install_spawn_hook() is False
    assert mine.run_scheduler_process_func is app_entry
    assert "left as it is" in caplog.text


@pytest.mark.parametrize("field, registers", [
    ("attention_backend", True), ("decode_attention_backend", True), (None, False)])
def test_spawned_entry_registers_only_when_hygon_is_selected(field, registers, monkeypatch):
    import sglang.srt.managers.scheduler as scheduler
    from types import SimpleNamespace

    calls = []
    monkeypatch.setattr(scheduler, "run_scheduler_process",
                        lambda *a, **k: calls.append((a, k)) or "ran")
    registered = []
    monkeypatch.setattr(integration, "register", lambda: registered.append(1) or True)
    args = SimpleNamespace(attention_backend="triton", prefill_attention_backend=None,
                           decode_attention_backend=None)
    if field:
        setattr(args, field, "hygon")
    assert compat.run_scheduler_process(args, "port", 0, tp_rank=1) == "ran"
    assert calls == [((args, "port", 0), {"tp_rank": 1})]
    assert registered == ([1] if registers else [])


def test_register_refuses_a_version_missing_an_extension_point(monkeypatch, caplog):
    """One log line naming the version and the reason; no choice, no factory added."""
    choices, _ = compat.choices_api()
    backends, _ = compat.registry_api()
    while "hygon" in choices:
        choices.remove("hygon")
    backends.pop("hygon", None)
    before = (list(choices), dict(backends))
    monkeypatch.setattr(integration, "_registered", False)
    monkeypatch.setattr(compat, "unsupported_reason", lambda: "no attention_registry")
    try:
        with caplog.at_level(logging.WARNING):
            assert integration.register() is False
        lines = [r.getMessage() for r in caplog.records if "hygon" in r.getMessage()]
        assert len(lines) == 1 and "not registered" in lines[0]
        assert "no attention_registry" in lines[0] and compat.sglang_version() in lines[0]
        assert (list(choices), dict(backends)) == before
    finally:
        monkeypatch.undo()
        integration._registered = False
        assert integration.register() is True
