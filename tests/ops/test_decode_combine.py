"""The split-KV combine of paged decode: fused into the decode kernel (the last program of
each (sequence, head group) merges it, counted by ``DecodeWorkspace.counters``) and the
two-launch form, both against reference.py.

CPU: the interpreter (programs run one after another, so the counter logic is exercised
but not its concurrency). GPU: real sizes, many programs finishing in any order, and
CUDA-graph replays that reuse the counters without a memset.
"""

import pytest
import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops import _device
from hygon_attn_backend.ops.decode import tuning
from hygon_attn_backend.ops.decode import (allocate_decode_workspace, paged_decode_attention,
                                           plan_paged_decode)
from tests.support.budget import assert_within_budget
from tests.ops.test_decode import blocks_needed, make_cache, make_table

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
CPU_DTYPE = torch.float16


def _problem(*, hkv, group, head_dim, page, seq_lens, num_tokens, dtype, device,
             layout="bhsd", sinks=False):
    nb = blocks_needed(seq_lens, page)
    k, v = make_cache(nb, hkv, page, head_dim, layout, dtype, device)
    table = make_table(seq_lens, page, nb, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    hq = hkv * group
    shape = ((len(seq_lens), hq, head_dim) if num_tokens == 1
             else (len(seq_lens), num_tokens, hq, head_dim))
    q = torch.randn(shape, dtype=dtype, device=device)
    options = {}
    if sinks:
        options["sinks"] = torch.randn(hq, dtype=torch.float32, device=device)
    return q, k, v, table, lens, options


def _run(q, k, v, table, lens, *, page, partition_size, fused, workspace=None, **options):
    hkv, hd = v.shape[1], v.shape[3]
    num_tokens = 1 if q.dim() == 3 else q.shape[1]
    if workspace is None:
        workspace = allocate_decode_workspace(
            max_num_seqs=table.shape[0], num_q_heads=q.shape[-2], num_kv_heads=hkv,
            head_dim=hd, max_context_len=table.shape[1] * page, device=q.device,
            num_tokens=num_tokens, partition_size=partition_size)
    plan = plan_paged_decode(table, lens, num_q_heads=q.shape[-2], num_kv_heads=hkv,
                             head_dim=hd, page_size=page, q_dtype=q.dtype, kv_dtype=v.dtype,
                             num_tokens=num_tokens, partition_size=partition_size,
                             workspace=workspace, fused_combine=fused, impl="triton")
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k, v, table, lens, out=out, plan=plan, **options)
    return out, plan, workspace


