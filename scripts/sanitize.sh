#!/usr/bin/env bash
# compute-sanitizer memcheck, racecheck and initcheck over every Triton kernel of the
# package, then memcheck and racecheck over the native kernels (csrc/) where they build
# (scripts/sanitize_cases.py, without and with --native: in-range and hostile inputs), on a
# CUDA machine. Prints each tool's summary line; logs under ${OUT:-/tmp/hygon-sanitize}.
# The native racecheck is reported, not failed on: it flags the prefill's key-mask words,
# ordered by an mbarrier that racecheck does not follow through a try-wait (docs/reliability.md).
# Usage: scripts/sanitize.sh            (the three tools in parallel on the one GPU)
#        SANITIZE_SERIAL=1 scripts/sanitize.sh
#        SANITIZE_NATIVE=0 scripts/sanitize.sh   (the Triton kernels only)
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
run_tool() {  # run_tool TOOL NAME [ARGS]: the driver under one tool, its rc in NAME.rc
    local tool=$1 name=$2; shift 2
    compute-sanitizer --tool "$tool" --error-exitcode 3 --print-limit 20 \
        "$PY" scripts/sanitize_cases.py "$@" > "$OUT/$name.log" 2>&1
    echo $? > "$OUT/$name.rc"
}
summary() {  # summary NAME: its rc and the summary lines
    echo "$1: exit $(cat "$OUT/$1.rc"); $(grep -E "ERROR SUMMARY|RACECHECK SUMMARY|sanitize_cases:" \
        "$OUT/$1.log" | tr '\n' ' ')"
}
for tool in memcheck racecheck initcheck; do
    if [ -n "${SANITIZE_SERIAL:-}" ]; then run_tool $tool "sanitize-$tool"; else run_tool $tool "sanitize-$tool" & fi
done
wait
rc=0
for tool in memcheck racecheck initcheck; do
    summary "sanitize-$tool"
    [ "$(cat "$OUT/sanitize-$tool.rc")" = 0 ] || { rc=1; grep -m 20 -E "=========" "$OUT/sanitize-$tool.log"; }
done
if [ "${SANITIZE_NATIVE:-1}" != 0 ]; then
    if "$PY" -c 'from hygon_attn_backend import native; raise SystemExit(not native.available())'; then
        # warm the native kernels outside the sanitizer (and check the cases pass plainly)
        if "$PY" scripts/sanitize_cases.py --native > "$OUT/native-plain.log" 2>&1; then
            for tool in memcheck racecheck; do run_tool $tool "native-$tool" --native; done
            summary native-memcheck
            [ "$(cat "$OUT/native-memcheck.rc")" = 0 ] || { rc=1; grep -m 20 -E "=========" "$OUT/native-memcheck.log"; }
            summary native-racecheck
        else
            rc=1; echo "native: plain run failed:"; tail -n 20 "$OUT/native-plain.log"
        fi
    else
        echo "native: the native kernels are unavailable here (hygon-attn doctor says why); skipped"
    fi
fi
exit $rc
