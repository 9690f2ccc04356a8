"""The prefix prefill's named heuristics, and :func:`choose`, the one entry that turns a
batch into its configuration (native or Triton, the tile).

Each rule's docstring gives its reasoning and one line of the measurement behind it
(H200, bf16, 32/8 heads, page 16; what was tried and dropped is in ``docs/history.md``).
"""

from __future__ import annotations

from typing import Optional

import torch

from hygon_attn_backend.ops import _checks, _device
from hygon_attn_backend.ops._dispatch import (native_coverage, select_impl,
                                              triton_interpreter_on)
from hygon_attn_backend.ops.prefill import native

PREFILL_Q_DTYPES = (torch.float16, torch.bfloat16)
HIP_LDS_BYTES = 64 * 1024  # shared memory (LDS) a workgroup may use on gfx9 (AMD, Hygon)


def native_preferred(*, is_hip: bool) -> bool:
    """Whether ``impl="auto"`` runs the native prefill where it covers the batch.

    Reasoning: the native prefill is the sm_90a wgmma kernel (other GPUs have none: the
    plan keeps them on Triton through ``native.device_unsupported``); on HIP there is none.
    Measurement: 1.39-1.47x the Triton prefill at five shapes from (32, 1024, 128) to (1, 0,
    8192) (H200, bf16, keys from the cache, 2026-12-01).
    """
    return not is_hip


def two_walks(*, head_dim_pad: int, page_size: int, block_n: int, num_warps: int) -> bool:
    """Whether the Triton prefill compiles its unmasked walk over cache pages twice
    (``TWO_WALKS``): once with no per-key check, taken when the program's check of its
    table row finds every block id present, and once with the check.

    Reasoning: where a key tile spans pages (``page_size < BLOCK_N``) the per-key check
    costs ~20% of the kernel. The second walk costs no shared memory but makes ptxas
    serialize the wgmma, so it is taken only where the tile is serialized already: the
    16-warp tile at head_dim 128. Elsewhere one walk keeps asynchronous wgmma.
    Measurement: keys from the cache +17-24% at five shapes ((1, 0, 8192) 342 -> 415
    TFLOP/s), -3% at (1, 0, 8192) with dense new keys (H200, page 16, 2026-12-01).
    ``two_walks=`` of :func:`choose` / ``plan_prefix_prefill`` forces either form.
    """
    return head_dim_pad == 128 and num_warps == 16 and page_size % block_n != 0


