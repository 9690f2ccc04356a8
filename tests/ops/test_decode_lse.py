"""The paged decode's log-sum-exp output (``return_lse``): the one-partition launch, the
split launch with the fused and the two-launch combine, speculative tokens, empty rows,
and the rule that an LSE call never runs native; all against reference.py.

The LSE is what decode context parallelism merges the ranks' outputs by, so it is
checked for what the merge needs: ``ln sum_j exp(s_j)`` in natural units, ``-inf`` for a
row that sees no key.
"""

import math

import pytest
import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops.decode import (allocate_decode_workspace, paged_decode_attention,
                                           plan_paged_decode, tuning)
from tests.ops.test_decode_combine import _check, _problem

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")


def _lse_direct(q, k, v, table, lens, scale, sinks=None):
    """ln sum_j exp(q.k_j * scale) computed here from the gathered keys (fp64): an oracle
    for the LSE that does not go through reference.py's softmax."""
    q4 = q.unsqueeze(1) if q.dim() == 3 else q
    S, T, Hq, D = q4.shape
    hkv = k.shape[1]
    out = torch.full((S, T, Hq), float("-inf"), dtype=torch.float64)
    for s in range(S):
        n = int(lens[s])
        if n <= 0:
            continue
        keys = reference.gather_kv(k, table[s], 0, n, dtype=torch.float64).cpu()
        keys = keys.repeat_interleave(Hq // hkv, dim=1)  # [n, Hq, D]
        logits = torch.einsum("thd,nhd->thn", q4[s].double().cpu(), keys) * scale
        pos = torch.arange(n)
        for t in range(T):
            visible = pos <= n - T + t
            row = logits[t][:, visible]
            if sinks is not None:
                row = torch.cat([row, sinks.double().cpu()[:, None]], dim=1)
            out[s, t] = torch.logsumexp(row, dim=1)
    return out.squeeze(1) if q.dim() == 3 else out


CASES = [  # (hkv, group, head_dim, page, seq_lens, num_tokens, partition, fused)
    (1, 4, 32, 16, [37, 1, 70], 1, None, None),        # one partition
    (2, 3, 32, 16, [70, 45], 1, 32, True),             # split, fused merge; G=3
    (2, 2, 32, 8, [70, 3, 64], 1, 32, False),          # split, two-launch combine
    (1, 2, 32, 16, [40, 33], 3, None, None),           # speculative tokens, one partition
    (1, 2, 32, 16, [70, 50], 2, 32, True),             # speculative tokens, split
]


@pytest.mark.parametrize("case", CASES)
def test_lse_matches_reference_and_direct_logsumexp(case):
    hkv, group, head_dim, page, seq_lens, num_tokens, partition, fused = case
    torch.manual_seed(0)
    q, k, v, table, lens, _ = _problem(hkv=hkv, group=group, head_dim=head_dim, page=page,
                                       seq_lens=seq_lens, num_tokens=num_tokens,
                                       dtype=torch.float16, device=DEV)
    options = dict(partition_size=partition, fused_combine=fused)
    plan = plan_paged_decode(table, lens, num_q_heads=hkv * group, num_kv_heads=hkv,
                             head_dim=head_dim, page_size=page, q_dtype=q.dtype,
                             kv_dtype=k.dtype, num_tokens=num_tokens, return_lse=True,
                             impl="triton", **options)
    assert plan.split == (partition is not None)
    out, lse = paged_decode_attention(q, k, v, table, lens, plan=plan, return_lse=True)
    want_lse = reference.paged_decode_attention(q, k, v, table, lens, return_lse=True)[1]
    assert lse.dtype == torch.float32 and lse.shape == q.shape[:-1]
    _check(out, q, k, v, table, lens)
    torch.testing.assert_close(lse.cpu(), want_lse.cpu(), atol=2e-3, rtol=1e-4)
    direct = _lse_direct(q, k, v, table, lens, head_dim ** -0.5)
    torch.testing.assert_close(lse.double().cpu(), direct, atol=2e-3, rtol=1e-4)


def test_lse_without_plan_and_into_a_given_buffer():
    torch.manual_seed(1)
    q, k, v, table, lens, _ = _problem(hkv=1, group=2, head_dim=32, page=16,
                                       seq_lens=[20, 9], num_tokens=1, dtype=torch.float16,
                                       device=DEV)
    out, lse = paged_decode_attention(q, k, v, table, lens, return_lse=True)
    want = reference.paged_decode_attention(q, k, v, table, lens, return_lse=True)[1]
    torch.testing.assert_close(lse.cpu(), want.cpu(), atol=2e-3, rtol=1e-4)
    # a strided buffer (a column slice of a wider one) is written in place
    plan = plan_paged_decode(table, lens, num_q_heads=2, num_kv_heads=1, head_dim=32,
                             page_size=16, q_dtype=q.dtype, kv_dtype=k.dtype, return_lse=True)
    wide = torch.zeros(2, 5, dtype=torch.float32, device=DEV)
    _, got = plan.run(q, k, v, lse=wide[:, 1:3])
    assert got.data_ptr() == wide[:, 1:3].data_ptr()
    torch.testing.assert_close(wide[:, 1:3].cpu(), want.cpu(), atol=2e-3, rtol=1e-4)
    assert bool((wide[:, 0] == 0).all()) and bool((wide[:, 3:] == 0).all())


def test_rows_without_keys_get_minus_infinity_and_zeros():
    torch.manual_seed(2)
    q, k, v, table, lens, _ = _problem(hkv=1, group=2, head_dim=32, page=16,
                                       seq_lens=[20, 9, 5], num_tokens=1, dtype=torch.float16,
                                       device=DEV)
    lens[1] = 0
    lens[2] = -3
    for impl in ("triton", "reference"):
        out, lse = paged_decode_attention(q, k, v, table, lens, return_lse=True,
                                          partition_size=16, impl=impl)
        assert bool(torch.isneginf(lse[1:]).all()), (impl, lse)
        assert bool((out[1:] == 0).all()), impl
        assert bool(torch.isfinite(lse[0]).all()), impl


def test_lse_with_sinks_counts_the_sink():
    torch.manual_seed(3)
    q, k, v, table, lens, options = _problem(hkv=1, group=2, head_dim=32, page=16,
                                             seq_lens=[30, 12], num_tokens=1,
                                             dtype=torch.float16, device=DEV, sinks=True)
    _, lse = paged_decode_attention(q, k, v, table, lens, return_lse=True, **options)
    direct = _lse_direct(q, k, v, table, lens, 32 ** -0.5, sinks=options["sinks"])
    torch.testing.assert_close(lse.double().cpu(), direct, atol=2e-3, rtol=1e-4)


def test_an_lse_call_never_runs_native():
    assert tuning.native_lacks(tree=False, lse=True) is not None
    assert tuning.native_lacks(tree=False, lse=False) is None
    if not HAS_CUDA:
        pytest.skip("the native decode needs a GPU")
    table = torch.zeros(64, 64, dtype=torch.int32, device=DEV)
    lens = torch.full((64,), 1024, dtype=torch.int32, device=DEV)
    base = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16)
    assert plan_paged_decode(table, lens, return_lse=True, **base).impl == "triton"
    with pytest.raises(ValueError, match="LSE"):
        plan_paged_decode(table, lens, return_lse=True, impl="native", **base)


