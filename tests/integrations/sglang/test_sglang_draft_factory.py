"""``hygon`` as the EAGLE draft backend through SGLang's ``DraftBackendFactory`` in both of
its forms (``integrations/sglang/draft_factory.py``): 0.5.23's
``_create_backend(..., stamps_children)`` and 0.5.10's / 0.5.17's three-parameter one.

The older form is checked on a stand-in factory with that signature (on every installed
version) and, where the installed SGLang has it, on SGLang's own class: the wrapper adds
our entry to the right map only when the draft resolves to ``hygon``, returns the backend
alone, leaves every other name to SGLang, and on 0.5.10 (the older graph hooks) refuses
``hygon`` with a message that names the workaround. What our entry builds (the multi-step
container, the draft-extend backend) is checked by ``test_sglang_draft.py``.
"""

from __future__ import annotations

import inspect
import types
from importlib.metadata import version

import pytest

pytest.importorskip("sglang.srt.speculative.draft_utils")

from sglang.srt.speculative import draft_utils  # noqa: E402

from hygon_attn_backend.integrations.sglang import draft_factory  # noqa: E402

MESSAGE = "EAGLE is not supported in decode attention backend {backend_type}"


class LegacyFactory:
    """A factory with 0.5.10's / 0.5.17's ``_create_backend`` parameters and resolution
    (the draft backend, else the server-args field, else ``attention_backend``)."""

    def __init__(self, server_args, draft_model_runner, topk, speculative_num_steps):
        self.server_args = server_args
        self.draft_model_runner = draft_model_runner
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.draft_attn_backend = server_args.speculative_draft_attention_backend

    def _create_backend(self, backend_name, backend_map, error_template):
        name = (self.draft_attn_backend or getattr(self.server_args, backend_name)
                or self.server_args.attention_backend)
        if name not in backend_map:
            raise ValueError(error_template.format(backend_type=name))
        return backend_map[name]()

    def _create_triton_decode_backend(self):
        return "triton multi-step"

    def _create_triton_prefill_backend(self):
        return "triton extend"


def _args(attention="hygon", draft=None, decode=None):
    return types.SimpleNamespace(attention_backend=attention, decode_attention_backend=decode,
                                 prefill_attention_backend=None,
                                 speculative_draft_attention_backend=draft)


@pytest.fixture
def fake_entry(monkeypatch):
    """Our entry without a model runner: ``() -> ("hygon", (kind, factory))``."""
    def entry(factory, *, multi_step):
        return lambda: ("hygon", ("multi-step" if multi_step else "extend", factory))
    monkeypatch.setattr(draft_factory, "_hygon_entry", entry)


@pytest.fixture
def legacy_class(monkeypatch):
    """The stand-in as the installed factory, wrapped; SGLang's class is restored after."""
    monkeypatch.setattr(draft_utils, "DraftBackendFactory", LegacyFactory)
    assert draft_factory.install(version("sglang"))
    assert draft_factory.install(version("sglang"))  # idempotent
    yield LegacyFactory
    draft_factory.uninstall()


def _maps(factory):
    return ({"triton": factory._create_triton_decode_backend},
            {"triton": factory._create_triton_prefill_backend})


def test_legacy_form_adds_hygon_to_the_map_it_resolves(legacy_class, fake_entry, monkeypatch):
    monkeypatch.setattr(draft_factory, "_legacy_graph_hooks", lambda: False)  # 0.5.17
    factory = legacy_class(_args(), object(), 2, 3)
    decode, extend = _maps(factory)
    kind, owner = factory._create_backend("decode_attention_backend", decode, MESSAGE)
    assert (kind, owner) == ("multi-step", factory)  # the backend alone, not (stamp, backend)
    kind, _ = factory._create_backend("prefill_attention_backend", extend, MESSAGE)
    assert kind == "extend"
    assert "hygon" not in decode and "hygon" not in extend  # SGLang's maps untouched
    # a draft backend named for the draft wins over the target's hygon
    other = legacy_class(_args(draft="triton"), object(), 2, 3)
    assert other._create_backend("decode_attention_backend", _maps(other)[0],
                                 MESSAGE) == "triton multi-step"
    # the draft inherits hygon through the decode field too
    inherited = legacy_class(_args(attention="triton", decode="hygon"), object(), 1, 3)
    assert inherited._create_backend("decode_attention_backend", _maps(inherited)[0],
                                     MESSAGE)[0] == "multi-step"


def test_legacy_form_leaves_an_unknown_map_to_sglang(legacy_class, fake_entry, monkeypatch):
    monkeypatch.setattr(draft_factory, "_legacy_graph_hooks", lambda: False)
    factory = legacy_class(_args(), object(), 1, 3)
    with pytest.raises(ValueError, match="not supported in decode attention backend hygon"):
        factory._create_backend("decode_attention_backend", {"triton": lambda: "x"}, MESSAGE)


def test_legacy_graph_hooks_refuse_hygon_with_the_workaround(legacy_class, fake_entry,
                                                             monkeypatch):
    monkeypatch.setattr(draft_factory, "_legacy_graph_hooks", lambda: True)  # 0.5.10
    factory = legacy_class(_args(), object(), 1, 3)
    with pytest.raises(ValueError, match="--speculative-draft-attention-backend triton"):
        factory._create_backend("decode_attention_backend", _maps(factory)[0], MESSAGE)
    # another draft backend is SGLang's business as before
    other = legacy_class(_args(draft="triton"), object(), 1, 3)
    assert other._create_backend("decode_attention_backend", _maps(other)[0],
                                 MESSAGE) == "triton multi-step"


def test_unknown_form_is_not_patched(monkeypatch):
    class Other:
        def _create_backend(self, name, table):
            return None

    monkeypatch.setattr(draft_utils, "DraftBackendFactory", Other)
    assert not draft_factory.install(version("sglang"))
    assert not hasattr(Other._create_backend, "__wrapped__")


def _installed_params():
    real = draft_utils.DraftBackendFactory.__dict__["_create_backend"]
    real = getattr(real, "__wrapped__", real)
    return tuple(inspect.signature(real).parameters)


@pytest.mark.skipif(_installed_params() != draft_factory._LEGACY_PARAMS,
                    reason="the installed SGLang has 0.5.23's factory form "
                           "(test_sglang_draft.py runs it)")
def test_installed_legacy_factory(fake_entry):
    """SGLang's own 0.5.10 / 0.5.17 class: wrapped at registration, its decode map told
    from its draft-extend map by its own Triton creators."""
    from hygon_attn_backend.integrations.sglang import register

    assert register()
    cls = draft_utils.DraftBackendFactory
    assert hasattr(cls._create_backend, "__wrapped__")
    factory = cls.__new__(cls)
    factory.server_args, factory.draft_model_runner = _args(), object()
    factory.topk, factory.speculative_num_steps, factory.draft_attn_backend = 1, 3, None
    decode, extend = _maps(factory)
    if draft_factory._legacy_graph_hooks():  # 0.5.10
        with pytest.raises(ValueError, match="cannot be the EAGLE draft model's backend"):
            factory._create_backend("decode_attention_backend", decode, MESSAGE)
    else:  # 0.5.17
        assert factory._create_backend("decode_attention_backend", decode,
                                       MESSAGE)[0] == "multi-step"
        assert factory._create_backend("prefill_attention_backend", extend,
                                       MESSAGE)[0] == "extend"
