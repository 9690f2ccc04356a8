"""Retrieval at long context through the fp8 and 16-bit decode paths.

One key is planted at a random depth of each sequence and every query head of its KV head
is built to find it: the query is a random direction ``u`` scaled so that the other keys'
logits spread as N(0, 1), the planted key is ``c * u`` with ``c`` chosen so that it takes
about half of the softmax mass (the rest still counts), and its value is a fixed pattern
``v*``. Each path is checked against the float64 reference of its own cache (the kernel's
error, not the quantization's): the fp8 error stays within 2x the 16-bit path's, and the
planted key still wins (the output's weight on ``v*`` is far above any other key's and
matches the reference's). Long contexts run split-KV (the heuristic splits them; the CPU
case forces partitions).
"""

import math

import pytest
import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops.decode import paged_decode_attention
from tests.support.budget import assert_within_budget

HAS_CUDA = torch.cuda.is_available()
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
PLANTED_MASS = 0.5  # softmax weight the planted key is built to take
ERR_RATIO = 2.0     # fp8 error over the 16-bit path's, at most
ERR_FLOOR = 1e-4    # absolute slack of that ratio (both errors can be ~1e-5)


def _planted_problem(seq_lens, *, num_kv_heads, group, head_dim, page_size, dtype, device,
                     seed):
    """``(q, k, v, table, lens, depths, v_star)``: random caches ``[N, Hkv, P, D]`` (float32)
    with one key planted per sequence and KV head at ``depths[s]``."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    d, hkv = head_dim, num_kv_heads
    scale = d ** -0.5
    pages = [-(-n // page_size) for n in seq_lens]
    nb = sum(pages) + 1
    k = torch.randn(nb, hkv, page_size, d, generator=gen)
    v = torch.randn(nb, hkv, page_size, d, generator=gen)
    perm = torch.randperm(nb, generator=gen)
    table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    used = 0
    for s, n in enumerate(pages):
        table[s, :n] = perm[used:used + n].to(torch.int32)
        used += n
    u = torch.randn(len(seq_lens), hkv, d, generator=gen)
    u = u / u.norm(dim=-1, keepdim=True)
    # other keys' logits scale * q.k ~ N(0, 1): |q| = 1 / scale
    q = (u / scale).repeat_interleave(group, dim=1)  # [S, Hq, D]
    q = q + 0.05 * torch.randn(q.shape, generator=gen)  # the heads differ a little
    v_star = torch.where(torch.arange(d) % 2 == 0, 3.0, -3.0)
    depths = []
    for s, n in enumerate(seq_lens):
        j = int(torch.randint(0, n, (1,), generator=gen))
        depths.append(j)
        c = math.log(PLANTED_MASS / (1 - PLANTED_MASS) * n * math.exp(0.5))
        blk, slot = int(table[s, j // page_size]), j % page_size
        k[blk, :, slot] = c * u[s]
        v[blk, :, slot] = v_star
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    return (q.to(dtype).to(device), k.to(device), v.to(device), table.to(device),
            lens.to(device), depths, v_star.to(device))


def _caches(k, v, kv_dtype, q_dtype):
    """The caches in ``kv_dtype`` (fp8 with per-tensor scales amax / format max)."""
    if kv_dtype not in FP8:
        return k.to(q_dtype), v.to(q_dtype), {}
    fmax = torch.finfo(kv_dtype).max
    ks, vs = float(k.abs().amax()) / fmax, float(v.abs().amax()) / fmax
    return (reference.quantize_fp8(k, kv_dtype, ks), reference.quantize_fp8(v, kv_dtype, vs),
            dict(k_scale=ks, v_scale=vs))


def _retrieve(prob, kv_dtype, impl="triton", **op_kw):
    """``(out, ref64, ref_lowp, err)`` of one path on the planted problem."""
    q, k, v, table, lens, _, _ = prob
    kc, vc, scales = _caches(k, v, kv_dtype, q.dtype)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(q, kc, vc, table, lens, out=out, impl=impl, **scales, **op_kw)
    ref64 = reference.paged_decode_attention(
        q.double(), kc, vc, table, lens, out=torch.empty(q.shape, dtype=torch.float64,
                                                         device=q.device), **scales)
    ref_lowp = reference.paged_decode_attention(q, kc, vc, table, lens,
                                                compute_dtype=q.dtype, **scales)
    err = (out.double() - ref64).abs().max().item()
    return out, ref64, ref_lowp, err


def _planted_weight(x, v_star):
    """``[S, Hq]`` weight of ``v_star`` in outputs ``x`` (the other values average ~0)."""
    return (x.double() @ v_star.double()) / float(v_star.double() @ v_star.double())


def check_retrieval(seq_lens, *, q_dtype, device, seed, partition_size=None, impl="triton",
                    **kw):
    prob = _planted_problem(seq_lens, dtype=q_dtype, device=device, seed=seed, **kw)
    v_star = prob[-1]
    op_kw = dict(partition_size=partition_size, impl=impl)
    base_out, base_ref, _, base_err = _retrieve(prob, q_dtype, **op_kw)
    assert bool((_planted_weight(base_out, v_star) > 0.5 * PLANTED_MASS).all())
    for kv_dtype in FP8:
        out, ref64, ref_lowp, err = _retrieve(prob, kv_dtype, **op_kw)
        assert_within_budget(out, ref64, ref_lowp, what=f"{kv_dtype} retrieval")
        assert err <= ERR_RATIO * base_err + ERR_FLOOR, \
            f"{kv_dtype}: error {err:.3g} against the 16-bit path's {base_err:.3g}"
        got, want = _planted_weight(out, v_star), _planted_weight(ref64, v_star)
        # the planted key takes ~PLANTED_MASS; any other key ~mass / n
        assert bool((got > 0.5 * PLANTED_MASS).all()), f"{kv_dtype}: planted key lost ({got})"
        assert torch.allclose(got, want, atol=0.02), f"{kv_dtype}: {got} vs {want}"


def test_retrieval_interpreter_split():
    """Tiny: 3 sequences up to 700 keys, forced 128-key partitions (split-KV and its
    combine), fp16 queries (the interpreter's bf16 dot is broken)."""
    check_retrieval([700, 333, 64], q_dtype=torch.float16, device=torch.device("cpu"),
                    seed=11, num_kv_heads=1, group=4, head_dim=64, page_size=16,
                    partition_size=128)


@pytest.mark.gpu
@pytest.mark.parametrize("impl", ["triton", "native"])
@pytest.mark.parametrize("seq_lens", [[32768, 131072], [65536]])
def test_gpu_retrieval_long_context(seq_lens, impl):
    """Both kernels, fp8 and bf16 caches, 32k-128k keys (native: the fp8 split-N loop)."""
    check_retrieval(seq_lens, q_dtype=torch.bfloat16, device=torch.device("cuda"), seed=5,
                    num_kv_heads=8, group=4, head_dim=128, page_size=16, impl=impl)
