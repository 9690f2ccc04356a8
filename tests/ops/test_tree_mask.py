"""Speculative verify's tree masks (``ops/tree_mask.py``) through the prefix prefill and
the multi-token decode.

The packed mask's helpers against brute force; the reference's tree rule against the
causal one (a chain is the causal mask); the Triton kernel against the fp64 reference on
random trees (dense new K/V as SGLang passes them, and every key in the cache as vLLM
writes it), GQA, pages 1 / 4 / 16, more than 32 drafts (two words a row), soft cap and
sinks; and the named errors of bad masks. CPU: the interpreter at tiny shapes (fp16);
GPU: real sizes in bf16.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops.decode import paged_decode_attention, plan_paged_decode
from hygon_attn_backend.ops.prefill import plan_prefix_prefill, prefix_prefill_attention
from hygon_attn_backend.ops.tree_mask import pack_tree_mask, tree_mask_from_parents
from tests.ops.test_decode import blocks_needed, make_cache, make_table
from tests.ops.test_decode import run_case as run_decode_case
from tests.ops.test_prefill import Case, make_inputs, run_case

gpu = pytest.mark.gpu


def random_parents(num_seqs: int, drafts: int, *, seed: int, chain: bool = False):
    """``[B, T]`` parents: draft ``i`` extends a random earlier draft (or the prefix)."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.empty((num_seqs, drafts), dtype=torch.int64)
    for i in range(drafts):
        if chain:
            parents[:, i] = i - 1
        else:
            parents[:, i] = torch.randint(-1, i, (num_seqs,), generator=gen) if i else -1
    return parents


def brute_visible(parents: torch.Tensor) -> torch.Tensor:
    num_seqs, drafts = parents.shape
    vis = torch.zeros((num_seqs * drafts, drafts), dtype=torch.bool)
    for b in range(num_seqs):
        for i in range(drafts):
            j = i
            while j >= 0:
                vis[b * drafts + i, j] = True
                j = int(parents[b, j])
    return vis


