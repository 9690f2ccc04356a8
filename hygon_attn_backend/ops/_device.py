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
