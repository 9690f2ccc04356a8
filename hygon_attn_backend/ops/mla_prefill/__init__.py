"""Multi-head latent attention (MLA) prefill: ``api.py`` (the public ops and which engine
path calls each), ``plan.py`` (the ragged plan), ``tuning.py`` (the heuristics and
``choose``), ``triton.py`` (the launches). The decode over the latent cache is
``ops/mla``."""

from hygon_attn_backend.ops.mla_prefill.api import (merge_attn_states, mla_extend_attention,
                                                    ragged_attention)
from hygon_attn_backend.ops.mla_prefill.plan import (RaggedPlan, check_ragged_lengths,
                                                     plan_mla_extend, plan_ragged_attention)

__all__ = ["ragged_attention", "merge_attn_states", "mla_extend_attention",
           "plan_ragged_attention", "plan_mla_extend", "RaggedPlan", "check_ragged_lengths"]