@pytest.mark.parametrize("drafts", [1, 3, 8, 31, 32, 33, 70])
def test_pack_unpack_roundtrip(drafts):
    """Packing then the reference's unpacking gives the dense mask back, bit 31 (the int32
    sign bit) and rows wider than one word included; bits past the words read as 0."""
    gen = torch.Generator().manual_seed(drafts)
    visible = torch.rand((5, drafts), generator=gen) < 0.5
    visible[:, -1] = True  # the last bit of every row set: bit 31 where drafts == 32
    packed = pack_tree_mask(visible)
    assert packed.dtype == torch.int32 and packed.shape == (5, -(-drafts // 32))
    assert torch.equal(reference.unpack_tree_mask(packed, drafts), visible)
    wider = reference.unpack_tree_mask(packed, drafts + 40)
    assert not wider[:, packed.shape[1] * 32:].any()


@pytest.mark.parametrize("seed", range(4))
def test_tree_from_parents_matches_brute_force(seed):
    parents = random_parents(3, 9, seed=seed)
    assert torch.equal(tree_mask_from_parents(parents), brute_visible(parents))


def test_tree_from_parents_refuses_bad_parents():
    with pytest.raises(ValueError, match="parents must satisfy"):
        tree_mask_from_parents(torch.tensor([[-1, 1, 0]]))  # a draft its own parent
    with pytest.raises(ValueError, match="parents must satisfy"):
        tree_mask_from_parents(torch.tensor([[-1, -2]]))


def test_reference_chain_is_causal():
    """A chain's tree mask (each draft sees itself and every earlier draft) gives exactly
    the causal reference; a branching tree gives something else."""
    case = Case("chain", (5, 9), (4, 4), group=2, page=4, head_dim=16, k_new=True, lse=False)
    args, kw = make_inputs(case, torch.device("cpu"))
    args = tuple(a.float() if a.is_floating_point() else a for a in args)
    kw = {k: (v.float() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    causal = reference.prefix_prefill_attention(*args, **kw)
    chain = pack_tree_mask(tree_mask_from_parents(random_parents(2, 4, seed=0, chain=True)))
    assert torch.equal(reference.prefix_prefill_attention(*args, tree_mask=chain, **kw), causal)
    tree = pack_tree_mask(tree_mask_from_parents(torch.tensor([[-1, 0, 0, 1]] * 2)))
    assert not torch.allclose(reference.prefix_prefill_attention(*args, tree_mask=tree, **kw),
                              causal)


CPU_TREE_CASES = [
    Case("tree_knew_p4", (5, 9), (4, 4), group=2, page=4, head_dim=32, k_new=True),
    Case("tree_cache_p4", (5, 9), (4, 4), group=2, page=4, head_dim=32),
    Case("tree_knew_p1_g4", (0, 13, 3), (6, 6, 6), group=4, page=1, head_dim=32, k_new=True),
    Case("tree_cache_p16_capsinks", (21, 2), (5, 5), group=2, page=16, head_dim=32,
         soft_cap=3.0, sinks=True),
    Case("tree_knew_two_words", (7,), (40,), group=1, page=4, head_dim=16, k_new=True),
]


def _tree_case(case: Case, device, seed: int):
    args, kw = make_inputs(case, device, seed=seed)
    drafts = max(case.extend)
    parents = random_parents(len(case.extend), drafts, seed=seed)
    kw["tree_mask"] = pack_tree_mask(tree_mask_from_parents(parents)).to(device)
    return args, kw


@pytest.mark.parametrize("case", CPU_TREE_CASES, ids=lambda c: c.name)
def test_tree_verify_triton_matches_reference(case, device):
    if device.type == "cuda":
        case = dataclasses.replace(case, dtype=torch.bfloat16)
    run_case(case, device, impl="triton", inputs=_tree_case(case, device, seed=1))


GPU_TREE_CASES = [
    Case("g_tree_knew", (4000, 17, 900, 1), (8, 8, 8, 8), group=4, kv_heads=8, page=16,
         head_dim=128, dtype=torch.bfloat16, k_new=True),
    Case("g_tree_cache", (4000, 17, 900, 1), (16, 16, 16, 16), group=8, kv_heads=2, page=64,
         head_dim=128, dtype=torch.bfloat16),
    Case("g_tree_wide", (3000, 5), (64, 64), group=4, kv_heads=2, page=1, head_dim=128,
         dtype=torch.float16, k_new=True),
]


@gpu
@pytest.mark.parametrize("case", GPU_TREE_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("impl", ["triton", "auto"])
def test_tree_verify_gpu(case, impl, device):
    """Real sizes; ``auto`` takes the Triton kernel for a tree (the native prefill has no
    tree mask)."""
    run_case(case, device, impl=impl, inputs=_tree_case(case, device, seed=2))


def _small(device):
    case = Case("bad", (5,), (4,), group=2, page=4, head_dim=16, k_new=True, lse=False)
    return make_inputs(case, device)


def test_tree_mask_bad_inputs(device):
    """Wrong shape, dtype or width, a window or a non-causal layer with a tree: a named
    ValueError at plan or launch, never a wrong answer."""
    args, kw = _small(device)
    good = pack_tree_mask(torch.tril(torch.ones(4, 4, dtype=torch.bool))).to(device)
    with pytest.raises(ValueError, match="tree_mask"):
        prefix_prefill_attention(*args, tree_mask=good[:3], **kw)
    with pytest.raises(ValueError, match="tree_mask"):
        prefix_prefill_attention(*args, tree_mask=good.to(torch.int64), **kw)
    with pytest.raises(ValueError, match="tree_mask"):
        prefix_prefill_attention(*args, tree_mask=good.new_zeros((4, 0)), **kw)
    with pytest.raises(ValueError, match="sliding window"):
        prefix_prefill_attention(*args, tree_mask=good, **{**kw, "sliding_window": 3})
    with pytest.raises(ValueError, match="causal"):
        prefix_prefill_attention(*args, tree_mask=good, **{**kw, "causal": False})
    wide = Case("wide", (5,), (40,), group=2, page=4, head_dim=16, k_new=True, lse=False)
    wargs, wkw = make_inputs(wide, device)
    narrow = torch.zeros((40, 1), dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="draft bits per row"):
        prefix_prefill_attention(*wargs, tree_mask=narrow, **wkw)
    q, _, _, _, cu, lens = args
    plan = plan_prefix_prefill(cu, lens, total_q=4, num_q_heads=4, num_kv_heads=2,
                               head_dim=16, tree_mask=good, impl="triton")
    with pytest.raises(ValueError, match="the tensor the plan was built with"):
        prefix_prefill_attention(*args, tree_mask=good.clone(), plan=plan, **kw)


# ---------------------------------------------------------------- the decode structure

def _decode_tree(num_seqs, drafts, device, seed):
    parents = random_parents(num_seqs, drafts, seed=seed)
    return pack_tree_mask(tree_mask_from_parents(parents)).to(device)


@pytest.mark.parametrize("seq_lens,drafts,group,page,partition", [
    ((9, 30), 4, 2, 4, None),
    ((40, 5, 17), 3, 4, 16, 16),      # split-KV: the drafts in the last partition
    ((33,), 8, 1, 1, 16),
    ((6, 70), 5, 5, 16, None),
])
def test_tree_verify_decode_matches_reference(seq_lens, drafts, group, page, partition,
                                              device):
    """The multi-token decode under a tree mask (drafts = each sequence's last T keys, in
    the cache) equals the fp64 reference, split over partitions or not."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    tree = _decode_tree(len(seq_lens), drafts, device, seed=sum(seq_lens))
    run_decode_case(num_kv_heads=2, group=group, head_dim=32, page_size=page, seq_lens=seq_lens,
             layout="bhsd", dtype=dtype, device=device, num_tokens=drafts,
             partition_size=partition, tree_mask=tree)


def test_reference_decode_chain_tree_is_causal(device):
    """The chain's tree mask gives the multi-token decode's causal answer; a branching
    tree does not."""
    seq_lens = (12, 7)
    nb = blocks_needed(seq_lens, 4)
    k, v = make_cache(nb, 2, 4, 16, "bhsd", torch.float32, device)
    table = make_table(seq_lens, 4, nb, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(2, 4, 4, 16, device=device)
    causal = reference.paged_decode_attention(q, k, v, table, lens)
    chain = pack_tree_mask(tree_mask_from_parents(random_parents(2, 4, seed=0, chain=True)))
    assert torch.equal(reference.paged_decode_attention(q, k, v, table, lens,
                                                        tree_mask=chain.to(device)), causal)
    tree = pack_tree_mask(tree_mask_from_parents(torch.tensor([[-1, 0, 0, 1]] * 2)))
    assert not torch.allclose(reference.paged_decode_attention(
        q, k, v, table, lens, tree_mask=tree.to(device)), causal)


@gpu
@pytest.mark.parametrize("impl", ["triton", "auto"])
def test_tree_verify_decode_gpu(impl, device):
    """Real sizes: 32 sequences of 2-9k keys, 8 drafts, GQA 4; ``auto`` runs Triton (the
    native decode has no tree mask)."""
    gen = torch.Generator().manual_seed(5)
    seq_lens = tuple(int(x) for x in torch.randint(2000, 9000, (32,), generator=gen))
    tree = _decode_tree(32, 8, device, seed=5)
    run_decode_case(num_kv_heads=8, group=4, head_dim=128, page_size=16, seq_lens=seq_lens,
             layout="bhsd", dtype=torch.bfloat16, device=device, num_tokens=8,
             tree_mask=tree, impl=impl)


@gpu
def test_tree_verify_decode_gpu_narrow_head(device):
    """A 32-wide head under 64 query rows a KV head (16 drafts x GQA 4): the tile shape
    whose 32-wide value accumulator the ragged prefill got wrong on an H100
    (``ops._device.head_tile``)."""
    seq_lens = (300, 1500, 77, 4000)
    tree = _decode_tree(len(seq_lens), 16, device, seed=7)
    run_decode_case(num_kv_heads=2, group=4, head_dim=32, page_size=16, seq_lens=seq_lens,
             layout="bhsd", dtype=torch.float16, device=device, num_tokens=16,
             tree_mask=tree, impl="triton")


def test_tree_verify_decode_bad_inputs(device):
    seq_lens = (9, 30)
    nb = blocks_needed(seq_lens, 4)
    k, v = make_cache(nb, 2, 4, 16, "bhsd", torch.float16, device)
    table = make_table(seq_lens, 4, nb, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    q = torch.randn(2, 4, 4, 16, dtype=torch.float16, device=device)
    good = _decode_tree(2, 4, device, seed=0)
    with pytest.raises(ValueError, match="tree_mask"):
        paged_decode_attention(q, k, v, table, lens, tree_mask=good[:7])
    with pytest.raises(ValueError, match="tree_mask"):
        paged_decode_attention(q, k, v, table, lens, tree_mask=good.to(torch.int64))
    with pytest.raises(ValueError, match="sliding window"):
        paged_decode_attention(q, k, v, table, lens, tree_mask=good, sliding_window=4)
    plan = plan_paged_decode(table, lens, num_q_heads=4, num_kv_heads=2, head_dim=16,
                             page_size=4, q_dtype=q.dtype, kv_dtype=k.dtype, num_tokens=4,
                             tree_mask=good, impl="triton")
    with pytest.raises(ValueError, match="the tensor the plan was built with"):
        paged_decode_attention(q, k, v, table, lens, tree_mask=good.clone(), plan=plan)
