"""Runtime patch: ``hygon`` as an EAGLE draft attention backend in SGLang 0.5.x.

SGLang's ``DraftBackendFactory`` (``sglang/srt/speculative/draft_utils.py``) builds the
draft worker's backends from two literal maps inside ``create_decode_backend`` and
``create_draft_extend_backend``; a name outside them (every plugin's) is refused with
"EAGLE is not supported in (decode) attention backend ...". Both methods hand their map
to ``_create_backend(backend_name, backend_map, error_template, stamps_children)``, which
resolves the backend the draft runs on (the runner's draft backend, else the configured
prefill / decode backend) and looks it up. :func:`install` wraps ``_create_backend``:
only when that resolved name is ``hygon`` it adds a ``hygon`` entry to the map it passes
on (the multi-step draft decode container for the decode map, whose per-step children
SGLang stamps: ``stamps_children``; our ``HygonAttnBackend`` for draft extend); every other
backend sees SGLang's own map and code. Recorded in
``patches/sglang-0.5-draft-backend-factory.md``. Building our draft-extend backend also
installs ``draft_graphs`` (the EAGLE v2 worker's draft-extend CUDA graph).

Gated to the SGLang versions whose factory was read (:data:`PATCHED_VERSIONS`) and to
``_create_backend`` having the parameters named above; elsewhere nothing is installed.
"""

from __future__ import annotations

import inspect
import logging

from hygon_attn_backend.integrations._patch import unwrap_method, version_tuple, wrap_method

logger = logging.getLogger(__name__)

#: SGLang (major, minor) versions whose DraftBackendFactory this patch was written for.
PATCHED_VERSIONS = ((0, 5),)
_MARK = "_hygon_attn_backend_patched"
_PARAMS = ("self", "backend_name", "backend_map", "error_template", "stamps_children")


def _resolved_backend(factory, backend_name: str):
    """The backend name ``_create_backend`` will look up, read as it reads it."""
    from sglang.srt.runtime_context import attention_backends

    prefill, decode = attention_backends()
    configured = decode if backend_name == "decode_attention_backend" else prefill
    return factory.draft_attn_backend or configured


def _hygon_entry(factory, *, multi_step: bool):
    """The map entry SGLang calls: ``() -> (stamp, backend)``."""
    from hygon_attn_backend.integrations.sglang import BACKEND_NAME

    def create():
        runner = factory.draft_model_runner
        if multi_step:
            from hygon_attn_backend.integrations.sglang.draft import HygonMultiStepDraftBackend

            return BACKEND_NAME, HygonMultiStepDraftBackend(
                runner, factory.topk, factory.speculative_num_steps)
        from hygon_attn_backend.integrations.sglang import _create_backend, draft_graphs

        draft_graphs.install(installed_version())  # the EAGLE v2 worker captures it
        return BACKEND_NAME, _create_backend(runner)  # an MLA draft: HygonMLABackend

    return create


def installed_version() -> str:
    """The installed SGLang's version string (its metadata, else ``sglang.__version__``: a
    source checkout without metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        import sglang

        return str(getattr(sglang, "__version__", ""))


def install(version) -> bool:
    """Wrap ``DraftBackendFactory._create_backend`` (idempotent). ``version``: the installed
    SGLang's version string. Returns True when the wrapper is in place."""
    if version_tuple(version) not in PATCHED_VERSIONS:
        return False
    try:
        from sglang.srt.speculative.draft_utils import DraftBackendFactory
    except ImportError as exc:
        logger.debug("hygon: SGLang's DraftBackendFactory not found (%s)", exc)
        return False
    if getattr(DraftBackendFactory, _MARK, False):
        return True
    original = DraftBackendFactory.__dict__.get("_create_backend")
    if original is None or tuple(inspect.signature(original).parameters) != _PARAMS:
        logger.warning("SGLang %s: DraftBackendFactory._create_backend is not the method "
                       "this patch expects (0.5.23's form); 'hygon' stays unavailable as a "
                       "draft backend: name another for the draft model "
                       "(--speculative-draft-attention-backend triton) and hygon still "
                       "runs the target's verify.", version)
        return False

    def _create_backend(self, backend_name, backend_map, error_template,
                        stamps_children=False):
        from hygon_attn_backend.integrations.sglang import BACKEND_NAME

        if BACKEND_NAME not in backend_map and \
                _resolved_backend(self, backend_name) == BACKEND_NAME:
            backend_map = dict(backend_map)
            backend_map[BACKEND_NAME] = _hygon_entry(self, multi_step=stamps_children)
        return original(self, backend_name, backend_map, error_template,
                        stamps_children=stamps_children)

    wrap_method(DraftBackendFactory, "_create_backend", _create_backend, _MARK)
    return True


def uninstall() -> bool:
    """Restore SGLang's method (tests use this). Returns True if it was patched."""
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    return unwrap_method(DraftBackendFactory, "_create_backend", _MARK)
