# The two commands of the README. Each builds the CPU environment (.venv) first if it is
# missing, so both work on a fresh machine.
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: demo test env gpu-test clean-env

$(VENV)/.hygon-env-ok: scripts/setup_cpu_env.sh requirements/sglang-0.5.23-cpu-nodeps.txt
	@echo "building the CPU environment in $(VENV) (first run only, 2-5 minutes)"
	scripts/setup_cpu_env.sh $(VENV)

env: $(VENV)/.hygon-env-ok

demo: env
	@echo "running hygon-attn demo"
	$(VENV)/bin/hygon-attn demo

test: env
	$(PY) -m pytest -q -rs tests

clean-env:
	rm -rf $(VENV)
