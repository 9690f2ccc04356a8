"""Speculative target verify on SGLang's own structures, in every supported SGLang version.

SGLang's speculative runner kits (``test_sglang_spec.py``) ship in newer wheels only (0.5.10
has none), so this drives ``HygonAttnBackend`` with a ``TARGET_VERIFY`` batch built as the
EAGLE worker builds one (``tests/support/sglang_harness.py``, ``Server.verify``): the
version's ``EagleVerifyInput`` with its flattened custom mask, the prefix lengths as
``seq_lens``, the drafts' slots in the request's ``req_to_token`` row over SGLang's
``RadixCache``, pools and allocators. Every draft row is checked against a float64
recompute under the same tree mask (prefix + ancestors + itself), within a small multiple
of the recompute's own error in the model dtype.
"""

import random

import pytest
import torch

pytest.importorskip("sglang.srt.speculative.eagle_info")

from tests.support.budget import assert_within_budget  # noqa: E402
from tests.support.sglang_harness import Server, TinyModel, dense_masked_attention  # noqa: E402

HEADS = dict(num_heads=8, num_kv_heads=2, head_dim=32)  # GQA group 4

#: draft parents (-1: the prefix's last token); the first is the chain SGLang builds for
#: topk 1, the second a tree of 8 as topk 2, 3 steps gives (two children at each level)
CHAIN = [-1, 0, 1, 2]
TREE = [-1, 0, 0, 1, 1, 2, 3, 5]


def _tokens(rng, n):
    return [rng.randrange(1, 1000) for _ in range(n)]


def _oracle(model, req, drafts, parents, mask, dtype):
    depth = []
    for p in parents:
        depth.append(0 if p < 0 else depth[p] + 1)
    _, kp, vp = model.qkv(req.tokens[:req.kv_len], range(req.kv_len))
    qd, kd, vd = model.qkv(drafts, [req.kv_len + d for d in depth])
    q = qd.view(-1, model.num_heads, model.head_dim)
    return dense_masked_attention(q, torch.cat([kp, kd]), torch.cat([vp, vd]), mask,
                                  scale=model.scale, dtype=dtype)


@pytest.mark.parametrize("parents", [CHAIN, TREE], ids=["chain4", "tree8"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_verify_rows_equal_the_masked_recompute(parents, page_size, device):
    rng = random.Random(page_size + len(parents))
    model = TinyModel(dtype=torch.float16, seed=5, device=device, **HEADS)
    srv = Server(model, page_size=page_size, seed=5)
    # request A prefilled and cached; B over A's prefix from the tree, then its own tail
    a = srv.start(_tokens(rng, 37))
    srv.extend([a])
    history = list(a.tokens)
    srv.finish(a)
    b = srv.start(history + _tokens(rng, 9))
    assert b.cached_len > 0
    srv.extend([b])
    c = srv.start(_tokens(rng, 21))
    srv.extend([c])
    reqs = [b, c]
    drafts = [_tokens(rng, len(parents)) for _ in reqs]
    outs, masks = srv.verify(reqs, drafts, parents)
    for r, toks, out, mask in zip(reqs, drafts, outs, masks):
        ref64 = _oracle(model, r, toks, parents, mask, torch.float64)
        ref16 = _oracle(model, r, toks, parents, mask, model.dtype)
        assert_within_budget(out, ref64, ref16, what=f"verify {parents} page {page_size}")
    # a tree row must not see its siblings: the causal chain answer differs
    if parents is TREE:
        r, toks, mask = reqs[0], drafts[0], masks[0]
        causal = torch.tril(torch.ones(len(parents), r.kv_len + len(parents),
                                       dtype=torch.bool), diagonal=r.kv_len)
        wrong = _oracle(model, r, toks, parents, causal, torch.float64)
        assert (outs[0].double().cpu() - wrong).abs().max() > 1e-2


def test_a_mask_of_the_wrong_size_is_refused(device, monkeypatch):
    model = TinyModel(dtype=torch.float16, seed=6, device=device, **HEADS)
    srv = Server(model, page_size=16, seed=6)
    r = srv.start(_tokens(random.Random(6), 20))
    srv.extend([r])
    from tests.support import sglang_harness

    real = sglang_harness._verify_input

    def short_mask(**given):
        given["custom_mask"] = given["custom_mask"][:-3]
        return real(**given)

    monkeypatch.setattr(sglang_harness, "_verify_input", short_mask)
    with pytest.raises(ValueError, match="custom_mask"):
        srv.verify([r], [[1, 2, 3, 4]], CHAIN)
