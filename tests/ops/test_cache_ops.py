"""write_kv and copy_blocks against reference.py, across KV layouts and cache dtypes.

A cache op moves data, it computes nothing: the kernel must agree with the reference bit
for bit (fp16/fp32 casts round to nearest even on both sides, fp8 codes are computed with
the same rounding). Every case compares the *whole storage* of both caches, byte for
byte, with the reference applied to a copy, so writes through the wrong stride, into the
other half of a combined K|V tensor, into another layer, or into a slot marked -1 all
fail. Storages are poisoned with random values (never zeros) before each run.

The main cases build each layout here from plain torch storages and permuted views (no
copy), independent of ``layouts.py``; one more test runs both ops on the views that
``layouts`` builds, for every layout and every vLLM physical order.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from hygon_attn_backend import layouts, reference
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
    """Fill storages with random values (fp8 too), never zeros; generated on the
    storage's device (seeded from ``gen``) so large GPU caches poison fast."""
    for t in storages:
        dev_gen = torch.Generator(device=t.device)
        dev_gen.manual_seed(int(torch.randint(2 ** 62, (1,), generator=gen)))
        vals = torch.randn(t.shape, generator=dev_gen, dtype=torch.float32, device=t.device)
        t.copy_((vals * 8.0).to(t.dtype))


def _bytes(t):
    """The tensor's bytes (on its device), for bit-exact comparison."""
    return t.detach().contiguous().view(torch.uint8)


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
    if index_dtype == torch.int32:  # int32 slots as a strided view: a column of [T, 2]
        pair = torch.stack([slots, torch.full_like(slots, -5)], dim=1)
        return k, v, pair.to(index_dtype).to(device)[:, 0]
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
                    index_dtype=torch.int32, num_pad=2, impl="triton"):
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
    write_kv(k, v, gk, gv, slots, k_scale=k_scale, v_scale=v_scale, impl=impl)
    what = f"write_kv {layout} {dtype} P={page_size} D={head_dim}"
    _assert_storages_equal(storages, expected, what)
    changed = sum(int((_bytes(e) != _bytes(p)).sum()) for e, p in zip(expected, poisoned))
    assert changed > 0, f"{what}: the written tokens did not change the poisoned cache"


# --------------------------------------------------- write_kv, small (CPU interpreter or GPU)


@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_write_kv_matches_reference(layout, dtype, page_size, head_dim, device):
    _run_write_case(layout, dtype, page_size, head_dim, device,
                    seed=_seed(layout, str(dtype), page_size, head_dim),
                    index_dtype=torch.int32 if page_size == 1 else torch.int64,
                    in_dtype=torch.float16 if head_dim == 80 else torch.float32)


@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_write_kv_fp8_rounding_is_exact(dtype, device):
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
    k = (vals * scale).view(num_tokens, 1, head_dim).to(device)
    v = torch.full_like(k, float("nan"))
    k_cache = torch.randn(num_tokens, 1, 1, head_dim).to(dtype).to(device)
    v_cache = torch.randn(num_tokens, 1, 1, head_dim).to(dtype).to(device)
    slots = torch.arange(num_tokens, dtype=torch.int64, device=device)
    write_kv(k, v, k_cache, v_cache, slots, k_scale=torch.tensor([scale], device=device),
             v_scale=1.0, impl="triton")
    limit = torch.finfo(dtype).max
    want = vals.clamp(-limit, limit).to(dtype).view(torch.uint8).view(k_cache.shape)
    got = k_cache.view(torch.uint8).cpu()
    bad = got != want
    examples = vals.view(k_cache.shape)[bad][:4].tolist()
    assert not bad.any(), (f"{int(bad.sum())} fp8 codes differ, e.g. x={examples} "
                           f"got {got[bad][:4].tolist()} want {want[bad][:4].tolist()}")
    assert torch.isnan(v_cache.float()).all(), "NaN input must give an fp8 NaN code"


