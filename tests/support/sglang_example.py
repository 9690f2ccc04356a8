"""Running ``examples/sglang_offline.py`` from the SGLang end-to-end tests: one engine
process a backend, so each test starts the example as a subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from tests.support import REPO

EXAMPLE = os.path.join(str(REPO), "examples", "sglang_offline.py")


def run_example(args, *, extra_paths=(), timeout: int = 1500,
                script: str = EXAMPLE) -> subprocess.CompletedProcess:
    """The example (``script``, default sglang_offline.py) with ``args``, the checkout (and
    ``extra_paths``) first on
    ``PYTHONPATH``; skips when the package is not installed (SGLang's scheduler processes
    find the backend through its entry point)."""
    if not [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "hygon"]:
        pytest.skip("package not installed (pip install -e .): SGLang's scheduler process "
                    "finds the backend through the entry point")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO), *map(str, extra_paths)]
        + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return subprocess.run([sys.executable, script, *args], capture_output=True, text=True,
                          env=env, timeout=timeout)
