"""Offline generation with SGLang's ``Engine`` and ``attention_backend="hygon"``.

    python examples/sglang_offline.py                       # tiny local model, compare
    python examples/sglang_offline.py --model /path/to/llama --page-size 16 --compare triton
    python examples/sglang_offline.py --tp-size 2            # hygon on two TP ranks
    python examples/sglang_offline.py --speculative-algorithm EAGLE --speculative-eagle-topk 4
    python examples/sglang_offline.py --engine-args '{"mem_fraction_static": 0.3}'
    python examples/sglang_offline.py --model-kind deepseek  # MLA: a tiny DeepSeek-V2

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

``--model-kind deepseek-mtp`` builds the same as a DeepSeek-V3 with one MTP layer, for
``--speculative-algorithm NEXTN`` (SGLang's NEXTN calls CUDA at start-up: a GPU run).
``--model-kind deepseek`` builds a tiny DeepSeek-V2 instead (MLA: 4 heads, latent 512 +
rope 64, YaRN, dense MLPs): SGLang's MLA paths (absorbed decode over the latent cache,
extend over cached prefixes) run on our MLA kernels, compared with SGLang's ``triton``.

``--speculative-algorithm NGRAM | STANDALONE | EAGLE | EAGLE3 | NEXTN`` turns on SGLang's
speculative decoding in the hygon run and in the compared one (``hygon`` verifies the drafts
and runs the draft model's attention too), and adds a third run, hygon without speculation:
greedy speculative decoding is lossless, so all three must give the same tokens. Without
``--speculative-draft-model-path`` STANDALONE drafts with the target itself (every draft is
accepted: the verify steps take the most tokens), EAGLE and EAGLE3 with a random-weight
head built for the tiny Llama, NEXTN with the MTP layer of ``--model-kind deepseek-mtp``.
The accept length printed is SGLang's count of generated tokens over verify steps. On a
CPU, SGLang's speculative helpers that are not attention (draft-tree construction, greedy
tree verify) exist only in ``sgl_kernel``'s CPU build, which the
package registry does not serve; ``tests/support/sglang_cpu_spec`` (the test suite's
stand-in) routes them to SGLang's own Triton forms, on ``PYTHONPATH``.
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
#: NEXTN: a model with its MTP layer (DeepSeek V3's ``num_nextn_predict_layers``)
SPEC_ALGORITHMS = ("NGRAM", "STANDALONE", "EAGLE", "EAGLE3", "NEXTN")


def workload(seed: int = 7):
    """Three first-turn prompts sharing a 40-token system prompt, and the user text of
    chat A's second turn."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 500) for _ in range(40)]
    users = [[rng.randrange(3, 500) for _ in range(n)] for n in (11, 5, 23)]
    follow_up = [rng.randrange(3, 500) for _ in range(9)]
    return [system + u for u in users], follow_up


def spec_engine_args(spec: dict) -> dict:
    """SGLang ``Engine`` keywords of a speculative configuration (``{}`` for none):
    ``spec`` has ``algorithm``, ``draft`` (a model path or None), ``topk``, ``steps`` and
    ``draft_tokens``."""
    if not spec:
        return {}
    kw = dict(speculative_algorithm=spec["algorithm"],
              speculative_num_draft_tokens=spec["draft_tokens"])
    if spec["algorithm"] == "NGRAM":  # SGLang takes the n-gram tree's breadth as its topk
        kw.update(speculative_ngram_max_bfs_breadth=spec["topk"])
    else:
        kw.update(speculative_draft_model_path=spec["draft"],
                  speculative_eagle_topk=spec["topk"], speculative_num_steps=spec["steps"])
    return kw


