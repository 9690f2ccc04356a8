#!/usr/bin/env bash
# Serve a model with SGLang on the hygon attention backend, send two requests that share a
# prefix (the second is served partly from SGLang's radix cache), print the replies, stop.
#
#   examples/sglang_server.sh                         # tiny random Llama built locally
#   examples/sglang_server.sh /path/to/model [extra sglang.launch_server flags...]
#
# Needs the package installed (pip install -e .): SGLang's processes load the backend
# through the sglang.srt.plugins entry point, which adds "hygon" to --attention-backend
# (and to --prefill-attention-backend / --decode-attention-backend, e.g. hygon prefill
# with another decode backend). Without a GPU it runs on the CPU, our Triton kernels in
# Triton's interpreter (float16).
set -euo pipefail

PYTHON=${PYTHON:-python}
PORT=${PORT:-30123}
PAGE_SIZE=${PAGE_SIZE:-16}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/hygon-sglang-server.XXXXXX")
SERVER_PID=""
cleanup() {
  if [[ -n "$SERVER_PID" ]]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

MODEL=${1:-}
shift || true
if [[ -z "$MODEL" ]]; then
  MODEL="$WORK/model"
  "$PYTHON" -c "from hygon_attn_backend.tools.demo.engine import build_tiny_llama; build_tiny_llama('$MODEL')" >/dev/null
fi

DEVICE_FLAGS=()
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export TRITON_INTERPRET=1
  DEVICE_FLAGS=(--device cpu --disable-cuda-graph --max-total-tokens 4096 --context-length 256)
fi

"$PYTHON" -m sglang.launch_server --model-path "$MODEL" --attention-backend hygon \
  --page-size "$PAGE_SIZE" --dtype float16 --port "$PORT" --skip-tokenizer-init \
  "${DEVICE_FLAGS[@]}" "$@" >"$WORK/server.log" 2>&1 &
SERVER_PID=$!

for _ in $(seq 1 300); do
  if curl -sf "http://127.0.0.1:$PORT/health" >/dev/null; then break; fi
  if ! kill -0 "$SERVER_PID" 2>/dev/null; then tail -n 40 "$WORK/server.log"; exit 1; fi
  sleep 1
done
curl -sf "http://127.0.0.1:$PORT/health" >/dev/null || { tail -n 40 "$WORK/server.log"; exit 1; }
grep -m1 "hygon attention backend" "$WORK/server.log" || true

PREFIX="11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42"
for TAIL in "50, 51, 52" "60, 61, 62, 63, 64"; do
  curl -sf "http://127.0.0.1:$PORT/generate" -H 'Content-Type: application/json' \
    -d "{\"input_ids\": [$PREFIX, $TAIL], \"sampling_params\": {\"max_new_tokens\": 8, \"temperature\": 0}}" |
    "$PYTHON" -c 'import json, sys; r = json.load(sys.stdin); print("output_ids", r["output_ids"], "cached_tokens", r["meta_info"].get("cached_tokens"))'
done
