"""The native ragged attention (the sm_90 prefill kernel's dense mode, ``impl="native"`` of
``ragged_attention``: MLA's up-projected 192 / 128 prefill and 128 / 128 varlen attention)
against reference.py.

GPU tests need an sm_90 GPU (H100/H200: the kernel is written for sm_90a's wgmma) and build
the extension on first use. They run the Triton ragged kernel's real-size cases that the
native one covers and the cases its structure adds: keys fewer than queries, many key
tiles, requests shorter than a tile, empty requests, GQA groups, vLLM's strided k / v
views, rows that cannot take its 16-byte copies (``auto`` runs Triton for that call,
``native`` refuses), unchecked offsets past the tensors, plan reuse and CUDA-graph replay.
CPU tests: what the plan chooses and the reasons it gives.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops.mla_prefill import native as _native
from hygon_attn_backend.ops.mla_prefill import plan_ragged_attention, ragged_attention
from tests.ops.test_mla_prefill import GPU_CASES, Case, check_case, make_inputs
from tests.support.budget import assert_within_budget

gpu = pytest.mark.gpu


def _need_sm90():
    if not (torch.cuda.is_available() and not getattr(torch.version, "hip", None)
            and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("the native ragged attention needs an NVIDIA sm_90 GPU (H100/H200)")


def _covered(case: Case) -> bool:
    return (case.d_qk, case.d_v) in _native.HEAD_DIMS and \
        case.heads // case.kv_heads <= _native.MAX_GROUP


def _plan(q, k, v, cu_q, cu_k, *, host=True):
    """The batch's plan (host offsets given: checked and the map built on the host)."""
    return plan_ragged_attention(cu_q, cu_k, total_q=q.shape[0], total_k=k.shape[0],
                                 num_q_heads=q.shape[1], num_kv_heads=k.shape[1],
                                 head_dim_qk=q.shape[2], head_dim_v=v.shape[2],
                                 host_cu_seqlens_q=cu_q.cpu() if host else None,
                                 host_cu_seqlens_k=cu_k.cpu() if host else None,
                                 q_dtype=q.dtype)


NATIVE_CASES = [c for c in GPU_CASES if _covered(c)] + [
    Case("n_mla_fewer_keys", (300, 129, 5), (200, 129, 0), heads=4, kv_heads=4, d_qk=192,
         d_v=128, dtype=torch.bfloat16),
    Case("n_mla_long_chunk", (700,), (5000,), heads=2, kv_heads=2, d_qk=192, d_v=128,
         causal=False, dtype=torch.float16),
    Case("n_mla_short_requests", (1, 2, 0, 127, 128, 129), (1, 300, 4, 127, 128, 700),
         heads=16, kv_heads=16, d_qk=192, d_v=128, dtype=torch.bfloat16, strided=True),
    Case("n_gqa4_128", (600, 64, 1), (900, 64, 1), heads=16, kv_heads=4, d_qk=128, d_v=128,
         dtype=torch.bfloat16),
    Case("n_gqa64_128_chunk", (40, 3), (300, 2), heads=64, kv_heads=1, d_qk=128, d_v=128,
         causal=False, dtype=torch.float16),
]


@gpu
@pytest.mark.parametrize("case", NATIVE_CASES, ids=lambda c: c.name)
def test_native_ragged_matches_reference(case):
    _need_sm90()
    dev = torch.device("cuda")
    q, k, v, cu_q, cu_k = inputs = make_inputs(case, dev)
    plan = _plan(q, k, v, cu_q, cu_k)
    assert plan.impl == "native", plan.config
    check_case(case, dev, plan=plan, inputs=inputs)
    # the plan again (the persistent launch's counter is back at zero), a second seed
    check_case(case, dev, plan=plan, inputs=inputs)
    check_case(case, dev, impl="native", seed=1)


@gpu
def test_native_ragged_unaligned_rows_run_triton_under_auto_and_native_refuses():
    _need_sm90()
    dev = torch.device("cuda")
    case = Case("unaligned", (70, 9), (100, 9), heads=4, kv_heads=4, d_qk=192, d_v=128,
                dtype=torch.bfloat16)
    q, k, v, cu_q, cu_k = make_inputs(case, dev)
    v_buf = torch.randn(v.shape[0], 4, 129, device=dev).bfloat16()
    v_odd = v_buf[..., 1:]  # rows start 2 bytes past a 16-byte boundary
    v_odd.copy_(v)
    plan = _plan(q, k, v, cu_q, cu_k, host=False)
    assert plan.impl == "native"
    check_case(case, dev, plan=plan, inputs=(q, k, v_odd, cu_q, cu_k))
    with pytest.raises(ValueError, match="v rows not 16-byte aligned"):
        ragged_attention(q, k, v_odd, cu_q, cu_k, impl="native")


