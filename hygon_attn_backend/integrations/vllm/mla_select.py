"""One flag, two backends: how ``--attention-backend hygon`` reaches the MLA backend.

vLLM selects a backend per attention layer: its selector asks the platform
(``Platform.get_attn_backend_cls(selected_backend, attn_selector_config)``) and the
config's ``use_mla`` says whether the layer is MLA (DeepSeek-V2/V3 style). The enum member
``hygon`` parses to names one class path (the dense :data:`BACKEND_PATH
<hygon_attn_backend.integrations.vllm.BACKEND_PATH>`), so the platform's answer is where
the MLA class comes in: when the selection is ours and ``use_mla`` is set,
:func:`backend_path` gives :data:`MLA_BACKEND_PATH` (``mla.HygonMLABackend``), otherwise
the dense path.

* vLLM's CPU platform: its method is already wrapped by :mod:`.cpu_platform`, which asks
  :func:`backend_path` here.
* every other platform (ROCm, CUDA): their method validates and returns the *selected*
  member's own class, the dense one, which refuses ``use_mla``. :func:`install` wraps that
  platform's method as :mod:`.cpu_platform` does: for our selection with ``use_mla`` it
  validates and returns the MLA class; every other call goes to vLLM's method unchanged.

Only on the vLLM versions the MLA backend was written against (:data:`compat.MLA_RANGE
<.compat.MLA_RANGE>`, 0.15 to 0.32); elsewhere ``use_mla`` keeps the dense path and vLLM's validation
refuses it with its own message.
"""

from __future__ import annotations

import importlib

from . import compat, logger

#: The MLA backend class vLLM imports for an MLA layer when ``hygon`` is selected.
MLA_BACKEND_PATH = "hygon_attn_backend.integrations.vllm.mla.HygonMLABackend"

_MARK = "_hygon_attn_backend_mla_patched"


def mla_available(version=None) -> bool:
    """True when this vLLM (``version``, default the installed one) takes our MLA backend."""
    if version is None:
        from . import vllm_version

        version = vllm_version()
    return compat.in_range(version, compat.MLA_RANGE)


def backend_path(attn_selector_config, version=None) -> str:
    """The class path ``hygon`` resolves to for a layer with this selector config:
    :data:`MLA_BACKEND_PATH` for an MLA layer (on a vLLM in ``MLA_RANGE``), else the dense
    backend's."""
    from . import BACKEND_PATH

    if getattr(attn_selector_config, "use_mla", False) and mla_available(version):
        return MLA_BACKEND_PATH
    return BACKEND_PATH


def load(path: str):
    """Import the class at ``path`` (``module.Class``)."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def validated_path(platform_cls, attn_selector_config) -> str:
    """The path for this layer after our class's own ``validate_configuration``; raises
    ValueError with its reasons (as vLLM's platforms do for a selected backend). For an
    MLA layer it also puts the prefill-slot wrapper in place (:mod:`.mla_prefill`): vLLM's
    MLA layer asks for its prefill backend right after its attention backend."""
    path = backend_path(attn_selector_config)
    reasons = load(path).validate_configuration(
        device_capability=platform_cls.get_device_capability(),
        **attn_selector_config._asdict())
    if reasons:
        raise ValueError(f"Selected backend hygon is not valid for this configuration. "
                         f"Reason: {reasons}")
    if path == MLA_BACKEND_PATH:
        from . import mla_prefill

        mla_prefill.install()
    return path


def install(version, platform_cls) -> bool:
    """Wrap ``platform_cls.get_attn_backend_cls`` (a non-CPU platform) so that an MLA layer
    with ``hygon`` selected gets :data:`MLA_BACKEND_PATH`. Returns True when the wrapper is
    in place (False outside ``MLA_RANGE`` or when the method is not a class method)."""
    if not mla_available(version):
        return False
    if getattr(platform_cls, _MARK, False):
        return True
    original = owner = None
    for owner in platform_cls.__mro__:
        if "get_attn_backend_cls" in owner.__dict__:
            original = owner.__dict__["get_attn_backend_cls"]
            break
    if not isinstance(original, classmethod):
        logger.warning("vLLM %s: %s.get_attn_backend_cls is not a class method; 'hygon' "
                       "serves dense layers only there.", version, platform_cls.__name__)
        return False
    original_func = original.__func__

    def get_attn_backend_cls(cls, selected_backend, attn_selector_config, *args, **kwargs):
        from . import is_selected

        if is_selected(selected_backend) and getattr(attn_selector_config, "use_mla", False):
            logger.info("Using the hygon MLA attention backend.")
            return validated_path(cls, attn_selector_config)
        return original_func(cls, selected_backend, attn_selector_config, *args, **kwargs)

    get_attn_backend_cls.__doc__ = original_func.__doc__
    get_attn_backend_cls.__wrapped__ = original_func
    get_attn_backend_cls._hygon_own = owner is platform_cls
    platform_cls.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    setattr(platform_cls, _MARK, True)
    return True


def uninstall(platform_cls) -> bool:
    """Restore the platform's original method (tests use this)."""
    if not getattr(platform_cls, _MARK, False):
        return False
    wrapper = platform_cls.__dict__["get_attn_backend_cls"].__func__
    if wrapper._hygon_own:
        platform_cls.get_attn_backend_cls = classmethod(wrapper.__wrapped__)
    else:  # the method was inherited: drop the wrapper, the base's shows through again
        del platform_cls.get_attn_backend_cls
    delattr(platform_cls, _MARK)
    return True
