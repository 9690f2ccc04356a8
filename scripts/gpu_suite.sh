#!/usr/bin/env bash
# Run every GPU-marked test plus the ops demo on a CUDA machine (no engines needed), with
# logs under ${OUT:-/tmp/hygon-gpu} (junit XML and the full pytest log).
# Usage: [PYTHON=python3] scripts/gpu_suite.sh [extra pytest args]   (make gpu-test)
# Without a GPU it says so in one line and exits 1, before anything runs.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
GPU_CHECK='
try:
    import torch
except ImportError:
    raise SystemExit("has no torch")
if not torch.cuda.is_available():
    raise SystemExit(f"has torch {torch.__version__}, which sees no CUDA or ROCm device")'
if ! why=$("$PY" -c "$GPU_CHECK" 2>&1); then
  echo "gpu-test: no GPU here: $PY ${why:-cannot run}; run it on a GPU machine, or name a Python with GPU torch: PYTHON=... make gpu-test" >&2
  exit 1
fi
OUT=${OUT:-/tmp/hygon-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
"$PY" -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))' | tee "$OUT/versions.txt"
"$PY" -m hygon_attn_backend doctor 2>&1 | tee "$OUT/doctor.txt"
"$PY" -m hygon_attn_backend demo --ops 2>&1 | tee "$OUT/demo_ops.txt"
demo_rc=${PIPESTATUS[0]}
"$PY" -m pytest -q -rs -m gpu --junitxml="$OUT/gpu-junit.xml" "$@" tests 2>&1 | tee "$OUT/gpu-pytest.log"
rc=${PIPESTATUS[0]}
echo "demo rc=$demo_rc pytest rc=$rc"
exit $(( rc != 0 || demo_rc != 0 ))
