"""MLA prefill ops (``ops.mla_prefill``: ragged attention with unlike query/key and value
heads, the LSE merge) against the float64 reference.

CPU: the kernels run in Triton's interpreter on tiny shapes in fp16. GPU (marked ``gpu``):
real sizes (B=8, 4k tokens, 16 and 128 heads, 192/128), bf16 too. Fresh random inputs,
outputs poisoned with NaN, errors within a small multiple of the reference's own error in
the input dtype (tests/support/budget.py).
"""

from __future__ import annotations

import math
from typing import Optional
import dataclasses
from dataclasses import dataclass

import pytest
import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops import _device
from hygon_attn_backend.ops.mla_prefill import (merge_attn_states, mla_extend_attention,
                                                plan_mla_extend, plan_ragged_attention,
                                                ragged_attention, tuning)

from tests.support.budget import assert_within_budget

gpu = pytest.mark.gpu


@dataclass(frozen=True)
class Case:
    """One ragged batch: request ``b`` has ``len_q[b]`` queries and ``len_k[b]`` keys."""

    name: str
    len_q: tuple
    len_k: tuple
    heads: int = 2
    kv_heads: int = 2
    d_qk: int = 48
    d_v: int = 32
    causal: bool = True
    dtype: torch.dtype = torch.float16
    strided: bool = False  # k's rope part broadcast over heads, v a slice (vLLM's views)


CPU_CASES = [
    Case("equal_lengths", (17, 5), (17, 5)),
    Case("shifted_causal", (5, 9), (21, 9)),
    Case("noncausal_chunk", (5, 9), (21, 30), causal=False),
    Case("empty_sequences", (0, 7, 0, 3), (4, 7, 0, 0)),
    Case("keys_fewer_than_queries", (12,), (5,)),
    Case("gqa_group4", (9, 16), (20, 16), heads=8, kv_heads=2, d_qk=40, d_v=24),
    Case("d_under_16", (6,), (10,), d_qk=12, d_v=8, causal=False),
    Case("mla_192_128", (3, 5), (9, 5), d_qk=192, d_v=128),
    Case("mla_192_128_views", (4, 2), (4, 6), d_qk=192, d_v=128, causal=False, strided=True),
]

GPU_CASES = [
    Case("g_mla_16h", (4096,) * 8, (4096,) * 8, heads=16, kv_heads=16, d_qk=192, d_v=128,
         dtype=torch.bfloat16),
    Case("g_mla_128h_chunk", (512, 1, 2000, 37), (4096, 300, 4096, 0), heads=128,
         kv_heads=128, d_qk=192, d_v=128, causal=False, dtype=torch.bfloat16, strided=True),
    Case("g_mla_shifted", (1000, 33, 2048), (3000, 33, 4096), heads=16, kv_heads=16,
         d_qk=192, d_v=128, dtype=torch.float16),
    Case("g_gqa_d80", (700, 64), (900, 64), heads=16, kv_heads=4, d_qk=80, d_v=80,
         dtype=torch.bfloat16),
    Case("g_d256", (300, 900), (700, 900), heads=4, kv_heads=2, d_qk=256, d_v=256,
         dtype=torch.bfloat16),
    # the tiny DeepSeek's MHA-method prefill in SGLang (no cached prefix, causal, 4 heads,
    # q/k 32 + 64 rope = 96, v 32 a slice of the up-projection), where the engine run on an
    # H100 (2026-12-06) saw the ragged kernel's output far from the reference
    Case("g_deepseek_tiny_mha", (51,), (51,), heads=4, kv_heads=4, d_qk=96, d_v=32,
         dtype=torch.float16, strided=True),
    Case("g_deepseek_tiny_mha_dense", (51, 7, 130), (51, 7, 130), heads=4, kv_heads=4,
         d_qk=96, d_v=32, dtype=torch.bfloat16),
]


def offsets(lengths, device):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


