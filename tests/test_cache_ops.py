"""write_kv and copy_blocks against reference.py, across KV layouts and cache dtypes.

A cache op moves data, it computes nothing: the kernel must agree with the reference bit
for bit (fp16/fp32 casts round to nearest even on both sides, fp8 codes are computed with
the same rounding). Every case compares the *whole storage* of both caches, byte for
byte, with the reference applied to a copy, so writes through the wrong stride, into the
other half of a combined K|V tensor, into another layer, or into a slot marked -1 all
fail. Storages are poisoned with random values (never zeros) before each run.

Layouts are built here from plain torch storages and permuted views (no copy), so these
tests do not depend on ``layouts.py``.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops.cache import copy_blocks, write_kv

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
CPU_DTYPES = (torch.float16, torch.float32) + FP8
GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32) + FP8

# name -> builder(num_blocks, H, P, D, dtype, device, gen) -> list of storage tensors.
# views(storages) -> (k_view, v_view, k_blocks, v_blocks): the canonical views for
# write_kv and the per-block tensors (dim 0 = block) that copy_blocks takes.
NUM_LAYERS = 3  # layers of the vLLM combined storages; the tests use layer 1


def _split_x(dtype):
    return 16 // torch.empty((), dtype=dtype).element_size()


def _layout(name, num_blocks, h, p, d, dtype, device):
    """Allocate the storage of ``name`` (uninitialised) and return ``(storages, views_fn)``."""
    def alloc(*shape):
        return torch.empty(shape, dtype=dtype, device=device)

    if name == "bshd":  # [N, P, H, D] for both (SGLang paged, vLLM flash layout)
        st = [alloc(num_blocks, p, h, d), alloc(num_blocks, p, h, d)]
        return st, lambda s: (s[0].permute(0, 2, 1, 3), s[1].permute(0, 2, 1, 3), s[0], s[1])
    if name == "bhsd":  # [N, H, P, D]
        st = [alloc(num_blocks, h, p, d), alloc(num_blocks, h, p, d)]
        return st, lambda s: (s[0], s[1], s[0], s[1])
    if name == "bhsd_bhds":  # K [N, H, P, D], V transposed [N, H, D, P]
        st = [alloc(num_blocks, h, p, d), alloc(num_blocks, h, d, p)]
        return st, lambda s: (s[0], s[1].permute(0, 1, 3, 2), s[0], s[1])
    if name == "split_x":  # legacy vLLM: K [N, H, D//x, P, x] (5-D), V [N, H, D, P]
        x = _split_x(dtype)
        st = [alloc(num_blocks, h, d // x, p, x), alloc(num_blocks, h, d, p)]
        return st, lambda s: (s[0], s[1].permute(0, 1, 3, 2), s[0], s[1])
    if name == "vllm_LBNHC":  # one tensor [L, N, P, H, 2D]; layer 1; K = [..., :D]
        st = [alloc(NUM_LAYERS, num_blocks, p, h, 2 * d)]

        def views(s):
            kv = s[0][1].permute(0, 2, 1, 3)  # [N, H, P, 2D]
            return kv[..., :d], kv[..., d:], kv[..., :d], kv[..., d:]
        return st, views
    if name == "vllm_BLHNC":  # cross-layer [N, L, H, P, 2D]: block stride spans all layers
        st = [alloc(num_blocks, NUM_LAYERS, h, p, 2 * d)]

        def views(s):
            kv = s[0][:, 1]  # [N, H, P, 2D], non-contiguous across dim 0
            return kv[..., :d], kv[..., d:], kv[..., :d], kv[..., d:]
        return st, views
    if name == "sglang_nhd":  # token pools [rows, H, D], rows = N * P, page = P rows
        st = [alloc(num_blocks * p, h, d), alloc(num_blocks * p, h, d)]

        def views(s):
            kp, vp = (t.view(num_blocks, p, h, d) for t in s)
            return kp.permute(0, 2, 1, 3), vp.permute(0, 2, 1, 3), kp, vp
        return st, views
    raise AssertionError(name)


LAYOUT_NAMES = ("bshd", "bhsd", "bhsd_bhds", "split_x", "vllm_LBNHC", "vllm_BLHNC",
                "sglang_nhd")


def _poison(storages, gen):
    """Fill storages with random values (fp8 too), never zeros."""
    for t in storages:
        vals = torch.randn(t.shape, generator=gen, dtype=torch.float32) * 8.0
        t.copy_(vals.to(t.device).to(t.dtype))


def _bytes(t):
    return t.detach().contiguous().view(torch.uint8).cpu()


def _assert_storages_equal(got, want, what):
    for i, (g, w) in enumerate(zip(got, want)):
        gb, wb = _bytes(g), _bytes(w)
        diff = gb != wb
        assert not diff.any(), (f"{what}: storage {i} differs from the reference in "
                                f"{int(diff.sum())} of {diff.numel()} bytes")


def _inputs(num_tokens, h, d, num_slots, gen, device, *, index_dtype, num_pad, in_dtype,
            saturate):
    """k, v as non-contiguous slices of a packed qkv tensor; distinct random slots with
    ``num_pad`` entries set to -1."""
    hq = 2 * h
    qkv = torch.randn(num_tokens, hq + 2 * h, d, generator=gen) * 4.0
    if saturate:  # a few values beyond the fp8 range (x / scale > max): saturated, not inf
        qkv[:, hq:][torch.rand(num_tokens, 2 * h, d, generator=gen) < 0.02] *= 1e4
    qkv = qkv.to(in_dtype).to(device)
    k, v = qkv[:, hq:hq + h], qkv[:, hq + h:]
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:num_pad]] = -1
    return k, v, slots.to(index_dtype).to(device)


def _scales(dtype, device):
    if dtype in FP8:
        # one plain float, one 1-element fp32 tensor
        return 0.37, torch.tensor([1.7], dtype=torch.float32, device=device)
    return None, None


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def _run_write_case(layout, dtype, page_size, head_dim, device, *, num_kv_heads=3,
                    num_blocks=5, num_tokens=11, seed=0, in_dtype=torch.float32,
                    index_dtype=torch.int32, num_pad=2):
    gen = torch.Generator().manual_seed(seed)
    storages, views = _layout(layout, num_blocks, num_kv_heads, page_size, head_dim, dtype,
                              device)
    _poison(storages, gen)
    poisoned = [t.clone() for t in storages]
    expected = [t.clone() for t in storages]
    num_tokens = min(num_tokens, num_blocks * page_size)
    k, v, slots = _inputs(num_tokens, num_kv_heads, head_dim, num_blocks * page_size, gen,
                          device, index_dtype=index_dtype,
                          num_pad=min(num_pad, num_tokens - 1), in_dtype=in_dtype,
                          saturate=dtype in FP8)
    k_scale, v_scale = _scales(dtype, device)
    ek, ev, _, _ = views(expected)
    reference.write_kv(k, v, ek, ev, slots, k_scale=k_scale, v_scale=v_scale)
    gk, gv, _, _ = views(storages)
    write_kv(k, v, gk, gv, slots, k_scale=k_scale, v_scale=v_scale, impl="triton")
    what = f"write_kv {layout} {dtype} P={page_size} D={head_dim}"
    _assert_storages_equal(storages, expected, what)
    changed = sum(int((_bytes(e) != _bytes(p)).sum()) for e, p in zip(expected, poisoned))
    assert changed > 0, f"{what}: the written tokens did not change the poisoned cache"


# ----------------------------------------------------------------------------- write_kv, CPU


@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_write_kv_matches_reference(layout, dtype, page_size, head_dim):
    _run_write_case(layout, dtype, page_size, head_dim, torch.device("cpu"),
                    seed=_seed(layout, str(dtype), page_size, head_dim),
                    index_dtype=torch.int32 if page_size == 1 else torch.int64,
                    in_dtype=torch.float16 if head_dim == 80 else torch.float32)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_write_kv_fp8_rounding_is_exact(dtype):
    """Every fp8 value, every midpoint between neighbours (ties to even) and the fp32
    numbers either side of it, zeros, tiny and huge values, +-inf (saturate) and NaN."""
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = torch.unique(codes[torch.isfinite(codes)])  # sorted
    mids = (finite[1:] + finite[:-1]) / 2
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    vals = torch.cat([finite, mids, torch.nextafter(mids, up), torch.nextafter(mids, down),
                      torch.tensor([float("inf"), float("-inf"), 1e9, -1e9, 1e-40, -1e-40,
                                    0.0, -0.0, 3e-3, -7e-4])])
    head_dim = 64
    num_tokens = -(-vals.numel() // head_dim)
    vals = torch.cat([vals, torch.full((num_tokens * head_dim - vals.numel(),), 1.5)])
    scale = 2.0
    # the cache stores x / scale: feed x = vals * scale (exact, a power of two)
    k = (vals * scale).view(num_tokens, 1, head_dim)
    v = torch.full_like(k, float("nan"))
    k_cache = torch.randn(num_tokens, 1, 1, head_dim).to(dtype)
    v_cache = torch.randn(num_tokens, 1, 1, head_dim).to(dtype)
    slots = torch.arange(num_tokens, dtype=torch.int64)
    write_kv(k, v, k_cache, v_cache, slots, k_scale=torch.tensor([scale]), v_scale=1.0,
             impl="triton")
    limit = torch.finfo(dtype).max
    want = vals.clamp(-limit, limit).to(dtype).view(torch.uint8).view(k_cache.shape)
    got = k_cache.view(torch.uint8)
    bad = got != want
    assert not bad.any(), (f"{int(bad.sum())} fp8 codes differ, e.g. x={vals.view(k.shape)[bad.view(k.shape)][:4].tolist()} "
                           f"got {got[bad][:4].tolist()} want {want[bad][:4].tolist()}")
    assert torch.isnan(v_cache.float()).all(), "NaN input must give an fp8 NaN code"


def test_write_kv_skips_padding_and_out_of_range_slots(monkeypatch):
    """Slot -1 (and, outside debug mode, any slot outside the cache) writes nothing."""
    monkeypatch.delenv("HYGON_ATTN_DEBUG", raising=False)
    gen = torch.Generator().manual_seed(7)
    num_blocks, h, p, d = 4, 2, 16, 64
    storage = torch.randn(num_blocks, p, h, d, generator=gen).half()
    v_storage = torch.randn(num_blocks, p, h, d, generator=gen).half()
    k_cache, v_cache = storage.permute(0, 2, 1, 3), v_storage.permute(0, 2, 1, 3)
    before = (storage.clone(), v_storage.clone())
    k = torch.randn(5, h, d, generator=gen).half()
    slots = torch.tensor([-1, -1, num_blocks * p, -7, 10 ** 9], dtype=torch.int64)
    write_kv(k, k, k_cache, v_cache, slots, impl="triton")
    assert torch.equal(storage, before[0]) and torch.equal(v_storage, before[1])
    # one valid slot among them lands where the reference puts it, and nowhere else
    slots[3] = 2 * p + 5
    write_kv(k, k, k_cache, v_cache, slots, impl="triton")
    assert torch.equal(k_cache[2, :, 5], k[3]) and torch.equal(v_cache[2, :, 5], k[3])
    k_cache[2, :, 5] = before[0].permute(0, 2, 1, 3)[2, :, 5]
    v_cache[2, :, 5] = before[1].permute(0, 2, 1, 3)[2, :, 5]
    assert torch.equal(storage, before[0]) and torch.equal(v_storage, before[1])


def test_write_kv_debug_mode_rejects_bad_slots(monkeypatch):
    monkeypatch.setenv("HYGON_ATTN_DEBUG", "1")
    k_cache = torch.randn(2, 1, 4, 64).half()
    v_cache = torch.randn(2, 1, 4, 64).half()
    k = torch.randn(2, 1, 64).half()
    before = k_cache.clone()
    with pytest.raises(ValueError, match=r"slot_mapping holds slots in \[0, 8\].*8 slots"):
        write_kv(k, k, k_cache, v_cache, torch.tensor([0, 8]), impl="triton")
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(k, k, k_cache, v_cache, torch.tensor([-2, 1]), impl="triton")
    assert torch.equal(k_cache, before), "nothing may be written when validation fails"
    write_kv(k, k, k_cache, v_cache, torch.tensor([-1, 7]), impl="triton")
    assert torch.equal(k_cache[1, :, 3], k[1])


def test_write_kv_empty_batch_and_reference_impl():
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(3, 2, 4, 80, generator=gen).half()
    v_cache = torch.randn(3, 2, 80, 4, generator=gen).half().permute(0, 1, 3, 2)
    before = k_cache.clone()
    empty = torch.empty(0, 2, 80, dtype=torch.float16)
    write_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int32), impl="triton")
    assert torch.equal(k_cache, before)
    k = torch.randn(3, 2, 80, generator=gen).half()
    v = torch.randn(3, 2, 80, generator=gen).half()
    slots = torch.tensor([11, -1, 0], dtype=torch.int32)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    write_kv(k, v, ref_k, ref_v, slots, impl="reference")
    write_kv(k, v, k_cache, v_cache, slots, impl="triton")
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert torch.equal(k_cache[2, :, 3], k[0]) and torch.equal(v_cache[0, :, 0], v[2])
    with pytest.raises(ValueError, match="impl must be one of"):
        write_kv(k, v, k_cache, v_cache, slots, impl="fast")


def _valid_write_args():
    k = torch.randn(3, 2, 64).half()
    return dict(k=k, v=k.clone(), k_cache=torch.randn(4, 2, 16, 64).half(),
                v_cache=torch.randn(4, 2, 16, 64).half(),
                slot_mapping=torch.tensor([0, 1, 2], dtype=torch.int32))


@pytest.mark.parametrize("name,bad,match", [
    ("k", torch.randn(3, 2, 64).to(torch.int32), "k must have dtype"),
    ("k", torch.randn(3, 128).half(), "k must have 3 dims"),
    ("v", torch.randn(3, 2, 32).half(), r"v must have shape \(3, 2, 64\)"),
    ("v", torch.randn(3, 2, 64, device="meta").half(), "v must be on cpu"),
    ("slot_mapping", torch.tensor([0, 1, 2], dtype=torch.float32), "slot_mapping must have dtype"),
    ("slot_mapping", torch.tensor([0, 1], dtype=torch.int32), r"slot_mapping must have shape \(3\)"),
    ("k_cache", torch.randn(4, 2, 16, 64).float(), "share a dtype"),
    ("k_cache", torch.randn(4, 3, 16, 64).half(), "same"),
    ("v_cache", torch.randn(4, 2, 16, 32).half(), "same"),
    ("k_cache", torch.randn(4, 2, 16, 64).to(torch.int8), "k_cache must have dtype"),
    ("k_cache", torch.randn(4, 2, 16, 4, 16).half(), "split-x"),
    ("k_cache", torch.randn(1, 2, 16, 64).half().expand(4, 2, 16, 64), "k_cache has stride 0"),
    ("v_cache", torch.randn(4, 2, 1, 64).half().expand(4, 2, 16, 64), "v_cache has stride 0"),
    ("k_scale", torch.tensor([1.0, 2.0]), "k_scale must be a float or a 1-element tensor"),
])
def test_write_kv_rejects_bad_arguments(name, bad, match):
    args = _valid_write_args()
    if name in ("k_scale",):
        with pytest.raises(ValueError, match=match):
            write_kv(**args, k_scale=bad, impl="triton")
        return
    args[name] = bad
    with pytest.raises(ValueError, match=match):
        write_kv(**args, impl="triton")


# ----------------------------------------------------------------------------- copy_blocks, CPU


def _run_copy_case(layout, dtype, page_size, head_dim, device, pairs, *, num_blocks=7,
                   num_kv_heads=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    storages, views = _layout(layout, num_blocks, num_kv_heads, page_size, head_dim, dtype,
                              device)
    _poison(storages, gen)
    poisoned = [t.clone() for t in storages]
    expected = [t.clone() for t in storages]
    mapping = torch.tensor(pairs, dtype=torch.int64, device=device)
    _, _, ek, ev = views(expected)
    reference.copy_blocks(ek, ev, mapping)
    _, _, gk, gv = views(storages)
    copy_blocks(gk, gv, mapping, impl="triton")
    what = f"copy_blocks {layout} {dtype} P={page_size} D={head_dim}"
    _assert_storages_equal(storages, expected, what)
    changed = sum(int((_bytes(e) != _bytes(p)).sum()) for e, p in zip(expected, poisoned))
    assert changed > 0, f"{what}: the copies did not change the poisoned cache"


@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_copy_blocks_matches_reference(layout, dtype, page_size, head_dim):
    # block 0 forked twice, 5 -> 2; sources {0, 5} disjoint from destinations {3, 6, 2}
    pairs = [[0, 3], [5, 2], [0, 6]]
    _run_copy_case(layout, dtype, page_size, head_dim, torch.device("cpu"), pairs,
                   seed=_seed("copy", layout, str(dtype), page_size, head_dim))


def test_copy_blocks_int32_mapping_non_contiguous_and_empty():
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(6, 2, 4, 64, generator=gen).half()
    v = torch.randn(6, 2, 64, 4, generator=gen).half()
    ek, ev = k.clone(), v.clone()
    # a strided [n, 2] mapping: the columns of a [2, n] tensor
    mapping = torch.tensor([[1, 2], [4, 5]], dtype=torch.int32).t()  # pairs (1, 4), (2, 5)
    reference.copy_blocks(ek, ev, mapping)
    copy_blocks(k, v, mapping, impl="triton")
    assert torch.equal(k, ek) and torch.equal(v, ev)
    assert torch.equal(k[4], k[1]) and torch.equal(v[5], v[2])
    copy_blocks(k, v, torch.empty(0, 2, dtype=torch.int64), impl="triton")
    assert torch.equal(k, ek)


def test_copy_blocks_skips_out_of_range_pairs(monkeypatch):
    monkeypatch.delenv("HYGON_ATTN_DEBUG", raising=False)
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(4, 2, 16, 64, generator=gen).half()
    v = torch.randn(4, 2, 16, 64, generator=gen).half()
    ek, ev = k.clone(), v.clone()
    reference.copy_blocks(ek, ev, torch.tensor([[0, 1]]))
    copy_blocks(k, v, torch.tensor([[0, 1], [0, 4], [-1, 2], [9, 3]]), impl="triton")
    assert torch.equal(k, ek) and torch.equal(v, ev)


def test_copy_blocks_debug_mode_checks(monkeypatch):
    monkeypatch.setenv("HYGON_ATTN_DEBUG", "1")
    k = torch.randn(4, 2, 16, 64).half()
    v = torch.randn(4, 2, 16, 64).half()
    before = k.clone()
    with pytest.raises(ValueError, match=r"block_mapping holds block ids in \[0, 4\]"):
        copy_blocks(k, v, torch.tensor([[0, 4]]), impl="triton")
    with pytest.raises(ValueError, match="destinations must be distinct"):
        copy_blocks(k, v, torch.tensor([[0, 2], [1, 2]]), impl="triton")
    with pytest.raises(ValueError, match="disjoint"):
        copy_blocks(k, v, torch.tensor([[0, 1], [1, 2]]), impl="triton")
    assert torch.equal(k, before)
    # the reference reads every source first: a chain is fine there
    ek, ev = k.clone(), v.clone()
    copy_blocks(ek, ev, torch.tensor([[0, 1], [1, 2]]), impl="reference")
    assert torch.equal(ek[1], k[0]) and torch.equal(ek[2], k[1])


@pytest.mark.parametrize("name,bad,match", [
    ("k_cache", torch.randn(4).half(), "k_cache must have 2 or 3 or 4 or 5 dims"),
    ("v_cache", torch.randn(5, 2, 16, 64).half(), "same number of blocks"),
    ("v_cache", torch.randn(4, 2, 16, 64).to(torch.int16), "v_cache must have dtype"),
    ("v_cache", torch.randn(4, 2, 16, 64, device="meta").half(), "v_cache must be on cpu"),
    ("block_mapping", torch.tensor([[0, 1, 2]]), r"block_mapping must have shape \(\*, 2\)"),
    ("block_mapping", torch.tensor([[0.0, 1.0]]), "block_mapping must have dtype"),
    ("block_mapping", torch.tensor([0, 1]), "block_mapping must have 2 dims"),
    ("k_cache", torch.randn(1, 2, 16, 64).half().expand(4, 2, 16, 64),
     "k_cache has stride 0 on its block axis"),
    ("v_cache", torch.randn(4, 1, 16, 64).half().expand(4, 2, 16, 64), "v_cache has stride 0"),
])
def test_copy_blocks_rejects_bad_arguments(name, bad, match):
    args = dict(k_cache=torch.randn(4, 2, 16, 64).half(), v_cache=torch.randn(4, 2, 16, 64).half(),
                block_mapping=torch.tensor([[0, 1]]))
    args[name] = bad
    with pytest.raises(ValueError, match=match):
        copy_blocks(**args, impl="triton")
