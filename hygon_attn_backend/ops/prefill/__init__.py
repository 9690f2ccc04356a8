"""Prefix prefill: ``api.py`` (the public op), ``plan.py`` (plan, tile map, layer binding),
``tuning.py`` (the heuristics and ``choose``), ``triton.py`` and ``native.py`` (the two
launch paths)."""

from hygon_attn_backend.ops.prefill.api import prefix_prefill_attention
from hygon_attn_backend.ops.prefill.plan import (PrefillLayer, PrefillPlan, check_host_lengths,
                                                 plan_prefix_prefill)

__all__ = ["prefix_prefill_attention", "plan_prefix_prefill", "PrefillPlan", "PrefillLayer",
           "check_host_lengths"]
