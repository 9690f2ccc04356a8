"""Offline generation with SGLang's ``Engine`` and ``attention_backend="hygon"``.

    python examples/sglang_offline.py                       # tiny local model, compare
    python examples/sglang_offline.py --model /path/to/llama --page-size 16 --compare triton
    python examples/sglang_offline.py --tp-size 2            # hygon on two TP ranks

Needs the package installed (``pip install -e .``): SGLang's scheduler processes find the
backend through the ``sglang.srt.plugins`` entry point. Without ``--model`` a tiny
random-weight Llama is built in a temporary folder (no download). The workload runs
three rounds of greedy generation: chat A alone, then chats B and C that share A's
system prompt, then A's second turn (A's first prompt and answer plus a new user turn),
so SGLang's radix cache serves cached prefixes and our kernels extend over them;
``cached`` in the output is SGLang's count of prefix tokens served from the cache.

With ``--compare BACKEND`` (default ``torch_native`` on CPU, ``triton`` on a GPU) the same
workload runs on that SGLang backend too, each engine in its own process, and the script
exits 0 when the generated tokens match and 1 otherwise. ``--tp-size N`` runs the hygon
engine on N tensor-parallel ranks (each rank's attention holds its share of the query and
KV heads); the compared run stays at TP=1, the reference. On a machine without a GPU the
engine runs on the CPU and our Triton kernels in Triton's interpreter (float16); there
SGLang binds each rank's OpenMP threads to a NUMA node of its own and refuses more ranks
than nodes, so a TP run sets ``SGLANG_CPU_OMP_THREADS_BIND`` (one span of cores a rank,
``0|1`` on two cores) unless it is set already. The engine's processes are spawned: a
script that starts an ``Engine`` with ``tp_size > 1`` must do so under
``if __name__ == "__main__":``, as this one does.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile

MAX_NEW_TOKENS = 8


def workload(seed: int = 7):
    """Three first-turn prompts sharing a 40-token system prompt, and the user text of
    chat A's second turn."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 500) for _ in range(40)]
    users = [[rng.randrange(3, 500) for _ in range(n)] for n in (11, 5, 23)]
    follow_up = [rng.randrange(3, 500) for _ in range(9)]
    return [system + u for u in users], follow_up


def generate(model: str, backend: str, page_size: int, device: str, *, tp_size: int = 1,
             log_level: str = "error") -> dict:
    """Run both rounds on one engine of ``tp_size`` tensor-parallel ranks; returns outputs
    and cached-prefix counts."""
    import sglang as sgl

    from hygon_attn_backend.integrations.sglang import register
    from hygon_attn_backend.tools.demo.engine import cpu_omp_bind

    register()  # also done by SGLang's plugin loader when the package is installed
    if device == "cpu" and tp_size > 1:  # read by each rank's process
        os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", cpu_omp_bind(tp_size))
    engine = sgl.Engine(model_path=model, attention_backend=backend, device=device,
                        dtype="float16", page_size=page_size, skip_tokenizer_init=True,
                        context_length=256, max_total_tokens=4096, log_level=log_level,
                        disable_cuda_graph=device == "cpu", tp_size=tp_size)
    params = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0}
    try:
        first_turns, follow_up = workload()
        out_a = engine.generate(input_ids=first_turns[:1], sampling_params=params)
        out_bc = engine.generate(input_ids=first_turns[1:], sampling_params=params)
        turn2 = [first_turns[0] + out_a[0]["output_ids"] + follow_up]
        out_a2 = engine.generate(input_ids=turn2, sampling_params=params)
    finally:
        engine.shutdown()
    outs = out_a + out_bc + out_a2
    return {"backend": backend,
            "output_ids": [o["output_ids"] for o in outs],
            "cached": [o["meta_info"].get("cached_tokens", 0) for o in outs]}


def _child(args) -> int:
    print(json.dumps(generate(args.model, args.backend, args.page_size, args.device,
                              tp_size=args.tp_size, log_level=args.log_level)))
    return 0


def _run_in_process(args, backend: str, *, tp_size: int) -> dict:
    """One engine per process: a fresh SGLang each time."""
    env = dict(os.environ)
    if args.device == "cpu":
        env.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU tensors
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--backend", backend,
           "--model", args.model, "--page-size", str(args.page_size), "--device", args.device,
           "--tp-size", str(tp_size), "--log-level", args.log_level]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{backend}: engine run failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model path (default: build a tiny random Llama)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--compare", default=None,
                        help="also run this SGLang backend and compare (default: torch_native "
                             "on CPU, triton on GPU; 'none' to skip)")
    parser.add_argument("--tp-size", type=int, default=1,
                        help="tensor-parallel ranks of the hygon engine (the compared run "
                             "stays at 1)")
    parser.add_argument("--log-level", default="error", help="SGLang's log level")
    parser.add_argument("--backend", default="hygon", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tp_size < 1:
        parser.error(f"--tp-size must be at least 1, got {args.tp_size}")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        return _child(args)

    with tempfile.TemporaryDirectory(prefix="hygon-sglang-") as tmp:
        if args.model is None:
            from hygon_attn_backend.tools.demo.engine import build_tiny_llama

            args.model = build_tiny_llama(os.path.join(tmp, "model"))
        ours = _run_in_process(args, "hygon", tp_size=args.tp_size)
        compare = args.compare or ("torch_native" if args.device == "cpu" else "triton")
        theirs = None if compare == "none" else _run_in_process(args, compare, tp_size=1)

    names = ["chat A turn 1", "chat B turn 1", "chat C turn 1", "chat A turn 2"]
    for i, name in enumerate(names):
        line = f"{name}: cached {ours['cached'][i]:3d}  hygon {ours['output_ids'][i]}"
        if theirs is not None:
            line += f"  {compare} {theirs['output_ids'][i]}"
        print(line)
    if theirs is None:
        return 0
    same = ours["output_ids"] == theirs["output_ids"]
    print("MATCH" if same else "MISMATCH", f"(hygon at TP={args.tp_size} vs {compare} at TP=1, "
          f"greedy, {MAX_NEW_TOKENS} tokens)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