def test_write_kv_fp8_one_scale_tensor_other_default(device):
    """k_scale left at its default (1) while v_scale is a device tensor: both caches hold
    the reference's codes."""
    g = torch.Generator().manual_seed(5)
    k = (torch.randn(6, 2, 64, generator=g) * 3).to(device)
    v = (torch.randn(6, 2, 64, generator=g) * 3).to(device)
    caches = [torch.zeros(4, 2, 4, 64, dtype=torch.float8_e4m3fn, device=device)
              for _ in range(4)]
    slots = torch.tensor([0, 5, 9, 2, 15, 11], device=device)
    v_scale = torch.tensor([0.5], device=device)
    write_kv(k, v, caches[0], caches[1], slots, v_scale=v_scale, impl="triton")
    reference.write_kv(k, v, caches[2], caches[3], slots, v_scale=v_scale)
    for got, want in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_write_kv_skips_padding_and_out_of_range_slots(monkeypatch, device):
    """Slot -1 (and, outside debug mode, any slot outside the cache) writes nothing."""
    monkeypatch.delenv("HYGON_ATTN_DEBUG", raising=False)
    gen = torch.Generator().manual_seed(7)
    num_blocks, h, p, d = 4, 2, 16, 64
    storage = torch.randn(num_blocks, p, h, d, generator=gen).half().to(device)
    v_storage = torch.randn(num_blocks, p, h, d, generator=gen).half().to(device)
    k_cache, v_cache = storage.permute(0, 2, 1, 3), v_storage.permute(0, 2, 1, 3)
    before = (storage.clone(), v_storage.clone())
    k = torch.randn(5, h, d, generator=gen).half().to(device)
    slots = torch.tensor([-1, -1, num_blocks * p, -7, 10 ** 9], dtype=torch.int64, device=device)
    write_kv(k, k, k_cache, v_cache, slots, impl="triton")
    assert torch.equal(storage, before[0]) and torch.equal(v_storage, before[1])
    # one valid slot among them lands where the reference puts it, and nowhere else
    slots[3] = 2 * p + 5
    write_kv(k, k, k_cache, v_cache, slots, impl="triton")
    assert torch.equal(k_cache[2, :, 5], k[3]) and torch.equal(v_cache[2, :, 5], k[3])
    k_cache[2, :, 5] = before[0].permute(0, 2, 1, 3)[2, :, 5]
    v_cache[2, :, 5] = before[1].permute(0, 2, 1, 3)[2, :, 5]
    assert torch.equal(storage, before[0]) and torch.equal(v_storage, before[1])


def test_write_kv_debug_mode_rejects_bad_slots(monkeypatch, device):
    monkeypatch.setenv("HYGON_ATTN_DEBUG", "1")
    k_cache = torch.randn(2, 1, 4, 64).half().to(device)
    v_cache = torch.randn(2, 1, 4, 64).half().to(device)
    k = torch.randn(2, 1, 64).half().to(device)
    before = k_cache.clone()
    with pytest.raises(ValueError, match=r"slot_mapping holds slots in \[0, 8\].*8 slots"):
        write_kv(k, k, k_cache, v_cache, torch.tensor([0, 8], device=device), impl="triton")
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(k, k, k_cache, v_cache, torch.tensor([-2, 1], device=device), impl="triton")
    assert torch.equal(k_cache, before), "nothing may be written when validation fails"
    write_kv(k, k, k_cache, v_cache, torch.tensor([-1, 7], device=device), impl="triton")
    assert torch.equal(k_cache[1, :, 3], k[1])


def test_write_kv_empty_batch_and_reference_impl(device):
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(3, 2, 4, 80, generator=gen).half().to(device)
    v_cache = torch.randn(3, 2, 80, 4, generator=gen).half().to(device).permute(0, 1, 3, 2)
    before = k_cache.clone()
    empty = torch.empty(0, 2, 80, dtype=torch.float16, device=device)
    write_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int32, device=device),
             impl="triton")
    assert torch.equal(k_cache, before)
    k = torch.randn(3, 2, 80, generator=gen).half().to(device)
    v = torch.randn(3, 2, 80, generator=gen).half().to(device)
    slots = torch.tensor([11, -1, 0], dtype=torch.int32, device=device)
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