def generate(model: str, backend: str, page_size: int, device: str, *, tp_size: int = 1,
             log_level: str = "error", spec: dict | None = None,
             max_new_tokens: int = MAX_NEW_TOKENS, engine_args: dict | None = None) -> dict:
    """Run both rounds on one engine of ``tp_size`` tensor-parallel ranks, speculating as
    ``spec`` says (:func:`spec_engine_args`), with ``engine_args`` as further ``Engine``
    keywords; returns outputs, cached-prefix counts and verify-step counts."""
    import sglang as sgl

    from hygon_attn_backend.integrations.sglang import register
    from hygon_attn_backend.tools.demo.engine import cpu_omp_bind

    register()  # also done by SGLang's plugin loader when the package is installed
    if device == "cpu" and tp_size > 1:  # read by each rank's process
        os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", cpu_omp_bind(tp_size))
    kwargs = dict(dtype="float16", page_size=page_size, skip_tokenizer_init=True,
                  context_length=256, max_total_tokens=4096, log_level=log_level,
                  disable_cuda_graph=device == "cpu", tp_size=tp_size)
    # --engine-args may override any of these (e.g. disable_cuda_graph on a GPU)
    kwargs.update(spec_engine_args(spec), **(engine_args or {}))
    engine = sgl.Engine(model_path=model, attention_backend=backend, device=device, **kwargs)
    params = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
    try:
        first_turns, follow_up = workload()
        out_a = engine.generate(input_ids=first_turns[:1], sampling_params=params)
        out_bc = engine.generate(input_ids=first_turns[1:], sampling_params=params)
        turn2 = [first_turns[0] + out_a[0]["output_ids"] + follow_up]
        out_a2 = engine.generate(input_ids=turn2, sampling_params=params)
    finally:
        engine.shutdown()
    outs = out_a + out_bc + out_a2
    return {"backend": backend, "spec": spec or None,
            "output_ids": [o["output_ids"] for o in outs],
            "cached": [o["meta_info"].get("cached_tokens", 0) for o in outs],
            "verify_steps": [o["meta_info"].get("spec_verify_ct", 0) for o in outs]}


