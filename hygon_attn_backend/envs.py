"""Every environment variable the package reads, parsed in one place.

Each variable has one accessor below that parses and validates it (a ``ValueError``
naming the variable on a bad value). They are read when a plan or a plain op call picks
its configuration, never inside a planned per-layer call; the engine integrations read
theirs once when they are built. The README's table lists exactly :data:`VARIABLES`
(a test checks it).
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

#: name -> one-line meaning (the README table is generated from the same facts).
VARIABLES = {
    "HYGON_ATTN_IMPL": "auto (default) / triton / native / reference: what the engine "
                       "integrations ask the ops for",
    "HYGON_ATTN_DEBUG": "1: value checks that sync with the host (slot and block-id ranges) "
                        "before each launch",
    "HYGON_ATTN_PARTITION_SIZE": "force the decode split-KV partition size (tokens, a positive "
                                 "multiple of 16)",
    "PA_PARTITION_SIZE": "the same, under the name DCU users know (HYGON_ATTN_PARTITION_SIZE "
                         "wins)",
    "HYGON_ATTN_PREFILL_TILE": "force the prefill tile BLOCK_M,BLOCK_N,warps,stages",
    "HYGON_ATTN_PREFILL_TWO_WALKS": "0/1: compile the prefill's unmasked multi-page walk "
                                    "with and without key checks (default: "
                                    "tuning.prefill_two_walks)",
    "HYGON_ATTN_DECODE_BLOCK_N": "force the decode KV tile (a power of two >= 16)",
    "HYGON_ATTN_DECODE_WARPS": "force the decode kernel's warps",
    "HYGON_ATTN_DECODE_STAGES": "force the decode kernel's pipeline stages",
    "HYGON_ATTN_DECODE_PREFETCH": "0/1: read the next tile's block ids one iteration ahead",
    "HYGON_ATTN_DECODE_PDL": "0: launch the split-KV combine (Triton and native) as a plain "
                             "launch instead of a programmatic dependent launch (default on "
                             "NVIDIA sm_90+)",
    "HYGON_ATTN_WRITE_KV_BLOCK_H": "write_kv heads per program (a power of two)",
    "HYGON_ATTN_COPY_BLOCKS_BLOCK": "copy_blocks elements per program (a power of two)",
    "HYGON_SGLANG_CHECK_PAGES": "1: check page contiguity of every SGLang batch (debugging)",
    "HYGON_ATTN_NATIVE_AUTO": "1: impl=auto takes the native kernels wherever they run; 0: "
                              "never (default: the measured rule, tuning.native_preferred)",
    "HYGON_ATTN_NATIVE_SPLIT_N": "0: the native decode's shared-softmax loop instead of the "
                                 "split-N loop (read when a decode is planned)",
    "HYGON_ATTN_NATIVE_STAGES": "2, 3 or 4: cp.async stages of the native split-N decode loop "
                                "(default: tuning.native_decode_stages; read when planned)",
    "HYGON_ATTN_NATIVE_TILE": "32 or 64: KV tokens per tile of the native split-N decode loop "
                              "(default: tuning.native_decode_tile; read when planned)",
    "HYGON_ATTN_NATIVE_PREFILL_PINGPONG": "0: the native prefill's two consumer warpgroups "
                                          "issue their S = Q K^T products without taking "
                                          "turns (default 1; read when planned)",
    "HYGON_ATTN_NATIVE_PREFILL_OVERLAP": "0: the native prefill runs one tile at a time "
                                         "instead of issuing the next tile's S with this "
                                         "tile's P V (default 1; read when planned)",
    "HYGON_ATTN_NATIVE_PREFILL_PERSISTENT": "0: the native prefill launches one program per "
                                            "work item instead of one an SM taking items "
                                            "from a counter (default 1; read when planned)",
    "HYGON_ATTN_CSRC": "the csrc/ folder the native extension is built from (default: beside "
                       "the package in a source checkout, else the wheel's "
                       "hygon_attn_backend/_csrc)",
}

IMPLS = ("auto", "triton", "native", "reference")
_TRUE = ("1", "true", "True", "yes")


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


def _pow2(name: str, minimum: int = 1) -> Optional[int]:
    value = _int(name)
    if value is not None and (value < minimum or value & (value - 1)):
        raise ValueError(f"{name} must be a power of two >= {minimum}, got {value}")
    return value


def _flag(name: str) -> bool:
    return _raw(name) in _TRUE


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


def decode_tile() -> Tuple[Optional[int], Optional[int], Optional[int], Optional[bool]]:
    """``(BLOCK_N, num_warps, num_stages, page_prefetch)`` forced by the environment
    (``None`` where unset)."""
    prefetch = _raw("HYGON_ATTN_DECODE_PREFETCH")
    return (_pow2("HYGON_ATTN_DECODE_BLOCK_N", 16), _int("HYGON_ATTN_DECODE_WARPS"),
            _int("HYGON_ATTN_DECODE_STAGES"),
            None if prefetch is None else prefetch not in ("0", "false", "False"))


def prefill_tile() -> Optional[Tuple[int, int, int, int]]:
    """``HYGON_ATTN_PREFILL_TILE="BLOCK_M,BLOCK_N,num_warps,num_stages"`` or None."""
    raw = _raw("HYGON_ATTN_PREFILL_TILE")
    if raw is None:
        return None
    try:
        block_m, block_n, num_warps, num_stages = (int(x) for x in raw.split(","))
    except ValueError:
        raise ValueError("HYGON_ATTN_PREFILL_TILE must be 'BLOCK_M,BLOCK_N,num_warps,"
                         f"num_stages', got {raw!r}") from None
    for name, val in (("BLOCK_M", block_m), ("BLOCK_N", block_n)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"HYGON_ATTN_PREFILL_TILE: {name} must be a power of two >= 16, "
                             f"got {raw!r}")
    return block_m, block_n, num_warps, num_stages


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


def write_kv_block_h() -> Optional[int]:
    return _pow2("HYGON_ATTN_WRITE_KV_BLOCK_H")


def copy_blocks_block() -> Optional[int]:
    return _pow2("HYGON_ATTN_COPY_BLOCKS_BLOCK")


def sglang_check_pages() -> bool:
    return _flag("HYGON_SGLANG_CHECK_PAGES")


def native_auto() -> Optional[bool]:
    """``HYGON_ATTN_NATIVE_AUTO``: ``True``/``False`` forced, ``None`` unset."""
    return _switch("HYGON_ATTN_NATIVE_AUTO")


def prefill_two_walks() -> Optional[bool]:
    """``HYGON_ATTN_PREFILL_TWO_WALKS``: ``True``/``False`` forced, ``None`` unset."""
    return _switch("HYGON_ATTN_PREFILL_TWO_WALKS")


def native_split_n() -> Optional[bool]:
    """``HYGON_ATTN_NATIVE_SPLIT_N``: ``False`` runs the shared-softmax loop, ``None`` unset."""
    return _switch("HYGON_ATTN_NATIVE_SPLIT_N")


def native_stages() -> Optional[int]:
    """``HYGON_ATTN_NATIVE_STAGES``: 2, 3 or 4, or ``None`` unset."""
    value = _int("HYGON_ATTN_NATIVE_STAGES")
    if value is not None and value not in (2, 3, 4):
        raise ValueError(f"HYGON_ATTN_NATIVE_STAGES must be 2, 3 or 4, got {value}")
    return value


def native_tile() -> Optional[int]:
    """``HYGON_ATTN_NATIVE_TILE``: 32 or 64, or ``None`` unset."""
    value = _int("HYGON_ATTN_NATIVE_TILE")
    if value is not None and value not in (32, 64):
        raise ValueError(f"HYGON_ATTN_NATIVE_TILE must be 32 or 64, got {value}")
    return value


def native_prefill_pingpong() -> bool:
    """``HYGON_ATTN_NATIVE_PREFILL_PINGPONG``: ``False`` when set to 0, else ``True``."""
    return _switch("HYGON_ATTN_NATIVE_PREFILL_PINGPONG") is not False


def native_prefill_overlap() -> bool:
    """``HYGON_ATTN_NATIVE_PREFILL_OVERLAP``: ``False`` when set to 0, else ``True``."""
    return _switch("HYGON_ATTN_NATIVE_PREFILL_OVERLAP") is not False


def native_prefill_persistent() -> bool:
    """``HYGON_ATTN_NATIVE_PREFILL_PERSISTENT``: ``False`` when set to 0, else ``True``."""
    return _switch("HYGON_ATTN_NATIVE_PREFILL_PERSISTENT") is not False


def csrc_dir() -> Optional[str]:
    """``HYGON_ATTN_CSRC``: where the native sources are, or None."""
    return _raw("HYGON_ATTN_CSRC")
