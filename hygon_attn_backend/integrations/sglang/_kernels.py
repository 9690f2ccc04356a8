"""The two attention calls the SGLang backend makes, in one place.

The public ops (``hygon_attn_backend.ops.decode`` / ``ops.prefill``) are used when the
package ships them; until then the plain-torch reference runs instead. Switching is the
``_OPS`` table below; nothing else in the backend knows which one runs.

``impl``: ``"auto"`` (Triton on a GPU or under ``TRITON_INTERPRET=1``, else the
reference), ``"triton"`` or ``"reference"``; see ``ops/_dispatch.py``.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Callable

from hygon_attn_backend import reference

# op name -> (module that defines the public op, attribute)
_OPS = {
    "decode": ("hygon_attn_backend.ops.decode", "paged_decode_attention"),
    "prefill": ("hygon_attn_backend.ops.prefill", "prefix_prefill_attention"),
}
_REFERENCE = {
    "decode": reference.paged_decode_attention,
    "prefill": reference.prefix_prefill_attention,
}
_resolved: dict = {}


def _public_op(name: str):
    """The public op, or None while its module does not exist yet (errors inside an
    existing module propagate: a broken kernel must never fall back silently)."""
    if name not in _resolved:
        module_name, attr = _OPS[name]
        if importlib.util.find_spec(module_name) is None:
            _resolved[name] = None
        else:
            _resolved[name] = getattr(importlib.import_module(module_name), attr)
    return _resolved[name]


def op_source(name: str) -> str:
    """``"ops"`` when the public op is used, ``"reference"`` otherwise (for logs/tests)."""
    return "ops" if _public_op(name) is not None else "reference"


def _call(name: str, impl: str) -> Callable:
    op = _public_op(name)
    if op is None or impl == "reference":
        return _REFERENCE[name]
    return lambda *args, **kwargs: op(*args, impl=impl, **kwargs)


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, *, impl: str = "auto",
                           **kwargs):
    """See ``ops.decode.paged_decode_attention`` / ``reference.paged_decode_attention``."""
    return _call("decode", impl)(q, k_cache, v_cache, block_table, seq_lens, **kwargs)


def prefix_prefill_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, *,
                             impl: str = "auto", **kwargs):
    """See ``ops.prefill.prefix_prefill_attention`` / ``reference.prefix_prefill_attention``."""
    return _call("prefill", impl)(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k,
                                  **kwargs)
