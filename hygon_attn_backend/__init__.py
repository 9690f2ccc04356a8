"""hygon-attn-backend: Hygon DCU FlashAttention kernels for vLLM and SGLang.

Public API (DESIGN.md)::

    from hygon_attn_backend import (paged_decode_attention, prefix_prefill_attention,
                                    write_kv, copy_blocks, layouts, reference)
    # plan once per step, run per layer:
    from hygon_attn_backend import (plan_paged_decode, plan_prefix_prefill, plan_write_kv,
                                    allocate_decode_workspace)
    # multi-head latent attention (MLA) decode over a paged latent cache:
    from hygon_attn_backend import (mla_decode_attention, plan_mla_decode,
                                    allocate_mla_decode_workspace, write_mla_cache,
                                    plan_write_mla_cache)

Importing the package is cheap: the ops (and Triton) load on first use, because the
engines import ``hygon_attn_backend.integrations.*`` in every process at plugin time.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0.dev0"

_LAZY = {
    "paged_decode_attention": ("hygon_attn_backend.ops.decode", "paged_decode_attention"),
    "prefix_prefill_attention": ("hygon_attn_backend.ops.prefill", "prefix_prefill_attention"),
    "write_kv": ("hygon_attn_backend.ops.cache", "write_kv"),
    "copy_blocks": ("hygon_attn_backend.ops.cache", "copy_blocks"),
    "plan_paged_decode": ("hygon_attn_backend.ops.decode", "plan_paged_decode"),
    "plan_prefix_prefill": ("hygon_attn_backend.ops.prefill", "plan_prefix_prefill"),
    "plan_write_kv": ("hygon_attn_backend.ops.cache", "plan_write_kv"),
    "allocate_decode_workspace": ("hygon_attn_backend.ops.decode", "allocate_decode_workspace"),
    "mla_decode_attention": ("hygon_attn_backend.ops.mla", "mla_decode_attention"),
    "plan_mla_decode": ("hygon_attn_backend.ops.mla", "plan_mla_decode"),
    "allocate_mla_decode_workspace": ("hygon_attn_backend.ops.mla",
                                      "allocate_mla_decode_workspace"),
    "write_mla_cache": ("hygon_attn_backend.ops.mla", "write_mla_cache"),
    "plan_write_mla_cache": ("hygon_attn_backend.ops.mla", "plan_write_mla_cache"),
    # MLA prefill (ops/mla_prefill)
    "ragged_attention": ("hygon_attn_backend.ops.mla_prefill", "ragged_attention"),
    "plan_ragged_attention": ("hygon_attn_backend.ops.mla_prefill", "plan_ragged_attention"),
    "merge_attn_states": ("hygon_attn_backend.ops.mla_prefill", "merge_attn_states"),
    "mla_extend_attention": ("hygon_attn_backend.ops.mla_prefill", "mla_extend_attention"),
    "plan_mla_extend": ("hygon_attn_backend.ops.mla_prefill", "plan_mla_extend"),
    "layouts": ("hygon_attn_backend.layouts", None),
    "reference": ("hygon_attn_backend.reference", None),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'hygon_attn_backend' has no attribute {name!r}") from None
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))
