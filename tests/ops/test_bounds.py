"""Bounds and empty rows: every kernel on hostile indices, and rows that see no key.

The rule (DESIGN.md "Bounds"): a block id outside ``[0, num_blocks)`` (or a table column
past the table's end) is an *absent* key, never loaded; a slot outside the cache is a
skipped write; a copy pair with a bad id is skipped. A row that sees no key gives 0, never
NaN. Where it can, a test checks against an independent oracle: the reference on a
*compacted* table (the bad blocks removed), which needs no notion of absence.
"""

from __future__ import annotations

import pytest
import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops.cache import copy_blocks, write_kv
from hygon_attn_backend.ops.decode import paged_decode_attention
from hygon_attn_backend.ops.prefill import prefix_prefill_attention

from tests.support.budget import assert_within_budget

HAS_CUDA = torch.cuda.is_available()
CPU = torch.device("cpu")
gpu = pytest.mark.gpu
# Triton kernels on CPU tensors run only under the interpreter, which conftest turns on
# where there is no GPU; on a CUDA host the same bounds are checked on the device by the
# *_gpu tests here, the fuzz's hostile cases and scripts/sanitize_cases.py.
interpreter = pytest.mark.skipif(HAS_CUDA, reason="Triton on CPU tensors needs the "
                                 "interpreter, which is off on a CUDA host (the GPU runs "
                                 "these bounds through the *_gpu tests, the fuzz and "
                                 "scripts/sanitize_cases.py)")


def _i32(values, device):
    return torch.tensor(values, dtype=torch.int32, device=device)