def _to(t, device):
    """Move an argument to ``device`` keeping broadcast (stride-0) axes broadcast."""
    if t.device.type == "meta":
        return t
    base = t[tuple(slice(0, 1) if st == 0 else slice(None) for st in t.stride())]
    return base.contiguous().to(device).expand(t.shape)


@pytest.mark.parametrize("name,bad,match", [
    ("k", torch.randn(3, 2, 64).to(torch.int32), "k must have dtype"),
    ("k", torch.randn(3, 128).half(), "k must have 3 dims"),
    ("v", torch.randn(3, 2, 32).half(), r"v must have shape \(3, 2, 64\)"),
    ("v", torch.randn(3, 2, 64, device="meta").half(), "v must be on"),
    ("slot_mapping", torch.tensor([0, 1, 2], dtype=torch.float32), "slot_mapping must have dtype"),
    ("slot_mapping", torch.tensor([0, 1], dtype=torch.int32),
     r"slot_mapping must have shape \(3\)"),
    ("k_cache", torch.randn(4, 2, 16, 64).float(), "share a dtype"),
    ("k_cache", torch.randn(4, 3, 16, 64).half(), "same"),
    ("v_cache", torch.randn(4, 2, 16, 32).half(), "same"),
    ("k_cache", torch.randn(4, 2, 16, 64).to(torch.int8), "k_cache must have dtype"),
    ("k_cache", torch.randn(4, 2, 16, 4, 16).half(), "split-x"),
    ("k_cache", torch.randn(1, 2, 16, 64).half().expand(4, 2, 16, 64), "k_cache has stride 0"),
    ("v_cache", torch.randn(4, 2, 1, 64).half().expand(4, 2, 16, 64), "v_cache has stride 0"),
    ("k_scale", torch.tensor([1.0, 2.0, 3.0]),
     "k_scale must be a float, a 1-element tensor or a 1-D tensor of num_kv_heads = 2"),
    ("k_scale", torch.tensor([[1.0, 2.0]]), "k_scale must be a float, a 1-element tensor"),
])
def test_write_kv_rejects_bad_arguments(name, bad, match, device):
    args = {key: _to(t, device) for key, t in _valid_write_args().items()}
    if name == "k_scale":
        with pytest.raises(ValueError, match=match):
            write_kv(**args, k_scale=_to(bad, device), impl="triton")
        return
    args[name] = _to(bad, device)
    with pytest.raises(ValueError, match=match):
        write_kv(**args, impl="triton")


# ------------------------------------------------ copy_blocks, small (CPU interpreter or GPU)


def _run_copy_case(layout, dtype, page_size, head_dim, device, pairs, *, num_blocks=7,
                   num_kv_heads=3, seed=0, impl="triton"):
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
    copy_blocks(gk, gv, mapping, impl=impl)
    what = f"copy_blocks {layout} {dtype} P={page_size} D={head_dim}"
    _assert_storages_equal(storages, expected, what)
    changed = sum(int((_bytes(e) != _bytes(p)).sum()) for e, p in zip(expected, poisoned))
    assert changed > 0, f"{what}: the copies did not change the poisoned cache"


@pytest.mark.parametrize("head_dim", [64, 80])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUT_NAMES)
def test_copy_blocks_matches_reference(layout, dtype, page_size, head_dim, device):
    # block 0 forked twice, 5 -> 2; sources {0, 5} disjoint from destinations {3, 6, 2}
    pairs = [[0, 3], [5, 2], [0, 6]]
    _run_copy_case(layout, dtype, page_size, head_dim, device, pairs,
                   seed=_seed("copy", layout, str(dtype), page_size, head_dim))


def test_copy_blocks_int32_mapping_non_contiguous_and_empty(device):
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(6, 2, 4, 64, generator=gen).half().to(device)
    v = torch.randn(6, 2, 64, 4, generator=gen).half().to(device)
    ek, ev = k.clone(), v.clone()
    # a strided [n, 2] mapping: the columns of a [2, n] tensor
    mapping = torch.tensor([[1, 2], [4, 5]], dtype=torch.int32, device=device).t()  # (1, 4), (2, 5)
    reference.copy_blocks(ek, ev, mapping)
    copy_blocks(k, v, mapping, impl="triton")
    assert torch.equal(k, ek) and torch.equal(v, ev)
    assert torch.equal(k[4], k[1]) and torch.equal(v[5], v[2])
    copy_blocks(k, v, torch.empty(0, 2, dtype=torch.int64, device=device), impl="triton")
    assert torch.equal(k, ek)


