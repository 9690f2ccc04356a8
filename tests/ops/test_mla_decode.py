"""MLA decode (ops/mla) and the latent cache write against reference.py.

CPU: the Triton kernels under the interpreter on tiny shapes, fp16 (bf16 ``tl.dot`` is
broken in the interpreter with some numpy / Triton pairs). GPU (``@pytest.mark.gpu``):
DeepSeek widths (512 + 64), bf16 and fp8. Oracle: the reference in float64; budget: a small
multiple of the reference's own error in the input dtype (tests/support/budget.py). The
reference itself is checked against a dense softmax written out here.
"""

import math

import pytest
import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops.cache import copy_blocks
from hygon_attn_backend.ops.mla import (allocate_mla_decode_workspace, mla_decode_attention,
                                        plan_mla_decode, plan_write_mla_cache, write_mla_cache)
from tests.support.budget import assert_within_budget

HAS_CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if HAS_CUDA else "cpu")
CPU_DTYPE = torch.float16
E4M3 = torch.float8_e4m3fn


def make_cache(num_blocks, page_size, width, dtype, device, kv_scale=0.5):
    """A random latent cache ``[num_blocks, P, W]`` (fp8: quantized with ``kv_scale``)."""
    x = torch.randn((num_blocks, page_size, width), device=device)
    if dtype in reference.FP8_DTYPES:
        return reference.quantize_fp8(x, dtype, kv_scale)
    return x.to(dtype)


