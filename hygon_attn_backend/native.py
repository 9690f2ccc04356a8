"""Build and load the native kernels of ``csrc/`` (``torch.ops.hygon_attn.*``).

The extension is compiled on first use on a machine with CUDA or ROCm torch, with
torch's own extension builder (ninja), and cached per torch version, GPU runtime and GPU
arch under ``$TORCH_EXTENSIONS_DIR/hygon_attn`` (default ``~/.cache/hygon_attn``).
``hygon-attn build-native`` builds it ahead of time; ``pip install`` never compiles it.
When it cannot be built (CPU torch, no GPU, no compiler) :func:`load` raises
:class:`NativeUnavailable` saying what is missing and how to fix it; the Triton kernels
serve every op in the meantime.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Optional

from hygon_attn_backend import envs

OPS = ("write_kv", "copy_blocks", "paged_decode", "prefix_prefill", "ragged_prefill", "mla_decode",
       "warp_size", "decode_programs_per_sm")
_EXT_NAME = "hygon_attn_native"
_SOURCES = ("cache_kernels.cu", "decode.cu", "decode_d64.cu", "decode_d128.cu", "decode_d256.cu",
            "prefill_sm90.cu", "mla_decode_sm90.cu", "binding.cpp")
_loaded: Optional[bool] = None
_error: Optional[str] = None


class NativeUnavailable(RuntimeError):
    """The native extension cannot be built or loaded here (the message says why)."""


def csrc_dir() -> Optional[Path]:
    """The kernel sources: ``$HYGON_ATTN_CSRC``, else ``csrc/`` beside the package (a source
    checkout or editable install), else the copy a wheel ships as ``hygon_attn_backend/_csrc``."""
    env = envs.csrc_dir()
    candidates = [Path(env)] if env else []
    here = Path(__file__).resolve().parent
    candidates += [here.parent / "csrc", here / "_csrc"]
    for path in candidates:
        if all((path / name).is_file() for name in _SOURCES):
            return path
    return None


def _torch_runtime():
    """``(kind, version)`` of torch's GPU runtime: ``("cuda", "13.0")``, ``("hip", ...)``,
    or ``(None, None)`` for a CPU build."""
    import torch

    if getattr(torch.version, "hip", None):
        return "hip", torch.version.hip
    if torch.version.cuda:
        return "cuda", torch.version.cuda
    return None, None


def gpu_arch() -> str:
    """Arch of the current GPU: ``sm_90`` on an H200, the gfx name on AMD/Hygon."""
    import torch

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    name = getattr(props, "gcnArchName", "") or ""
    if name:
        return name.split(":")[0]
    return f"sm_{props.major}{props.minor}"


def cuda_arch_flags() -> list:
    """nvcc arch flags of the build: on sm_90 (H100/H200) ``sm_90a``, the arch-specific
    target whose wgmma the native prefill needs (``csrc/sm90.cuh``); elsewhere none (torch
    picks the visible GPU's arch). Given flags replace torch's own choice entirely."""
    kind, _ = _torch_runtime()
    if kind == "cuda" and gpu_arch() == "sm_90":
        return ["-gencode=arch=compute_90a,code=sm_90a"]
    return []


def build_dir() -> Path:
    """Cache folder for this torch version, runtime and GPU arch."""
    import torch

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    base = Path(root) / "hygon_attn" if root else Path.home() / ".cache" / "hygon_attn"
    kind, version = _torch_runtime()
    return base / f"torch{torch.__version__}-{kind}{version}-{gpu_arch()}"


def _why_unbuildable() -> Optional[str]:
    import torch

    kind, _ = _torch_runtime()
    if kind is None:
        return (f"torch {torch.__version__} is a CPU build: the native kernels need CUDA or "
                "ROCm torch (install torch for your GPU)")
    if not torch.cuda.is_available():
        return "no GPU is visible to torch (torch.cuda.is_available() is False)"
    if csrc_dir() is None:
        return ("the kernel sources (csrc/, or hygon_attn_backend/_csrc in a wheel) are not "
                "found: reinstall the package, use a source checkout (pip install -e .) or set "
                "HYGON_ATTN_CSRC to its csrc/ folder")
    return None


def _ops_registered() -> bool:
    import torch

    try:
        ns = torch.ops.hygon_attn
        return all(hasattr(ns, op) for op in OPS)
    except (AttributeError, RuntimeError):
        return False


def load(*, verbose: bool = False):
    """Build (first time) and load the extension; returns ``torch.ops.hygon_attn``.

    Raises :class:`NativeUnavailable` with the reason and the fix when it cannot.
    """
    global _loaded, _error
    import torch

    if _loaded:
        return torch.ops.hygon_attn
    if _error is not None:
        raise NativeUnavailable(_error)
    reason = _why_unbuildable()
    if reason is None:
        try:
            _build_and_load(verbose=verbose)
        except Exception as exc:  # the compiler's message, with what to do about it
            reason = (f"building the native kernels failed: {type(exc).__name__}: "
                      f"{str(exc).strip()[-2000:]}\nNeeds nvcc (CUDA) or hipcc (ROCm) matching "
                      "torch, and ninja (pip install ninja)")
    if reason is not None:
        _error = (f"native kernels unavailable: {reason}. The Triton kernels still serve every "
                  "op (impl='auto' or 'triton').")
        raise NativeUnavailable(_error)
    _loaded = True
    return torch.ops.hygon_attn


def _build_and_load(*, verbose: bool) -> None:
    from torch.utils import cpp_extension

    src = csrc_dir()
    out = build_dir()
    out.mkdir(parents=True, exist_ok=True)
    prebuilt = out / f"{_EXT_NAME}.so"
    if not prebuilt.exists():
        print(f"hygon-attn: building the native kernels for {gpu_arch()} into {out} "
              "(first use only; a few minutes)...", file=sys.stderr, flush=True)
    flags = ["-O3"]  # torch adds its own -std
    cpp_extension.load(
        name=_EXT_NAME,
        sources=[str(src / name) for name in _SOURCES],
        extra_include_paths=[str(src)],
        extra_cflags=flags,
        extra_cuda_cflags=flags + cuda_arch_flags(),
        build_directory=str(out),
        is_python_module=False,
        verbose=verbose,
    )
    if not _ops_registered():
        raise RuntimeError(f"the library loaded but torch.ops.hygon_attn lacks some of {OPS}")


def available() -> bool:
    """True when the extension is loaded or can be built and loaded now (builds it)."""
    try:
        load()
    except NativeUnavailable:
        return False
    return True


def status() -> str:
    """One line for ``hygon-attn doctor``: built / not built / why (never builds)."""
    if _loaded:
        return "yes (loaded)"
    reason = _why_unbuildable()
    if reason is not None:
        return f"no ({reason}; Triton serves every op)"
    lib = build_dir() / f"{_EXT_NAME}.so"
    if lib.exists():
        return f"built ({lib}); loads on first use"
    return "not built yet: builds on first use, or now with `hygon-attn build-native`"
