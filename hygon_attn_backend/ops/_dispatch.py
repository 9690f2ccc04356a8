"""Which implementation an op runs: Triton on a GPU, Triton's interpreter on CPU when
``TRITON_INTERPRET=1``, or the plain-torch reference (the CPU fallback the engine
integrations use on machines without a GPU).

Every public op takes ``impl="auto" | "triton" | "reference"``. ``auto`` picks Triton
where it can run and the reference elsewhere; an explicit ``triton`` on a device where
Triton cannot run is an error, never a silent fallback.
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


def select_impl(impl: str, device: torch.device) -> str:
    """Resolve ``impl`` to ``"triton"`` or ``"reference"`` for tensors on ``device``."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":
        return "triton" if triton_runs_on(device) else "reference"
    if impl == "triton" and not triton_runs_on(device):
        raise ValueError(f"impl='triton' cannot run on device {device}: Triton needs a GPU, "
                         "or TRITON_INTERPRET=1 set before import for CPU tensors")
    return impl


IMPL_ENV = "HYGON_ATTN_IMPL"


def impl_from_env() -> str:
    """The implementation the engine integrations ask the ops for: ``HYGON_ATTN_IMPL`` =
    ``auto`` (default) | ``triton`` | ``reference``."""
    return envs.impl()
