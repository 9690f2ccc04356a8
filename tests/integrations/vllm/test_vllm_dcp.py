"""Decode context parallelism of the vLLM backend on two CPU processes (gloo).

Each of two ranks holds its shard of a real paged cache, dealt out the way vLLM deals it
(its slot mapping: runs of ``cp_kv_cache_interleave_size`` tokens to ranks in turn, a
token not owned gets slot -1), and two query heads of a four-head group over one KV head.
The context tokens are in the shards before the step; the step's new tokens are written
by the backend's own cache write with that slot mapping. Then the backend's DCP path
(``integrations.vllm.dcp``: all-gathered queries, our decode and prefill on the shard
with their LSEs, the LSE merge across ranks, the new tokens merged in) runs on each rank
and each rank's output is checked against reference.py on the unsharded cache.

vLLM's own merge (``cp_lse_ag_out_rs``) is a Triton kernel that vLLM's launcher cannot
run in the CPU interpreter, so the ranks' merge here all-gathers the partial outputs
and LSEs over gloo and merges them with ``ops.lse_merge.merge_partials`` (the same arithmetic).
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hygon_attn_backend import reference
from hygon_attn_backend.integrations.vllm import dcp, step
from hygon_attn_backend.ops.lse_merge import merge_partials

WORLD = 2
HKV, H, D, P = 1, 2, 32, 16  # per rank: 1 KV head (replicated), 2 of the group's 4 q heads
# (seq_lens, query_lens): decodes first (one token), then a first prefill, a chunk after a
# cached prefix and a speculative-style 3-token extend (all on the prefill side under DCP)
SEQ_LENS = [37, 1, 70, 20, 45, 33]
QUERY_LENS = [1, 1, 1, 20, 9, 3]


def owner_and_slot(pos: int, table_row, world: int, rank: int, interleave: int):
    """vLLM's slot mapping of position ``pos`` on ``rank`` (ComputeSlotMappingKernel):
    ``(owned, slot)``; a position another rank owns gets slot -1."""
    span = P * world
    vblock, voff = divmod(pos, span)
    owned = (voff // interleave) % world == rank
    local = (voff // (world * interleave)) * interleave + voff % interleave
    return owned, (int(table_row[vblock]) * P + local) if owned else -1


def problem(seed=0):
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(torch.float16)

    n = sum(QUERY_LENS)
    keys = [randn(s, HKV, D) for s in SEQ_LENS]  # every position's K/V, per request
    vals = [randn(s, HKV, D) for s in SEQ_LENS]
    q_group = randn(n, WORLD * H, D)  # the group's queries; rank r has heads [rH, (r+1)H)
    # one table for both ranks (vLLM's): a block holds P local tokens of a P * W virtual block
    blocks = [-(-s // (P * WORLD)) for s in SEQ_LENS]
    perm = (torch.randperm(sum(blocks) + 3, generator=gen) + 1).tolist()
    table = torch.zeros(len(SEQ_LENS), max(blocks) + 1, dtype=torch.int32)
    at = 0
    for b, k in enumerate(blocks):
        table[b, :k] = torch.tensor(perm[at:at + k], dtype=torch.int32)
        at += k
    return keys, vals, q_group, table, sum(blocks) + 4


def rank_main(rank: int, store: str, interleave: int, results: str) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    try:
        torch.save(run_rank(rank, interleave), os.path.join(results, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def gather_heads(q):
    parts = [torch.empty_like(q) for _ in range(WORLD)]
    dist.all_gather(parts, q.contiguous())
    return torch.cat(parts, dim=1)


def merge_ranks(out, lse):
    rank = dist.get_rank()
    outs = [torch.empty_like(out) for _ in range(WORLD)]
    lses = [torch.empty_like(lse) for _ in range(WORLD)]
    dist.all_gather(outs, out.contiguous())
    dist.all_gather(lses, lse.contiguous())
    merged, merged_lse = merge_partials(torch.stack(outs), torch.stack(lses))
    heads = slice(rank * H, (rank + 1) * H)
    return merged[:, heads].to(out.dtype), merged_lse[:, heads]


def run_rank(rank: int, interleave: int) -> dict:
    keys, vals, q_group, table, num_blocks = problem()
    n = q_group.shape[0]
    kv_cache = torch.zeros(num_blocks, HKV, P, 2 * D, dtype=torch.float16)
    key = torch.zeros(n, HKV, D, dtype=torch.float16)
    value = torch.zeros_like(key)
    slot_mapping = torch.full((n,), -1, dtype=torch.int64)
    row = 0
    for b, (s, ql) in enumerate(zip(SEQ_LENS, QUERY_LENS)):
        for pos in range(s):
            owned, slot = owner_and_slot(pos, table[b], WORLD, rank, interleave)
            if pos >= s - ql:  # a new token: the step writes it
                key[row], value[row] = keys[b][pos], vals[b][pos]
                slot_mapping[row] = slot
                row += 1
            elif owned:  # context: already in this rank's shard
                blk, off = divmod(slot, P)
                kv_cache[blk, :, off, :D] = keys[b][pos]
                kv_cache[blk, :, off, D:] = vals[b][pos]
    qsl = torch.tensor([0] + QUERY_LENS, dtype=torch.int32).cumsum(0).to(torch.int32)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)
    layer = step.LayerSpec(num_heads=H, num_kv_heads=HKV, head_size=D, scale=D ** -0.5)
    md = step.make_metadata(
        query_start_loc=qsl, seq_lens=seq_lens, block_table=table, slot_mapping=slot_mapping,
        num_reqs=len(SEQ_LENS), num_actual_tokens=n, max_query_len=max(QUERY_LENS),
        max_seq_len=max(SEQ_LENS), num_decodes=3, num_decode_tokens=3,
        one_token_decodes=True)
    cp = dcp.ContextParallel(world_size=WORLD, rank=rank, interleave=interleave,
                             gather_heads=gather_heads, merge_ranks=merge_ranks)
    step.plan_metadata(md, num_q_heads=H, num_kv_heads=HKV, head_size=D, block_size=P,
                       q_dtype=torch.float16, kv_dtype=torch.float16, impl="triton",
                       query_start_loc_cpu=qsl, cp=cp,
                       decode_lens_buffer=torch.zeros(8, dtype=torch.int32))
    step.write_new_kv(key, value, kv_cache, slot_mapping, layer, impl="triton")
    query = q_group[:, rank * H:(rank + 1) * H].contiguous()
    out = torch.zeros_like(query)
    step.attention(query, kv_cache, md, out, layer, key=key, value=value)
    return dict(out=out, num_decodes=md.num_decodes,
                decode_impl=md.dcp.decode_plan.impl,
                local_decode_lens=md.dcp.decode_seq_lens.tolist(),
                local_context_lens=md.dcp.context_seq_lens.tolist())


def oracle(rank: int):
    """reference.py on the unsharded cache: every request's keys in one paged cache."""
    keys, vals, q_group, _, _ = problem()
    n = q_group.shape[0]
    blocks = [-(-s // P) for s in SEQ_LENS]
    k_cache = torch.zeros(sum(blocks), HKV, P, D, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    table = torch.zeros(len(SEQ_LENS), max(blocks), dtype=torch.int32)
    at = 0
    for b, s in enumerate(SEQ_LENS):
        table[b, :blocks[b]] = torch.arange(at, at + blocks[b], dtype=torch.int32)
        for pos in range(s):
            k_cache[at + pos // P, :, pos % P] = keys[b][pos]
            v_cache[at + pos // P, :, pos % P] = vals[b][pos]
        at += blocks[b]
    cu = torch.tensor([0] + QUERY_LENS, dtype=torch.int32).cumsum(0).to(torch.int32)
    q = q_group[:, rank * H:(rank + 1) * H]
    ref = {}
    for dtype in (torch.float64, torch.float16):
        ref[dtype] = reference.prefix_prefill_attention(
            q, k_cache, v_cache, table, cu, torch.tensor(SEQ_LENS, dtype=torch.int32),
            compute_dtype=dtype)
    assert ref[torch.float64].shape == (n, H, D)
    return ref


@pytest.mark.parametrize("interleave", [1, 8])
def test_two_rank_dcp_matches_reference_on_the_unsharded_cache(interleave):
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(rank_main, args=(store, interleave, tmp), nprocs=WORLD,
                           join=True, start_method="spawn")
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]
    from tests.support.budget import assert_within_budget

    for rank, res in enumerate(results):
        assert res["num_decodes"] == 3
        assert res["decode_impl"] == "triton"
        ref = oracle(rank)
        assert_within_budget(res["out"], ref[torch.float64], ref[torch.float16])
    # the shards split every sequence: both ranks' local lengths add up to the whole
    total = [a + b for a, b in zip(results[0]["local_decode_lens"],
                                   results[1]["local_decode_lens"])]
    assert total == SEQ_LENS[:3]
    ctx = [s - q for s, q in zip(SEQ_LENS[3:], QUERY_LENS[3:])]
    assert [a + b for a, b in zip(results[0]["local_context_lens"],
                                  results[1]["local_context_lens"])] == ctx


@pytest.mark.parametrize("interleave", [1, 4, 16])
def test_local_lens_deal_positions_as_the_slot_mapping(interleave):
    lens = torch.arange(0, 200, dtype=torch.int32)
    table = torch.arange(64, dtype=torch.int32)
    for rank in range(WORLD):
        got = dcp.local_lens(lens, world_size=WORLD, rank=rank, interleave=interleave)
        owned = [owner_and_slot(p, table, WORLD, rank, interleave)[0] for p in range(200)]
        want = [sum(owned[:n]) for n in range(200)]
        assert got.tolist() == want
    assert dcp.local_max_len(199, world_size=WORLD, interleave=interleave) >= max(
        dcp.local_lens(torch.tensor([199]), world_size=WORLD, rank=r,
                       interleave=interleave).item() for r in range(WORLD))


def test_local_lens_equal_vllms():
    vllm_utils = pytest.importorskip("vllm.v1.attention.backends.utils")
    lens = torch.tensor([0, 1, 5, 16, 17, 33, 100, 257], dtype=torch.int32)
    for interleave in (1, 2, 8):
        for world in (2, 4):
            for rank in range(world):
                ours = dcp.local_lens(lens, world_size=world, rank=rank, interleave=interleave)
                theirs = vllm_utils.get_dcp_local_seq_lens(lens, world, rank, interleave)
                assert ours.tolist() == theirs.tolist(), (interleave, world, rank)


def test_merge_partials_is_attention_over_the_union():
    torch.manual_seed(0)
    q = torch.randn(3, 2, 8, dtype=torch.float64)
    k = torch.randn(10, 1, 8, dtype=torch.float64)
    v = torch.randn(10, 1, 8, dtype=torch.float64)
    full, full_lse = reference._attend(q, k, v, None, 0.5, None, None)
    parts = [reference._attend(q, k[i::3], v[i::3], None, 0.5, None, None) for i in range(3)]
    out, lse = merge_partials(torch.stack([p[0] for p in parts]),
                                  torch.stack([p[1] for p in parts]))
    torch.testing.assert_close(out.double(), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), full_lse, atol=1e-5, rtol=1e-5)
    # a set with no key for a row (-inf) drops out; none at all gives zeros and -inf
    empty = torch.full((3, 2), float("-inf"), dtype=torch.float64)
    out2, _ = merge_partials(torch.stack([full, torch.zeros_like(full)]),
                                 torch.stack([full_lse, empty]))
    torch.testing.assert_close(out2.double(), full, atol=1e-6, rtol=1e-6)
    out3, lse3 = merge_partials(torch.zeros(2, 3, 2, 8), torch.stack([empty, empty]))
    assert bool((out3 == 0).all()) and bool(torch.isneginf(lse3).all())
    with pytest.raises(ValueError, match=r"outs must be \[R, N, H, D\] and lses \[R, N, H\]"):
        merge_partials(torch.zeros(2, 3, 2, 8), torch.zeros(2, 3, 3))


def test_multi_token_decodes_go_to_the_prefill_side_under_dcp():
    """Speculative decode rows (T > 1) need a causal rule in global positions, which a
    shard does not have: under DCP they run as prefill rows (context + new tokens)."""
    qsl = torch.tensor([0, 3, 6, 16], dtype=torch.int32)
    args = dict(query_start_loc=qsl, seq_lens=torch.tensor([40, 50, 30], dtype=torch.int32),
                block_table=torch.zeros(3, 4, dtype=torch.int32),
                slot_mapping=torch.zeros(16, dtype=torch.int64), num_reqs=3,
                num_actual_tokens=16, max_query_len=10, max_seq_len=50, num_decodes=2,
                num_decode_tokens=6)
    assert step.make_metadata(**args).num_decodes == 2
    md = step.make_metadata(**args, one_token_decodes=True)
    assert (md.num_decodes, md.num_prefills, md.num_prefill_tokens) == (0, 3, 16)


def test_context_parallel_checks_its_arguments():
    with pytest.raises(ValueError, match="rank must be in"):
        dcp.ContextParallel(world_size=2, rank=2)
    with pytest.raises(ValueError, match="interleave must be a positive int"):
        dcp.ContextParallel(world_size=2, rank=0, interleave=0)
