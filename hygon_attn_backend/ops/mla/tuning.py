"""The MLA decode's named heuristics, and :func:`choose`, which turns a batch into its
launch configuration (implementation, tile, partitions).

The kernel (``kernels/mla_decode.py``) runs one program per (block of ``BLOCK_M`` query
rows, request, partition): every query head reads the same latent row, so a program's
rows (``T x Hq`` flattened, ``row = t * Hq + h``) share each KV tile it loads. No model
names here: only shapes and device facts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hygon_attn_backend.ops import _device
from hygon_attn_backend.ops._dispatch import select_impl
from hygon_attn_backend.ops.mla import native

MLA_Q_DTYPES = (torch.float16, torch.bfloat16)
MLA_MAX_RANK = 512        # kv_lora_rank the kernel takes (a [BLOCK_M, 512] fp32 accumulator)
MLA_MAX_ROPE = 128        # rope_dim the kernel takes
MLA_MAX_BLOCK_M = 64      # query rows a program serves at most
MLA_MIN_PARTITION = 256   # smallest split-KV partition (tokens) the rule chooses
MLA_TARGET_PROGRAMS_PER_SM = 2  # the split aims at this many programs an SM
WHOLE_SEQUENCE = 1 << 30  # partition floor of the one-partition launch
#: drafts a request of a verify under a tree mask: the kernel holds each row's first two
#: mask words in registers (no mask load in the KV loop)
MLA_MAX_TREE_DRAFTS = 64
#: query rows a request from which the native kernel serves a batch: past 32, where the
#: Triton rule's tile is 64 rows too (native_preferred)
MLA_NATIVE_MIN_ROWS = 33


@dataclass
class MLAConfig:
    """The Triton MLA decode launch: ``BLOCK_M`` query rows and ``BLOCK_N`` keys a tile,
    its warps and pipeline stages, and ``num_partitions`` split-KV partitions (each
    sequence splits its own length over them, at least ``MLA_MIN_PARTITION`` tokens a
    partition: ``kernels/combine.py: seq_partitions``)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    num_partitions: int

    @property
    def split(self) -> bool:
        return self.num_partitions > 1

    @property
    def kernel_partition_size(self) -> int:
        """The kernels' ``partition_size``: the per-sequence split's floor, or one
        partition covering any sequence."""
        return MLA_MIN_PARTITION if self.split else WHOLE_SEQUENCE


@dataclass
class MLAChoice:
    impl: str                     # "native" | "triton" | "reference"
    config: Optional[MLAConfig]   # None: nothing to launch (reference, empty batch / table)


def block_m_for(rows: int) -> int:
    """Query rows a program serves: every row of the request (``T x Hq``) up to
    ``MLA_MAX_BLOCK_M``, at least 16 (the matrix unit's M).

    Reasoning: each program streams its request's whole latent range once, so a request's
    KV is read ``ceil(rows / BLOCK_M)`` times (from L2 after the first, when the programs of
    a request run together); the ``[BLOCK_M, kv_lora_rank]`` fp32 accumulator bounds it:
    64 rows x 512 is 128 registers a thread on 8 warps.
    """
    return max(16, min(MLA_MAX_BLOCK_M, _device.next_pow2(rows)))