def _engine_args(text: str) -> dict:
    """``--engine-args``: a JSON object of ``Engine`` keywords."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object of Engine keywords, got {text!r}")
    return value


def _child(args) -> int:
    spec = json.loads(args.spec) if args.spec else None
    print(json.dumps(generate(args.model, args.backend, args.page_size, args.device,
                              tp_size=args.tp_size, log_level=args.log_level, spec=spec,
                              max_new_tokens=args.max_new_tokens,
                              engine_args=args.engine_args)))
    return 0


def _spec(args, model: str, tmp: str) -> dict | None:
    """The speculative configuration of the options (None without
    ``--speculative-algorithm``), a random EAGLE head built in ``tmp`` where one is needed."""
    algo = args.speculative_algorithm
    if not algo:
        return None
    topk, steps = args.speculative_eagle_topk, args.speculative_num_steps
    drafts = args.speculative_num_draft_tokens or (steps + 1 if topk == 1 else
                                                   min(topk * steps, 2 * steps + 2))
    draft = args.speculative_draft_model_path
    if draft is None and algo in ("EAGLE", "EAGLE3") and args.model_kind != "llama":
        raise SystemExit(f"--speculative-algorithm {algo} builds its random head for the tiny "
                         f"Llama only: pass --speculative-draft-model-path")
    if draft is None and algo in ("STANDALONE", "NEXTN"):
        # STANDALONE drafts with the target (every draft is accepted); NEXTN's MTP layer
        # is in the target's checkpoint
        draft = model
    elif draft is None and algo == "EAGLE":
        from hygon_attn_backend.tools.demo.engine import build_tiny_eagle_head

        draft = build_tiny_eagle_head(model, os.path.join(tmp, "eagle"), engine="sglang")
    elif draft is None and algo == "EAGLE3":
        from hygon_attn_backend.tools.demo.engine import build_tiny_eagle3_head

        draft = build_tiny_eagle3_head(model, os.path.join(tmp, "eagle3"))
    return {"algorithm": algo, "draft": draft, "topk": topk, "steps": steps,
            "draft_tokens": drafts}


def _run_in_process(args, backend: str, *, tp_size: int, spec: dict | None = None) -> dict:
    """One engine per process: a fresh SGLang each time."""
    env = dict(os.environ)
    if args.device == "cpu":
        env.setdefault("TRITON_INTERPRET", "1")  # Triton kernels on CPU tensors
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--backend", backend,
           "--model", args.model, "--page-size", str(args.page_size), "--device", args.device,
           "--tp-size", str(tp_size), "--log-level", args.log_level,
           "--max-new-tokens", str(args.max_new_tokens), "--spec", json.dumps(spec or {}),
           "--engine-args", json.dumps(args.engine_args)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{backend}: engine run failed (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model path (default: build a tiny random Llama)")
    parser.add_argument("--model-kind", default="llama",
                        choices=["llama", "deepseek", "deepseek-mtp"],
                        help="the tiny random model built without --model: a Llama (GQA), "
                             "a DeepSeek-V2 (MLA, latent 512 + rope 64, YaRN) or a "
                             "DeepSeek-V3 with an MTP layer (for NEXTN)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--compare", default=None,
                        help="also run this SGLang backend and compare (default: torch_native "
                             "on CPU, triton on GPU; 'none' to skip)")
    parser.add_argument("--tp-size", type=int, default=1,
                        help="tensor-parallel ranks of the hygon engine (the compared run "
                             "stays at 1)")
    parser.add_argument("--log-level", default="error", help="SGLang's log level")
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS,
                        help=f"greedy tokens a prompt (default {MAX_NEW_TOKENS})")
    parser.add_argument("--speculative-algorithm", type=str.upper, choices=SPEC_ALGORITHMS,
                        default=None, help="speculative decoding in the hygon and compared "
                                           "runs, beside a hygon run without it")
    parser.add_argument("--speculative-draft-model-path", default=None,
                        help="draft model / EAGLE head (default: the target for STANDALONE "
                             "and NEXTN, a random head for EAGLE / EAGLE3 on the tiny Llama)")
    parser.add_argument("--speculative-eagle-topk", type=int, default=1,
                        help="draft branches a step (> 1: a draft tree, SGLang takes it with "
                             "--page-size 1 only; NGRAM: the n-gram tree's breadth)")
    parser.add_argument("--speculative-num-steps", type=int, default=3)
    parser.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                        help="tokens a verify step (default: steps + 1 for a chain, "
                             "min(topk * steps, 2 * steps + 2) for a tree)")
    parser.add_argument("--engine-args", type=_engine_args, default={},
                        help="further sglang.Engine keywords of every run, a JSON object "
                             "(e.g. '{\"mem_fraction_static\": 0.3, "
                             "\"sampling_backend\": \"pytorch\"}')")
    parser.add_argument("--spec", default="", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="hygon", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tp_size < 1:
        parser.error(f"--tp-size must be at least 1, got {args.tp_size}")
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.speculative_eagle_topk < 1 or args.speculative_num_steps < 1:
        parser.error(f"--speculative-eagle-topk and --speculative-num-steps must be at least "
                     f"1, got {args.speculative_eagle_topk} and {args.speculative_num_steps}")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.child:
        return _child(args)

    with tempfile.TemporaryDirectory(prefix="hygon-sglang-") as tmp:
        if args.model is None:
            from hygon_attn_backend.tools.demo import engine

            path = os.path.join(tmp, "model")
            args.model = (engine.build_tiny_llama(path) if args.model_kind == "llama" else
                          engine.build_tiny_deepseek(path, rope_scaling=engine.DEEPSEEK_YARN,
                                                     engine="sglang",
                                                     mtp=args.model_kind == "deepseek-mtp"))
        spec = _spec(args, args.model, tmp)
        ours = _run_in_process(args, "hygon", tp_size=args.tp_size, spec=spec)
        # torch_native has no speculative verify and no MLA: those comparisons take triton
        compare = args.compare or ("torch_native" if args.device == "cpu" and spec is None
                                   and args.model_kind == "llama" else "triton")
        theirs = None if compare == "none" else _run_in_process(args, compare, tp_size=1,
                                                               spec=spec)
        plain = None if spec is None else _run_in_process(args, "hygon", tp_size=args.tp_size)
    return _report(args, ours, theirs, compare, plain, spec)


def _report(args, ours, theirs, compare, plain, spec) -> int:
    """Print each prompt's tokens (and accept lengths), then a MATCH / MISMATCH line for
    each comparison; 0 when every comparison matched."""
    names = ["chat A turn 1", "chat B turn 1", "chat C turn 1", "chat A turn 2"]
    for i, name in enumerate(names):
        line = f"{name}: cached {ours['cached'][i]:3d}  hygon {ours['output_ids'][i]}"
        if spec is not None:
            steps = ours["verify_steps"][i]
            line += f"  accept length {len(ours['output_ids'][i]) / max(steps, 1):.2f}"
        if theirs is not None:
            line += f"  {compare} {theirs['output_ids'][i]}"
        print(line)
    what = "" if spec is None else (f", {spec['algorithm']} topk {spec['topk']}, "
                                    f"{spec['draft_tokens']} draft tokens")
    ok = True
    for other, label in ((theirs, f"{compare} at TP=1"), (plain, "hygon without speculation")):
        if other is None:
            continue
        same = ours["output_ids"] == other["output_ids"]
        ok = ok and same
        print("MATCH" if same else "MISMATCH", f"(hygon at TP={args.tp_size}{what} vs {label}, "
              f"greedy, {args.max_new_tokens} tokens)")
    for run, label in ((ours, "hygon"), (theirs, compare)):
        if spec is not None and run is not None:
            total = sum(len(t) for t in run["output_ids"])
            print(f"{label}: accept length {total / max(sum(run['verify_steps']), 1):.2f} "
                  f"({total} tokens in {sum(run['verify_steps'])} verify steps)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
