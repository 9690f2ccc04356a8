"""The native MLA decode (``csrc/mla_decode_sm90.cu``, ``impl="native"``) against reference.py.

GPU tests need an sm_90 GPU (H100/H200: the kernel is written for sm_90a's wgmma) and build
the extension on first use. They cover what the kernel's structure adds to the Triton
decode's cases: 64-row blocks of T x Hq rows (Hq 64 and 128, T 1 and 2, padded blocks at
T x Hq = 96, 48 and 36), pages 1 / 16 / 64 read row by row, the split partitions merged by
the Triton combine, tiles with absent keys (bad block ids, lengths past the table, seq_len 0 and
seq_len < T), strided views (SGLang's pool inside a wider buffer), CUDA-graph replay, fp8
caches (e4m3 / e5m2 codes widened in place in shared memory, a bf16 query widened per row,
the scale from a tensor or a float), and the calls it does not take (misaligned rows). CPU tests: what a plan chooses, the errors it
raises and the split rule.
"""

from __future__ import annotations

import pytest
import torch

from hygon_attn_backend.ops.mla import native as _native
from hygon_attn_backend.ops.mla import plan_mla_decode, tuning
from tests.ops.test_mla_decode import check_against_reference, make_batch, make_table, run_case

gpu = pytest.mark.gpu
BF16 = torch.bfloat16
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _need_sm90():
    if not (torch.cuda.is_available() and not getattr(torch.version, "hip", None) and
            torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("the native MLA decode needs an NVIDIA sm_90 GPU (H100/H200)")


def _plan(table, lens, *, heads, tokens=1, page, impl="native", dtype=BF16, **kw):
    return plan_mla_decode(block_table=table, seq_lens=lens, page_size=page,
                           num_q_heads=heads, kv_lora_rank=512, rope_dim=64, q_dtype=dtype,
                           kv_dtype=dtype, num_tokens=tokens, impl=impl, **kw)


# ----------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("num_partitions", [None, 1, 5])
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("heads,tokens", [(128, 1), (64, 2), (32, 3), (128, 2), (16, 3),
                                          (12, 3)])
def test_native_matches_reference(heads, tokens, page, num_partitions):
    _need_sm90()
    torch.manual_seed(heads + 7 * tokens + page)
    lens = torch.randint(1, 3000, (6,)).tolist()
    lens[0], lens[1], lens[2] = 4097, 1, 64
    plan = run_case(seq_lens=lens, page_size=page, rank=512, rope=64, heads=heads,
                    tokens=tokens, dtype=BF16, return_lse=True, num_partitions=num_partitions,
                    impl="native")
    assert plan.impl == "native"
    assert plan.config.block_m == _native.ROWS and plan.config.block_n == _native.BLOCK_N


@gpu
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
@pytest.mark.parametrize("num_partitions", [None, 5])
@pytest.mark.parametrize("page", [1, 64])
@pytest.mark.parametrize("heads,tokens", [(128, 1), (64, 2), (16, 3)])
def test_native_fp8_matches_reference(heads, tokens, page, num_partitions, kv_dtype):
    """fp8 latent caches: every 16-bit panel of a tile widened from the codes staged in the
    same stage (panel 8 overlaps its own codes), absent keys' zero-filled codes, the scale
    from a tensor (split) or a float (unsplit)."""
    _need_sm90()
    torch.manual_seed(heads + 7 * tokens + page + (kv_dtype == E5M2))
    lens = torch.randint(1, 3000, (6,)).tolist()
    lens[0], lens[1], lens[2] = 4097, 1, 65
    plan = run_case(seq_lens=lens, page_size=page, rank=512, rope=64, heads=heads,
                    tokens=tokens, dtype=BF16, kv_dtype=kv_dtype, return_lse=True,
                    num_partitions=num_partitions, tensor_scale=num_partitions is not None,
                    impl="native")
    assert plan.impl == "native"


@gpu
@pytest.mark.parametrize("kv_dtype", [E4M3, E5M2])
def test_native_fp8_auto_choice_fp16_query_and_bounds(kv_dtype):
    """"auto" takes the native kernel for an fp8 cache at 128 rows; an fp16 query (used as
    it is), bad block ids, a length past the table and seq_len 0 give the reference's
    answer."""
    _need_sm90()
    torch.manual_seed(17)
    plan = run_case(seq_lens=[2000, 333, 17], page_size=16, rank=512, rope=64, heads=128,
                    dtype=torch.float16, kv_dtype=kv_dtype, impl="auto", return_lse=True)
    assert plan.impl == "native"
    q, kv, table, lens = make_batch(seq_lens=[300, 200, 0, 90], page_size=16, rank=512,
                                    rope=64, heads=64, tokens=2, dtype=BF16, kv_dtype=kv_dtype)
    table[0, 1] = -3
    table[1, 2] = kv.shape[0] + 7
    lens[3] = 10_000
    bounded = plan_mla_decode(block_table=table, seq_lens=lens, page_size=16, num_q_heads=64,
                              kv_lora_rank=512, rope_dim=64, q_dtype=BF16, kv_dtype=kv_dtype,
                              num_tokens=2, impl="native", max_seq_len=400, return_lse=True)
    out, lse = bounded.run(q, kv, kv_scale=0.5)
    check_against_reference(q, kv, table, lens, rank=512, out=out, lse=lse, kv_scale=0.5)
    assert torch.all(out[2] == 0) and torch.all(torch.isneginf(lse[2]))


@gpu
def test_native_fp8_query_rows_of_any_magnitude():
    """A bf16 query is widened to fp16 row by row (a power of two per row, folded into the
    logits): rows far past fp16's range (2^20) and far below it (2^-20) keep their
    answer."""
    _need_sm90()
    torch.manual_seed(23)
    q, kv, table, lens = make_batch(seq_lens=[1500, 700], page_size=64, rank=512, rope=64,
                                    heads=64, dtype=BF16, kv_dtype=E4M3)
    q[0, :32] *= 2.0 ** 20
    q[1, 32:] *= 2.0 ** -20
    plan = plan_mla_decode(block_table=table, seq_lens=lens, page_size=64, num_q_heads=64,
                           kv_lora_rank=512, rope_dim=64, q_dtype=BF16, kv_dtype=E4M3,
                           impl="native", scale=2.0 ** -20, return_lse=True)
    out, lse = plan.run(q, kv, kv_scale=torch.tensor([0.5], device="cuda"))
    check_against_reference(q, kv, table, lens, rank=512, out=out, lse=lse, kv_scale=0.5,
                            scale=2.0 ** -20)


@gpu
def test_native_fp16_and_auto_choice():
    _need_sm90()
    torch.manual_seed(3)
    plan = run_case(seq_lens=[2000, 333, 17], page_size=16, rank=512, rope=64, heads=128,
                    dtype=torch.float16, impl="auto")
    assert plan.impl == "native"
    small = run_case(seq_lens=[200, 33], page_size=16, rank=512, rope=64, heads=16,
                     dtype=BF16, impl="auto")
    assert small.impl == "triton"  # 16 rows: the Triton tile reads the cache faster


@gpu
@pytest.mark.parametrize("num_partitions", [1, 3])
def test_native_bounds(num_partitions):
    """Bad block ids in the used part, a length past the table, seq_len 0 and seq_len < T:
    the reference's answer (absent keys masked, zeros and -inf for rows that see none)."""
    _need_sm90()
    torch.manual_seed(13)
    q, kv, table, lens = make_batch(seq_lens=[300, 200, 0, 90, 1], page_size=16, rank=512,
                                    rope=64, heads=64, tokens=2, dtype=BF16)
    nb = kv.shape[0]
    table[0, 1] = -3
    table[1, 2] = nb + 7
    table[3, 0] = 2**31 - 1
    lens[3] = 10_000  # far past the table's capacity
    plan = _plan(table, lens, heads=64, tokens=2, page=16, num_partitions=num_partitions,
                 max_seq_len=400, return_lse=True)
    out, lse = plan.run(q, kv)
    check_against_reference(q, kv, table, lens, rank=512, out=out, lse=lse)
    assert torch.all(out[2] == 0) and torch.all(torch.isneginf(lse[2]))
    assert torch.all(out[4, 0] == 0) and torch.all(torch.isneginf(lse[4, 0]))


@gpu
def test_native_cuda_graph_replay():
    _need_sm90()
    torch.manual_seed(31)
    q, kv, table, lens = make_batch(seq_lens=[3000] * 8, page_size=64, rank=512, rope=64,
                                    heads=128, dtype=BF16)
    plan = _plan(table, lens, heads=128, page=64, impl="auto", return_lse=True,
                 num_partitions=4)
    assert plan.impl == "native"
    out = torch.empty((8, 128, 512), dtype=BF16, device="cuda")
    lse = torch.empty((8, 128), device="cuda")
    plan.run(q, kv, out=out, lse=lse)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q, kv, out=out, lse=lse)
    lens.copy_(torch.randint(1, 3000, (8,), device="cuda", dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_against_reference(q, kv, table, lens, rank=512, out=out, lse=lse)


@gpu
@pytest.mark.parametrize("num_partitions", [1, 2])
def test_native_strided_views(num_partitions):
    """SGLang's token pool (``[slots + P, 1, W]`` viewed as pages) inside a wider buffer, a
    q with a head stride past its width and an out of a larger tensor: the strides reach
    the kernel, rows stay 16-byte aligned, the answer is the reference's."""
    _need_sm90()
    torch.manual_seed(41)
    page, heads, lens = 16, 64, [700, 33]
    nb = sum(-(-n // page) for n in lens) + 3
    buf = torch.randn(((nb + 1) * page, 1, 576 + 64), device="cuda").to(BF16)
    pool = buf[page:, 0, :576].unflatten(0, (nb, page))  # [nb, P, 576], slot stride 640
    assert pool.stride() == (page * 640, 640, 1)
    table = make_table(lens, page, nb, "cuda")
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    qbuf = torch.randn((2, heads, 576 + 128), device="cuda").to(BF16)
    q = qbuf[..., 64:640]  # head stride 704, rows 128 bytes in
    obuf = torch.full((2, heads, 1024), float("nan"), device="cuda").to(BF16)
    out = obuf[..., 256:768]
    plan = _plan(table, seq_lens, heads=heads, page=page, num_partitions=num_partitions,
                 return_lse=True)
    assert plan.impl == "native"
    res, lse = plan.run(q, pool, out=out)
    assert res is out
    check_against_reference(q, pool, table, seq_lens, rank=512, out=out, lse=lse)
    assert torch.isnan(obuf[..., :256]).all() and torch.isnan(obuf[..., 768:]).all()


@gpu
def test_native_call_it_does_not_take():
    """A q whose rows are not 16-byte aligned and a float32 out: "auto" runs Triton on the
    same plan (the same answer), "native" raises naming the tensor."""
    _need_sm90()
    torch.manual_seed(5)
    q, kv, table, lens = make_batch(seq_lens=[500, 70], page_size=16, rank=512, rope=64,
                                    heads=64, dtype=BF16)
    buf = torch.empty((2, 64, 577), dtype=BF16, device="cuda")
    buf[..., 1:] = q
    q_odd = buf[..., 1:]  # rows start 2 bytes off
    auto = _plan(table, lens, heads=64, page=16, impl="auto")
    assert auto.impl == "native"
    out = auto.run(q_odd, kv)
    check_against_reference(q_odd, kv, table, lens, rank=512, out=out)
    out32 = auto.run(q, kv, out=torch.empty((2, 64, 512), device="cuda"))
    check_against_reference(q, kv, table, lens, rank=512, out=out32)
    forced = _plan(table, lens, heads=64, page=16, impl="native")
    with pytest.raises(ValueError, match="q rows not 16-byte aligned"):
        forced.run(q_odd, kv)


# ----------------------------------------------------------------------------- CPU


def test_choice_and_refusals_without_the_gpu():
    """What the kernel covers, by name; a CPU plan never takes it."""
    assert _native.shape_unsupported(kv_lora_rank=512, rope_dim=64, q_dtype=BF16,
                                     kv_dtype=BF16) is None
    assert "512 + 64" in _native.shape_unsupported(kv_lora_rank=256, rope_dim=64,
                                                   q_dtype=BF16, kv_dtype=BF16)
    for fp8 in (E4M3, E5M2):
        assert _native.shape_unsupported(kv_lora_rank=512, rope_dim=64, q_dtype=BF16,
                                         kv_dtype=fp8) is None
    assert "cache of q's dtype" in _native.shape_unsupported(
        kv_lora_rank=512, rope_dim=64, q_dtype=BF16, kv_dtype=torch.float16)
    assert "sm_90" in _native.device_unsupported(torch.device("cpu"))
    assert tuning.native_preferred(rows=128) and tuning.native_preferred(rows=64)
    assert tuning.native_preferred(rows=48)  # MTP q_len 3 at Hq 16: Triton pads to 64 too
    assert not tuning.native_preferred(rows=32)
    table = torch.zeros((2, 4), dtype=torch.int32)
    lens = torch.tensor([30, 7], dtype=torch.int32)
    with pytest.raises(ValueError, match="impl='native' needs CUDA/HIP tensors"):
        _plan(table, lens, heads=128, page=16, impl="native", dtype=torch.float16)
    plan = _plan(table, lens, heads=128, page=16, impl="auto", dtype=torch.float16)
    assert plan.impl in ("triton", "reference")


def test_native_split_rule_fills_one_wave():
    """One native program an SM: split only while the first wave has room, never past the
    Triton rule's count (a workspace sized by that rule serves both), partitions of at
    least MLA_MIN_PARTITION keys."""
    rule = tuning.native_partitions_for
    assert rule(programs=64, max_context_len=32768, num_sms=132) == 2
    assert rule(programs=256, max_context_len=32768, num_sms=132) == 1
    assert rule(programs=1, max_context_len=600, num_sms=132) == 3  # 600 keys: 3 partitions
    for programs in (1, 2, 5, 33, 64, 131, 132, 500):
        for ctx in (1, 300, 4096, 131072):
            n = rule(programs=programs, max_context_len=ctx, num_sms=132)
            assert 1 <= n <= tuning.num_partitions_for(programs=programs, max_context_len=ctx,
                                                       num_sms=132)
            assert programs * n <= 132 or n == 1
    cfg = tuning.launch_config(num_seqs=32, num_q_heads=128, num_tokens=1, kv_lora_rank=512,
                               kv_elem_size=2, max_context_len=32768, num_sms=132,
                               tile=(64, 64, None, None), native=True)
    assert (cfg.block_m, cfg.block_n, cfg.num_partitions) == (64, 64, 2)
