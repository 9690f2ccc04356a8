#!/usr/bin/env bash
# The native kernels on a GPU machine, in one go: build (hygon-attn build-native), the
# GPU tests of tests/test_native.py, the Triton-vs-native decode benchmark, and
# compute-sanitizer memcheck + racecheck on scripts/native_sanitize.py (when the
# sanitizer works on this machine). Logs go to $OUT (default ./native-gpu-logs).
#
# Usage: scripts/gpu_native_run.sh [BENCH_REP_MS]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/native-gpu-logs}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/hab-ext}
PY=${PYTHON:-python3}
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }

stamp "build"
timeout 240 "$PY" -m hygon_attn_backend build-native >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
tail -1 "$OUT/build.log"
stamp "tests"
timeout 180 "$PY" -m pytest -q tests/test_native.py -m gpu -p no:cacheprovider >"$OUT/tests.log" 2>&1
grep -E "passed|failed|error" "$OUT/tests.log" | tail -3
grep -E "^FAILED" "$OUT/tests.log" | head -20
stamp "bench"
timeout 240 "$PY" scripts/bench_native_decode.py --rep-ms "${1:-50}" --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
stamp "sanitizer"
if command -v compute-sanitizer >/dev/null; then
  for tool in memcheck racecheck; do
    timeout "${SAN_TIMEOUT:-55}" compute-sanitizer --tool "$tool" "$PY" scripts/native_sanitize.py >"$OUT/sanitize_$tool.log" 2>&1
    echo "$tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|done' "$OUT/sanitize_$tool.log" | tr '\n' ' ')"
  done
else
  echo "compute-sanitizer not found"
fi
stamp "done"
