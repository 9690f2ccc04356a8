"""The two attention calls the SGLang backend makes, in one place.

The public ops (``hygon_attn_backend.ops.decode`` / ``ops.prefill``) are used when the
package ships them; until then the plain-torch reference runs instead. Switching is the
``_OPS`` table below; nothing else in the backend knows which one runs.

``impl``: ``"auto"`` (Triton on a GPU or under ``TRITON_INTERPRET=1``, else the
reference), ``"triton"`` or ``"reference"``; see ``ops/_dispatch.py``. The Triton kernels
take fp16/bf16 queries: with ``auto``, a float32 model runs the reference (logged once);
with ``triton`` it is an error.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from typing import Callable

import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops._dispatch import select_impl

logger = logging.getLogger(__name__)

TRITON_Q_DTYPES = (torch.float16, torch.bfloat16)
# options only the public ops take (the reference has no launch state to reuse)
_OP_ONLY = ("workspace", "max_seq_len", "plan", "validate", "kv_head_grid")

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


def uses_public_op(name: str, impl: str, q: torch.Tensor) -> bool:
    """Whether a call with ``impl`` and query ``q`` runs the public op's Triton path."""
    return _public_op(name) is not None and resolve_impl(impl, q) == "triton"


def op_source(name: str) -> str:
    """``"ops"`` when the public op is used, ``"reference"`` otherwise (for logs/tests)."""
    return "ops" if _public_op(name) is not None else "reference"


_warned_fp32 = set()


def resolve_impl(impl: str, q: torch.Tensor) -> str:
    """``"triton"`` or ``"reference"`` for a call with query ``q``."""
    chosen = select_impl(impl, q.device)
    if chosen == "triton" and q.dtype not in TRITON_Q_DTYPES:
        if impl == "triton":
            raise ValueError(f"impl='triton' needs fp16/bf16 queries, got q of dtype {q.dtype}")
        if q.dtype not in _warned_fp32:
            _warned_fp32.add(q.dtype)
            logger.warning("hygon: %s queries run on the torch reference (the Triton kernels "
                           "take fp16/bf16)", q.dtype)
        chosen = "reference"
    return chosen


def _call(name: str, impl: str, q: torch.Tensor) -> Callable:
    op = _public_op(name)
    if op is None or resolve_impl(impl, q) == "reference":
        ref = _REFERENCE[name]

        def run_reference(*args, **kwargs):
            for key in _OP_ONLY:
                kwargs.pop(key, None)
            return ref(*args, **kwargs)

        return run_reference
    # impl passes through: "native" (and "auto" on HIP) reach the native kernels
    return lambda *args, **kwargs: op(*args, impl=impl, **kwargs)


def paged_decode_attention(q, k_cache, v_cache, block_table, seq_lens, *, impl: str = "auto",
                           **kwargs):
    """See ``ops.decode.paged_decode_attention`` / ``reference.paged_decode_attention``."""
    return _call("decode", impl, q)(q, k_cache, v_cache, block_table, seq_lens, **kwargs)


def prefix_prefill_attention(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k, *,
                             impl: str = "auto", **kwargs):
    """See ``ops.prefill.prefix_prefill_attention`` / ``reference.prefix_prefill_attention``."""
    return _call("prefill", impl, q)(q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k,
                                  **kwargs)
