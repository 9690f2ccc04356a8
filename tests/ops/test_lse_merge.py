"""``ops.lse_merge.merge_partials``: its Triton launch (GPUs) and its torch form (CPUs)
against attention over the union of the key sets, and against each other on the same
inputs, empty sets and empty rows included."""

from __future__ import annotations

import pytest
import torch

from hygon_attn_backend.ops import lse_merge
from hygon_attn_backend.ops.lse_merge import merge_partials

gpu = pytest.mark.gpu


def _partials(r, n, h, d, *, dtype, device, seed=0):
    """``R`` random partial outputs and LSEs, set 1 empty for row (0, 0), every set empty
    for row (n - 1, h - 1), the empty sets' outputs NaN (never read)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    outs = torch.randn(r, n, h, d, generator=gen).to(dtype)
    lses = torch.randn(r, n, h, generator=gen) * 4
    lses[1, 0, 0] = float("-inf")
    lses[:, n - 1, h - 1] = float("-inf")
    outs[1, 0, 0] = float("nan")
    outs[:, n - 1, h - 1] = float("nan")
    return outs.to(device), lses.to(device)


def _check_against_union(out, lse, outs, lses):
    """The merge as fp64 attention arithmetic: weights exp(lse_r) / sum."""
    o64, l64 = outs.double().cpu(), lses.double().cpu()
    w = torch.exp(l64 - l64.amax(0).nan_to_num(neginf=0.0))
    ref = torch.nan_to_num(o64, nan=0.0) * (w / w.sum(0).clamp_min(1e-300)).unsqueeze(-1)
    ref = ref.sum(0)
    total = torch.logsumexp(l64, 0)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-6, rtol=2e-6)
    assert torch.equal(torch.isinf(lse.cpu()), torch.isinf(total))
    fin = torch.isfinite(total)
    torch.testing.assert_close(lse.double().cpu()[fin], total[fin], atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_torch_form_is_attention_over_the_union(dtype):
    outs, lses = _partials(3, 4, 5, 24, dtype=dtype, device="cpu")
    out, lse = merge_partials(outs, lses)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    _check_against_union(out, lse, outs, lses)
    assert torch.equal(out[-1, -1], torch.zeros(24)) and lse[-1, -1] == float("-inf")


def test_triton_launch_equals_torch_form_in_the_interpreter():
    """The kernel itself (interpreter), D not a power of two, outs not contiguous, the
    output written into a bf16 ``out``."""
    outs, lses = _partials(2, 3, 4, 40, dtype=torch.float32, device="cpu", seed=3)
    outs = outs.transpose(1, 2).contiguous().transpose(1, 2)  # [R, N, H, D], H before N
    ref, ref_lse = merge_partials(outs, lses)
    got, got_lse = lse_merge._merge_triton(outs, lses, None)
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)
    assert torch.equal(torch.isinf(got_lse), torch.isinf(ref_lse))
    torch.testing.assert_close(got_lse[torch.isfinite(ref_lse)],
                               ref_lse[torch.isfinite(ref_lse)])
    into = torch.full((3, 4, 40), float("nan"), dtype=torch.bfloat16)
    res, _ = lse_merge._merge_triton(outs, lses, into)
    assert res is into
    torch.testing.assert_close(into.float(), ref, atol=1e-2, rtol=1e-2)


def test_bad_arguments_name_themselves():
    outs, lses = _partials(2, 3, 4, 8, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="outs must be"):
        merge_partials(outs[0], lses)
    with pytest.raises(ValueError, match="floating point"):
        merge_partials(outs.to(torch.int32), lses)
    with pytest.raises(ValueError, match="out must be"):
        merge_partials(outs, lses, out=torch.empty(3, 4, 9))


@gpu
@pytest.mark.parametrize("r,d", [(2, 128), (4, 512), (3, 72)])
def test_gpu_launch_is_attention_over_the_union(r, d):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    outs, lses = _partials(r, 33, 8, d, dtype=torch.bfloat16, device="cuda", seed=r)
    out, lse = merge_partials(outs, lses)
    _check_against_union(out, lse, outs.float(), lses)