def make_inputs(case: Case, device, *, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device).to(case.dtype)

    cu_q, cu_k = offsets(case.len_q, device), offsets(case.len_k, device)
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    q = rnd(total_q, case.heads, case.d_qk)
    if case.strided:
        # vLLM: k = cat(k_nope, k_pe broadcast over heads), v a slice of [k_nope | v]
        rope = case.d_qk // 3
        k_pe = rnd(total_k, 1, rope).expand(total_k, case.kv_heads, rope)
        k = torch.cat([rnd(total_k, case.kv_heads, case.d_qk - rope), k_pe], dim=-1)
        kv = rnd(total_k, case.kv_heads, case.d_qk - rope + case.d_v)
        v = kv[..., case.d_qk - rope:]
        assert not v.is_contiguous()
    else:
        k = rnd(total_k, case.kv_heads, case.d_qk)
        v = rnd(total_k, case.kv_heads, case.d_v)
    return q, k, v, cu_q, cu_k


def check_case(case: Case, device, *, seed: int = 0, impl: str = "triton", plan=None,
               inputs=None):
    q, k, v, cu_q, cu_k = inputs or make_inputs(case, device, seed=seed)
    out = torch.full((q.shape[0], q.shape[1], v.shape[2]), float("nan"), dtype=q.dtype,
                     device=device)
    res, lse = ragged_attention(q, k, v, cu_q, cu_k, causal=case.causal, out=out,
                                return_lse=True, impl=impl, plan=plan)
    assert res is out
    ref64, ref_lse = reference.ragged_attention(q, k, v, cu_q, cu_k, causal=case.causal,
                                                return_lse=True, compute_dtype=torch.float64)
    ref_lp = reference.ragged_attention(q, k, v, cu_q, cu_k, causal=case.causal,
                                        compute_dtype=q.dtype)
    assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse).cpu(), finite.cpu()), f"{case.name}: -inf rows"
    assert bool((lse[~finite] == float("-inf")).all())
    if finite.any():
        err = (lse.double() - ref_lse.double())[finite].abs().max().item()
        assert err < 2e-3 * max(1.0, ref_lse[finite].abs().max().item()), \
            f"{case.name}: lse error {err:.3e}"
    return assert_within_budget(out, ref64, ref_lp, what=case.name)


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_ragged_matches_reference(case, device):
    check_case(case, device)


def test_narrow_value_head_takes_a_64_wide_tile_on_a_gpu():
    """The value head's tile rule (``ops._device.head_tile``): a GPU never gets a value
    tile under 64 columns (32-wide ones were wrong on an H100), the interpreter keeps the
    real width."""
    gpu, cpu = torch.device("cuda"), torch.device("cpu")
    for d_v, want_gpu, want_cpu in ((8, 64, 16), (32, 64, 32), (64, 64, 64), (80, 128, 128),
                                    (128, 128, 128)):
        cfg = tuning.choose(device=gpu, impl="triton", total_q=51, num_kv_heads=4,
                                group=1, head_dim_qk=96, head_dim_v=d_v,
                                q_dtype=torch.float16, tile=(64, 64, 4, 3))
        assert (cfg.d1, cfg.d2, cfg.dv) == (64, 32, want_gpu)
        assert _device.head_tile(d_v, device=cpu) == want_cpu


def test_padded_value_tile_gives_the_unpadded_answer(device):
    """A 32-wide value head run on the 64-wide tile a GPU takes (the padded columns masked
    on load and store) matches the reference, as the unpadded tile does."""
    case = Case("tiny_deepseek_mha", (51, 7), (51, 7), heads=4, kv_heads=4, d_qk=96, d_v=32,
                strided=True)
    inputs = make_inputs(case, device)
    q, k, v, cu_q, cu_k = inputs
    plan = plan_ragged_attention(cu_q, cu_k, total_q=q.shape[0], total_k=k.shape[0],
                                 num_q_heads=4, num_kv_heads=4, head_dim_qk=96, head_dim_v=32,
                                 q_dtype=q.dtype, impl="triton")
    padded = dataclasses.replace(plan, config=plan.config._replace(dv=64))
    check_case(case, device, plan=padded, inputs=inputs)


