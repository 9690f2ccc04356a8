"""The native kernels (csrc/, ``impl="native"``) against reference.py.

GPU tests (``@pytest.mark.gpu``) build the extension on first use and run the same case
grid as the Triton decode and cache tests: KV layouts, page sizes 1/16/64, GQA groups
1/3/4/8/16/64, every head_dim, ragged batches, split and unsplit launches, hostile block
ids, speculative tokens, window / soft cap / sinks, fp8 KV, CUDA-graph replay.
CPU tests: the choice of implementation, the doctor line, and the libraries that
``scripts/ci_native_compile.sh`` links (loaded into the CPU torch, every op registered).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hygon_attn_backend import native, reference
from hygon_attn_backend.ops.cache import tuning as cache_tuning
from hygon_attn_backend.ops.decode import tuning
from hygon_attn_backend.ops.prefill import tuning as prefill_tuning
from hygon_attn_backend.ops._dispatch import select_impl
from hygon_attn_backend.ops.decode import allocate_decode_workspace, paged_decode_attention
from hygon_attn_backend.ops.decode import plan_paged_decode
from tests import support
from tests.support.budget import assert_within_budget
from tests.ops.test_cache_ops import LAYOUT_NAMES, _run_copy_case, _run_write_case, _seed
from tests.ops.test_decode import make_cache, make_table, run_case

HAS_CUDA = torch.cuda.is_available()
CI_OUT = support.REPO / "build" / "native-ci"
gpu = pytest.mark.gpu


def _native_case(**kw):
    return run_case(device=torch.device("cuda"), impl="native", **kw)


# ----------------------------------------------------------------------------- GPU: decode


@gpu
@pytest.mark.parametrize("partition_size", [None, 256])
@pytest.mark.parametrize("group", [1, 3, 4, 8, 16, 64])
def test_native_decode_groups(group, partition_size):
    _native_case(num_kv_heads=max(1, 8 // group) if group < 16 else 1, group=group,
                 head_dim=128, page_size=16, seq_lens=[1, 1000, 4097, 2053, 16, 0],
                 layout="bshd", dtype=torch.bfloat16, partition_size=partition_size)


@gpu
@pytest.mark.skipif(HAS_CUDA and bool(torch.version.hip), reason="the NVIDIA rule (HIP: native always)")
def test_auto_decode_on_nvidia_follows_the_grid(monkeypatch):
    """impl="auto" on NVIDIA: the native decode for a grid of >= 1.5 (sequence, KV head)
    programs an SM (tuning.native_preferred_nvidia), Triton for a small batch; the
    large-grid answer is right by the reference (run_case), ragged lengths included."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    hkv, group = 8, 4
    big = -(-int(tuning.NATIVE_DECODE_MIN_PROGRAMS_PER_SM * sms) // hkv) + 1
    for seqs, want in ((big, "native"), (2, "triton")):
        table = torch.zeros(seqs, 4, dtype=torch.int32, device="cuda")
        lens = torch.full((seqs,), 64, dtype=torch.int32, device="cuda")
        plan = plan_paged_decode(table, lens, num_q_heads=hkv * group, num_kv_heads=hkv,
                                 head_dim=128, page_size=16, q_dtype=torch.bfloat16,
                                 kv_dtype=torch.bfloat16)
        assert plan.impl == want, (seqs, plan.impl)
    lens = [1 + (37 * i) % 300 for i in range(big)]
    run_case(num_kv_heads=hkv, group=group, head_dim=128, page_size=16, seq_lens=lens,
             layout="vllm", dtype=torch.bfloat16, device=torch.device("cuda"), impl="auto")


@gpu
@pytest.mark.parametrize("partition_size", [None, 256])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 192, 256])
def test_native_decode_head_dims_pages(head_dim, page_size, partition_size):
    _native_case(num_kv_heads=2, group=4, head_dim=head_dim, page_size=page_size,
                 seq_lens=[700, 1, 333, 64], layout="bhsd", dtype=torch.float16,
                 partition_size=partition_size)


@gpu
@pytest.mark.parametrize("partition_size", [None, 256])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("layout", ["bshd", "bhsd", "bhds", "split_x", "vllm"])
def test_native_decode_layouts(layout, page_size, partition_size):
    _native_case(num_kv_heads=4, group=3, head_dim=128, page_size=page_size,
                 seq_lens=[1500, 31, 257], layout=layout, dtype=torch.bfloat16,
                 partition_size=partition_size)



