# The two commands of the README. Each builds the CPU environment (.venv) first if it is
# missing, so both work on a fresh machine.
#   make demo       the vLLM demo (hygon-attn demo) in .venv
#   make test       the test suite in .venv
#   make env        only build .venv (CPU torch, Triton, vLLM's CPU build, SGLang)
#   make gpu-test   the GPU-marked tests, doctor and demo --ops on a GPU machine
#                   (scripts/gpu_suite.sh; PYTHON=... names a Python with GPU torch)
#   make clean-env  delete .venv
#   make compat     the engine-version matrix (scripts/compat/run.py): every vLLM/SGLang
#                   version in its own cached environment (COMPAT_CACHE, default
#                   ~/.cache/hygon-attn-compat); the recorded run is docs/compat.md.
#                   COMPAT_ARGS="--ci" runs the oldest and newest supported version of
#                   each engine only, "--markdown FILE" also writes the table there
VENV ?= .venv
PY := $(VENV)/bin/python
PYTHON ?= python3
COMPAT_CACHE ?= $(HOME)/.cache/hygon-attn-compat
COMPAT_ARGS ?=

.PHONY: demo test env gpu-test clean-env compat

$(VENV)/.hygon-env-ok: scripts/setup_cpu_env.sh requirements/sglang-0.5.23-cpu-nodeps.txt
	@echo "building the CPU environment in $(VENV) (first run only, 2-5 minutes)"
	scripts/setup_cpu_env.sh $(VENV)

env: $(VENV)/.hygon-env-ok

demo: env
	@echo "running hygon-attn demo"
	$(VENV)/bin/hygon-attn demo

test: env
	$(PY) -m pytest -q -rs tests

gpu-test:
	@PYTHON=$(PYTHON) scripts/gpu_suite.sh

clean-env:
	rm -rf $(VENV)

compat: env
	$(PY) scripts/compat/run.py --cache $(COMPAT_CACHE) $(COMPAT_ARGS)
