"""Seeded, reproducible fuzzer of the public ops against ``reference.py``.

    hygon-attn fuzz --op decode|prefill|mla|mla_prefill|write_kv|copy_blocks --cases N --seed S
                    [--device cuda|cpu] [--case K] [--shard I/N] [--skip M]

Case ``K`` of seed ``S`` is a pure function of ``(op, S, K, device kind)``: its host
choices come from ``random.Random(f"{op}:{S}:{K}")`` and torch's generator is seeded from
it. Everything a kernel specialises on (dtypes, head_dim, page size, heads, layout,
flags, tile, the class of every stride) comes from profile ``K % NUM_PROFILES``, drawn
once per seed, and a case draws only the batch, so a run compiles a bounded number of
kernel specialisations (``fuzz/speckeys.py`` counts them on a CPU). A failing case prints
the line that reruns it alone.

On a CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set here before
the kernels are imported): tiny shapes and fp16 only (the interpreter's bf16 ``tl.dot``
is broken). ``--shard I/N`` runs the cases with ``K % N == I`` (parallel processes on
one GPU; ``N`` should divide ``NUM_PROFILES`` so each shard compiles its own profiles).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
import traceback

from hygon_attn_backend.tools.argtypes import count

OPS = ("decode", "prefill", "mla", "mla_prefill", "write_kv", "copy_blocks")
IMPL_OPS = ("prefill", "decode", "mla", "mla_prefill")  # the ops whose cases take --impl
# profiles per seed: each value of every stratified set (12 layouts, 12 page sizes, 12
# groups, 6 head_dims, ...) appears in at least NUM // len(set) of them; each profile costs
# its kernels' compiles (decode <= 3: one-partition, split, combine; prefill 1), so a run
# compiles <= 96 decode and 32 prefill kernels, 12 and 4 per shard of 8 (fuzz/speckeys.py)
NUM_PROFILES = {"decode": 32, "prefill": 32, "mla": 24, "mla_prefill": 24, "write_kv": 24,
                "copy_blocks": 24}


def _op_functions(op: str):
    from hygon_attn_backend.tools.fuzz import attention, cache, mla, mla_prefill
    return {
        "mla": (mla.mla_profile, mla.mla_case),
        "mla_prefill": (mla_prefill.ragged_profile, mla_prefill.ragged_case),
        "decode": (attention.decode_profile, attention.decode_case),
        "prefill": (attention.prefill_profile, attention.prefill_case),
        "write_kv": (cache.write_kv_profile, cache.write_kv_case),
        "copy_blocks": (cache.copy_blocks_profile, cache.copy_blocks_case),
    }[op]


def run_case(op: str, seed: int, index: int, device, profiles: list, tiny=None):
    """Run case ``index``; returns ``(problem or None, description)``. An exception is a
    failure too (its type and message are the problem). tiny: CPU-sized shapes (default:
    on a CPU device)."""
    import torch

    _, case_fn = _op_functions(op)
    tiny = device.type == "cpu" if tiny is None else tiny
    rng = random.Random(f"{op}:{seed}:{index}")
    torch.manual_seed(rng.getrandbits(62))
    prof = profiles[index % len(profiles)]
    try:
        return case_fn(rng, prof, device, tiny)
    except Exception as exc:  # a crash of any kind is a finding, reported with its case
        where = traceback.extract_tb(exc.__traceback__)[-1]
        return (f"raised {type(exc).__name__}: {exc} (at {os.path.basename(where.filename)}:"
                f"{where.lineno})", f"profile {index % len(profiles)}")


def profiles_for(op: str, seed: int, tiny: bool, kv_dtype: str = "any") -> list:
    """The seed's profiles of ``op``. ``kv_dtype`` (one of ``KV_DTYPE_FILTERS``, decode and
    prefill): every profile's cache dtype is drawn from the dtypes that filter keeps, so a
    filtered run has as many profiles as an unfiltered one, stratified the same way."""
    from hygon_attn_backend.tools.fuzz.problems import Strata

    profile_fn, _ = _op_functions(op)
    count = NUM_PROFILES[op]
    keep = {} if kv_dtype == "any" else {"kv_dtype": lambda d: kv_dtype_matches(d, kv_dtype)}
    return [profile_fn(random.Random(f"{op}:{seed}:profile:{i}"), tiny,
                       Strata(f"{op}:{seed}", i, count, keep)) for i in range(count)]


#: ``--kv-dtype``: the cache dtypes a decode / prefill run keeps (``any``: every profile)
KV_DTYPE_FILTERS = ("any", "fp8", "fp8_e4m3", "fp8_e5m2", "16bit")


def kv_dtype_matches(kv_dtype, name: str) -> bool:
    """Whether a profile's cache dtype ``kv_dtype`` passes the ``--kv-dtype`` filter."""
    import torch
    fp8 = kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    return {"any": True, "fp8": fp8, "fp8_e4m3": kv_dtype == torch.float8_e4m3fn,
            "fp8_e5m2": kv_dtype == torch.float8_e5m2, "16bit": not fp8}[name]