def test_copy_blocks_skips_out_of_range_pairs(monkeypatch, device):
    monkeypatch.delenv("HYGON_ATTN_DEBUG", raising=False)
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(4, 2, 16, 64, generator=gen).half().to(device)
    v = torch.randn(4, 2, 16, 64, generator=gen).half().to(device)
    ek, ev = k.clone(), v.clone()
    reference.copy_blocks(ek, ev, torch.tensor([[0, 1]], device=device))
    copy_blocks(k, v, torch.tensor([[0, 1], [0, 4], [-1, 2], [9, 3]], device=device),
                impl="triton")
    assert torch.equal(k, ek) and torch.equal(v, ev)


def test_copy_blocks_debug_mode_checks(monkeypatch, device):
    monkeypatch.setenv("HYGON_ATTN_DEBUG", "1")
    k = torch.randn(4, 2, 16, 64).half().to(device)
    v = torch.randn(4, 2, 16, 64).half().to(device)
    before = k.clone()

    def mapping(pairs):
        return torch.tensor(pairs, device=device)
    with pytest.raises(ValueError, match=r"block_mapping holds block ids in \[0, 4\]"):
        copy_blocks(k, v, mapping([[0, 4]]), impl="triton")
    with pytest.raises(ValueError, match="destinations must be distinct"):
        copy_blocks(k, v, mapping([[0, 2], [1, 2]]), impl="triton")
    with pytest.raises(ValueError, match="disjoint"):
        copy_blocks(k, v, mapping([[0, 1], [1, 2]]), impl="triton")
    assert torch.equal(k, before)
    # the reference reads every source first: a chain is fine there
    ek, ev = k.clone(), v.clone()
    copy_blocks(ek, ev, mapping([[0, 1], [1, 2]]), impl="reference")
    assert torch.equal(ek[1], k[0]) and torch.equal(ek[2], k[1])


@pytest.mark.parametrize("name,bad,match", [
    ("k_cache", torch.randn(4).half(), "k_cache must have 2 or 3 or 4 or 5 dims"),
    ("v_cache", torch.randn(5, 2, 16, 64).half(), "same number of blocks"),
    ("v_cache", torch.randn(4, 2, 16, 64).to(torch.int16), "v_cache must have dtype"),
    ("v_cache", torch.randn(4, 2, 16, 64, device="meta").half(), "v_cache must be on"),
    ("block_mapping", torch.tensor([[0, 1, 2]]), r"block_mapping must have shape \(\*, 2\)"),
    ("block_mapping", torch.tensor([[0.0, 1.0]]), "block_mapping must have dtype"),
    ("block_mapping", torch.tensor([0, 1]), "block_mapping must have 2 dims"),
    ("k_cache", torch.randn(1, 2, 16, 64).half().expand(4, 2, 16, 64),
     "k_cache has stride 0 on its block axis"),
    ("v_cache", torch.randn(4, 1, 16, 64).half().expand(4, 2, 16, 64), "v_cache has stride 0"),
])
def test_copy_blocks_rejects_bad_arguments(name, bad, match, device):
    args = dict(k_cache=torch.randn(4, 2, 16, 64).half().to(device),
                v_cache=torch.randn(4, 2, 16, 64).half().to(device),
                block_mapping=torch.tensor([[0, 1]], device=device))
    args[name] = _to(bad, device)
    with pytest.raises(ValueError, match=match):
        copy_blocks(**args, impl="triton")


# ------------------------------------------------------- through layouts.py (every engine storage)

LAYOUTS_CASES = ([("layout", name) for name in layouts.LAYOUTS if name != "vllm"]
                 + [("vllm", order) for order in layouts.VLLM_ORDERS])


