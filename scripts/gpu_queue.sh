#!/usr/bin/env bash
# Several GPU checks and benchmarks in one call of a lent GPU machine, each under its own
# time limit, logs and JSON under $OUT (default ./gpu-logs), a short summary per step.
#
# Usage: scripts/gpu_queue.sh STEP[=SECONDS] ...
# Steps:
#   native-build    hygon-attn build-native, in the background (joined by the next native-*)
#   prefill-tests   the GPU tests of the prefill, bounds, launch and vLLM-core kernels
#   native-tests    tests/test_native.py on the GPU
#   native-prefill-tests  tests/test_native_prefill.py (stops at the first failure)
#   native-prefill-bench  bench prefill --impl triton,native on $PREFILL_SHAPES ($PREFILL_PAGES,
#                   $PREFILL_SOURCE, $PREFILL_REP_MS, $PREFILL_IMPLS, peers $PREFILL_COMPARE)
#   gpu-tests       the GPU tests of $TESTS (test files), 8 processes
#   native-bench    scripts/bench_native_decode.py (Triton beside native; $NATIVE_REP_MS, default 50;
#                   $NATIVE_ARGS, e.g. "--l2-flush read --variants triton,native,native_ef")
#   native-sanitize compute-sanitizer memcheck + racecheck on scripts/native_sanitize.py
#   overhead        hygon-attn bench overhead --repeats 5 (host cost a call; the prefill rows
#                   with the native and the Triton kernels where both run)
#   prefill-tiles   bench prefill over the tile sweep in $PREFILL_TILES, page 16 and 64
#   decode-bench    bench decode (default shapes, same-bytes copy rows; $DECODE_ARGS, default
#                   --impl triton,native; SGLang importable for --compare when .whl/ is carried)
#   decode-bench-read  the same with the L2 evicted by a read (--l2-flush read)
#   decode-sweep    bench decode of Triton at $SWEEP_SHAPES with $SWEEP_HEADS (Hq/Hkv), once per
#                   ';'-separated environment assignment in $SWEEP_ENVS ('-': none), partitions
#                   $SWEEP_PARTITIONS (default auto,none), pages $SWEEP_PAGES (default 16); steps run one after another, never
#                   beside another GPU step (a concurrent step skews the ceilings)
#   engine          hygon-attn bench engine $ENGINE_ARGS (SGLang from the wheels in .whl/, carried
#                   as ../shared/tools/sglang_gpu/README.md says; results under $OUT/engine)
#   sglang-tests    the SGLang backend, kit, radix, warm-up, register and shim tests (whole files,
#                   on CUDA) with SGLang from .whl/
#   sanitize        scripts/sanitize.sh (every Triton kernel, hostile inputs)
#   fuzz-prefill    hygon-attn fuzz --op prefill --seed 11 (--impl $FUZZ_IMPL, default triton)
#   fuzz-decode     hygon-attn fuzz --op decode --seed 11 --cases $FUZZ_CASES (default 2000;
#                   --impl $FUZZ_IMPL, default native: the native decode on every case it covers)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-logs}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/hab-ext}
PY=${PYTHON:-python3}
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
BUILD_PID=
PREFILL_TILES=${PREFILL_TILES:-"default;256,64,16,3;256,32,16,3;128,64,8,3;128,128,8,3"}
PREFILL_SHAPES=${PREFILL_SHAPES:-"1,0,8192;1,4096,4096;8,2048,512;32,1024,128;4,16384,1024"}
SWEEP_HEADS=${SWEEP_HEADS:-32/4}

# SGLang from the wheels in .whl/ (../shared/tools/sglang_gpu/README.md), installed once
install_sglang() {
  [ -d .whl ] || { echo "no .whl/ (carry the SGLang wheels)"; return 1; }
  [ -d /tmp/site/sglang ] && return 0
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    >"$OUT/sglang-install.log" 2>&1 || { tail -5 "$OUT/sglang-install.log"; return 1; }
  cp .whl/cutedsl_dual_gemm.py /tmp/site/sglang/kernels/ops/gemm/cutedsl_dual_gemm.py
  mkdir -p /tmp/stub && cp -r .whl/sgl_kernel /tmp/stub/
}

