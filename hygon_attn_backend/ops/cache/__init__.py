"""Cache ops: ``api.py`` (``write_kv``, ``copy_blocks``), ``plan.py`` (the per-step write
plan and its Triton launch), ``tuning.py`` (the heuristics), ``native.py`` (the native
launches)."""

from hygon_attn_backend.ops.cache.api import copy_blocks, write_kv
from hygon_attn_backend.ops.cache.plan import WritePlan, plan_write_kv

__all__ = ["write_kv", "copy_blocks", "plan_write_kv", "WritePlan"]
