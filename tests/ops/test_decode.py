"""Paged decode attention (ops/decode.py) against reference.py.

CPU: the Triton kernels under the interpreter on small shapes, fp16 (bf16 ``tl.dot`` is
broken in the interpreter). GPU (``@pytest.mark.gpu``): real sizes, bf16 and fp16.
Oracle: reference in float64; budget: a small multiple of the reference's own error in
the input dtype (tests/support/budget.py).
"""

import math

import pytest
import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops.decode import tuning
from hygon_attn_backend.ops.decode import (allocate_decode_workspace, decode_launch_config,
                                           paged_decode_attention, plan_paged_decode)
from tests.support.budget import assert_within_budget

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
CPU_DTYPE = torch.float16

# (num_kv_heads, group, head_dim, page_size, seq_lens, layout): G in {1,4,5,8,16},
# P in {1,16,64}, D in {64,80,128,256}, lengths 1 / mid-page / exact pages / 0.
CPU_CASES = [
    (2, 1, 64, 16, [1, 37, 64], "bhsd"),
    (1, 4, 80, 1, [5, 23], "bshd"),
    (2, 5, 64, 16, [40, 17], "bshd"),
    (1, 8, 128, 64, [100, 1], "bhds"),
    (1, 16, 64, 16, [33, 0, 48], "bhsd"),
    (1, 4, 256, 8, [19], "split_x"),
    (2, 4, 64, 16, [45, 3], "vllm"),
    (1, 7, 96, 32, [70], "bshd"),
    (1, 12, 192, 16, [20], "bhsd"),
]
PARTITIONS = [None, 16, 32]  # heuristic (one partition at these sizes), forced splits


def _storage_to_view(storage, layout, head_dim):
    """Canonical ``[N, H, P, D]`` views (plain permutes, no copies) of a storage."""
    if layout == "bhsd":
        return storage
    if layout == "bshd":
        return storage.permute(0, 2, 1, 3)
    if layout == "bhds":
        return storage.permute(0, 1, 3, 2)
    raise AssertionError(layout)


