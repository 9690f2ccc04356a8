"""End-to-end demo: vLLM offline generation with ``attention_backend="hygon"`` against
vLLM's default backend, on a tiny random-weight Llama built locally (no download).

``run_demo()`` (called by ``hygon-attn demo``) builds the model in a temporary folder,
runs the same greedy generation once per backend, each in its own Python process (a
fresh engine each time), prints both outputs and whether they match token for token, and
returns 0 on a match, 1 on a mismatch.

The workload exercises every path of the backend: a batch of prompts of different
lengths (prefill), decode steps, prompts longer than the per-step token budget (chunked
prefill: later chunks attend to a cached prefix) and a second round whose prompts share
whole cached blocks with the first (prefix-cache hits).

The model: Llama, hidden 64, 2 layers, 4 query heads, 2 KV heads (GQA), head_dim 32,
vocab 512, a ``tokenizers`` WordLevel tokenizer, float16.
Weights are drawn with a larger spread than a real initialisation (``INIT_STD``) so the
logits of a random model are well separated and greedy decoding does not hinge on
rounding noise.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Optional, Sequence

from hygon_attn_backend.tools import needs

VOCAB_SIZE = 512
HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 32
INIT_STD = 0.15
MAX_MODEL_LEN = 256
BLOCK_SIZE = 32  # a multiple of 32 so vLLM's CPU backend accepts it too
MAX_TOKENS = 10
SEED = 1234
#: Prompt draw whose greedy steps all have a clear winner: with float16 logits a random
#: model often has top-2 logprobs within one rounding step (0.002-0.004), where any two
#: correct attention kernels may pick different tokens. With this draw and SEED the
#: smallest top-2 gap of vLLM's default CPU backend is 0.043 (40 draws searched).
PROMPT_SEED = 26
#: float16: what the kernels take on a GPU and under the CPU Triton interpreter.
DTYPE = "float16"


def build_tiny_llama(path: str, *, seed: int = SEED, num_heads: int = HEADS,
                     num_kv_heads: int = KV_HEADS, hidden: int = HIDDEN) -> str:
    """Write a random-weight Llama and its tokenizer to ``path``; returns ``path``.
    ``num_heads`` / ``num_kv_heads``: query and KV heads (head_dim stays ``HEAD_DIM``; the
    parallel tests shard them over tensor-parallel ranks); ``hidden``: the model width, a
    multiple of ``num_heads`` (the config's check)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    save_word_tokenizer(path)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=hidden,
                         intermediate_size=2 * hidden, num_hidden_layers=LAYERS,
                         num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                         head_dim=HEAD_DIM, max_position_embeddings=MAX_MODEL_LEN,
                         initializer_range=INIT_STD, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, tie_word_embeddings=False, torch_dtype="float32")
    return save_random_weights(LlamaForCausalLM(config), path, seed=seed)


