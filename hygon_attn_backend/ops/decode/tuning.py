"""The paged decode's named heuristics, and :func:`choose`, the one entry that turns a batch
into its launch configuration (native or Triton, tile, partitions, combine).

Each rule's docstring gives its reasoning and one line of the measurement behind it
(H200, graph replay, L2 cleared, pages permuted; what was tried and dropped is in
``docs/history.md``). No model names here: only shapes and device facts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hygon_attn_backend import envs
from hygon_attn_backend.ops import _device
from hygon_attn_backend.ops._dispatch import select_impl, triton_interpreter_on
from hygon_attn_backend.ops.decode import native

DECODE_Q_DTYPES = (torch.float16, torch.bfloat16)
WHOLE_SEQUENCE = 1 << 30  # partition size of the one-partition launch: covers any sequence
DECODE_MIN_PARTITION = 256  # smallest partition the decode heuristics choose
DECODE_TARGET_WAVES = 4     # programs per SM the Triton split aims at
DECODE_FEW_ROWS = 4  # query rows a program serves up to which D=128 takes the short tile
DECODE_SHORT_TILE_MIN_PAGE = 16  # ... on pages of at least this many tokens (measured 16, 64)
DECODE_FUSED_MAX_PARTITIONS = 4  # measured: a gain at 4 partitions, a loss from 8
DECODE_FP8_LARGE_GRID = 8  # programs an SM from which an fp8 decode takes the 128-key tile
DECODE_FP8_SPLIT = 4  # partitions of an fp8 grid below that where the rule leaves one
NATIVE_DECODE_MIN_PROGRAMS_PER_SM = 1.5  # grids below this split, and there Triton leads
NATIVE_LOOP_STAGES = 3  # cp.async stages of the native split-N loop (native_loop_stages)
NATIVE_LOOP_TILE = 64   # KV tokens a tile of the native split-N loop
NATIVE_PROGRAM_TILES = 1    # a program's fixed cost (Q, the warps' merge, its output), in tiles
NATIVE_COMBINE_TILES = 2    # the combine launch of a split call, in tiles
NATIVE_MAX_WAVES = 8        # waves a split grid may take
NATIVE_MIN_SPLIT_GAIN = 0.1  # a split must save this share of the unsplit cost
NATIVE_SIZING_PROGRAMS_PER_SM = 4  # workspace sizing: the native kernel fits 2-3 (D <= 128)


@dataclass
class DecodeConfig:
    """The Triton decode launch's shape (the native one reads ``partition_size`` and
    ``num_partitions``)."""

    partition_size: int
    num_partitions: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    page_prefetch: bool
    seq_split: bool = False  # each sequence splits its own length (seq_partitions)


@dataclass
class DecodeChoice:
    """What :func:`choose` decided for one batch."""

    impl: str                       # "triton" | "native" | "reference"
    config: Optional[DecodeConfig]  # None: nothing to launch (reference, empty batch/table)
    fused_combine: bool = False     # Triton: the partitions merge inside the decode kernel
    pdl: bool = False               # the combine is a programmatic dependent launch
    native_stages: int = 0          # native: the loop (0: shared-softmax; 2-3: split-N)
    native_tile: int = NATIVE_LOOP_TILE


# ----------------------------------------------------------------------------- native or Triton


def native_lacks(*, tree: bool, lse: bool) -> Optional[str]:
    """What a call asks that the native decode does not do (None: nothing), so that
    ``impl="auto"`` runs Triton for it and ``impl="native"`` is refused with the reason.

    Reasoning: the native decode (``csrc/``) walks the causal chain only and writes the
    output alone; a tree mask and the log-sum-exp (decode context parallelism merges the
    ranks' outputs by it) are the Triton kernel's.
    """
    if tree:
        return "a tree mask (the native decode has the causal chain only)"
    if lse:
        return "an LSE output (the native decode writes the attention output only)"
    return None


def native_preferred(*, is_hip: bool, group: int, head_dim: int, num_tokens: int,
                     programs: int, num_sms: int, same_kv_dtype: bool,
                     fp8_kv: bool = False) -> bool:
    """Whether ``impl="auto"`` runs the native decode instead of the Triton one.

    Reasoning: on AMD/Hygon GPUs (HIP) the native kernel is the DCU design itself (wave 64,
    the 16x16x16 matrix instructions), where Triton spills and misses peak: HIP takes it
    always. On NVIDIA native is taken only where it was measured faster:
    :func:`native_preferred_nvidia`.
    """
    if is_hip:
        return True
    return native_preferred_nvidia(group=group, head_dim=head_dim, num_tokens=num_tokens,
                                   programs=programs, num_sms=num_sms,
                                   same_kv_dtype=same_kv_dtype, fp8_kv=fp8_kv)


def native_preferred_nvidia(*, group: int, head_dim: int, num_tokens: int, programs: int,
                            num_sms: int, same_kv_dtype: bool, fp8_kv: bool = False) -> bool:
    """The native decode on NVIDIA: 1 <= G <= 16 query heads a KV head, one query token,
    head_dim 128, K/V in the query's 16-bit dtype, and a grid of at least
    ``NATIVE_DECODE_MIN_PROGRAMS_PER_SM`` (sequence, KV head) programs an SM.

    Reasoning: the native split-N loop stages whole swizzled 256-byte rows, 6-8% faster to
    stream than padded rows; where the grid fills the GPU unsplit that is the whole
    difference. At G = 1 a 16-row tile has one useful row, but the loop is bound by the
    KV stream, not the rows; Triton's 64-token tile gathers four pages at page 16, where
    the native loop's per-row addressing does not care. Where it splits, Triton's fused
    merge (up to 4 partitions) or its partition rule wins; D=64 and fp8 were not faster.
    Measurement (H200, bf16, pages permuted, same run; ``hygon-attn bench decode --impl
    auto,triton,native``):
    - G=2-8: native over Triton 1.02-1.05x from (32, 4k) up, 0.94-0.99x below 1.5
      programs an SM and at D=64 (2026-12-01).
    - G=1 (32/32 heads): native over Triton 1.00x at (8, 8k), 1.05x at (32, 4k), 1.06x
      at (64, 4k), 1.06x at (128, 4k), 1.05x at (256, 2k) and 1.11x at (64, 16k) on page
      16; on page 64 1.10x at (32, 4k), 0.98-1.00x at (64, 4k), (128, 4k) and (256, 2k),
      0.98x at (64, 16k) (2026-12-03; the 2026-12-01 loop measured 0.94-0.99x there).
    fp8 KV (``fp8_kv``, e4m3 or e5m2, bf16/fp16 queries) takes the native decode at every
    grid of that domain: its split-N loop stages the fp8 bytes and widens them after
    ldmatrix, where the Triton kernel's per-tile cost does not shrink with the bytes.
    Measurement (H200, bf16 q, 32/8 heads, page 16, 2026-12-04; ``hygon-attn bench decode
    --kv-dtype auto,fp8_e4m3 --impl auto,triton``): native e4m3 over Triton e4m3 0.78x the
    time at (1, 32k), 0.70x at (8, 8k), 0.64x at (32, 4k), 0.55x at (64, 16k), 0.64x at
    (256, 2k), 0.58x at (128, 8k).
    """
    if not (1 <= group <= 16 and num_tokens == 1 and head_dim == 128):
        return False
    if fp8_kv:
        return True
    if not same_kv_dtype:
        return False
    return programs >= NATIVE_DECODE_MIN_PROGRAMS_PER_SM * max(1, num_sms)


def native_loop_stages(*, split_n: bool = True) -> int:
    """The native decode's loop (``HabDecodeParams::loop_stages``): 0 runs the
    shared-softmax loop, 2-3 the split-N loop (where it applies: up to 16 rows, head_dim
    <= 128, 16-bit KV) with that many cp.async stages of 64-token tiles.

    Reasoning: a stage is 32 KB at head_dim 128 (64 tokens of K and V): 3 stages fit the 2
    programs an SM the loop's 216 registers allow (~128 KB in flight an SM).
    Measurement: 3 stages as fast as 2 or faster at every grid of 8-2,048 programs, e.g.
    (64, 4k) G=16 182.3 -> 141.2 us; 4 stages (one program an SM) lost 40-60%; 32-token
    tiles were 1-12% slower at 16 of 18 shapes (H200, 2026-12-01).
    ``split_n=False``: the shared-softmax loop (tests and benchmarks of that loop).
    fp8 KV takes the same 3: its stages hold half the bytes (16 KB), and 3 and 4 stages
    timed within 1% of each other at 6 shapes, 2 stages 7-11% slower (H200, 2026-12-04).
    """
    return NATIVE_LOOP_STAGES if split_n else 0


def native_partition_size(*, programs: int, max_context_len: int, block_n: int,
                          programs_per_sm: int, num_sms: int,
                          max_partitions: "int | None" = None) -> int:
    """Tokens per partition of the native decode (``>= max_context_len``: no split).

    ``programs``: the grid's programs per partition (sequences x KV heads x row chunks);
    ``programs_per_sm``: how many fit on an SM at once (the runtime's occupancy query).
    Reasoning: once the chip is full each program streams its partition at about the same
    speed, so a launch takes about ``waves x (tiles per program + 1)`` tile times plus ~2
    for the combine when split, ``waves = ceil(programs x partitions / slots)``. For each
    wave count up to ``NATIVE_MAX_WAVES`` the best partition count is the largest that
    still fits, ``floor(w x slots / programs)``; take the cheapest (partitions of at least
    ``DECODE_MIN_PARTITION`` tokens, at most ``max_partitions``) if it saves
    ``NATIVE_MIN_SPLIT_GAIN`` of the unsplit cost.
    Measurement: the Triton rule's ~4 programs an SM left the native kernel (2-3 an SM) a
    mostly empty second wave: (64, 4k) 32/8 read 72% of the copy with it (H200, 2026-12-01).
    """
    ctx = max(int(max_context_len), 1)
    tiles = -(-ctx // block_n)
    whole = tiles * block_n
    programs = max(1, int(programs))
    slots = max(1, int(programs_per_sm) * int(num_sms))
    min_tiles = max(1, DECODE_MIN_PARTITION // block_n)
    max_parts = max(1, -(-tiles // min_tiles))
    if max_partitions is not None:
        max_parts = max(1, min(max_parts, int(max_partitions)))
    if max_parts <= 1 or 2 * programs >= NATIVE_MAX_WAVES * slots:
        return whole

    def cost(parts: int) -> "tuple[int, int]":
        per = -(-tiles // parts)
        waves = -(-(programs * parts) // slots)
        combine = NATIVE_COMBINE_TILES if parts > 1 else 0
        return waves * (per + NATIVE_PROGRAM_TILES) + combine, parts

    unsplit = cost(1)[0]
    best = None
    for waves in range(1, NATIVE_MAX_WAVES + 1):
        parts = min(waves * slots // programs, max_parts)
        if parts > 1:
            best = cost(parts) if best is None else min(best, cost(parts))
    if best is None or best[0] > (1 - NATIVE_MIN_SPLIT_GAIN) * unsplit:
        return whole
    return -(-tiles // best[1]) * block_n


def _native_partition_size(*, num_seqs, num_kv_heads, rows, head_dim, q_dtype, kv_dtype,
                           max_context, loop_stages, loop_tile, device, max_partitions) -> int:
    """:func:`native_partition_size` for the native grid of ``rows = G * T`` query rows per
    KV head and this device's occupancy of the instantiation the launch takes."""
    chunk_rows = min(rows, native.MAX_ROWS)  # the rows of one program
    per_sm = native.programs_per_sm(
        device_index=_device.device_index(device), q_dtype=q_dtype, kv_dtype=kv_dtype,
        head_dim=head_dim, rows=chunk_rows, loop_stages=loop_stages, loop_tile=loop_tile)
    return native_partition_size(
        programs=native.grid_programs(num_seqs=num_seqs, num_kv_heads=num_kv_heads, rows=rows,
                                      head_dim=head_dim),
        max_context_len=max_context,
        block_n=native.block_n(head_dim=head_dim, rows=chunk_rows, loop_stages=loop_stages,
                               loop_tile=loop_tile),
        programs_per_sm=per_sm, num_sms=_device.num_sms_of(device),
        max_partitions=max_partitions)


# ----------------------------------------------------------------------------- Triton decode


def partition_size_env() -> "int | None":
    """Partition size forced by the environment: ``HYGON_ATTN_PARTITION_SIZE``, else
    ``PA_PARTITION_SIZE`` (the name DCU users know). A positive multiple of 16, or unset."""
    return envs.decode_partition_size()


def partition_size_dcu(group: int) -> int:
    """The DCU kernel's rule, the documented baseline: 512 tokens per partition, 256 when
    the GQA group ``G > 15``. It ignores the batch (splits at large batch, may under-fill
    the chip at batch 1)."""
    return 256 if group > 15 else 512


def triton_partition_size(*, num_seqs: int, num_kv_heads: int, group: int, max_context_len: int,
                   num_sms: int, rule: str = "measured") -> int:
    """Tokens per split-KV partition of the Triton decode (``>= max_context_len``: no split).

    Reasoning: decode reads each KV byte once, so the questions are whether the grid
    ``num_kv_heads x num_seqs x num_partitions`` keeps every SM loaded and what a split
    costs (a scratch write/read and a combine). Aim for ``DECODE_TARGET_WAVES`` programs an
    SM: ``num_partitions = round(target / (num_seqs * num_kv_heads))``, partitions of at
    least ``DECODE_MIN_PARTITION`` tokens. The size fixes the partition *count* from the
    launch's context bound; each sequence then splits its own length over that count on the
    device (``kernels/combine.py: seq_partitions``), so a bound far above the lengths (a
    CUDA graph planned for the cache's capacity) does not leave partitions empty.
    Measurement: 4 programs an SM was the best grid in every split sweep: (1, 128k) 64
    partitions 4109 GB/s against 3261 with the DCU rule (H200, bf16, D=128, Hq 32).
    Override: ``HYGON_ATTN_PARTITION_SIZE`` / ``PA_PARTITION_SIZE`` (checked first);
    ``rule="dcu"`` gives :func:`partition_size_dcu`.
    """
    env = partition_size_env()
    if env is not None:
        return env
    if rule == "dcu":
        return partition_size_dcu(group)
    if rule != "measured":
        raise ValueError(f"rule must be 'measured' or 'dcu', got {rule!r}")
    ctx = max(int(max_context_len), 1)
    whole = -(-ctx // DECODE_MIN_PARTITION) * DECODE_MIN_PARTITION
    programs = max(1, num_seqs * num_kv_heads)
    target = DECODE_TARGET_WAVES * max(1, num_sms)
    parts = int(target / programs + 0.5)  # nearest
    if parts <= 1:
        return whole
    size = -(-ctx // parts)
    size = -(-size // DECODE_MIN_PARTITION) * DECODE_MIN_PARTITION
    return min(max(size, DECODE_MIN_PARTITION), whole)


def tile_config(*, block_m: int, head_dim_pad: int, page_size: int, kv_elem_size: int,
                rows: int | None = None, tile=None) -> "tuple[int, int, int, bool]":
    """``(BLOCK_N, num_warps, num_stages, page_prefetch)`` of the Triton decode kernel.

    Reasoning: the kernel is bandwidth-bound: a K/V tile pair of ~8-32 KB with two stages
    keeps enough bytes in flight while the ``[BLOCK_M, D]`` accumulator stays in registers.
    A tile spanning pages (``P < BLOCK_N``) needs a table lookup per token, so
    ``page_prefetch`` reads the next tile's block ids one iteration ahead. Large
    ``BLOCK_M * D`` get 8 warps. Few rows at D=128 (at most ``DECODE_FEW_ROWS``) on pages
    of 16+ tokens take BLOCK_N 32 with 3 stages: the same bytes in flight in two smaller
    loads, 100 registers instead of 128.
    Measurement: 64 / 4 warps / 2 stages / read-ahead best or within 1% everywhere, 16, 32
    or 128 keys lost 2-25%; the few-rows tile +1-3 points of the copy at G <= 4 (H200, bf16).
    Override: ``tile=(BLOCK_N, num_warps, num_stages, page_prefetch)`` (any entry None).
    """
    few_rows = (rows is not None and rows <= DECODE_FEW_ROWS and head_dim_pad == 128
                and page_size >= DECODE_SHORT_TILE_MIN_PAGE)
    chosen = [32 if few_rows else block_n_for(head_dim_pad),
              8 if block_m * head_dim_pad >= 64 * 256 else 4,
              3 if few_rows else 2, True]
    for i, value in enumerate(tile or ()):
        if value is not None:
            chosen[i] = value
    block_n, num_warps, num_stages, prefetch = chosen
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"decode tile BLOCK_N must be a power of two >= 16, got {block_n}")
    return int(block_n), int(num_warps), int(num_stages), bool(prefetch)


def kv_widen(*, kv_dtype: torch.dtype, device) -> str:
    """How the Triton decode widens its K/V tiles (``kernels/fp8.py``): ``"none"`` for a
    16-bit cache; for fp8, ``"e4m3_cvt"`` / ``"e5m2_cvt"`` (the ``cvt.rn.f16x2`` instruction
    on the tile as loaded) on NVIDIA GPUs of compute capability 8.9+, else ``"cast"``
    (Triton's cast: HIP, older GPUs, the CPU interpreter). Every fp8 mode runs both dots
    on fp16 operands (exact for every e4m3 / e5m2 value).

    Reasoning: fp8 -> bf16 takes four conversions a pair of elements (via f16 and f32)
    against one for fp16, and Triton's own cast is moved behind the dot operand's shared
    load, which then reads K a byte at a time; the instruction on the loaded tile keeps the
    16-bit operand path (an impure inline asm, which Triton does not move).
    Measurement: the loop's sm_90 SASS, 64 keys, 4 warps (Triton 3.6): bf16 cache 825
    instructions; fp8 widened to bf16 1,184 (128 F2F); Triton's fp16 cast 1,001 (64
    byte-wide shared loads); the instruction on the tile 595. H200, (64, 16k), 32-key tile:
    widened to bf16 1,272 us, Triton's cast 1,109, the instruction 1,192, the instruction
    replaced by a byte move of the same count 1,188: the conversion is not what bounds the
    loop (``fp8_tile`` is what gained). The tile sweep behind ``fp8_tile`` ran with the
    instruction; Triton's cast was not swept (2026-12-03).
    """
    if kv_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "none"
    if getattr(device, "type", None) == "cuda" and not _device.gpu_is_hip() and \
            not triton_interpreter_on() and \
            _device.cuda_capability(_device.device_index(device)) >= (8, 9):
        return "e4m3_cvt" if kv_dtype == torch.float8_e4m3fn else "e5m2_cvt"
    return "cast"


def fp8_regime(*, kv_elem_size: int, head_dim_pad: int, page_size: int,
               rows: Optional[int]) -> bool:
    """Whether the fp8 decode rules (:func:`fp8_tile`, :func:`fp8_partition_size`) apply:
    an fp8 cache at D=128 with few rows a program (at most ``DECODE_FEW_ROWS``) on pages
    of 16+ tokens, where they were measured; elsewhere the 16-bit rules stand."""
    return (kv_elem_size == 1 and head_dim_pad == 128 and rows is not None
            and rows <= DECODE_FEW_ROWS and page_size >= DECODE_SHORT_TILE_MIN_PAGE)


def fp8_tile(*, programs: int, num_sms: int) -> "tuple[int, int, int]":
    """``(BLOCK_N, num_warps, num_stages)`` of an fp8 decode (:func:`fp8_regime`).

    Reasoning: an fp8 tile holds half the bytes of a 16-bit one, and the loop's time per
    tile hardly depends on the bytes (the same tile count took the same time with the
    conversion replaced by a byte move: it is not the conversion), so fp8 wants more keys
    a tile than the 16-bit few-rows tile (32 keys, 3 stages): 64 keys with 3 stages
    (145 registers, 3 programs an SM). A grid of ``DECODE_FP8_LARGE_GRID``+ programs an SM
    has the waves to hide its latency without splitting: 128 keys, 2 stages.
    Measurement (H200, bf16 q, e4m3, 32/8 heads, page 16, best partition count of each
    tile; bf16 ``auto`` in the same run): (64, 16k) 32-key 1,162 us, 64/3 975, 128/2 980,
    bf16 968; (256, 2k) 588 / 524 / 480, bf16 493; (8, 8k) 86.0 / 76.7 / 81.9, bf16 81.8;
    (1, 32k) 49.4 / 46.1 / 49.7, bf16 50.7 (2026-12-03).
    """
    if programs >= DECODE_FP8_LARGE_GRID * max(1, num_sms):
        return 128, 4, 2
    return 64, 4, 3


def fp8_partition_size(*, partition_size: int, programs: int, max_context_len: int,
                       num_sms: int) -> int:
    """The partition size of an fp8 decode (:func:`fp8_regime`), from the 16-bit rule's
    ``partition_size``: where that leaves one partition and the grid is below
    ``DECODE_FP8_LARGE_GRID`` programs an SM, ``DECODE_FP8_SPLIT`` partitions.

    Reasoning: the 64-key fp8 tile fits 3 programs an SM, not 4: a grid sized for 4 (the
    16-bit rule's 512 programs at (64, 16k)) runs 1.3 waves of 396; four partitions give
    even waves, and their merge is the fused one.
    Measurement: (64, 16k) e4m3 64-key tile: 1 partition 1,234 us, 2 980, 4 975 (H200,
    2026-12-03).
    """
    ctx = max(int(max_context_len), 1)
    if partition_size < ctx or programs >= DECODE_FP8_LARGE_GRID * max(1, num_sms):
        return partition_size
    size = -(-ctx // DECODE_FP8_SPLIT)
    size = -(-size // DECODE_MIN_PARTITION) * DECODE_MIN_PARTITION
    return max(size, DECODE_MIN_PARTITION)


def block_n_for(head_dim_pad: int) -> int:
    """Default KV tile length of the Triton decode for a padded head_dim.

    Reasoning: ``BLOCK_N x D`` of ~8K elements keeps the same bytes in flight at every
    head_dim: ``8192 / D`` (128 at D=64, 64 at D=128, 32 at D=256); below 64 it stays 64.
    Measurement: D=64 BLOCK_N 128 / 64 / 32 read 76.0 / 65.5 / 50.7% of the copy at (64, 4k)
    (H200, fp16, 16/4 heads).
    """
    if head_dim_pad < 64:
        return 64
    return max(16, min(128, 8192 // head_dim_pad))


def use_fused_combine(*, num_partitions: int) -> bool:
    """Whether a split Triton decode merges its partitions inside the decode kernel.

    Reasoning: fused, the last program of each (sequence, head group) merges the group's
    partitions while other groups still stream KV: one launch, no kernel boundary. But one
    program merges serially, so many partitions are a tail the second launch spreads out.
    Measurement: fused against two launches +7% at 4 partitions, -3% at 8, -44% at 64
    (H200, bf16, D=128). ``fused_combine=`` (plan / op) forces either form.
    """
    return 1 < num_partitions <= DECODE_FUSED_MAX_PARTITIONS


def combine_pdl(device) -> bool:
    """Whether a split decode launches its combine as a programmatic dependent launch.

    Reasoning: between the decode and combine grids the GPU drains one and ramps up the
    other; with PDL (sm_90+) the combine grid is scheduled once every decode program has
    started and waits for their writes, overlapping the decode's tail. Never on HIP or under
    the interpreter.
    Measurement: never slower, 1-5% faster where the combine is a large share: (1, 8k) 23.7
    against 24.8-25.0 us (H200, bf16, 32/8 heads). ``HYGON_ATTN_DECODE_PDL=0`` turns it off.
    """
    if envs.decode_pdl() is False or getattr(device, "type", None) != "cuda" or \
            _device.gpu_is_hip() or triton_interpreter_on():
        return False
    return _device.cuda_major(_device.device_index(device)) >= 9


def combine_chunk(*, rows_pad: int, head_dim_pad: int, num_warps: int,
                  fused: bool = True) -> int:
    """Partitions the merge reads per step, a ``[chunk, rows_pad, head_dim_pad]`` fp32 tile.

    Reasoning: fused into the decode kernel at most 16 values a thread and 16 partitions,
    so the merge does not cost the KV loop its occupancy (with 8+ rows the chunk is 1: rows
    8 x chunk 2 took 144 registers against 110, 3 programs an SM instead of 4). The combine
    kernel alone is latency-bound with registers to spare: 64 values a thread, 64
    partitions a step.
    Measurement: combine kernel chunk 64 against 16: (1, 32k) 64 partitions 7.41 against
    9.73 us (H200).
    """
    if fused and rows_pad >= 8:
        return 1
    per_thread, cap = (16, 16) if fused else (64, 64)
    budget = per_thread * 32 * max(1, num_warps)
    return max(1, min(cap, budget // max(1, rows_pad * head_dim_pad)))


# ----------------------------------------------------------------------------- the config


def num_partitions_for(partition_size: int, max_context_len: int) -> int:
    return max(1, -(-max(int(max_context_len), 1) // partition_size))


def launch_config(*, num_seqs: int, num_q_heads: int, num_kv_heads: int, num_tokens: int,
                  head_dim: int, page_size: int, kv_elem_size: int, max_context_len: int,
                  num_sms: int, partition_size: Optional[int] = None,
                  kv_head_grid: bool = True, rule: str = "measured",
                  tile=None) -> DecodeConfig:
    """The Triton launch configuration (also the partition count of a native launch).
    tile: optional ``(BLOCK_N, num_warps, num_stages, page_prefetch)`` forcing the tile."""
    group = num_q_heads // num_kv_heads
    heads = group if kv_head_grid else 1
    block_m = max(16, _device.next_pow2(num_tokens * heads))
    fp8 = kv_head_grid and fp8_regime(kv_elem_size=kv_elem_size,
                                      head_dim_pad=_device.next_pow2(head_dim),
                                      page_size=page_size, rows=num_tokens * heads)
    programs = num_seqs * num_kv_heads
    # the fp8 rule's tile, else a verify batch's (None: the general rule's)
    rule_tile = fp8_tile(programs=programs, num_sms=num_sms) if fp8 else verify_tile(
        num_tokens=num_tokens, rows=num_tokens * heads,
        head_dim_pad=_device.next_pow2(head_dim), kv_elem_size=kv_elem_size)
    block_n, num_warps, num_stages, prefetch = tile_config(
        block_m=block_m, head_dim_pad=_device.next_pow2(head_dim), page_size=page_size,
        kv_elem_size=kv_elem_size, rows=num_tokens * heads,
        tile=_merge_tile(rule_tile, tile))
    # the measured rule fixes the partition count; each sequence then splits its own length
    # (seq_partitions): a forced or environment size keeps fixed partitions
    seq_split = partition_size is None and rule == "measured" and partition_size_env() is None
    if partition_size is None:
        partition_size = triton_partition_size(
            num_seqs=num_seqs, num_kv_heads=num_kv_heads, group=group,
            max_context_len=max_context_len, num_sms=num_sms, rule=rule)
        if fp8 and seq_split:
            partition_size = fp8_partition_size(
                partition_size=partition_size, programs=programs,
                max_context_len=max_context_len, num_sms=num_sms)
    num_partitions = num_partitions_for(partition_size, max_context_len)
    if num_partitions > 1:
        block_n = min(block_n, partition_size & -partition_size)
    return DecodeConfig(partition_size, num_partitions, block_m, block_n, num_warps, num_stages,
                        prefetch, seq_split=seq_split and num_partitions > 1)


#: query rows a program (draft tokens x GQA group) from which a verify tile takes 3 stages
VERIFY_DEEP_ROWS = 32


def verify_tile(*, num_tokens: int, rows: int, head_dim_pad: int,
                kv_elem_size: int) -> "Optional[tuple]":
    """``(BLOCK_N, num_warps, num_stages)`` entries (None: the general rule's) of a
    speculative verify tile, or None where the general rule stands.

    Reasoning: a verify program of 32-64 rows (8 drafts at G = 4) does 2-4x the products of
    a decode program on the same bytes; a third stage keeps one more K/V tile in flight
    while the dots run, where 16 rows are still bound by the loads alone.
    Measurement (H100, B = 64, prefix 32k, 32/8 heads, D = 128, bf16, page 16, 2026-12-06;
    plain decode 2.899 ms): T = 8 at the 64-key tile, 2 / 3 stages: chain 3.499 / 2.998 ms,
    8-node tree 3.503 / 3.008; T = 4 (16 rows): chain 2.863 / 3.493, so 16 rows keep 2.
    """
    if num_tokens > 1 and rows >= VERIFY_DEEP_ROWS and head_dim_pad == 128 and \
            kv_elem_size == 2:
        return (None, None, 3)
    return None


def _merge_tile(rule, tile):
    """A forced ``tile`` (entries None: keep) over a rule's ``(BLOCK_N, warps, stages)``."""
    if rule is None:
        return tile
    merged = list(rule) + [None]
    for i, value in enumerate(tile or ()):
        if value is not None:
            merged[i] = value
    return tuple(merged)


def kernel_partition_size(config: DecodeConfig) -> int:
    """The kernels' ``partition_size`` argument: one partition covering any sequence
    (unsplit), the floor of a per-sequence split, or the fixed size."""
    if config.num_partitions <= 1:
        return WHOLE_SEQUENCE
    if config.seq_split:
        return DECODE_MIN_PARTITION
    return config.partition_size


def seq_partitions(seq_len: int, config: DecodeConfig,
                   table_keys: Optional[int] = None) -> "tuple[int, int]":
    """``(part_size, num_parts)`` of one sequence under ``config`` (a split launch), as
    the kernels compute it (``kernels/combine.py: seq_partitions``) from the keys its table
    holds, ``min(seq_len, table_keys)`` (``table_keys``: ``max_blocks * page_size``; None:
    ``seq_len``). Fixed partitions too few for those keys (a ``max_seq_len`` below the
    length) spread them over the grid instead."""
    n = seq_len if table_keys is None else min(seq_len, table_keys)
    parts_max, block_n = config.num_partitions, config.block_n
    if config.seq_split:
        size = max(-(-n // parts_max), kernel_partition_size(config))
        size = -(-size // block_n) * block_n
        parts = -(-n // size)
    else:
        size = config.partition_size
        if n > parts_max * size:
            size = -(-(-(-n // parts_max)) // block_n) * block_n
        parts = min(-(-n // size), parts_max)
    return size, max(parts, 1)


def workspace_partitions(*, num_seqs: int, num_q_heads: int, num_kv_heads: int,
                         head_dim: int, num_tokens: int, max_context_len: int,
                         num_sms: int, partition_size: Optional[int] = None) -> int:
    """The most partitions a batch of ``num_seqs`` sequences takes under any rule (the
    Triton rule, its fp8 split (:func:`fp8_partition_size`: the cache dtype is not known
    here), and the native one at ``NATIVE_SIZING_PROGRAMS_PER_SM``, an occupancy above the
    kernel's, with its smallest tile): what a workspace must hold for it."""
    group = num_q_heads // max(1, num_kv_heads)
    triton_size = triton_partition_size(num_seqs=num_seqs, num_kv_heads=num_kv_heads,
                                        group=group, max_context_len=max_context_len,
                                        num_sms=num_sms)
    sizes = [partition_size] if partition_size else [
        triton_size,
        fp8_partition_size(partition_size=triton_size, programs=num_seqs * num_kv_heads,
                           max_context_len=max_context_len, num_sms=num_sms),
        native_partition_size(
            programs=native.grid_programs(num_seqs=num_seqs, num_kv_heads=num_kv_heads,
                                          rows=num_tokens * group, head_dim=head_dim),
            max_context_len=max_context_len, block_n=32,
            programs_per_sm=NATIVE_SIZING_PROGRAMS_PER_SM, num_sms=num_sms)]
    return max(num_partitions_for(size, max_context_len) for size in sizes)


def choose(*, device: torch.device, impl: str, num_seqs: int, max_blocks: int,
           num_q_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
           q_dtype: torch.dtype, kv_dtype: torch.dtype, num_tokens: int, max_context: int,
           partition_size: Optional[int] = None, kv_head_grid: bool = True, tile=None,
           fused_combine: Optional[bool] = None, workspace_slots: Optional[int] = None,
           workspace_counters: bool = True, native_split_n: bool = True,
           tree: bool = False, lse: bool = False) -> DecodeChoice:
    """The decode's whole configuration for one batch: the implementation (``impl``
    resolved by :func:`native_preferred`), the launch config, the combine's form, and the
    native loop. ``workspace_slots``: the slots a caller's workspace holds (None: the plan
    allocates one to fit); ``workspace_counters``: whether it has the fused combine's
    counters. ``tree``: the batch has a tree mask, which only the Triton kernel reads.
    ``lse``: the call returns the log-sum-exp, which only the Triton kernel writes
    (:func:`native_lacks`: ``impl="auto"`` then takes Triton, ``impl="native"`` is refused).
    Arguments are validated by the plan."""
    group = num_q_heads // num_kv_heads
    if q_dtype not in DECODE_Q_DTYPES:  # float32 queries: the reference serves them
        if impl in ("triton", "native"):
            raise ValueError(f"impl={impl!r} takes float16/bfloat16 queries, got {q_dtype}")
        select_impl(impl, device)  # rejects an unknown impl name
        return DecodeChoice("reference", None)
    num_sms = _device.num_sms_of(device)
    chosen = select_impl(
        impl, device, native_unsupported=native.unsupported(
            head_dim=head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype, kv_head_grid=kv_head_grid)
        or native_lacks(tree=tree, lse=lse),
        native_preferred=native_preferred(
            is_hip=_device.gpu_is_hip(), group=group, head_dim=head_dim, num_tokens=num_tokens,
            programs=num_seqs * num_kv_heads, num_sms=num_sms,
            same_kv_dtype=kv_dtype == q_dtype,
            fp8_kv=kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)), q_dtype=q_dtype)
    stages = native_loop_stages(split_n=native_split_n) if chosen == "native" else 0
    if chosen == "reference" or not num_seqs or not max_blocks:
        return DecodeChoice(chosen, None, native_stages=stages)
    if chosen == "native" and partition_size is None and partition_size_env() is None:
        partition_size = _native_partition_size(
            num_seqs=num_seqs, num_kv_heads=num_kv_heads, rows=num_tokens * group, head_dim=head_dim, q_dtype=q_dtype, kv_dtype=kv_dtype,
            max_context=max_context, loop_stages=stages, loop_tile=NATIVE_LOOP_TILE,
            device=device,
            max_partitions=None if workspace_slots is None else workspace_slots // num_seqs)
    config = launch_config(
        num_seqs=num_seqs, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        num_tokens=num_tokens, head_dim=head_dim, page_size=page_size,
        kv_elem_size=kv_dtype.itemsize, max_context_len=max_context, num_sms=num_sms,
        partition_size=partition_size, kv_head_grid=kv_head_grid, tile=tile)
    split = config.num_partitions > 1
    fused = split and chosen == "triton" and workspace_counters and (
        fused_combine if fused_combine is not None
        else use_fused_combine(num_partitions=config.num_partitions))
    return DecodeChoice(chosen, config, fused_combine=fused,
                        pdl=split and not fused and combine_pdl(device),
                        native_stages=stages)


#: rows (draft tokens x GQA group) up to which a verify step runs on the decode structure
VERIFY_DECODE_MAX_ROWS = 64


def verify_on_decode(*, num_tokens: int, group: int) -> bool:
    """Whether a speculative verify step (``num_tokens`` drafts a request) runs as a
    multi-token decode (drafts read back from the cache, a KV-head grid, split-KV) rather
    than as a prefix prefill of the drafts.

    Reasoning: a verify step reads the whole prefix once per KV head, as a decode step
    does; the prefill path has no split over the keys, so a small batch leaves the GPU
    idle, while the decode structure keeps a program's ``T x G`` rows in one M tile and
    splits long prefixes. Past 64 rows the decode tile grows beyond what it was tuned for.
    Measurement (H200, bf16, 32/8 heads, page 16, 2026-12-03): T=4, (64, 32k) 1.11x a
    decode step against 1.16x through the prefill, (8, 8k) 1.09x against 1.49x, (1, 32k)
    1.08x against 8.6x; an 8-draft tree at (64, 32k) 2.18x against 2.83x
    (``docs/benchmarks.md``).
    """
    return num_tokens * group <= VERIFY_DECODE_MAX_ROWS
