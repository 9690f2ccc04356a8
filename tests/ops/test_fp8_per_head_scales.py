"""fp8 caches with one scale per KV head (vLLM's ``attn_head`` KV-cache scheme): write_kv,
the paged decode and the prefix prefill against reference.py, Triton (the interpreter on
CPU) and, on a GPU, the native kernels (test_native_per_head_scales calls the cases with
``impl="native"``).

The heads are given magnitudes 2^10 apart and each its own scale, so a kernel that reads
one scale for every head (or the wrong head's) saturates or flushes most codes of some
head: the per-tensor answer is checked to be far outside the budget first.
"""

import pytest
import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops.cache import write_kv
from hygon_attn_backend.ops.decode import paged_decode_attention
from hygon_attn_backend.ops.prefill import prefix_prefill_attention
from tests.ops.test_decode import make_table
from hygon_attn_backend.tools.fuzz.budget import budget_error
from tests.support.budget import assert_within_budget

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
HKV, G, D, P = 3, 2, 64, 16
MAGNITUDES = (2.0 ** -6, 1.0, 2.0 ** 4)  # per KV head


def _per_head(x):  # [..., HKV, D] scaled per head
    return x * torch.tensor(MAGNITUDES, device=x.device).view(-1, 1)


def _scales(kv_dtype):
    fmax = torch.finfo(kv_dtype).max
    ks = torch.tensor([4 * m / fmax for m in MAGNITUDES], device=DEV)
    vs = torch.tensor([3 * m / fmax for m in MAGNITUDES], device=DEV)
    return ks, vs


def _caches(kv_dtype, num_blocks):
    k = _per_head(torch.randn(num_blocks, P, HKV, D, device=DEV)).transpose(1, 2)
    v = _per_head(torch.randn(num_blocks, P, HKV, D, device=DEV)).transpose(1, 2)
    ks, vs = _scales(kv_dtype)
    k8 = reference.quantize_fp8(k.transpose(1, 2), kv_dtype, ks).transpose(1, 2)
    v8 = reference.quantize_fp8(v.transpose(1, 2), kv_dtype, vs).transpose(1, 2)
    return k8, v8, ks, vs


@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
def test_reference_per_head_is_each_head_per_tensor(kv_dtype):
    x = _per_head(torch.randn(5, HKV, D, device=DEV))
    ks, _ = _scales(kv_dtype)
    codes = reference.quantize_fp8(x, kv_dtype, ks)
    for h in range(HKV):
        want = reference.quantize_fp8(x[:, h], kv_dtype, float(ks[h]))
        assert torch.equal(codes[:, h].view(torch.uint8), want.view(torch.uint8))
    back = reference.dequantize_fp8(codes, ks)
    assert torch.equal(back[:, 1], reference.dequantize_fp8(codes[:, 1], float(ks[1])))


@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
def test_write_kv_per_head_scales_bit_exact(kv_dtype, impl="triton"):
    t, nb = 21, 4
    k = _per_head(torch.randn(t, HKV, D, device=DEV)).half()
    v = _per_head(torch.randn(t, HKV, D, device=DEV)).half()
    ks, vs = _scales(kv_dtype)
    slots = torch.randperm(nb * P, device=DEV)[:t].to(torch.int32)
    slots[3] = -1
    got = [torch.zeros(nb, HKV, P, D, device=DEV, dtype=kv_dtype) for _ in range(2)]
    want = [c.clone() for c in got]
    write_kv(k, v, *got, slots, k_scale=ks, v_scale=vs, impl=impl)
    reference.write_kv(k, v, *want, slots, k_scale=ks, v_scale=vs)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8), w.view(torch.uint8))
    # one scale for every head gives other codes (the check above can fail)
    one = [c.clone() for c in want]
    reference.write_kv(k, v, *one, slots, k_scale=ks.max().reshape(1), v_scale=vs.max().reshape(1))
    assert not torch.equal(one[0].view(torch.uint8), want[0].view(torch.uint8))


