"""vLLM integration: ``--attention-backend hygon``.

vLLM loads :func:`register` through the ``vllm.general_plugins`` entry point in every
process it starts (the front end, the engine core and each worker). ``register`` is
idempotent and cheap: it imports nothing of ours beyond this module and nothing of vLLM
that vLLM has not already imported when it calls plugins (the backend class is named by
its path and imported only when vLLM selects it).

How the name ``hygon`` reaches a spawned worker
-----------------------------------------------
vLLM parses ``--attention-backend NAME`` as ``AttentionBackendEnum[NAME.upper()]`` and
ships the config to spawned processes by pickle, and an enum member pickles by *value*.
A spawned process unpickles the config before it loads plugins, so a member created at
run time (``AttentionBackendEnum.register("HYGON", ...)``) would not exist yet there and
unpickling would fail. The enum's ``CUSTOM`` slot (value ``None``) exists in every
process, so ``register`` points ``CUSTOM`` at our backend class (vLLM's own
``register_backend``) and adds ``HYGON`` as an alias *name* of that member: the user's
``hygon`` parses to ``CUSTOM``, which survives pickling, and each process's own
``register`` call makes ``CUSTOM`` resolve to our class before any backend is selected.
If another plugin already owns ``CUSTOM``, ``register`` leaves it alone and registers a
separate ``HYGON`` member instead (works in one process and with forked workers; a
warning says spawned workers cannot see it). vLLM before 0.32 cannot create members
(no ``AttentionBackendEnum.register``): there ``register`` refuses instead.

CPU platform
------------
vLLM's ``CpuPlatform.get_attn_backend_cls`` (0.15 to 0.32 at least) ignores the selected
backend and always returns its own CPU backend. ``register`` installs a version-gated
wrapper (:mod:`.cpu_platform`, recorded in ``patches/vllm-cpu-backend-choice.md``) that
returns our backend only when the selection is ours; every other selection goes to
vLLM's original method unchanged.

MLA models
----------
The same name serves MLA layers (DeepSeek-V2/V3): vLLM asks the platform for a backend
with ``use_mla=True``, and our platform wrappers answer with the MLA backend class
(:mod:`.mla_select`, :mod:`.mla`) there, the dense class otherwise.

Speculative decoding on ROCm
----------------------------
vLLM 0.32's drafter accepts, on ROCm platforms and with more than one speculative token,
only an allow-list of vLLM's own attention-metadata classes. ``register`` installs a
version-gated wrapper of the drafter's ``__init__`` (:mod:`.spec_decode`, recorded in
``patches/vllm-0.32-rocm-drafter-allow-list.md``) that adds ours to that list only when
``hygon`` is the selected backend; it is installed when the drafter's module is imported.

Supported vLLM versions
-----------------------
:data:`compat.SUPPORTED_RANGE <.compat.SUPPORTED_RANGE>` (0.15 to 0.34; measured per
version by ``scripts/compat/run.py``, ``docs/compat.md``). The interface differences
between them are adapted in :mod:`.compat`, the one module that knows versions. On a
version outside the range, or a vLLM lacking what registration needs
(:func:`.compat.missing_capabilities`), ``register`` logs one warning line and changes
nothing.
"""

from __future__ import annotations

import logging
from typing import Optional

from . import compat

# Under vLLM's logger namespace, so messages appear with vLLM's own (in every process).
logger = logging.getLogger("vllm.hygon_attn_backend")

#: Name users pass: ``--attention-backend hygon`` (vLLM upper-cases it).
BACKEND_NAME = "HYGON"
#: Class path vLLM resolves when our backend is selected.
BACKEND_PATH = "hygon_attn_backend.integrations.vllm.backend.HygonAttentionBackend"

_registered_member = None


def vllm_version() -> Optional[str]:
    """The installed vLLM's version string, or None when vLLM is not importable."""
    try:
        from vllm.version import __version__
    except Exception:  # vLLM absent or broken: the plugin must never break anything
        return None
    return __version__


def is_supported_version(version: Optional[str]) -> bool:
    return version is not None and compat.in_range(version, compat.SUPPORTED_RANGE)


def unsupported_reason(version: Optional[str]) -> Optional[str]:
    """Why ``register`` would refuse this vLLM, or None when it can register."""
    if version is None:
        return "vLLM is not importable"
    if not is_supported_version(version):
        return (f"vLLM {version} is outside the supported range "
                f"{compat.range_text(compat.SUPPORTED_RANGE)}")
    missing = compat.missing_capabilities()
    if missing:
        return f"vLLM {version} lacks {', '.join(missing)}"
    return None


def register():
    """Make ``--attention-backend hygon`` select our backend in this process.

    Idempotent; returns the ``AttentionBackendEnum`` member that ``hygon`` parses to (or
    None on an unsupported vLLM, where nothing is changed).
    """
    global _registered_member
    if _registered_member is not None:
        return _registered_member
    version = vllm_version()
    reason = unsupported_reason(version)
    if reason is not None:
        _refuse(reason)
        return None

    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    enum = AttentionBackendEnum
    existing = enum.__members__.get(BACKEND_NAME)
    if existing is not None:
        member = existing  # registered before in this process (e.g. by another path)
    elif (not enum.CUSTOM.is_overridden()
          or enum.CUSTOM.get_path() == BACKEND_PATH):
        register_backend(enum.CUSTOM, BACKEND_PATH)
        member = enum.CUSTOM
        # An alias name for the CUSTOM member, as Enum itself stores aliases: in the
        # name -> member map only, so iterating the enum does not list CUSTOM twice.
        setattr(enum, BACKEND_NAME, member)
        enum._member_map_[BACKEND_NAME] = member
    elif not compat.can_add_members():
        _refuse(f"vLLM's CUSTOM attention backend slot already points at "
                f"{enum.CUSTOM.get_path()} and vLLM {version} cannot add a 'hygon' member")
        return None
    else:
        logger.warning("vLLM's CUSTOM attention backend slot already points at %s; "
                       "registering 'hygon' as its own name instead. Spawned workers "
                       "cannot unpickle that name: use it with forked workers only.",
                       enum.CUSTOM.get_path())
        register_backend(BACKEND_NAME, BACKEND_PATH)  # creates the member HYGON
        member = enum[BACKEND_NAME]

    from . import cpu_platform, spec_decode

    if not cpu_platform.install(version, member):
        _install_mla_selection(version)
    spec_decode.install(version)
    _registered_member = member
    return member


def _install_mla_selection(version) -> None:
    """On a non-CPU platform, let MLA layers resolve ``hygon`` to the MLA backend."""
    from vllm.platforms import current_platform

    from . import mla_select

    if not current_platform.is_cpu():
        mla_select.install(version, type(current_platform))


def _refuse(reason: str) -> None:
    logger.warning("hygon-attn-backend: %s; the 'hygon' attention backend is not registered "
                   "and vLLM is left unchanged.", reason)


def is_selected(backend) -> bool:
    """True when ``backend`` (an ``AttentionBackendEnum`` member or None) is ours."""
    if backend is None or _registered_member is None:
        return False
    try:
        return backend is _registered_member and backend.get_path() == BACKEND_PATH
    except ValueError:
        return False
