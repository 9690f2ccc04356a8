"""Device facts the ops' plans and heuristics read: multiprocessor count, vendor, compute
capability. Each is read once per device and cached (no per-step driver query)."""

from __future__ import annotations

import functools

import torch


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_index(device: torch.device) -> int:
    """The CUDA index of ``device`` (the current device where it names none)."""
    return device.index if device.index is not None else torch.cuda.current_device()


def num_sms_of(device: torch.device) -> int:
    """Multiprocessor count of ``device`` (132 for the CPU interpreter, an H200's)."""
    if device.type != "cuda":
        return 132
    return _num_sms(device_index(device))


@functools.lru_cache(maxsize=None)
def cuda_major(index: int) -> int:
    """Compute capability major of CUDA device ``index``."""
    return torch.cuda.get_device_capability(index)[0]


@functools.lru_cache(maxsize=None)
def cuda_capability(index: int) -> "tuple[int, int]":
    """Compute capability ``(major, minor)`` of CUDA device ``index``."""
    return tuple(torch.cuda.get_device_capability(index))


def gpu_is_hip() -> bool:
    """True on ROCm/DTK torch (AMD and Hygon GPUs)."""
    return bool(getattr(torch.version, "hip", None))


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


#: the narrowest head tile the prefill-structure Triton kernels give a GPU (:func:`head_tile`)
GPU_MIN_HEAD_TILE = 64


def head_tile(width: int, *, device: torch.device) -> int:
    """The padded width (a power of two) a prefill-structure Triton kernel gives a head
    dimension of ``width`` columns that is an accumulator's column count (the value head
    of ``kernels/mla_prefill.py``, the head of ``kernels/prefill.py``): at least 16 (the
    matrix unit's K), and at least :data:`GPU_MIN_HEAD_TILE` on a GPU. The padded columns
    are masked on load and store.

    Reasoning: on an H100 (Triton 3.6) the ragged kernel with a 32-wide value head gave
    wrong rows at every 64-row tile with 32 or more keys (64x64 on 4 or 8 warps, 1-3
    stages; 64x32), whatever the query/key width, and one such launch faulted on an
    illegal address; the same batches with the value head padded to 64 were right. A
    32-wide head costs two times its value product; such heads are rare (small models).
    Under the CPU interpreter the real width stays, so the CPU tests run the narrow masks.
    The prefix prefill's tile has the same shape (64+ rows, the head as the second
    product's N); its 32-wide head takes the rule by that likeness (not measured there).
    Measurement (H100, fp16, 4 heads, 51 / 300 tokens, causal, 2026-12-07): (q/k, v) =
    (96, 32), (128, 32), (80, 32), (64, 32), (192, 32) unpadded: max error 0.7-2.3 against
    the fp64 reference; padded to 64: 6.6e-4-9.7e-4; (96, 32) at 32x32, 64x16 and 16x16
    tiles: right unpadded.
    """
    tile = max(16, next_pow2(width))
    return tile if device.type == "cpu" else max(tile, GPU_MIN_HEAD_TILE)


def sm90_unsupported(device: torch.device, what: str) -> "str | None":
    """None when ``device`` is an NVIDIA sm_90 GPU (H100/H200: the native wgmma kernels
    are written for sm_90a), else the reason ``what`` cannot run there."""
    if device.type != "cuda":
        return f"device {device} ({what} runs on NVIDIA sm_90 GPUs)"
    if gpu_is_hip():
        return f"a HIP GPU ({what} is an sm_90 wgmma kernel; HIP runs Triton)"
    cap = cuda_capability(device_index(device))
    if cap != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]} ({what} needs sm_90: H100/H200)"
    return None
