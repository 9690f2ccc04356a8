"""Paged decode: ``api.py`` (the public op), ``plan.py`` (plan, layer binding, workspace),
``tuning.py`` (the heuristics and ``choose``), ``triton.py`` and ``native.py`` (the two
launch paths)."""

from hygon_attn_backend.ops.decode.api import paged_decode_attention
from hygon_attn_backend.ops.decode.plan import (DecodeLayer, DecodePlan, DecodeWorkspace,
                                                allocate_decode_workspace, plan_paged_decode)
from hygon_attn_backend.ops.decode.tuning import DecodeConfig
from hygon_attn_backend.ops.decode.tuning import launch_config as decode_launch_config
from hygon_attn_backend.ops.decode.tuning import verify_on_decode

__all__ = ["paged_decode_attention", "plan_paged_decode", "DecodePlan", "DecodeLayer",
           "DecodeWorkspace", "DecodeConfig", "allocate_decode_workspace",
           "decode_launch_config", "verify_on_decode"]
