"""Every environment variable the package reads, parsed in one place.

Each variable has one accessor below that parses and validates it (a ``ValueError``
naming the variable on a bad value). They are read when a plan or a plain op call picks
its configuration, never inside a planned per-layer call; the engine integrations read
theirs once when they are built. The README's table lists exactly :data:`VARIABLES`
(a test checks it).
"""

from __future__ import annotations

import os
from typing import Optional

#: name -> one-line meaning (the README table is generated from the same facts).
VARIABLES = {
    "HYGON_ATTN_IMPL": "auto (default) / triton / native / reference: what the engine "
                       "integrations ask the ops for",
    "HYGON_ATTN_DEBUG": "1: value checks that sync with the host (slot and block-id ranges, "
                        "SGLang's page contiguity) before each launch",
    "HYGON_ATTN_PARTITION_SIZE": "force the decode split-KV partition size (tokens, a positive "
                                 "multiple of 16)",
    "PA_PARTITION_SIZE": "the same, under the name DCU users know (HYGON_ATTN_PARTITION_SIZE "
                         "wins)",
    "HYGON_ATTN_DECODE_PDL": "0: launch the split-KV combine (Triton and native) as a plain "
                             "launch instead of a programmatic dependent launch (default on "
                             "NVIDIA sm_90+)",
    "HYGON_ATTN_CSRC": "the csrc/ folder the native extension is built from (default: beside "
                       "the package in a source checkout, else the wheel's "
                       "hygon_attn_backend/_csrc)",
}

IMPLS = ("auto", "triton", "native", "reference")


def _raw(name: str) -> Optional[str]:
    value = os.environ.get(name)
    return value.strip() if value is not None and value.strip() else None


def _int(name: str) -> Optional[int]:
    raw = _raw(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {raw!r}") from None


def impl(default: str = "auto") -> str:
    """``HYGON_ATTN_IMPL``: the implementation the engine integrations ask for
    (``default`` when unset)."""
    value = (_raw("HYGON_ATTN_IMPL") or default).lower()
    if value not in IMPLS:
        raise ValueError(f"HYGON_ATTN_IMPL must be one of {IMPLS}, got {value!r}")
    return value


def debug() -> bool:
    """``HYGON_ATTN_DEBUG=1``: host-synchronising value checks before launches."""
    return _raw("HYGON_ATTN_DEBUG") not in (None, "0", "false", "False")


def decode_partition_size() -> Optional[int]:
    """``HYGON_ATTN_PARTITION_SIZE``, else ``PA_PARTITION_SIZE``: a positive multiple of 16."""
    for name in ("HYGON_ATTN_PARTITION_SIZE", "PA_PARTITION_SIZE"):
        value = _int(name)
        if value is not None:
            if value <= 0 or value % 16:
                raise ValueError(f"{name} must be a positive multiple of 16, got {value}")
            return value
    return None


def _switch(name: str) -> Optional[bool]:
    """A ``0``/``1`` variable: ``True``/``False`` forced, ``None`` unset."""
    raw = _raw(name)
    if raw is None:
        return None
    if raw not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {raw!r}")
    return raw == "1"


def decode_pdl() -> Optional[bool]:
    """``HYGON_ATTN_DECODE_PDL``: ``True``/``False`` forced, ``None`` unset."""
    return _switch("HYGON_ATTN_DECODE_PDL")


def csrc_dir() -> Optional[str]:
    """``HYGON_ATTN_CSRC``: where the native sources are, or None."""
    return _raw("HYGON_ATTN_CSRC")
