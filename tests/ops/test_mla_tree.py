"""MLA decode of a speculative draft tree (``plan_mla_decode(tree_mask=...)``): the T
drafts of a request are its last T keys, each sees the keys before them and its ancestors
in the tree. Oracle: reference.py's MLA decode with the same packed mask, itself checked
against the dense paged decode's tree reference over the same keys (one KV head, K the
latent row, V its first ``kv_lora_rank`` columns).

CPU: the Triton kernel under the interpreter on tiny widths, fp16. GPU: DeepSeek's
512 + 64 rows, bf16, split and unsplit.
"""

import pytest
import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops.mla import mla_decode_attention, plan_mla_decode, tuning
from hygon_attn_backend.ops.tree_mask import tree_mask_from_parents, pack_tree_mask
from tests.ops.test_mla_decode import DEV, check_against_reference, make_batch
from tests.ops.test_tree_mask import random_parents
from tests.support.budget import assert_within_budget

HAS_CUDA = torch.cuda.is_available()


def _tree(num_seqs, drafts, seed, device=DEV):
    """A random draft tree's packed mask ``[B * T, 1]`` and its dense visibility."""
    visible = tree_mask_from_parents(random_parents(num_seqs, drafts, seed=seed))
    return pack_tree_mask(visible).to(device), visible


def test_reference_tree_equals_the_dense_tree_reference():
    """The MLA reference under a tree mask is the dense paged decode's tree reference over
    the same keys: one KV head, K the latent row, V its first kv_lora_rank columns."""
    torch.manual_seed(0)
    rank, rope, heads, drafts = 24, 8, 4, 5
    q, kv, table, lens = make_batch(seq_lens=[19, 5, 40], page_size=4, rank=rank, rope=rope,
                                    heads=heads, tokens=drafts, dtype=torch.float32,
                                    device="cpu")
    tree, _ = _tree(3, drafts, seed=1, device="cpu")
    got = reference.mla_decode_attention(q, kv, table, lens, kv_lora_rank=rank, scale=0.3,
                                         tree_mask=tree, compute_dtype=torch.float64)
    k_cache = kv[:, None]  # [num_blocks, 1, P, W]: one KV head
    v_cache = torch.nn.functional.pad(kv[..., :rank], (0, rope))[:, None]  # V, zero-padded
    want = reference.paged_decode_attention(q, k_cache, v_cache, table, lens, scale=0.3,
                                            tree_mask=tree, compute_dtype=torch.float64)
    torch.testing.assert_close(got, want[..., :rank].to(got.dtype), rtol=1e-6, atol=1e-6)
    chain = reference.mla_decode_attention(q, kv, table, lens, kv_lora_rank=rank, scale=0.3)
    assert not torch.allclose(got, chain)  # the tree is not the chain


@pytest.mark.parametrize("page,parts,drafts", [(16, 1, 3), (1, 3, 3), (4, 2, 6), (16, 1, 6),
                                               (16, 2, 40)])
def test_tree_verify_triton_matches_reference(page, parts, drafts):
    """Trees of 3, 6 and 40 drafts (two mask words a row), split and unsplit."""
    torch.manual_seed(page + drafts)
    lens = [37 + drafts, drafts, 70]
    q, kv, table, seq_lens = make_batch(seq_lens=lens, page_size=page, rank=32, rope=16,
                                        heads=4, tokens=drafts)
    tree, _ = _tree(len(lens), drafts, seed=drafts)
    plan = plan_mla_decode(block_table=table, seq_lens=seq_lens, page_size=page,
                           num_q_heads=4, kv_lora_rank=32, rope_dim=16, q_dtype=q.dtype,
                           kv_dtype=kv.dtype, num_tokens=drafts, return_lse=True,
                           num_partitions=parts, tree_mask=tree, impl="triton")
    assert plan.impl == "triton" and plan.tree_mask is tree
    out, lse = plan.run(q, kv)
    ref64, lse64 = reference.mla_decode_attention(
        q, kv, table, seq_lens, kv_lora_rank=32, tree_mask=tree, return_lse=True,
        compute_dtype=torch.float64)
    ref_lp = reference.mla_decode_attention(q, kv, table, seq_lens, kv_lora_rank=32,
                                            tree_mask=tree, compute_dtype=q.dtype)
    assert_within_budget(out, ref64, ref_lp, mult=4.0)
    torch.testing.assert_close(lse, lse64.float(), rtol=1e-3, atol=1e-3)
    # the one-shot op takes the mask too
    once = mla_decode_attention(q, kv, table, seq_lens, kv_lora_rank=32, tree_mask=tree,
                                impl="triton")
    assert_within_budget(once, ref64, ref_lp, mult=4.0)