@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
def test_decode_per_head_scales(kv_dtype, impl="triton"):
    seq_lens = [70, 33, 5]
    nb = sum(-(-n // P) for n in seq_lens) + 2
    k8, v8, ks, vs = _caches(kv_dtype, nb)
    table = make_table(seq_lens, P, nb, DEV)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    q_dtype = torch.bfloat16 if HAS_CUDA else torch.float16
    q = torch.randn(len(seq_lens), HKV * G, D, device=DEV).to(q_dtype)
    out = paged_decode_attention(q, k8, v8, table, lens, k_scale=ks, v_scale=vs,
                                 partition_size=32, impl=impl)
    args = (k8, v8, table, lens)
    ref64 = reference.paged_decode_attention(
        q.double(), *args, k_scale=ks, v_scale=vs,
        out=torch.empty(q.shape, dtype=torch.float64, device=DEV))
    lowp = reference.paged_decode_attention(q, *args, k_scale=ks, v_scale=vs,
                                            compute_dtype=q.dtype)
    # the per-tensor reading of the same codes is far off
    one = reference.paged_decode_attention(q.double(), *args, k_scale=ks.max().reshape(1),
                                           v_scale=vs.max().reshape(1),
                                           out=torch.empty(q.shape, dtype=torch.float64,
                                                           device=DEV))
    assert budget_error(one, ref64, lowp)[2] is not None
    assert_within_budget(out, ref64, lowp)


@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
def test_prefill_per_head_scales(kv_dtype, impl="triton"):
    prefix, new = [40, 0, 17], [9, 20, 1]
    total = [a + b for a, b in zip(prefix, new)]
    nb = sum(-(-n // P) for n in total) + 2
    d = 128 if impl == "native" else D  # the native prefill takes head_dim 128
    k = _per_head(torch.randn(nb, P, HKV, d, device=DEV)).transpose(1, 2)
    v = _per_head(torch.randn(nb, P, HKV, d, device=DEV)).transpose(1, 2)
    ks, vs = _scales(kv_dtype)
    k8 = reference.quantize_fp8(k.transpose(1, 2), kv_dtype, ks).transpose(1, 2)
    v8 = reference.quantize_fp8(v.transpose(1, 2), kv_dtype, vs).transpose(1, 2)
    table = make_table(total, P, nb, DEV)
    q_dtype = torch.bfloat16 if HAS_CUDA else torch.float16
    q = torch.randn(sum(new), HKV * G, d, device=DEV).to(q_dtype)
    cu_q = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32,
                        device=DEV)
    lens_k = torch.tensor(total, dtype=torch.int32, device=DEV)
    out = prefix_prefill_attention(q, k8, v8, table, cu_q, lens_k, k_scale=ks, v_scale=vs,
                                   impl=impl)
    args = (k8, v8, table, cu_q, lens_k)
    ref64 = reference.prefix_prefill_attention(q.double(), *args, k_scale=ks, v_scale=vs,
                                               compute_dtype=torch.float64)
    lowp = reference.prefix_prefill_attention(q, *args, k_scale=ks, v_scale=vs,
                                              compute_dtype=q.dtype)
    assert_within_budget(out, ref64, lowp)


def test_scale_of_the_wrong_size_names_it():
    k8, v8, ks, vs = _caches(torch.float8_e4m3fn, 4)
    table = make_table([20], P, 4, DEV)
    lens = torch.tensor([20], dtype=torch.int32, device=DEV)
    q = torch.randn(1, HKV * G, D, device=DEV).half()
    with pytest.raises(ValueError, match=r"k_scale must be a float, a 1-element tensor or a "
                                         r"1-D tensor of num_kv_heads = 3 elements"):
        paged_decode_attention(q, k8, v8, table, lens, k_scale=ks[:2], v_scale=vs)
    with pytest.raises(ValueError, match="v_scale must be"):
        paged_decode_attention(q, k8, v8, table, lens, k_scale=ks, v_scale=vs.view(1, 3))
    k = torch.randn(2, HKV, D, device=DEV).half()
    with pytest.raises(ValueError, match="k_scale must be"):
        write_kv(k, k, k8, v8, torch.tensor([0, 1], device=DEV), k_scale=ks.repeat(2),
                 v_scale=vs)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8, ids=str)
def test_native_per_head_scales(kv_dtype):
    """The native write_kv, decode and (sm_90) prefill with per-head scales."""
    test_write_kv_per_head_scales_bit_exact(kv_dtype, "native")
    test_decode_per_head_scales(kv_dtype, "native")
    if torch.cuda.get_device_capability() == (9, 0):
        test_prefill_per_head_scales(kv_dtype, "native")
