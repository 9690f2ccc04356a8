"""The RadixCache story: SGLang's own RadixCache, ReqToTokenPool, MHATokenToKVPool and
allocators, driven like the scheduler drives them, with our backend doing the attention.

Every extend over a cached prefix is checked against a full recompute of the sequence
(dense causal attention from scratch, float64), within a small multiple of the error the
same recompute makes in the model dtype. On CPU float32 runs the reference and float16 the
Triton kernels under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1).
"""

import random

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.radix_cache")

from sglang.srt.mem_cache.base_prefix_cache import EvictParams  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from tests.support.budget import assert_within_budget  # noqa: E402
from tests.support.sglang_harness import Server, TinyModel  # noqa: E402

PAGE_SIZES = (1, 16)
DTYPES = (torch.float32, torch.float16)
HEADS = dict(num_heads=4, num_kv_heads=2, head_dim=32)  # GQA group 2


def _tokens(rng, n):
    return [rng.randrange(1, 1000) for _ in range(n)]


def _check(server, req, out, positions, what):
    """``out`` (the backend's rows for ``positions`` of ``req``) equals a full recompute."""
    model = server.model
    ref64 = model.oracle(req.tokens[: max(positions) + 1], positions, dtype=torch.float64)
    ref_lowp = model.oracle(req.tokens[: max(positions) + 1], positions, dtype=model.dtype)
    assert_within_budget(out, ref64, ref_lowp, what=what)


def _server(page_size, dtype, device, seed=0, **kwargs):
    # on a CUDA machine SGLang's pools route writes to CUDA ops: build everything there
    model = TinyModel(dtype=dtype, seed=seed, device=device, **HEADS)
    return Server(model, page_size=page_size, seed=seed, **kwargs)


