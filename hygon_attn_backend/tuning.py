"""Named, documented heuristics: partition size for split-KV decode, tile shapes.

Each heuristic is a function whose docstring gives the reasoning and the measurement
behind it (docs/benchmarks.md), with an environment override where users need one.
No model names here: only shapes and device facts.
"""

from __future__ import annotations

import functools

from hygon_attn_backend import envs


# ----------------------------------------------------------------------------- cache ops


def cache_write_config(num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """``(BLOCK_H, num_warps)`` for ``write_kv``: one program per (token, BLOCK_H heads).

    Reasoning: writing the cache is pure data movement, ``2 * H * D`` elements per token.
    A program should move a tile big enough to keep its warps' loads wide (about 1-2K
    elements, i.e. every thread holds a few 16-byte vectors) yet leave many programs in
    flight for small decode batches. So BLOCK_H is the number of heads that makes the
    ``[BLOCK_H, next_pow2(D)]`` tile about 1024 elements (capped by the head count), and
    num_warps grows with the tile (1 warp per 256 elements, 1..4).
    Measurement: not yet tuned on the GPU (the rule is the bandwidth-bound default).
    Override: ``HYGON_ATTN_WRITE_KV_BLOCK_H`` (a power of two).
    """
    block_d = 1 << max(0, (head_dim - 1).bit_length())
    block_h = envs.write_kv_block_h()
    if block_h is None:
        block_h = max(1, 1024 // block_d)
        heads_pow2 = 1 << max(0, (num_kv_heads - 1).bit_length())
        block_h = min(block_h, heads_pow2)
    num_warps = min(4, max(1, (block_h * block_d) // 256))
    return block_h, num_warps


def copy_blocks_config(numel_per_block: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for ``copy_blocks``: one program copies BLOCK elements of one
    (src, dst) block pair.

    Reasoning: a block is ``H * P * D`` elements (16K for 8 heads x 16 slots x 128), so
    4096-element chunks with 8 warps give each thread 4 x 4 elements (wide vector loads
    when the inner axis is contiguous) and a few programs per pair; tiny blocks (P = 1)
    use one chunk of the next power of two. Measurement: not yet tuned on the GPU (a
    bandwidth-bound default). Override: ``HYGON_ATTN_COPY_BLOCKS_BLOCK`` (a power of two).
    """
    block = envs.copy_blocks_block()
    if block is None:
        block = min(4096, 1 << max(0, (numel_per_block - 1).bit_length()))
    num_warps = min(8, max(1, block // 512))
    return block, num_warps


# ----------------------------------------------------------------------------- native or Triton


def native_preferred(op: str, *, is_hip: bool, group: int = 1, head_dim: int = 0,
                     num_tokens: int = 1, programs: int = 0, num_sms: int = 0,
                     same_kv_dtype: bool = True) -> bool:
    """Whether ``impl="auto"`` runs the native kernel (``csrc/``) of ``op`` (``"decode"``,
    ``"write_kv"``, ``"copy_blocks"``, ``"prefill"``) instead of the Triton one.

    Reasoning: on AMD/Hygon GPUs (HIP) the native kernels are the DCU design itself:
    hand-written for wave 64 and the 16x16x16 matrix instructions, where Triton spills
    registers and misses peak (published DCU numbers: 1.5-4.3x faster kernels, TPOT 79 ->
    35 ms); so HIP takes native for every op. On NVIDIA, Triton's kernels are tuned on the
    H200, and native is taken only where it was measured faster there: the prefill (sm_90
    wgmma kernel) and the decode shapes of :func:`native_decode_preferred_nvidia` (the
    decode's keywords: ``group`` = Hq / Hkv, ``head_dim``, ``num_tokens`` a sequence,
    ``programs`` = sequences x KV heads, ``num_sms``, ``same_kv_dtype`` = K/V in the query
    dtype, not fp8).
    Override: ``HYGON_ATTN_NATIVE_AUTO=1`` (native wherever it runs) / ``0`` (never).
    """
    forced = envs.native_auto()
    if forced is not None:
        return forced
    if op not in ("decode", "write_kv", "copy_blocks", "prefill"):
        raise ValueError(f"op must be 'decode', 'write_kv', 'copy_blocks' or 'prefill', got "
                         f"{op!r}")
    if is_hip:
        return op != "prefill"  # the native prefill is sm_90a only
    if op == "prefill":
        # the sm_90 wgmma kernel (csrc/prefill_sm90.cu; other GPUs have none: the plan's
        # native_unsupported keeps them on Triton): 1.39-1.47x Triton at the five issue-13
        # shapes (H200, bf16, 32/8 heads, page 16, keys from the cache; session 14,
        # docs/native-prefill.md)
        return True
    if op == "decode":
        return native_decode_preferred_nvidia(
            group=group, head_dim=head_dim, num_tokens=num_tokens, programs=programs,
            num_sms=num_sms, same_kv_dtype=same_kv_dtype)
    return False


NATIVE_DECODE_MIN_PROGRAMS_PER_SM = 1.5  # grids below this split, and there Triton leads


def native_decode_preferred_nvidia(*, group: int, head_dim: int, num_tokens: int,
                                   programs: int, num_sms: int, same_kv_dtype: bool) -> bool:
    """Whether the native decode is the faster one on NVIDIA for this step: 2 <= G <= 16
    query heads a KV head, one query token a sequence (at most 16 rows a KV head: the
    split-N loop), head_dim 128, K/V in the query's 16-bit dtype, and a grid of at least
    ``NATIVE_DECODE_MIN_PROGRAMS_PER_SM`` (sequence, KV head) programs an SM.

    Reasoning: the native split-N loop stages whole 256-byte rows, swizzled, which a
    stand-alone stream of the same grid showed 6-8% faster than the padded rows both
    decodes had (docs/notes-decode.md v18); where the grid fills the GPU without a split,
    that is the whole difference. Where it splits, its combine is a second launch that
    Triton's fused merge (up to 4 partitions) or its partition rule beats; G = 1 gives the
    16-row tiles one useful row; head_dim 64 and fp8 KV (the shared-softmax loop) were
    not faster.
    Measurement (H200, graph replay, L2 cleared by do_bench's write / by a read, page 16,
    pages permuted, ``scripts/bench_native_decode.py``, session 16, docs/native-measurements.md),
    native with 3 stages over Triton: G=2 (64, 4k) and (128, 2k) 1.04x / 1.04x; G=4 (32,
    4k) 1.02-1.03x, (64, 4k) 1.04-1.05x, (128, 2k) 1.04x, (128, 4k) 1.04x, (256, 2k)
    1.04-1.05x, (64, 16k) 1.05x; fp16 (64, 4k) and (256, 2k) 1.04x; G=8 (64, 4k) and (128,
    2k) 1.00-1.02x; G=16 (64, 4k) 0.99-1.01x, (256, 2k) 1.01-1.03x. Below 1.5 programs an
    SM: (16, 8k) G=4 0.96-0.97x, (8, 8k) 0.97-0.99x, (1, 32k) 0.94-0.97x, (32, 4k) G=16
    0.84x; G=1 (64, 4k) 0.95-0.98x; head_dim 64 0.97-0.99x.
    """
    if not (2 <= group <= 16 and num_tokens == 1 and head_dim == 128 and same_kv_dtype):
        return False
    return programs >= NATIVE_DECODE_MIN_PROGRAMS_PER_SM * max(1, num_sms)


def native_decode_stages() -> int:
    """The native decode's loop (``HabDecodeParams::loop_stages``): 0 runs the
    shared-softmax loop, 2-4 the split-N loop (where it applies) with that many cp.async
    stages, i.e. 1-3 KV tiles in flight while one is computed.

    Reasoning: a stage is 32 KB at head_dim 128 (64 tokens of K and V), so 3 stages fit 2
    programs an SM (~128 KB in flight an SM); 2 stages would fit 3 by shared memory, but
    the loop's 216 registers (Q kept in registers since session 17) allow 2; 4 stages fit
    one.
    Measurement (H200, bf16, D=128 and 64, page 16, graph replay with the L2 cleared,
    ``scripts/bench_native_decode.py --variants ...,native_s2,native_s3``, session 16,
    docs/native-measurements.md): since the stages hold whole swizzled rows
    (docs/notes-decode.md v18), 3 stages are as fast as 2 or faster at every grid measured,
    8 to 2,048 programs:
    (256, 2k) G=4 524.0 -> 498.4 us, (128, 2k) 280.6 -> 260.7 us, (64, 4k) 284.1 -> 259.4
    us, (64, 4k) G=16 182.3 -> 141.2 us (write flush). (With the padded rows of sessions
    10-15, 2 stages had been 2-7% faster from 4 programs an SM up.) 4 stages lost 40-60%.
    Override: ``HYGON_ATTN_NATIVE_SPLIT_N=0`` (the shared-softmax loop),
    ``HYGON_ATTN_NATIVE_STAGES=2|3|4``.
    """
    if envs.native_split_n() is False:
        return 0
    forced = envs.native_stages()
    if forced is not None:
        return forced
    return 3


def native_decode_tile() -> int:
    """KV tokens per tile of the native split-N decode loop (``HabDecodeParams::loop_tile``):
    32 or 64.

    Reasoning: with 64-token tiles each of the 4 warps owns 16 tokens and all of O (64
    fp32 registers a thread at head_dim 128) and keeps Q's fragments (32 more): 216
    registers and 35 KB a stage, 2 programs an SM with 3 stages. With 32-token tiles two
    warps share 16 tokens and split both QK^T's channels (the halves of S added through
    shared memory) and O's: 96 registers, 17.5 KB a stage and 4 KB for the exchange, 3
    programs an SM with 3 stages and 5 with 2, for twice the per-tile work (barriers,
    staging, softmax) per token.
    Measurement (H200, bf16, D=128, page 16, graph replay with the L2 cleared,
    ``scripts/bench_native_decode.py``, docs/native-measurements.md session 10): the 32-token tile
    issued 1.6x the instructions of the 64-token one at (1, 32k) 32/8 (ncu) at 1.75x the
    IPC; timed over 18 shapes it was the faster only at (256, 2k) G = 8 / 16 (1-2%, with 3
    stages) and at (8, 8k) (level), and 1-12% slower elsewhere. With the S exchange
    (session 11, three runs): 2 stages 1-2% faster at (256, 2k) G = 8 / 16, (64, 4k) 32/8
    and (8, 8k), level at batch 1, 5-26% slower at (64, 4k) / (64, 16k) G >= 8; 3 stages
    slower nearly everywhere. No rule separates the few wins from run-to-run noise, so
    64 everywhere.
    Override: ``HYGON_ATTN_NATIVE_TILE=32|64``.
    """
    forced = envs.native_tile()
    if forced is not None:
        return forced
    return 64


NATIVE_PROGRAM_TILES = 1    # a program's fixed cost (Q, the warps' merge, its output), in tiles
NATIVE_COMBINE_TILES = 2    # the combine launch of a split call, in tiles
NATIVE_MAX_WAVES = 8        # waves a split grid may take
NATIVE_MIN_SPLIT_GAIN = 0.1  # a split must save this share of the unsplit cost


def native_decode_partition_size(*, programs: int, max_context_len: int, block_n: int,
                                 programs_per_sm: int, num_sms: int,
                                 max_partitions: "int | None" = None) -> int:
    """Tokens per partition of the native decode (``>= max_context_len``: no split).

    ``programs``: the grid's programs per partition (sequences x KV heads x row chunks);
    ``programs_per_sm``: how many of them fit on an SM at once (the runtime's occupancy
    calculator, ``_native.decode_programs_per_sm``).
    Reasoning: each native program streams its partition at about the same speed once the
    chip is full, so a launch takes about ``waves x (tiles per program + 1)`` tile times,
    ``waves = ceil(programs x partitions / slots)`` with ``slots = programs_per_sm x
    num_sms``, plus ~2 tile times for the combine when split. The Triton rule's aim of ~4
    programs an SM leaves the native kernel (2-3 programs an SM) in a second, mostly empty
    wave: (64, 4k) 32/8 (512 programs on 396 slots) read 72% of the copy and (1, 128k) 64
    partitions x 8 heads 58%. For each wave count ``w <= NATIVE_MAX_WAVES`` the best
    partition count is the largest that still fits ``w`` waves, ``floor(w x slots /
    programs)``; this takes the cheapest of those, with partitions of at least
    ``DECODE_MIN_PARTITION`` tokens in whole tiles and at most ``max_partitions`` (what a
    caller's workspace holds), if it saves ``NATIVE_MIN_SPLIT_GAIN`` of the unsplit cost.
    A grid of ``NATIVE_MAX_WAVES / 2`` waves or more unsplit is not split (its tail is a
    small share, and the programs of a real batch end at different times anyway).
    Measurement: docs/native-measurements.md (2026-12-01, second run).
    Override: ``HYGON_ATTN_PARTITION_SIZE`` / ``PA_PARTITION_SIZE`` (the plan checks them
    first) or ``partition_size=``.
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


def gpu_is_hip() -> bool:
    """True on ROCm/DTK torch (AMD and Hygon GPUs)."""
    import torch

    return bool(getattr(torch.version, "hip", None))


# ----------------------------------------------------------------------------- paged decode

DECODE_MIN_PARTITION = 256  # smallest partition the decode heuristics choose


def decode_partition_size_env() -> "int | None":
    """Partition size forced by the environment: ``HYGON_ATTN_PARTITION_SIZE``, else
    ``PA_PARTITION_SIZE`` (the name DCU users know). A positive multiple of 16, or unset."""
    return envs.decode_partition_size()


def decode_partition_size_dcu(group: int) -> int:
    """The DCU kernel's rule, kept as the documented baseline: 512 tokens per partition,
    256 when the GQA group ``G > 15`` (its M tile is then large, so shorter partitions
    keep the per-program work even). It ignores the batch: at large batch it still splits
    (extra scratch traffic and a combine launch), at batch 1 it may under-fill the chip.
    """
    return 256 if group > 15 else 512


def decode_partition_size(*, num_seqs: int, num_kv_heads: int, group: int,
                          max_context_len: int, num_sms: int, rule: str = "measured") -> int:
    """Tokens per split-KV partition of paged decode (``>= max_context_len``: no split).

    Reasoning: decode reads each KV byte once, so the only questions are whether the grid
    ``num_kv_heads x num_seqs x num_partitions`` keeps enough loads in flight on every
    SM, and what the split costs (a scratch write/read of ``Hq * D`` fp32 per partition
    and a combine launch). Aim for about ``DECODE_TARGET_WAVES`` programs per SM:
    ``num_partitions = round(target / (num_seqs * num_kv_heads))``, so a batch that
    already gives ~target programs (or more) is not split, and a small batch splits its
    longest context into partitions of at least ``DECODE_MIN_PARTITION`` tokens (rounded
    up to a multiple of it).
    Measurement (H200, 132 SMs, bf16, D=128, Hq 32; docs/bench-decode.md and
    docs/bench-decode-sweeps.md): ~512 programs (4 per SM) was the best grid in every
    split test. B=1 ctx 128k: 64 partitions 4109 GB/s, against 3612 with 32 and 3261
    with the DCU rule's 256 (P=64). B=8 ctx 8k: 8 partitions 3897 against 3417 with 4
    and 3751 with 16. Batches that already give ~512 programs run best unsplit: B=64
    ctx 4k with 8 KV heads 4480 GB/s against 4081 for the DCU rule's 8 partitions.
    Override: ``HYGON_ATTN_PARTITION_SIZE`` / ``PA_PARTITION_SIZE`` (checked first);
    ``rule="dcu"`` gives :func:`decode_partition_size_dcu`.
    The size returned here fixes the partition *count* of a launch (the grid), computed
    from the launch's context bound. With this rule (no override), each sequence then
    splits its own length over that count on the device (``kernels/combine.py:
    seq_partitions``, at least ``DECODE_MIN_PARTITION`` tokens each): a bound far above
    the actual lengths (a CUDA graph planned for the cache's capacity, a ragged batch)
    would otherwise leave most partitions empty and the grid under-filled.
    """
    env = decode_partition_size_env()
    if env is not None:
        return env
    if rule == "dcu":
        return decode_partition_size_dcu(group)
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


DECODE_TARGET_WAVES = 4     # programs per SM the split aims at


DECODE_FEW_ROWS = 4  # query rows a program serves up to which D=128 takes the short tile
DECODE_SHORT_TILE_MIN_PAGE = 16  # ... on pages of at least this many tokens (measured 16, 64)


def decode_tile_config(*, block_m: int, head_dim_pad: int, page_size: int,
                       kv_elem_size: int, rows: int | None = None,
                       tile=None) -> "tuple[int, int, int, bool]":
    """``(BLOCK_N, num_warps, num_stages, page_prefetch)`` of the paged decode kernel.

    Reasoning: the kernel is bandwidth-bound, so a KV tile pair (K and V, ``2 * BLOCK_N *
    D`` elements) of ~8-32 KB with two pipeline stages keeps enough bytes in flight per
    SM, while the fp32 accumulator ``[BLOCK_M, D]`` and the logits ``[BLOCK_M, BLOCK_N]``
    stay in registers. A tile that spans pages (``P < BLOCK_N``) needs one table lookup
    per token, whose latency would sit in front of the K/V loads: ``page_prefetch``
    reads the next tile's block ids one iteration ahead so it overlaps them instead.
    Large ``BLOCK_M * D`` (big groups, D=256) get 8 warps and a smaller BLOCK_N. fp8 KV
    uses the same tiles (not measured separately).
    Measurement (H200, bf16, D=128, G=4, KV-read GB/s, docs/bench-decode-sweeps.md
    sweep 3): BLOCK_N=64, 4 warps, 2 stages, block ids read ahead was the best or within
    1% of it at every point: B=64 ctx 4k 4376 (P=16) / 4498 (P=64), B=1 ctx 128k 4005 /
    4086; BLOCK_N 16, 32 or 128 lost 2-25%. Without the read-ahead the P=16 tile (four
    pages per tile, one table lookup per token) dropped to 2857 / 2647.
    Few rows at D=128 (``rows``, the query rows a program serves, at most 4: GQA groups up
    to 4 with one token) on pages of 16 tokens or more take half the tile with one stage
    more, BLOCK_N 32 with 3 stages: the same bytes in flight in two smaller loads, and
    100-102 registers instead of 128 (ptxas, Triton 3.6, sm_90), still 4 programs an SM, so
    the split rule's waves stay as they are. Measured (H200, bf16, page 16, graph replay
    with the L2 cleared, % of the copy, `notes-decode-v1-v14.md` v14), G=4 (32/8 heads): B=64 ctx
    4k 89.4-91.5 -> 92.3-94.2, B=64 ctx 16k 93.8-96.5 -> 97.1-99.2, B=256 ctx 2k 94.7-96.4
    -> 94.8-97.4, B=1 ctx 32k 61.4-62.1 -> 61.8-62.6, B=1 ctx 128k 89.6 -> 89.8, B=8 ctx 8k
    77.2 -> 77.1; G=1 (32/32): 97.0 / 97.7 / 100.7 -> 99.0 / 100.1-100.3 / 101.1-102.3 at
    the three large batches; G=2 (32/16): 94.7 / 98.1 / 98.2 -> 96.2 / 97.7-98.9 /
    97.7-98.5; page 64 level at large batch (97.5 / 99.3 against 98.2 / 99.1), better at B=1
    ctx 32k and B=8 ctx 8k (62.2 / 76.6 against 55.2 / 65.5). Not below 16-token pages: at
    page 1 (a block id per token) it lost 4-11 points (B=64 ctx 4k 83.9 against 91.3, B=256
    ctx 2k 82.8 against 93.5, B=1 ctx 32k 57.0 against 60.4, B=8 ctx 8k 66.8 against 74.8).
    Not at 8 rows: there it compiles to 96 registers, 5 programs an SM, and B=256 ctx 2k
    32/4 lost 6% (a fuller grid's last wave emptier); 4 stages lost 1-3% at small batch, 5
    stages 15-30%.
    Override: ``tile=(BLOCK_N, num_warps, num_stages, page_prefetch)`` (benchmarks pass
    it; any entry may be None), else ``HYGON_ATTN_DECODE_BLOCK_N``,
    ``HYGON_ATTN_DECODE_WARPS``, ``HYGON_ATTN_DECODE_STAGES``,
    ``HYGON_ATTN_DECODE_PREFETCH`` (0/1).
    """
    few_rows = (rows is not None and rows <= DECODE_FEW_ROWS and head_dim_pad == 128
                and page_size >= DECODE_SHORT_TILE_MIN_PAGE)
    chosen = [32 if few_rows else decode_block_n(head_dim_pad),
              8 if block_m * head_dim_pad >= 64 * 256 else 4,
              3 if few_rows else 2, True]
    for forced in (envs.decode_tile(), tile):
        for i, value in enumerate(forced or ()):
            if value is not None:
                chosen[i] = value
    block_n, num_warps, num_stages, prefetch = chosen
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"decode tile BLOCK_N must be a power of two >= 16, got {block_n}")
    return int(block_n), int(num_warps), int(num_stages), bool(prefetch)


def decode_block_n(head_dim_pad: int) -> int:
    """Default KV tile length of the decode kernel for a padded head_dim.

    Reasoning: a tile of ``BLOCK_N x D`` elements (~8K: 16 KB of K plus 16 KB of V in
    fp16/bf16) keeps about the same bytes in flight per program at every head_dim, so
    ``BLOCK_N = 8192 / D``: 128 at D=64, 64 at D=128, 32 at D=256. Below D=64 (not
    measured; the CPU tests' tiny dims) it stays 64.
    Measurement (H200, fp16, Hq/Hkv 16/4, page 16, graph replay with the L2 cleared,
    % of copy, docs/notes-decode-v1-v14.md v8): D=64 with BLOCK_N 128 / 64 / 32 (4 warps):
    B=64 ctx 4k 76.0 / 65.5 / 50.7; B=32 ctx 4k 61.4 / 56.1 / 44.8; B=8 ctx 16k 61.7 /
    55.9 / 45.1; B=1 ctx 32k 29.8 / 28.9 / 25.6; 8 warps at 128 lost 10-30%. D=128:
    BLOCK_N 64 was best (sweep 3 above).
    """
    if head_dim_pad < 64:
        return 64
    return max(16, min(128, 8192 // head_dim_pad))


def decode_fused_combine(*, num_partitions: int) -> bool:
    """Whether a split decode merges its partitions inside the decode kernel by default.

    Reasoning: with the combine as a second launch, every split step pays a kernel boundary
    (the decode grid drains, then the combine launches and ramps up: a few microseconds in
    a CUDA graph, plus a launch's host cost eagerly). Fused, the last program of each
    (sequence, head group) merges the group's rows right after its own partition, while
    other groups still stream KV: one launch. Its costs: one atomic per program on an int32
    counter (``DecodeWorkspace.counters``, reset by the merging program, so CUDA-graph
    replays need no memset); the merge's registers in the decode kernel; and the merge of
    one group runs in one program (a serial tail when a group has many partitions, where
    the second launch spreads it over every (sequence, row)).
    Measurement (H200, bf16, D=128, page 16, graph replay with the L2 cleared,
    docs/notes-decode-v1-v14.md v5/v6): with the lean merge (16 values per thread per step, one
    stage), fused against two launches: 4 partitions ((64, 4k) G=16) 85.4 against 91.5 us
    (+7%); 8 partitions ((8, 8k)) 87.6 against 84.7 us (-3%); 64 partitions ((1, 32k))
    78.6 against 54.5 us (one program merging 64 partitions serially is the tail). Hence:
    fused up to ``DECODE_FUSED_MAX_PARTITIONS`` partitions. ``fused_combine=`` (plan / op)
    or ``--partitions auto-fused|auto-launch`` (bench) force either form.
    """
    return 1 < num_partitions <= DECODE_FUSED_MAX_PARTITIONS


DECODE_FUSED_MAX_PARTITIONS = 4  # measured: a gain at 4 partitions, a loss from 8


@functools.lru_cache(maxsize=None)
def _cuda_major(index: int) -> int:
    import torch

    return torch.cuda.get_device_capability(index)[0]


def decode_combine_pdl(device) -> bool:
    """Whether a split decode launches its combine kernel as a programmatic dependent
    launch (PDL) of the decode kernel.

    Reasoning: between the decode grid and the combine grid the GPU drains the first, then
    launches and ramps up the second: microseconds that matter at batch 1, where the whole
    decode is 25-50 us (docs/notes-decode.md: the combine launch is 5-8 us of 24-52 us). With
    PDL (CUDA ``cudaLaunchAttributeProgrammaticStreamSerialization``, sm_90+), the decode
    programs let the combine grid be scheduled as soon as all of them have started, and
    the combine programs wait (``griddepcontrol.wait``) until the decode grid's writes are
    visible, so the launch overlaps the decode's tail. CUDA graphs keep the dependency as
    a programmatic edge. Needs an NVIDIA GPU of compute capability 9.0 or newer and a
    Triton with ``launch_pdl``; never on HIP or under the interpreter.
    Measurement (H200, bf16/fp16, page 16, graph replay with the L2 cleared, two runs
    each way alternated, session 5 in docs/notes-decode-v1-v14.md v10): with PDL against without,
    D=128 32/8 heads: (1, 8k) 23.7 against 24.8-25.0 us, (1, 32k) 50.8-50.9 against
    51.1-51.2, (1, 128k) 142.3-142.7 against 143.1, (8, 8k) 82.3-82.5 against 82.7-82.8;
    D=64 16/4 heads: (1, 32k) 22.9-23.1 against 23.7-23.8, (8, 16k) equal (51.2-51.3):
    never slower, 1-5% faster where the combine is a large share. Hence on wherever it
    runs; ``HYGON_ATTN_DECODE_PDL=0`` turns it off.
    """
    forced = envs.decode_pdl()
    if forced is False or getattr(device, "type", None) != "cuda" or gpu_is_hip():
        return False
    import torch

    from hygon_attn_backend.ops._dispatch import triton_interpreter_on

    if triton_interpreter_on():
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_major(index) >= 9


def decode_combine_chunk(*, rows_pad: int, head_dim_pad: int, num_warps: int,
                         fused: bool = True) -> int:
    """Partitions the merge reads per step, a ``[chunk, rows_pad, head_dim_pad]`` fp32 tile.

    Fused into the decode kernel: at most 16 values per thread (plus a 64-bit address
    each: ~48 registers) and 16 partitions, so the merge does not cost the KV loop its
    occupancy. The combine kernel alone (``fused=False``) has registers to spare and is
    latency-bound (one program per (sequence, query row), each step a dependent load):
    64 values per thread and 64 partitions per step, so a 64-partition split merges in one
    step. Measured (H200, combine kernel alone, L2 cleared, median of 3 x 300 ms,
    session 4 in ``notes-decode.md``): chunk 64 / 4 warps against the former 16 / 4 warps:
    (1, 32k) D=128, 64 partitions 7.41 against 9.73 us; (1, 128k) 7.38 against 9.73; (8, 8k)
    8.20 against 11.17; (1, 32k) D=64, 128 partitions 10.92 against 11.47 (8 warps: 9.68).
    Fused with 8 or more rows the chunk is 1: with Triton 3.6 for sm_90 (bf16, D=128, 4
    warps, ``scripts/decode_ptxas.py``) rows 8 x chunk 2 compiled to 144 registers against
    110 with chunk 1 (rows 16 x chunk 1: 128), i.e. 3 programs an SM instead of 4, so the
    split grid of (64, 4k) 32/4 heads (512 programs) ran in two waves: 66% of the copy
    against 88% for 64/4 heads, the same bytes (H200, page 16, 2026-12-01).
    """
    if fused and rows_pad >= 8:
        return 1
    per_thread, cap = (16, 16) if fused else (64, 64)
    budget = per_thread * 32 * max(1, num_warps)
    return max(1, min(cap, budget // max(1, rows_pad * head_dim_pad)))


# ----------------------------------------------------------------------------- prefix prefill


def prefill_two_walks(*, head_dim_pad: int, page_size: int, block_n: int,
                      num_warps: int) -> bool:
    """Whether the prefill kernel compiles its unmasked walk over cache pages twice
    (``TWO_WALKS``): once with no per-key check, taken when the program's check of its
    table row finds every block id present, and once with the check.

    Reasoning: where a key tile spans pages (``page_size < BLOCK_N``) the per-key check
    (a ``[BLOCK_N]`` mask in the loads' layout converted to the logits' layout every tile)
    cost ~20% of the kernel at page 16 even behind a scalar branch on the row check:
    (1, 0, 8192) page 16 read 342 TFLOP/s against 406 at page 64 (H200, 2026-12-01,
    notes-prefill.md v5). The second walk costs no shared memory (Triton 3.6 reuses
    the stage buffers across the branches: 131,584 B either way at 256x64/16w/3s, D=128,
    ``scripts/prefill_ptxas.py --two-walks``) but makes ptxas serialize the wgmma (C7515,
    two pipelined loops), so it is taken only where the tile is serialized already: the
    16-warp tile at head_dim 128 (C7512, registers). At head_dim 64 and on 8-/4-warp tiles
    one walk compiles with asynchronous wgmma and stays.
    Measurement (H200, bf16, 32/8 heads, page 16, two walks against one in one run,
    notes-prefill.md v6): keys from the cache +17-24% on the five issue-4 shapes ((1, 0,
    8192) 342 -> 415 TFLOP/s, 52% of the matmul, level with page 64), dense new keys
    +16-22% where there is a cache prefix, -3% at (1, 0, 8192) dense (no cache walk).
    Override: ``HYGON_ATTN_PREFILL_TWO_WALKS=0|1``.
    """
    forced = envs.prefill_two_walks()
    if forced is not None:
        return forced
    return head_dim_pad == 128 and num_warps == 16 and page_size % block_n != 0


def prefill_tile_config(*, head_dim_pad: int, group: int, total_q: int, num_kv_heads: int,
                        num_seqs: int = 1, num_sms: int = 132, interpreter: bool = False,
                        is_hip: "bool | None" = None) -> "tuple[int, int, int, int]":
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of the prefix-prefill kernel.

    Reasoning: prefill is matrix-bound (each K/V tile feeds ``BLOCK_M`` rows), so the M tile
    should be as tall as the registers allow, with the GQA group packed in. For ``D <= 128``
    the best measured tile is 256 rows x 64 keys with 16 warps (four warpgroups of 64 rows:
    the same registers per thread as 128 rows on 8 warps, but each K/V tile in shared
    memory feeds twice the rows, and four warpgroups let one's softmax overlap another's
    MMA) and 3 stages (Q 64 KB + K/V ring 96 KB). 256 x 128 on 16 warps spills (8x slower).
    When that gives fewer programs than SMs (small batches of short extends), fall back to
    128 x 128 on 8 warps, then 64 x 64 on 4 warps. ``D = 256`` doubles the accumulator and
    the K/V tiles: 64 x 64, 4 warps, 2 stages (correct on the H200, not tuned). ``BLOCK_M``
    is never below the group (each row a (token, head) pair; odd groups leave
    ``BLOCK_M % G`` rows idle). Under the CPU interpreter tiny tiles keep tests fast.
    Measurement (H200, bf16, Hq/Hkv=32/8, D=128, page 16 and 64, docs/bench-prefill.md):
    256x64/16w/3s was the fastest of eight tiles on all five issue-4 shapes: +5-22% over
    128x128/8w/3s and +11-19% over 64x64/4w/3s at (B=32, prefix 1024, extend 128) in the
    same run; +16-45% over the first version's 128x64/8w/3s. Re-measured once the 8-warp
    tiles compiled with asynchronous wgmma (2026-12-01, notes-prefill.md v5): still the
    fastest at all 20 points (5 shapes x page 16/64 x keys from the cache / dense).
    On HIP (``is_hip``; None: ``gpu_is_hip()``) the tiles of :func:`prefill_tile_config_hip`.
    Override: ``HYGON_ATTN_PREFILL_TILE="BLOCK_M,BLOCK_N,num_warps,num_stages"``.
    """
    group_pow2 = 1 << max(0, (group - 1).bit_length())
    env = envs.prefill_tile()
    if env is not None:
        block_m, block_n, num_warps, num_stages = env
        if block_m < group:
            raise ValueError(f"HYGON_ATTN_PREFILL_TILE: BLOCK_M={block_m} is smaller than "
                             f"the GQA group {group}")
        return block_m, block_n, num_warps, num_stages
    if interpreter:
        return max(16, group_pow2), 16, 4, 1

    def programs(block_m):  # a bound: each request adds at most one partial tile
        return (-(-total_q * group // block_m) + max(0, num_seqs - 1)) * num_kv_heads

    if gpu_is_hip() if is_hip is None else is_hip:
        return prefill_tile_config_hip(head_dim_pad=head_dim_pad, group_pow2=group_pow2,
                                       fills_sms=programs(128) >= num_sms)
    if head_dim_pad > 128:
        return max(64, group_pow2), 64, 4, 2

    if programs(256) >= num_sms or group_pow2 > 128:
        return max(256, group_pow2), 64, 16, 3
    if programs(128) >= num_sms or group_pow2 > 64:
        return max(128, group_pow2), 128, 8, 3
    return max(64, group_pow2), 64, 4, 3


HIP_LDS_BYTES = 64 * 1024  # shared memory (LDS) a workgroup may use on gfx9 (AMD, Hygon)


def prefill_tile_config_hip(*, head_dim_pad: int, group_pow2: int, fills_sms: bool
                            ) -> "tuple[int, int, int, int]":
    """The prefix-prefill tile on AMD/Hygon GPUs (HIP; wave 64, 64 KB of LDS a workgroup).

    Reasoning: the NVIDIA tiles do not fit there. Compiled offline for gfx90a and gfx942
    with Triton 3.6 and 3.9 (docs/notes-prefill.md, 2026-12-01), 256 x 64 / 16 warps / 3
    stages takes the whole 64 KB and spills ~420 bytes a lane (16 waves leave 128 VGPRs
    each), 128 x 128 / 8 / 3 needs 96 KB and D=256's 64 x 64 / 4 / 2 needs 72 KB: Triton
    refuses to launch both (OutOfResources). So, as on NVIDIA the tallest M tile the
    resources allow, here without a spill: D <= 128: 128 x 64 on 8 warps, 2 stages (48 KB,
    ~220 VGPRs) when its programs fill the GPU or the group needs 128 rows, else 64 x 64 on
    4 warps (40 KB); a group over 128 heads 256 x 16 on 16 warps (64 KB, ~116 VGPRs).
    D = 256: 64 x 32 on 4 warps, 2 stages (36 KB), 128 x 16 on 8 warps for groups of 65-128
    (64 KB). No spill on either target.
    Not timed on AMD/Hygon hardware (none here): these are the tiles that fit, and the
    largest of those; ``HYGON_ATTN_PREFILL_TILE`` overrides them.
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