def test_ragged_second_seed_and_plan_reuse(device):
    """One plan, two layers' calls with fresh tensors (the plan holds no layer state)."""
    case = CPU_CASES[1]
    q, k, v, cu_q, cu_k = make_inputs(case, device)
    plan = plan_ragged_attention(cu_q, cu_k, total_q=q.shape[0], total_k=k.shape[0],
                                 num_q_heads=case.heads, num_kv_heads=case.kv_heads,
                                 head_dim_qk=case.d_qk, head_dim_v=case.d_v,
                                 host_cu_seqlens_q=cu_q.cpu(), host_cu_seqlens_k=cu_k.cpu(),
                                 q_dtype=q.dtype)
    assert plan.impl == "triton"
    check_case(case, device, plan=plan, inputs=(q, k, v, cu_q, cu_k))
    q2, k2, v2, _, _ = make_inputs(case, device, seed=1)
    check_case(case, device, plan=plan, inputs=(q2, k2, v2, cu_q, cu_k))
    # the device-built tile map (no host copies) gives the same schedule
    dev_plan = plan_ragged_attention(cu_q, cu_k, total_q=q.shape[0], total_k=k.shape[0],
                                     num_q_heads=case.heads, num_kv_heads=case.kv_heads,
                                     head_dim_qk=case.d_qk, head_dim_v=case.d_v)
    assert torch.equal(dev_plan.tile_req.cpu(), plan.tile_req.cpu())
    assert torch.equal(dev_plan.tile_mblock.cpu(), plan.tile_mblock.cpu())


def test_ragged_reference_impl_and_scale(device):
    case = CPU_CASES[0]
    q, k, v, cu_q, cu_k = make_inputs(case, device)
    out = ragged_attention(q, k, v, cu_q, cu_k, scale=0.3, impl="reference")
    tri = ragged_attention(q, k, v, cu_q, cu_k, scale=0.3, impl="triton")
    ref64 = reference.ragged_attention(q, k, v, cu_q, cu_k, scale=0.3,
                                       compute_dtype=torch.float64)
    ref_lp = reference.ragged_attention(q, k, v, cu_q, cu_k, scale=0.3, compute_dtype=q.dtype)
    assert_within_budget(out, ref64, ref_lp, what="reference impl")
    assert_within_budget(tri, ref64, ref_lp, what="triton, scale 0.3")
    default = reference.ragged_attention(q, k, v, cu_q, cu_k, compute_dtype=torch.float64)
    assert (default - ref64).abs().max() > 1e-3  # the scale was applied


def test_reference_ragged_is_plain_softmax():
    """The oracle itself, at one row: softmax(q k^T * scale) v over the visible keys."""
    q = torch.randn(2, 1, 5, dtype=torch.float64)
    k = torch.randn(4, 1, 5, dtype=torch.float64)
    v = torch.randn(4, 1, 3, dtype=torch.float64)
    cu_q, cu_k = torch.tensor([0, 2]), torch.tensor([0, 4])
    out, lse = reference.ragged_attention(q, k, v, cu_q, cu_k, return_lse=True,
                                          compute_dtype=torch.float64)
    s = (q[1, 0] @ k[:, 0].T) / math.sqrt(5)  # the last row sees every key
    assert torch.allclose(out[1, 0], torch.softmax(s, 0) @ v[:, 0])
    assert torch.allclose(lse[0, 1].double(), torch.logsumexp(s, 0), atol=1e-6)
    s0 = (q[0, 0] @ k[:3, 0].T) / math.sqrt(5)  # row 0: keys 0..2 (shift 2)
    assert torch.allclose(out[0, 0], torch.softmax(s0, 0) @ v[:3, 0])


def test_head_split_rule():
    assert tuning.head_split(192) == (128, 64)
    assert tuning.head_split(576) == (512, 64)
    assert tuning.head_split(48) == (32, 16)
    assert tuning.head_split(128) == (128, 0)
    assert tuning.head_split(100) == (64, 64)
    assert tuning.head_split(8) == (16, 0)
    assert tuning.heads_per_tile(1) == 1 and tuning.heads_per_tile(8) == 8
    assert tuning.heads_per_tile(128) == 64 and tuning.heads_per_tile(96) == 32
    # the 192/128 tile at (B=8, 4k, 16 heads) on an H200
    assert tuning.tile_config(qk_width=192, dv=128, heads=1, total_q=8 * 4096,
                              num_programs_per_tile=16, num_sms=132,
                              is_hip=False) == (128, 64, 8, 3)


