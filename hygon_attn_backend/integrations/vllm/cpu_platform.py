"""Runtime patch: let an explicit ``--attention-backend hygon`` work on vLLM's CPU platform.

vLLM's ``CpuPlatform.get_attn_backend_cls`` returns its own CPU backend whatever the
user selected (it logs "Cannot use X backend on CPU."). :func:`install` wraps that class
method so that when the selected backend is ours, it validates the configuration against
our backend (as vLLM's CUDA platform does for any selected backend) and returns our class
path (the MLA backend's for an MLA layer: :mod:`.mla_select`); for every other selection, including none, it calls vLLM's original method with the
same arguments. The patch is recorded in ``patches/vllm-cpu-backend-choice.md``.

Gated to the vLLM versions where the wrapped method was read and tested
(:data:`compat.CPU_PATCH_RANGE <.compat.CPU_PATCH_RANGE>`); elsewhere it does nothing.
The original is called with the ``num_heads`` keyword only where its signature takes it
(vLLM 0.15's has none).
"""

from __future__ import annotations

import logging

from . import compat

# Under vLLM's logger namespace, so messages appear with vLLM's own (in every process).
logger = logging.getLogger("vllm.hygon_attn_backend")

_MARK = "_hygon_attn_backend_patched"


def install(version, member) -> bool:
    """Wrap ``CpuPlatform.get_attn_backend_cls`` when running on vLLM's CPU platform.

    version: the installed vLLM's version string; member: the ``AttentionBackendEnum``
    member that ``hygon`` parses to. Returns True when the wrapper is in place.
    """
    if not compat.in_range(version, compat.CPU_PATCH_RANGE):
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.platforms.cpu import CpuPlatform

    if getattr(CpuPlatform, _MARK, False):
        return True
    original = CpuPlatform.__dict__.get("get_attn_backend_cls")
    if not isinstance(original, classmethod):
        logger.warning("vLLM %s: CpuPlatform.get_attn_backend_cls is not the class method "
                       "this patch expects; 'hygon' stays unavailable on CPU.", version)
        return False
    original_func = original.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
        from . import is_selected, mla_select

        if not is_selected(selected_backend):
            return compat.call_with_supported(original_func, cls, selected_backend,
                                              attn_selector_config, num_heads=num_heads)
        # The dense class, or the MLA one for an MLA layer (mla_select), validated.
        path = mla_select.validated_path(cls, attn_selector_config)
        logger.info("Using the hygon attention backend on CPU (%s).", path.rpartition(".")[2])
        return path

    get_attn_backend_cls.__doc__ = original_func.__doc__
    get_attn_backend_cls.__wrapped__ = original_func
    CpuPlatform.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    setattr(CpuPlatform, _MARK, True)
    return True


def uninstall() -> bool:
    """Restore vLLM's original method (tests use this). Returns True if it was patched."""
    from vllm.platforms.cpu import CpuPlatform

    if not getattr(CpuPlatform, _MARK, False):
        return False
    wrapper = CpuPlatform.__dict__["get_attn_backend_cls"].__func__
    CpuPlatform.get_attn_backend_cls = classmethod(wrapper.__wrapped__)
    delattr(CpuPlatform, _MARK)
    return True