def _layouts_storage(kind, name, dtype, device, *, num_blocks=6, h=3, p=16, d=80):
    """``(tensors, views)``: every tensor of the storage (all vLLM layers) and a function
    from that list to ``(k_view, v_view)`` (canonical views, also the copy_blocks tensors)."""
    if kind == "vllm":
        per_layer = layouts.allocate_vllm(name, num_layers=3, num_blocks=num_blocks,
                                          block_size=p, num_kv_heads=h, head_dim=d,
                                          dtype=dtype, device=device)
        return per_layer, lambda ts: layouts.vllm_kv_views(ts[1])
    v_layout = "bhds" if name == "split_x" else name
    size = dict(num_blocks=num_blocks, block_size=p, num_kv_heads=h, head_dim=d, dtype=dtype,
                device=device)
    k_st, v_st = layouts.allocate(name, **size), layouts.allocate(v_layout, **size)
    return [k_st, v_st], lambda ts: layouts.kv_views(name, ts[0], ts[1], block_size=p,
                                                     v_layout=v_layout)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float8_e5m2], ids=str)
@pytest.mark.parametrize("kind,name", LAYOUTS_CASES)
def test_cache_ops_on_layouts_module_storages(kind, name, dtype, device):
    """write_kv then copy_blocks on the views ``layouts`` builds, for every layout and
    every vLLM physical order (3 layers; layer 1 used, layers 0 and 2 must not change)."""
    tensors, views = _layouts_storage(kind, name, dtype, device)
    before = [t.clone() for t in tensors]
    expected = [t.clone() for t in tensors]  # contents matter, not strides
    gen = torch.Generator().manual_seed(_seed("layouts", kind, name, str(dtype)))
    h, p, d, num_blocks = 3, 16, 80, 6
    k, v, slots = _inputs(9, h, d, num_blocks * p, gen, device, index_dtype=torch.int64,
                          num_pad=2, in_dtype=torch.float16, saturate=False)
    mapping = torch.tensor([[0, 4], [2, 5], [0, 1]], device=device)
    k_scale, v_scale = _scales(dtype, device)
    ek, ev = views(expected)
    reference.write_kv(k, v, ek, ev, slots, k_scale=k_scale, v_scale=v_scale)
    reference.copy_blocks(ek, ev, mapping)
    gk, gv = views(tensors)
    write_kv(k, v, gk, gv, slots, k_scale=k_scale, v_scale=v_scale, impl="triton")
    copy_blocks(gk, gv, mapping, impl="triton")
    _assert_storages_equal(tensors, expected, f"layouts {kind} {name} {dtype}")
    changed = sum(int((_bytes(e) != _bytes(b)).sum()) for e, b in zip(expected, before))
    assert changed > 0, "the ops did not change the random cache"


# ----------------------------------------------------------------------------- GPU, real sizes

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run on the H200 test "
                                                     "machine)")
# (page_size, head_dim): the common shape, token-level pages with D = 80, big pages, D = 96
GPU_SHAPES = [(16, 128), (1, 80), (64, 96)]
GPU_CASES = ([(layout, dtype, 16, 128) for layout in LAYOUT_NAMES for dtype in GPU_DTYPES]
             + [(layout, dtype, p, d) for layout in LAYOUT_NAMES
                for dtype in (torch.bfloat16, torch.float8_e4m3fn) for p, d in GPU_SHAPES[1:]])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout,dtype,page_size,head_dim", GPU_CASES,
                         ids=lambda x: str(x).replace("torch.", ""))
def test_write_kv_gpu_matches_reference(layout, dtype, page_size, head_dim):
    num_blocks = 4096 // page_size * 4  # 16K slots
    _run_write_case(layout, dtype, page_size, head_dim, torch.device("cuda"), num_kv_heads=8,
                    num_blocks=num_blocks, num_tokens=4000, num_pad=37,
                    seed=_seed("gpu", layout, str(dtype), page_size, head_dim),
                    in_dtype=torch.bfloat16 if dtype == torch.bfloat16 else torch.float16)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout,dtype,page_size,head_dim", GPU_CASES,
                         ids=lambda x: str(x).replace("torch.", ""))