def _issue_repro(device, dtype, seed=0):
    """The reported case: 12 blocks of 16 slots, 2 KV heads, D=128, 8 query heads, every
    table row ``[0, -5, 1000, 3]``, cu_seqlens_q ``[0, 5, 5, 40]``, seq_lens_k
    ``[20, 3, 60]``."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(dtype)
    k, v = rnd(12, 2, 16, 128), rnd(12, 2, 16, 128)
    table = _i32([[0, -5, 1000, 3]] * 3, device)
    cu, lens = _i32([0, 5, 5, 40], device), _i32([20, 3, 60], device)
    return rnd(40, 8, 128), k, v, table, cu, lens, rnd(40, 2, 128), rnd(40, 2, 128)


def _check_repro(device, dtype, k_new):
    q, k, v, table, cu, lens, kn, vn = _issue_repro(device, dtype)
    kw = dict(k_new=kn, v_new=vn) if k_new else {}
    out = torch.full_like(q, float("nan"))
    res, lse = prefix_prefill_attention(q, k, v, table, cu, lens, out=out, return_lse=True,
                                        impl="triton", **kw)
    ref64, ref_lse = reference.prefix_prefill_attention(
        q, k, v, table, cu, lens, return_lse=True, compute_dtype=torch.float64, **kw)
    ref_lp = reference.prefix_prefill_attention(q, k, v, table, cu, lens, compute_dtype=dtype,
                                                **kw)
    assert res is out
    assert_within_budget(out, ref64, ref_lp, what="issue repro")
    assert torch.isfinite(lse).all() and (lse.double() - ref_lse.double()).abs().max() < 2e-2


@interpreter
@pytest.mark.parametrize("k_new", [False, True], ids=["cache_only", "k_new"])
def test_prefill_issue_repro_cpu(k_new):
    """Segfaulted under the interpreter before (the K/V tile load formed block -5/1000)."""
    _check_repro(CPU, torch.float16, k_new)


@gpu
@pytest.mark.parametrize("k_new", [False, True], ids=["cache_only", "k_new"])
def test_prefill_issue_repro_gpu(k_new):
    _check_repro(torch.device("cuda"), torch.bfloat16, k_new)


def test_reference_absent_keys_equal_compacted_table():
    """The reference's absence rule equals dropping the bad blocks (no query position
    depends on them: decode T=1 and non-causal prefill see every key)."""
    q, k, v, table, cu, lens, _, _ = _issue_repro(CPU, torch.float32)
    # request 2 keys: block 0 (0..15), -5, 1000, block 3 (48..59) -> 28 present keys
    dec = reference.paged_decode_attention(q[:1], k, v, table[:1], _i32([60], CPU),
                                           compute_dtype=torch.float64)
    dec_c = reference.paged_decode_attention(q[:1], k, v, _i32([[0, 3]], CPU),
                                             _i32([28], CPU), compute_dtype=torch.float64)
    torch.testing.assert_close(dec, dec_c, rtol=0, atol=1e-12)
    pre = reference.prefix_prefill_attention(q[:20], k, v, table[:1], _i32([0, 20], CPU),
                                             _i32([60], CPU), causal=False,
                                             compute_dtype=torch.float64)
    pre_c = reference.prefix_prefill_attention(q[:20], k, v, _i32([[0, 3]], CPU),
                                               _i32([0, 20], CPU), _i32([28], CPU),
                                               causal=False, compute_dtype=torch.float64)
    torch.testing.assert_close(pre, pre_c, rtol=0, atol=1e-12)


# page 16: one table read per 16-key tile (a bad id drops the whole tile);
# page 4: one read per key (a bad id masks 4 keys inside a tile)
@interpreter
@pytest.mark.parametrize("two_walks", ["0", "1"])
@pytest.mark.parametrize("page", [16, 4])
@pytest.mark.parametrize("bad", [-5, 1000])
def test_prefill_bad_ids_equal_compacted_table(page, bad, two_walks, monkeypatch):
    """Also with the unmasked walk compiled twice (tuning.two_walks forced): a row
    with a bad id must take the checked copy."""
    from hygon_attn_backend.ops.prefill import tuning
    monkeypatch.setattr(tuning, "two_walks", lambda **kw: two_walks == "1")
    gen = torch.Generator().manual_seed(page)
    k = torch.randn(12, 2, page, 64, generator=gen).half()
    v = torch.randn(12, 2, page, 64, generator=gen).half()
    q = torch.randn(9, 4, 64, generator=gen).half()
    full = _i32([[7, bad, 2, bad, 5]], CPU)  # the key length ends mid-page in block 5
    keep = _i32([[7, 2, 5]], CPU)
    cu = _i32([0, 9], CPU)
    out = prefix_prefill_attention(q, k, v, full, cu, _i32([4 * page + 3], CPU),
                                   causal=False, impl="triton")
    args = (q, k, v, keep, cu, _i32([2 * page + 3], CPU))
    ref64 = reference.prefix_prefill_attention(*args, causal=False,
                                               compute_dtype=torch.float64)
    ref_lp = reference.prefix_prefill_attention(*args, causal=False,
                                                compute_dtype=torch.float16)
    assert_within_budget(out, ref64, ref_lp, what=f"page {page} bad {bad}")


@interpreter
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("k_new", [False, True])
def test_prefill_two_walks_clean_and_hostile_rows_in_one_batch(k_new, causal, monkeypatch):
    """TWO_WALKS: in one batch, rows whose ids are all present take the unchecked walk and
    a row with a bad id the checked one; both equal the reference (page 4 < BLOCK_N, so a
    tile spans pages)."""
    from hygon_attn_backend.ops.prefill import tuning
    monkeypatch.setattr(tuning, "two_walks", lambda **kw: True)
    gen = torch.Generator().manual_seed(11)
    page, d = 4, 64
    k = torch.randn(40, 2, page, d, generator=gen).half()
    v = torch.randn(40, 2, page, d, generator=gen).half()
    table = torch.randperm(40, generator=gen)[:30].reshape(3, 10).to(torch.int32)
    table[1, 2] = 999  # request 1: an absent page inside its unmasked walk
    lens_q, lens_k = [6, 5, 9], [37, 30, 25]
    cu = _i32([0, 6, 11, 20], CPU)
    q = torch.randn(20, 4, d, generator=gen).half()
    kw = {}
    if k_new:
        kw = dict(k_new=torch.randn(20, 2, d, generator=gen).half(),
                  v_new=torch.randn(20, 2, d, generator=gen).half())
    args = (q, k, v, table, cu, _i32(lens_k, CPU))
    out = prefix_prefill_attention(*args, causal=causal, impl="triton", **kw)
    ref64 = reference.prefix_prefill_attention(*args, causal=causal,
                                               compute_dtype=torch.float64, **kw)
    ref_lp = reference.prefix_prefill_attention(*args, causal=causal,
                                                compute_dtype=torch.float16, **kw)
    assert sum(lens_q) == q.shape[0]
    assert_within_budget(out, ref64, ref_lp, what=f"two walks k_new={k_new} causal={causal}")


@interpreter
@pytest.mark.parametrize("k_new", [False, True])
def test_prefill_table_past_its_end_and_empty_table(k_new):
    """Columns past the table's end are absent (validation off, as under graph capture);
    an empty table with no prefix is fine (never read)."""
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(6, 1, 16, 64, generator=gen).half()
    v = torch.randn(6, 1, 16, 64, generator=gen).half()
    q = torch.randn(5, 2, 64, generator=gen).half()
    kn, vn = (torch.randn(5, 1, 64, generator=gen).half() for _ in range(2))
    kw = dict(k_new=kn, v_new=vn) if k_new else {}
    cu = _i32([0, 5], CPU)
    short = _i32([[4]], CPU)  # 16 keys reachable; seq_lens_k says 40
    out = prefix_prefill_attention(q, k, v, short, cu, _i32([40], CPU), causal=False,
                                   validate=False, impl="triton", **kw)
    ref = reference.prefix_prefill_attention(q, k, v, short, cu, _i32([40], CPU),
                                             causal=False, compute_dtype=torch.float64, **kw)
    ref_lp = reference.prefix_prefill_attention(q, k, v, short, cu, _i32([40], CPU),
                                                causal=False, compute_dtype=torch.float16, **kw)
    assert_within_budget(out, ref, ref_lp, what="short table")
    if k_new:
        empty = torch.zeros((1, 0), dtype=torch.int32)
        out = prefix_prefill_attention(q, k, v, empty, cu, _i32([5], CPU), impl="triton", **kw)
        ref = reference.prefix_prefill_attention(q, k, v, empty, cu, _i32([5], CPU),
                                                 compute_dtype=torch.float64, **kw)
        ref_lp = reference.prefix_prefill_attention(q, k, v, empty, cu, _i32([5], CPU),
                                                    compute_dtype=torch.float16, **kw)
        assert_within_budget(out, ref, ref_lp, what="empty table")


@interpreter
@pytest.mark.parametrize("k_new", [False, True])
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_walk_is_bounded_by_the_table(k_new, causal, monkeypatch):
    """seq_lens_k far past a 32-token table (validation off, as under graph capture): the
    cache keys there are absent and the kernel walks the table's tiles only (it walked all
    200,000 keys before), with the reference's answer."""
    from hygon_attn_backend.kernels import prefill as kernel
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(6, 1, 16, 32, generator=gen).half()
    v = torch.randn(6, 1, 16, 32, generator=gen).half()
    q = torch.randn(3, 2, 32, generator=gen).half()
    kn, vn = (torch.randn(3, 1, 32, generator=gen).half() for _ in range(2))
    kw = dict(k_new=kn, v_new=vn, causal=causal) if k_new else dict(causal=causal)
    cu, table = _i32([0, 3], CPU), _i32([[4, 1]], CPU)
    calls, original = [], kernel.lookup_tile_pages

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    monkeypatch.setattr(kernel, "lookup_tile_pages", counting)
    walked = {}
    for length in (35, 200_000):  # 32 keys in the table (+ 3 new ones with k_new)
        lens = _i32([length], CPU)
        calls.clear()
        out = prefix_prefill_attention(q, k, v, table, cu, lens, validate=False,
                                       impl="triton", **kw)
        walked[length] = len(calls)
        ref = reference.prefix_prefill_attention(q, k, v, table, cu, lens,
                                                 compute_dtype=torch.float64, **kw)
        ref_lp = reference.prefix_prefill_attention(q, k, v, table, cu, lens,
                                                    compute_dtype=torch.float16, **kw)
        assert_within_budget(out, ref, ref_lp, what=f"seq_len_k {length}")
    assert walked[200_000] <= walked[35]


