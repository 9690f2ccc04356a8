"""Which implementation an op runs: Triton on a GPU, Triton's interpreter on CPU when
``TRITON_INTERPRET=1``, the native CUDA/HIP kernels of ``csrc/``, or the plain-torch
reference (the CPU fallback the engine integrations use on machines without a GPU).

Every public op takes ``impl="auto" | "triton" | "native" | "reference"``. ``auto`` picks
native where ``tuning.native_preferred`` says it is measured faster (and it builds), else
Triton where it can run, else the reference; an explicit ``triton`` or ``native`` that
cannot run is an error, never a silent fallback.
"""

from __future__ import annotations

import os

import torch

from hygon_attn_backend import envs

IMPLS = envs.IMPLS


def triton_interpreter_on() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``).
    Must be set before the kernels are imported: ``@triton.jit`` reads it then."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def triton_runs_on(device: torch.device) -> bool:
    if device.type == "cuda":
        return True
    return device.type == "cpu" and triton_interpreter_on()


def select_impl(impl: str, device: torch.device, *, native_preferred: "bool | None" = None,
                native_unsupported: "str | None" = None) -> str:
    """Resolve ``impl`` to ``"triton"``, ``"native"`` or ``"reference"`` for tensors on
    ``device``.

    native_preferred: the op's ``tuning.native_preferred`` rule for this call; ``None``
       for ops without a native kernel (prefix prefill), where ``impl="native"`` runs
       Triton (the engine integrations pass one ``HYGON_ATTN_IMPL`` to every op).
    native_unsupported: why the native kernel does not cover this call, if it does not.
    """
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