# ----------------------------------------------------------------------------- merge


def make_partials(n, h, d, dtype, device, *, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(n, h, d, generator=gen, device=device).to(dtype)
    b = torch.randn(n, h, d, generator=gen, device=device).to(dtype)
    la = torch.randn(h, n, generator=gen, device=device) * 4
    lb = torch.randn(h, n, generator=gen, device=device) * 4
    return a, la, b, lb


def test_merge_matches_reference_and_exact_attention(device):
    """Two halves of a key set merged equal attention over the whole set."""
    q = torch.randn(6, 3, 40, device=device).half()
    k = torch.randn(20, 3, 40, device=device).half()
    v = torch.randn(20, 3, 24, device=device).half()
    cu_q = torch.tensor([0, 6], dtype=torch.int32, device=device)
    whole = reference.ragged_attention(q, k, v, cu_q, torch.tensor([0, 20], device=device),
                                       causal=False, compute_dtype=torch.float64)
    halves = []
    for lo, hi in ((0, 11), (11, 20)):
        halves.append(ragged_attention(q, k[lo:hi], v[lo:hi], cu_q,
                                       torch.tensor([0, hi - lo], dtype=torch.int32,
                                                    device=device),
                                       causal=False, return_lse=True, impl="triton"))
    (oa, la), (ob, lb) = halves
    out = torch.full_like(oa, float("nan"))
    res, lse = merge_attn_states(oa, la, ob, lb, out=out, return_lse=True, impl="triton")
    assert res is out
    ref_lp = reference.ragged_attention(q, k, v, cu_q, torch.tensor([0, 20], device=device),
                                        causal=False, compute_dtype=torch.float16)
    assert_within_budget(out, whole, ref_lp, mult=8.0, what="merged halves")
    _, whole_lse = reference.ragged_attention(q, k, v, cu_q,
                                              torch.tensor([0, 20], device=device),
                                              causal=False, return_lse=True,
                                              compute_dtype=torch.float64)
    assert (lse.double() - whole_lse.double()).abs().max() < 2e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_merge_empty_and_nonfinite_partials(dtype, device):
    """-inf, +inf and NaN LSE: that partial contributes nothing (its values unread, NaN
    here); both such: 0 and -inf. The same answer from the reference and Triton."""
    n, h, d = 9, 5, 40
    a, la, b, lb = make_partials(n, h, d, dtype, device)
    la[0, 0] = float("-inf")
    a[0, 0] = float("nan")
    lb[1, 1] = float("inf")
    b[1, 1] = float("nan")
    la[2, 2] = float("nan")
    la[3, 3] = lb[3, 3] = float("-inf")
    a[3, 3] = float("nan")
    results = {impl: merge_attn_states(a, la, b, lb, return_lse=True, impl=impl)
               for impl in ("reference", "triton")}
    ref64, ref_lse = reference.merge_attn_states(a, la, b, lb, compute_dtype=torch.float64)
    assert torch.equal(ref64[0, 0].to(dtype), b[0, 0]) and torch.equal(ref64[1, 1].to(dtype),
                                                                       a[1, 1])
    for impl, (out, lse) in results.items():
        assert bool(torch.isfinite(out).all()), impl
        assert bool((out[3, 3] == 0).all()) and lse[3, 3] == float("-inf"), impl
        assert (out.double() - ref64).abs().max() <= 2e-3, impl
        assert torch.equal(torch.isfinite(lse), torch.isfinite(ref_lse)), impl
        fin = torch.isfinite(ref_lse)
        assert (lse - ref_lse)[fin].abs().max() < 1e-5, impl
        assert lse[0, 0] == lb[0, 0] and lse[1, 1] == la[1, 1], impl


def test_merge_in_place_on_strided_slices(device):
    """vLLM's accumulator: out is out_a (a slice of a larger buffer), LSE [H, N] slices."""
    buf = torch.randn(12, 4, 64, device=device).half()
    lse_buf = torch.randn(4, 12, device=device)
    b = torch.randn(8, 4, 32, device=device).half()
    lb = torch.randn(4, 8, device=device)
    a, la = buf[2:10, :, :32], lse_buf[:, 2:10]
    want, want_lse = reference.merge_attn_states(a.clone(), la.clone(), b, lb)
    before = buf.clone()
    merge_attn_states(a, la, b, lb, out=a, out_lse=la, impl="triton")
    assert (a.float() - want.float()).abs().max() <= 2e-3
    assert (la - want_lse).abs().max() < 1e-5
    assert torch.equal(buf[:2], before[:2]) and torch.equal(buf[10:], before[10:])
    assert torch.equal(buf[2:10, :, 32:], before[2:10, :, 32:])


# ----------------------------------------------------------------------------- bad inputs


def _bad_calls(device):
    q = torch.randn(8, 2, 48, device=device).half()
    k = torch.randn(10, 2, 48, device=device).half()
    v = torch.randn(10, 2, 32, device=device).half()
    cu_q = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
    t32 = lambda *x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    return [
        ("k's head size", dict(k=k[..., :40])),
        ("v must hold k's", dict(v=v[:9])),
        ("multiple of k's", dict(q=torch.randn(8, 3, 48, device=device).half())),
        ("k must have dtype", dict(k=k.float())),
        ("in \\[1, 256\\]", dict(q=torch.randn(8, 2, 300, device=device).half(),
                                k=torch.randn(10, 2, 300, device=device).half())),
        ("cu_seqlens_k must have shape", dict(cu_k=t32(0, 10))),
        ("cu_seqlens_q must be non-decreasing", dict(cu_q=t32(0, 5, 3))),
        ("cu_seqlens_q\\[-1\\] \\(7\\) must equal", dict(cu_q=t32(0, 3, 7))),
        ("cu_seqlens_k\\[-1\\] \\(11\\) must be at most", dict(cu_k=t32(0, 4, 11))),
        ("cu_seqlens_k must start at 0", dict(cu_k=t32(1, 4, 10))),
        ("out must have shape", dict(out=torch.empty(8, 2, 48, device=device).half())),
        ("scale must be a finite float", dict(scale=-1.0)),
    ], (q, k, v, cu_q, cu_k)


@pytest.mark.parametrize("impl", ["reference", "triton", "auto"])
def test_ragged_bad_inputs_name_the_argument(impl, device):
    cases, (q, k, v, cu_q, cu_k) = _bad_calls(device)
    for message, change in cases:
        args = dict(q=q, k=k, v=v, cu_q=cu_q, cu_k=cu_k)
        kw = {n: change[n] for n in ("out", "scale") if n in change}
        args.update({n: x for n, x in change.items() if n not in kw})
        with pytest.raises(ValueError, match=message):
            ragged_attention(args["q"], args["k"], args["v"], args["cu_q"], args["cu_k"],
                             impl=impl, **kw)


def test_ragged_plan_refuses_other_shapes(device):
    _, (q, k, v, cu_q, cu_k) = _bad_calls(device)
    plan = plan_ragged_attention(cu_q, cu_k, total_q=8, total_k=10, num_q_heads=2,
                                 num_kv_heads=2, head_dim_qk=48, head_dim_v=32)
    with pytest.raises(ValueError, match="plan was built for k of shape"):
        ragged_attention(q, k[:9], v[:9], cu_q, cu_k, plan=plan)
    with pytest.raises(ValueError, match="must be the tensors the plan was built with"):
        ragged_attention(q, k, v, cu_q.clone(), cu_k, plan=plan)
    with pytest.raises(ValueError, match="head_dim_v must be in"):
        plan_ragged_attention(cu_q, cu_k, total_q=8, total_k=10, num_q_heads=2,
                              num_kv_heads=2, head_dim_qk=48, head_dim_v=257)
    with pytest.raises(ValueError, match="tile BLOCK_N=24 must be a power of two"):
        plan_ragged_attention(cu_q, cu_k, total_q=8, total_k=10, num_q_heads=2,
                              num_kv_heads=2, head_dim_qk=48, head_dim_v=32,
                              tile=(16, 24, 4, 1))


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_merge_bad_inputs_name_the_argument(impl, device):
    a, la, b, lb = make_partials(4, 3, 16, torch.float16, device)
    cases = [
        ("out_b must have dtype", dict(out_b=b.float())),
        ("out_b must have shape", dict(out_b=b[:3])),
        ("lse_a must have shape \\(3, 4\\)", dict(lse_a=la.t().contiguous())),
        ("lse_b must have dtype", dict(lse_b=lb.double())),
        ("out must have dtype", dict(out=torch.empty_like(a, dtype=torch.float32))),
        ("out_lse must have shape", dict(out_lse=torch.empty(4, 3, device=device))),
    ]
    for message, change in cases:
        args = dict(out_a=a, lse_a=la, out_b=b, lse_b=lb)
        kw = {n: change[n] for n in ("out", "out_lse") if n in change}
        args.update({n: x for n, x in change.items() if n not in kw})
        with pytest.raises(ValueError, match=message):
            merge_attn_states(args["out_a"], args["lse_a"], args["out_b"], args["lse_b"],
                              impl=impl, **kw)


# ----------------------------------------------------------------------------- GPU


@gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_ragged_gpu_real_sizes(case):
    check_case(case, torch.device("cuda"))


@gpu
def test_merge_gpu_real_sizes():
    dev = torch.device("cuda")
    a, la, b, lb = make_partials(8 * 4096, 128, 128, torch.bfloat16, dev)
    la[:, ::7] = float("-inf")
    out, lse = merge_attn_states(a, la, b, lb, return_lse=True, impl="triton")
    ref, ref_lse = reference.merge_attn_states(a, la, b, lb)
    assert (out.float() - ref.float()).abs().max() <= 1.6e-2
    assert (lse - ref_lse).abs().max() < 1e-4


def test_ragged_unchecked_offsets_stay_inside_the_tensors(device):
    """validate=False with cu_seqlens_k past k's rows: the kernel reads only rows of k / v
    (they are slices of buffers whose next rows are NaN) and answers as for the offsets
    clipped to k."""
    q = torch.randn(8, 2, 48, device=device).half()
    k_buf = torch.randn(14, 2, 48, device=device).half()
    v_buf = torch.randn(14, 2, 32, device=device).half()
    k_buf[10:] = float("nan")
    v_buf[10:] = float("nan")
    k, v = k_buf[:10], v_buf[:10]
    cu_q = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)
    wild = torch.tensor([0, 4, 14], dtype=torch.int32, device=device)
    clipped = torch.tensor([0, 4, 10], dtype=torch.int32, device=device)
    out = ragged_attention(q, k, v, cu_q, wild, causal=False, validate=False, impl="triton")
    ref64 = reference.ragged_attention(q, k, v, cu_q, clipped, causal=False,
                                       compute_dtype=torch.float64)
    ref_lp = reference.ragged_attention(q, k, v, cu_q, clipped, causal=False,
                                        compute_dtype=q.dtype)
    assert_within_budget(out, ref64, ref_lp, what="clipped offsets")
    with pytest.raises(ValueError, match="must be at most k.shape"):
        ragged_attention(q, k, v, cu_q, wild, causal=False, impl="triton")


