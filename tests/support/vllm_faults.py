"""Child process of tests/test_engine_faults.py: vLLM greedy generation on the tiny demo
Llama under two engine faults, with the attention backend named on the command line.

1. Preemption with recompute: a KV cache of a few blocks (``num_gpu_blocks_override``)
   that cannot hold the batch, so the scheduler preempts running requests and later
   recomputes them (their generated tokens go through prefill again).
2. A request aborted mid-decode (``LLMEngine.abort_request``): the others must finish
   exactly as in a run without it.

Usage: python tests/support/vllm_faults.py MODEL_DIR BACKEND RESULT_JSON  (BACKEND: hygon|default)
Writes ``{"preempt": {"tokens", "gaps", "preemptions"}, "abort": {...}}``.
"""

from __future__ import annotations

import json
import sys

from hygon_attn_backend.tools.demo.engine import greedy_record

PREEMPT_BLOCKS = 6  # blocks of 32 tokens: the first three prompts take all six, and the
# first request needs a fourth block at its 27th token: the scheduler must preempt
MAX_TOKENS = 40
MAX_MODEL_LEN = 128  # the longest request is 70 + 40 tokens; 6 blocks hold 192


def _preemptions(llm) -> int:
    total = 0
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:num_preemptions"):
            total += int(getattr(metric, "value", 0))
    return total


def main(model_dir: str, backend: str, result: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from hygon_attn_backend.tools.demo import engine as demo

    prompts = demo.demo_prompts()[0]  # 70, 9, 41 and 1 tokens
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                            logprobs=2)
    common = dict(model=model_dir, tokenizer=model_dir, max_model_len=MAX_MODEL_LEN,
                  block_size=demo.BLOCK_SIZE, enable_prefix_caching=False,
                  max_num_batched_tokens=128, max_num_seqs=4, seed=demo.SEED,
                  enforce_eager=True, dtype=demo.DTYPE, disable_log_stats=False)
    if backend != "default":
        common["attention_backend"] = backend
    res = {}

    llm = LLM(num_gpu_blocks_override=PREEMPT_BLOCKS, **common)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                        use_tqdm=False)
    res["preempt"] = dict(greedy_record(outs), preemptions=_preemptions(llm))

    # abort: three requests decode together; the second is aborted after a few steps
    engine = llm.llm_engine
    for i, p in enumerate(prompts[:3]):
        engine.add_request(f"abort-{i}", TokensPrompt(prompt_token_ids=p), params)
    done, steps = [], 0
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
        steps += 1
        if steps == 6:
            engine.abort_request(["abort-1"])
    kept = sorted((o for o in done if o.request_id != "abort-1"), key=lambda o: o.request_id)
    res["abort"] = greedy_record(kept)
    res["abort"]["finished_ids"] = sorted(o.request_id for o in done)
    with open(result, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    main(*sys.argv[1:4])