def test_lse_buffer_and_flag_are_checked():
    q, k, v, table, lens, _ = _problem(hkv=1, group=2, head_dim=32, page=16, seq_lens=[5],
                                       num_tokens=1, dtype=torch.float16, device=DEV)
    plan = plan_paged_decode(table, lens, num_q_heads=2, num_kv_heads=1, head_dim=32,
                             page_size=16, q_dtype=q.dtype, kv_dtype=k.dtype)
    with pytest.raises(ValueError, match="return_lse"):
        paged_decode_attention(q, k, v, table, lens, plan=plan, return_lse=True)
    with pytest.raises(ValueError, match="return_lse"):
        plan.run(q, k, v, lse=torch.empty(1, 2, device=DEV))
    lse_plan = plan_paged_decode(table, lens, num_q_heads=2, num_kv_heads=1, head_dim=32,
                                 page_size=16, q_dtype=q.dtype, kv_dtype=k.dtype,
                                 return_lse=True)
    with pytest.raises(ValueError, match=r"lse must be float32 \[1, 2\]"):
        lse_plan.run(q, k, v, lse=torch.empty(1, 2, dtype=torch.float16, device=DEV))
    with pytest.raises(ValueError, match=r"lse must be float32 \[1, 2\]"):
        lse_plan.run(q, k, v, lse=torch.empty(2, 2, device=DEV))


def test_workspace_graph_path_returns_lse():
    """A planned split launch with a preallocated workspace (what an engine's graph runs)."""
    torch.manual_seed(4)
    q, k, v, table, lens, _ = _problem(hkv=1, group=4, head_dim=32, page=16,
                                       seq_lens=[64, 17], num_tokens=1, dtype=torch.float16,
                                       device=DEV)
    ws = allocate_decode_workspace(max_num_seqs=2, num_q_heads=4, num_kv_heads=1,
                                   head_dim=32, max_context_len=table.shape[1] * 16, device=DEV,
                                   partition_size=16)
    plan = plan_paged_decode(table, lens, num_q_heads=4, num_kv_heads=1, head_dim=32,
                             page_size=16, q_dtype=q.dtype, kv_dtype=k.dtype,
                             partition_size=16, workspace=ws, return_lse=True, impl="triton",
                             fused_combine=True)
    assert plan.split and plan.fused_combine
    _, lse = plan.run(q, k, v)
    want = reference.paged_decode_attention(q, k, v, table, lens, return_lse=True)[1]
    torch.testing.assert_close(lse.cpu(), want.cpu(), atol=2e-3, rtol=1e-4)
    assert math.isfinite(float(lse.min()))
