"""End to end with an MLA model: SGLang's offline Engine (scheduler process, radix cache,
its MLA latent pool) with ``attention_backend="hygon"`` on the tiny random-weight
DeepSeek-V2 (latent 512 + rope 64, YaRN; ``examples/sglang_offline.py --model-kind
deepseek``), greedy tokens compared with SGLang's own ``triton`` backend over the three
rounds of the example (cached system prompt, a second turn). On a CPU both run Triton
kernels in the interpreter. About four minutes on a 2-core CPU, hence ``slow``.
"""

import pytest

pytest.importorskip("sglang")

from tests.support.sglang_example import run_example  # noqa: E402


@pytest.mark.slow
def test_tiny_deepseek_matches_sglangs_triton_backend():
    proc = run_example(["--model-kind", "deepseek", "--max-new-tokens", "6"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("MATCH (hygon at TP=1 vs triton") for line in lines), \
        proc.stdout
    cached = {line.split(":")[0]: int(line.split("cached")[1].split()[0])
              for line in lines if " cached " in line}
    assert cached["chat B turn 1"] > 0 and cached["chat A turn 2"] > 0, proc.stdout
