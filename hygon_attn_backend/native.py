"""Loader for the optional native extension built from ``csrc/``.

No native kernel ships in this release: the Triton kernels cover every path. The
loader exists so callers can ask for native code and get a clear answer instead of an
ImportError from deep inside an engine.
"""

from __future__ import annotations

import importlib

_MODULE = "hygon_attn_backend._native"


def load():
    """Import the native extension or raise ``RuntimeError`` saying why it is absent."""
    try:
        return importlib.import_module(_MODULE)
    except ImportError as exc:
        raise RuntimeError(
            "the native extension (hygon_attn_backend._native, built from csrc/) is not "
            "available in this install; the Triton kernels serve every op") from exc


def status() -> str:
    """One line for ``hygon-attn doctor``."""
    try:
        load()
    except RuntimeError:
        return "no (not built in this install; Triton serves every op)"
    return "yes"
