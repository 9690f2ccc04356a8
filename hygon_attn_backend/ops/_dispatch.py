"""Which implementation an op runs: Triton on a GPU, Triton's interpreter on CPU when
``TRITON_INTERPRET=1``, the native CUDA/HIP kernels of ``csrc/``, or the plain-torch
reference (the CPU fallback the engine integrations use on machines without a GPU).

Every public op takes ``impl="auto" | "triton" | "native" | "reference"``. ``auto`` picks
native where ``tuning.native_preferred`` says it is measured faster (and it builds), else
Triton where it can run, else the reference; an explicit ``triton`` or ``native`` that
cannot run is an error, never a silent fallback (the one exception, with a warning: bf16
queries where Triton's CPU interpreter computes bf16 wrong run the reference,
``_interpreter.py``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from hygon_attn_backend import envs
from hygon_attn_backend.ops._interpreter import triton_computes, triton_interpreter_on

IMPLS = envs.IMPLS
__all__ = ["IMPLS", "native_coverage", "select_impl", "triton_interpreter_on",
           "triton_runs_on"]


def triton_runs_on(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return device.type == "cpu" and triton_interpreter_on()


def select_impl(impl: str, device: torch.device, *, native_preferred: "bool | None" = None,
                native_unsupported: "str | None" = None,
                q_dtype: Optional[torch.dtype] = None) -> str:
    """Resolve ``impl`` to ``"triton"``, ``"native"`` or ``"reference"`` for tensors on
    ``device``.

    native_preferred: the op's ``tuning.native_preferred`` rule for this call; ``None``
       for ops without a native kernel (prefix prefill), where ``impl="native"`` runs
       Triton (the engine integrations pass one ``HYGON_ATTN_IMPL`` to every op).
    native_unsupported: why the native kernel does not cover this call, if it does not.
    q_dtype: an attention op's query dtype, if known: Triton in the CPU interpreter where
       it computes that dtype wrong (``_interpreter.triton_computes``: bf16 with some numpy
       / Triton pairs) runs the reference instead, ``"auto"`` or ``"triton"`` alike, with
       one warning (the engines pass one ``HYGON_ATTN_IMPL=triton`` on CPU).
    """
    chosen = _select(impl, device, native_preferred, native_unsupported)
    if chosen == "triton" and q_dtype is not None and not triton_computes(q_dtype):
        return "reference"
    return chosen


def native_coverage(impl: str, device: torch.device, device_unsupported: Callable,
                    shape_unsupported: Callable) -> "tuple[str, str | None]":
    """``(impl, why)`` for :func:`select_impl`'s ``native_unsupported``: on a CUDA device
    with ``impl`` ``"native"`` or ``"auto"``, why the op's native kernel does not cover the
    batch, the device's reason (``device_unsupported(device)``) before the shapes'
    (``shape_unsupported()``); ``impl="native"`` on a GPU without the kernel becomes
    ``"triton"`` (the engines pass one ``HYGON_ATTN_IMPL`` to every op). Elsewhere
    ``(impl, None)``."""
    if impl not in ("native", "auto") or device.type != "cuda":
        return impl, None
    why = device_unsupported(device)
    if why is not None:
        return ("triton" if impl == "native" else impl), why
    return impl, shape_unsupported()


def _select(impl, device, native_preferred, native_unsupported) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "native" and native_preferred is None:
        impl = "triton"
    if impl == "native":
        if device.type != "cuda":
            raise ValueError(f"impl='native' needs CUDA/HIP tensors, got device {device}")
        if native_unsupported:
            raise ValueError(f"impl='native' does not cover this call: {native_unsupported}")
        from hygon_attn_backend import native

        native.load()  # NativeUnavailable (a RuntimeError) says what is missing
        return "native"
    if impl == "auto":
        if device.type == "cuda" and native_preferred and not native_unsupported:
            from hygon_attn_backend import native

            if native.available():
                return "native"
        return "triton" if triton_runs_on(device) else "reference"
    if impl == "triton" and not triton_runs_on(device):
        raise ValueError(f"impl='triton' cannot run on device {device}: Triton needs a GPU, "
                         "or TRITON_INTERPRET=1 set before import for CPU tensors")
    return impl

