"""Child process of ``test_vllm_spec.py``: greedy generation in vLLM's engine (in this
process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with ``attention_backend="hygon"``, once
without speculation and once per speculative configuration, recording every plan our
metadata builder makes (the step's query lengths, the decode plan's tokens a request,
whether a prefill plan was made). Writes one JSON file.

Usage: ``python -m tests.integrations.vllm.spec_child MODEL_DIR RESULT.json CONFIGS_JSON``
where CONFIGS_JSON is a list of vLLM ``speculative_config`` dicts (``null``: none).
"""

import gc
import json
import os
import sys

#: Prompts whose n-grams repeat (the n-gram drafter proposes from them), and the tokens
#: each generates: the longest runs alone at the end (uniform single-request batches).
PROMPTS = ([5, 17, 33, 80, 12, 9] * 4, [7, 8, 9, 10] * 5 + [3], [100, 101, 102] * 3)
MAX_TOKENS = (6, 6, 20)


def main(argv):
    model_dir, result_path, configs = argv[0], argv[1], json.loads(argv[2])
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from hygon_attn_backend.integrations.vllm import step

    plans = []
    real = step.plan_metadata

    def recorded(md, **kwargs):
        real(md, **kwargs)
        cu = kwargs.get("query_start_loc_cpu")
        plans.append({"query_lens": (cu[1:] - cu[:-1]).tolist() if cu is not None else None,
                      "decode_tokens": md.decode_plan.num_tokens if md.decode_plan else 0,
                      "prefill": md.prefill_plan is not None})

    step.plan_metadata = recorded
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    runs = []
    for spec in configs:
        plans.clear()
        kwargs = dict(model=model_dir, tokenizer=model_dir, max_model_len=256, block_size=32,
                      max_num_seqs=4, max_num_batched_tokens=256, seed=1, enforce_eager=True,
                      dtype="float16", attention_backend="hygon")
        if spec is not None:
            kwargs["speculative_config"] = spec
        llm = LLM(**kwargs)
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for n in MAX_TOKENS]
        out = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in PROMPTS], params,
                           use_tqdm=False)
        runs.append({"spec": spec, "tokens": [list(r.outputs[0].token_ids) for r in out],
                     "plans": list(plans)})
        del llm
        gc.collect()
    with open(result_path, "w") as f:
        json.dump(runs, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
