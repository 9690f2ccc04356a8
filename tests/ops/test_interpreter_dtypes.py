"""bf16 under Triton's CPU interpreter: never a wrong answer.

With some numpy / Triton pairs the interpreter's bf16 ``tl.dot`` is garbage (numpy 2.4 with
Triton 3.x: decode off by ~8e8). ``ops/_interpreter.py`` probes it once per process; where it
is wrong, bf16 attention runs the reference, with one ``InterpreterDtypeWarning``.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops import _interpreter
from hygon_attn_backend.ops.decode import paged_decode_attention
from hygon_attn_backend.ops.prefill import plan_prefix_prefill, prefix_prefill_attention

from tests.support.budget import assert_within_budget

BF16 = torch.bfloat16
interpreter = pytest.mark.skipif(torch.cuda.is_available(), reason="Triton on CPU tensors "
                                 "needs the interpreter, which is off on a CUDA host")


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def _case(dtype=BF16, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)
    return dict(q=rnd(2, 4, 64), k=rnd(6, 1, 16, 64), v=rnd(6, 1, 16, 64),
                table=_i32([[0, 1, 2], [3, 4, 5]]), lens=_i32([40, 19]), qp=rnd(9, 4, 64),
                cu=_i32([0, 4, 9]))


def _decode(c, impl):
    return paged_decode_attention(c["q"], c["k"], c["v"], c["table"], c["lens"], impl=impl)


def _prefill(c, impl, **kw):
    return prefix_prefill_attention(c["qp"], c["k"], c["v"], c["table"], c["cu"], c["lens"],
                                    impl=impl, **kw)


@pytest.fixture
def broken_bf16(monkeypatch):
    """The probe says the interpreter's bf16 dot is wrong; no warning given yet."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(_interpreter, "bf16_dot_works", lambda: False)
    monkeypatch.setattr(_interpreter, "_WARNED", set())


@interpreter
@pytest.mark.parametrize("impl", ["auto", "triton"])
def test_broken_bf16_runs_the_reference_and_warns_once(broken_bf16, impl):
    c = _case()
    with pytest.warns(_interpreter.InterpreterDtypeWarning, match="bfloat16 tl.dot wrong"):
        out = _decode(c, impl)
    want = reference.paged_decode_attention(c["q"], c["k"], c["v"], c["table"], c["lens"])
    assert out.dtype == BF16 and torch.equal(out, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second time: no warning
        out_p = _prefill(c, impl)
    want_p = reference.prefix_prefill_attention(c["qp"], c["k"], c["v"], c["table"], c["cu"],
                                                c["lens"])
    assert torch.equal(out_p, want_p)


@interpreter
def test_broken_bf16_prefill_plan_without_dtype_runs_the_reference(broken_bf16):
    """A prefill plan built without q's dtype decides at the first bf16 launch."""
    c = _case()
    plan = plan_prefix_prefill(c["cu"], c["lens"], total_q=9, num_q_heads=4, num_kv_heads=1,
                               head_dim=64, impl="triton")
    assert plan.impl == "triton"
    with pytest.warns(_interpreter.InterpreterDtypeWarning):
        out, lse = _prefill(c, "triton", plan=plan, return_lse=True)
    want, want_lse = reference.prefix_prefill_attention(
        c["qp"], c["k"], c["v"], c["table"], c["cu"], c["lens"], return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@interpreter
def test_fp16_and_the_gpu_path_never_probe(monkeypatch):
    def probe():
        raise AssertionError("probed")
    monkeypatch.setattr(_interpreter, "bf16_dot_works", probe)
    assert _interpreter.triton_computes(torch.float16)
    c = _case(torch.float16)
    ref = reference.paged_decode_attention(c["q"], c["k"], c["v"], c["table"], c["lens"],
                                           compute_dtype=torch.float64)
    ref_lp = reference.paged_decode_attention(c["q"], c["k"], c["v"], c["table"], c["lens"],
                                              compute_dtype=torch.float16)
    assert_within_budget(_decode(c, "triton"), ref, ref_lp, what="fp16 decode")
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # as on a GPU: no interpreter
    assert _interpreter.triton_computes(BF16)


@interpreter
def test_probe_verdict_matches_a_real_bf16_launch(monkeypatch):
    """Here and now: the probe's verdict is what the attention kernels do in bf16 (the
    kernels forced to run: the fallback off)."""
    works = _interpreter.bf16_dot_works()
    assert _interpreter.bf16_dot_works.cache_info().currsize == 1  # probed once a process
    monkeypatch.setattr(_interpreter, "triton_computes", lambda dtype: True)
    from hygon_attn_backend.ops import _dispatch
    monkeypatch.setattr(_dispatch, "triton_computes", lambda dtype: True)
    c = _case()
    out = _decode(c, "triton")
    ref = reference.paged_decode_attention(c["q"], c["k"], c["v"], c["table"], c["lens"],
                                           compute_dtype=torch.float64)
    ref_lp = reference.paged_decode_attention(c["q"], c["k"], c["v"], c["table"], c["lens"],
                                              compute_dtype=BF16)
    if works:
        assert_within_budget(out, ref, ref_lp, what="bf16 decode in the interpreter")
    else:
        err = (out.double() - ref).abs().max()
        assert not err <= 1e-1, f"the probe says broken, the kernel is right ({err})"