def _aligned(n, page_size):
    return n // page_size * page_size


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_multi_turn_chat_turn_two_hits_turn_one(page_size, dtype, device):
    rng = random.Random(1)
    srv = _server(page_size, dtype, device, seed=1)
    system, user1, user2 = _tokens(rng, 37), _tokens(rng, 11), _tokens(rng, 9)

    turn1 = srv.start(system + user1)
    assert turn1.cached_len == 0
    (out,) = srv.extend([turn1])  # (the harness also checks that the backend only reads)
    _check(srv, turn1, out, list(range(48)), "turn 1 prefill")
    for _ in range(5):
        (out,) = srv.decode([turn1], [rng.randrange(1, 1000)])
        _check(srv, turn1, out, [turn1.kv_len - 1], f"turn 1 decode at {turn1.kv_len - 1}")
    turn1_slots = srv.req_to_token_pool.req_to_token[turn1.row, : turn1.kv_len].clone()
    history = list(turn1.tokens)
    srv.finish(turn1)

    turn2 = srv.start(history + user2)
    assert turn2.cached_len == _aligned(len(history), page_size) > 0
    cached = turn2.cached_len
    assert torch.equal(srv.req_to_token_pool.req_to_token[turn2.row, :cached],
                       turn1_slots[:cached]), "turn 2 must read turn 1's KV slots"
    (out,) = srv.extend([turn2])
    _check(srv, turn2, out, list(range(cached, len(turn2.tokens))), "turn 2 extend over turn 1")
    (out,) = srv.decode([turn2], [7])
    _check(srv, turn2, out, [turn2.kv_len - 1], "turn 2 decode")
    srv.finish(turn2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_shared_few_shot_prefix_across_requests(page_size, dtype, device):
    rng = random.Random(2)
    srv = _server(page_size, dtype, device, seed=2)
    few_shot = _tokens(rng, 40)
    first = srv.start(few_shot + _tokens(rng, 7))
    srv.extend([first])
    srv.finish(first)

    # two requests in one ragged extend batch, both served the few-shot prefix by the tree
    b = srv.start(few_shot + _tokens(rng, 12))
    c = srv.start(few_shot + _tokens(rng, 3))
    shared = _aligned(40, page_size)
    assert b.cached_len == c.cached_len == shared
    r2t = srv.req_to_token_pool.req_to_token
    assert torch.equal(r2t[b.row, :shared], r2t[c.row, :shared])
    out_b, out_c = srv.extend([b, c])
    _check(srv, b, out_b, list(range(shared, len(b.tokens))), "request B over the shared prefix")
    _check(srv, c, out_c, list(range(shared, len(c.tokens))), "request C over the shared prefix")

    # a mixed batch: B decodes one token while D (same prefix) prefills
    d = srv.start(few_shot + _tokens(rng, 9))
    assert d.cached_len == shared
    b.tokens.append(rng.randrange(1, 1000))
    out_b, out_d = srv.extend([b, d], mode=ForwardMode.MIXED)
    _check(srv, b, out_b, [len(b.tokens) - 1], "decode row of the mixed batch")
    _check(srv, d, out_d, list(range(shared, len(d.tokens))), "extend rows of the mixed batch")
    for req in (b, c, d):
        srv.finish(req)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_branch_splits_a_node_mid_edge(page_size, dtype, device):
    rng = random.Random(3)
    srv = _server(page_size, dtype, device, seed=3)
    x = _tokens(rng, 64)
    req_x = srv.start(x)
    srv.extend([req_x])
    srv.finish(req_x)
    root = srv.tree.root_node
    assert [len(ch.key) for ch in root.children.values()] == [64], "one 64-token edge"

    split = 27 if page_size == 1 else 32  # inside the edge (page-aligned for P > 1)
    y = srv.start(x[:split] + _tokens(rng, 16))
    assert y.cached_len == split
    (head,) = root.children.values()
    assert len(head.key) == split and [len(ch.key) for ch in head.children.values()] == [64 - split]
    (out,) = srv.extend([y])
    _check(srv, y, out, list(range(split, len(y.tokens))), "branch extend after the split")
    srv.finish(y)
    assert sorted(len(ch.key) for ch in head.children.values()) == sorted([64 - split, 16])

    # the split kept the tail's values: a request over all of x still reads x's slots
    z = srv.start(x + _tokens(rng, 5))
    assert z.cached_len == 64
    (out,) = srv.extend([z])
    _check(srv, z, out, list(range(64, len(z.tokens))), "extend across both halves of the split")
    srv.finish(z)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_locked_path_survives_eviction_pressure(page_size, device):
    rng = random.Random(4)
    srv = _server(page_size, torch.float32, device, seed=4, pool_tokens=256)
    for _ in range(3):  # evictable history
        r = srv.start(_tokens(rng, 48))
        srv.extend([r])
        srv.finish(r)
    base = _tokens(rng, 48)
    r = srv.start(base)
    srv.extend([r])
    srv.finish(r)

    live = srv.start(base + _tokens(rng, 6))  # locks the 48-token path while running
    assert live.cached_len == 48
    path = srv.path_slots(live.node).clone()
    free_before = srv.allocator.available_size()
    evicted = srv.tree.evict(EvictParams(num_tokens=10 ** 6)).num_tokens_evicted
    assert evicted == 3 * _aligned(48, page_size), "every unlocked leaf goes, nothing locked"
    assert srv.allocator.available_size() == free_before + evicted
    assert torch.equal(srv.path_slots(live.node), path)
    assert srv.tree.protected_size() == 48
    free_pages = set(srv.allocator.free_pages.tolist())
    assert not free_pages & set((path // page_size).tolist()), "a locked slot was freed"

    # pressure: a new request takes the freed slots and overwrites their KV
    other = srv.start(_tokens(rng, 120))
    assert other.cached_len == 0
    srv.extend([other])
    (out,) = srv.extend([live])
    _check(srv, live, out, list(range(48, len(live.tokens))), "locked prefix after eviction")
    (out,) = srv.decode([live], [5])
    _check(srv, live, out, [live.kv_len - 1], "decode on the locked prefix after eviction")
    srv.finish(live)
    srv.finish(other)


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_eviction_frees_leaves_only(page_size, monkeypatch, device):
    rng = random.Random(5)
    srv = _server(page_size, torch.float32, device, seed=5)
    stem = _tokens(rng, 32)
    for _ in range(3):
        r = srv.start(stem + _tokens(rng, 32))
        srv.extend([r])
        srv.finish(r)
    (node_stem,) = srv.tree.root_node.children.values()
    assert len(node_stem.key) == 32 and len(node_stem.children) == 3

    deleted = []
    real_delete = srv.tree._delete_leaf

    def delete_leaf(node):
        live_children = [c for c in node.children.values() if not c.evicted]
        assert not live_children, "eviction removed a node that still has children"
        deleted.append(node)
        real_delete(node)

    monkeypatch.setattr(srv.tree, "_delete_leaf", delete_leaf)
    total = srv.tree.total_size()
    for step in range(3):
        free_before = srv.allocator.available_size()
        got = srv.tree.evict(EvictParams(num_tokens=1)).num_tokens_evicted
        assert len(deleted) == step + 1 and got == 32 == len(deleted[-1].key)
        assert srv.allocator.available_size() == free_before + 32
        assert node_stem in srv.tree.root_node.children.values(), \
            "the shared stem went before its leaves"
    assert srv.tree.total_size() == total - 96
    got = srv.tree.evict(EvictParams(num_tokens=1)).num_tokens_evicted
    assert deleted[-1] is node_stem and got == 32 and srv.tree.total_size() == 0
