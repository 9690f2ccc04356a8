"""SGLang integration: ``--attention-backend hygon``.

SGLang calls :func:`register` through the ``sglang.srt.plugins`` entry point in every
process it starts (``load_plugins()``), before it parses or builds ``ServerArgs``.
Registration only adds the name ``"hygon"`` to the attention-backend choices (shared by
``--attention-backend``, ``--prefill-attention-backend`` and
``--decode-attention-backend``) and a factory to SGLang's backend registry; the backend
module, Triton and our kernels load when a model runner actually asks for ``hygon``.
Without the flag nothing of ours runs.

Speculative decoding: registration also adds ``hygon`` to SGLang's draft attention-backend
choices (``--speculative-draft-attention-backend``, and the target's backend a draft
inherits) and wraps ``DraftBackendFactory._create_backend`` so that EAGLE's draft decode
and draft extend resolve ``hygon`` (``draft_factory.py``; the wrapper changes nothing for
any other backend).

SGLang 0.5.10, 0.5.17 and 0.5.23 are supported. What differs between them lives in
``compat.py``: where the choices list is (``arg_groups.choices`` or ``server_args``),
whether a plugin loader exists (0.5.10 has none: the Engine's scheduler-process entry is
pointed at ours, patches/sglang-0.5.10-scheduler-spawn.md), the KV write location
(``KVWriteLoc.for_layer``, ``KVWriteLoc``, a bare tensor) and the CUDA-graph hooks
(``init_forward_metadata_out_graph`` / ``_in_graph`` or 0.5.10's capture / replay pair).
A version missing an extension point is refused with one log line, untouched.

Offline use without the entry point (for example from a source checkout)::

    from hygon_attn_backend.integrations.sglang import register
    register()
    engine = sglang.Engine(model_path=..., attention_backend="hygon")
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

BACKEND_NAME = "hygon"

_registered = False


def _create_backend(model_runner):
    """SGLang's factory signature: ``fn(model_runner) -> AttentionBackend``; MLA models
    (``model_runner.use_mla_backend``) get ``mla.HygonMLABackend``."""
    from hygon_attn_backend.integrations.sglang.mla import HygonMLABackend, is_mla_runner

    if is_mla_runner(model_runner):
        return HygonMLABackend(model_runner)
    from hygon_attn_backend.integrations.sglang.backend import HygonAttnBackend

    return HygonAttnBackend(model_runner)


def _register_draft_backend() -> None:
    """``hygon`` among the draft backends: the choices SGLang's draft worker accepts (0.5.23;
    0.5.10 and 0.5.17 take any name there) and the factory's maps through
    ``draft_factory.install`` (a version whose factory it does not know keeps ``hygon`` for
    the target only)."""
    try:
        from sglang.srt.arg_groups.choices import (
            DRAFT_ATTENTION_BACKEND_CHOICES,
            add_draft_attention_backend_choices,
        )
    except ImportError as exc:
        logger.debug("hygon: SGLang draft attention-backend choices not found (%s)", exc)
    else:
        if BACKEND_NAME not in DRAFT_ATTENTION_BACKEND_CHOICES:
            add_draft_attention_backend_choices([BACKEND_NAME])
    from hygon_attn_backend.integrations.sglang import draft_factory

    draft_factory.install(draft_factory.installed_version())


def register() -> bool:
    """Make ``hygon`` selectable in SGLang. Idempotent; returns True once registered.

    Supported: SGLang 0.5.10 to 0.5.23 (``compat.py`` lists what differs between them).
    Every extension point is checked before anything changes: when one is missing (no
    SGLang, or a layout we do not know) it logs one line saying why, returns False and
    leaves SGLang untouched. On a version without a plugin loader (0.5.10) it also points
    the Engine's scheduler-process entry at ours (``compat.install_spawn_hook``), so the
    processes the Engine spawns register too.
    """
    global _registered
    if _registered:
        return True
    try:
        from hygon_attn_backend.integrations.sglang import compat
    except ImportError as exc:  # pragma: no cover - our own module
        logger.warning("hygon: SGLang integration unavailable (%s)", exc)
        return False
    try:
        reason = compat.unsupported_reason()
    except ImportError as exc:  # no SGLang here
        reason = f"SGLang not importable ({exc})"
    if reason is not None:
        logger.warning("hygon: attention backend not registered with SGLang %s: %s",
                       compat.sglang_version(), reason)
        return False
    choices, add_choices = compat.choices_api()
    backends, register_backend = compat.registry_api()
    if BACKEND_NAME not in choices:
        add_choices([BACKEND_NAME])
    if BACKEND_NAME not in backends:
        register_backend(BACKEND_NAME)(_create_backend)
    _register_draft_backend()
    if not compat.has_plugin_loader():
        compat.install_spawn_hook()
    _registered = True
    return True


__all__ = ["BACKEND_NAME", "register"]
