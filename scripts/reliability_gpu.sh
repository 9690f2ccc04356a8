#!/usr/bin/env bash
# The reliability record on a CUDA machine, in one command: the bounds/prefill/decode GPU
# tests, the fuzzer (CASES per op, the four ops as parallel shards on the one GPU) and
# scripts/sanitize.sh, side by side. Writes fuzz.log, pytest.log, sanitize.log and
# summary.txt under ${OUT:-/tmp/hygon-reliability}.
# Usage: scripts/reliability_gpu.sh [CASES] [SEED] [LIMIT_S]
#   FUZZ_OPS="decode prefill" (default: all four), SKIP_TESTS=1, SKIP_SANITIZE=1,
#   MPS=1 (start CUDA MPS first, so the shards' kernels share the GPU instead of
#   time-slicing it; falls back to plain processes if it does not start; not tried with
#   the sanitizer: pair it with SKIP_SANITIZE=1)
set -uo pipefail
cd "$(dirname "$0")/.."
CASES=${1:-10000}
SEED=${2:-1}
LIMIT=${3:-300}
OUT=${OUT:-/tmp/hygon-reliability}
mkdir -p "$OUT" /tmp/hygon-fuzz
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
start=$(date +%s)
if [ -n "${MPS:-}" ] && command -v nvidia-cuda-mps-control >/dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/hygon-mps CUDA_MPS_LOG_DIRECTORY=/tmp/hygon-mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if ! { nvidia-cuda-mps-control -d && timeout 60 "$PY" -c \
            "import torch; torch.ones(1, device='cuda').sum().item()"; }; then
        echo quit | nvidia-cuda-mps-control 2>/dev/null
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
        echo "MPS did not start: plain processes"
    fi
fi
# shards per op: each divides the op's profile count (fuzz.NUM_PROFILES: 32, 32, 24, 24), so a
# shard compiles only its own profiles' kernels (12 decode or 4 prefill for seed 1)
declare -A SHARDS=([decode]=8 [prefill]=8 [write_kv]=2 [copy_blocks]=1)
for op in ${FUZZ_OPS:-decode prefill write_kv copy_blocks}; do
    n=${SHARDS[$op]}
    for ((i = 0; i < n; i++)); do
        timeout -k 10 "$LIMIT" "$PY" -m hygon_attn_backend fuzz --op "$op" --cases "$CASES" \
            --seed "$SEED" --device cuda --shard "$i/$n" > "/tmp/hygon-fuzz/$op-$i.log" 2>&1 &
    done
done
if [ -z "${SKIP_SANITIZE:-}" ]; then
    OUT=/tmp/hygon-sanitize timeout "$LIMIT" scripts/sanitize.sh > /tmp/hygon-sanitize.txt 2>&1 &
fi
if [ -z "${SKIP_TESTS:-}" ]; then
    timeout "$LIMIT" "$PY" -m pytest -q -m gpu -n 4 tests/ops/test_bounds.py tests/ops/test_prefill.py \
        tests/ops/test_decode.py > "$OUT/pytest.log" 2>&1
fi
wait
{
    echo "# $(date -u +%F) $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
    "$PY" -c 'import torch, triton, sys; print("torch", torch.__version__, "triton", triton.__version__, "python", sys.version.split()[0])'
    echo "## pytest"; tail -n 3 "$OUT/pytest.log" 2>/dev/null
    echo "## fuzz (seed $SEED, $CASES cases per op)"
    cat /tmp/hygon-fuzz/*.log | grep -E "^fuzz " || echo "no fuzz summary (timed out?)"
    echo "failure lines printed: $(cat /tmp/hygon-fuzz/*.log | grep -c '^FAIL')"
    echo "## sanitizer"; cat /tmp/hygon-sanitize.txt 2>/dev/null
    echo "wall: $(( $(date +%s) - start )) s"
} > "$OUT/summary.txt" 2>&1
cat /tmp/hygon-fuzz/*.log | head -c 4000000 > "$OUT/fuzz.log"
cat /tmp/hygon-sanitize.txt /tmp/hygon-sanitize/*.log 2>/dev/null | head -c 4000000 > "$OUT/sanitize.log"
cat "$OUT/summary.txt"