def test_copy_blocks_gpu_matches_reference(layout, dtype, page_size, head_dim):
    num_blocks = 2048
    gen = torch.Generator().manual_seed(_seed("gpu-copy", layout, str(dtype), page_size))
    perm = torch.randperm(num_blocks, generator=gen)
    src, dst = perm[:100], perm[100:300]  # each source forked twice; disjoint sets
    pairs = torch.stack([torch.cat([src, src]), dst], dim=1).tolist()
    _run_copy_case(layout, dtype, page_size, head_dim, torch.device("cuda"), pairs,
                   num_blocks=num_blocks, num_kv_heads=8,
                   seed=_seed("gpu-copy", layout, str(dtype), page_size, head_dim))


def _free_cuda_bytes() -> int:
    free, _ = torch.cuda.mem_get_info()
    return free


def _run_head_major_case(num_blocks, device, *, h=2, p=16, d=128):
    """K as bshd ``[N, P, H, D]`` and V head-major ``[H, N, P, D]``; tokens written into the
    last two blocks (and blocks 0-1), then blocks copied from/to the end; the whole
    storages must equal the reference applied to clones."""
    gen = torch.Generator(device=device)
    gen.manual_seed(1234)
    k_store = torch.randn(num_blocks, p, h, d, device=device, dtype=torch.float16, generator=gen)
    v_store = torch.randn(h, num_blocks, p, d, device=device, dtype=torch.float16, generator=gen)

    def views(ks, vs):
        return ks.permute(0, 2, 1, 3), vs.permute(1, 0, 2, 3)

    num_tokens = 3 * p
    last = num_blocks * p
    slots = torch.cat([torch.arange(last - 2 * p, last), torch.arange(5, 5 + p)])
    slots[7] = -1
    slots = slots[torch.randperm(num_tokens, generator=torch.Generator().manual_seed(5))]
    slots = slots.to(device)
    k = torch.randn(num_tokens, h, d, device=device, dtype=torch.float16, generator=gen)
    v = torch.randn(num_tokens, h, d, device=device, dtype=torch.float16, generator=gen)
    pairs = torch.tensor([[num_blocks - 1, 3], [1, num_blocks - 3], [2, num_blocks - 4]],
                         device=device)

    ek_store, ev_store = k_store.clone(), v_store.clone()
    ek, ev = views(ek_store, ev_store)
    reference.write_kv(k, v, ek, ev, slots)
    reference.copy_blocks(ek, ev, pairs)
    gk, gv = views(k_store, v_store)
    write_kv(k, v, gk, gv, slots, impl="triton")
    copy_blocks(gk, gv, pairs, impl="triton")
    assert torch.equal(gk[num_blocks - 1, :, p - 1], k[(slots == last - 1).nonzero()[0, 0]])
    assert torch.equal(gv[num_blocks - 3], gv[1]) and torch.equal(gk[3], gk[num_blocks - 1])
    assert torch.equal(k_store.view(torch.int16), ek_store.view(torch.int16)), "K storage"
    assert torch.equal(v_store.view(torch.int16), ev_store.view(torch.int16)), "V storage"


def test_cache_ops_head_major_v_small(device):
    _run_head_major_case(9, device, d=64)


@pytest.mark.gpu
@needs_cuda
def test_cache_ops_gpu_cache_over_2_pow_31_elements():
    """Both caches hold 2^31 + 2^16 fp16 elements: writes and copies at the very end must
    land there (int64 offsets). In the head-major V, ``h*s_h + blk*s_b`` passes 2^31
    although every stride fits in int32."""
    h, p, d = 2, 16, 128
    per_block = h * p * d
    num_blocks = 2 ** 31 // per_block + 16
    numel = num_blocks * per_block
    assert numel > 2 ** 31
    need = 4 * numel * 2 + (1 << 30)  # two caches, their reference clones, slack
    if _free_cuda_bytes() < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory for two "
                    f"{numel}-element caches and their reference copies")
    _run_head_major_case(num_blocks, torch.device("cuda"), h=h, p=p, d=d)
