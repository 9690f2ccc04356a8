"""How many Triton kernels a fuzz run compiles, counted on a CPU without running them.

Triton compiles one kernel per *specialisation key*: the kernel, its constexprs, each
pointer's dtype and 16-byte alignment, each integer argument not in ``do_not_specialize``
(``== 1``, divisible by 16, 32- or 64-bit), the launch options (``num_warps``,
``num_stages``). A GPU fuzz run is compile-bound when its cases draw many keys, so the
fuzzer fixes everything that enters a key per profile and varies only the batch; this
module checks that it does.

:func:`count_keys` draws the GPU-sized cases of a seed (``tiny=False``) on CPU tensors with
every kernel launch intercepted: the key is recorded through Triton's own argument
specialisation (``native_specialize_impl``) and the kernel does not run; the attention
references do not run either (a case stops at its first reference call, recording the
fp64 work it would do), and random fills are skipped (values do not enter a key). Needs
``TRITON_INTERPRET=1`` set before the kernels are imported (as on any CPU).

    python -m hygon_attn_backend.tools.fuzz.speckeys --op decode --cases 10000 --shards 8
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import sys
from collections import defaultdict
from typing import Dict

ATTENTION_REFERENCES = ("paged_decode_attention", "prefix_prefill_attention")


class _StopCase(Exception):
    """Raised in place of an attention reference: the case's launches are recorded."""


