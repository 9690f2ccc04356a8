"""Multi-head latent attention (MLA) decode over a paged latent cache: ``api.py`` (the
one-shot op), ``plan.py`` (plan, workspace), ``tuning.py`` (the heuristics and
``choose``), ``triton.py`` (the launches), ``native.py`` (the sm_90a kernel's coverage and
launch), ``cache.py`` (the latent cache write)."""

from hygon_attn_backend.ops.mla.api import mla_decode_attention
from hygon_attn_backend.ops.mla.cache import MLAWritePlan, plan_write_mla_cache, write_mla_cache
from hygon_attn_backend.ops.mla.plan import (MLADecodePlan, MLADecodeWorkspace,
                                             allocate_mla_decode_workspace, plan_mla_decode)
from hygon_attn_backend.ops.mla.tuning import MLAConfig

__all__ = ["mla_decode_attention", "plan_mla_decode", "MLADecodePlan", "MLADecodeWorkspace",
           "allocate_mla_decode_workspace", "MLAConfig", "write_mla_cache",
           "plan_write_mla_cache", "MLAWritePlan"]