def tile_config(*, block_m: int, rank_pad: int, kv_elem_size: int,
                tile=None) -> "tuple[int, int, int, int]":
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of the Triton MLA decode.

    Reasoning: a KV tile of ``BLOCK_N`` latent rows (576 x 2 bytes each) is both K and V.
    16 query rows (one request's heads at Hq = 16): the loop is bound by reading the cache,
    32-key tiles on 4 warps with 3 stages keep ~108 KB in flight; 32 query rows (Hq 32, or
    MTP q_len 2 at Hq 16) are still bound by the cache and take the same tile. 64 rows
    (Hq >= 64, or T x Hq past 32): the two dots dominate (each row costs 2 x (576 + 512)
    FLOPs a key, past the ridge point at Hq = 128), 64-key tiles on 8 warps give the matrix
    units the larger N. fp8 rows are half the bytes: the same tile.
    Measurement (H200, bf16, 512 + 64, page 64, (64, 8k), 2026-12-03): Hq 16: 16x32 4w 3s
    86.2% of the copy, 16x64 4w 2s 83.8%, 16x32 4w 2s 74.7%, 16x16 47.5%; Hq 128: 64x64
    8w 2s 24.6%, 64x32 8w 3s 20.0%, 64x32 8w 2s 16.3%, 32x32 4w 15.1%, 64x16 9.9%.
    32 rows (H100, Hq 16 x MTP q_len 2, page 64, 2026-12-07; time over the q_len 1 row):
    32x32 4w 3s 1.055x at (32, 8k) and 1.030x at (128, 8k), 32x32 4w 2s 1.181x / 1.187x,
    32x64 8w 2s 1.277x / 1.294x, 64x64 8w 2s 1.344x / 1.373x, 32x64 4w 2s 1.348x / 1.394x;
    16-row programs over the 32 rows (each re-reading the tiles) 1.295x / 1.428x.
    Override: ``tile=(BLOCK_M, BLOCK_N, num_warps, num_stages)`` (any entry None).
    """
    del kv_elem_size
    if block_m <= 32:
        chosen = [block_m, 32, 4, 3]
    else:
        chosen = [block_m, 64, 8, 2]
    for i, value in enumerate(tile or ()):
        if value is not None:
            chosen[i] = value
    bm, bn, warps, stages = (int(v) for v in chosen)
    for name, value in (("BLOCK_M", bm), ("BLOCK_N", bn)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"MLA decode tile {name} must be a power of two >= 16, got "
                             f"{value}")
    return bm, bn, warps, stages


def num_partitions_for(*, programs: int, max_context_len: int, num_sms: int) -> int:
    """Split-KV partitions of the Triton MLA decode (1: no split).

    Reasoning: the kernel is bound by reading the latent cache once; the grid
    ``row_blocks x requests x partitions`` must keep every SM busy, and a program holds a
    large accumulator (one or two fit an SM), so aim for ``MLA_TARGET_PROGRAMS_PER_SM``
    programs an SM, partitions of at least ``MLA_MIN_PARTITION`` tokens. The count is fixed
    from the launch's context bound; each sequence splits its own length over it on the
    device, so a bound far above the lengths (a CUDA graph sized for the cache) still
    spreads short sequences.
    """
    ctx = max(int(max_context_len), 1)
    most = max(1, -(-ctx // MLA_MIN_PARTITION))
    parts = int(MLA_TARGET_PROGRAMS_PER_SM * max(1, num_sms) / max(1, programs) + 0.5)
    return max(1, min(parts, most))


def native_partitions_for(*, programs: int, max_context_len: int, num_sms: int) -> int:
    """Split-KV partitions of the native MLA decode (1: no split): one wave.

    Reasoning: a native program takes a whole SM (225 KB of shared memory), so the grid's
    ``programs x partitions`` run in waves of ``num_sms``; a second, partly filled wave
    costs as much as the first. Split only as far as the first wave still has room,
    partitions of at least ``MLA_MIN_PARTITION`` tokens. Never more than the Triton rule's
    count, so a workspace sized by that rule serves both.
    Measurement (H200, bf16, Hq 128, page 64, 2026-12-04; ms at x1 / x2 / x4 / x8
    partitions): (32, 32k) 1.429 / 0.738 / 0.747 / 0.782 (64 programs: x2);
    (128, 4k) 0.382 / 0.453 / 0.491 / 0.565 and (128, 32k) 2.862 / 2.948 / 2.953 / 3.005
    (256 programs: x1).
    """
    ctx = max(int(max_context_len), 1)
    most = max(1, -(-ctx // MLA_MIN_PARTITION))
    return max(1, min(max(1, num_sms) // max(1, programs), most))


def launch_config(*, num_seqs: int, num_q_heads: int, num_tokens: int, kv_lora_rank: int,
                  kv_elem_size: int, max_context_len: int, num_sms: int, tile=None,
                  num_partitions: Optional[int] = None, native: bool = False) -> MLAConfig:
    """The MLA decode's launch for one batch (``tile`` / ``num_partitions`` force the
    tile and the split; ``native``: the native kernel's split rule)."""
    rows = num_tokens * num_q_heads
    bm, bn, warps, stages = tile_config(block_m=block_m_for(rows),
                                        rank_pad=_device.next_pow2(kv_lora_rank),
                                        kv_elem_size=kv_elem_size, tile=tile)
    if num_partitions is None:
        rule = native_partitions_for if native else num_partitions_for
        num_partitions = rule(programs=num_seqs * -(-rows // bm),
                              max_context_len=max_context_len, num_sms=num_sms)
    if num_partitions > 1:  # a tile never straddles two partitions
        bn = min(bn, MLA_MIN_PARTITION)
    return MLAConfig(block_m=bm, block_n=bn, num_warps=warps, num_stages=stages,
                     num_partitions=int(num_partitions))


def workspace_partitions(*, num_seqs: int, num_q_heads: int, num_tokens: int,
                         max_context_len: int, num_sms: int) -> int:
    """The partitions a batch of ``num_seqs`` requests takes under the default rule."""
    rows = num_tokens * num_q_heads
    return num_partitions_for(programs=num_seqs * -(-rows // block_m_for(rows)),
                              max_context_len=max_context_len, num_sms=num_sms)


def native_preferred(*, rows: int) -> bool:
    """Whether ``impl="auto"`` takes the native MLA decode (``csrc/mla_decode_sm90.cu``)
    for a batch of ``rows = T x Hq`` query rows a request, where it covers the batch
    (sm_90, 512 + 64 rows of q's 16-bit dtype or fp8: ``native.shape_unsupported``).

    Reasoning: from 64 rows a request the loop is bound by the two products (242 FLOP per
    cached byte at 128 rows), which the native kernel runs on wgmma with a producer
    warpgroup loading the tiles. Past 32 rows the Triton rule pads to a 64-row tile too
    (e.g. MTP q_len 3 at Hq 16: 48 rows), so the native 64-row program costs no more
    padding; up to 32 the Triton decode's 16- and 32-row tiles read the cache at up to 90%
    of the copy, where a 64-row program would multiply the padding.
    Measurement (H200, bf16, Hq 128, page 64, 2026-12-04; ``docs/benchmarks-mla.md``, "MLA
    decode, native"): native / Triton 0.093 / 0.177 ms at (32, 4k), 0.268 / 0.595 at
    (128, 4k), 2.08 / 4.62 at (128, 32k). H100, Hq 16, page 64, 2026-12-07: 48 rows (MTP
    q_len 3) on the native kernel 0.127 / 0.405 ms at (32, 8k) / (128, 8k) (1.02x / 0.97x
    the q_len 1 time), on the Triton 64-row tile 0.179 / 0.607 (1.39x / 1.38x). fp8 (e4m3)
    caches, H100, page 64, 2026-12-07: native / Triton 0.338 / 0.960 ms at Hq 128 (32, 16k),
    0.631 / 1.869 at Hq 64 (128, 16k): the rule is the same for both.
    """
    return rows >= MLA_NATIVE_MIN_ROWS


def choose(*, device: torch.device, impl: str, num_seqs: int, max_blocks: int,
           num_q_heads: int, num_tokens: int, kv_lora_rank: int, rope_dim: int,
           q_dtype: torch.dtype, kv_dtype: torch.dtype, max_context: int, tile=None,
           num_partitions: Optional[int] = None, tree: bool = False) -> MLAChoice:
    """The MLA decode's implementation and launch for one batch. ``impl="native"`` runs
    the sm_90a kernel where it covers the batch and raises where it does not;
    ``"auto"`` takes it where :func:`native_preferred` says so (a forced ``tile`` keeps
    Triton). float32 queries run the reference (``impl="triton"`` / ``"native"`` refuse
    them). The native launch shares the Triton launch's config (64 rows, 64-key tiles,
    the same partitions), so the Triton combine merges either. Arguments are validated
    by the plan. ``tree``: the drafts are under a tree mask (the Triton kernel's; the
    native kernel attends causally)."""
    if q_dtype not in MLA_Q_DTYPES:
        if impl in ("triton", "native"):
            raise ValueError(f"impl={impl!r} takes float16/bfloat16 queries, got {q_dtype}")
        select_impl(impl, device)  # rejects an unknown impl name
        return MLAChoice("reference", None)
    rows = num_tokens * num_q_heads
    native_why = None
    if impl in ("auto", "native"):
        native_why = native.device_unsupported(device) or native.shape_unsupported(
            kv_lora_rank=kv_lora_rank, rope_dim=rope_dim, q_dtype=q_dtype, kv_dtype=kv_dtype)
        if native_why is None and rows < MLA_NATIVE_MIN_ROWS:
            native_why = (f"{rows} query rows a request (native MLA decode: >= "
                          f"{MLA_NATIVE_MIN_ROWS})")
        if native_why is None and tree:
            native_why = "a draft tree mask (native MLA decode: causal drafts only)"
    preferred = native_preferred(rows=rows) and tile is None
    chosen = select_impl(impl, device, native_preferred=preferred,
                         native_unsupported=native_why, q_dtype=q_dtype)
    if chosen == "reference" or not num_seqs or not max_blocks:
        return MLAChoice(chosen, None)
    if chosen == "native":
        tile = (native.ROWS, native.BLOCK_N, None, None)
    config = launch_config(num_seqs=num_seqs, num_q_heads=num_q_heads, num_tokens=num_tokens,
                           kv_lora_rank=kv_lora_rank, kv_elem_size=kv_dtype.itemsize,
                           max_context_len=max_context, num_sms=_device.num_sms_of(device),
                           tile=tile, num_partitions=num_partitions,
                           native=chosen == "native")
    return MLAChoice(chosen, config)


def write_config(width: int) -> "tuple[int, int]":
    """``(BLOCK_W, num_warps)`` of the latent cache write: one program a token writes its
    whole row (``kv_lora_rank + rope_dim`` values, the next power of two of it wide).

    Reasoning: a row is 576 values (1.1 KB in 16-bit): one program a token with a warp per
    256 values (1..4) moves it in a few 16-byte vectors a thread.
    """
    block = _device.next_pow2(max(16, width))
    return block, min(4, max(1, block // 256))