def save_word_tokenizer(path: str) -> str:
    """Write a ``tokenizers`` WordLevel tokenizer of ``VOCAB_SIZE`` words (``<unk>``,
    ``<s>``, ``</s>``, then ``w0`` ...) to ``path`` (created); returns ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    os.makedirs(path, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    words = specials + [f"w{i}" for i in range(VOCAB_SIZE - len(specials))]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(path)
    return path


#: The tiny DeepSeek-V2-style (MLA) model of :func:`build_tiny_deepseek`: DeepSeek's latent
#: widths (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64, the 576-wide cache row), small
#: ``qk_nope_head_dim`` / ``v_head_dim`` so the Triton interpreter runs it on a CPU.
DEEPSEEK = dict(heads=4, kv_lora_rank=512, qk_rope=64, qk_nope=32, v_head=32)
#: DeepSeek-V2's YaRN (its mscale changes the softmax scale). SGLang's CPU rotary
#: embedding for DeepSeek needs a scaling config; vLLM runs either.
DEEPSEEK_YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                 "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
#: Config keys SGLang's ``deepseek_v2`` model reads that transformers' ``DeepseekV2Config``
#: leaves out (DeepSeek's own config files carry them); the MoE ones are unused here
#: (every layer dense) but read.
#: The MTP form's model width: SGLang's NextN layer on CUDA normalises [embedding, hidden]
#: with a fused kernel that takes widths in (256, 8192], multiples of 256 (measured on an
#: H100, 2026-12-06: "fused_eh_norm: unsupported hidden_size=64").
MTP_HIDDEN = 512
SGLANG_DEEPSEEK_KEYS = dict(moe_layer_freq=1, topk_method="greedy", n_group=1, topk_group=1,
                            routed_scaling_factor=1.0, scoring_func="softmax",
                            norm_topk_prob=False)


def build_tiny_deepseek(path: str, *, seed: int = SEED, rope_scaling=None,
                        engine: str = "vllm", mtp: bool = False) -> str:
    """Write a random-weight DeepSeek-V2-style (MLA) model and its tokenizer to ``path``;
    returns ``path``. 2 layers, dense MLPs (``first_k_dense_replace`` = every layer),
    ``DEEPSEEK``'s widths, no query LoRA (DeepSeek-V2-Lite's ``q_proj``), vocab 512.
    ``rope_scaling``: e.g. ``DEEPSEEK_YARN``; ``engine="sglang"`` adds
    ``SGLANG_DEEPSEEK_KEYS`` to the config. ``mtp``: a DeepSeek-V3 (the architecture
    SGLang's NEXTN reads), ``MTP_HIDDEN`` wide, with one multi-token-prediction layer after
    the two (``num_nextn_predict_layers`` 1: its decoder layer, a tiny MoE of 4 experts as
    SGLang builds it, and ``enorm`` / ``hnorm`` / ``eh_proj`` / ``shared_head``; for vLLM
    its router is DeepSeek-V3's ``noaux_tc``, which vLLM's ``mtp`` method reads)."""
    from transformers import (DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,
                              DeepseekV3ForCausalLM)

    if engine not in ("vllm", "sglang"):
        raise ValueError(f"engine must be 'vllm' or 'sglang', got {engine!r}")
    save_word_tokenizer(path)
    d = DEEPSEEK
    extra = {} if rope_scaling is None else {"rope_scaling": rope_scaling}
    if engine == "sglang":
        extra.update(SGLANG_DEEPSEEK_KEYS)
    config_cls, model_cls = ((DeepseekV3Config, DeepseekV3ForCausalLM) if mtp else
                             (DeepseekV2Config, DeepseekV2ForCausalLM))
    if mtp:  # the MTP layer is built as one more decoder layer, then moved (below)
        extra.update(n_group=1, topk_group=1)
        if engine == "vllm":  # DeepSeek-V3's router: vLLM loads the checkpoint's
            # e_score_correction_bias only into a noaux_tc gate
            extra.update(topk_method="noaux_tc", scoring_func="sigmoid")
    hidden = MTP_HIDDEN if mtp else HIDDEN
    config = config_cls(
        vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=hidden, num_hidden_layers=LAYERS + int(mtp),
        num_attention_heads=d["heads"], num_key_value_heads=d["heads"], q_lora_rank=None,
        kv_lora_rank=d["kv_lora_rank"], qk_nope_head_dim=d["qk_nope"],
        qk_rope_head_dim=d["qk_rope"], v_head_dim=d["v_head"], head_dim=d["qk_rope"],
        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=LAYERS, max_position_embeddings=MAX_MODEL_LEN,
        initializer_range=INIT_STD, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        tie_word_embeddings=False, torch_dtype="float32", **extra)
    save_random_weights(model_cls(config), path, seed=seed, std=INIT_STD)
    if mtp:
        _add_mtp_layer(path, hidden=hidden, seed=seed)
    return path


def _add_mtp_layer(path: str, *, hidden: int, seed: int) -> None:
    """Turn the last decoder layer of the DeepSeek-V3 at ``path`` into its MTP layer: the
    config counts one layer fewer and names ``num_nextn_predict_layers`` 1; the layer gets
    DeepSeek's MTP weights (norms 1, a random ``eh_proj`` over [embedding, hidden], the
    model's embedding and LM head as its own)."""
    import torch
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    pre = f"model.layers.{LAYERS}."
    gen = torch.Generator().manual_seed(seed + 1)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        weights[pre + name + ".weight"] = torch.ones(hidden)
    weights[pre + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) * INIT_STD
    weights[pre + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    weights[pre + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file({k: v.contiguous() for k, v in weights.items()}, file, metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(num_hidden_layers=LAYERS, num_nextn_predict_layers=1)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


#: The EAGLE head's architecture name in each engine's model registry (the same weights:
#: ``fc`` over [token embedding, target hidden state], one Llama layer without its input
#: norm, the target's embedding and LM head shared).
EAGLE_ARCHITECTURES = {"vllm": "EagleLlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}


def _head_config(target_dir: str, path: str, **updates) -> dict:
    """A draft head's config at ``path`` (created): the target's, one layer, ``updates``."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(target_dir, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(num_hidden_layers=1, **updates)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    return cfg


def _head_layer(cfg: dict, rand, *, qkv_in: int) -> dict:
    """The random weights of a head's one Llama layer (``layers.0.``: attention whose q/k/v
    read ``qkv_in`` columns, the MLP, a unit post-attention norm), drawn by ``rand(*shape)``
    in this order."""
    import torch

    h, inter, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    layer = "layers.0."
    return {layer + "self_attn.q_proj.weight": rand(hq * d, qkv_in),
            layer + "self_attn.k_proj.weight": rand(hkv * d, qkv_in),
            layer + "self_attn.v_proj.weight": rand(hkv * d, qkv_in),
            layer + "self_attn.o_proj.weight": rand(h, hq * d),
            layer + "mlp.gate_proj.weight": rand(inter, h),
            layer + "mlp.up_proj.weight": rand(inter, h),
            layer + "mlp.down_proj.weight": rand(h, inter),
            layer + "post_attention_layernorm.weight": torch.ones(h)}


def _seeded_rand(seed: int):
    import torch

    gen = torch.Generator().manual_seed(seed)
    return lambda *shape: torch.randn(*shape, generator=gen) * INIT_STD


def build_tiny_eagle_head(target_dir: str, path: str, *, engine: str, seed: int = 7) -> str:
    """Write a random-weight EAGLE head for the tiny Llama in ``target_dir`` to ``path`` (its
    config: the target's, one layer, ``EAGLE_ARCHITECTURES[engine]``); returns ``path``."""
    from safetensors.torch import save_file

    if engine not in EAGLE_ARCHITECTURES:
        raise ValueError(f"engine must be one of {sorted(EAGLE_ARCHITECTURES)}, got {engine!r}")
    cfg = _head_config(target_dir, path, architectures=[EAGLE_ARCHITECTURES[engine]])
    h, rand = cfg["hidden_size"], _seeded_rand(seed)
    weights = {"embed_tokens.weight": rand(cfg["vocab_size"], h), "fc.weight": rand(h, 2 * h)}
    weights.update(_head_layer(cfg, rand, qkv_in=h))
    save_file(weights, os.path.join(path, "model.safetensors"))
    return path


#: The target layers whose inputs the tiny EAGLE3 head reads (SGLang captures layer
#: ``i + 1``'s input for id ``i``): the embedding output and the first layer's output, two
#: of the tiny Llama's three hidden states (DeepSeek's and Llama's heads take three of
#: dozens; a two-layer target has no third one past its first layer).
EAGLE3_AUX_LAYER_IDS = (-1, 0)


def build_tiny_eagle3_head(target_dir: str, path: str, *, seed: int = 11) -> str:
    """Write a random-weight EAGLE3 head (SGLang's ``LlamaForCausalLMEagle3``) for the tiny
    Llama in ``target_dir`` to ``path``; returns ``path``. One layer whose attention takes
    [token embedding, hidden state] (``2 * hidden`` wide), ``fc`` over the
    ``EAGLE3_AUX_LAYER_IDS`` hidden states of the target, its own final norm, the target's
    embedding and LM head copied (a full draft vocabulary: no ``d2t`` map)."""
    import torch
    from safetensors.torch import load_file, save_file

    ids = list(EAGLE3_AUX_LAYER_IDS)
    target = load_file(os.path.join(target_dir, "model.safetensors"))
    cfg = _head_config(target_dir, path, architectures=["LlamaForCausalLMEagle3"],
                       draft_vocab_size=int(target["lm_head.weight"].shape[0]),
                       eagle_config={"eagle_aux_hidden_state_layer_ids": ids,
                                     "use_aux_hidden_state": True})
    h, rand = cfg["hidden_size"], _seeded_rand(seed)
    weights = {"embed_tokens.weight": target["model.embed_tokens.weight"].clone(),
               "lm_head.weight": target["lm_head.weight"].clone(),
               "fc.weight": rand(h, len(ids) * h), "norm.weight": torch.ones(h)}
    weights.update(_head_layer(cfg, rand, qkv_in=2 * h))
    weights.update({"layers.0.input_layernorm.weight": torch.ones(h),
                    "layers.0.hidden_norm.weight": torch.ones(h)})
    save_file(weights, os.path.join(path, "model.safetensors"))
    return path


def save_random_weights(model, path: str, *, seed: int, std: float = INIT_STD) -> str:
    """Fill a transformers ``model``'s parameters from ``seed`` (norm weights 1, every other
    weight normal with spread ``std``), save it to ``path`` as safetensors; returns ``path``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.save_pretrained(path, safe_serialization=True)
    return path


def cpu_omp_bind(workers: int) -> str:
    """OpenMP core spans for ``workers`` engine workers on this host, ``|``-separated, one
    span a worker (``"0|1"`` for two workers on two cores): the format of vLLM's
    ``VLLM_CPU_OMP_THREADS_BIND`` and SGLang's ``SGLANG_CPU_OMP_THREADS_BIND``. On a CPU
    both engines otherwise bind each worker to a NUMA node of its own and refuse more
    workers than nodes (a one-node machine runs one)."""
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    cores = os.cpu_count() or 1
    per = max(1, cores // workers)
    spans = []
    for w in range(workers):
        lo = min(w * per, cores - 1)
        hi = min(lo + per - 1, cores - 1)
        spans.append(str(lo) if lo == hi else f"{lo}-{hi}")
    return "|".join(spans)


def demo_prompts(seed: int = PROMPT_SEED) -> tuple[list[list[int]], list[list[int]]]:
    """Token-id prompts: round 1 (lengths 70, 9, 41, 1) and round 2 (sharing 2 and 1
    whole blocks with round-1 prompts, plus new tokens)."""
    import random

    rng = random.Random(seed)

    def words(n):
        return [rng.randrange(3, VOCAB_SIZE) for _ in range(n)]

    a, b, c, d = words(70), words(9), words(41), words(1)
    round1 = [a, b, c, d]
    round2 = [a[:2 * BLOCK_SIZE] + words(5), c[:BLOCK_SIZE] + words(20)]
    return round1, round2


def _generate(model_dir: str, backend: Optional[str], options: Optional[dict] = None) -> dict:
    """Greedy generation in this process with vLLM. Returns ``{"tokens": [[ids]...],
    "gaps": [[top-2 logprob gap per step]...]}``. ``options``: more ``LLM`` arguments
    (``tensor_parallel_size``, ``decode_context_parallel_size``, ...)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import torch

    kwargs = dict(model=model_dir, tokenizer=model_dir, max_model_len=MAX_MODEL_LEN,
                  block_size=BLOCK_SIZE, enable_prefix_caching=True,
                  enable_chunked_prefill=True, max_num_batched_tokens=64,
                  max_num_seqs=8, seed=SEED, enforce_eager=True)
    kwargs["dtype"] = DTYPE
    if backend is not None:
        kwargs["attention_backend"] = backend
    kwargs.update(options or {})
    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=2)
    outputs = []
    for prompts in demo_prompts():
        outputs += llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                use_tqdm=False)
    return greedy_record(outputs)


def greedy_record(outputs) -> dict:
    """``{"tokens": [[id, ...], ...], "gaps": [[gap, ...], ...]}`` of vLLM
    ``RequestOutput``s, in the order given: each request's first completion's token ids and,
    per step, the gap between its two most likely tokens' logprobs (``inf`` with fewer than
    two; sampled with ``logprobs=2``), which says whether a token difference is a near tie."""
    tokens, gaps = [], []
    for r in outputs:
        out = r.outputs[0]
        tokens.append(list(out.token_ids))
        gaps.append([_top2_gap(step) for step in out.logprobs or []])
    return {"tokens": tokens, "gaps": gaps}


def _top2_gap(step_logprobs) -> float:
    vals = sorted((lp.logprob for lp in step_logprobs.values()), reverse=True)
    return float(vals[0] - vals[1]) if len(vals) > 1 else float("inf")


def _run_child(model_dir: str, backend: Optional[str], timeout: float,
               impl: Optional[str] = None) -> dict:
    """Run :func:`_generate` in a fresh Python process; returns its result. ``impl`` sets
    ``HYGON_ATTN_IMPL`` there; ``"triton"`` without a GPU runs the kernels in Triton's
    interpreter."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as result:
        cmd = [sys.executable, "-m", "hygon_attn_backend.tools.demo.engine", "--child", model_dir,
               "--backend", backend or "default", "--result", result.name]
        env = dict(os.environ, VLLM_LOGGING_LEVEL="INFO")  # the log is read below
        if impl is not None:
            env["HYGON_ATTN_IMPL"] = impl
            if impl == "triton" and not _has_cuda():
                env["TRITON_INTERPRET"] = "1"
        proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"generation with backend {backend or 'default'} failed "
                               f"(exit {proc.returncode}):\n{proc.stdout[-3000:]}\n"
                               f"{proc.stderr[-6000:]}")
        res = json.load(open(result.name))
    # Which attention ran, from the worker's log (the builder announces itself): a hygon
    # run that silently fell back to vLLM's backend must not pass as a match.
    log = proc.stdout + proc.stderr
    found = re.search(r"hygon attention backend: (.*?) for layers", log)
    if backend is not None and found is None:
        raise RuntimeError("vLLM did not use the hygon backend (its builder never ran); "
                           f"worker log tail:\n{log[-4000:]}")
    if backend is None and found is not None:
        raise RuntimeError("the default-backend run used the hygon backend")
    res["kernels"] = found.group(1) if found else "vLLM's default"
    return res


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _plugin_installed() -> bool:
    from importlib.metadata import entry_points

    return any(ep.name == "hygon" for ep in entry_points(group="vllm.general_plugins"))


def run_demo(*, model_dir: Optional[str] = None, timeout: float = 900.0, out=None,
             impl: Optional[str] = None) -> int:
    """Build the tiny model, generate with hygon and with vLLM's default backend, print
    both and whether they match. Returns 0 on a token-for-token match, 1 otherwise
    (2 when vLLM or the plugin's entry point is missing).

    impl: what the hygon run executes (``HYGON_ATTN_IMPL``). Default: the environment's
    ``HYGON_ATTN_IMPL`` if set, else ``"triton"``: our Triton kernels, natively on a GPU
    and in Triton's interpreter on a CPU (slower, but the kernels themselves).
    ``"reference"`` runs the plain-torch fallback."""
    if impl is None:
        from hygon_attn_backend import envs

        impl = envs.impl(default="triton")
    out = out or sys.stdout
    try:
        import vllm  # noqa: F401
    except ImportError:
        print(f"hygon-attn demo: needs vLLM, not installed: pip install '{needs.VLLM}'",
              file=out)
        return 2
    if not _plugin_installed():
        print("hygon-attn demo: the 'hygon' vllm.general_plugins entry point is not "
              "installed (pip install the package, e.g. pip install -e .).", file=out)
        return 2
    with tempfile.TemporaryDirectory(prefix="hygon-tiny-llama-") as tmp:
        model_dir = model_dir or build_tiny_llama(os.path.join(tmp, "model"))
        print(f"tiny Llama: {model_dir} (hidden {HIDDEN}, {LAYERS} layers, {HEADS}/{KV_HEADS} "
              f"heads, head_dim {HEAD_DIM}, vocab {VOCAB_SIZE})", file=out)
        ours = _run_child(model_dir, "hygon", timeout, impl=impl)
        theirs = _run_child(model_dir, None, timeout)
    print(f"hygon run: {ours['kernels']}", file=out)
    same = ours["tokens"] == theirs["tokens"]
    rows = zip(ours["tokens"], theirs["tokens"], theirs["gaps"])
    for i, (a, b, gaps) in enumerate(rows):
        verdict = "same"
        if a != b:
            step = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            gap = gaps[step] if step < len(gaps) else float("nan")
            verdict = (f"DIFFERENT from step {step} (default backend's top-2 logprob gap "
                       f"there: {gap:.4f})")
        print(f"prompt {i}: hygon   {a}\n          default {b}  {verdict}", file=out)
    smallest = min((g for gaps in theirs["gaps"] for g in gaps), default=float("nan"))
    print(f"smallest top-2 logprob gap of the default backend: {smallest:.4f}", file=out)
    print(f"outputs match token for token: {'yes' if same else 'NO'}", file=out)
    return 0 if same else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", metavar="MODEL_DIR", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="default", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help="use this model instead of building one")
    parser.add_argument("--impl", choices=["auto", "triton", "reference"], default=None,
                        help="what the hygon run executes (default: triton)")
    args = parser.parse_args(argv)
    if args.child:
        backend = None if args.backend == "default" else args.backend
        tokens = _generate(args.child, backend)
        with open(args.result, "w") as f:
            json.dump(tokens, f)
        return 0
    return run_demo(model_dir=args.model_dir, impl=args.impl)


if __name__ == "__main__":
    sys.exit(main())