# ----------------------------------------------------------------------------- absorbed extend


@dataclass(frozen=True)
class ExtendCase:
    """Request ``b``: ``prefix[b]`` cached tokens and ``extend[b]`` new ones, every row in
    a paged latent cache of ``page`` slots a block."""

    name: str
    prefix: tuple
    extend: tuple
    heads: int = 4
    d: int = 72
    d_v: int = 64
    page: int = 16
    dtype: torch.dtype = torch.float16
    bad_block: bool = False  # one used table entry out of range: its keys absent
    kv_dtype: Optional[torch.dtype] = None  # fp8: the latent cache quantized with kv_scale
    kv_scale: float = 0.7
    tensor_scale: bool = False  # the scale as a 1-element device tensor


EXTEND_CPU_CASES = [
    ExtendCase("mixed_p16", (5, 0, 20), (3, 7, 1)),
    ExtendCase("page1_heads16", (9, 2), (4, 6), heads=16, page=1),
    ExtendCase("page4_empty", (0, 6, 3), (0, 5, 0), page=4),
    ExtendCase("latent_576_512", (7,), (2,), heads=2, d=576, d_v=512, page=16),
    ExtendCase("absent_block", (20, 4), (5, 3), page=4, bad_block=True),
    ExtendCase("fp8_e4m3_576", (9, 0), (3, 5), heads=4, d=576, d_v=512, page=16,
               kv_dtype=torch.float8_e4m3fn),
    ExtendCase("fp8_e5m2_tensor_scale_p1", (6, 2), (2, 4), heads=8, page=1,
               kv_dtype=torch.float8_e5m2, tensor_scale=True, kv_scale=1.9),
]

