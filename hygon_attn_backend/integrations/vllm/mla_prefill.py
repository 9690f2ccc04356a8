"""vLLM's MLA prefill-backend slot for layers that ``hygon`` serves.

vLLM's ``MLAAttention.__init__`` (0.21 to 0.32) builds an MLA *prefill* backend for every
MLA layer, whatever attention backend the layer runs
(``mla_attention.get_mla_prefill_backend(vllm_config)``, then the class's constructor),
and the metadata builder clones it and hands it each step's prefill metadata
(``prepare_metadata``). Our impl never calls it: ``HygonMLAImpl.forward_mha`` runs its
own prefill (:func:`.mla_step.prefill`). Where vLLM's choice cannot be built, the layer
would fail for nothing: vLLM's CPU platform before 0.32 has no CPU prefill backend and
its selector returns FlashAttention's (no device capability), whose constructor asserts
that flash-attn is there; a ROCm host without flash-attn has none either.

:func:`install` wraps that function as ``mla_attention`` sees it: when vLLM's answer is
unusable (it raises ``ValueError``, or ``ImportError`` as the FlashAttention module
does on the CPU builds of 0.25 and 0.28, or the class it returns says ``is_available()``
is False, as on 0.21's), the selected attention backend is ours and the user named no
``mla_prefill_backend``, the answer is :func:`placeholder_class`, a prefill backend that
keeps the metadata vLLM gives it and refuses to run. Every other call returns vLLM's
answer unchanged. Installed from :func:`.mla_select.validated_path` when it hands vLLM
our MLA class (the layer asks for its prefill backend right after), so nothing changes
for a run that does not select ``hygon``. Recorded in ``patches/vllm-mla-prefill-slot.md``.
"""

from __future__ import annotations

import functools
import importlib

from . import logger

_MARK = "_hygon_attn_backend_mla_prefill_patched"
#: The module whose global ``get_mla_prefill_backend`` ``MLAAttention.__init__`` calls.
LAYER_MODULE = "vllm.model_executor.layers.attention.mla_attention"


@functools.lru_cache(maxsize=None)
def placeholder_class():
    """A vLLM ``MLAPrefillBackend`` that holds the prepared metadata and runs nothing (the
    hygon MLA impl computes the prefill itself); built on first use (it imports vLLM)."""
    from vllm.v1.attention.backends.mla.prefill.base import MLAPrefillBackend

    class HygonMLAPrefillPlaceholder(MLAPrefillBackend):
        """The prefill slot of an MLA layer served by hygon's MLA impl, which never calls
        it: a call means another impl reached this layer's metadata."""

        @staticmethod
        def get_name() -> str:
            return "HYGON_MLA_PREFILL_PLACEHOLDER"

        def _refuse(self, *args, **kwargs):
            raise NotImplementedError(
                "the hygon MLA backend runs the MLA prefill itself (HygonMLAImpl."
                "forward_mha); vLLM's prefill backend slot of this layer holds a "
                "placeholder that computes nothing")

        run_prefill_new_tokens = _refuse
        run_prefill_context_chunk = _refuse

    return HygonMLAPrefillPlaceholder


def _usable(cls) -> bool:
    try:
        return bool(cls.is_available())
    except Exception:  # an availability probe that itself fails: not usable
        return False


def _ours_selected(vllm_config) -> bool:
    from . import is_selected

    attention = getattr(vllm_config, "attention_config", None)
    return (attention is not None and is_selected(attention.backend)
            and getattr(attention, "mla_prefill_backend", None) is None)


def choose(original, vllm_config, *args, **kwargs):
    """vLLM's prefill backend class from ``original(vllm_config, ...)``, or the
    placeholder where that is unusable and the layer is ours (see the module text)."""
    try:
        chosen = original(vllm_config, *args, **kwargs)
    except (ValueError, ImportError):  # none valid; or its module does not import here
        if not _ours_selected(vllm_config):
            raise
        chosen = None
    if chosen is not None and (_usable(chosen) or not _ours_selected(vllm_config)):
        return chosen
    logger.info("hygon MLA: vLLM has no usable MLA prefill backend here (%s); the layer's "
                "prefill slot holds a placeholder (hygon runs the prefill itself).",
                "none found" if chosen is None else f"{chosen.get_name()} unavailable")
    return placeholder_class()


def install() -> bool:
    """Wrap ``mla_attention.get_mla_prefill_backend``; True when the wrapper is in place
    (False where vLLM has no such function: nothing to wrap)."""
    try:
        module = importlib.import_module(LAYER_MODULE)
    except ImportError:
        return False
    original = getattr(module, "get_mla_prefill_backend", None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def get_mla_prefill_backend(vllm_config, *args, **kwargs):
        return choose(original, vllm_config, *args, **kwargs)

    setattr(get_mla_prefill_backend, _MARK, True)
    module.get_mla_prefill_backend = get_mla_prefill_backend
    return True


def uninstall() -> bool:
    """Restore vLLM's function (tests use this)."""
    module = importlib.import_module(LAYER_MODULE)
    current = getattr(module, "get_mla_prefill_backend", None)
    if not getattr(current, _MARK, False):
        return False
    module.get_mla_prefill_backend = current.__wrapped__
    return True