def _replays(q, k, v, table, lens, out, plan, count, **options):
    """Capture one planned call in a CUDA graph and replay it ``count`` times with new
    queries copied into ``q``: ``(queries, outputs)``, ``[count, *q.shape]`` each."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k, v, table, lens, out=out, plan=plan, **options)
    qs = torch.randn((count,) + tuple(q.shape), dtype=q.dtype, device="cuda")
    outs = torch.empty_like(qs)
    for i in range(count):
        q.copy_(qs[i])
        graph.replay()
        outs[i].copy_(out)
    return qs, outs


def _check(out, q, k, v, table, lens, **options):
    ref64 = reference.paged_decode_attention(q, k, v, table, lens, **options,
                                             compute_dtype=torch.float64)
    ref_lp = reference.paged_decode_attention(q, k, v, table, lens, **options,
                                              compute_dtype=q.dtype)
    assert_within_budget(out, ref64, ref_lp)


# (hkv, group, head_dim, page, seq_lens, num_tokens, options): G=5 and T*G=6 pad the merge
# rows; a length-0 sequence, one shorter than a partition, one over many partitions
CPU_CASES = [
    (2, 4, 64, 16, [70, 0, 15, 33], 1, {}),
    (1, 5, 64, 8, [50, 1], 1, {"sinks": True}),
    (1, 3, 80, 16, [47, 20], 2, {"sliding_window": 19}),
    (2, 1, 64, 1, [40, 9], 1, {"soft_cap": 20.0}),
]


@pytest.mark.parametrize("case", CPU_CASES)
@pytest.mark.parametrize("fused", [True, False])
def test_combine_forms_match_reference(case, fused):
    hkv, group, hd, page, seq_lens, t, opts = case
    opts = dict(opts)
    q, k, v, table, lens, options = _problem(
        hkv=hkv, group=group, head_dim=hd, page=page, seq_lens=seq_lens, num_tokens=t,
        dtype=CPU_DTYPE, device=DEV, sinks=opts.pop("sinks", False))
    options.update(opts)
    out, plan, ws = _run(q, k, v, table, lens, page=page, partition_size=16, fused=fused,
                         **options)
    assert plan.split and plan.fused_combine is fused
    assert plan.num_launches == (1 if fused else 2)
    _check(out, q, k, v, table, lens, **options)
    # the merging program left every counter at zero for the next launch
    assert int(ws.counters.abs().sum()) == 0
    if 0 in seq_lens:
        assert out[seq_lens.index(0)].abs().max().item() == 0.0


def test_fused_combine_reuses_counters_across_calls_and_layers():
    q, k, v, table, lens, _ = _problem(hkv=2, group=4, head_dim=64, page=16,
                                       seq_lens=[60, 33, 17], num_tokens=1, dtype=CPU_DTYPE,
                                       device=DEV)
    out, plan, ws = _run(q, k, v, table, lens, page=16, partition_size=16, fused=True)
    for _ in range(3):  # layers of one step, each with its own queries
        q2 = torch.randn_like(q)
        out = paged_decode_attention(q2, k, v, table, lens, plan=plan)
        _check(out, q2, k, v, table, lens)
    assert int(ws.counters.abs().sum()) == 0


def test_fused_combine_default_and_fallbacks():
    q, k, v, table, lens, _ = _problem(hkv=1, group=4, head_dim=64, page=16,
                                       seq_lens=[60, 20], num_tokens=1, dtype=CPU_DTYPE,
                                       device=DEV)
    kw = dict(num_q_heads=4, num_kv_heads=1, head_dim=64, page_size=16, q_dtype=q.dtype,
              kv_dtype=v.dtype, impl="triton")
    assert tuning.use_fused_combine(num_partitions=tuning.DECODE_FUSED_MAX_PARTITIONS)
    assert not tuning.use_fused_combine(num_partitions=64)
    assert not tuning.use_fused_combine(num_partitions=1)
    plan = plan_paged_decode(table, lens, partition_size=16, **kw)
    assert plan.fused_combine is tuning.use_fused_combine(
        num_partitions=plan.config.num_partitions)
    plan = plan_paged_decode(table, lens, partition_size=32, **kw)  # 3 partitions
    assert plan.config.num_partitions == 3 and plan.fused_combine
    assert plan_paged_decode(table, lens, partition_size=16, fused_combine=True,
                             **kw).fused_combine
    assert not plan_paged_decode(table, lens, partition_size=16, fused_combine=False,
                                 **kw).fused_combine
    # one partition: nothing to merge, whatever is asked
    assert not plan_paged_decode(table, lens, fused_combine=True, **kw).fused_combine
    # a workspace without counters (built by hand) keeps the two-launch combine
    ws = allocate_decode_workspace(max_num_seqs=2, num_q_heads=4, num_kv_heads=1,
                                   head_dim=64, max_context_len=table.shape[1] * 16,
                                   device=DEV, partition_size=16)
    ws.counters = None
    plan = plan_paged_decode(table, lens, partition_size=16, workspace=ws,
                             fused_combine=True, **kw)
    assert not plan.fused_combine and plan.num_launches == 2
    out = paged_decode_attention(q, k, v, table, lens, plan=plan)
    _check(out, q, k, v, table, lens)


def test_fused_combine_counters_too_small_is_an_error():
    q, k, v, table, lens, _ = _problem(hkv=2, group=2, head_dim=64, page=16,
                                       seq_lens=[60, 20], num_tokens=1, dtype=CPU_DTYPE,
                                       device=DEV)
    ws = allocate_decode_workspace(max_num_seqs=2, num_q_heads=4, num_kv_heads=2,
                                   head_dim=64, max_context_len=table.shape[1] * 16,
                                   device=DEV, partition_size=16)
    ws.counters = ws.counters[:3]  # needs 2 sequences x 2 KV heads
    with pytest.raises(ValueError, match="counters"):
        plan_paged_decode(table, lens, num_q_heads=4, num_kv_heads=2, head_dim=64,
                          page_size=16, q_dtype=q.dtype, kv_dtype=v.dtype, partition_size=16,
                          workspace=ws, fused_combine=True, impl="triton")


def test_combine_chunk_rule_bounds_registers():
    for rows_pad in (1, 2, 4, 8, 16, 32, 64):
        for d in (64, 128, 256):
            c = tuning.combine_chunk(rows_pad=rows_pad, head_dim_pad=d, num_warps=4)
            assert 1 <= c <= 16
            assert c == 1 or c * rows_pad * d <= 16 * 32 * 4
            if rows_pad >= 8:  # one partition a step (registers: see the rule's docstring)
                assert c == 1
    for d in (64, 128, 256):  # the combine kernel alone: 64 values per thread, <= 64
        c = tuning.combine_chunk(rows_pad=1, head_dim_pad=d, num_warps=4, fused=False)
        assert c == min(64, 64 * 32 * 4 // d)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (real grids, concurrent programs)")
@pytest.mark.parametrize("group,head_dim,num_tokens", [(1, 128, 1), (4, 128, 1), (8, 64, 1),
                                                       (16, 128, 1), (64, 128, 1),
                                                       (4, 256, 1), (6, 96, 3)])
def test_gpu_fused_combine_many_programs(group, head_dim, num_tokens):
    gen = torch.Generator().manual_seed(group * 1000 + head_dim)
    seq_lens = [int(x) for x in torch.randint(0, 6000, (37,), generator=gen)] + [0, 1, 8192]
    q, k, v, table, lens, options = _problem(
        hkv=max(1, 8 // group), group=group, head_dim=head_dim, page=16, seq_lens=seq_lens,
        num_tokens=num_tokens, dtype=torch.bfloat16, device="cuda", layout="bshd",
        sinks=True)
    out, plan, ws = _run(q, k, v, table, lens, page=16, partition_size=256, fused=True,
                         **options)
    assert plan.fused_combine and plan.config.num_partitions > 16
    torch.cuda.synchronize()
    _check(out, q, k, v, table, lens, **options)
    assert int(ws.counters.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (CUDA graphs)")
def test_gpu_fused_combine_graph_replays_are_all_right():
    """200 replays of one captured launch with new queries each time: a counter left
    non-zero or a merge that read a partition before it was written shows as a wrong row."""
    seq_lens = [1, 4000, 777, 12000, 0, 2500, 64, 9000]
    q, k, v, table, lens, _ = _problem(hkv=8, group=4, head_dim=128, page=16,
                                       seq_lens=seq_lens, num_tokens=1,
                                       dtype=torch.bfloat16, device="cuda", layout="bshd")
    out, plan, ws = _run(q, k, v, table, lens, page=16, partition_size=512, fused=True)
    qs, outs = _replays(q, k, v, table, lens, out, plan, 200)
    torch.cuda.synchronize()
    for i in range(0, qs.shape[0], 40):
        _check(outs[i], qs[i], k, v, table, lens)
    # every replay equals an eager call on the same queries, bit for bit
    eager = torch.stack([paged_decode_attention(qs[i], k, v, table, lens, plan=plan)
                         for i in range(qs.shape[0])])
    assert torch.equal(eager, outs)
    assert int(ws.counters.abs().sum()) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs an NVIDIA GPU of sm_90+")
def test_gpu_pdl_combine_equals_plain_launch_eager_and_replayed(monkeypatch):
    """The combine as a programmatic dependent launch waits for the decode grid: its output
    equals the plain two-launch form bit for bit, eagerly and over 100 graph replays with new
    queries each time (a merge that read a partition before it was written would differ)."""
    seq_lens = [1, 4000, 777, 32768, 0, 2500, 64, 9000]
    q, k, v, table, lens, options = _problem(
        hkv=8, group=4, head_dim=128, page=16, seq_lens=seq_lens, num_tokens=1,
        dtype=torch.bfloat16, device="cuda", layout="bshd", sinks=True)
    monkeypatch.setenv("HYGON_ATTN_DECODE_PDL", "0")
    plain, plan, ws = _run(q, k, v, table, lens, page=16, partition_size=256, fused=False,
                           **options)
    assert not plan.pdl
    monkeypatch.setenv("HYGON_ATTN_DECODE_PDL", "1")
    out, pplan, _ = _run(q, k, v, table, lens, page=16, partition_size=256, fused=False,
                         workspace=ws, **options)
    assert pplan.pdl and pplan.num_launches == 2
    torch.cuda.synchronize()
    assert torch.equal(out, plain)
    qs, outs = _replays(q, k, v, table, lens, out, pplan, 100, **options)
    eager = torch.stack([paged_decode_attention(qs[i], k, v, table, lens, plan=plan, **options)
                         for i in range(qs.shape[0])])
    torch.cuda.synchronize()
    assert torch.equal(eager, outs)
    _check(outs[7], qs[7], k, v, table, lens, **options)


def test_pdl_rule_env_and_devices(monkeypatch):
    """Never on a CPU tensor's plan, off with HYGON_ATTN_DECODE_PDL=0, a bad value named."""
    monkeypatch.setenv("HYGON_ATTN_DECODE_PDL", "1")
    assert tuning.combine_pdl(torch.device("cpu")) is False
    monkeypatch.setenv("HYGON_ATTN_DECODE_PDL", "0")
    assert tuning.combine_pdl(torch.device("cuda")) is False
    if HAS_CUDA:  # the default: on where the GPU has it
        monkeypatch.delenv("HYGON_ATTN_DECODE_PDL")
        want = torch.cuda.get_device_capability()[0] >= 9 and not _device.gpu_is_hip()
        assert tuning.combine_pdl(torch.device("cuda")) is want
    monkeypatch.setenv("HYGON_ATTN_DECODE_PDL", "yes")
    with pytest.raises(ValueError, match="HYGON_ATTN_DECODE_PDL"):
        tuning.combine_pdl(torch.device("cuda"))


