"""Fuzz cases of the cache ops: ``write_kv`` and ``copy_blocks`` against the reference,
bit for bit over the *whole* storage (another layer, the other half of vLLM's K|V tensor,
a slot marked -1: any stray byte fails).

Hostile share: slots below -1 or past the end (skipped), copy pairs with ids outside
``[0, num_blocks)`` (skipped).
"""

from __future__ import annotations

import random

import torch

from hygon_attn_backend import reference
from hygon_attn_backend.tools.fuzz import problems as pb
from hygon_attn_backend.ops.cache import copy_blocks, write_kv

HOSTILE_SHARE = 0.2


def _profile(rng: random.Random, tiny: bool, strata: pb.Strata) -> dict:
    k_dtypes = (torch.float16, torch.float32) if tiny else (torch.float16, torch.bfloat16,
                                                            torch.float32)
    dtype = rng.choice(k_dtypes)
    return dict(
        dtype=dtype,
        cache_dtype=rng.choices((dtype, torch.float16) + pb.FP8, weights=(5, 1, 1, 1))[0],
        kv_heads=rng.choice((1, 2) if tiny else (1, 2, 4, 8)),
        head_dim=strata.pick("head_dim", pb.HEAD_DIMS_TINY if tiny else pb.HEAD_DIMS),
        page=strata.pick("page", pb.PAGES_TINY if tiny else pb.PAGES),
        layout=strata.pick("layout", pb.ALL_LAYOUTS),
        index_dtype=rng.choice((torch.int32, torch.int64)),
        scales=rng.choice(pb.SCALE_KINDS))


write_kv_profile = _profile
copy_blocks_profile = _profile


def _storage_problem(cache: pb.Cache, want: list, what: str):
    got = pb.storage_bytes(cache)
    for i, (g, w) in enumerate(zip(got, want)):
        if not torch.equal(g, w):
            diff = int((g != w).sum())
            return f"{what}: storage {i} differs from the reference in {diff} bytes"
    return None


def _desc(prof: dict, **extra) -> str:
    items = {**prof, **extra}
    return " ".join(f"{k}={str(v).replace('torch.', '')}" for k, v in items.items())


def write_kv_case(rng: random.Random, prof: dict, device, tiny: bool):
    page, hkv, dim = prof["page"], prof["kv_heads"], prof["head_dim"]
    num_blocks = rng.randint(1, 8 if tiny else 64)
    num_slots = num_blocks * page
    num_tokens = rng.randint(0, min(num_slots, 24 if tiny else 512))
    slots = torch.randperm(num_slots)[:num_tokens].tolist()  # distinct
    for i in range(num_tokens):
        if rng.random() < 0.1:
            slots[i] = -1  # padding
    hostile = rng.random() < HOSTILE_SHARE and num_tokens > 0
    if hostile:
        bad = (-2, -7, -(2**31), num_slots, num_slots + 1, num_slots + 10**6, 2**31 - 1)
        for i in rng.sample(range(num_tokens), rng.randint(1, min(3, num_tokens))):
            slots[i] = rng.choice(bad)
    cache = pb.build_cache(prof["layout"], num_blocks=num_blocks, page=page, kv_heads=hkv,
                           head_dim=dim, dtype=prof["cache_dtype"], device=device)
    want_cache = pb.copy_cache(cache)
    k = torch.randn(num_tokens, hkv, dim, device=device).to(prof["dtype"]) * 3
    v = torch.randn(num_tokens, hkv, dim, device=device).to(prof["dtype"]) * 3
    slot_t = torch.tensor(slots, dtype=prof["index_dtype"], device=device)
    kw = pb.fp8_scales(rng, prof["cache_dtype"], kind=prof["scales"], num_kv_heads=hkv,
                       device=device, lo=0.1, hi=3.0)
    reference.write_kv(k, v, want_cache.k, want_cache.v, slot_t, **kw)
    want = pb.storage_bytes(want_cache)
    write_kv(k, v, cache.k, cache.v, slot_t, impl="triton", **kw)
    desc = _desc(prof, num_blocks=num_blocks, num_tokens=num_tokens, hostile=hostile)
    return _storage_problem(cache, want, "write_kv"), desc


def copy_blocks_case(rng: random.Random, prof: dict, device, tiny: bool):
    page, hkv, dim = prof["page"], prof["kv_heads"], prof["head_dim"]
    num_blocks = rng.randint(2, 8 if tiny else 64)
    ids = torch.randperm(num_blocks).tolist()
    half = rng.randint(1, num_blocks // 2)
    srcs, dsts = ids[:half], ids[half:]
    n = rng.randint(0, len(dsts))
    pairs = [[rng.choice(srcs), d] for d in dsts[:n]]  # distinct dst, dst disjoint from src
    hostile = rng.random() < HOSTILE_SHARE
    if hostile:
        big = 2**31 - 1 if prof["index_dtype"] == torch.int32 else 2**40
        bad = (-1, -3, num_blocks, num_blocks + 7, big, -(2**31))
        for _ in range(rng.randint(1, 3)):
            pair = [rng.choice(bad), rng.choice(dsts)] if rng.random() < 0.5 else \
                [rng.choice(srcs), rng.choice(bad)]
            pairs.insert(rng.randint(0, len(pairs)), pair)
    cache = pb.build_cache(prof["layout"], num_blocks=num_blocks, page=page, kv_heads=hkv,
                           head_dim=dim, dtype=prof["cache_dtype"], device=device)
    want_cache = pb.copy_cache(cache)
    mapping = torch.tensor(pairs, dtype=prof["index_dtype"], device=device).reshape(-1, 2)
    reference.copy_blocks(want_cache.k_blocks, want_cache.v_blocks, mapping)
    want = pb.storage_bytes(want_cache)
    copy_blocks(cache.k_blocks, cache.v_blocks, mapping, impl="triton")
    desc = _desc(prof, num_blocks=num_blocks, pairs=len(pairs), hostile=hostile)
    return _storage_problem(cache, want, "copy_blocks"), desc

