#!/usr/bin/env bash
# Run every GPU-marked test plus the ops demo on a CUDA machine (no engines needed), with
# logs under ${OUT:-/tmp/hygon-gpu} (junit XML and the full pytest log).
# Usage: scripts/gpu_suite.sh [extra pytest args]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hygon-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))' | tee "$OUT/versions.txt"
python3 -m hygon_attn_backend doctor 2>&1 | tee "$OUT/doctor.txt"
python3 -m hygon_attn_backend demo --ops 2>&1 | tee "$OUT/demo_ops.txt"
demo_rc=${PIPESTATUS[0]}
python3 -m pytest -q -rs -m gpu --junitxml="$OUT/gpu-junit.xml" "$@" tests 2>&1 | tee "$OUT/gpu-pytest.log"
rc=${PIPESTATUS[0]}
echo "demo rc=$demo_rc pytest rc=$rc"
exit $(( rc != 0 || demo_rc != 0 ))
