"""vLLM parallel runs of the tiny random Llama (``tools.demo.engine``), engine-side.

:func:`generate` runs one greedy generation (the demo's prompts: prefill, chunked
prefill, prefix-cache hits, decode) in a fresh Python process with the given parallel
sizes and attention backend and returns its tokens and the attention the workers ran;
the slow tests compare a parallel ``hygon`` run with a TP=1 run of vLLM's own CPU backend.

On a CPU host vLLM binds each worker's OpenMP threads to a NUMA node and refuses two
workers on one node; ``VLLM_CPU_OMP_THREADS_BIND`` with one core per worker (``0|1``)
lets two workers share a one-node machine (``tools.demo.engine.cpu_omp_bind``).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Optional

from hygon_attn_backend.tools.demo.engine import cpu_omp_bind
from tests import support

REPO = str(support.REPO)


def generate(model_dir: str, *, backend: Optional[str], options: Optional[dict] = None,
             impl: Optional[str] = None, timeout: float = 1500.0) -> dict:
    """Greedy tokens of the demo's prompts in a fresh process. ``options``: ``LLM``
    arguments (parallel sizes); ``impl``: ``HYGON_ATTN_IMPL`` of a hygon run. Returns
    ``{"tokens", "gaps", "kernels"}``, or raises ``RuntimeError`` with the log's tail
    (``"log"`` is kept for the error tests: see :func:`run_child`)."""
    rc, res, log = run_child(model_dir, backend=backend, options=options, impl=impl,
                             timeout=timeout)
    if rc != 0:
        raise RuntimeError(f"generation ({backend or 'default'}, {options}) failed "
                           f"(exit {rc}):\n{log[-8000:]}")
    found = re.search(r"hygon attention backend: (.*?) for layers", log)
    if backend == "hygon" and found is None:
        raise RuntimeError(f"the hygon backend's builder never ran:\n{log[-4000:]}")
    if backend is None and found is not None:
        raise RuntimeError("the default-backend run used the hygon backend")
    res["kernels"] = found.group(1) if found else "vLLM's default"
    return res


def run_child(model_dir: str, *, backend: Optional[str], options: Optional[dict] = None,
              impl: Optional[str] = None, timeout: float = 1500.0):
    """``(exit code, result or None, log)`` of one generation in a fresh process."""
    options = dict(options or {})
    workers = (options.get("tensor_parallel_size", 1)
               * options.get("pipeline_parallel_size", 1))
    env = dict(os.environ, VLLM_LOGGING_LEVEL="INFO")
    env["PYTHONPATH"] = os.pathsep.join(
        [REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    if workers > 1:
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_omp_bind(workers))
    if impl is not None:
        env["HYGON_ATTN_IMPL"] = impl
    with tempfile.NamedTemporaryFile("r", suffix=".json") as result:
        cmd = [sys.executable, "-m", "tests.support.vllm_parallel", model_dir,
               backend or "default", json.dumps(options), result.name]
        proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True, env=env,
                              cwd=REPO)
        log = proc.stdout + proc.stderr
        res = json.load(open(result.name)) if proc.returncode == 0 else None
    return proc.returncode, res, log


def _child(argv) -> int:
    from hygon_attn_backend.tools.demo import engine as demo

    model_dir, backend, options, result = argv
    out = demo._generate(model_dir, None if backend == "default" else backend,
                         json.loads(options))
    with open(result, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
