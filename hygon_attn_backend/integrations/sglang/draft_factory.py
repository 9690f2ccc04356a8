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

SGLang 0.5.10 and 0.5.17 have the older ``_create_backend(backend_name, backend_map,
error_template)``, whose entries return the backend alone and which resolves the name from
the server args (the runner's draft backend, else the named field, else
``attention_backend``); there the wrapper tells the two maps apart by their Triton entry
(the decode map's is ``_create_triton_decode_backend``). 0.5.17's draft workers call the
container's ``init_forward_metadata_out_graph`` / ``_in_graph`` as 0.5.23's do. 0.5.10's
call the older per-batch hooks and capture the EAGLE v1 draft extend in CUDA graphs for
any backend, which ours does not serve; there choosing ``hygon`` for the draft raises a
``ValueError`` that names the workaround (another draft backend; ``hygon`` still verifies).

Gated to the SGLang versions whose factory was read (:data:`PATCHED_VERSIONS`) and to
``_create_backend`` having one of the two parameter lists above; elsewhere nothing is
installed.
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
#: 0.5.10 and 0.5.17: no ``stamps_children``, the entries return the backend alone
_LEGACY_PARAMS = ("self", "backend_name", "backend_map", "error_template")


def _resolved_backend(factory, backend_name: str):
    """The backend name ``_create_backend`` will look up, read as it reads it."""
    from sglang.srt.runtime_context import attention_backends

    prefill, decode = attention_backends()
    configured = decode if backend_name == "decode_attention_backend" else prefill
    return factory.draft_attn_backend or configured


def _legacy_resolved_backend(factory, backend_name: str):
    """The name 0.5.10's / 0.5.17's ``_create_backend`` looks up, read as it reads it."""
    args = factory.server_args
    return (factory.draft_attn_backend or getattr(args, backend_name, None)
            or args.attention_backend)


def _legacy_map_kind(factory, backend_map) -> "bool | None":
    """Whether ``backend_map`` is the multi-step decode map (True) or the draft-extend map
    (False) of a 0.5.10 / 0.5.17 factory, told by its Triton entry (both maps hold one);
    None when neither matches (the entry is then not added)."""
    entry = getattr(backend_map.get("triton"), "__func__", None)
    cls = type(factory)
    if entry is not None and entry is getattr(cls, "_create_triton_decode_backend", None):
        return True
    if entry is not None and entry is getattr(cls, "_create_triton_prefill_backend", None):
        return False
    return None


def _legacy_graph_hooks() -> bool:
    """SGLang 0.5.10 (:func:`compat.has_legacy_graph_hooks`): the draft workers call the
    older per-batch graph hooks and capture the EAGLE v1 draft extend, which ``hygon`` does
    not serve."""
    from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

    from hygon_attn_backend.integrations.sglang import compat

    return compat.has_legacy_graph_hooks(AttentionBackend)


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
    params = tuple(inspect.signature(original).parameters) if original is not None else ()
    if params == _PARAMS:
        wrapper = _wrapper(original)
    elif params == _LEGACY_PARAMS:
        wrapper = _legacy_wrapper(original, version)
    else:
        logger.warning("SGLang %s: DraftBackendFactory._create_backend is not a method "
                       "this patch knows (0.5.10's, 0.5.17's or 0.5.23's form); 'hygon' "
                       "stays unavailable as a draft backend: name another for the draft "
                       "model (--speculative-draft-attention-backend triton) and hygon "
                       "still runs the target's verify.", version)
        return False
    wrap_method(DraftBackendFactory, "_create_backend", wrapper, _MARK)
    return True


def _wrapper(original):
    """0.5.23's form: the entry returns ``(stamp, backend)``."""

    def _create_backend(self, backend_name, backend_map, error_template,
                        stamps_children=False):
        from hygon_attn_backend.integrations.sglang import BACKEND_NAME

        if BACKEND_NAME not in backend_map and \
                _resolved_backend(self, backend_name) == BACKEND_NAME:
            backend_map = dict(backend_map)
            backend_map[BACKEND_NAME] = _hygon_entry(self, multi_step=stamps_children)
        return original(self, backend_name, backend_map, error_template,
                        stamps_children=stamps_children)

    return _create_backend


def _legacy_wrapper(original, version):
    """0.5.10's and 0.5.17's form: the entry returns the backend alone."""

    def _create_backend(self, backend_name, backend_map, error_template):
        from hygon_attn_backend.integrations.sglang import BACKEND_NAME

        if BACKEND_NAME in backend_map or \
                _legacy_resolved_backend(self, backend_name) != BACKEND_NAME:
            return original(self, backend_name, backend_map, error_template)
        multi_step = _legacy_map_kind(self, backend_map)
        if multi_step is None:
            return original(self, backend_name, backend_map, error_template)
        if _legacy_graph_hooks():
            raise ValueError(
                f"the hygon attention backend cannot be the EAGLE draft model's backend on "
                f"SGLang {version}: name another for the draft "
                f"(--speculative-draft-attention-backend triton); hygon still runs the "
                f"target model and its verify")
        create = _hygon_entry(self, multi_step=multi_step)
        backend_map = dict(backend_map)
        backend_map[BACKEND_NAME] = lambda: create()[1]
        return original(self, backend_name, backend_map, error_template)

    return _create_backend


def uninstall() -> bool:
    """Restore SGLang's method (tests use this). Returns True if it was patched."""
    from sglang.srt.speculative.draft_utils import DraftBackendFactory

    return unwrap_method(DraftBackendFactory, "_create_backend", _MARK)
