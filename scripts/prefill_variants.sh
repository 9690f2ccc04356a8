#!/usr/bin/env bash
# Build variants of the native prefill (csrc/prefill_sm90.cu's HAB_PREFILL_* switches) into
# stand-alone timing binaries (scripts/prefill_harness.cu), and run them on a GPU machine.
#
#   scripts/prefill_variants.sh build [NAME=DEFINES ...]   # here: nvcc only, no GPU needed
#                                      [NAME=@REV ...]       # the kernel as committed at REV
#   scripts/prefill_variants.sh run "B,PREFIX,EXTEND[,HQ,HKV,PAGE,DENSE];..." [NAME ...]
#
# Binaries go to build/harness/ (carry it to the GPU machine). With no NAME=DEFINES the
# build makes the default set below; `run` with no NAME runs every binary there, one after
# another (never two at once: they would share the GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=build/harness
DEFAULT=(
  "base="
  "stages2=-DHAB_PREFILL_STAGES=2"
  "regs56=-DHAB_PREFILL_PRODUCER_REGS=56"
  "regs80=-DHAB_PREFILL_PRODUCER_REGS=80"
  "nostore=-DHAB_PREFILL_DIAG_NOSTORE"
  "trace=-DHAB_PREFILL_TRACE"
)
case ${1:-} in
  build)
    shift
    NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
    # the static CUDA runtime next to nvcc (a toolkit whose lib/ the linker does not search)
    LINK=()
    for lib in "$(dirname "$(dirname "$NVCC")")"/lib "$(dirname "$(dirname "$NVCC")")"/lib64; do
      [ -e "$lib/libcudart_static.a" ] && LINK+=("-L$lib")
    done
    mkdir -p "$DIR"
    specs=("$@")
    [ ${#specs[@]} -gt 0 ] || specs=("${DEFAULT[@]}")
    pids=()
    for spec in "${specs[@]}"; do
      name=${spec%%=*} defs=${spec#*=} src=csrc/prefill_sm90.cu
      if [[ $defs == @* ]]; then  # NAME=@REV: that revision's kernel (with today's headers)
        src=$DIR/$name.src.cu
        git show "${defs#@}:csrc/prefill_sm90.cu" >"$src"
        defs=
      fi
      # shellcheck disable=SC2086
      "$NVCC" -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -I csrc $defs \
        scripts/prefill_harness.cu "$src" "${LINK[@]}" -o "$DIR/$name" >"$DIR/$name.ptxas" 2>&1 &
      pids+=($!)
    done
    rc=0
    for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
    for spec in "${specs[@]}"; do
      name=${spec%%=*}
      echo "$name: $(grep -c 'spill stores' "$DIR/$name.ptxas") kernels, max spill" \
        "$(grep -o '[0-9]* bytes spill stores' "$DIR/$name.ptxas" | sort -n | tail -1)"
    done
    exit $rc ;;
  run)
    shapes=$2
    shift 2
    names=("$@")
    if [ ${#names[@]} -eq 0 ]; then
      for f in "$DIR"/*; do [[ $f == *.ptxas || $f == *.src.cu ]] || names+=("$(basename "$f")"); done
    fi
    IFS=';' read -ra list <<<"$shapes"
    for shape in "${list[@]}"; do
      IFS=',' read -ra a <<<"$shape"
      for name in "${names[@]}"; do
        printf '%-14s ' "$name"
        timeout 120 "$DIR/$name" "${a[0]}" "${a[1]}" "${a[2]}" "${a[3]:-32}" "${a[4]:-8}" \
          "${a[5]:-16}" "${a[6]:-0}" "${REPS:-30}" || echo "  (rc=$?)"
      done
    done ;;
  *) sed -n 2,10p "$0"; exit 2 ;;
esac