@gpu
@pytest.mark.parametrize("partition_size", [None, 128])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("kind", ["k_bshd_v_bhsd", "v_before_k"])
def test_native_decode_k_and_v_strides(kind, head_dim, partition_size):
    """The split-N loop addresses a V row as its K row plus one distance when the two caches
    share block and slot strides, and on its own otherwise: K and V of different layouts
    (the second way), and one allocation holding V before K (a negative distance), both
    with a bad block id in the table. Every token must come from its own row."""
    dev = torch.device("cuda")
    nb, hkv, page, group = 48, 2, 16, 4  # 19 + 2 + 9 blocks used
    if kind == "k_bshd_v_bhsd":
        k = make_cache(nb, hkv, page, head_dim, "bshd", torch.bfloat16, dev)[0]
        v = make_cache(nb, hkv, page, head_dim, "bhsd", torch.bfloat16, dev)[1]
        assert k.stride() != v.stride()
    else:
        kv = torch.randn(2, nb, page, hkv, head_dim, device=dev).to(torch.bfloat16)
        v, k = kv[0].permute(0, 2, 1, 3), kv[1].permute(0, 2, 1, 3)
        assert v.data_ptr() < k.data_ptr() and k.stride() == v.stride()
    seq_lens = [300, 17, 129]
    table = make_table(seq_lens, page, nb, dev)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    q = torch.randn(len(seq_lens), hkv * group, head_dim, device=dev).to(torch.bfloat16)
    out = paged_decode_attention(q, k, v, table, lens, partition_size=partition_size,
                                 impl="native")
    ref64 = reference.paged_decode_attention(q, k, v, table, lens, compute_dtype=torch.float64)
    ref_lp = reference.paged_decode_attention(q, k, v, table, lens, compute_dtype=torch.bfloat16)
    assert_within_budget(out, ref64, ref_lp)
    # a bad id in the middle of sequence 0: its 16 keys are absent, the rest unchanged
    bad = table.clone()
    bad[0, 5] = -1
    out_bad = paged_decode_attention(q, k, v, bad, lens, partition_size=partition_size,
                                     impl="native")
    ref_bad = reference.paged_decode_attention(q, k, v, bad, lens, compute_dtype=torch.float64)
    ref_bad_lp = reference.paged_decode_attention(q, k, v, bad, lens,
                                                  compute_dtype=torch.bfloat16)
    assert_within_budget(out_bad, ref_bad, ref_bad_lp)
    assert not torch.equal(out_bad[0], out[0]) and torch.equal(out_bad[1:], out[1:])

