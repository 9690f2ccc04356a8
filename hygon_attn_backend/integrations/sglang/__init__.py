"""SGLang integration: ``--attention-backend hygon``.

SGLang calls :func:`register` through the ``sglang.srt.plugins`` entry point in every
process it starts (``load_plugins()``), before it parses or builds ``ServerArgs``.
Registration only adds the name ``"hygon"`` to the attention-backend choices (shared by
``--attention-backend``, ``--prefill-attention-backend`` and
``--decode-attention-backend``) and a factory to SGLang's backend registry; the backend
module, Triton and our kernels load when a model runner actually asks for ``hygon``.
Without the flag nothing of ours runs.

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
    """SGLang's factory signature: ``fn(model_runner) -> AttentionBackend``."""
    from hygon_attn_backend.integrations.sglang.backend import HygonAttnBackend

    return HygonAttnBackend(model_runner)


def register() -> bool:
    """Make ``hygon`` selectable in SGLang. Idempotent; returns True once registered.

    Returns False (and changes nothing) when SGLang, or the extension points this
    version relies on (``sglang.srt.arg_groups.choices.add_attention_backend_choices``,
    ``attention_registry.register_attention_backend``), are missing.
    """
    global _registered
    if _registered:
        return True
    try:
        from sglang.srt.arg_groups.choices import (
            ATTENTION_BACKEND_CHOICES,
            add_attention_backend_choices,
        )
        from sglang.srt.layers.attention.attention_registry import (
            ATTENTION_BACKENDS,
            register_attention_backend,
        )
    except ImportError as exc:  # no SGLang here, or a layout we do not know
        logger.debug("hygon: SGLang attention-backend registry not found (%s)", exc)
        return False
    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(_create_backend)
    _registered = True
    return True


__all__ = ["BACKEND_NAME", "register"]