sglang_env() {
  export PYTHONPATH=$PWD:/tmp/site:/tmp/stub SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1 \
    SGLANG_FORCE_FUSED_OP_BACKEND=torch TVM_FFI_DISABLE_TORCH_C_DLPACK=1 NCCL_NVLS_ENABLE=0
}

# a pytest log's last line and its first failures
pytest_summary() { tail -1 "$1"; grep -E "^FAILED" "$1" | head -20; }

join_build() {
  if [ -n "$BUILD_PID" ]; then
    wait "$BUILD_PID"; echo "build rc=$? $(tail -1 "$OUT/native-build.log")"; BUILD_PID=
  fi
}

run_step() {
  local name=$1 limit=$2
  stamp "$name (limit $limit s)"
  case $name in
    native-build)
      timeout "$limit" "$PY" -m hygon_attn_backend build-native >"$OUT/native-build.log" 2>&1 &
      BUILD_PID=$! ;;
    prefill-tests)
      timeout "$limit" "$PY" -m pytest -q -m gpu -n 10 -p no:cacheprovider \
        tests/test_prefill.py tests/test_bounds.py tests/test_vllm_core_kernels.py \
        tests/test_launch.py >"$OUT/$name.log" 2>&1
      pytest_summary "$OUT/$name.log" ;;
    gpu-tests)
      join_build
      # shellcheck disable=SC2086
      timeout "$limit" "$PY" -m pytest -q -m gpu -n 8 -p no:cacheprovider ${TESTS:-tests} \
        >"$OUT/$name.log" 2>&1
      pytest_summary "$OUT/$name.log" ;;
    native-tests)
      join_build
      timeout "$limit" "$PY" -m pytest -q -m gpu -p no:cacheprovider tests/test_native.py \
        >"$OUT/$name.log" 2>&1
      pytest_summary "$OUT/$name.log" ;;
    native-prefill-tests)
      join_build
      timeout "$limit" "$PY" -m pytest -q -x -m gpu -p no:cacheprovider \
        tests/test_native_prefill.py >"$OUT/$name.log" 2>&1
      pytest_summary "$OUT/$name.log" ;;
    native-prefill-bench)
      join_build
      timeout "$limit" "$PY" -m hygon_attn_backend bench prefill --shapes "$PREFILL_SHAPES" \
        --block-sizes "${PREFILL_PAGES:-16,64}" --kv-source "${PREFILL_SOURCE:-both}" \
        --impl "${PREFILL_IMPLS:-triton,native}" --rep-ms "${PREFILL_REP_MS:-40}" \
        ${PREFILL_COMPARE:+--compare "$PREFILL_COMPARE"} \
        --json "$OUT/native-prefill-bench.json" --markdown "$OUT/native-prefill-bench.md" \
        >"$OUT/$name.log" 2>&1
      echo "rc=$?"; tail -40 "$OUT/$name.log" | cut -c1-200 ;;
    native-bench)
      join_build
      # shellcheck disable=SC2086
      timeout "$limit" "$PY" scripts/bench_native_decode.py --rep-ms "${NATIVE_REP_MS:-50}" \
        ${NATIVE_ARGS:-} --json "$OUT/native-bench.json" >"$OUT/$name.log" 2>&1
      echo "rc=$?"; tail -40 "$OUT/$name.log" ;;
    native-sanitize)
      join_build
      command -v compute-sanitizer >/dev/null || { echo "compute-sanitizer not found"; return 1; }
      for tool in memcheck racecheck; do
        timeout "$(( limit / 2 ))" compute-sanitizer --tool "$tool" "$PY" \
          scripts/native_sanitize.py >"$OUT/native-sanitize-$tool.log" 2>&1
        echo "$tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|done' \
          "$OUT/native-sanitize-$tool.log" | tr '\n' ' ')"
      done ;;
    overhead)
      join_build
      timeout "$limit" "$PY" -m hygon_attn_backend bench overhead --repeats 5 \
        --json "$OUT/overhead.json" >"$OUT/$name.log" 2>&1
      echo "rc=$?"; tail -40 "$OUT/$name.log" | cut -c1-160 ;;
    prefill-tiles)
      timeout "$limit" "$PY" -m hygon_attn_backend bench prefill --shapes "$PREFILL_SHAPES" \
        --block-sizes 16,64 --kv-source both --tiles "$PREFILL_TILES" --rep-ms 40 \
        --json "$OUT/prefill-tiles.json" --markdown "$OUT/prefill-tiles.md" \
        >"$OUT/$name.log" 2>&1
      echo "rc=$?"; tail -60 "$OUT/$name.log" | cut -c1-160 ;;
    decode-bench|decode-bench-read)
      join_build
      local flush=write; [ "$name" = decode-bench-read ] && flush=read
      # shellcheck disable=SC2086
      (if [ -d .whl ] && install_sglang; then sglang_env; fi
       timeout "$limit" "$PY" -m hygon_attn_backend bench decode --l2-flush "$flush" \
         ${DECODE_ARGS:---impl triton,native} --rep-ms 40 --json "$OUT/$name.json" \
         --markdown "$OUT/$name.md") >"$OUT/$name.log" 2>&1
      echo "rc=$?"; tail -60 "$OUT/$name.log" | cut -c1-160 ;;
    decode-sweep)
      local IFS_OLD=$IFS; IFS=';'; local envs=(${SWEEP_ENVS:--}); IFS=$IFS_OLD
      local t_end=$(( $(date +%s) + limit ))
      for assign in "${envs[@]}"; do
        local left=$(( t_end - $(date +%s) ))
        [ "$left" -le 5 ] && { echo "decode-sweep: out of time before '$assign'"; break; }
        local log="$OUT/decode-sweep-${assign//[^A-Za-z0-9]/_}.log"
        # shellcheck disable=SC2086
        (if [ "$assign" != "-" ]; then export $assign; fi
         timeout "$left" "$PY" -m hygon_attn_backend bench decode --impl triton \
           --shapes "${SWEEP_SHAPES:-64,4096;64,16384;256,2048}" \
           --num-q-heads "${SWEEP_HEADS%/*}" --num-kv-heads "${SWEEP_HEADS#*/}" --groups "" \
           --per-head-groups "" --block-sizes "${SWEEP_PAGES:-16}" \
           --partitions "${SWEEP_PARTITIONS:-auto,none}" --no-same-bytes-copy \
           --rep-ms 30) >"$log" 2>&1
        echo "== $assign"; grep -E "^\| B=" "$log" | cut -c1-140
      done ;;
    engine)
      install_sglang || return 1
      # shellcheck disable=SC2086
      (sglang_env
       timeout "$limit" "$PY" -m hygon_attn_backend bench engine ${ENGINE_ARGS:-} \
         --out "$OUT/engine" --csv "$OUT/engine.csv") >"$OUT/$name.log" 2>&1
      echo "rc=$?"; tail -40 "$OUT/$name.log" | cut -c1-200 ;;
    sglang-tests)
      install_sglang || return 1
      (sglang_env
       timeout "$limit" "$PY" -m pytest -q -n 10 -p no:cacheprovider tests/test_sglang_backend.py \
         tests/test_sglang_kit.py tests/test_sglang_radix.py tests/test_sglang_warmup.py \
         tests/test_sglang_register.py tests/test_shims.py) >"$OUT/$name.log" 2>&1
      pytest_summary "$OUT/$name.log" ;;
    sanitize)
      OUT="$OUT/sanitize" timeout "$limit" scripts/sanitize.sh >"$OUT/$name.log" 2>&1
      echo "rc=$?"; tail -8 "$OUT/$name.log" ;;
    fuzz-prefill)
      timeout "$limit" "$PY" -m hygon_attn_backend fuzz --op prefill --seed 11 --cases 400 \
        --impl "${FUZZ_IMPL:-triton}" >"$OUT/$name.log" 2>&1
      echo "rc=$?"; tail -6 "$OUT/$name.log" ;;
    fuzz-decode)
      join_build
      timeout -s INT "$limit" "$PY" -m hygon_attn_backend fuzz --op decode --seed 11 \
        --cases "${FUZZ_CASES:-2000}" --impl "${FUZZ_IMPL:-native}" >"$OUT/$name.log" 2>&1
      echo "rc=$?"; tail -6 "$OUT/$name.log" ;;
    *) echo "unknown step $name"; return 2 ;;
  esac
}

for arg in "$@"; do
  run_step "${arg%%=*}" "$( [ "$arg" != "${arg#*=}" ] && echo "${arg#*=}" || echo 120 )"
done
join_build
stamp "done"