@gpu
@pytest.mark.parametrize("parts", [2, 3, 5, 8, 16, 40])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_native_decode_combine_block_sizes(parts, head_dim):
    # the combine's block size follows the launch's partitions (64-512 threads: decode.cu,
    # combine_threads); every size merges to the answer, ragged sequences included (a
    # short one has fewer partitions than the launch)
    ctx = 64 * parts * 4
    _native_case(num_kv_heads=4, group=8, head_dim=head_dim, page_size=16,
                 seq_lens=[ctx, ctx // 3, 1, ctx - 5], layout="bshd", dtype=torch.bfloat16,
                 partition_size=ctx // parts)


def _out_like(q, kind, dtype):
    """An output for q of ``kind``: contiguous, rows padded (channels contiguous, 4-channel
    stores), shifted by one element (misaligned: per-element stores) or channels strided."""
    s, hq, d = q.shape
    if kind == "contiguous":
        return torch.empty(s, hq, d, dtype=dtype, device=q.device)
    if kind == "padded_rows":
        return torch.empty(s, hq, d + 8, dtype=dtype, device=q.device)[..., :d]
    if kind == "shifted":
        return torch.empty(s * hq * d + 1, dtype=dtype, device=q.device)[1:].view(s, hq, d)
    return torch.empty(s, d, hq, dtype=dtype, device=q.device).transpose(1, 2)  # channels strided


@gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kind", ["contiguous", "padded_rows", "shifted", "channels_strided"])
@pytest.mark.parametrize("partition_size", [None, 256])
def test_native_decode_output_layouts(kind, out_dtype, partition_size):
    # the unsplit split-N loop stores 4 channels at once where out's rows allow it, element
    # by element elsewhere; both must write exactly the answer, and nothing else
    torch.manual_seed(3)
    seq_lens, page, hkv, group, d = [900, 5, 300], 16, 4, 4, 128
    nb = sum(-(-n // page) for n in seq_lens)
    k, v = make_cache(nb, hkv, page, d, "bshd", torch.bfloat16, torch.device("cuda"))
    table = make_table(seq_lens, page, nb, torch.device("cuda"))
    lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
    q = torch.randn(len(seq_lens), hkv * group, d, dtype=torch.bfloat16, device="cuda")
    out = _out_like(q, kind, out_dtype)
    base = out._base if out._base is not None else out
    base.fill_(float("nan"))
    res = paged_decode_attention(q, k, v, table, lens, out=out, impl="native",
                                 partition_size=partition_size)
    assert res is out
    ref64 = reference.paged_decode_attention(q, k, v, table, lens, compute_dtype=torch.float64)
    ref_lp = reference.paged_decode_attention(q, k, v, table, lens, compute_dtype=torch.bfloat16)
    assert_within_budget(out, ref64, ref_lp)
    # the padding (and the element before a shifted view) is never written
    written = torch.zeros(base.numel(), dtype=torch.bool, device="cuda")
    idx = torch.arange(base.numel(), device="cuda").as_strided(
        out.shape, out.stride(), out.storage_offset() - base.storage_offset())
    written[idx.reshape(-1)] = True
    assert torch.isnan(base.reshape(-1)[~written]).all()


@gpu
@pytest.mark.parametrize("split_n,stages", [("0", "2"), ("1", "2"), ("1", "3")])
@pytest.mark.parametrize("partition_size", [None, 256])
@pytest.mark.parametrize("head_dim,group", [(64, 1), (128, 8), (96, 16)])
def test_native_decode_both_loops(monkeypatch, split_n, stages, partition_size, head_dim,
                                  group):
    """Groups up to 16 at head_dim <= 128 run the split-N loop on mma.sync GPUs, with 2 or 3
    cp.async stages of 64-token tiles (partitions of 256 tokens are 4 tiles, 1000 tokens
    unsplit 16); the shared-softmax loop (loop_stages 0) runs the same cases."""
    monkeypatch.setattr(tuning, "native_loop_stages",
                        lambda split_n=True: int(stages) if split_n and split_n_on else 0)
    split_n_on = split_n == "1"
    _native_case(num_kv_heads=2, group=group, head_dim=head_dim, page_size=16,
                 seq_lens=[1000, 1, 77, 0], layout="bshd", dtype=torch.bfloat16,
                 partition_size=partition_size, sinks=torch.randn(2 * group, device="cuda"),
                 sliding_window=500)


def test_native_stage_rule():
    """tuning.native_loop_stages: 3 stages of 64-token tiles (every grid measured), 0 (the
    shared-softmax loop) when the split-N loop is turned off."""
    assert tuning.native_loop_stages() == 3
    assert tuning.native_loop_stages(split_n=False) == 0
    assert tuning.NATIVE_LOOP_TILE == 64


@gpu
@pytest.mark.parametrize("head_dim,group,tokens", [(128, 64, 1), (256, 8, 8), (128, 16, 3)])
@pytest.mark.parametrize("partition_size", [None, 256])
def test_native_decode_32_row_programs(head_dim, group, tokens, partition_size):
    """More than 32 query rows a KV head in 32-row programs (row chunks): the route the
    launch takes where a 64-row program's shared memory is past the device's limit (gfx9's
    64 KB at D >= 128), forced here with the plan's ``native_max_rows = 32``; the output
    equals the 64-row programs' within the reference's budget."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    dev = torch.device("cuda")
    torch.manual_seed(3)
    seq_lens, page, hkv = [1500, 31, 257], 16, 1
    nb = sum(-(-n // page) for n in seq_lens) + 4
    k, v = make_cache(nb, hkv, page, head_dim, "bshd", torch.bfloat16, dev)
    table = make_table(seq_lens, page, nb, dev)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    q = torch.randn(len(seq_lens), tokens, hkv * group, head_dim, dtype=torch.bfloat16,
                    device=dev)
    ws = allocate_decode_workspace(max_num_seqs=len(seq_lens), num_q_heads=hkv * group,
                                   num_kv_heads=hkv, head_dim=head_dim,
                                   max_context_len=table.shape[1] * page, device=dev,
                                   num_tokens=tokens, partition_size=partition_size)
    outs = []
    for max_rows in (0, 32):
        plan = plan_paged_decode(table, lens, num_q_heads=hkv * group, num_kv_heads=hkv,
                                 head_dim=head_dim, page_size=page, q_dtype=q.dtype,
                                 kv_dtype=k.dtype, workspace=ws, num_tokens=tokens,
                                 partition_size=partition_size, impl="native")
        plan.native_max_rows = max_rows
        outs.append(paged_decode_attention(q, k, v, table, lens, plan=plan))
    ref64 = reference.paged_decode_attention(q, k, v, table, lens, compute_dtype=torch.float64)
    ref_lp = reference.paged_decode_attention(q, k, v, table, lens, compute_dtype=q.dtype)
    for out in outs:
        assert_within_budget(out, ref64, ref_lp)


def test_native_decode_call_args_resolved_once(monkeypatch):
    """The native decode's per-layer call: the layer's side (scales, sinks, soft cap,
    window) and the plan's side (workspace, partitions, loop, combine launch, L2 policy)
    are built once and reach the op in its schema's order; per call only q and out change.
    CPU: the op is a recorder standing in for torch.ops.hygon_attn."""
    from hygon_attn_backend.ops.decode import DecodeLayer, plan_paged_decode

    calls = []

    class Ops:
        @staticmethod
        def paged_decode(*args):
            calls.append(args)

    monkeypatch.setattr(native, "load", lambda: Ops)
    B, hq, hkv, d, page, ctx = 2, 8, 2, 64, 16, 512
    # fp16: a CPU bf16 plan runs the reference where the interpreter's bf16 is wrong
    k = torch.zeros(B * ctx // page, hkv, page, d, dtype=torch.float16)
    table = torch.arange(k.shape[0], dtype=torch.int32).view(B, -1)
    lens = torch.full((B,), ctx, dtype=torch.int32)
    ws = allocate_decode_workspace(max_num_seqs=B, num_q_heads=hq, num_kv_heads=hkv,
                                   head_dim=d, max_context_len=ctx, device=k.device)
    plan = plan_paged_decode(table, lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                             page_size=page, q_dtype=k.dtype, kv_dtype=k.dtype,
                             max_seq_len=ctx, workspace=ws, partition_size=256,
                             impl="triton")
    # what plan_paged_decode sets for impl="native" on a GPU, set by hand on the CPU plan
    plan.impl, plan.native_stages, plan.native_tile = "native", 3, 64
    sinks = torch.randn(hq, dtype=torch.float16)
    layer = DecodeLayer(k, k, scale=0.5, soft_cap=30.0, sliding_window=100, sinks=sinks)
    outs = []
    for _ in range(2):
        q = torch.randn(B, hq, d, dtype=torch.float16)
        outs.append((q, torch.empty_like(q)))
        plan.run_layer(layer, q, outs[-1][1])
    assert len(calls) == 2
    for (q, out), args in zip(outs, calls):
        assert args[0].shape == (B, 1, hq, d) and args[0].data_ptr() == out.data_ptr()
        assert args[1].data_ptr() == q.data_ptr()
        assert args[2] is k and args[4] is table and args[5] is lens
        assert args[6].dtype == torch.float32 and torch.equal(args[6], sinks.float())
        assert args[7] is None and args[8] is None  # float scales: no scale tensors
        assert args[9] is ws.max_logits and args[10] is ws.exp_sums and args[11] is ws.partial_out
        assert args[12:] == (0.5, 1.0, 1.0, 30.0, 100, 256, 2, 3, 64, plan.pdl, 0)
    assert calls[0][6] is calls[1][6]  # the sinks converted once, for the layer
    assert layer.native_args is not None and plan._native_args is not None


def test_native_decode_rows_per_program():
    """The partition rule counts the programs the launch makes: 64-row programs, 32-row
    ones on HIP past head_dim 64 (dispatch_rows: the 64-row layout is past 64 KB there)."""
    from hygon_attn_backend.ops.decode import native as _native

    assert _native.rows_per_program(128, is_hip=False) == 64
    assert _native.rows_per_program(128, is_hip=True) == 32
    assert _native.rows_per_program(256, is_hip=True) == 32
    assert _native.rows_per_program(64, is_hip=True) == 64
    progs = functools.partial(_native.grid_programs, num_seqs=2, num_kv_heads=4)
    assert progs(rows=64, head_dim=128, is_hip=False) == 8
    assert progs(rows=64, head_dim=128, is_hip=True) == 16
    assert progs(rows=33, head_dim=256, is_hip=True) == 16
    assert progs(rows=32, head_dim=128, is_hip=True) == 8
    assert progs(rows=130, head_dim=64, is_hip=True) == 24


@pytest.mark.parametrize("programs,ctx", [(8, 32768), (8, 131072), (32, 32768), (512, 4096),
                                          (512, 16384), (8192, 2048), (64, 8192), (1, 300)])
@pytest.mark.parametrize("per_sm", [2, 3])
def test_native_partition_rule(programs, ctx, per_sm):
    """tuning.native_partition_size: whole tiles of at least 256 tokens (or the
    whole context), and a grid that is never worse, by the rule's own cost, than unsplit
    or than the Triton rule's partition count."""
    sms, block_n = 132, 64
    slots = per_sm * sms
    size = tuning.native_partition_size(programs=programs, max_context_len=ctx,
                                               block_n=block_n, programs_per_sm=per_sm,
                                               num_sms=sms)
    tiles = -(-ctx // block_n)
    assert size % block_n == 0 and (size >= tuning.DECODE_MIN_PARTITION or size >= ctx)

    def cost(parts):
        per = -(-tiles // parts)
        waves = -(-(programs * parts) // slots)
        return waves * (per + tuning.NATIVE_PROGRAM_TILES) + \
            (tuning.NATIVE_COMBINE_TILES if parts > 1 else 0)

    parts = -(-ctx // size)
    assert cost(parts) <= cost(1)
    triton_size = tuning.triton_partition_size(num_seqs=programs, num_kv_heads=1, group=1,
                                               max_context_len=ctx, num_sms=sms)
    assert cost(parts) <= cost(-(-ctx // triton_size))
    if 2 * programs >= tuning.NATIVE_MAX_WAVES * slots:  # many waves already: no split
        assert parts == 1
    capped = tuning.native_partition_size(
        programs=programs, max_context_len=ctx, block_n=block_n, programs_per_sm=per_sm,
        num_sms=sms, max_partitions=2)
    assert -(-ctx // capped) <= 2


@gpu
@pytest.mark.parametrize("page_size", [3, 24, 48])
def test_native_decode_odd_page_sizes(page_size):
    """Page sizes that are not powers of two: the token -> (block, slot) division by a
    multiplier (csrc/fastdiv.h) on the device, in both loops' staging."""
    for group in (4, 32):  # split-N loop (16 rows), shared-softmax loop (32 rows)
        _native_case(num_kv_heads=2, group=group, head_dim=128, page_size=page_size,
                     seq_lens=[1000, 7, 95], layout="bshd", dtype=torch.bfloat16,
                     partition_size=None)


@gpu
def test_native_decode_table_without_columns():
    """Every sequence empty and a block table of zero columns: zeros, no error (the entry
    point's 32-bit checks of the table's span must accept it)."""
    q = torch.randn(2, 8, 64, dtype=torch.float16, device="cuda")
    k = torch.randn(4, 2, 16, 64, dtype=torch.float16, device="cuda")
    v = torch.randn_like(k)
    table = torch.zeros(2, 0, dtype=torch.int32, device="cuda")
    lens = torch.zeros(2, dtype=torch.int32, device="cuda")
    out = paged_decode_attention(q, k, v, table, lens, impl="native")
    assert out.shape == q.shape and not out.isnan().any() and out.abs().max().item() == 0.0


@gpu
@pytest.mark.parametrize("head_dim", [128, 256])
def test_native_combine_more_partitions_than_one_block(head_dim):
    """The combine kernel merges partitions in chunks of its 512 threads (groups of
    head_dim / 4 threads, 4 channels a thread: 16 groups at D=128, 8 at D=256, every 16th or
    8th partition each): 40,000 tokens in 64-token partitions are 625 of them, so the chunk
    loop runs twice, with a remainder in each group. Short and empty sequences beside it."""
    _native_case(num_kv_heads=2, group=4, head_dim=head_dim, page_size=16,
                 seq_lens=[40000, 33, 0, 2049], layout="bshd", dtype=torch.bfloat16,
                 partition_size=64)


@gpu
def test_native_decode_bad_loop():
    """The native op refuses a loop it has no code for (stages other than 0, 2, 3, 4; a
    tile other than 64), in the launch and in the occupancy query."""
    q = torch.randn(1, 1, 8, 128, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(2, 2, 16, 128, dtype=torch.bfloat16, device="cuda")
    table = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    lens = torch.full((1,), 5, dtype=torch.int32, device="cuda")
    for stages, tile in ((1, 64), (5, 64), (3, 32)):
        with pytest.raises(RuntimeError, match="loop_stages must be 0|loop_tile must be 64"):
            native.load().paged_decode(torch.empty_like(q), q, k, k, table, lens, None, None,
                                       None, q, q, q, 1.0, 1.0, 1.0, 0.0, 0, 1 << 30, 1, stages,
                                       tile, False, 0)
        with pytest.raises(RuntimeError, match="loop_stages must be 0|loop_tile must be 64"):
            native.load().decode_programs_per_sm(torch.bfloat16, torch.bfloat16, 128, 16,
                                                 stages, tile)


@gpu
def test_native_decode_occupancy_query():
    """The occupancy the partition rule plans with: at least one program an SM, no more
    with 3 stages of 35 KB than with 2."""
    ops = native.load()
    per = {s: ops.decode_programs_per_sm(torch.bfloat16, torch.bfloat16, 128, 16, s, 64)
           for s in (0, 2, 3)}
    assert min(per.values()) >= 1, per
    assert per[2] >= per[3], per


@gpu
@pytest.mark.parametrize("num_tokens,group", [(3, 4), (2, 5), (4, 1), (2, 64)])
@pytest.mark.parametrize("partition_size", [None, 256])
def test_native_decode_speculative_tokens(num_tokens, group, partition_size):
    # (2, 64): 128 rows, two row chunks of 64
    _native_case(num_kv_heads=1, group=group, head_dim=128, page_size=16,
                 seq_lens=[900, 5, 2000], layout="bshd", dtype=torch.bfloat16,
                 num_tokens=num_tokens, partition_size=partition_size)


@gpu
@pytest.mark.parametrize("partition_size", [None, 256])
@pytest.mark.parametrize("option", ["window", "soft_cap", "sinks", "all"])
def test_native_decode_options(option, partition_size):
    kw = {}
    if option in ("window", "all"):
        kw["sliding_window"] = 300
    if option in ("soft_cap", "all"):
        kw.update(soft_cap=2.0, scale=0.5)
    if option in ("sinks", "all"):
        kw["sinks"] = torch.randn(10, dtype=torch.float32, device="cuda") * 2
    _native_case(num_kv_heads=2, group=5, head_dim=128, page_size=16, seq_lens=[900, 5, 2000, 0],
                 layout="bshd", dtype=torch.bfloat16, partition_size=partition_size,
                 num_tokens=3 if option == "all" else None, **kw)


@gpu
@pytest.mark.parametrize("tensor_scales", [False, True])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_native_decode_fp8(kv_dtype, tensor_scales):
    scales = (0.02, 0.05)
    if tensor_scales:
        scales = tuple(torch.tensor([s], device="cuda") for s in scales)
    _native_case(num_kv_heads=2, group=8, head_dim=128, page_size=16, seq_lens=[3000, 7],
                 layout="bhsd", dtype=torch.bfloat16, kv_dtype=kv_dtype, scales=scales,
                 partition_size=256)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("head_dim,layout", [(64, "bshd"), (256, "vllm"), (128, "bhds")])
def test_native_fp8_shared_softmax_loop(head_dim, layout, kv_dtype, dtype):
    """fp8 caches the split-N loop does not take (head_dim 64 and 256, channels strided) run
    the shared-softmax loop, which widens the codes to q's dtype two at a time
    (csrc/fp8_widen.h, checked exhaustively on the host by check_fp8.cpp): both formats into
    fp16 and bf16 against the reference."""
    _native_case(num_kv_heads=2, group=4, head_dim=head_dim, page_size=16,
                 seq_lens=[700, 9, 130], layout=layout, dtype=dtype, kv_dtype=kv_dtype,
                 scales=(0.02, 0.05), partition_size=256)


# (head_dim, group, tokens, layout, page, seq_lens, partition_size, options): rows G * T <= 16
FP8_SPLIT_N_CASES = [
    (128, 8, 1, "vllm", 16, [1000, 1, 77, 0], None, ("sinks", "window")),
    (96, 4, 1, "bshd", 1, [300, 2049], 256, ("soft_cap",)),
    (80, 16, 1, "bhsd", 64, [4097, 64], None, ()),
    (128, 1, 1, "bshd", 16, [5000, 3], 256, ()),
    (128, 4, 3, "vllm", 16, [700, 33, 2], None, ("window",)),
]


@gpu
@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("case", FP8_SPLIT_N_CASES, ids=lambda c: f"D{c[0]}G{c[1]}T{c[2]}-{c[3]}-P{c[4]}")
def test_native_fp8_split_n_loop(monkeypatch, stages, kv_dtype, case):
    """fp8 caches in 16-byte rows (head_dim 80-128) run the split-N loop on fp16 products
    (decode_split_n.cuh: the permuted k-steps of K, the byte-paired tokens of V), with 2-4
    cp.async stages, split and unsplit, every option, against reference.py."""
    head_dim, group, tokens, layout, page, lens, psize, opts = case
    monkeypatch.setattr(tuning, "native_loop_stages", lambda split_n=True: stages if split_n else 0)
    kw = {}
    if "sinks" in opts:
        kw["sinks"] = torch.randn(2 * group, device="cuda")
    if "window" in opts:
        kw["sliding_window"] = 400
    if "soft_cap" in opts:
        kw.update(soft_cap=3.0, scale=0.3)
    _native_case(num_kv_heads=2, group=group, head_dim=head_dim, page_size=page, seq_lens=lens,
                 layout=layout, dtype=torch.bfloat16, kv_dtype=kv_dtype, scales=(0.03, 0.04),
                 partition_size=psize, num_tokens=tokens if tokens > 1 else None, **kw)


@gpu
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_native_fp8_queries_past_fp16_range_and_nan_rows(kv_dtype):
    """The fp8 split-N loop takes a bf16 query of |q| ~ 3e5 (past fp16's range) scaled by a
    power of two per row, and a NaN query head stays in its row: the same defined answers
    as the Triton kernel (tests/ops/test_decode_fp8.py)."""
    from tests.ops.test_decode_fp8 import _fp8_case
    out, ref64, lowp = _fp8_case(kv_dtype, seq_lens=[300, 17], q_mult=3e5, head_dim=128,
                                 impl="native")
    assert bool(out.isfinite().all())
    assert_within_budget(out, ref64, lowp)
    torch.manual_seed(5)
    clean, _, _ = _fp8_case(kv_dtype, seq_lens=[40, 21], head_dim=128, impl="native")
    torch.manual_seed(5)
    dirty, _, _ = _fp8_case(kv_dtype, seq_lens=[40, 21], nan_row=(0, 1), head_dim=128,
                            impl="native")
    assert bool(dirty[0, 1].isnan().all())
    keep = torch.ones(dirty.shape[:2], dtype=torch.bool, device="cuda")
    keep[0, 1] = False
    assert torch.equal(dirty[keep], clean[keep])


@gpu
@pytest.mark.parametrize("partition_size", [None, 16])
@pytest.mark.parametrize("bad_id", [-1, 10_000, "short_table"])
def test_native_decode_hostile_block_ids(bad_id, partition_size):
    """The third block of a 40-token sequence is unusable: the result must equal the
    reference over its first 32 tokens (those keys skipped, never read)."""
    dev = torch.device("cuda")
    k, v = make_cache(8, 1, 16, 64, "bhsd", torch.float16, dev)
    q = torch.randn(1, 4, 64, dtype=torch.float16, device=dev)
    table = torch.tensor([[3, 5, 1]], dtype=torch.int32, device=dev)
    if bad_id == "short_table":
        table = table[:, :2].contiguous()
    else:
        table[0, 2] = bad_id
    lens = torch.tensor([40], dtype=torch.int32, device=dev)
    out = paged_decode_attention(q, k, v, table, lens, partition_size=partition_size,
                                 impl="native")
    good = (table[:, :2].contiguous(), torch.tensor([32], dtype=torch.int32, device=dev))
    ref64 = reference.paged_decode_attention(q, k, v, *good, compute_dtype=torch.float64)
    ref_lp = reference.paged_decode_attention(q, k, v, *good, compute_dtype=torch.float16)
    assert_within_budget(out, ref64, ref_lp)


@gpu
def test_native_decode_zero_lengths_give_zeros():
    out, _ = _native_case(num_kv_heads=1, group=4, head_dim=64, page_size=16, seq_lens=[0, 0],
                          layout="bhsd", dtype=torch.float16, partition_size=16)
    assert torch.count_nonzero(out) == 0


def _graph_problem(seq_lens, partition_size):
    """bf16 decode inputs on a bshd cache (4 KV heads, G = 8, head_dim 128, page 16) and a
    workspace for ``partition_size``: ``q, k, v, table, lens, workspace``."""
    dev = torch.device("cuda")
    hkv, group, d, p = 4, 8, 128, 16
    nb = sum(-(-s // p) for s in seq_lens) + 3
    k, v = make_cache(nb, hkv, p, d, "bshd", torch.bfloat16, dev)
    table = make_table(seq_lens, p, nb, dev)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    q = torch.randn(len(seq_lens), hkv * group, d, dtype=torch.bfloat16, device=dev)
    ws = allocate_decode_workspace(max_num_seqs=len(seq_lens), num_q_heads=hkv * group,
                                   num_kv_heads=hkv, head_dim=d,
                                   max_context_len=table.shape[1] * p, device=dev,
                                   partition_size=partition_size)
    return q, k, v, table, lens, ws


@gpu
@pytest.mark.parametrize("partition_size", [None, 256])
def test_native_decode_cuda_graph_replay_equals_eager(partition_size):
    q, k, v, table, lens, ws = _graph_problem([1000, 77, 3000], partition_size)
    kw = dict(partition_size=partition_size, workspace=ws, impl="native")
    eager = paged_decode_attention(q, k, v, table, lens, **kw)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k, v, table, lens, out=out, **kw)  # warm up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    out.fill_(float("nan"))
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k, v, table, lens, out=out, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    q.copy_(torch.randn_like(q))  # new inputs, same buffers: the replay follows them
    graph.replay()
    want = paged_decode_attention(q, k, v, table, lens, **kw)
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@gpu
@pytest.mark.skipif(not HAS_CUDA or torch.version.hip is not None
                    or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs an NVIDIA GPU of sm_90+")
def test_native_pdl_combine_equals_plain_launch_eager_and_replayed(monkeypatch):
    """The native combine as a programmatic dependent launch waits for the decode grid: its
    output equals the plain launch's bit for bit, eagerly and over 50 graph replays with new
    queries each time (a merge that read a partition before it was written would differ)."""
    q, k, v, table, lens, ws = _graph_problem([1, 4000, 777, 32768, 0, 2500], 256)
    hkv, group, d, p = 4, 8, 128, 16
    monkeypatch.setenv("HYGON_ATTN_DECODE_PDL", "0")
    plain_plan = plan_paged_decode(table, lens, num_q_heads=hkv * group, num_kv_heads=hkv,
                                   head_dim=d, page_size=p, q_dtype=q.dtype, kv_dtype=k.dtype,
                                   partition_size=256, workspace=ws, impl="native")
    assert not plain_plan.pdl
    plain = paged_decode_attention(q, k, v, table, lens, plan=plain_plan)
    monkeypatch.setenv("HYGON_ATTN_DECODE_PDL", "1")
    plan = plan_paged_decode(table, lens, num_q_heads=hkv * group, num_kv_heads=hkv,
                             head_dim=d, page_size=p, q_dtype=q.dtype, kv_dtype=k.dtype,
                             partition_size=256, workspace=ws, impl="native")
    assert plan.pdl and plan.split
    out = paged_decode_attention(q, k, v, table, lens, plan=plan)
    torch.cuda.synchronize()
    assert torch.equal(out, plain)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k, v, table, lens, out=out, plan=plan)
    for _ in range(50):
        q.copy_(torch.randn_like(q))
        graph.replay()
        want = paged_decode_attention(q, k, v, table, lens, plan=plain_plan)
        torch.cuda.synchronize()
        assert torch.equal(out, want)


# ----------------------------------------------------------------------------- GPU: cache ops


GPU_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn,
                    torch.float8_e5m2)


@gpu
@pytest.mark.parametrize("page_size,head_dim", [(16, 128), (1, 80), (64, 96)])
@pytest.mark.parametrize("dtype", GPU_CACHE_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_native_write_kv_bit_exact(layout, dtype, page_size, head_dim):
    _run_write_case(layout, dtype, page_size, head_dim, torch.device("cuda"), num_kv_heads=8,
                    num_blocks=4096 // page_size, num_tokens=1000, num_pad=37,
                    seed=_seed("native", layout, str(dtype), page_size, head_dim),
                    in_dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float16,
                    impl="native")


@gpu
def test_native_write_kv_skips_bad_slots():
    dev = torch.device("cuda")
    k_cache = torch.randn(4, 2, 16, 64, device=dev).half()
    v_cache = torch.randn(4, 2, 16, 64, device=dev).half()
    before = (k_cache.clone(), v_cache.clone())
    k = torch.randn(5, 2, 64, device=dev).half()
    slots = torch.tensor([-1, -1, 64, -7, 10 ** 9], dtype=torch.int64, device=dev)
    from hygon_attn_backend.ops.cache import write_kv

    write_kv(k, k, k_cache, v_cache, slots, impl="native")
    torch.cuda.synchronize()
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e5m2, torch.float32], ids=str)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_native_copy_blocks_bit_exact(layout, dtype):
    num_blocks = 512
    gen = torch.Generator().manual_seed(_seed("native-copy", layout, str(dtype)))
    perm = torch.randperm(num_blocks, generator=gen)
    src, dst = perm[:40], perm[40:120]
    pairs = torch.stack([torch.cat([src, src]), dst], dim=1).tolist()
    pairs += [[-1, 3], [num_blocks, 4], [5, num_blocks + 9]]  # skipped, never touched
    _run_copy_case(layout, dtype, 16, 128, torch.device("cuda"), pairs[:-3],
                   num_blocks=num_blocks, num_kv_heads=8, impl="native",
                   seed=_seed("native-copy", layout, str(dtype)))


# ----------------------------------------------------------------------------- CPU


def test_native_choice_on_cpu():
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="impl='native' needs CUDA/HIP tensors"):
        select_impl("native", cpu, native_preferred=False)
    # ops without a native kernel (prefix prefill) run Triton under impl='native'
    assert select_impl("native", torch.device("cuda")) == "triton"
    # auto never takes native for CPU tensors
    assert select_impl("auto", cpu, native_preferred=True) in ("triton", "reference")


def test_native_preferred_rule():
    for rule in (tuning.native_preferred, cache_tuning.native_preferred):
        assert rule(is_hip=True, **({} if rule is cache_tuning.native_preferred else dict(
            group=8, head_dim=64, num_tokens=1, programs=1, num_sms=132, same_kv_dtype=True)))
    assert not cache_tuning.native_preferred(is_hip=False)
    assert prefill_tuning.native_preferred(is_hip=False)
    assert not prefill_tuning.native_preferred(is_hip=True)
    # NVIDIA decode: native on the measured domain only (tuning.native_preferred_nvidia)
    step = dict(is_hip=False, group=4, head_dim=128, num_tokens=1, programs=64 * 8, num_sms=132,
                same_kv_dtype=True)
    assert tuning.native_preferred(**step)
    edge = int(tuning.NATIVE_DECODE_MIN_PROGRAMS_PER_SM * 132)
    assert tuning.native_preferred(**{**step, "programs": edge + 1})
    assert not tuning.native_preferred(**{**step, "programs": edge - 1})  # splits
    for change in ({"group": 32}, {"head_dim": 64}, {"head_dim": 256},
                   {"num_tokens": 2}, {"same_kv_dtype": False}, {"programs": 8 * 8}):
        assert not tuning.native_preferred(**{**step, **change}), change
    for group in (1, 2, 8, 16):
        assert tuning.native_preferred(**{**step, "group": group})
    # fp8 KV: native at every grid of the domain (its split-N loop), not past it
    fp8 = {**step, "same_kv_dtype": False, "fp8_kv": True}
    for programs in (1, 8, edge - 1, 64 * 8):
        assert tuning.native_preferred(**{**fp8, "programs": programs})
    for change in ({"group": 32}, {"head_dim": 64}, {"num_tokens": 2}):
        assert not tuning.native_preferred(**{**fp8, **change}), change


@pytest.mark.skipif(HAS_CUDA, reason="the CPU-torch message is checked on CPU torch only")
def test_native_status_and_error_on_cpu_torch():
    assert "CPU build" in native.status() or "no GPU" in native.status()
    with pytest.raises(native.NativeUnavailable, match="Triton kernels still serve"):
        native.load()


@pytest.mark.parametrize("lib", ["_hab_cuda.so", "_hab_hip.so"])
def test_compile_check_libraries_import(lib):
    path = CI_OUT / lib
    if not path.exists():
        pytest.skip(f"{path} absent: run scripts/ci_native_compile.sh (nvcc/hipcc toolchain) "
                    "first; CI does")
    # a fresh process: TORCH_LIBRARY may register the namespace once per process
    code = ("import sys, torch; torch.ops.load_library(sys.argv[1]); "
            "from hygon_attn_backend.native import OPS; "
            "print(','.join(op for op in OPS if hasattr(torch.ops.hygon_attn, op)))")
    res = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True,
                         cwd=support.REPO, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().split(",") == list(native.OPS)
    if not HAS_CUDA:  # on CPU torch the ops exist but have no CPU kernel
        code2 = code + ("; x = torch.zeros(1, 1, 4)\n"
                        "try:\n torch.ops.hygon_attn.write_kv(x, x, x.view(1, 1, 1, 4), "
                        "x.view(1, 1, 1, 4), torch.zeros(1, dtype=torch.int32), None, None, 1., 1.)\n"
                        "except NotImplementedError as e: print('no-cpu-kernel')")
        res2 = subprocess.run([sys.executable, "-c", code2, str(path)], capture_output=True,
                              text=True, cwd=support.REPO, timeout=300)
        assert "no-cpu-kernel" in res2.stdout, res2.stderr[-2000:]


def test_wheel_ships_the_native_sources(tmp_path):
    """A pip-installed package can build the native kernels on first use: its wheel holds
    every file of csrc/ as hygon_attn_backend/_csrc, and csrc_dir() finds them there when no
    source checkout is beside the package."""
    import zipfile

    root = support.REPO
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", str(root), "-w", str(tmp_path / "wheel")],
                   check=True, capture_output=True)
    wheel = next((tmp_path / "wheel").glob("hygon_attn_backend-*.whl"))
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
    shipped = {p.name for p in (site / "hygon_attn_backend" / "_csrc").iterdir()}
    assert {p.name for p in (root / "csrc").iterdir() if p.is_file()} <= shipped
    env = {k: v for k, v in os.environ.items() if k != "HYGON_ATTN_CSRC"}
    env["PYTHONPATH"] = str(site)
    found = subprocess.run(
        [sys.executable, "-c", "from hygon_attn_backend import native; print(native.csrc_dir())"],
        check=True, capture_output=True, text=True, env=env, cwd=tmp_path).stdout.strip()
    assert Path(found) == (site / "hygon_attn_backend" / "_csrc").resolve()
