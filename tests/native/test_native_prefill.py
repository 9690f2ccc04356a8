"""The native prefix prefill (``csrc/prefill_sm90.cu``, ``impl="native"``) against reference.py.

GPU tests need an sm_90 GPU (H100/H200: the kernel is written for sm_90a's wgmma) and build
the extension on first use. They run the Triton prefill's real-size cases that the native
kernel covers (head_dim 128, fp16/bf16 KV, fp8 KV without dense new keys) and the cases its
structure adds: GQA groups that leave rows of the 128-row tile idle, keys walked over many
pipeline stages, tiles that straddle the prefix and the dense new keys, hostile block ids, a
cache past 2^31 elements, CUDA-graph replay; with fp8 caches (widened to fp16 by the
producers, a bf16 Q rescaled per row into fp16) both formats, tensor scales, queries past
fp16's range. CPU tests: what a plan chooses and the errors it raises.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops.prefill import tuning
from hygon_attn_backend.ops.prefill import native as _native
from hygon_attn_backend.ops.prefill import plan_prefix_prefill, prefix_prefill_attention
from tests.support.budget import assert_within_budget
from tests.ops.test_prefill import GPU_CASES, Case, make_inputs, run_case

gpu = pytest.mark.gpu


def _sm90() -> bool:
    return torch.cuda.is_available() and not getattr(torch.version, "hip", None) and \
        torch.cuda.get_device_capability() == (9, 0)


def _need_sm90():
    if not _sm90():
        pytest.skip("the native prefill needs an NVIDIA sm_90 GPU (H100/H200)")


def _covered(case: Case) -> bool:
    return case.head_dim == 128 and (case.kv_dtype is None or not case.k_new)


NATIVE_CASES = [c for c in GPU_CASES if _covered(c)] + [
    Case("n_g1_long", (5000,), (300,), group=1, kv_heads=4, page=16, head_dim=128,
         dtype=torch.bfloat16),
    Case("n_g3_idle_rows", (130, 0, 257), (200, 129, 1), group=3, kv_heads=2, page=64,
         head_dim=128, dtype=torch.float16),
    Case("n_g8_knew_straddle", (100, 129, 0), (300, 77, 128), group=8, kv_heads=2, page=16,
         head_dim=128, dtype=torch.bfloat16, k_new=True),
    Case("n_g64_p1", (40, 3), (70, 2), group=64, kv_heads=1, page=1, head_dim=128,
         dtype=torch.bfloat16),
    Case("n_noncausal_knew", (333, 0), (129, 300), group=4, kv_heads=2, page=16,
         head_dim=128, dtype=torch.bfloat16, k_new=True, causal=False),
    Case("n_window_sinks", (700, 5), (400, 260), group=4, kv_heads=2, page=64, head_dim=128,
         dtype=torch.float16, window=100, sinks=True, soft_cap=20.0),
    Case("n_empty_requests", (7, 0, 0, 12), (0, 0, 5, 0), group=4, kv_heads=2, page=16,
         head_dim=128, dtype=torch.bfloat16),
    Case("n_bshd_knew_p1", (64, 1), (190, 33), group=2, kv_heads=4, page=1, head_dim=128,
         dtype=torch.bfloat16, k_new=True, layout="bshd", q_noncontig=True),
    # fp8 caches: the staged, widened tiles over many ring turns, both formats, fp16 and
    # bf16 queries, every mask and option, the permuted layout
    Case("n_fp8_e4m3_long", (3000,), (300,), group=4, kv_heads=2, page=16, head_dim=128,
         dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn),
    Case("n_fp8_e5m2_f16", (130, 0, 257), (200, 129, 1), group=3, kv_heads=2, page=64,
         head_dim=128, dtype=torch.float16, kv_dtype=torch.float8_e5m2),
    Case("n_fp8_g1_p1", (40, 3), (700, 2), group=1, kv_heads=4, page=1, head_dim=128,
         dtype=torch.bfloat16, kv_dtype=torch.float8_e5m2),
    Case("n_fp8_window_sinks_cap", (700, 5), (400, 260), group=4, kv_heads=2, page=64,
         head_dim=128, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, window=100,
         sinks=True, soft_cap=20.0),
    Case("n_fp8_noncausal_bshd", (333, 0), (129, 300), group=8, kv_heads=2, page=16,
         head_dim=128, dtype=torch.float16, kv_dtype=torch.float8_e4m3fn, causal=False,
         layout="bshd", q_noncontig=True),
    Case("n_fp8_g64", (40, 3), (70, 2), group=64, kv_heads=1, page=16, head_dim=128,
         dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn),
]


@gpu
@pytest.mark.parametrize("case", NATIVE_CASES, ids=lambda c: c.name)
def test_native_prefill_real_sizes(case):
    _need_sm90()
    run_case(case, torch.device("cuda"), impl="native")


@gpu
def test_native_prefill_cache_over_2g_elements():
    """Used pages above element 2^31 of a bf16 cache (int64 row addresses)."""
    _need_sm90()
    case = Case("n_big_cache", (3000, 50), (200, 300), group=4, kv_heads=8, page=16,
                head_dim=128, dtype=torch.bfloat16)
    per_block = case.kv_heads * case.page * case.head_dim
    run_case(case, torch.device("cuda"), impl="native",
             min_blocks=(2 ** 31) // per_block + 64)


@gpu
@pytest.mark.parametrize("k_new", [False, True])
def test_native_prefill_hostile_block_ids(k_new):
    """Negative, too-large and past-the-table ids are absent keys, as in the reference."""
    _need_sm90()
    dev = torch.device("cuda")
    case = Case("n_hostile", (600, 90, 300), (150, 40, 1), group=4, kv_heads=2, page=16,
                head_dim=128, dtype=torch.bfloat16, k_new=k_new)
    args, kw = make_inputs(case, dev, seed=3)
    q, k_cache, v_cache, table, cu, lens = args
    table = table.clone()
    table[0, 3] = -1
    table[0, 17] = k_cache.shape[0] + 5
    table[1, 0] = 2 ** 31 - 1
    table[2, 5] = -7
    args = (q, k_cache, v_cache, table, cu, lens)
    run_case(case, dev, impl="native", inputs=(args, kw))
    # a table narrower than the keys: the columns past it are absent too
    narrow = (q, k_cache, v_cache, table[:, :20], cu, lens)
    run_case(case, dev, impl="native", inputs=(narrow, dict(kw, validate=False)))


@gpu
def test_native_prefill_graph_replay():
    """The planned launch captured in a CUDA graph, replayed with new queries."""
    _need_sm90()
    dev = torch.device("cuda")
    case = Case("n_graph", (900, 17), (300, 129), group=4, kv_heads=2, page=16,
                head_dim=128, dtype=torch.bfloat16, lse=False)
    args, kw = make_inputs(case, dev, seed=5)
    q, k_cache, v_cache, table, cu, lens = args
    plan = plan_prefix_prefill(cu, lens, total_q=q.shape[0], num_q_heads=q.shape[1],
                               num_kv_heads=k_cache.shape[1], head_dim=128,
                               host_cu_seqlens_q=cu.cpu(), q_dtype=q.dtype, impl="native")
    assert plan.impl == "native" and plan.block_m == _native.BLOCK_M
    out = torch.empty_like(q)
    static_q = q.clone()
    run = lambda: prefix_prefill_attention(static_q, k_cache, v_cache, table, cu, lens,
                                           out=out, plan=plan, impl="native",
                                           causal=case.causal)
    run()  # first call outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for seed in range(3):
        static_q.copy_(torch.randn(q.shape, device=dev, generator=torch.Generator(
            device=dev).manual_seed(100 + seed)).to(q.dtype))
        graph.replay()
        torch.cuda.synchronize()
        a = (static_q, k_cache, v_cache, table, cu, lens)
        ref64 = reference.prefix_prefill_attention(*a, compute_dtype=torch.float64)
        ref_lp = reference.prefix_prefill_attention(*a, compute_dtype=q.dtype)
        assert_within_budget(out, ref64, ref_lp, what=f"graph replay {seed}")
    # the persistent launch's work counter is left at zero for the next launch
    assert plan.sched is not None and plan.sched.tolist() == [0, 0]


@gpu
def test_native_prefill_ragged_batch_with_new_keys():
    """The persistent launch over a ragged batch with empty and one-token requests and
    dense new keys: the same results as the reference."""
    _need_sm90()
    case = Case("n_variants", (0, 700, 33, 0), (900, 130, 1, 2), group=4, kv_heads=2, page=16,
                head_dim=128, dtype=torch.bfloat16, k_new=True)
    run_case(case, torch.device("cuda"), impl="native")


@gpu
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_native_prefill_fp8_tensor_scales_and_wide_queries(kv_dtype):
    """fp8 caches with 1-element tensor scales (read on the device), bf16 queries far past
    fp16's range in some rows and tiny in others (each row is rescaled into fp16), a
    zero row: within the budget of the reference."""
    _need_sm90()
    dev = torch.device("cuda")
    case = Case("n_fp8_wide_q", (500, 40), (300, 129), group=4, kv_heads=2, page=16,
                head_dim=128, dtype=torch.bfloat16, kv_dtype=kv_dtype)
    args, kw = make_inputs(case, dev, seed=7)
    q = args[0].clone()
    q[::7] *= 3.0e6    # |q| ~ 1e7: past fp16's 65504
    q[3::11] *= 1e-7   # below fp16's normal range
    q[5] = 0.0
    kw = dict(kw, k_scale=torch.tensor([kw["k_scale"]], device=dev),
              v_scale=torch.tensor(kw["v_scale"], device=dev))
    # logits ~ 1e7: the softmax is one-hot in those rows, in the reference too
    kw["return_lse"] = False
    run_case(dataclasses.replace(case, lse=False), dev, impl="native",
             inputs=((q,) + args[1:], kw))


@gpu
def test_native_prefill_refuses_what_it_does_not_cover():
    """impl='native' on an sm_90 GPU: fp8 KV with dense new keys and head_dim 64 raise,
    naming the reason."""
    _need_sm90()
    dev = torch.device("cuda")
    fp8 = Case("n_fp8_knew", (40,), (20,), group=4, kv_heads=2, page=16, head_dim=128,
               dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, k_new=True)
    args, kw = make_inputs(fp8, dev)
    with pytest.raises(ValueError, match="k_new"):
        prefix_prefill_attention(*args, impl="native", **kw)
    d64 = Case("n_d64", (40,), (20,), group=4, kv_heads=2, page=16, head_dim=64,
               dtype=torch.bfloat16)
    args, kw = make_inputs(d64, dev)
    with pytest.raises(ValueError, match="head_dim 64"):
        prefix_prefill_attention(*args, impl="native", **kw)


# ----------------------------------------------------------------------------- CPU


def test_native_prefill_needs_a_gpu():
    cu = torch.tensor([0, 5], dtype=torch.int32)
    lens = torch.tensor([9], dtype=torch.int32)
    with pytest.raises(ValueError, match="CUDA"):
        plan_prefix_prefill(cu, lens, total_q=5, num_q_heads=8, num_kv_heads=2, head_dim=128,
                            impl="native")


def test_native_prefill_reasons():
    cpu = torch.device("cpu")
    assert "sm_90" in _native.device_unsupported(cpu)
    shape = dict(head_dim=128, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, group=4)
    assert _native.shape_unsupported(**shape) is None
    assert "head_dim 64" in _native.shape_unsupported(**dict(shape, head_dim=64))
    assert _native.shape_unsupported(**dict(shape, kv_dtype=torch.float8_e5m2)) is None
    assert "float32" in _native.shape_unsupported(**dict(shape, kv_dtype=torch.float32))
    assert "group 256" in _native.shape_unsupported(**dict(shape, group=256))
    k = torch.zeros(4, 2, 16, 128, dtype=torch.float8_e4m3fn)
    assert _native.layer_unsupported(k, k) is None
    assert "differ" in _native.layer_unsupported(k, k.view(torch.float8_e5m2))
    # fp8 rows 8 codes apart: 8 bytes, not the 16 of a copy
    k8_odd = torch.zeros(4, 2, 16, 136, dtype=torch.float8_e4m3fn)[..., 8:]
    assert "aligned" in _native.layer_unsupported(k8_odd, k8_odd)
    k16 = torch.zeros(4, 2, 16, 128, dtype=torch.bfloat16)
    assert _native.layer_unsupported(k16, k16) is None
    # a view whose rows start 2 elements apart is not 16-byte aligned
    odd = torch.zeros(4, 2, 16, 130, dtype=torch.bfloat16)[..., 2:]
    assert "aligned" in _native.layer_unsupported(odd, odd)
    q = torch.zeros(6, 8, 128, dtype=torch.bfloat16)
    bf16 = torch.bfloat16
    assert _native.call_unsupported(q, q, None, None, bf16) is None
    assert "q" in _native.call_unsupported(q[..., ::2].expand(6, 8, 64), q, None, None, bf16)
    # q's base 4 elements past an aligned one: 8 bytes, not 16; out needs only 4 bytes
    flat = torch.zeros(6 * 8 * 128 + 4, dtype=torch.bfloat16)
    shifted = flat[4:].view(6, 8, 128)
    assert "q rows not 16-byte" in _native.call_unsupported(shifted, q, None, None, bf16)
    assert _native.call_unsupported(q, shifted, None, None, bf16) is None
    # a stride that breaks the alignment counts only on an axis longer than 1
    rows = torch.zeros(1, 8, 130, dtype=torch.bfloat16)[..., :128]  # head stride 130
    assert _native.call_unsupported(rows[:, :1], rows[:, :1], None, None, bf16) is None
    assert "q" in _native.call_unsupported(rows, q[:1], None, None, bf16)
    assert "k_new" in _native.call_unsupported(q, q, rows.expand(6, 8, 128), q, bf16)
    # fp8 caches: 16-bit queries of either dtype, no dense new keys
    e4m3 = torch.float8_e4m3fn
    assert _native.call_unsupported(q, q, None, None, e4m3) is None
    assert _native.call_unsupported(q.half(), q.half(), None, None, e4m3) is None
    assert "k_new" in _native.call_unsupported(q, q, q[:, :2], q[:, :2], e4m3)
    assert "q dtype" in _native.call_unsupported(q.float(), q.float(), None, None, e4m3)
    assert "q dtype" in _native.call_unsupported(q.half(), q.half(), None, None, bf16)


def test_native_prefill_auto_rule():
    """NVIDIA takes the native prefill (the plan keeps GPUs without it on Triton); HIP has
    no native prefill."""
    assert tuning.native_preferred(is_hip=False) is True
    assert tuning.native_preferred(is_hip=True) is False


@gpu
def test_native_prefill_auto_choices():
    """On sm_90 'auto' plans native (fp8 caches too), except for a forced Triton tile."""
    _need_sm90()
    dev = torch.device("cuda")
    cu = torch.tensor([0, 40], dtype=torch.int32, device=dev)
    lens = torch.tensor([90], dtype=torch.int32, device=dev)
    kw = dict(total_q=40, num_q_heads=8, num_kv_heads=2, head_dim=128, q_dtype=torch.bfloat16)
    assert plan_prefix_prefill(cu, lens, **kw).impl == "native"
    assert plan_prefix_prefill(cu, lens, kv_dtype=torch.float8_e4m3fn, **kw).impl == "native"
    # SGLang's extend passes the new K/V dense: with an fp8 cache that stays on Triton
    dense = plan_prefix_prefill(cu, lens, kv_dtype=torch.float8_e4m3fn, has_k_new=True, **kw)
    assert dense.impl == "triton"
    assert plan_prefix_prefill(cu, lens, has_k_new=True, **kw).impl == "native"
    assert plan_prefix_prefill(cu, lens, tile=(256, 64, 16, 3), **kw).impl == "triton"
    with pytest.raises(ValueError, match="128-row"):
        plan_prefix_prefill(cu, lens, tile=(256, 64, 16, 3), impl="native", **kw)