def _specialise(arg, do_not_specialize: bool) -> tuple:
    """Triton's specialisation of one non-constexpr argument (its own function where this
    Triton has it, else the same rules written out)."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        native_specialize_impl = None
    if native_specialize_impl is not None:
        try:
            return tuple(native_specialize_impl(BaseBackend, arg, False,
                                                not do_not_specialize, True))
        except Exception:  # a value Triton's specialiser does not take (a torch dtype)
            return ("value", repr(arg))
    if hasattr(arg, "data_ptr"):
        return (str(arg.dtype), arg.data_ptr() % 16 == 0)
    if isinstance(arg, bool) or not isinstance(arg, int):
        return (type(arg).__name__,) if arg is not None else ("constexpr", None)
    width = "i32" if -2**31 <= arg < 2**31 else "i64"
    if do_not_specialize:
        return (width,)
    return ("constexpr", 1) if arg == 1 else (width, arg % 16 == 0)


def launch_key(fn, args: tuple, kwargs: dict, *, do_not_specialize=()) -> tuple:
    """The specialisation key of launching the ``@triton.jit`` function ``fn`` (its
    Python function) with ``args``/``kwargs`` (launch options among them)."""
    sig = inspect.signature(fn)
    launch_opts = sorted((k, repr(v)) for k, v in kwargs.items() if k not in sig.parameters)
    bound = sig.bind(*args, **{k: v for k, v in kwargs.items() if k in sig.parameters})
    bound.apply_defaults()
    key = [fn.__name__]
    for name, param in sig.parameters.items():
        value = bound.arguments[name]
        if "constexpr" in str(param.annotation):
            key.append(("constexpr", repr(value)))
        else:
            key.append(_specialise(value, name in do_not_specialize))
    return tuple(key) + tuple(launch_opts)


def reference_work(args: tuple) -> int:
    """Elements the fp64 reference touches for an attention call ``(q, k, v, table,
    seq_lens)`` (decode) or ``(q, k, v, table, cu_seqlens_q, seq_lens_k)`` (prefill):
    per request ``Hq * Lk * D`` (K/V expanded to every query head) + ``Hq * Lq * Lk``
    (scores)."""
    q = args[0]
    heads, dim = q.shape[-2], q.shape[-1]
    if len(args) == 5:  # decode: q [B, Hq, D] or [B, T, Hq, D]
        lens_q = [1 if q.dim() == 3 else q.shape[1]] * q.shape[0]
        lens_k = args[4].tolist()
    else:
        cu = args[4].tolist()
        lens_q = [b - a for a, b in zip(cu, cu[1:])]
        lens_k = args[5].tolist()
    return sum(heads * lk * (dim + lq) for lq, lk in zip(lens_q, lens_k))


@contextlib.contextmanager
def recording_launches(keys: list, work: "list | None" = None):
    """Within the block, every Triton launch appends its key to ``keys`` and returns
    without running; ``torch.randn``/``torch.full`` and a conversion of their result leave
    the tensor unfilled (the cases' big caches and outputs); with ``work`` (a list), the
    attention references append :func:`reference_work` of their call and raise
    :class:`_StopCase` instead of running."""
    import torch
    from triton.runtime.interpreter import InterpretedFunction

    from hygon_attn_backend import reference
    from hygon_attn_backend.ops import _interpreter
    from hygon_attn_backend.ops._dispatch import triton_interpreter_on

    if not triton_interpreter_on():
        raise RuntimeError("speckeys needs TRITON_INTERPRET=1 set before the kernels load")

    def run(self, *args, grid, warmup, **kwargs):
        if not warmup:
            keys.append(launch_key(self.fn, args, kwargs,
                                   do_not_specialize=self.kwargs.get("do_not_specialize") or ()))

    def stop(*args, **kwargs):
        work.append(reference_work(args))
        raise _StopCase

    def no_fill(*size, generator=None, **kwargs):  # keys see shapes, strides and dtypes
        t = torch.empty(*size, **kwargs)
        t._unfilled = True
        return t

    def no_full(size, fill_value, **kwargs):  # the NaN-poisoned outputs
        return torch.empty(size, **kwargs)

    def convert(self, *args, **kwargs):  # an unfilled tensor converts without its values
        if getattr(self, "_unfilled", False) and len(args) == 1 and \
                isinstance(args[0], torch.dtype) and not kwargs and self.is_contiguous():
            t = torch.empty(self.shape, dtype=args[0], device=self.device)
            t._unfilled = True
            return t
        return to(self, *args, **kwargs)

    saved = {n: getattr(reference, n) for n in ATTENTION_REFERENCES}
    original_run = InterpretedFunction.run
    randn, full, to = torch.randn, torch.full, torch.Tensor.to
    # the keys are a GPU run's: bf16 launches as on a GPU, whatever the interpreter's bf16
    # does here (its probe would be a recorded launch too)
    bf16_probe = _interpreter.bf16_dot_works
    _interpreter.bf16_dot_works = lambda: True
    InterpretedFunction.run = run
    torch.randn, torch.full, torch.Tensor.to = no_fill, no_full, convert
    if work is not None:
        for n in ATTENTION_REFERENCES:
            setattr(reference, n, stop)
    try:
        yield keys
    finally:
        InterpretedFunction.run = original_run
        _interpreter.bf16_dot_works = bf16_probe
        torch.randn, torch.full, torch.Tensor.to = randn, full, to
        for n, f in saved.items():
            setattr(reference, n, f)


def case_keys(op: str, seed: int, index: int, profiles: list) -> "tuple[list, int]":
    """The keys of the launches of case ``index`` (GPU-sized, on CPU tensors) and the
    reference's work (:func:`reference_work`, 0 for the cache ops)."""
    import torch

    from hygon_attn_backend.tools import fuzz

    keys: list = []
    attention = op in ("decode", "prefill")
    work: list = []
    with recording_launches(keys, work if attention else None):
        problem, _ = fuzz.run_case(op, seed, index, torch.device("cpu"), profiles,
                                   tiny=False)
    if attention and not work:
        raise RuntimeError(f"{op} case {index} failed before its reference: {problem}")
    return keys, sum(work)


def count_keys(op: str, *, cases: int, seed: int, shards: int = 1) -> dict:
    """Distinct keys of cases ``0..cases-1`` of ``seed``: ``total``, ``per_shard`` (shard
    ``i`` = the cases with ``K % shards == i``), ``per_kernel``, ``per_profile`` (the
    most of one profile), ``launches``, and the reference's work per case
    (``work_mean``, ``work_max``, elements)."""
    from hygon_attn_backend.tools import fuzz

    profiles = fuzz.profiles_for(op, seed, tiny=False)
    shard_keys = [set() for _ in range(shards)]
    profile_keys = defaultdict(set)
    launches, work = 0, []
    for k in range(cases):
        keys, w = case_keys(op, seed, k, profiles)
        launches += len(keys)
        work.append(w)
        shard_keys[k % shards].update(keys)
        profile_keys[k % len(profiles)].update(keys)
    every = set().union(*shard_keys)
    per_kernel: Dict[str, int] = defaultdict(int)
    for key in every:
        per_kernel[key[0]] += 1
    return dict(total=len(every), per_shard=[len(s) for s in shard_keys],
                per_kernel=dict(per_kernel),
                per_profile=max((len(s) for s in profile_keys.values()), default=0),
                launches=launches, work_mean=sum(work) / max(1, len(work)),
                work_max=max(work, default=0))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--op", required=True)
    p.add_argument("--cases", type=int, default=10000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--shards", type=int, default=8)
    args = p.parse_args(argv)
    res = count_keys(args.op, cases=args.cases, seed=args.seed, shards=args.shards)
    print(f"{args.op} seed {args.seed}, {args.cases} cases: {res['total']} distinct keys "
          f"({res['per_kernel']}), per shard of {args.shards}: {res['per_shard']}, max per "
          f"profile {res['per_profile']}, {res['launches']} launches; reference work per case "
          f"mean {res['work_mean']:.3g}, max {res['work_max']:.3g} elements")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.exit(main())