def test_chain_tree_is_the_causal_decode():
    """A tree whose every draft extends the one before (a chain) gives the causal verify."""
    torch.manual_seed(2)
    q, kv, table, lens = make_batch(seq_lens=[21, 9], page_size=16, rank=32, rope=16,
                                    heads=4, tokens=4)
    chain = pack_tree_mask(tree_mask_from_parents(random_parents(2, 4, seed=0, chain=True)))
    outs = [plan_mla_decode(block_table=table, seq_lens=lens, page_size=16, num_q_heads=4,
                            kv_lora_rank=32, rope_dim=16, q_dtype=q.dtype, kv_dtype=kv.dtype,
                            num_tokens=4, tree_mask=mask, impl="triton").run(q, kv)
            for mask in (chain.to(DEV), None)]
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=2e-3)
    check_against_reference(q, kv, table, lens, rank=32, out=outs[0])


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_tree_mask_bad_inputs(impl):
    q, kv, table, lens = make_batch(seq_lens=[9, 9], page_size=16, rank=32, rope=16,
                                    heads=4, tokens=3)
    tree, _ = _tree(2, 3, seed=0)
    kw = dict(block_table=table, seq_lens=lens, page_size=16, num_q_heads=4,
              kv_lora_rank=32, rope_dim=16, q_dtype=q.dtype, kv_dtype=kv.dtype,
              num_tokens=3, impl=impl)
    with pytest.raises(ValueError, match="tree_mask"):  # rows: B * T = 6, not 5
        plan_mla_decode(tree_mask=tree[:5], **kw)
    with pytest.raises(ValueError, match="tree_mask"):
        plan_mla_decode(tree_mask=tree.to(torch.int64), **kw)
    with pytest.raises(ValueError, match="40 new tokens"):  # one word holds 32 drafts
        plan_mla_decode(tree_mask=torch.zeros((80, 1), dtype=torch.int32, device=DEV),
                        **{**kw, "num_tokens": 40})
    with pytest.raises(ValueError, match="at most 64 drafts"):
        plan_mla_decode(tree_mask=torch.zeros((130, 3), dtype=torch.int32, device=DEV),
                        **{**kw, "num_tokens": 65})


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (DeepSeek widths at real size)")
@pytest.mark.parametrize("heads,drafts,page,parts", [(16, 4, 64, None), (128, 8, 1, None),
                                                     (16, 8, 16, 4), (4, 3, 1, None)])
def test_tree_verify_gpu(heads, drafts, page, parts):
    """512 + 64 rows, bf16: Hq x T rows past the native kernel's 64 still run Triton (the
    native kernel attends causally); ``impl="native"`` refuses the mask."""
    torch.manual_seed(heads + drafts)
    lens = [1500, drafts, 333, 4097]
    q, kv, table, seq_lens = make_batch(seq_lens=lens, page_size=page, rank=512, rope=64,
                                        heads=heads, tokens=drafts, dtype=torch.bfloat16)
    tree, _ = _tree(len(lens), drafts, seed=heads)
    plan = plan_mla_decode(block_table=table, seq_lens=seq_lens, page_size=page,
                           num_q_heads=heads, kv_lora_rank=512, rope_dim=64,
                           q_dtype=q.dtype, kv_dtype=kv.dtype, num_tokens=drafts,
                           num_partitions=parts, tree_mask=tree)
    assert plan.impl == "triton"
    out = plan.run(q, kv)
    ref64 = reference.mla_decode_attention(q, kv, table, seq_lens, kv_lora_rank=512,
                                           tree_mask=tree, compute_dtype=torch.float64)
    ref_lp = reference.mla_decode_attention(q, kv, table, seq_lens, kv_lora_rank=512,
                                            tree_mask=tree, compute_dtype=q.dtype)
    assert_within_budget(out, ref64, ref_lp, mult=4.0)
    if torch.cuda.get_device_capability()[0] == 9 and \
            heads * drafts >= tuning.MLA_NATIVE_MIN_ROWS:  # else the native kernel's row
        # minimum is the reason named
        with pytest.raises(ValueError, match="tree mask"):
            plan_mla_decode(block_table=table, seq_lens=seq_lens, page_size=page,
                            num_q_heads=heads, kv_lora_rank=512, rope_dim=64,
                            q_dtype=q.dtype, kv_dtype=kv.dtype, num_tokens=drafts,
                            tree_mask=tree, impl="native")
