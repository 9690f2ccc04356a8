"""Offline generation with vLLM running the hygon attention backend.

    python examples/vllm_offline.py                       # a tiny random Llama, built here
    python examples/vllm_offline.py --model /path/to/hf-model --dtype bfloat16

Needs vLLM 0.32 (CPU) or 0.33 (GPU) and this package installed (its
``vllm.general_plugins`` entry point registers the backend in every vLLM process).
On CPU the backend runs the plain-torch reference, or the Triton kernels in the
interpreter with ``TRITON_INTERPRET=1``; on a GPU, the Triton kernels.
"""

import argparse
import os
import tempfile


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a Hugging Face model folder or id (default: a "
                        "tiny random Llama built locally)")
    parser.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        prompts = ["The capital of France is", "Attention kernels on a DCU"]
        if model is None:
            from hygon_attn_backend.tools.demo.engine import build_tiny_llama

            model = build_tiny_llama(os.path.join(tmp, "tiny-llama"))
            prompts = ["w1 w2 w3 w4 w5", "w10 w20 w30"]  # its WordLevel vocabulary
        llm = LLM(model=model, dtype=args.dtype, max_model_len=256,
                  attention_backend="hygon")
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        for out in llm.generate(prompts, params):
            print(repr(out.prompt), "->", repr(out.outputs[0].text))


if __name__ == "__main__":  # vLLM spawns workers: keep the entry point guarded
    main()