EXTEND_GPU_CASES = [
    ExtendCase("g_dsv3_16h", (4096,) * 8, (512,) * 8, heads=16, d=576, d_v=512, page=64,
               dtype=torch.bfloat16),
    ExtendCase("g_dsv3_128h", (1000, 3000, 0, 17), (100, 1, 700, 64), heads=128, d=576,
               d_v=512, page=1, dtype=torch.bfloat16),
    ExtendCase("g_dsv3_p16_fp16", (2048, 5), (64, 300), heads=16, d=576, d_v=512, page=16,
               dtype=torch.float16),
    ExtendCase("g_dsv3_fp8_e4m3", (3000, 40), (200, 129), heads=16, d=576, d_v=512,
               page=64, dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn, kv_scale=0.05),
]


def make_extend_inputs(case: ExtendCase, device, *, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed)
    lens = [p + e for p, e in zip(case.prefix, case.extend)]
    num_seqs = len(lens)
    max_blocks = max(1, max(-(-n // case.page) for n in lens)) + 1
    num_blocks = num_seqs * max_blocks + 3
    # the cache's rows strided like SGLang's pool viewed [num_blocks, P, D] out of a wider
    # buffer, so the kernel must use the strides it is given
    store = torch.randn(num_blocks, case.page, case.d + 8, generator=gen,
                        device=device).to(case.dtype)
    kv = store[..., :case.d]
    if case.kv_dtype is not None:  # codes of x / kv_scale, SGLang's pool strides kept
        codes = torch.empty(store.shape, dtype=case.kv_dtype, device=device)
        codes.copy_(reference.quantize_fp8(store.float() * case.kv_scale, case.kv_dtype,
                                           case.kv_scale))
        kv = codes[..., :case.d]
    perm = torch.randperm(num_seqs * max_blocks, generator=gen, device=device) + 3
    table = perm.reshape(num_seqs, max_blocks).to(torch.int32)
    if case.bad_block:
        table[0, 1] = num_blocks + 5
    q = torch.randn(sum(case.extend), case.heads, case.d, generator=gen,
                    device=device).to(case.dtype)
    cu = offsets(case.extend, device)
    lens_k = torch.tensor(lens, dtype=torch.int32, device=device)
    return q, kv, table, cu, lens_k


def check_extend(case: ExtendCase, device, *, impl="triton", plan=None, inputs=None):
    q, kv, table, cu, lens_k = inputs or make_extend_inputs(case, device)
    out = torch.full((q.shape[0], q.shape[1], case.d_v), float("nan"), dtype=q.dtype,
                     device=device)
    scale = None
    if case.kv_dtype is not None:
        scale = (torch.tensor([case.kv_scale], device=device) if case.tensor_scale
                 else case.kv_scale)
    res, lse = mla_extend_attention(q, kv, table, cu, lens_k, v_head_dim=case.d_v, out=out,
                                    return_lse=True, impl=impl, plan=plan, kv_scale=scale)
    assert res is out
    ref64, ref_lse = reference.mla_extend_attention(q, kv, table, cu, lens_k,
                                                    v_head_dim=case.d_v, return_lse=True,
                                                    compute_dtype=torch.float64,
                                                    kv_scale=scale)
    ref_lp = reference.mla_extend_attention(q, kv, table, cu, lens_k, v_head_dim=case.d_v,
                                            compute_dtype=q.dtype, kv_scale=scale)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse).cpu(), finite.cpu()), f"{case.name}: -inf rows"
    if finite.any():
        err = (lse.double() - ref_lse.double())[finite].abs().max().item()
        assert err < 2e-3 * max(1.0, ref_lse[finite].abs().max().item()), case.name
    return assert_within_budget(out, ref64, ref_lp, what=case.name)


@pytest.mark.parametrize("case", EXTEND_CPU_CASES, ids=lambda c: c.name)
def test_mla_extend_matches_reference(case, device):
    check_extend(case, device)


def test_mla_extend_plan_reuse_and_absent_keys(device):
    case = EXTEND_CPU_CASES[0]
    q, kv, table, cu, lens_k = make_extend_inputs(case, device)
    plan = plan_mla_extend(cu, lens_k, total_q=q.shape[0], num_q_heads=case.heads,
                           head_dim=case.d, v_head_dim=case.d_v, page_size=case.page,
                           host_cu_seqlens_q=cu.cpu(), host_seq_lens_k=lens_k.cpu(),
                           capacity=table.shape[1] * case.page, q_dtype=q.dtype)
    check_extend(case, device, plan=plan, inputs=(q, kv, table, cu, lens_k))
    q2 = torch.randn_like(q)
    check_extend(case, device, plan=plan, inputs=(q2, kv, table, cu, lens_k))
    with pytest.raises(ValueError, match="plan was built for total_q"):
        mla_extend_attention(q[:3], kv, table, cu, lens_k, v_head_dim=case.d_v, plan=plan)
    # an absent block (id past the cache) hides exactly its keys, in both implementations
    bad = table.clone()
    bad[0, 0] = -1
    got = mla_extend_attention(q, kv, bad, cu, lens_k, v_head_dim=case.d_v, impl="triton")
    want = reference.mla_extend_attention(q, kv, bad, cu, lens_k, v_head_dim=case.d_v,
                                          compute_dtype=torch.float64)
    assert (got.double() - want).abs().max() <= 4e-3
    full = reference.mla_extend_attention(q, kv, table, cu, lens_k, v_head_dim=case.d_v,
                                          compute_dtype=torch.float64)
    assert (full - want)[: case.extend[0]].abs().max() > 1e-2  # the block mattered


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_mla_extend_bad_inputs_name_the_argument(impl, device):
    case = EXTEND_CPU_CASES[0]
    q, kv, table, cu, lens_k = make_extend_inputs(case, device)
    t32 = lambda *x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    cases = [
        ("kv_cache must have shape", dict(kv=kv[..., :40])),
        ("kv_cache must have dtype", dict(kv=kv.float())),
        ("need 1 <= v_head_dim <= head_dim", dict(v_head_dim=case.d + 1)),
        ("seq_lens_k must have shape", dict(lens_k=lens_k[:2])),
        ("block_table must have shape", dict(table=table[:2])),
        ("shorter than request 1's query length", dict(lens_k=t32(8, 6, 21))),
        ("the block table holds at most", dict(lens_k=t32(8, 7, 10_000))),
        ("cu_seqlens_q\\[-1\\] \\(10\\) must equal", dict(cu=t32(0, 3, 9, 10))),
        ("out must have shape", dict(out=torch.empty(11, case.heads, case.d,
                                                     device=device).half())),
        ("scale must be a finite float", dict(scale=float("nan"))),
    ]
    for message, change in cases:
        args = dict(q=q, kv=kv, table=table, cu=cu, lens_k=lens_k)
        kw = dict(v_head_dim=change.get("v_head_dim", case.d_v))
        kw.update({n: change[n] for n in ("out", "scale") if n in change})
        args.update({n: x for n, x in change.items() if n in args})
        with pytest.raises(ValueError, match=message):
            mla_extend_attention(args["q"], args["kv"], args["table"], args["cu"],
                                 args["lens_k"], impl=impl, **kw)


@gpu
@pytest.mark.parametrize("case", EXTEND_GPU_CASES, ids=lambda c: c.name)
def test_mla_extend_gpu_real_sizes(case):
    check_extend(case, torch.device("cuda"))