def make_table(seq_lens, page_size, num_blocks, device, extra_cols=1):
    """Block table over a random permutation of the blocks; unused columns hold ids past
    the cache (reading them would be out of bounds)."""
    need = [max(1, -(-s // page_size)) for s in seq_lens]
    cols = max(need, default=1) + extra_cols
    perm = torch.randperm(num_blocks)
    table = torch.full((len(seq_lens), cols), num_blocks + 1000, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[used:used + n]
        used += n
    return table.to(device)


def make_batch(*, seq_lens, page_size, rank, rope, heads, tokens=1, dtype=CPU_DTYPE,
               kv_dtype=None, device=DEV, extra_blocks=2):
    nb = sum(max(1, -(-s // page_size)) for s in seq_lens) + extra_blocks
    kv = make_cache(nb, page_size, rank + rope, kv_dtype or dtype, device)
    table = make_table(seq_lens, page_size, nb, device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    shape = (len(seq_lens), heads, rank + rope) if tokens == 1 else \
        (len(seq_lens), tokens, heads, rank + rope)
    q = torch.randn(shape, device=device).to(dtype)
    return q, kv, table, lens


def check_against_reference(q, kv, table, lens, *, rank, out, lse=None, kv_scale=None,
                            scale=None, mult=4.0):
    ref64, lse64 = reference.mla_decode_attention(
        q, kv, table, lens, kv_lora_rank=rank, kv_scale=kv_scale, scale=scale,
        return_lse=True, compute_dtype=torch.float64)
    ref_lp, lse_lp = reference.mla_decode_attention(
        q, kv, table, lens, kv_lora_rank=rank, kv_scale=kv_scale, scale=scale,
        return_lse=True, compute_dtype=q.dtype)
    assert_within_budget(out, ref64, ref_lp, mult=mult)
    if lse is not None:
        none = torch.isinf(lse64)  # rows that see no key: -inf on both sides
        assert torch.equal(torch.isneginf(lse.cpu()), none.cpu()), "lse: -inf rows differ"
        assert_within_budget(lse[~none], lse64[~none].float(), lse_lp[~none], mult=mult,
                             floor=1e-3, what="lse")


def run_case(*, seq_lens, page_size, rank, rope, heads, tokens=1, num_partitions=None,
             kv_dtype=None, dtype=CPU_DTYPE, return_lse=False, tensor_scale=False,
             scale=None, tile=None, device=DEV, impl="triton"):
    q, kv, table, lens = make_batch(seq_lens=seq_lens, page_size=page_size, rank=rank,
                                    rope=rope, heads=heads, tokens=tokens, dtype=dtype,
                                    kv_dtype=kv_dtype, device=device)
    fp8 = kv.dtype in reference.FP8_DTYPES
    kv_scale = None
    if fp8:
        kv_scale = torch.tensor([0.5], device=device) if tensor_scale else 0.5
    plan = plan_mla_decode(block_table=table, seq_lens=lens, page_size=page_size,
                           num_q_heads=heads, kv_lora_rank=rank, rope_dim=rope, q_dtype=dtype,
                           kv_dtype=kv.dtype, num_tokens=tokens, scale=scale,
                           return_lse=return_lse, num_partitions=num_partitions, tile=tile,
                           impl=impl)
    out = torch.full(q.shape[:-1] + (rank,), float("nan"), dtype=dtype, device=device)
    lse = torch.full(q.shape[:-1], float("nan"), device=device) if return_lse else None
    res = plan.run(q, kv, out=out, lse=lse, kv_scale=kv_scale)
    if return_lse:
        assert res[0] is out and res[1] is lse
    else:
        assert res is out
    check_against_reference(q, kv, table, lens, rank=rank, out=out, lse=lse,
                            kv_scale=kv_scale, scale=scale)
    return plan


# ----------------------------------------------------------------------------- reference


def test_reference_is_a_dense_softmax_over_the_latent_rows():
    """The reference against attention written out on a dense copy of each sequence's
    rows: logits ``q . row * scale`` over the visible keys, values the first R columns."""
    rank, rope, heads, tokens, page = 8, 4, 3, 2, 4
    q, kv, table, lens = make_batch(seq_lens=[9, 1, 0], page_size=page, rank=rank, rope=rope,
                                    heads=heads, tokens=tokens, dtype=torch.float64,
                                    device=torch.device("cpu"))
    scale = 0.3
    out, lse = reference.mla_decode_attention(q, kv, table, lens, kv_lora_rank=rank,
                                              scale=scale, return_lse=True,
                                              compute_dtype=torch.float64)
    for s, length in enumerate(lens.tolist()):
        rows = torch.stack([kv[table[s, j // page], j % page] for j in range(length)]) \
            if length else torch.zeros((0, rank + rope), dtype=torch.float64)
        for t in range(tokens):
            last = length - tokens + t  # sees keys 0..last
            for h in range(heads):
                if last < 0:
                    assert torch.all(out[s, t, h] == 0) and lse[s, t, h] == float("-inf")
                    continue
                logits = rows[:last + 1] @ q[s, t, h] * scale
                w = torch.softmax(logits, 0)
                torch.testing.assert_close(out[s, t, h], w @ rows[:last + 1, :rank])
                torch.testing.assert_close(lse[s, t, h].double(),
                                           torch.logsumexp(logits, 0), rtol=1e-6, atol=1e-6)


# ----------------------------------------------------------------------------- CPU matrix

# (rank, rope, heads, page, seq_lens): 32+16 and 256+32 widths, pages 1 and 16, lengths
# mid-page, one key, exact pages, 0
CPU_CASES = [
    (32, 16, 16, 16, [37, 1, 32]),
    (32, 16, 8, 1, [23, 5]),
    (32, 0, 16, 16, [40, 0]),
    (256, 32, 16, 16, [19, 48]),
]


@pytest.mark.parametrize("num_partitions", [1, 3])
@pytest.mark.parametrize("tokens", [1, 2, 3])
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: f"R{c[0]}E{c[1]}H{c[2]}P{c[3]}")
def test_mla_decode_matrix(case, tokens, num_partitions):
    rank, rope, heads, page, lens = case
    torch.manual_seed(hash((case[0], case[1], case[3], tokens, num_partitions)) % 1000)
    plan = run_case(seq_lens=lens, page_size=page, rank=rank, rope=rope, heads=heads,
                    tokens=tokens, num_partitions=num_partitions)
    assert plan.impl == "triton" and plan.num_launches == (2 if num_partitions > 1 else 1)


@pytest.mark.parametrize("num_partitions", [1, 2])
@pytest.mark.parametrize("page", [1, 16])
def test_mla_decode_deepseek_width(page, num_partitions):
    """512 + 64, the DeepSeek row, with few tokens (the interpreter is slow)."""
    torch.manual_seed(page + num_partitions)
    run_case(seq_lens=[20, 7], page_size=page, rank=512, rope=64, heads=16, tokens=2,
             num_partitions=num_partitions, return_lse=True)


@pytest.mark.parametrize("tensor_scale", [False, True])
@pytest.mark.parametrize("num_partitions", [1, 3])
def test_mla_decode_fp8_cache(num_partitions, tensor_scale):
    torch.manual_seed(7)
    run_case(seq_lens=[45, 3], page_size=16, rank=32, rope=16, heads=16, kv_dtype=E4M3,
             num_partitions=num_partitions, tensor_scale=tensor_scale)


@pytest.mark.parametrize("num_partitions", [1, 3])
def test_mla_decode_lse(num_partitions):
    """LSE rows, a zero-length sequence (-inf, zeros) and rows with no key (seq_len < T)."""
    torch.manual_seed(3)
    run_case(seq_lens=[50, 0, 1], page_size=16, rank=32, rope=16, heads=8, tokens=3,
             num_partitions=num_partitions, return_lse=True, scale=0.2)


def test_mla_decode_block_m_smaller_than_the_rows():
    """A tile of 16 rows over 3 x 16 rows: several programs a request."""
    torch.manual_seed(5)
    run_case(seq_lens=[33, 17], page_size=16, rank=32, rope=16, heads=16, tokens=3,
             tile=(16, 16, 4, 1), num_partitions=2, return_lse=True)


def test_mla_decode_one_shot_and_default_scale():
    """The one-shot op: default scale ``1 / sqrt(W)``, strided views of the cache (an SGLang
    token pool ``[N * P, 1, W]`` viewed as pages, inside a wider buffer) and of q."""
    torch.manual_seed(11)
    rank, rope, page, heads = 32, 16, 4, 16
    lens = [13, 6]
    nb = 8
    buf = torch.randn((nb * page, 1, rank + rope + 8)).to(CPU_DTYPE).to(DEV)
    pool = buf[:, 0, :rank + rope].unflatten(0, (nb, page))  # [nb, P, W] strided view
    assert pool.stride() != pool.contiguous().stride()
    table = make_table(lens, page, nb, DEV)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
    qbuf = torch.randn((2, heads, 2 * (rank + rope))).to(CPU_DTYPE).to(DEV)
    q = qbuf[..., ::2]
    out, lse = mla_decode_attention(q, pool, table, seq_lens, kv_lora_rank=rank,
                                    return_lse=True, impl="triton")
    assert out.shape == (2, heads, rank) and out.dtype == CPU_DTYPE and lse.shape == (2, heads)
    check_against_reference(q, pool, table, seq_lens, rank=rank, out=out, lse=lse)
    ref = reference.mla_decode_attention(q, pool, table, seq_lens, kv_lora_rank=rank,
                                         scale=1 / math.sqrt(rank + rope),
                                         compute_dtype=torch.float64)
    assert (out.double() - ref).abs().max() < 1e-2


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_mla_decode_bounds(impl):
    """Lengths past the table, bad block ids (negative, past the cache) and seq_len 0: the
    same answer as the reference (absent keys masked), on every implementation."""
    torch.manual_seed(13)
    q, kv, table, lens = make_batch(seq_lens=[30, 20, 0, 9], page_size=8, rank=32, rope=16,
                                    heads=16)
    nb = kv.shape[0]
    table[0, 1] = -3          # a hole in the middle
    table[1, 2] = nb + 7      # an id past the cache
    lens[3] = 10_000          # far past the table's capacity
    for parts in (1, 3):
        plan = plan_mla_decode(block_table=table, seq_lens=lens, page_size=8, num_q_heads=16,
                               kv_lora_rank=32, rope_dim=16, q_dtype=CPU_DTYPE,
                               kv_dtype=kv.dtype, max_seq_len=40, num_partitions=parts,
                               return_lse=True, impl=impl)
        out, lse = plan.run(q, kv)
        check_against_reference(q, kv, table, lens, rank=32, out=out, lse=lse)
        assert torch.all(out[2] == 0) and torch.all(torch.isneginf(lse[2]))


def test_mla_decode_empty_batch_and_table():
    kv = make_cache(4, 16, 48, CPU_DTYPE, DEV)
    q = torch.randn((2, 16, 48)).to(CPU_DTYPE)
    table = torch.zeros((2, 0), dtype=torch.int32)
    lens = torch.tensor([5, 3], dtype=torch.int32)
    out, lse = mla_decode_attention(q, kv, table, lens, kv_lora_rank=32, return_lse=True,
                                    impl="triton")
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    empty = mla_decode_attention(q[:0], kv, table[:0], lens[:0], kv_lora_rank=32,
                                 impl="triton")
    assert empty.shape == (0, 16, 32)


def test_mla_decode_workspace_and_reuse():
    """A preallocated workspace serves the plan; a second run writes the same answer into
    the same tensors (nothing of the first call is left behind)."""
    torch.manual_seed(17)
    q, kv, table, lens = make_batch(seq_lens=[60, 33], page_size=16, rank=32, rope=16,
                                    heads=16)
    ws = allocate_mla_decode_workspace(max_num_seqs=4, num_q_heads=16, kv_lora_rank=32,
                                       max_context_len=64, device=DEV, num_slots=8)
    plan = plan_mla_decode(block_table=table, seq_lens=lens, page_size=16, num_q_heads=16,
                           kv_lora_rank=32, rope_dim=16, q_dtype=CPU_DTYPE,
                           kv_dtype=kv.dtype, num_partitions=4, workspace=ws, impl="triton")
    assert plan.workspace is ws
    out = torch.full((2, 16, 32), float("nan"), dtype=CPU_DTYPE)
    plan.run(q, kv, out=out)
    first = out.clone()
    out.fill_(float("nan"))
    plan.run(q, kv, out=out)
    assert torch.equal(out, first)
    check_against_reference(q, kv, table, lens, rank=32, out=out)
    with pytest.raises(ValueError, match="workspace too small"):
        plan_mla_decode(block_table=table, seq_lens=lens, page_size=16, num_q_heads=16,
                        kv_lora_rank=32, rope_dim=16, q_dtype=CPU_DTYPE, kv_dtype=kv.dtype,
                        num_partitions=8, workspace=ws, impl="triton")


def test_mla_decode_float32_queries_run_the_reference():
    q, kv, table, lens = make_batch(seq_lens=[9], page_size=4, rank=16, rope=0, heads=2,
                                    dtype=torch.float32)
    plan = plan_mla_decode(block_table=table, seq_lens=lens, page_size=4, num_q_heads=2,
                           kv_lora_rank=16, rope_dim=0, q_dtype=torch.float32,
                           kv_dtype=torch.float32)
    assert plan.impl == "reference"
    with pytest.raises(ValueError, match="float16/bfloat16"):
        plan_mla_decode(block_table=table, seq_lens=lens, page_size=4, num_q_heads=2,
                        kv_lora_rank=16, rope_dim=0, q_dtype=torch.float32,
                        kv_dtype=torch.float32, impl="triton")


# ----------------------------------------------------------------------------- bad input


def _plan_kw(**over):
    table = torch.zeros((2, 3), dtype=torch.int32, device=DEV)
    lens = torch.tensor([5, 3], dtype=torch.int32, device=DEV)
    kw = dict(block_table=table, seq_lens=lens, page_size=16, num_q_heads=16,
              kv_lora_rank=32, rope_dim=16, q_dtype=CPU_DTYPE, kv_dtype=CPU_DTYPE)
    kw.update(over)
    return kw


@pytest.mark.parametrize("impl", ["triton", "reference", "auto"])
@pytest.mark.parametrize("over, match", [
    (dict(page_size=0), "page_size"),
    (dict(num_q_heads=0), "num_q_heads"),
    (dict(kv_lora_rank=1024), "kv_lora_rank"),
    (dict(rope_dim=-1), "rope_dim"),
    (dict(rope_dim=256), "rope_dim"),
    (dict(num_tokens=0), "num_tokens"),
    (dict(kv_dtype=torch.bfloat16), "kv_dtype"),
    (dict(q_dtype=torch.int8), "q_dtype"),
    (dict(scale=0.0), "scale"),
    (dict(scale=float("nan")), "scale"),
    (dict(max_seq_len=-1), "max_seq_len"),
    (dict(return_lse=1), "return_lse"),
    (dict(num_partitions=0), "num_partitions"),
    (dict(seq_lens=torch.zeros(3, dtype=torch.int32)), "seq_lens"),
    (dict(block_table=torch.zeros(2, 3)), "block_table"),
])
def test_plan_rejects_bad_arguments(over, match, impl):
    with pytest.raises(ValueError, match=match):
        plan_mla_decode(**_plan_kw(**over), impl=impl)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_run_rejects_what_a_layer_gets_wrong(impl):
    plan = plan_mla_decode(**_plan_kw(), impl=impl)
    q = torch.randn((2, 16, 48)).to(CPU_DTYPE)
    kv = make_cache(4, 16, 48, CPU_DTYPE, DEV)
    with pytest.raises(ValueError, match="q: the plan was built for"):
        plan.run(q[:, :8], kv)
    with pytest.raises(ValueError, match="q: the plan was built for"):
        plan.run(q.float(), kv)
    with pytest.raises(ValueError, match="kv_cache: the plan was built for"):
        plan.run(q, make_cache(4, 8, 48, CPU_DTYPE, DEV))
    with pytest.raises(ValueError, match="kv_cache: the plan was built for"):
        plan.run(q, kv.to(torch.bfloat16))
    with pytest.raises(ValueError, match="out must have shape"):
        plan.run(q, kv, out=torch.empty((2, 16, 48), dtype=CPU_DTYPE))
    with pytest.raises(ValueError, match="lse: the plan was built with return_lse=False"):
        plan.run(q, kv, lse=torch.empty((2, 16)))
    with pytest.raises(ValueError, match="kv_scale"):
        plan.run(q, kv, kv_scale=torch.ones(2))


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_one_shot_rejects_bad_arguments(impl):
    q = torch.randn((2, 16, 48)).to(CPU_DTYPE)
    kv = make_cache(4, 16, 48, CPU_DTYPE, DEV)
    table = torch.zeros((2, 3), dtype=torch.int32)
    lens = torch.tensor([5, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="kv_cache rows must be q's width 48"):
        mla_decode_attention(q, kv[..., :40], table, lens, kv_lora_rank=32, impl=impl)
    with pytest.raises(ValueError, match="kv_lora_rank must be an int in"):
        mla_decode_attention(q, kv, table, lens, kv_lora_rank=64, impl=impl)
    with pytest.raises(ValueError, match="kv_cache dtype must match"):
        mla_decode_attention(q, kv.to(torch.bfloat16), table, lens, kv_lora_rank=32,
                             impl=impl)
    with pytest.raises(ValueError, match="kv_cache must have 3 dims"):
        mla_decode_attention(q, kv.unsqueeze(1), table, lens, kv_lora_rank=32, impl=impl)
    with pytest.raises(ValueError, match="block_table must have shape"):
        mla_decode_attention(q, kv, table[:1], lens, kv_lora_rank=32, impl=impl)
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        mla_decode_attention(q, kv[:, :0], table, lens, kv_lora_rank=32, impl=impl)


# ----------------------------------------------------------------------------- cache write


@pytest.mark.parametrize("rope", [16, 0])
@pytest.mark.parametrize("kv_dtype", [torch.float16, E4M3, torch.float8_e5m2])
@pytest.mark.parametrize("tensor_scale", [False, True])
def test_write_mla_cache_matches_reference(kv_dtype, rope, tensor_scale):
    """Bit for bit over the whole cache storage (poisoned first): padding (-1), a slot past
    the cache and a negative one are skipped; rows land at their page and offset."""
    torch.manual_seed(19)
    rank, page, nb = 32, 4, 5
    n = 7
    kv_c = (torch.randn((n, rank)) * 3).to(CPU_DTYPE)
    k_pe = (torch.randn((n, 2 * rope))[:, ::2] * 3).to(CPU_DTYPE)  # strided
    slots = torch.tensor([3, -1, 17, nb * page, 0, -5, 9], dtype=torch.int64)
    scale = torch.tensor([0.7]) if tensor_scale else 0.7
    fp8 = kv_dtype in reference.FP8_DTYPES
    poison = torch.randint(0, 120, (nb, page, rank + rope), dtype=torch.uint8)
    caches = []
    for impl in ("triton", "reference"):
        if fp8:
            cache = poison.clone().view(kv_dtype)
        else:
            cache = poison.to(kv_dtype)
        write_mla_cache(kv_c, k_pe, cache, slots, kv_scale=scale if fp8 else None, impl=impl)
        caches.append(cache)
    bits = [c.view(torch.uint8) if fp8 else c.view(torch.int16) for c in caches]
    assert torch.equal(bits[0], bits[1])
    untouched = [s for s in range(nb * page) if s not in (3, 17, 0, 9)]
    flat = caches[0].view(nb * page, rank + rope)
    pois = (poison.view(kv_dtype) if fp8 else poison.to(kv_dtype)).view(nb * page, -1)
    assert torch.equal(flat[untouched].view(torch.uint8), pois[untouched].view(torch.uint8))
    row = flat[17].float() * (0.7 if fp8 else 1.0)
    want = torch.cat([kv_c[2].float(), k_pe[2].float()])
    assert torch.allclose(row, want, rtol=0.13 if fp8 else 1e-3, atol=0.05 if fp8 else 0)


def test_write_mla_cache_plan_and_bad_input():
    kv_c = torch.randn((3, 32)).to(CPU_DTYPE)
    k_pe = torch.randn((3, 16)).to(CPU_DTYPE)
    cache = make_cache(2, 4, 48, CPU_DTYPE, DEV)
    slots = torch.tensor([1, 2, 7])
    plan = plan_write_mla_cache(slots, kv_lora_rank=32, rope_dim=16, page_size=4,
                                impl="triton")
    write_mla_cache(kv_c, k_pe, cache, slots, plan=plan)
    assert torch.equal(cache[1, 3], torch.cat([kv_c[2], k_pe[2]]))
    with pytest.raises(ValueError, match="slot_mapping must be the tensor"):
        write_mla_cache(kv_c, k_pe, cache, slots.clone(), plan=plan)
    with pytest.raises(ValueError, match="kv_cache rows must be"):
        write_mla_cache(kv_c, k_pe, cache[..., :40], slots)
    with pytest.raises(ValueError, match="k_pe must have shape"):
        write_mla_cache(kv_c, k_pe[:2], cache, slots)
    with pytest.raises(ValueError, match="stride 0"):
        write_mla_cache(kv_c, k_pe, cache[:1].expand(2, 4, 48), slots)
    with pytest.raises(ValueError, match="kv_cache must have 3 dims"):
        write_mla_cache(kv_c, k_pe, cache.unsqueeze(1), slots)


def test_copy_blocks_on_a_latent_cache():
    """The existing block copy takes the latent cache as it is (one tensor: passed as
    both caches)."""
    torch.manual_seed(23)
    cache = make_cache(6, 4, 48, CPU_DTYPE, DEV)
    want = cache.clone()
    mapping = torch.tensor([[0, 3], [2, 5]], dtype=torch.int64)
    reference.copy_blocks(want, want, mapping)
    copy_blocks(cache, cache, mapping, impl="triton")
    assert torch.equal(cache, want) and torch.equal(cache[3], cache[0])


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("page", [1, 16, 64])
@pytest.mark.parametrize("tokens", [1, 3])
def test_gpu_deepseek_sizes(heads, page, tokens):
    torch.manual_seed(heads + page + tokens)
    lens = torch.randint(1, 8192, (64 if heads == 16 else 16,)).tolist()
    lens[0], lens[1] = 8192, 1
    run_case(seq_lens=lens, page_size=page, rank=512, rope=64, heads=heads, tokens=tokens,
             dtype=torch.bfloat16, return_lse=True)


@pytest.mark.gpu
@pytest.mark.parametrize("num_partitions", [None, 1, 7])
def test_gpu_fp8_and_forced_splits(num_partitions):
    torch.manual_seed(29)
    lens = [4096, 3000, 17, 0, 8000, 1]
    run_case(seq_lens=lens, page_size=64, rank=512, rope=64, heads=128, tokens=2,
             dtype=torch.bfloat16, kv_dtype=E4M3, num_partitions=num_partitions,
             return_lse=True, tensor_scale=True)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay():
    """A plan run captured in a CUDA graph: replays with new lengths give new answers."""
    torch.manual_seed(31)
    q, kv, table, lens = make_batch(seq_lens=[2000] * 8, page_size=64, rank=512, rope=64,
                                    heads=16, dtype=torch.bfloat16)
    plan = plan_mla_decode(block_table=table, seq_lens=lens, page_size=64, num_q_heads=16,
                           kv_lora_rank=512, rope_dim=64, q_dtype=q.dtype, kv_dtype=kv.dtype,
                           return_lse=True)
    out = torch.empty((8, 16, 512), dtype=q.dtype, device=DEV)
    lse = torch.empty((8, 16), device=DEV)
    plan.run(q, kv, out=out, lse=lse)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q, kv, out=out, lse=lse)
    lens.copy_(torch.randint(1, 2000, (8,), device=DEV, dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    check_against_reference(q, kv, table, lens, rank=512, out=out, lse=lse)


@pytest.mark.gpu
def test_gpu_write_mla_cache():
    kv_c = torch.randn((300, 512), device=DEV, dtype=torch.bfloat16)
    k_pe = torch.randn((300, 64), device=DEV, dtype=torch.bfloat16)
    slots = torch.randperm(64 * 16, device=DEV)[:300]
    slots[::7] = -1
    for dtype in (torch.bfloat16, E4M3):
        caches = [torch.zeros((16, 64, 576), device=DEV).to(dtype) for _ in range(2)]
        for cache, impl in zip(caches, ("triton", "reference")):
            write_mla_cache(kv_c, k_pe, cache, slots, kv_scale=0.3, impl=impl)
        assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))


# ----------------------------------------------------------------------------- sm_90 compile

SCRIPTS = str(__import__("tests.support", fromlist=["REPO"]).REPO / "scripts")
# (heads, tokens, split, lse, fp8): each shipped tile (16, 32 and 64 rows), both walks;
# the fp8 ones widen e4m3 by the cvt instruction, as on an sm_90 GPU
# (heads, tokens, split, lse, fp8, tree)
COMPILE_CASES = [(16, 1, True, True, True, False), (16, 2, True, True, False, False),
                 (128, 1, False, True, False, False), (128, 1, True, False, True, False),
                 (16, 8, True, False, False, True), (128, 4, False, False, True, True)]
H100_SHARED_BYTES = 232448  # the opt-in shared memory a block gets on sm_90


def test_kernels_compile_for_sm90_within_shared_memory():
    """The shipped tiles compiled for sm_90 by the installed Triton (no GPU needed, no
    interpreter: it accepts what the compiler refuses, such as a module-level float read
    in a kernel), and the combine kernel; each fits the shared memory of an sm_90 block."""
    import json
    import os
    import subprocess
    import sys
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {SCRIPTS!r})\n"
        "from prefill_ptxas import compile_offline\n"
        "from hygon_attn_backend.kernels.mla_decode import mla_combine_kernel, "
        "mla_decode_kernel\n"
        "from hygon_attn_backend.ops.mla import tuning\n"
        "from hygon_attn_backend.kernels.fp8 import WIDEN_CODES\n"
        "P = dict(out_ptr='*bf16', q_ptr='*bf16', kv_ptr='*bf16', lse_ptr='*fp32',\n"
        "         block_table_ptr='*i32', seq_lens_ptr='*i32', kv_scale_ptr='*fp32',\n"
        "         max_logits_ptr='*fp32', exp_sums_ptr='*fp32', partial_out_ptr='*fp32',\n"
        "         tree_ptr='*i32')\n"
        "out = []\n"
        "for heads, tokens, split, lse, fp8, tree in json.loads(sys.argv[1]):\n"
        "    bm, bn, w, s = tuning.tile_config(block_m=tuning.block_m_for(heads * tokens),\n"
        "                                      rank_pad=512, kv_elem_size=2)\n"
        "    c = dict(NUM_HEADS=heads, NUM_TOKENS=tokens, RANK=512, RANK_PAD=512, ROPE=64,\n"
        "             ROPE_PAD=64, BLOCK_M=bm, BLOCK_N=bn, PAGE_SIZE=64, SPLIT=split,\n"
        "             SCALES_FROM_PTR=fp8, WRITE_LSE=lse and not split,\n"
        "             KV_WIDEN=WIDEN_CODES['e4m3_cvt' if fp8 else 'none'], TREE=tree)\n"
        "    p = dict(P, kv_ptr='*fp8e4nv') if fp8 else P\n"
        "    k = compile_offline(mla_decode_kernel, c, p, {'scale', 'kv_scale_value'},\n"
        "                        {'stride_kv_dim'}, warps=w, stages=s, target=('cuda', 90, 32))\n"
        "    out.append(k.metadata.shared)\n"
        "k = compile_offline(mla_combine_kernel, dict(NUM_HEADS=16, RANK=512, RANK_PAD=512,\n"
        "                    PART_CHUNK=16, ALIGN=32, PAGE_SIZE=64, WRITE_LSE=True),\n"
        "                    {n: P[n] for n in ('out_ptr', 'lse_ptr', 'max_logits_ptr',\n"
        "                     'exp_sums_ptr', 'partial_out_ptr', 'seq_lens_ptr')}, set(),\n"
        "                    {'stride_o_dim'}, warps=4, stages=1, target=('cuda', 90, 32))\n"
        "out.append(k.metadata.shared)\n"
        "print(json.dumps(out))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code, json.dumps(COMPILE_CASES)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    shared = json.loads(run.stdout.splitlines()[-1])
    assert len(shared) == len(COMPILE_CASES) + 1
    assert all(0 <= s <= H100_SHARED_BYTES for s in shared), shared


@pytest.mark.parametrize("tokens", [1, 2])
def test_mla_one_partition_split_gives_the_unsplit_bits(tokens):
    """Sequences shorter than the split's floor in a split launch (a CUDA graph planned for
    the cache's capacity) give the unsplit launch's exact bits, out and LSE: the combine
    takes a lone partition's partial as it is (SGLang's draft graph runner compares graph
    and eager rounds exactly). fp32 out: any rounding of the merge would show."""
    torch.manual_seed(tokens)
    q, kv, table, lens = make_batch(seq_lens=[40, 3, 0, 17], page_size=16, rank=32, rope=16,
                                    heads=8, tokens=tokens)
    got = []
    for parts in (1, 4):
        plan = plan_mla_decode(block_table=table, seq_lens=lens, page_size=16, num_q_heads=8,
                               kv_lora_rank=32, rope_dim=16, q_dtype=q.dtype,
                               kv_dtype=kv.dtype, num_tokens=tokens, return_lse=True,
                               num_partitions=parts, impl="triton")
        out = torch.full(q.shape[:-1] + (32,), float("nan"), dtype=torch.float32, device=DEV)
        lse = torch.full(q.shape[:-1], float("nan"), device=DEV)
        plan.run(q, kv, out=out, lse=lse)
        got.append((plan.num_launches, out, lse))
    (n1, out1, lse1), (n4, out4, lse4) = got
    assert (n1, n4) == (1, 2)
    assert torch.equal(out1, out4) and torch.equal(lse1, lse4)
    check_against_reference(q, kv, table, lens, rank=32, out=out4.to(q.dtype), lse=lse4)