def fuzz(op: str, *, cases: int, seed: int, device: str = "cuda", only=None,
         shard: "tuple[int, int]" = (0, 1), skip: int = 0, out=sys.stdout,
         max_failures: int = 20, impl: str = "triton", kv_dtype: str = "any") -> int:
    """Run the cases; print each failure and a summary line. Returns the failure count.
    ``skip``: leave out this shard's first ``skip`` cases (resume a run that was stopped
    after them). ``impl`` (prefill, decode, mla and mla_prefill): the implementation the
    cases plan with; "auto" takes the plan's choice, "native" the native kernel on the
    cases it covers (the summary counts the native cases). ``kv_dtype`` (prefill and
    decode, one of ``KV_DTYPE_FILTERS``): every profile takes a cache dtype of that filter
    (:func:`profiles_for`; a case's rerun line names the filter)."""
    import torch

    if impl != "triton" and op not in IMPL_OPS:
        raise ValueError(f"impl={impl!r}: only the prefill, decode, mla and mla_prefill cases "
                         f"take an impl (op={op!r})")
    if kv_dtype not in KV_DTYPE_FILTERS:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPE_FILTERS}, got {kv_dtype!r}")
    if kv_dtype != "any" and op not in ("prefill", "decode"):
        raise ValueError(f"kv_dtype={kv_dtype!r}: only the prefill and decode cases have a "
                         f"cache dtype (op={op!r})")
    dev = torch.device(device)
    profiles = profiles_for(op, seed, dev.type == "cpu", kv_dtype)
    if op in IMPL_OPS:
        for prof in profiles:
            prof["impl"] = impl
    indices = [only] if only is not None else [k for k in range(cases)
                                               if k % shard[1] == shard[0]][skip:]
    failures, done, native, start = 0, 0, 0, time.perf_counter()
    stopped = ""
    try:
        for k in indices:
            problem, desc = run_case(op, seed, k, dev, profiles)
            done += 1
            native += "impl=native" in desc
            if problem is not None:
                failures += 1
                if failures <= max_failures:
                    print(f"FAIL {op} seed={seed} case={k}: {problem}\n  {desc}\n  rerun: "
                          f"hygon-attn fuzz --op {op} --seed {seed} --case {k} --device "
                          f"{device}" + (f" --impl {impl}" if impl != "triton" else "")
                          + (f" --kv-dtype {kv_dtype}" if kv_dtype != "any" else ""),
                          file=out, flush=True)
            elif only is not None:
                print(f"ok {op} seed={seed} case={k}: {desc}", file=out)
        if dev.type == "cuda":
            torch.cuda.synchronize()
    except KeyboardInterrupt:  # also SIGTERM (a time limit): report what ran
        stopped = f" (stopped after {done} of {len(indices)})"
    took = time.perf_counter() - start
    part = "" if shard[1] == 1 else f" shard {shard[0]}/{shard[1]}"
    if skip:
        part += f", its first {skip} skipped"
    if impl != "triton":
        part += f", impl {impl}: {native} native"
    if kv_dtype != "any":
        part += f", kv {kv_dtype}"
    print(f"fuzz {op}: {done} cases, {failures} failures, {took:.1f} s (seed {seed}, "
          f"{device}{part}, {len(profiles)} profiles){stopped}", file=out, flush=True)
    return failures


def _shard(text: str) -> "tuple[int, int]":
    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        i, n = -1, 0
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"must be I/N with 0 <= I < N, got {text!r}")
    return i, n


def add_fuzz_parser(sub) -> None:
    p = sub.add_parser("fuzz", help="random problems against the reference (seeded)")
    p.add_argument("--op", choices=OPS, required=True)
    p.add_argument("--cases", type=count(1), default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="default: cuda when available, else cpu (Triton's interpreter)")
    p.add_argument("--case", type=count(0), default=None, help="rerun one case by its index")
    p.add_argument("--shard", type=_shard, default=(0, 1), help="I/N: cases with K %% N == I")
    p.add_argument("--skip", type=count(0), default=0,
                   help="leave out the shard's first SKIP cases (resume a stopped run)")
    p.add_argument("--impl", choices=("triton", "auto", "native"), default="triton",
                   help="prefill, decode, mla, mla_prefill: the implementation the cases plan "
                        "with (auto: the plan's rule; native: the native kernel on the cases "
                        "it covers on this GPU, Triton on the rest)")
    p.add_argument("--kv-dtype", choices=KV_DTYPE_FILTERS, default="any",
                   help="prefill and decode: only the profiles with this cache dtype (fp8: "
                        "e4m3 and e5m2; 16bit: the query's dtype)")
    p.add_argument("--profile", default=None,
                   help="write a cProfile of the run to this file (where a case's host "
                        "time goes: building it, compiling, the kernels, the reference)")
    p.set_defaults(func=cmd_fuzz)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def cmd_fuzz(args) -> int:
    if args.impl != "triton" and args.op not in IMPL_OPS:
        print(f"hygon-attn fuzz: --impl {args.impl}: only --op prefill, decode, mla and "
              f"mla_prefill take an impl (got --op {args.op})", file=sys.stderr)
        return 2
    if args.kv_dtype != "any" and args.op not in ("prefill", "decode"):
        print(f"hygon-attn fuzz: --kv-dtype {args.kv_dtype}: only --op prefill and decode "
              f"have a cache dtype (got --op {args.op})", file=sys.stderr)
        return 2
    device = args.device
    if device is None:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        from hygon_attn_backend.tools import needs

        problem = needs.interpreter_problem("hygon-attn fuzz")
        if problem:  # a missing package is no finding of the kernels
            print(problem, file=sys.stderr)
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    signal.signal(signal.SIGTERM, _interrupt)  # `timeout`: print the summary of what ran
    profiler = None
    if args.profile:
        import cProfile
        profiler = cProfile.Profile()
        profiler.enable()
    try:
        failures = fuzz(args.op, cases=args.cases, seed=args.seed, device=device,
                        only=args.case, shard=args.shard, skip=args.skip, impl=args.impl,
                        kv_dtype=args.kv_dtype)
    finally:
        if profiler is not None:
            profiler.disable()
            profiler.dump_stats(args.profile)
    return 1 if failures else 0
