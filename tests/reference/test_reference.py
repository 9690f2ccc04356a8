"""The oracle itself, checked against dense attention written out directly.

Everything else is tested against ``reference.py``, so its paging, masking and merge
rules are pinned here with the smallest independent formulation: a dense per-request
softmax over explicitly gathered keys.
"""

import math

import pytest
import torch

from hygon_attn_backend import layouts, reference

torch.set_grad_enabled(False)


def dense_attention(q, k, v, *, causal, scale=None):
    """q [Lq, Hq, D], k/v [Lk, Hkv, D] float64, mask j <= i + (Lk - Lq)."""
    lq, hq, d = q.shape
    lk, hkv, _ = k.shape
    scale = scale or 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    for h in range(hq):
        kh, vh = k[:, h // (hq // hkv)], v[:, h // (hq // hkv)]
        for i in range(lq):
            s = (kh @ q[i, h]) * scale
            if causal:
                s[i + (lk - lq) + 1:] = float("-inf")
            out[i, h] = torch.softmax(s, dim=0) @ vh
    return out


def make_paged(ks, vs, page_size, num_blocks, gen):
    """Scatter per-request dense [L, H, D] K and V into bhsd caches (random elsewhere)
    through one random block table. Returns (k_cache, v_cache, table)."""
    max_blocks = max(math.ceil(x.shape[0] / page_size) for x in ks)
    perm = torch.randperm(num_blocks, generator=gen)
    table = perm[: len(ks) * max_blocks].view(len(ks), max_blocks).to(torch.int32)
    h, d = ks[0].shape[1:]
    caches = []
    for dense in (ks, vs):
        cache = torch.randn(num_blocks, h, page_size, d, dtype=torch.float64, generator=gen)
        for b, x in enumerate(dense):
            for t in range(x.shape[0]):
                cache[table[b, t // page_size], :, t % page_size] = x[t]
        caches.append(cache)
    return caches[0], caches[1], table


def test_mask_worked_example():
    mask = reference.causal_mask(3, 7).int()
    expected = torch.tensor([[1, 1, 1, 1, 1, 0, 0],
                             [1, 1, 1, 1, 1, 1, 0],
                             [1, 1, 1, 1, 1, 1, 1]])
    assert torch.equal(mask, expected)


def test_mask_sliding_window():
    mask = reference.causal_mask(2, 5, sliding_window=2).int()
    assert torch.equal(mask, torch.tensor([[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]))


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("group", [1, 5])
@pytest.mark.parametrize("with_new", [False, True])
def test_prefill_matches_dense(page_size, group, with_new):
    gen = torch.Generator().manual_seed(page_size * 10 + group)
    hkv, d = 2, 8
    hq = hkv * group
    lens_q, lens_k = [2, 5, 1, 4], [6, 5, 9, 4]
    ks = [torch.randn(n, hkv, d, dtype=torch.float64, generator=gen) for n in lens_k]
    vs = [torch.randn(n, hkv, d, dtype=torch.float64, generator=gen) for n in lens_k]
    k_cache, v_cache, table = make_paged(ks, vs, page_size, 64, gen)
    q = torch.randn(sum(lens_q), hq, d, dtype=torch.float64, generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    seq_k = torch.tensor(lens_k, dtype=torch.int32)
    kw = {}
    if with_new:
        kw = dict(k_new=torch.cat([x[-n:] for x, n in zip(ks, lens_q)]),
                  v_new=torch.cat([x[-n:] for x, n in zip(vs, lens_q)]))
        # the cache's copy of the new tokens is garbage: only k_new/v_new may be read
        for b, n in enumerate(lens_q):
            for t in range(lens_k[b] - n, lens_k[b]):
                k_cache[table[b, t // page_size], :, t % page_size] = 1e6
    out, lse = reference.prefix_prefill_attention(q, k_cache, v_cache, table, cu, seq_k,
                                                  return_lse=True,
                                                  compute_dtype=torch.float64, **kw)
    for b in range(len(lens_q)):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        want = dense_attention(q[rows], ks[b], vs[b], causal=True)
        torch.testing.assert_close(out[rows], want, rtol=1e-10, atol=1e-10)
    assert torch.isfinite(lse).all()


def test_prefill_non_causal_and_lse():
    gen = torch.Generator().manual_seed(7)
    k = torch.randn(5, 1, 4, dtype=torch.float64, generator=gen)
    v = torch.randn(5, 1, 4, dtype=torch.float64, generator=gen)
    cache_k, cache_v, table = make_paged([k], [v], 2, 8, gen)
    q = torch.randn(3, 2, 4, dtype=torch.float64, generator=gen)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    out, lse = reference.prefix_prefill_attention(q, cache_k, cache_v, table, cu,
                                                  torch.tensor([5], dtype=torch.int32),
                                                  causal=False, return_lse=True,
                                                  compute_dtype=torch.float64)
    torch.testing.assert_close(out, dense_attention(q, k, v, causal=False))
    s = torch.einsum("qhd,kd->qhk", q, k[:, 0]) / 2.0
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, dim=-1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 3])
def test_decode_matches_dense(tokens):
    gen = torch.Generator().manual_seed(tokens)
    hkv, group, d, page = 2, 4, 16, 4
    lens = [1, 7, 12, 4]
    ks = [torch.randn(n, hkv, d, dtype=torch.float64, generator=gen) for n in lens]
    vs = [torch.randn(n, hkv, d, dtype=torch.float64, generator=gen) for n in lens]
    k_cache, v_cache, table = make_paged(ks, vs, page, 32, gen)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    if tokens == 1:
        q = torch.randn(len(lens), hkv * group, d, dtype=torch.float64, generator=gen)
    else:
        q = torch.randn(len(lens), tokens, hkv * group, d, dtype=torch.float64, generator=gen)
    out = reference.paged_decode_attention(q, k_cache, v_cache, table, lens_t,
                                           compute_dtype=torch.float64)
    for b, n in enumerate(lens):
        qb = q[b].unsqueeze(0) if tokens == 1 else q[b]
        if tokens > n:
            continue
        want = dense_attention(qb, ks[b], vs[b], causal=True)
        got = out[b].unsqueeze(0) if tokens == 1 else out[b]
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_decode_zero_length_gives_zeros():
    k_cache = torch.randn(4, 1, 2, 8, dtype=torch.float64)
    q = torch.randn(2, 2, 8, dtype=torch.float64)
    out = reference.paged_decode_attention(q, k_cache, k_cache.clone(),
                                           torch.zeros(2, 1, dtype=torch.int32),
                                           torch.tensor([0, 2], dtype=torch.int32))
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    assert out[1].abs().sum() > 0


def test_split_x_key_cache_reads_like_canonical():
    gen = torch.Generator().manual_seed(3)
    canon = torch.randn(6, 2, 4, 16, generator=gen).half()
    split = layouts.convert(canon, "split_x")
    assert split.shape == (6, 2, 2, 4, 8)
    table = torch.tensor([[5, 0, 3]], dtype=torch.int32)
    got = reference.gather_kv(split, table[0], 0, 10)
    want = reference.gather_kv(canon, table[0], 0, 10)
    assert torch.equal(got, want)


@pytest.mark.parametrize("log2", [False, True])
def test_combine_partitions_equals_full_softmax(log2):
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 40, dtype=torch.float64, generator=gen) * 4
    vals = torch.randn(40, 8, dtype=torch.float64, generator=gen)
    full = torch.softmax(logits, dim=-1) @ vals
    bounds = [0, 7, 16, 16, 40]  # an empty partition in the middle
    ms, ls, outs = [], [], []
    for a, b in zip(bounds[:-1], bounds[1:]):
        part = logits[:, a:b]
        if b == a:
            ms.append(torch.full((3,), float("-inf"), dtype=torch.float64))
            ls.append(torch.zeros(3, dtype=torch.float64))
            outs.append(torch.full((3, 8), float("nan"), dtype=torch.float64))
            continue
        m = part.amax(-1)
        p = torch.exp(part - m[:, None])
        ms.append(m / math.log(2) if log2 else m)
        ls.append(p.sum(-1))
        outs.append((p @ vals[a:b]) / p.sum(-1, keepdim=True))
    got = reference.combine_partitions(torch.stack(ms, -1), torch.stack(ls, -1),
                                       torch.stack(outs, -2), log2_domain=log2)
    torch.testing.assert_close(got, full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", reference.FP8_DTYPES)
def test_fp8_roundtrip_and_saturation(dtype):
    x = torch.linspace(-3, 3, 101, dtype=torch.float32)
    q = reference.quantize_fp8(x, dtype, 0.05)
    back = reference.dequantize_fp8(q, 0.05)
    rel = 2.0 ** -(3 if dtype == torch.float8_e4m3fn else 2)
    assert ((back - x).abs() <= rel * x.abs() + 1e-6).all()
    big = reference.quantize_fp8(torch.tensor([1e9, -1e9]), dtype, 1.0).float()
    assert torch.isfinite(big).all() and big[0] == torch.finfo(dtype).max


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "bhds", "split_x"])
def test_write_kv_and_copy_blocks(layout):
    gen = torch.Generator().manual_seed(5)
    kw = dict(num_blocks=6, block_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float16)
    ks = layouts.allocate(layout, **kw)
    vs = layouts.allocate("bhds" if layout == "split_x" else layout, **kw)
    kv = layouts.view(ks, layout) if layout != "split_x" else ks
    vv = layouts.view(vs, "bhds" if layout == "split_x" else layout)
    before_k = reference.as_canonical_view(kv).clone()
    k = torch.randn(3, 2, 16, generator=gen).half()
    v = torch.randn(3, 2, 16, generator=gen).half()
    slots = torch.tensor([5, -1, 22])
    reference.write_kv(k, v, kv, vv, slots)
    after_k = reference.as_canonical_view(kv)
    assert torch.equal(after_k[1, :, 1], k[0]) and torch.equal(after_k[5, :, 2], k[2])
    assert torch.equal(vv[1, :, 1], v[0]) and torch.equal(vv[5, :, 2], v[2])
    changed = (after_k != before_k).any(dim=(1, 3))
    assert int(changed.sum()) == 2  # only the two real slots moved; -1 wrote nothing
    reference.copy_blocks(ks, vs, torch.tensor([[1, 0], [5, 3]]))
    after = reference.as_canonical_view(kv)
    assert torch.equal(after[0], after[1]) and torch.equal(after[3], after[5])
    assert torch.equal(vv[0], vv[1])
