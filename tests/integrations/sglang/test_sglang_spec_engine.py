"""End to end: SGLang's speculative decoding with ``attention_backend="hygon"`` in SGLang's
offline Engine (its scheduler, speculative workers and RadixCache), on the tiny local Llama
of ``examples/sglang_offline.py`` (three rounds, cached prefixes extended).

Greedy speculative decoding is lossless, so each configuration's tokens must equal those of
hygon without speculation, and, where compared, those of SGLang's own ``triton`` backend
under the same speculative configuration. ``hygon`` runs the target's verify and draft
extend and the draft model's attention: SGLang refuses a draft backend its factory does not
know, so a run that generates went through ours (``draft_factory``).

On a CPU the kernels run in Triton's interpreter, and ``tests/support/sglang_cpu_spec``
(on ``PYTHONPATH`` here only) routes SGLang's non-attention speculative helpers, which on
its generic CPU path have no implementation, to SGLang's own Triton forms of them. About
eleven minutes on a 2-core CPU (fifteen engine start-ups), hence ``slow``.
"""

import os
import re

import pytest

from tests import support

pytest.importorskip("sglang.srt.speculative.eagle_worker_v2")

from tests.support.sglang_example import run_example  # noqa: E402

STAND_IN = os.path.join(str(support.REPO), "tests", "support", "sglang_cpu_spec")

#: (id, options of examples/sglang_offline.py, whether SGLang's triton backend is compared)
CASES = [
    ("ngram-chain-page16", ["--speculative-algorithm", "NGRAM"], False),
    # drafting with the target itself: drafts are accepted, verify steps take several tokens
    ("standalone-chain-page16", ["--speculative-algorithm", "STANDALONE"], False),
    ("eagle-chain-page16", ["--speculative-algorithm", "EAGLE"], False),
    # a draft tree (SGLang takes topk > 1 at page 1 only) whose deep paths are accepted
    ("standalone-tree-topk4-page1", ["--speculative-algorithm", "STANDALONE",
                                     "--speculative-eagle-topk", "4", "--page-size", "1"], True),
    ("eagle-tree-topk4-page1", ["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk",
                                "4", "--page-size", "1"], False),
    # a random EAGLE3 head over two of the target's hidden states
    ("eagle3-chain-page16", ["--speculative-algorithm", "EAGLE3"], False),
    # an MLA target: the chain verify on the MLA decode
    ("ngram-mla-page16", ["--speculative-algorithm", "NGRAM", "--model-kind", "deepseek"],
     False),
]


def _run(options, compare: bool):
    import torch

    proc = run_example([*options, "--max-new-tokens", "12", "--compare",
                        "triton" if compare else "none"],
                       extra_paths=[] if torch.cuda.is_available() else [STAND_IN])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("options,compare", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_speculative_tokens_equal_the_plain_run(options, compare):
    out = _run(options, compare)
    matches = [line for line in out.splitlines() if line.startswith(("MATCH", "MISMATCH"))]
    want = 2 if compare else 1
    assert len(matches) == want and all(m.startswith("MATCH") for m in matches), out
    assert "vs hygon without speculation" in out, out
    found = re.search(r"^hygon: accept length ([0-9.]+) \((\d+) tokens in (\d+) verify steps\)",
                      out, re.M)
    assert found, out
    accept, tokens, steps = float(found[1]), int(found[2]), int(found[3])
    assert tokens == 4 * 12 and steps > 0, out  # 12 tokens for each of the 4 prompts
    if "STANDALONE" in options:
        # drafts from the target are right: a verify step keeps more than its bonus token
        assert accept > 1.5, out
    cached = re.findall(r"^chat [ABC] turn \d: cached\s+(\d+)", out, re.M)
    assert len(cached) == 4 and int(cached[1]) > 0 and int(cached[3]) > 0, out