# ----------------------------------------------------------------------------- empty rows


@interpreter
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("page", [16, 4])
def test_prefill_rows_that_see_no_key_give_zero(sinks, page):
    """A window of 3 whose keys all sit in an absent block: those rows give exactly 0 and
    lse -inf (no NaN), in the kernel and the reference; the other rows match."""
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(8, 1, page, 64, generator=gen).half()
    v = torch.randn(8, 1, page, 64, generator=gen).half()
    len_k, len_q = 48, 20
    absent = 44 // page * page  # keys [absent, 48) sit in block -1
    table = _i32([[(1 + c) if c < absent // page else -1 for c in range(48 // page)]], CPU)
    q = torch.randn(len_q, 4, 64, generator=gen).half()
    kw = dict(sliding_window=3, return_lse=True)
    if sinks:
        kw["sinks"] = torch.randn(4, generator=gen)
    args = (q, k, v, table, _i32([0, len_q], CPU), _i32([len_k], CPU))
    out, lse = prefix_prefill_attention(*args, impl="triton", **kw)
    ref, ref_lse = reference.prefix_prefill_attention(*args, compute_dtype=torch.float64, **kw)
    ref_lp, _ = reference.prefix_prefill_attention(*args, compute_dtype=torch.float16, **kw)
    # row i sits at position 28 + i and sees keys (25 + i, 28 + i]: none once 26 + i >= absent
    empty = slice(absent - 26, len_q)
    assert torch.count_nonzero(ref[empty]) == 0 and torch.count_nonzero(out[empty]) == 0
    assert torch.isfinite(out).all()
    if not sinks:
        assert torch.isneginf(ref_lse[empty]).all() and torch.isneginf(lse[empty]).all()
    assert_within_budget(out, ref, ref_lp, what="window over absent keys")


@interpreter
@pytest.mark.parametrize("partition_size", [16, None])
@pytest.mark.parametrize("sinks", [False, True])
def test_decode_rows_that_see_no_key_give_zero(partition_size, sinks):
    """seq_len 0, and a window whose keys all sit in an absent block: 0, no NaN."""
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(8, 1, 16, 64, generator=gen).half()
    v = torch.randn(8, 1, 16, 64, generator=gen).half()
    q = torch.randn(3, 4, 64, generator=gen).half()
    table = _i32([[2, 3, -1], [4, 5, 6], [1, 2, 3]], CPU)
    lens = _i32([40, 0, 37], CPU)
    kw = dict(sliding_window=4, partition_size=partition_size)
    if sinks:
        kw["sinks"] = torch.randn(4, generator=gen)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k, v, table, lens, out=out, impl="triton", **kw)
    kw.pop("partition_size")
    ref = reference.paged_decode_attention(q, k, v, table, lens, compute_dtype=torch.float64,
                                           **kw)
    ref_lp = reference.paged_decode_attention(q, k, v, table, lens,
                                              compute_dtype=torch.float16, **kw)
    for s in (0, 1):  # window keys 36..39 in block -1; empty sequence
        assert torch.count_nonzero(ref[s]) == 0 and torch.count_nonzero(out[s]) == 0
    assert_within_budget(out, ref, ref_lp, what="decode empty rows")


# ----------------------------------------------------------------------------- lengths past the table


def _decode_case(seed=7):
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(8, 1, 16, 64, generator=gen).half()
    v = torch.randn(8, 1, 16, 64, generator=gen).half()
    q = torch.randn(2, 4, 64, generator=gen).half()
    return q, k, v, _i32([[2, 5, 7], [1, 3, 4]], CPU)  # a table of 48 tokens a row


def _count_tile_lookups(monkeypatch) -> list:
    """Record each call of the decode kernel's page lookup (one per K/V tile walked, plus
    one a program with PAGE_PREFETCH): the interpreter resolves it in the kernel's module."""
    from hygon_attn_backend.kernels import decode as kernel
    calls, original = [], kernel.lookup_tile_pages

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    monkeypatch.setattr(kernel, "lookup_tile_pages", counting)
    return calls


@interpreter
@pytest.mark.parametrize("sliding_window", [None, 8])
@pytest.mark.parametrize("partition_size,fused", [(None, None), (16, True), (16, False)])
def test_decode_walk_is_bounded_by_the_table(partition_size, fused, sliding_window,
                                             monkeypatch):
    """seq_len far past a 48-token table: the keys there are absent, and the kernel walks
    the tiles of seq_len 48 (it walked all 200,000 keys before: 15 s in the interpreter),
    with the reference's answer (a window past the table: zeros)."""
    q, k, v, table = _decode_case()
    calls = _count_tile_lookups(monkeypatch)
    walked = {}
    for length in (48, 200_000, 2**31 - 1):
        if length == 2**31 - 1:  # (only once bounded: unbounded it would walk for hours)
            assert walked[200_000] <= walked[48]
        lens = _i32([length, 19], CPU)
        calls.clear()
        out = paged_decode_attention(q, k, v, table, lens, partition_size=partition_size,
                                     fused_combine=fused, sliding_window=sliding_window,
                                     impl="triton")
        walked[length] = len(calls)
        kw = dict(sliding_window=sliding_window)
        ref = reference.paged_decode_attention(q, k, v, table, lens,
                                               compute_dtype=torch.float64, **kw)
        ref_lp = reference.paged_decode_attention(q, k, v, table, lens,
                                                  compute_dtype=torch.float16, **kw)
        assert_within_budget(out, ref, ref_lp, what=f"seq_len {length}")
        if sliding_window and length > 48:
            assert torch.count_nonzero(out[0]) == 0
    assert walked[200_000] <= walked[48] and walked[2**31 - 1] <= walked[48]


def test_reference_decode_gathers_no_key_past_the_table(monkeypatch):
    """The reference (the engines' CPU path) follows the same bound: a wild seq_len
    gathers the table's keys only."""
    q, k, v, table = _decode_case()
    stops, original = [], reference.gather_kv

    def recording(cache, row, start, stop, **kw):
        stops.append(stop)
        return original(cache, row, start, stop, **kw)
    monkeypatch.setattr(reference, "gather_kv", recording)
    for length in (200_000, 2**31 - 1):  # (the second only once bounded: 2^31 keys)
        wild = reference.paged_decode_attention(q, k, v, table, _i32([length, 19], CPU),
                                                compute_dtype=torch.float64)
        assert stops and max(stops) <= 48
    # T=1 at any length >= 48 sees every key of the table: seq_len 48's answer
    same = reference.paged_decode_attention(q, k, v, table, _i32([48, 19], CPU),
                                            compute_dtype=torch.float64)
    torch.testing.assert_close(wild, same, rtol=0, atol=0)


@interpreter
@pytest.mark.parametrize("fused", [True, False])
def test_decode_max_seq_len_below_seq_len_reads_every_key(fused, monkeypatch):
    """max_seq_len 32 sizes a grid of 2 partitions of 16 for a sequence of 48: the
    partitions grow to cover its keys (keys 32..47 were skipped before), so the answer is
    the reference's, and the host mirror of the partitioning agrees; the walk stays
    within the table."""
    from hygon_attn_backend.ops.decode import plan_paged_decode, tuning
    q, k, v, table = _decode_case()
    lens = _i32([48, 19], CPU)
    plan = plan_paged_decode(table, lens, num_q_heads=4, num_kv_heads=1, head_dim=64,
                             page_size=16, q_dtype=torch.float16, kv_dtype=torch.float16,
                             max_seq_len=32, partition_size=16, fused_combine=fused,
                             impl="triton")
    assert plan.config.num_partitions == 2
    for length in (48, 2**31 - 1):  # the table holds 48 keys either way
        size, parts = tuning.seq_partitions(length, plan.config, table_keys=48)
        assert parts <= 2 and parts * size >= 48 and size % plan.config.block_n == 0
    calls = _count_tile_lookups(monkeypatch)
    out = paged_decode_attention(q, k, v, table, lens, plan=plan)
    ref = reference.paged_decode_attention(q, k, v, table, lens, compute_dtype=torch.float64)
    ref_lp = reference.paged_decode_attention(q, k, v, table, lens,
                                              compute_dtype=torch.float16)
    assert_within_budget(out, ref, ref_lp, what="max_seq_len below seq_len")
    # 3 tiles of 16 for sequence 0 and 2 for sequence 1, plus at most one prefetch each
    # of the 4 programs
    assert len(calls) <= 5 + 4


# ----------------------------------------------------------------------------- cache ops


@interpreter
@pytest.mark.parametrize("split_x", [False, True])
def test_write_kv_hostile_slots_write_nothing_outside(split_x):
    """Slots -1, -7, num_slots, past the end, int32 max: skipped; the valid ones written;
    every other byte of both caches unchanged."""
    n, h, p, d = 4, 2, 16, 64
    gen = torch.Generator().manual_seed(2)
    num_slots = n * p
    slots = _i32([-1, 5, -7, num_slots, num_slots + 1000, 2**31 - 1, 63, -(2**31)], CPU)
    k = torch.randn(len(slots), h, d, generator=gen).half()
    v = torch.randn(len(slots), h, d, generator=gen).half()
    if split_x:
        k_cache = torch.randn(n, h, d // 8, p, 8, generator=gen).half()
    else:
        k_cache = torch.randn(n, h, p, d, generator=gen).half()
    v_cache = torch.randn(n, h, p, d, generator=gen).half()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    k_before = k_cache.clone()
    write_kv(k, v, k_cache, v_cache, slots, impl="triton")
    reference.write_kv(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    canon = reference.as_canonical_view(k_cache)
    assert torch.equal(canon[0, :, 5], k[1]) and torch.equal(canon[3, :, 15], k[6])
    changed = (reference.as_canonical_view(k_before) != canon).any(dim=(1, 3))  # [n, p]
    assert changed.nonzero().tolist() == [[0, 5], [3, 15]]


@interpreter
def test_copy_blocks_bad_ids_skip_the_pair():
    gen = torch.Generator().manual_seed(4)
    n = 8
    k = torch.randn(n, 2, 16, 64, generator=gen).half()
    v = torch.randn(n, 2, 64, 16, generator=gen).half()
    before_k, before_v = k.clone(), v.clone()
    mapping = _i32([[-1, 2], [3, n], [n + 5, 1], [4, 5], [2**31 - 1, 6], [0, -(2**31)]], CPU)
    copy_blocks(k, v, mapping, impl="triton")
    want_k, want_v = before_k.clone(), before_v.clone()
    want_k[5], want_v[5] = before_k[4], before_v[4]
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    ref_k, ref_v = before_k.clone(), before_v.clone()
    reference.copy_blocks(ref_k, ref_v, mapping)
    assert torch.equal(ref_k, want_k) and torch.equal(ref_v, want_v)