def make_cache(num_blocks, num_kv_heads, page_size, head_dim, layout, dtype, device,
               kv_dtype=None, scales=(1.0, 1.0)):
    """Random K/V caches in ``layout`` as the op takes them (views or split-x 5-D K)."""
    kv_dtype = kv_dtype or dtype
    n, h, p, d = num_blocks, num_kv_heads, page_size, head_dim

    def fill(shape):
        x = torch.randn(shape, dtype=torch.float32, device=device)
        if kv_dtype in reference.FP8_DTYPES:
            return x
        return x.to(kv_dtype)

    if layout == "vllm":  # one K|V tensor, physical [N, P, H, 2D]
        kv = fill((n, p, h, 2 * d)).permute(0, 2, 1, 3)
        k, v = kv[..., :d], kv[..., d:]
    elif layout == "split_x":
        x = 16 // torch.empty((), dtype=kv_dtype).element_size()
        k = fill((n, h, d // x, p, x))
        v = fill((n, h, p, d))
    else:
        shapes = {"bhsd": (n, h, p, d), "bshd": (n, p, h, d), "bhds": (n, h, d, p)}
        k = _storage_to_view(fill(shapes[layout]), layout, d)
        v = _storage_to_view(fill(shapes[layout]), layout, d)
    if kv_dtype in reference.FP8_DTYPES:
        k = reference.quantize_fp8(k, kv_dtype, scales[0])
        v = reference.quantize_fp8(v, kv_dtype, scales[1])
    return k, v


def make_table(seq_lens, page_size, num_blocks, device, extra_cols=2):
    """Block table over a random permutation of blocks; unused columns hold ids past the
    cache (reading them would be out of bounds)."""
    need = [max(1, -(-s // page_size)) for s in seq_lens]
    cols = max(need) + extra_cols
    perm = torch.randperm(num_blocks)
    table = torch.full((len(seq_lens), cols), num_blocks + 1000, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used:used + n]
        used += n
    return table.to(device)


def blocks_needed(seq_lens, page_size):
    return sum(max(1, -(-s // page_size)) for s in seq_lens) + 3


def run_case(*, num_kv_heads, group, head_dim, page_size, seq_lens, layout, dtype, device,
             num_tokens=None, partition_size=None, kv_dtype=None, scales=(1.0, 1.0),
             mult=4.0, impl="triton", **options):
    num_q_heads = num_kv_heads * group
    nb = blocks_needed(seq_lens, page_size)
    k, v = make_cache(nb, num_kv_heads, page_size, head_dim, layout, dtype, device,
                      kv_dtype=kv_dtype, scales=scales)
    table = make_table(seq_lens, page_size, nb, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    shape = ((len(seq_lens), num_q_heads, head_dim) if num_tokens is None
             else (len(seq_lens), num_tokens, num_q_heads, head_dim))
    q = torch.randn(shape, dtype=dtype, device=device)
    kw = dict(options)
    if kv_dtype in reference.FP8_DTYPES:
        kw.update(k_scale=scales[0], v_scale=scales[1])
    out = torch.full_like(q, float("nan"))
    grid = kw.pop("kv_head_grid", None)
    if grid is not None:  # the per-query-head baseline: a plan option, not an op option
        kw["plan"] = plan_paged_decode(
            table, lens, num_q_heads=q.shape[-2], num_kv_heads=v.shape[1],
            head_dim=q.shape[-1], page_size=v.shape[2], q_dtype=q.dtype, kv_dtype=v.dtype,
            num_tokens=1 if q.dim() == 3 else q.shape[1], partition_size=partition_size,
            kv_head_grid=grid, impl=impl)
    res = paged_decode_attention(q, k, v, table, lens, out=out, partition_size=partition_size,
                                 impl=impl, **kw)
    kw.pop("plan", None)
    assert res is out
    ref_kw = {key: val for key, val in kw.items() if key not in ("kv_head_grid", "workspace")}
    ref64 = reference.paged_decode_attention(q, k, v, table, lens, **ref_kw,
                                             compute_dtype=torch.float64)
    ref_lp = reference.paged_decode_attention(q, k, v, table, lens, **ref_kw,
                                              compute_dtype=dtype)
    assert_within_budget(out, ref64, ref_lp, mult=mult)
    return out, ref64


# ----------------------------------------------------------------------------- CPU matrix


@pytest.mark.parametrize("partition_size", PARTITIONS)
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"H{c[0]}G{c[1]}D{c[2]}P{c[3]}-{c[5]}")
def test_decode_matrix(case, partition_size):
    hkv, g, d, p, lens, layout = case
    run_case(num_kv_heads=hkv, group=g, head_dim=d, page_size=p, seq_lens=lens, layout=layout,
             dtype=CPU_DTYPE if not HAS_CUDA else torch.bfloat16, device=DEV,
             partition_size=partition_size)


@pytest.mark.parametrize("prefetch", ["0", "1"])
@pytest.mark.parametrize("page_size,block_n", [(16, 16), (16, 32), (16, 64), (1, 16), (32, 16)])
def test_page_prefetch_both_ways(monkeypatch, prefetch, page_size, block_n):
    rule = tuning.tile_config
    monkeypatch.setattr(tuning, "tile_config", lambda **kw: rule(
        **{**kw, "tile": (block_n, None, None, prefetch == "1")}))
    run_case(num_kv_heads=1, group=4, head_dim=64, page_size=page_size, seq_lens=[77, 5, 33],
             layout="bshd", dtype=CPU_DTYPE, device=DEV, partition_size=32)


@pytest.mark.parametrize("kv_head_grid", [True, False])
def test_per_query_head_variant_matches(kv_head_grid):
    run_case(num_kv_heads=2, group=4, head_dim=64, page_size=16, seq_lens=[29, 50],
             layout="bhsd", dtype=CPU_DTYPE, device=DEV, partition_size=32,
             kv_head_grid=kv_head_grid)


@pytest.mark.parametrize("num_tokens,group", [(3, 4), (2, 5), (4, 1)])
@pytest.mark.parametrize("partition_size", [None, 16])
def test_speculative_tokens(num_tokens, group, partition_size):
    run_case(num_kv_heads=1, group=group, head_dim=64, page_size=16, seq_lens=[21, 40, 4],
             layout="bshd", dtype=CPU_DTYPE, device=DEV, num_tokens=num_tokens,
             partition_size=partition_size)


@pytest.mark.parametrize("partition_size", [None, 16])
@pytest.mark.parametrize("option", ["window", "soft_cap", "sinks", "all"])
def test_options(option, partition_size):
    kw = {}
    if option in ("window", "all"):
        kw["sliding_window"] = 20
    if option in ("soft_cap", "all"):
        kw["soft_cap"] = 2.0
        kw["scale"] = 0.5  # large logits so the cap bites
    if option in ("sinks", "all"):
        kw["sinks"] = torch.randn(4, dtype=torch.float32, device=DEV) * 2
    run_case(num_kv_heads=1, group=4, head_dim=64, page_size=16, seq_lens=[55, 9, 0],
             layout="bhsd", dtype=CPU_DTYPE, device=DEV, partition_size=partition_size,
             num_tokens=2 if option == "all" else None, **kw)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("tensor_scales", [False, True])
def test_fp8_kv(kv_dtype, tensor_scales):
    scales = (0.05, 0.03)
    if tensor_scales:
        scales = tuple(torch.tensor([s], device=DEV) for s in scales)
    run_case(num_kv_heads=1, group=5, head_dim=64, page_size=16, seq_lens=[30, 47],
             layout="bhsd", dtype=CPU_DTYPE, device=DEV, kv_dtype=kv_dtype, scales=scales,
             partition_size=16)


def test_zero_length_sequences_give_zeros():
    out, _ = run_case(num_kv_heads=1, group=4, head_dim=64, page_size=16, seq_lens=[0, 0],
                      layout="bhsd", dtype=CPU_DTYPE, device=DEV, partition_size=16)
    assert torch.count_nonzero(out) == 0


def _skipped_tail_case(table_edit, partition_size):
    """A sequence whose last block is unusable: the op must equal the reference over the
    tokens before it (those keys are skipped, never read out of bounds)."""
    d, p, n = 64, 16, 8
    k, v = make_cache(n, 1, p, d, "bhsd", CPU_DTYPE, DEV)
    q = torch.randn(1, 4, d, dtype=CPU_DTYPE, device=DEV)
    table = torch.tensor([[3, 5, 1]], dtype=torch.int32, device=DEV)
    table, lens = table_edit(table)
    out = paged_decode_attention(q, k, v, table, torch.tensor([lens], dtype=torch.int32,
                                 device=DEV), partition_size=partition_size, impl="triton")
    good = torch.tensor([32], dtype=torch.int32, device=DEV)
    ref = reference.paged_decode_attention(q, k, v, table[:, :2].contiguous(), good,
                                           compute_dtype=torch.float64)
    ref_lp = reference.paged_decode_attention(q, k, v, table[:, :2].contiguous(), good,
                                              compute_dtype=CPU_DTYPE)
    assert_within_budget(out, ref, ref_lp)


# 16: one lookup per 16-token tile; None: one 64-token tile over 3 pages, lookup per token
@pytest.mark.parametrize("partition_size", [16, None])
@pytest.mark.parametrize("bad_id", [-1, 10_000])
def test_bad_block_ids_are_skipped(bad_id, partition_size):
    def edit(table):
        table[0, 2] = bad_id
        return table, 40
    _skipped_tail_case(edit, partition_size)


@pytest.mark.parametrize("partition_size", [16, None])
def test_block_table_shorter_than_sequence_is_cut(partition_size):
    _skipped_tail_case(lambda table: (table[:, :2].contiguous(), 40), partition_size)


def test_workspace_reuse_and_size_check():
    hkv, g, d, p = 1, 4, 64, 16
    k, v = make_cache(20, hkv, p, d, "bhsd", CPU_DTYPE, DEV)
    table = make_table([60, 33], p, 20, DEV)
    lens = torch.tensor([60, 33], dtype=torch.int32, device=DEV)
    ws = allocate_decode_workspace(max_num_seqs=2, num_q_heads=hkv * g, num_kv_heads=hkv,
                                   head_dim=d, max_context_len=table.shape[1] * p, device=DEV,
                                   partition_size=16)
    ref = reference.paged_decode_attention(
        q := torch.randn(2, hkv * g, d, dtype=CPU_DTYPE, device=DEV), k, v, table, lens,
        compute_dtype=torch.float64)
    for _ in range(2):
        ws.partial_out.fill_(float("nan"))
        out = paged_decode_attention(q, k, v, table, lens, partition_size=16, workspace=ws,
                                     impl="triton")
        assert (out.double() - ref).abs().max().item() < 5e-3
    small = allocate_decode_workspace(max_num_seqs=2, num_q_heads=hkv * g, num_kv_heads=hkv,
                                      head_dim=d, max_context_len=table.shape[1] * p,
                                      device=DEV, num_slots=3)
    with pytest.raises(ValueError, match="workspace"):
        paged_decode_attention(q, k, v, table, lens, partition_size=16, workspace=small,
                               impl="triton")


# ----------------------------------------------------------------------------- bad input


def _good_args():
    k, v = make_cache(6, 2, 16, 64, "bhsd", CPU_DTYPE, DEV)
    q = torch.randn(2, 8, 64, dtype=CPU_DTYPE, device=DEV)
    table = make_table([20, 9], 16, 6, DEV)
    lens = torch.tensor([20, 9], dtype=torch.int32, device=DEV)
    return dict(q=q, k_cache=k, v_cache=v, block_table=table, seq_lens=lens)


@pytest.mark.parametrize("edit,name", [
    (lambda a: a.update(q=a["q"][:, :7]), "heads"),
    (lambda a: a.update(q=a["q"][..., :32].contiguous()), "head_dim"),
    (lambda a: a.update(q=a["q"].float()), "q"),
    (lambda a: a.update(k_cache=a["k_cache"].float()), "k_cache"),
    (lambda a: a.update(v_cache=a["v_cache"][:, :1]), "k_cache and v_cache"),
    (lambda a: a.update(block_table=a["block_table"].float()), "block_table"),
    (lambda a: a.update(block_table=a["block_table"][:1]), "block_table"),
    (lambda a: a.update(seq_lens=a["seq_lens"][:1]), "seq_lens"),
    (lambda a: a.update(partition_size=24), "partition_size"),
    (lambda a: a.update(sinks=torch.zeros(3, device=DEV)), "sinks"),
    (lambda a: a.update(sliding_window=0), "sliding_window"),
    (lambda a: a.update(out=torch.empty(2, 8, 32, device=DEV, dtype=CPU_DTYPE)), "out"),
])
def test_bad_input_names_the_argument(edit, name):
    args = _good_args()
    edit(args)
    q, k, v, t, s = (args.pop(x) for x in ("q", "k_cache", "v_cache", "block_table", "seq_lens"))
    with pytest.raises(ValueError, match=name):
        paged_decode_attention(q, k, v, t, s, impl="triton", **args)


def test_debug_mode_raises_on_bad_block_id(monkeypatch):
    monkeypatch.setenv("HYGON_ATTN_DEBUG", "1")
    args = _good_args()
    args["block_table"][0, 1] = -1
    with pytest.raises(ValueError, match="block_table"):
        paged_decode_attention(*args.values(), impl="triton")


# ----------------------------------------------------------------------------- heuristics


def test_partition_rule_dcu_baseline_and_env(monkeypatch):
    assert tuning.partition_size_dcu(8) == 512
    assert tuning.partition_size_dcu(16) == 256
    kw = dict(num_seqs=1, num_kv_heads=8, group=4, max_context_len=32768, num_sms=132)
    assert tuning.triton_partition_size(**kw, rule="dcu") == 512
    monkeypatch.setenv("PA_PARTITION_SIZE", "1024")
    assert tuning.triton_partition_size(**kw) == 1024
    monkeypatch.setenv("HYGON_ATTN_PARTITION_SIZE", "2048")
    assert tuning.triton_partition_size(**kw) == 2048
    monkeypatch.setenv("HYGON_ATTN_PARTITION_SIZE", "100")
    with pytest.raises(ValueError, match="HYGON_ATTN_PARTITION_SIZE"):
        tuning.triton_partition_size(**kw)


@pytest.mark.parametrize("num_seqs,ctx,num_kv_heads,expect_parts", [
    (1, 32768, 8, 64),      # batch 1: ~4 programs per SM (partition 512)
    (1, 131072, 8, 64),     # partition 2048
    (8, 8192, 8, 8),        # partition 1024
    (64, 4096, 8, 1),       # 512 programs already: no split
    (64, 4096, 4, 2),       # G=8: 256 programs, split in 2
    (64, 4096, 2, 4),       # G=16: 128 programs, split in 4
    (64, 16384, 8, 1),
    (256, 2048, 8, 1),
])
def test_partition_rule_measured_pinned(monkeypatch, num_seqs, ctx, num_kv_heads, expect_parts):
    monkeypatch.delenv("HYGON_ATTN_PARTITION_SIZE", raising=False)
    monkeypatch.delenv("PA_PARTITION_SIZE", raising=False)
    cfg = decode_launch_config(num_seqs=num_seqs, num_q_heads=32, num_kv_heads=num_kv_heads,
                               num_tokens=1, head_dim=128, page_size=16, kv_elem_size=2,
                               max_context_len=ctx, num_sms=132)
    assert cfg.num_partitions == expect_parts


# ----------------------------------------------------------------------------- GPU


def _gpu_case(**kw):
    return run_case(device=torch.device("cuda"), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 4, 5, 8, 16, 64])
@pytest.mark.parametrize("partition_size", [None, 256])
def test_gpu_groups_real_sizes(group, partition_size):
    hkv = max(1, 64 // group) if group < 64 else 1
    _gpu_case(num_kv_heads=min(hkv, 8), group=group, head_dim=128, page_size=16,
              seq_lens=[1, 1000, 4097, 2053, 16], layout="bshd", dtype=torch.bfloat16,
              partition_size=partition_size)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 192, 256])
@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
def test_gpu_head_dims_pages(head_dim, page_size):
    _gpu_case(num_kv_heads=2, group=4, head_dim=head_dim, page_size=page_size,
              seq_lens=[700, 1, 333], layout="bhsd", dtype=torch.float16, partition_size=256)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["bshd", "bhds", "split_x", "vllm"])
def test_gpu_layouts(layout):
    _gpu_case(num_kv_heads=4, group=8, head_dim=128, page_size=16, seq_lens=[1500, 31],
              layout=layout, dtype=torch.bfloat16)


@pytest.mark.gpu
def test_gpu_128k_context_split():
    _gpu_case(num_kv_heads=8, group=4, head_dim=128, page_size=64, seq_lens=[131072, 70001],
              layout="bshd", dtype=torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_gpu_fp8(kv_dtype):
    _gpu_case(num_kv_heads=2, group=8, head_dim=128, page_size=16, seq_lens=[3000, 7],
              layout="bhsd", dtype=torch.bfloat16, kv_dtype=kv_dtype, scales=(0.02, 0.05))


@pytest.mark.gpu
def test_gpu_spec_tokens_and_options():
    _gpu_case(num_kv_heads=2, group=5, head_dim=128, page_size=16, seq_lens=[900, 5, 2000],
              layout="bshd", dtype=torch.bfloat16, num_tokens=4, partition_size=256,
              sliding_window=300, soft_cap=30.0,
              sinks=torch.randn(10, device="cuda", dtype=torch.float32))


@pytest.mark.gpu
def test_gpu_cache_over_2_31_elements():
    """A cache of more than 2^31 elements, with the sequence's blocks at its far end."""
    free = torch.cuda.mem_get_info()[0]
    p, h, d = 16, 8, 128
    num_blocks = (2 ** 31) // (p * h * d) + 64
    if free < 2 * num_blocks * p * h * d * 2 + (2 << 30):
        pytest.skip("not enough GPU memory for a > 2^31-element cache pair")
    k = torch.empty((num_blocks, p, h, d), dtype=torch.bfloat16, device="cuda")
    v = torch.empty_like(k)
    tail = slice(num_blocks - 40, num_blocks)
    k[tail].normal_()
    v[tail].normal_()
    kv, vv = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    assert k.numel() > 2 ** 31
    table = torch.arange(num_blocks - 40, num_blocks, dtype=torch.int32,
                         device="cuda").flip(0).reshape(2, 20).contiguous()
    lens = torch.tensor([310, 257], dtype=torch.int32, device="cuda")
    q = torch.randn(2, 32, d, dtype=torch.bfloat16, device="cuda")
    for ps in (None, 64):
        out = paged_decode_attention(q, kv, vv, table, lens, partition_size=ps)
        ref64 = reference.paged_decode_attention(q, kv, vv, table, lens,
                                                 compute_dtype=torch.float64)
        ref_lp = reference.paged_decode_attention(q, kv, vv, table, lens,
                                                  compute_dtype=torch.bfloat16)
        assert_within_budget(out, ref64, ref_lp)
    del k, v


@pytest.mark.gpu
def test_gpu_cuda_graph_capture_with_workspace():
    hkv, g, d, p = 8, 4, 128, 16
    lens_list = [5000, 100, 2049]
    nb = blocks_needed(lens_list, p)
    k, v = make_cache(nb, hkv, p, d, "bshd", torch.bfloat16, "cuda")
    table = make_table(lens_list, p, nb, "cuda")
    lens = torch.tensor(lens_list, dtype=torch.int32, device="cuda")
    q = torch.randn(3, hkv * g, d, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(q)
    ws = allocate_decode_workspace(max_num_seqs=3, num_q_heads=hkv * g, num_kv_heads=hkv,
                                   head_dim=d, max_context_len=table.shape[1] * p,
                                   device="cuda", partition_size=512)
    kw = dict(out=out, workspace=ws, partition_size=512)
    paged_decode_attention(q, k, v, table, lens, **kw)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(q, k, v, table, lens, **kw)
    q.copy_(torch.randn_like(q))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref64 = reference.paged_decode_attention(q, k, v, table, lens, compute_dtype=torch.float64)
    ref_lp = reference.paged_decode_attention(q, k, v, table, lens, compute_dtype=torch.bfloat16)
    assert_within_budget(out, ref64, ref_lp)
    assert math.isfinite(out.float().abs().max().item())


def test_decode_tile_keeps_the_bytes_in_flight_per_head_dim():
    """``BLOCK_N x D`` ~ 8K elements from D=64 up (measured at D=64 and D=128); the CPU
    tests' tiny dims keep 64; env and explicit tiles still override."""

    assert [tuning.block_n_for(d) for d in (16, 32, 64, 128, 256)] == [64, 64, 128, 64, 32]
    cfg = tuning.tile_config(block_m=16, head_dim_pad=64, page_size=16, kv_elem_size=2)
    assert cfg == (128, 4, 2, True)
    cfg = tuning.tile_config(block_m=16, head_dim_pad=64, page_size=16, kv_elem_size=2,
                                    tile=(64, None, None, None))
    assert cfg[0] == 64


def test_decode_tile_is_short_for_few_rows_at_head_dim_128():
    """Up to 4 query rows at D=128 on pages of 16+ tokens: BLOCK_N 32 with 3 stages
    (measured); 8 rows, other head_dims, page 1 and an explicit tile keep their own."""
    from hygon_attn_backend.ops.decode import decode_launch_config

    def cfg(page_size=16, **kw):
        return tuning.tile_config(block_m=16, page_size=page_size, kv_elem_size=2, **kw)

    assert cfg(head_dim_pad=128, rows=4) == (32, 4, 3, True)
    assert cfg(head_dim_pad=128, rows=1) == (32, 4, 3, True)
    assert cfg(head_dim_pad=128, rows=8) == (64, 4, 2, True)
    assert cfg(head_dim_pad=128) == (64, 4, 2, True)
    assert cfg(head_dim_pad=64, rows=4) == (128, 4, 2, True)
    assert cfg(head_dim_pad=128, rows=4, tile=(64, None, 2, None)) == (64, 4, 2, True)
    assert cfg(head_dim_pad=128, rows=4, page_size=64) == (32, 4, 3, True)
    assert cfg(head_dim_pad=128, rows=4, page_size=1) == (64, 4, 2, True)  # measured slower
    assert cfg(head_dim_pad=128, rows=4, page_size=8) == (64, 4, 2, True)  # not measured
    common = dict(num_seqs=64, head_dim=128, page_size=16, kv_elem_size=2,
                  max_context_len=4096, num_sms=132)
    # rows = group x speculative tokens: 32/8 heads with 1 token is 4 rows, with 2 is 8
    one = decode_launch_config(num_q_heads=32, num_kv_heads=8, num_tokens=1, **common)
    two = decode_launch_config(num_q_heads=32, num_kv_heads=8, num_tokens=2, **common)
    assert (one.block_n, one.num_stages) == (32, 3)
    assert (two.block_n, two.num_stages) == (64, 2)
