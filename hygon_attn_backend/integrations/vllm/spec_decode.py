"""Runtime patch: our metadata on the drafter's ROCm allow-list (vLLM 0.32).

On a ROCm platform, vLLM 0.32's drafter (``SpecDecodeBaseProposer`` in
``vllm/v1/spec_decode/llm_base_proposer.py``, the base of the EAGLE and draft-model
proposers) builds ``allowed_attn_types`` in ``__init__``: a literal tuple of vLLM's own
metadata classes (Triton, ROCm, AITER, MLA, Flex, ...). With more than one speculative
token, ``propose()`` raises "Unsupported attention metadata type for speculative decoding
with num_speculative_tokens > 1" for every other type, so an out-of-tree backend cannot
draft several tokens on ROCm (Hygon DCUs run vLLM's ROCm platform). vLLM's own backends
pass by being listed or by subclassing a listed class; our metadata
(``step.HygonAttentionMetadata``, engine-free) is neither. The multi-step drafting loop
itself needs nothing of the metadata's type: it rebuilds each step's metadata through the
backend's builder, as it does on CUDA (and on CPU, where no allow-list is consulted).

:func:`install` wraps ``SpecDecodeBaseProposer.__init__``: after vLLM's own ``__init__``,
when it made an allow-list (ROCm only) and the selected attention backend is ours, our
metadata class is appended; otherwise the proposer is exactly vLLM's. The drafter's module
is heavy (models, loaders), so the wrapper is installed when that module is first
imported (an import hook on that one name), or at once when it already is. Recorded in
``patches/vllm-0.32-rocm-drafter-allow-list.md``; gated to :data:`PATCHED_VERSIONS`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import sys

from hygon_attn_backend.integrations._patch import version_tuple

from . import logger

#: vLLM (major, minor) versions whose drafter allow-list this patch was written for.
PATCHED_VERSIONS = ((0, 32),)
MODULE = "vllm.v1.spec_decode.llm_base_proposer"
_MARK = "_hygon_attn_backend_patched"


def _allow_ours(proposer, vllm_config) -> None:
    allowed = getattr(proposer, "allowed_attn_types", None)
    if allowed is None:  # not ROCm: vLLM consults no allow-list
        return
    from . import is_selected
    from .step import HygonAttentionMetadata

    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if is_selected(backend) and HygonAttentionMetadata not in allowed:
        proposer.allowed_attn_types = tuple(allowed) + (HygonAttentionMetadata,)


def patch_module(module) -> bool:
    """Wrap the proposer's ``__init__`` in the imported drafter module (idempotent)."""
    cls = getattr(module, "SpecDecodeBaseProposer", None)
    if cls is None:
        logger.warning("vLLM: %s has no SpecDecodeBaseProposer; multi-token drafting with "
                       "'hygon' stays unavailable on ROCm.", MODULE)
        return False
    if getattr(cls, _MARK, False):
        return True
    original = cls.__dict__["__init__"]
    if list(inspect.signature(original).parameters)[:2] != ["self", "vllm_config"]:
        logger.warning("vLLM: SpecDecodeBaseProposer.__init__ is not the method this patch "
                       "expects; multi-token drafting with 'hygon' stays unavailable on ROCm.")
        return False

    def __init__(self, vllm_config, *args, **kwargs):
        original(self, vllm_config, *args, **kwargs)
        _allow_ours(self, vllm_config)

    __init__.__doc__ = original.__doc__
    __init__.__wrapped__ = original
    cls.__init__ = __init__
    setattr(cls, _MARK, True)
    return True


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds :data:`MODULE` as the path finder does and patches it once it has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run = loader.exec_module

        def exec_module(module):
            run(module)
            patch_module(module)

        loader.exec_module = exec_module
        return spec


def install(version) -> bool:
    """Patch the drafter now if its module is imported, else when it is. ``version``: the
    installed vLLM's version string. Returns True when the patch is (or will be) in place."""
    if version_tuple(version) not in PATCHED_VERSIONS:
        return False
    module = sys.modules.get(MODULE)
    if module is not None:
        return patch_module(module)
    if not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())
    return True


def uninstall() -> bool:
    """Restore vLLM's ``__init__`` and drop the import hook (tests use this)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PatchOnImport)]
    module = sys.modules.get(MODULE)
    cls = getattr(module, "SpecDecodeBaseProposer", None) if module is not None else None
    if cls is None or not getattr(cls, _MARK, False):
        return False
    cls.__init__ = cls.__dict__["__init__"].__wrapped__
    delattr(cls, _MARK)
    return True
