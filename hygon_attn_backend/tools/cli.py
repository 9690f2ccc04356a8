"""``hygon-attn`` command line: doctor, demo, bench.

    hygon-attn doctor          versions, device, runnable implementations, engine entry points
    hygon-attn demo            the end-to-end job (vLLM generation with --attention-backend
                               hygon beside vLLM's default backend) when vLLM is installed;
                               otherwise, or with --ops, the ops on a built-in problem
                               checked against the reference
    hygon-attn build-native    build the native CUDA/HIP kernels now (GPU torch)
    hygon-attn bench decode    decode benchmark (GPU)
    hygon-attn bench prefill   prefix-prefill benchmark (GPU)
    hygon-attn bench mla       MLA (latent) decode benchmark (GPU)
    hygon-attn bench mla-prefill  MLA's ragged 192/128 prefill benchmark (GPU)
    hygon-attn bench cache     write_kv / copy_blocks bandwidth (GPU)
    hygon-attn bench overhead  host microseconds per attention call (GPU)
    hygon-attn bench verify    speculative verify vs plain decode, a copy, SGLang (GPU)
    hygon-attn bench step      a vLLM step's attention: builder + layers, eager against
                               graph-replayed (GPU)
    hygon-attn bench engine    SGLang engine step times and greedy tokens, hygon beside
                               SGLang's triton backend (GPU + SGLang)
    hygon-attn simulate        KV memory and prefix reuse of a request trace through the
                               engines' own memory managers (CPU, no model)
    hygon-attn fuzz --op OP    seeded random problems against the reference
    hygon-attn --version       the installed version

A bad argument is one line naming it (exit 2); a missing package is one line naming it
and its install command.

Heavy modules (torch kernels, engines) are imported inside the subcommands only. Nothing
of the engine path imports ``tools/``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

from hygon_attn_backend.tools import doctor, needs


def cmd_build_native(args) -> int:
    """``hygon-attn build-native``: build (or rebuild) the extension now."""
    from hygon_attn_backend import native

    try:
        native.load(verbose=bool(getattr(args, "verbose", False)))
    except native.NativeUnavailable as exc:
        print(str(exc), file=sys.stderr)
        return 1
    print(f"native kernels built and loaded: {native.build_dir()}")
    return 0


def _interpreter_ok(command: str) -> bool:
    """False (after one line on stderr) where the kernels would need Triton's CPU
    interpreter and it cannot run here."""
    import torch

    if torch.cuda.is_available():
        return True
    problem = needs.interpreter_problem(command)
    if problem:
        print(problem, file=sys.stderr)
    return problem is None


def cmd_demo(args) -> int:
    engine_run = not args.ops and importlib.util.find_spec("vllm") is not None
    interpreted = not engine_run or (args.impl or "triton") == "triton"
    if interpreted and not _interpreter_ok("hygon-attn demo"):
        return 2
    if engine_run:
        from hygon_attn_backend.tools.demo import engine

        return int(engine.run_demo(impl=args.impl) or 0)
    from hygon_attn_backend.tools.demo import ops

    return ops.run(seed=args.seed)


def package_version() -> str:
    """The installed distribution's version, else the source tree's."""
    import importlib.metadata as md

    try:
        return md.version("hygon-attn-backend")
    except md.PackageNotFoundError:
        from hygon_attn_backend import __version__

        return __version__


class _Parser(argparse.ArgumentParser):
    """A bad argument is one line on stderr naming it, and exit 2 (argparse's own
    ``error`` prints the whole usage block before it)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hygon-attn", description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="version",
                        version=f"hygon-attn {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="versions, device, implementations, entry points")
    p.set_defaults(func=lambda a: doctor.cmd_doctor(a))
    p = sub.add_parser("demo", help="run the main job on a built-in problem")
    p.add_argument("--ops", action="store_true",
                   help="check the ops against the reference instead of the engine run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--impl", choices=["auto", "triton", "native", "reference"], default=None,
                   help="engine run: our Triton kernels (default; the interpreter on a CPU), "
                        "or the torch reference")
    p.set_defaults(func=cmd_demo)
    p = sub.add_parser("build-native", help="build the native CUDA/HIP kernels now (GPU torch)")
    p.add_argument("--verbose", action="store_true", help="show the compiler commands")
    p.set_defaults(func=cmd_build_native)
    p = sub.add_parser("bench", help="benchmarks beside the peers (GPU)")
    bench_sub = p.add_subparsers(dest="bench", required=True)
    for name in ("decode", "prefill", "mla", "mla_prefill", "cache", "overhead", "step",
                 "engine", "verify"):
        try:
            module = importlib.import_module(f"hygon_attn_backend.tools.bench.{name}")
        except ImportError as exc:
            q = bench_sub.add_parser(name, help=f"unavailable: {exc}")
            q.set_defaults(func=lambda a, exc=exc: sys.exit(f"bench unavailable: {exc}"))
            continue
        getattr(module, f"add_{name}_parser")(bench_sub)  # sets its own func
    p = sub.add_parser("sglang-serve", add_help=False,
                       help="SGLang's HTTP server with hygon registered first (every "
                            "argument is SGLang's: --model-path M --attention-backend hygon "
                            "...; needed on SGLang 0.5.10)")
    p.add_argument("sglang_args", nargs=argparse.REMAINDER)  # main() takes them first
    from hygon_attn_backend.tools.simulate.cli import add_simulate_parser
    add_simulate_parser(sub)
    from hygon_attn_backend.tools.fuzz import add_fuzz_parser
    add_fuzz_parser(sub)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sglang-serve"]:  # every later argument is SGLang's, --help included
        from hygon_attn_backend.integrations.sglang import serve

        return serve.main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)

