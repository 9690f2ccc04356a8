#!/usr/bin/env bash
# compute-sanitizer memcheck, racecheck and initcheck over every Triton kernel of the
# package (scripts/sanitize_cases.py: in-range and hostile inputs), on a CUDA machine.
# Prints each tool's summary line; logs under ${OUT:-/tmp/hygon-sanitize}.
# Usage: scripts/sanitize.sh            (the three tools in parallel on the one GPU)
#        SANITIZE_SERIAL=1 scripts/sanitize.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/hygon-sanitize}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
# every tensor its own cudaMalloc: an out-of-bounds access cannot hide in a neighbour
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTORCH_NO_CUDA_MEMORY_CACHING=1
if ! command -v compute-sanitizer >/dev/null; then
    echo "compute-sanitizer not found (CUDA toolkit's bin/ on PATH?)"; exit 2
fi
compute-sanitizer --version | tail -n 1
# warm Triton's compile cache outside the sanitizer (and check the cases pass plainly)
"$PY" scripts/sanitize_cases.py > "$OUT/sanitize-plain.log" 2>&1 || {
    echo "plain run failed:"; tail -n 20 "$OUT/sanitize-plain.log"; exit 1; }
run_tool() {
    compute-sanitizer --tool "$1" --error-exitcode 3 --print-limit 20 \
        "$PY" scripts/sanitize_cases.py > "$OUT/sanitize-$1.log" 2>&1
    echo $? > "$OUT/sanitize-$1.rc"
}
for tool in memcheck racecheck initcheck; do
    if [ -n "${SANITIZE_SERIAL:-}" ]; then run_tool $tool; else run_tool $tool & fi
done
wait
rc=0
for tool in memcheck racecheck initcheck; do
    code=$(cat "$OUT/sanitize-$tool.rc")
    summary=$(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|sanitize_cases:" "$OUT/sanitize-$tool.log" \
              | tr '\n' ' ')
    echo "$tool: exit $code; $summary"
    [ "$code" = 0 ] || { rc=1; grep -m 20 -E "=========" "$OUT/sanitize-$tool.log"; }
done
exit $rc
