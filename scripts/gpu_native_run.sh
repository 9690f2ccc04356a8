#!/usr/bin/env bash
# The native kernels on a GPU machine, in one go (scripts/gpu_queue.sh's native steps):
# build (hygon-attn build-native), the GPU tests of tests/test_native.py, the
# Triton-vs-native decode benchmark, and compute-sanitizer memcheck + racecheck on
# scripts/native_sanitize.py. Logs go to $OUT (default ./native-gpu-logs).
#
# Usage: scripts/gpu_native_run.sh [BENCH_REP_MS]
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
OUT=${OUT:-$root/native-gpu-logs} NATIVE_REP_MS=${1:-50} exec "$root/scripts/gpu_queue.sh" \
  native-build=240 native-tests=180 native-bench=240 native-sanitize=$(( 2 * ${SAN_TIMEOUT:-55} ))