# ----------------------------------------------------------------------------- per-sequence split


@pytest.mark.parametrize("fused", [True, False])
def test_per_sequence_split_spreads_short_sequences(monkeypatch, fused):
    """The measured rule fixes the partition count from the grid's context bound; each
    sequence then splits its own length: a short sequence in a grid sized for a long one
    (a CUDA graph sized for the cache) still uses several partitions. Checked through the
    scratch each partition writes, against the host mirror, and against the reference."""
    from hygon_attn_backend.ops.decode.tuning import seq_partitions

    monkeypatch.setattr(tuning, "DECODE_MIN_PARTITION", 16)
    monkeypatch.delenv("HYGON_ATTN_PARTITION_SIZE", raising=False)
    monkeypatch.delenv("PA_PARTITION_SIZE", raising=False)
    seq_lens = [900, 37, 0, 300]
    q, k, v, table, lens, _ = _problem(hkv=8, group=1, head_dim=64, page=16,
                                       seq_lens=seq_lens, num_tokens=1, dtype=CPU_DTYPE,
                                       device=DEV)
    capacity = 1024  # the bound a graph would be planned with, far above the lengths
    table = torch.cat([table, torch.full((table.shape[0], capacity // 16 - table.shape[1]),
                                         10**6, dtype=table.dtype, device=DEV)], dim=1)
    plan = plan_paged_decode(table, lens, num_q_heads=8, num_kv_heads=8, head_dim=64,
                             page_size=16, q_dtype=q.dtype, kv_dtype=v.dtype,
                             fused_combine=fused, impl="triton")
    cfg = plan.config
    assert cfg.seq_split and cfg.num_partitions > 4 and plan.fused_combine is fused
    plan.workspace.exp_sums.fill_(float("nan"))
    out = paged_decode_attention(q, k, v, table, lens, plan=plan)
    _check(out, q, k, v, table, lens)
    written = ~torch.isnan(plan.workspace.exp_sums[:, 0].view(len(seq_lens), -1)).cpu()
    for s, n in enumerate(seq_lens):
        size, parts = seq_partitions(n, cfg)
        assert written[s].tolist() == [p < parts for p in range(cfg.num_partitions)]
        assert size % cfg.block_n == 0 and (parts - 1) * size < max(n, 1) <= parts * size
    # the long sequence's partitions grow past the floor to cover it with the grid's count;
    # a shorter one still uses several partitions (of at least the floor, a whole tile)
    assert seq_partitions(900, cfg)[0] > 16 and seq_partitions(300, cfg)[1] > 1


def test_forced_partition_size_keeps_fixed_partitions(monkeypatch):
    monkeypatch.delenv("HYGON_ATTN_PARTITION_SIZE", raising=False)
    q, k, v, table, lens, _ = _problem(hkv=1, group=4, head_dim=64, page=16,
                                       seq_lens=[60, 20], num_tokens=1, dtype=CPU_DTYPE,
                                       device=DEV)
    plan = plan_paged_decode(table, lens, num_q_heads=4, num_kv_heads=1, head_dim=64,
                             page_size=16, q_dtype=q.dtype, kv_dtype=v.dtype,
                             partition_size=16, impl="triton")
    assert plan.split and not plan.config.seq_split
    monkeypatch.setenv("HYGON_ATTN_PARTITION_SIZE", "16")
    plan = plan_paged_decode(table, lens, num_q_heads=4, num_kv_heads=1, head_dim=64,
                             page_size=16, q_dtype=q.dtype, kv_dtype=v.dtype, impl="triton")
    assert plan.split and not plan.config.seq_split


@pytest.mark.parametrize("fused", [True, False])
def test_one_partition_split_gives_the_unsplit_bits(monkeypatch, fused):
    """A split launch (a CUDA graph planned for the cache's capacity) whose sequences each
    fit one partition writes exactly what the unsplit launch (the eager step) writes: the
    combine takes a lone partition's partial as it is, so graph replays and eager steps
    agree bit for bit (SGLang's kits compare them exactly). fp32 out: any rounding of the
    merge would show. Both launches take the split's 64-key tile: the unsplit rule's
    128-key tile sums P V in another order, whose last bits depend on the machine's
    matrix library under the interpreter."""
    monkeypatch.setattr(tuning, "DECODE_MIN_PARTITION", 64)
    monkeypatch.delenv("HYGON_ATTN_PARTITION_SIZE", raising=False)
    monkeypatch.delenv("PA_PARTITION_SIZE", raising=False)
    torch.manual_seed(11)
    seq_lens = [60, 20, 0, 1]
    q, k, v, table, lens, _ = _problem(hkv=2, group=4, head_dim=64, page=16,
                                       seq_lens=seq_lens, num_tokens=1, dtype=CPU_DTYPE,
                                       device=DEV)
    wide = torch.cat([table, torch.full((table.shape[0], 64 - table.shape[1]), 10**6,
                                        dtype=table.dtype, device=DEV)], dim=1)
    outs = []
    for tbl, bound in ((table, max(seq_lens)), (wide, None)):
        plan = plan_paged_decode(tbl, lens, num_q_heads=8, num_kv_heads=2, head_dim=64,
                                 page_size=16, q_dtype=q.dtype, kv_dtype=v.dtype,
                                 max_seq_len=bound, fused_combine=fused, return_lse=True,
                                 tile=(64, None, None, None), impl="triton")
        out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=DEV)
        lse = torch.full(q.shape[:-1], float("nan"), dtype=torch.float32, device=DEV)
        plan.run(q, k, v, out=out, lse=lse)
        outs.append((plan.split, out, lse))
    (split_a, out_a, lse_a), (split_b, out_b, lse_b) = outs
    assert not split_a and split_b
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)
    _check(out_b.to(q.dtype), q, k, v, table, lens)
