"""What a command needs beyond torch, checked before it starts: a missing package is one
line naming it and the install command, never a traceback or a run of failed cases.

Triton's CPU interpreter (``TRITON_INTERPRET=1``, what the kernels run in on a machine
without a GPU) imports numpy, which neither torch nor Triton installs.
"""

from __future__ import annotations

import importlib.util
from typing import List, Optional

#: module -> the pip requirement that provides it
INTERPRETER_NEEDS = {"triton": "triton", "numpy": "numpy"}
#: what the install hints name: the same requirements as pyproject.toml's extras
#: (tests/test_packaging.py holds them equal)
VLLM = "vllm>=0.15,<0.35"
SGLANG = "sglang>=0.5.10,<0.6"
PLOT = "matplotlib"


def missing(needs: dict) -> List[str]:
    """The requirements of ``needs`` (``module -> requirement``) whose module is not
    installed here, in order. The modules are looked up, never imported: importing
    Triton before ``TRITON_INTERPRET`` is set fixes it to compiled kernels for the whole
    process, so a check made ahead of the interpreter must not."""
    out = []
    for module, requirement in needs.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package missing; a stubbed module
            found = False
        if not found and requirement not in out:
            out.append(requirement)
    return out


def interpreter_missing() -> List[str]:
    """What Triton's CPU interpreter needs and this environment lacks ([] when it runs)."""
    return missing(INTERPRETER_NEEDS)


def interpreter_problem(command: str) -> Optional[str]:
    """None when Triton's CPU interpreter can run here; else the one line ``command``
    (e.g. ``"hygon-attn fuzz"``) prints before exiting."""
    lacking = interpreter_missing()
    if not lacking:
        return None
    return (f"{command}: no GPU here, and Triton's CPU interpreter needs "
            f"{' and '.join(lacking)}, not installed: pip install {' '.join(lacking)}")
