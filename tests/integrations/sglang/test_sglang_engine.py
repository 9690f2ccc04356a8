"""End to end: SGLang's offline Engine (scheduler process, UnifiedRadixCache, its pools)
with ``attention_backend="hygon"`` on a tiny local Llama, greedy tokens compared with
SGLang's ``torch_native`` backend (examples/sglang_offline.py). About three minutes on a
2-core CPU (two engine start-ups), hence ``slow``.
"""

import pytest

pytest.importorskip("sglang")

from tests.support.sglang_example import run_example  # noqa: E402


@pytest.mark.slow
def test_offline_engine_matches_torch_native():
    proc = run_example(["--compare", "torch_native" if not _has_cuda() else "triton"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("MATCH") for line in lines), proc.stdout
    cached = {line.split(":")[0]: int(line.split("cached")[1].split()[0])
              for line in lines if " cached " in line}
    assert cached["chat B turn 1"] > 0 and cached["chat A turn 2"] > 0, proc.stdout


def _has_cuda():
    import torch

    return torch.cuda.is_available()
