"""The cache ops' named heuristics: which implementation ``impl="auto"`` runs, and the
Triton programs' sizes. Both ops are pure data movement."""

from __future__ import annotations

from hygon_attn_backend.ops._device import next_pow2


def native_preferred(*, is_hip: bool) -> bool:
    """Whether ``impl="auto"`` runs the native ``write_kv`` / ``copy_blocks``.

    Reasoning: on AMD/Hygon GPUs (HIP) the native kernels are the DCU design (wave 64),
    where Triton is not tuned; on NVIDIA the Triton kernels move the same bytes and no
    measurement has put native ahead. Measurement: none on HIP hardware (none here).
    """
    return is_hip


def write_config(num_kv_heads: int, head_dim: int) -> tuple[int, int]:
    """``(BLOCK_H, num_warps)`` for ``write_kv``: one program per (token, BLOCK_H heads).

    Reasoning: writing the cache moves ``2 * H * D`` elements a token. A program should
    move ~1K elements (every thread a few 16-byte vectors) yet leave many programs for small
    decode batches: BLOCK_H makes ``[BLOCK_H, next_pow2(D)]`` about 1024 elements (capped
    by the head count), 1 warp per 256 elements (1..4).
    Measurement: the bandwidth-bound default; docs/benchmarks.md has its cache-op timings.
    """
    block_d = next_pow2(head_dim)
    block_h = min(max(1, 1024 // block_d), next_pow2(num_kv_heads))
    num_warps = min(4, max(1, (block_h * block_d) // 256))
    return block_h, num_warps


def copy_blocks_config(numel_per_block: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)`` for ``copy_blocks``: one program copies BLOCK elements of one
    (src, dst) block pair.

    Reasoning: a block is ``H * P * D`` elements (16K for 8 heads x 16 slots x 128):
    4096-element chunks on 8 warps give each thread 4 x 4 elements and a few programs a
    pair; tiny blocks (P = 1) take one chunk of the next power of two.
    Measurement: the bandwidth-bound default; docs/benchmarks.md has its cache-op timings.
    """
    block = min(4096, next_pow2(numel_per_block))
    num_warps = min(8, max(1, block // 512))
    return block, num_warps
