"""fp8 KV decode: the widening rule, the fp8 tile and partition rules, the query's range
scale (bf16 queries past fp16's range), NaN isolation, against reference.py.

CPU: the kernel under the interpreter (Triton's cast widening, fp16 dots). GPU: the
``cvt`` widening on sm_89+.
"""

import pytest
import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops.decode import (allocate_decode_workspace, paged_decode_attention,
                                           plan_paged_decode, tuning)
from tests.ops.test_decode import make_table
from tests.support.budget import assert_within_budget

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def test_kv_widen_rule():
    cpu = torch.device("cpu")
    assert tuning.kv_widen(kv_dtype=torch.bfloat16, device=cpu) == "none"
    assert tuning.kv_widen(kv_dtype=torch.float16, device=cpu) == "none"
    for dtype in FP8:  # no GPU (or the interpreter): Triton's cast
        assert tuning.kv_widen(kv_dtype=dtype, device=cpu) == "cast"


def _cfg(batch, ctx, elem, **kw):
    return tuning.launch_config(num_seqs=batch, num_q_heads=32, num_kv_heads=8, num_tokens=1,
                                head_dim=128, page_size=16, kv_elem_size=elem,
                                max_context_len=ctx, num_sms=132, **kw)


def test_fp8_tile_and_partition_rules():
    # 16-bit caches keep their rule: the few-rows tile, one partition at (64, 16k)
    c = _cfg(64, 16384, 2)
    assert (c.block_n, c.num_warps, c.num_stages, c.num_partitions) == (32, 4, 3, 1)
    # fp8: 64 keys / 3 stages, four partitions where the 16-bit rule leaves one
    c = _cfg(64, 16384, 1)
    assert (c.block_n, c.num_warps, c.num_stages, c.num_partitions) == (64, 4, 3, 4)
    assert c.seq_split and tuning.use_fused_combine(num_partitions=c.num_partitions)
    # a grid of 8+ programs an SM: 128 keys, 2 stages, unsplit
    c = _cfg(256, 2048, 1)
    assert (c.block_n, c.num_warps, c.num_stages, c.num_partitions) == (128, 4, 2, 1)
    # small batches keep the 16-bit rule's partitions
    assert _cfg(8, 8192, 1).num_partitions == _cfg(8, 8192, 2).num_partitions == 8
    assert _cfg(1, 32768, 1).num_partitions == _cfg(1, 32768, 2).num_partitions
    # forced partitions and tiles stand
    assert _cfg(64, 16384, 1, partition_size=16384).num_partitions == 1
    c = _cfg(64, 16384, 1, tile=(32, None, 2, None))
    assert (c.block_n, c.num_warps, c.num_stages) == (32, 4, 2)
    # outside the measured regime (D=64 here) the 16-bit rules stand
    c = tuning.launch_config(num_seqs=64, num_q_heads=32, num_kv_heads=8, num_tokens=1,
                             head_dim=64, page_size=16, kv_elem_size=1,
                             max_context_len=16384, num_sms=132)
    assert c.num_partitions == 1


def test_workspace_holds_the_fp8_split():
    ws = allocate_decode_workspace(max_num_seqs=64, num_q_heads=32, num_kv_heads=8,
                                   head_dim=128, max_context_len=16384, device="cpu")
    assert ws.num_slots >= 64 * _cfg(64, 16384, 1).num_partitions


def _fp8_case(kv_dtype, *, seq_lens, q_mult=1.0, nan_row=None, partition_size=None,
              head_dim=64, impl="triton"):
    d, p, hkv, g = head_dim, 16, 1, 4
    nb = sum(-(-n // p) for n in seq_lens) + 3
    k = torch.randn(nb, hkv, p, d, device=DEV)
    v = torch.randn(nb, hkv, p, d, device=DEV)
    ks, vs = 0.01, 0.02
    k8, v8 = reference.quantize_fp8(k, kv_dtype, ks), reference.quantize_fp8(v, kv_dtype, vs)
    table = make_table(seq_lens, p, nb, DEV)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    q_dtype = torch.bfloat16 if HAS_CUDA else torch.float16
    q = (torch.randn(len(seq_lens), hkv * g, d, device=DEV) * q_mult).to(q_dtype)
    if nan_row is not None:
        q[nan_row] = float("nan")
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, k8, v8, table, lens, out=out, k_scale=ks, v_scale=vs,
                           partition_size=partition_size, impl=impl)
    args = (q, k8, v8, table, lens)
    ref64 = reference.paged_decode_attention(
        q.double(), *args[1:], k_scale=ks, v_scale=vs,
        out=torch.empty(q.shape, dtype=torch.float64, device=DEV))
    lowp = reference.paged_decode_attention(*args, k_scale=ks, v_scale=vs,
                                            compute_dtype=q.dtype)
    return out, ref64, lowp


@pytest.mark.parametrize("kv_dtype", FP8)
@pytest.mark.parametrize("partition_size", [None, 32])
def test_fp8_decode_matches_reference(kv_dtype, partition_size):
    out, ref64, lowp = _fp8_case(kv_dtype, seq_lens=[70, 33, 5],
                                 partition_size=partition_size)
    assert_within_budget(out, ref64, lowp)


@pytest.mark.skipif(not HAS_CUDA, reason="bf16 queries past fp16's range need a GPU "
                                         "(the interpreter's bf16 dot is broken)")
@pytest.mark.parametrize("kv_dtype", FP8)
def test_fp8_decode_bf16_queries_past_fp16_range(kv_dtype):
    """|q| ~ 3e5: the fp16 dots take the query scaled by a power of two, no inf."""
    out, ref64, lowp = _fp8_case(kv_dtype, seq_lens=[300, 17], q_mult=3e5)
    assert bool(out.isfinite().all())
    assert_within_budget(out, ref64, lowp)


@pytest.mark.parametrize("kv_dtype", FP8)
def test_fp8_nan_query_row_stays_in_its_row(kv_dtype):
    """A NaN query head: its row is NaN, every other row (the same program's heads too,
    whose range scale leaves NaN out) equals the clean run's bit for bit."""
    torch.manual_seed(5)
    clean, _, _ = _fp8_case(kv_dtype, seq_lens=[40, 21])
    torch.manual_seed(5)
    dirty, _, _ = _fp8_case(kv_dtype, seq_lens=[40, 21], nan_row=(0, 1))
    assert bool(dirty[0, 1].isnan().all())
    keep = torch.ones(dirty.shape[:2], dtype=torch.bool, device=DEV)
    keep[0, 1] = False
    assert torch.equal(dirty[keep], clean[keep])


def test_fp8_plan_takes_the_fp8_split_with_its_workspace():
    """A plan with an engine's workspace (sized by allocate_decode_workspace) takes the fp8
    rule's partitions without a 'workspace too small'."""
    table = torch.zeros(64, 1024, dtype=torch.int32)
    lens = torch.full((64,), 16384, dtype=torch.int32)
    ws = allocate_decode_workspace(max_num_seqs=64, num_q_heads=32, num_kv_heads=8,
                                   head_dim=128, max_context_len=16384, device="cpu")
    plan = plan_paged_decode(table, lens, num_q_heads=32, num_kv_heads=8, head_dim=128,
                             page_size=16, q_dtype=torch.float16,
                             kv_dtype=torch.float8_e4m3fn, max_seq_len=16384, workspace=ws,
                             impl="triton")
    assert plan.config.num_partitions == 4 and plan.fused_combine
