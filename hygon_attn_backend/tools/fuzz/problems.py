"""Random problem pieces shared by the fuzzers: value sets, caches in every layout, block
tables (with hostile ids), lengths.

Every draw takes a ``random.Random`` (host choices) and uses torch's global generator for
tensor contents; the runner seeds both per case, so ``(seed, case)`` reproduces a case.

Kernel specialisations are bounded on purpose: Triton compiles once per combination of
compile-time values (head_dim, page size, flags, dtypes) and of each integer argument's
``== 1`` / ``% 16 == 0`` (strides among them), so the compile-time part of a case comes
from a *profile* (drawn once per seed, reused by every ``NUM_PROFILES``-th case), strides
that depend on the batch keep the profile's class (:func:`table_width`), and only sizes
Triton does not specialise on, lengths, ids and values vary freely.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from hygon_attn_backend import layouts

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
HEAD_DIMS = (64, 80, 96, 128, 192, 256)
HEAD_DIMS_TINY = (64, 80)
PAGES = (1, 2, 3, 5, 8, 16, 17, 32, 64, 100, 128, 256)
PAGES_TINY = (1, 3, 16)
GROUPS = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32, 64)
GROUPS_TINY = (1, 2, 3, 4, 5, 8)
# "split_x" is vLLM's legacy 5-D K cache with a V-transposed (bhds) V cache
ATTN_LAYOUTS = ("bshd", "bhsd", "bhds", "sglang_nhd", "sglang_hnd") + tuple(
    f"vllm_{o}" for o in layouts.VLLM_ORDERS)
ALL_LAYOUTS = ATTN_LAYOUTS + ("split_x",)


class Strata:
    """Stratified choice of compile-time values over a seed's ``count`` profiles: for each
    value set, profile ``index`` takes entry ``perm[index] % len(values)`` of a per-seed
    permutation ``perm`` of the profiles, so every value appears in ``count // len(values)``
    or one more profiles (a plain draw would miss some of 12 layouts), and the sets are
    combined at random (a shared period would pair page size ``p`` with one layout)."""

    def __init__(self, key: str, index: int, count: int, keep=None):
        self.key, self.index, self.count = key, index, count
        self.keep = keep or {}  # name -> predicate: the values a pick of that name keeps

    def pick(self, name: str, values: tuple):
        if name in self.keep:
            values = tuple(v for v in values if self.keep[name](v))
            if not values:
                raise ValueError(f"no value of {name} passes the filter")
        perm = random.Random(f"{self.key}:{name}").sample(range(self.count), self.count)
        return values[perm[self.index] % len(values)]


def bad_block_ids(num_blocks: int, index_dtype: torch.dtype) -> tuple:
    """Ids that must behave as absent keys: negative, just past the end, far past it."""
    big = 2**31 - 1 if index_dtype == torch.int32 else 2**40
    return (-1, -5, -(2**31), num_blocks, num_blocks + 1000, big)


@dataclass
class Cache:
    """A K/V cache pair in one layout.

    k, v: the canonical ``[num_blocks, H, P, D]`` views the attention ops and ``write_kv``
       take (``k`` 5-D for split-x). k_blocks, v_blocks: the tensors ``copy_blocks`` takes
       (dim 0 = block). roots: the whole storages, to compare byte for byte.
    """

    k: torch.Tensor
    v: torch.Tensor
    k_blocks: torch.Tensor
    v_blocks: torch.Tensor
    roots: list


def _root(t: torch.Tensor) -> torch.Tensor:
    return t._base if t._base is not None else t


def build_cache(layout: str, *, num_blocks: int, page: int, kv_heads: int, head_dim: int,
                dtype: torch.dtype, device) -> Cache:
    """A random cache in ``layout`` (a name of :data:`ALL_LAYOUTS`)."""
    dims = dict(num_blocks=num_blocks, block_size=page, num_kv_heads=kv_heads,
                head_dim=head_dim, dtype=dtype, device=device)
    if layout.startswith("vllm_"):
        kv = layouts.allocate_vllm(layout[5:], num_layers=2, **dims)[1]  # layer 1 of 2
        k, v = layouts.vllm_kv_views(kv)
        return Cache(k, v, k, v, [_root(kv)])
    if layout == "split_x":
        k_st = layouts.allocate("split_x", **dims)
        v_st = layouts.allocate("bhds", **dims)
        k, v = layouts.kv_views("split_x", k_st, v_st, v_layout="bhds")
        return Cache(k, v, k_st, v_st, [k_st, v_st])
    k_st, v_st = layouts.allocate(layout, **dims), layouts.allocate(layout, **dims)
    k, v = layouts.kv_views(layout, k_st, v_st, block_size=page)
    if layout == "sglang_nhd":  # token pool [rows, H, D]: a block is P consecutive rows
        k_blk = k_st.view(num_blocks, page, kv_heads, head_dim)
        v_blk = v_st.view(num_blocks, page, kv_heads, head_dim)
        return Cache(k, v, k_blk, v_blk, [k_st, v_st])
    return Cache(k, v, k_st, v_st, [k_st, v_st])


def copy_cache(cache: Cache, device=None) -> Cache:
    """A deep copy of ``cache`` (on ``device``, default the same): new root storages and
    the same views into them (same shapes, strides and offsets)."""
    roots = [r.clone() if device is None else r.to(device) for r in cache.roots]

    def remap(t):
        for r, c in zip(cache.roots, roots):
            if t.untyped_storage().data_ptr() == r.untyped_storage().data_ptr():
                offset = t.storage_offset() - r.storage_offset() + c.storage_offset()
                return c.as_strided(t.shape, t.stride(), offset)
        raise AssertionError("a cache view outside its roots")
    return Cache(remap(cache.k), remap(cache.v), remap(cache.k_blocks),
                 remap(cache.v_blocks), roots)


def storage_bytes(cache: Cache) -> list:
    """Copies of every root storage as raw bytes (for bit-exact comparisons)."""
    return [r.detach().reshape(-1).view(torch.uint8).clone() for r in cache.roots]


def draw_batch_size(rng: random.Random, tiny: bool) -> int:
    if tiny:
        return rng.randint(1, 3)
    r = rng.random()
    if r < 0.6:
        return rng.randint(1, 4)
    if r < 0.9:
        return rng.randint(5, 16)
    return rng.randint(17, 64)


def draw_length(rng: random.Random, tiny: bool, *, allow_long: bool) -> int:
    """A key length in 0..64k: mostly short, some medium, a rare long one."""
    if tiny:
        return 0 if rng.random() < 0.1 else rng.randint(1, 48)
    r = rng.random()
    if r < 0.05:
        return 0
    if r < 0.75:
        return rng.randint(1, 300)
    if r < 0.97 or not allow_long:
        return rng.randint(301, 4096)
    return rng.randint(4097, 65536)


@dataclass
class Table:
    """Block table of a batch (``hostile``: how many used entries hold bad ids)."""

    table: torch.Tensor
    num_blocks: int
    hostile: int


def table_width(rng: random.Random, needed: int, *, x16: bool) -> int:
    """Columns of a block table with at least ``needed`` used ones: a multiple of 16 with
    ``x16``, else >= 2 and not a multiple of 16. The row stride is a kernel argument that
    Triton specialises on (``== 1``, ``% 16 == 0``), so a profile fixes its class and the
    cases of a profile share one kernel."""
    width = needed + rng.randint(0, 2)
    if x16:
        return -(-max(width, 1) // 16) * 16 + 16 * rng.randint(0, 1)
    width = max(width, 2)
    return width + 1 if width % 16 == 0 else width


def build_table(rng: random.Random, cols_needed: list, *, index_dtype: torch.dtype, device,
                hostile: bool, width_x16: bool) -> Table:
    """Distinct physical blocks for every used entry (a random permutation), garbage in the
    unused columns (:func:`table_width` columns), and with ``hostile`` 1-3 used entries
    replaced by bad ids."""
    width = table_width(rng, max(cols_needed + [0]), x16=width_x16)
    num_used = sum(cols_needed)
    num_blocks = num_used + rng.randint(1, 8)
    table = torch.randint(-3, num_blocks + 4, (len(cols_needed), width), dtype=torch.int64)
    used = torch.arange(width).unsqueeze(0) < torch.tensor(cols_needed).view(-1, 1)
    table[used] = torch.randperm(num_blocks)[:num_used]
    bad = 0
    if hostile and num_used:
        where = used.nonzero()  # [num_used, 2]
        for i in rng.sample(range(num_used), min(num_used, rng.randint(1, 3))):
            table[where[i, 0], where[i, 1]] = rng.choice(bad_block_ids(num_blocks, index_dtype))
            bad += 1
    return Table(table.to(device=device, dtype=index_dtype), num_blocks, bad)


SCALE_KINDS = ("float", "tensor", "per_head")  # how an fp8 case passes k_scale / v_scale


def fp8_scales(rng: random.Random, cache_dtype: torch.dtype, *, kind: str, num_kv_heads: int,
               device, lo: float, hi: float) -> dict:
    """``k_scale``/``v_scale`` keyword arguments for an fp8 cache, else no arguments.
    ``kind`` (:data:`SCALE_KINDS`): floats, 1-element fp32 tensors, or fp32 tensors of
    ``num_kv_heads`` elements (one scale per KV head; 1 element when there is one head)."""
    if cache_dtype not in FP8:
        return {}
    if kind not in SCALE_KINDS:
        raise ValueError(f"kind must be one of {SCALE_KINDS}, got {kind!r}")
    n = num_kv_heads if kind == "per_head" else 1
    ks = [rng.uniform(lo, hi) for _ in range(n)]
    vs = [rng.uniform(lo, hi) for _ in range(n)]
    if kind == "float":
        return dict(k_scale=ks[0], v_scale=vs[0])
    return dict(k_scale=torch.tensor(ks, dtype=torch.float32, device=device),
                v_scale=torch.tensor(vs, dtype=torch.float32, device=device))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
