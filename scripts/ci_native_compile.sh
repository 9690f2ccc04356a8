#!/usr/bin/env bash
# Compile check of csrc/ for both vendors on a machine without a GPU (CI, 2 cores).
#
#   - every kernel file with nvcc 13.0 for sm_90a and sm_90, -Werror all-warnings
#   - every kernel file with hipcc (ROCm 5.2, clang 15) for gfx906 (wave 64, FMA path) and
#     gfx90a (MFMA path), -Wall -Werror
#   - binding.cpp with g++ against the CPU torch, -Wall -Werror; one .so per vendor linked
#     and loaded into torch (torch.ops.hygon_attn must hold every op)
#   - check_fastdiv.cpp and check_fp8.cpp built and run on the host (the page-size division
#     and the fp8 widening of the kernels)
#
# The tools install themselves: Debian's hipcc if missing (apt), the pinned CUDA 13.0 pip
# wheels into a venv under /tmp (the cu12 wheels hold no nvcc; the five must be pinned
# together). Device code is compiled with the optimizer off (nvcc -Xcicc -O0 -Xptxas -O0,
# hipcc -O0): this checks that every target compiles without a warning in a few minutes;
# the optimised build happens on the GPU machine (hygon_attn_backend/native.py).
#
# Usage: scripts/ci_native_compile.sh [PYTHON]   (default .venv/bin/python: CPU torch)
# Outputs: build/native-ci/{_hab_cuda.so,_hab_hip.so,*.log}; tests/native/test_native.py loads them.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${1:-$ROOT/.venv/bin/python}
OUT=$ROOT/build/native-ci
NVV=${HAB_NVCC_VENV:-/tmp/hab-nvcc-cu130}
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
START=$(date +%s)
cd "$ROOT"
mkdir -p "$OUT"
rm -f "$OUT"/*.o "$OUT"/*.so "$OUT"/*.log

if ! command -v hipcc >/dev/null; then
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends hipcc >/dev/null
fi
if [ ! -x "$NVV/bin/python" ] || ! "$NVV/bin/python" -c 'import nvidia.cu13' 2>/dev/null; then
  python3 -m venv "$NVV"
  "$NVV/bin/pip" install -q nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-nvvm==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
fi
CU=$("$NVV/bin/python" -c 'import nvidia.cu13; print(list(nvidia.cu13.__path__)[0])')
export HIP_PLATFORM=amd  # the image's /usr/local/cuda would make hipcc pick nvcc
echo "tools ready after $(( $(date +%s) - START )) s: $("$CU/bin/nvcc" --version | tail -1); $(hipcc --version 2>/dev/null | head -1)"

KERNELS=$(cd "$ROOT/csrc" && ls *.cu)
TORCH_INC=$("$PY" -c 'from torch.utils.cpp_extension import include_paths as p; print(" ".join("-isystem " + x for x in p()))')
TORCH_LIB=$("$PY" -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')

pids=()
names=()
job() {  # job NAME CMD...: run in the background, log to $OUT/NAME.log
  local name=$1; shift
  ( cd "$ROOT/csrc" && "$@" ) >"$OUT/$name.log" 2>&1 &
  pids+=($!); names+=("$name")
}
for f in $KERNELS; do
  b=${f%.cu}
  job "cuda_$b" "$CU/bin/nvcc" -std=c++17 -Xcompiler -fPIC -Werror all-warnings -Xcicc -O0 -Xptxas -O0 \
    -gencode=arch=compute_90a,code=sm_90a -gencode=arch=compute_90,code=sm_90 -c "$f" -o "$OUT/cuda_$b.o"
  job "hip_$b" hipcc --offload-arch=gfx906 --offload-arch=gfx90a -O0 -std=c++17 -Wall -Werror -fPIC \
    -c "$f" -o "$OUT/hip_$b.o"
done
job binding g++ -O1 -std=c++17 -fPIC -Wall -Werror $TORCH_INC -c binding.cpp -o "$OUT/binding.o"
# host check of the kernels' division by a multiplier (csrc/fastdiv.h), exhaustive per divisor
job fastdiv sh -c "g++ -O2 -std=c++17 -Wall -Werror check_fastdiv.cpp -o '$OUT/check_fastdiv' && '$OUT/check_fastdiv'"
# host check of the fp8 widening (csrc/fp8_widen.h): every code pair, both formats, both
# 16-bit types, and the device passes' byte-permute selectors
job fp8_widen sh -c "g++ -O2 -std=c++17 -Wall -Werror check_fp8.cpp -o '$OUT/check_fp8' && '$OUT/check_fp8'"

failed=0
for i in "${!pids[@]}"; do
  if ! wait "${pids[$i]}"; then
    echo "FAILED: ${names[$i]}"; cat "$OUT/${names[$i]}.log"; failed=1
  fi
done
[ "$failed" = 0 ] || exit 1
echo "compiled $(echo $KERNELS | wc -w) kernel files x (sm_90a+sm_90, gfx906+gfx90a) + binding in $(( $(date +%s) - START )) s"

g++ -shared "$OUT"/cuda_*.o "$OUT/binding.o" -L"$TORCH_LIB" -lc10 -ltorch_cpu -ltorch \
  -L"$CU/lib" -l:libcudart.so.13 -Wl,-rpath,"$CU/lib" -o "$OUT/_hab_cuda.so"
g++ -shared "$OUT"/hip_*.o "$OUT/binding.o" -L"$TORCH_LIB" -lc10 -ltorch_cpu -ltorch \
  -lamdhip64 -o "$OUT/_hab_hip.so"
for lib in _hab_cuda.so _hab_hip.so; do
  "$PY" - "$OUT/$lib" <<'EOF'
import sys
import torch
torch.ops.load_library(sys.argv[1])
from hygon_attn_backend.native import OPS
missing = [op for op in OPS if not hasattr(torch.ops.hygon_attn, op)]
assert not missing, f"{sys.argv[1]}: ops not registered: {missing}"
print(f"{sys.argv[1]}: torch.ops.hygon_attn has {', '.join(OPS)}")
EOF
done
echo "native compile check passed in $(( $(date +%s) - START )) s"
