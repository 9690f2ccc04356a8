"""The MLA prefill ops' named heuristics, and :func:`choose`, the one entry that turns a
batch into its configuration (the implementation, the head split, the tile).

The tiles are chosen from the register and shared-memory budget (reasoning beside each
rule); they were not yet timed on a GPU: ``hygon-attn bench mla-prefill --tiles`` sweeps
them (``docs/benchmarks-mla.md`` keeps what it measured).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from hygon_attn_backend.ops import _device
from hygon_attn_backend.ops._dispatch import (native_coverage, select_impl,
                                              triton_interpreter_on)
from hygon_attn_backend.ops.mla_prefill import native

MLA_Q_DTYPES = (torch.float16, torch.bfloat16)
#: the widest query/key and value head the ragged kernel takes (registers: the output
#: accumulator is ``BLOCK_M x next_pow2(D_V)`` fp32, the logits two dots of ``D_QK``)
MAX_HEAD_DIM = 256
#: the widest latent row of the absorbed MLA extend (DeepSeek's 512 + 64 = 576)
MAX_LATENT_DIM = 576


class Config(NamedTuple):
    """One batch's launch configuration: the implementation, the split of the query/key
    head into two power-of-two parts (``d1 + d2 >= D_QK``, ``d2 == 0``: one part), the
    padded value head ``dv``, the tile ``(block_m, block_n, num_warps, num_stages)`` and
    the query heads a tile packs (``heads``, a divisor of the GQA group)."""

    impl: str
    d1: int
    d2: int
    dv: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    heads: int

    @property
    def tile(self) -> tuple:
        return self.block_m, self.block_n, self.num_warps, self.num_stages


def head_split(head_dim: int) -> "tuple[int, int]":
    """``(d1, d2)``: the query/key head as two power-of-two parts the kernel multiplies
    with two ``tl.dot`` (``d2 == 0``: one).

    Reasoning: ``tl.dot`` takes power-of-two widths, and padding 192 to 256 would spend a
    third of the QK^T work on zeros; 192 = 128 + 64 (MLA's nope + rope parts), 576 = 512 +
    64, 80 = 64 + 16 waste nothing, and any width wastes at most the padding of its small
    tail part. ``d1`` is the largest power of two ``<= head_dim`` (16 at least, the
    smallest dot), ``d2`` the next power of two over the rest (16 at least).
    """
    if head_dim < 1:
        raise ValueError(f"head_dim must be >= 1, got {head_dim}")
    d1 = max(16, 1 << (head_dim.bit_length() - 1))
    rest = head_dim - d1
    return d1, (max(16, _device.next_pow2(rest)) if rest > 0 else 0)


def tile_config(*, qk_width: int, dv: int, heads: int, total_q: int, num_programs_per_tile:
                int, num_sms: int = 132, interpreter: bool = False,
                is_hip: "bool | None" = None) -> "tuple[int, int, int, int]":
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of the ragged kernel.

    qk_width: ``d1 + d2``; dv: the padded value head; heads: query heads a tile packs
    (``BLOCK_M`` is never below it); num_programs_per_tile: programs a row of the tile map
    makes (the KV heads times the head blocks).

    Reasoning: prefill is matrix-bound, so the M tile is as tall as the registers allow.
    At MLA's 192/128 the accumulator of 128 rows x 128 columns on 8 warps is 64 fp32
    registers a lane, the same as the 128-wide prefix prefill's 128 x 128 tile, and a
    64-key stage is 64 x (192 + 128) x 2 bytes = 40 KB of shared memory: three stages and
    the 48 KB q tile fit the H200's 227 KB. A value head of 256 doubles the accumulator:
    64 rows on 4 warps, 2 stages (the prefix prefill's D=256 tile). When the 128-row tiles
    make fewer programs than SMs, 64 rows on 4 warps. On HIP (64 KB of LDS) 64 x 32 on 4
    warps, 2 stages (28 KB at 192/128; 16 keys, 1 stage at 576/512). The absorbed
    extend's 512-wide value head: 64 rows on 8 warps (a 128-register accumulator a lane), 32 keys of 576 + 512 columns a
    stage (70 KB), one stage. Tiny tiles under the CPU interpreter.
    Measurement: none yet (``bench mla-prefill`` sweeps ``--tiles``).
    """
    heads_pow2 = _device.next_pow2(heads)
    if interpreter:
        return max(16, heads_pow2), 16, 4, 1

    def programs(block_m):
        return -(-total_q * heads // block_m) * num_programs_per_tile

    if _device.gpu_is_hip() if is_hip is None else is_hip:
        return (max(64, heads_pow2), 16, 4, 1) if dv > 256 else (max(64, heads_pow2), 32, 4, 2)
    if dv > 256:  # the absorbed extend's latent rows (576 / 512)
        return max(64, heads_pow2), 32, 8, 1
    if dv > 128 or qk_width > 256:
        return max(64, heads_pow2), 64, 4, 2
    if programs(128) >= num_sms or heads_pow2 > 64:
        return max(128, heads_pow2), 64, 8, 3
    return max(64, heads_pow2), 64, 4, 3


def heads_per_tile(group: int) -> int:
    """Query heads one tile packs: the whole GQA group (each K/V tile is then loaded once
    for it), as the prefix prefill does; MLA's up-projected attention has ``Hq == Hkv``
    (group 1).

    Reasoning: a group wider than 64 heads makes a 128-row tile hold one token, and a
    taller tile would not fit the registers at these head sizes; such a group is split in
    blocks of 64 (its power-of-two divisor), each block its own program.
    """
    if group <= 64:
        return group
    heads = 64
    while group % heads:
        heads //= 2
    return heads


def native_preferred(*, is_hip: bool) -> bool:
    """Whether ``impl="auto"`` runs the native ragged attention where it covers the batch.

    Reasoning: it is the prefix prefill's sm_90a wgmma kernel in its ragged mode (no other
    GPU has it: ``native.device_unsupported`` keeps them on Triton; HIP has none), and
    that kernel leads the Triton tile at the prefill's shapes (``docs/benchmarks.md``).
    Measurement at MLA's 192 / 128: ``docs/benchmarks-mla.md`` ("MLA prefill, native").
    """
    return not is_hip


def choose(*, device: torch.device, impl: str, total_q: int, num_kv_heads: int, group: int,
           head_dim_qk: int, head_dim_v: int, q_dtype: Optional[torch.dtype],
           tile: Optional[tuple] = None, ragged: bool = False) -> Config:
    """The :class:`Config` of one batch. ``impl``: ``"auto"`` | ``"triton"`` |
    ``"native"`` | ``"reference"``; float32 queries run the reference. ``tile`` forces
    ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` (a Triton tile).

    ragged: a :func:`~ops.mla_prefill.ragged_attention` batch, which the native kernel
    (``native.py``) may cover: ``"auto"`` takes it where :func:`native_preferred` says so
    and it covers the shapes (unless ``tile`` forces a Triton tile); ``"native"`` on an
    sm_90 GPU that it does not cover raises. Elsewhere (a GPU without it, the absorbed
    extend, which has no native kernel) ``"native"`` runs Triton, as the engines pass one
    ``HYGON_ATTN_IMPL`` to every op."""
    native_why = "the absorbed MLA extend (no native kernel)"
    if ragged:
        impl, native_why = native_coverage(
            impl, device, native.device_unsupported, lambda: native.shape_unsupported(
                head_dim_qk=head_dim_qk, head_dim_v=head_dim_v, q_dtype=q_dtype, group=group))
        if native_why is None and impl == "auto" and tile is not None:
            native_why = f"tile {tuple(tile)} (a Triton tile)"
    chosen = select_impl(impl, device, q_dtype=q_dtype, native_unsupported=native_why,
                         native_preferred=native_preferred(is_hip=_device.gpu_is_hip())
                         if ragged and device.type == "cuda" else None)
    if q_dtype is not None and q_dtype not in MLA_Q_DTYPES:
        if chosen == "triton" and impl == "triton":
            raise ValueError(f"impl='triton' takes float16/bfloat16 queries, got {q_dtype}")
        chosen = "reference"
    d1, d2 = head_split(head_dim_qk)
    dv = _device.head_tile(head_dim_v, device=device)
    heads = heads_per_tile(group)
    if chosen == "native":
        if tile is not None:
            raise ValueError(f"tile {tuple(tile)}: the native ragged attention has its own "
                             f"{native.BLOCK_M}-row tile")
        # the tile map's blocks hold 128 // group tokens, as the Triton fallback's
        # (native.FALLBACK_TILE) with the whole group a tile (group <= 64)
        return Config("native", d1, d2, dv, native.BLOCK_M, 128, 12,
                      2 if head_dim_qk > 128 else 3, group)
    if tile is None:
        tile = tile_config(
            qk_width=d1 + d2, dv=dv, heads=heads, total_q=total_q,
            num_programs_per_tile=num_kv_heads * (group // heads),
            num_sms=_device.num_sms_of(device),
            interpreter=device.type == "cpu" and triton_interpreter_on())
    block_m, block_n, num_warps, num_stages = (int(x) for x in tile)
    if block_m < heads:
        raise ValueError(f"tile BLOCK_M={block_m} is smaller than the {heads} query heads a "
                         f"tile packs (GQA group {group})")
    for name, value in (("BLOCK_M", block_m), ("BLOCK_N", block_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"tile {name}={value} must be a power of two >= 16")
    return Config(chosen, d1, d2, dv, block_m, block_n, num_warps, num_stages, heads)