def tile_config(*, head_dim_pad: int, group: int, total_q: int, num_kv_heads: int,
                num_seqs: int = 1, num_sms: int = 132, interpreter: bool = False,
                is_hip: "bool | None" = None) -> "tuple[int, int, int, int]":
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of the Triton prefill kernel.

    Reasoning: prefill is matrix-bound, so the M tile is as tall as the registers allow,
    with the GQA group packed in. ``D <= 128``: 256 rows x 64 keys on 16 warps, 3 stages
    (four warpgroups, each K/V tile feeding twice the rows of 128 x 128 / 8 warps, one
    warpgroup's softmax overlapping another's MMA); when that gives fewer programs than SMs,
    128 x 128 on 8 warps, then 64 x 64 on 4. ``D = 256``: 64 x 64, 4 warps, 2 stages.
    ``BLOCK_M`` is never below the group. Tiny tiles under the CPU interpreter. On HIP
    (``is_hip``; None: this machine's torch) :func:`tile_config_hip`.
    Measurement: 256x64/16w/3s the fastest of eight tiles at all 20 points (5 shapes x page
    16/64 x cache/dense keys), +5-22% over 128x128/8w at (32, 1024, 128) (H200, 2026-12-01).
    """
    group_pow2 = _device.next_pow2(group)
    if interpreter:
        return max(16, group_pow2), 16, 4, 1

    def programs(block_m):  # a bound: each request adds at most one partial tile
        return (-(-total_q * group // block_m) + max(0, num_seqs - 1)) * num_kv_heads

    if _device.gpu_is_hip() if is_hip is None else is_hip:
        return tile_config_hip(head_dim_pad=head_dim_pad, group_pow2=group_pow2,
                               fills_sms=programs(128) >= num_sms)
    if head_dim_pad > 128:
        return max(64, group_pow2), 64, 4, 2
    if programs(256) >= num_sms or group_pow2 > 128:
        return max(256, group_pow2), 64, 16, 3
    if programs(128) >= num_sms or group_pow2 > 64:
        return max(128, group_pow2), 128, 8, 3
    return max(64, group_pow2), 64, 4, 3


def tile_config_hip(*, head_dim_pad: int, group_pow2: int, fills_sms: bool
                    ) -> "tuple[int, int, int, int]":
    """The Triton prefill tile on AMD/Hygon GPUs (HIP; wave 64, 64 KB of LDS a workgroup).

    Reasoning: the NVIDIA tiles do not fit there (256 x 64 / 16 warps spills ~420 bytes a
    lane, 128 x 128 / 8 / 3 needs 96 KB, D=256's 64 x 64 / 4 / 2 72 KB), so the tallest M
    tile without a spill: D <= 128: 128 x 64 on 8 warps, 2 stages (48 KB) when its programs
    fill the GPU or the group needs 128 rows, else 64 x 64 on 4 warps; groups over 128
    heads 256 x 16 on 16 warps. D = 256: 64 x 32 on 4 warps, 128 x 16 on 8 for groups of
    65-128.
    Measurement: compiled for gfx90a and gfx942 with Triton 3.6 and 3.9 without a spill;
    not timed on AMD/Hygon hardware. ``tile=`` overrides them.
    """
    if head_dim_pad > 128:
        if group_pow2 > 128:
            raise ValueError(f"prefix prefill on HIP: a GQA group of {group_pow2} query heads "
                             "per KV head at head_dim 256 needs more than 64 KB of LDS")
        return (128, 16, 8, 2) if group_pow2 > 64 else (64, 32, 4, 2)
    if group_pow2 > 256:
        raise ValueError(f"prefix prefill on HIP: a GQA group of {group_pow2} query heads per "
                         "KV head needs more than 64 KB of LDS")
    if group_pow2 > 128:
        return 256, 16, 16, 2
    if fills_sms or group_pow2 > 64:
        return 128, 64, 8, 2
    return 64, 64, 4, 2


def choose(*, device: torch.device, impl: str, total_q: int, num_seqs: int,
           num_kv_heads: int, group: int, head_dim: int, q_dtype: Optional[torch.dtype],
           kv_dtype: Optional[torch.dtype], tile: Optional[tuple] = None,
           tree: bool = False,
           dense_new_keys: bool = False) -> "tuple[str, tuple[int, int, int, int]]":
    """``(impl, (BLOCK_M, BLOCK_N, num_warps, num_stages))`` for one batch: ``impl``
    resolved by :func:`native_preferred` and what the native kernel covers, and the tile
    (``tile`` forces a Triton tile; with ``"auto"`` one of another height keeps Triton).
    ``impl="native"`` on a GPU without the native prefill (HIP, not sm_90) runs Triton: the
    engines pass one ``HYGON_ATTN_IMPL`` to every op. ``tree``: the batch has a tree mask,
    which only the Triton kernel reads. ``dense_new_keys``: the layers pass the new tokens'
    K/V dense, which the native prefill does not read beside an fp8 cache."""
    impl, native_why = native_coverage(
        impl, device, native.device_unsupported, lambda: native.shape_unsupported(
            head_dim=head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype, group=group))
    if impl in ("native", "auto") and device.type == "cuda":
        if native_why is None and dense_new_keys and kv_dtype in _checks.FP8_DTYPES:
            native_why = ("dense k_new / v_new with an fp8 KV cache (the native kernel reads "
                          "fp8 only)")
        if native_why is None and tree:
            native_why = "a tree mask (the native prefill has the causal and window masks)"
        if native_why is None and impl == "auto" and tile is not None and \
                int(tile[0]) != native.BLOCK_M:
            native_why = f"tile BLOCK_M={tile[0]} (a Triton tile)"
    chosen = select_impl(impl, device, native_unsupported=native_why,
                         native_preferred=native_preferred(is_hip=_device.gpu_is_hip()),
                         q_dtype=q_dtype)
    if q_dtype is not None and q_dtype not in PREFILL_Q_DTYPES:
        if chosen == "triton" and impl == "triton":
            raise ValueError(f"impl='triton' takes float16/bfloat16 queries, got {q_dtype}")
        chosen = "reference"
    if chosen == "native":
        # the native kernel's tile; a layer it does not cover runs Triton's 128-row tile
        # on the same tile map
        if tile is not None and int(tile[0]) != native.BLOCK_M:
            raise ValueError(f"tile BLOCK_M={tile[0]}: the native prefill takes "
                             f"{native.BLOCK_M}-row tiles")
        tile = tile if tile is not None else native.TILE
    if tile is None:
        tile = tile_config(
            head_dim_pad=_device.head_tile(head_dim, device=device), group=group,
            total_q=total_q,
            num_kv_heads=num_kv_heads, num_seqs=num_seqs, num_sms=_device.num_sms_of(device),
            interpreter=device.type == "cpu" and triton_interpreter_on())
    return chosen, tuple(int(x) for x in tile)