@gpu
def test_native_ragged_unchecked_offsets_answer_as_clipped():
    """validate=False with offsets past q's and k's rows (the next rows NaN): the kernel
    answers as for offsets clipped to the tensors, as the Triton kernel does."""
    _need_sm90()
    dev = torch.device("cuda")
    q = torch.randn(300, 2, 192, device=dev).bfloat16()
    k_buf = torch.randn(600, 2, 192, device=dev).bfloat16()
    v_buf = torch.randn(600, 2, 128, device=dev).bfloat16()
    k_buf[400:] = float("nan")
    v_buf[400:] = float("nan")
    k, v = k_buf[:400], v_buf[:400]
    cu_q = torch.tensor([0, 100, 300], dtype=torch.int32, device=dev)
    for causal in (False, True):
        wild = torch.tensor([0, 150, 560], dtype=torch.int32, device=dev)
        clipped = torch.tensor([0, 150, 400], dtype=torch.int32, device=dev)
        out = ragged_attention(q, k, v, cu_q, wild, causal=causal, validate=False,
                               impl="native")
        ref64 = reference.ragged_attention(q, k, v, cu_q, clipped, causal=causal,
                                           compute_dtype=torch.float64)
        ref_lp = reference.ragged_attention(q, k, v, cu_q, clipped, causal=causal,
                                            compute_dtype=q.dtype)
        assert_within_budget(out, ref64, ref_lp, what=f"clipped offsets, causal={causal}")


@gpu
def test_native_ragged_cuda_graph_replay():
    _need_sm90()
    dev = torch.device("cuda")
    case = Case("graph", (300, 40), (500, 40), heads=8, kv_heads=8, d_qk=192, d_v=128,
                dtype=torch.bfloat16)
    q, k, v, cu_q, cu_k = make_inputs(case, dev)
    plan = _plan(q, k, v, cu_q, cu_k)
    out = torch.empty(q.shape[0], 8, 128, dtype=q.dtype, device=dev)
    run = lambda: ragged_attention(q, k, v, cu_q, cu_k, out=out, plan=plan)  # noqa: E731
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    q.copy_(torch.randn_like(q))
    graph.replay()
    graph.replay()
    torch.cuda.synchronize()
    ref64 = reference.ragged_attention(q, k, v, cu_q, cu_k, compute_dtype=torch.float64)
    ref_lp = reference.ragged_attention(q, k, v, cu_q, cu_k, compute_dtype=q.dtype)
    assert_within_budget(out, ref64, ref_lp, what="graph replay")


# ----------------------------------------------------------------------------- CPU


def test_native_ragged_covers_its_heads_and_says_why_not():
    covered = dict(q_dtype=torch.bfloat16, group=1)
    assert _native.shape_unsupported(head_dim_qk=192, head_dim_v=128, **covered) is None
    assert _native.shape_unsupported(head_dim_qk=128, head_dim_v=128, **covered) is None
    assert "q/k head 96, v head 32" in _native.shape_unsupported(head_dim_qk=96, head_dim_v=32,
                                                                 **covered)
    assert "q/k head 192, v head 192" in _native.shape_unsupported(
        head_dim_qk=192, head_dim_v=192, **covered)
    assert "float32" in _native.shape_unsupported(head_dim_qk=192, head_dim_v=128,
                                                  q_dtype=torch.float32, group=1)
    assert "GQA group 128 > 64" in _native.shape_unsupported(
        head_dim_qk=128, head_dim_v=128, q_dtype=torch.float16, group=128)


def test_native_ragged_call_alignment_reasons():
    q = torch.zeros(4, 2, 192, dtype=torch.bfloat16)
    k = torch.zeros(6, 2, 192, dtype=torch.bfloat16)
    v = torch.zeros(6, 2, 256, dtype=torch.bfloat16)[..., 128:]  # vLLM's slice: aligned
    out = torch.zeros(4, 2, 128, dtype=torch.bfloat16)
    assert _native.call_unsupported(q, k, v, out) is None
    odd = torch.zeros(6, 2, 129, dtype=torch.bfloat16)[..., 1:]
    assert "v rows not 16-byte aligned" in _native.call_unsupported(q, k, odd, out)
    k_wide = torch.zeros(6, 2, 196, dtype=torch.bfloat16)[..., :192]  # rows 392 bytes apart
    assert "k rows not 16-byte aligned" in _native.call_unsupported(q, k_wide, v, out)

def test_cpu_plans_never_take_the_native_kernel():
    case = dataclasses.replace(GPU_CASES[0], len_q=(5,), len_k=(5,))
    cu = torch.tensor([0, 5], dtype=torch.int32)
    plan = plan_ragged_attention(cu, cu, total_q=5, total_k=5, num_q_heads=case.heads,
                                 num_kv_heads=case.kv_heads, head_dim_qk=192, head_dim_v=128,
                                 q_dtype=torch.float32)
    assert plan.impl == "reference" and plan.sched is None
