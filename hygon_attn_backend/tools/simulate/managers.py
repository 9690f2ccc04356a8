"""KV memory managers the simulator drives, all behind one small interface.

* :class:`ContiguousManager`: the baseline without paging. Each request reserves one
  contiguous region when it is admitted, either of the maximum sequence length
  (``max-len``) or of its own final length (``exact``, an oracle that knows the output
  length), placed first-fit in a linear arena of ``capacity`` token slots. No reuse.
* :class:`VllmManager`: vLLM's own ``KVCacheManager`` (and its ``BlockPool``) with
  prefix caching: full blocks are hashed (chained over the prefix) and a new request
  reuses the longest run of cached blocks; freed blocks stay cached until evicted.
* :class:`SglangManager`: SGLang's own ``RadixCache`` over its ``ReqToTokenPool`` and
  its token (page 1) or paged allocator: a request reuses the longest token prefix in
  the radix tree (page-aligned), finished requests are inserted into the tree, the tree
  is evicted (LRU) when the allocator runs dry.

The engines are imported when a manager is built, never at module import.

Interface (``rid`` is the request's index in the trace, ``tokens`` the ids to prefill):
``admit(rid, tokens) -> hit tokens | None`` (None: no room now; nothing changed),
``append(rid, token) -> bool`` (one generated token; False: no room),
``finish(rid)`` (done: keep what the engine caches), ``preempt(rid)`` (give the memory
back; the request will be prefilled again), ``slots(rid)`` (the token slots holding its
K/V), ``usage(rids) -> (reserved, used)`` (slots held for those requests, counting whole
pages or regions; distinct slots holding their K/V), ``free_tokens()`` (slots a new request could get, eviction included) and
``cached_tokens()`` (slots holding reusable K/V that no running request holds).
"""

from __future__ import annotations

from typing import Dict, List, Optional


class ContiguousManager:
    """One contiguous region per request, first-fit in ``[0, capacity)``."""

    def __init__(self, capacity: int, *, reserve: str = "max-len", max_len: int = 2048):
        if reserve not in ("max-len", "exact"):
            raise ValueError(f"reserve must be 'max-len' or 'exact', got {reserve!r}")
        self.capacity, self.reserve, self.max_len = capacity, reserve, max_len
        self.name = f"contiguous ({reserve})"
        self.page = 1
        self.holes = [(0, capacity)]  # sorted (start, length)
        self.regions: Dict[int, tuple] = {}  # rid -> (start, length)
        self.lens: Dict[int, int] = {}
        self.final: Dict[int, int] = {}

    def set_final_len(self, rid: int, n: int) -> None:
        """The request's final length (prompt + output), known only to ``exact``."""
        self.final[rid] = n

    def region_size(self, rid: int, n_tokens: int) -> int:
        if self.reserve == "max-len":
            return self.max_len
        return max(n_tokens, self.final.get(rid, n_tokens))

    def admit(self, rid: int, tokens: List[int]) -> Optional[int]:
        if len(tokens) > self.max_len:
            raise ValueError(f"request {rid}: {len(tokens)} tokens exceed max_len "
                             f"{self.max_len}")
        size = self.region_size(rid, len(tokens))
        for i, (start, length) in enumerate(self.holes):
            if length >= size:
                rest = (start + size, length - size)
                self.holes[i:i + 1] = [rest] if rest[1] else []
                self.regions[rid] = (start, size)
                self.lens[rid] = len(tokens)
                return 0
        return None

    def append(self, rid: int, token: int) -> bool:
        if self.lens[rid] + 1 > self.regions[rid][1]:
            return False  # the region is full: only a longer max_len would help
        self.lens[rid] += 1
        return True

    def _release(self, rid: int) -> None:
        start, size = self.regions.pop(rid)
        self.lens.pop(rid)
        holes = sorted(self.holes + [(start, size)])
        merged = []
        for s, n in holes:
            if merged and merged[-1][0] + merged[-1][1] == s:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((s, n))
        self.holes = merged

    finish = preempt = _release

    def slots(self, rid: int) -> List[int]:
        start = self.regions[rid][0]
        return list(range(start, start + self.lens[rid]))

    def usage(self, rids) -> tuple:
        return sum(self.regions[r][1] for r in rids), sum(self.lens[r] for r in rids)

    def free_tokens(self) -> int:
        return sum(n for _, n in self.holes)

    def largest_hole(self) -> int:
        return max((n for _, n in self.holes), default=0)

    def cached_tokens(self) -> int:
        return 0


class VllmManager:
    """vLLM's ``KVCacheManager`` with prefix caching on one full-attention group."""

    def __init__(self, capacity: int, *, block_size: int = 16, max_len: int = 1 << 20,
                 caching: bool = True):
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,
                                                KVCacheGroupSpec)
        from vllm.v1.request import Request

        self._request_cls, self._params_cls = Request, SamplingParams
        self.page = block_size
        self.name = f"vLLM block-hash reuse, block {block_size}" if caching else (
            f"vLLM paged, block {block_size}, no reuse")
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1,
                                 dtype=torch.float16)
        # the pool holds one null block besides the usable ones
        config = KVCacheConfig(num_blocks=capacity // block_size + 1, kv_cache_tensors=[],
                               kv_cache_groups=[KVCacheGroupSpec(["attn"], spec)])
        init_none_hash(sha256)
        self.mgr = KVCacheManager(config, max_model_len=max_len,
                                  scheduler_block_size=block_size, hash_block_size=block_size,
                                  enable_caching=caching)
        self.hasher = get_request_block_hasher(block_size, sha256)
        self.reqs: Dict[int, object] = {}
        self.serial = 0
        self.capacity = self.free_tokens()

    def admit(self, rid: int, tokens: List[int]) -> Optional[int]:
        self.serial += 1  # a preempted request comes back under a new id
        req = self._request_cls(f"{rid}-{self.serial}", list(tokens),
                                self._params_cls(max_tokens=1), None,
                                block_hasher=self.hasher)
        blocks, hit, _ = self.mgr.get_computed_blocks(req)
        if self.mgr.allocate_slots(req, len(tokens) - hit, hit, blocks) is None:
            return None
        req.num_computed_tokens = len(tokens)
        self.reqs[rid] = req
        return hit

    def append(self, rid: int, token: int) -> bool:
        req = self.reqs[rid]
        if req.num_tokens == req.num_computed_tokens:  # not appended by a failed try
            req.append_output_token_ids(token)
        if self.mgr.allocate_slots(req, 1) is None:
            return False
        req.num_computed_tokens += 1
        return True

    def finish(self, rid: int) -> None:
        self.mgr.free(self.reqs.pop(rid))  # full blocks stay cached (hashed) until evicted

    preempt = finish

    def slots(self, rid: int) -> List[int]:
        req = self.reqs[rid]
        (blocks,) = self.mgr.get_block_ids(req.request_id)
        n = req.num_computed_tokens
        return [b * self.page + i % self.page for i, b in
                ((i, blocks[i // self.page]) for i in range(n))]

    def usage(self, rids) -> tuple:
        filled: Dict[int, int] = {}  # block -> tokens written in it (a shared block is full)
        for r in rids:
            req = self.reqs[r]
            n = req.num_computed_tokens
            for i, b in enumerate(self.mgr.get_block_ids(req.request_id)[0]):
                filled[b] = max(filled.get(b, 0), min(self.page, n - i * self.page))
        return len(filled) * self.page, sum(filled.values())

    def free_tokens(self) -> int:
        return self.mgr.block_pool.get_num_free_blocks() * self.page

    def cached_tokens(self) -> int:
        pool = self.mgr.block_pool
        return self.page * sum(1 for b in pool.blocks
                               if b.ref_cnt == 0 and b.block_hash is not None)


class SglangManager:
    """SGLang's ``RadixCache`` with its ``ReqToTokenPool`` and token/paged allocator."""

    def __init__(self, capacity: int, *, page_size: int = 1, max_reqs: int = 4096,
                 max_len: int = 32768):
        from array import array

        import torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import (EvictParams, InsertParams,
                                                            MatchPrefixParams)
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

        self._array, self._key = array, RadixKey
        self._evict, self._insert, self._match = EvictParams, InsertParams, MatchPrefixParams
        self.torch = torch
        self.page = page_size
        self.name = f"SGLang radix reuse, page {page_size}"
        if page_size == 1:  # the pool object only serves CPU copies: none here
            self.alloc = TokenToKVPoolAllocator(capacity, torch.float16, "cpu", None,
                                                need_sort=False)
        else:
            self.alloc = PagedTokenToKVPoolAllocator(capacity, page_size, torch.float16, "cpu",
                                                     None, need_sort=False)
        self.r2t = ReqToTokenPool(size=max_reqs, max_context_len=max_len, device="cpu",
                                  enable_memory_saver=False)
        self.tree = RadixCache(CacheInitParams(
            disable=False, req_to_token_pool=self.r2t, token_to_kv_pool_allocator=self.alloc,
            page_size=page_size))
        self.reqs: Dict[int, dict] = {}
        self.capacity = self.free_tokens()

    def _make_room(self, need: int) -> None:
        if self.alloc.available_size() < need + self.page:
            self.tree.evict(self._evict(num_tokens=need + self.page))

    def _alloc(self, prefix_len: int, new: int, last: int):
        torch = self.torch
        self._make_room(new)
        if self.page == 1:
            return self.alloc.alloc(new)
        pre = torch.tensor([prefix_len], dtype=torch.int64)
        seq = torch.tensor([prefix_len + new], dtype=torch.int64)
        last_t = torch.tensor([last], dtype=torch.int64)
        if new == 1 and prefix_len > 0:
            return self.alloc.alloc_decode(seq, seq, last_t)
        return self.alloc.alloc_extend(pre, pre, seq, seq, last_t, new)

    def admit(self, rid: int, tokens: List[int]) -> Optional[int]:
        # as the scheduler does: the last token is always computed (its logits are needed)
        key = self._key(self._array("q", tokens[:len(tokens) - 1]))
        match = self.tree.match_prefix(self._match(key=key))
        node, cached = match.last_device_node, match.device_prefix_len
        self.tree.inc_lock_ref(node)
        r2t = self.r2t.req_to_token
        prefix = self.tree.path_device_indices(node)[:cached] if cached else None
        last = int(prefix[-1]) if cached else -1
        locs = self._alloc(cached, len(tokens) - cached, last)
        if locs is None:
            self.tree.dec_lock_ref(node)
            return None
        row = self.r2t.alloc_rows(1)[0]
        if cached:
            r2t[row, :cached] = prefix.to(r2t.dtype)
        r2t[row, cached:len(tokens)] = locs.to(r2t.dtype)
        self.reqs[rid] = dict(row=row, node=node, cached=cached, tokens=list(tokens))
        self._checkpoint(rid)
        return cached

    def _checkpoint(self, rid: int) -> None:
        """After the prefill, as SGLang's scheduler checkpoints a request into the tree:
        insert its page-aligned tokens (later requests can hit them at once), free the
        slots of any part the tree already held, point the row at the tree's slots and
        move the lock to the new node."""
        st = self.reqs[rid]
        n = len(st["tokens"])
        aligned = n // self.page * self.page
        if aligned <= st["cached"]:
            return
        r2t = self.r2t.req_to_token
        kv = r2t[st["row"], :n].to(self.torch.int64)
        key = self._key(self._array("q", st["tokens"][:aligned]))
        result = self.tree.insert(self._insert(key=key, value=kv[:aligned].clone()))
        if result.prefix_len > st["cached"]:  # the tree already held these: free our copy
            self.alloc.free(kv[st["cached"]:result.prefix_len])
        node = self.tree.match_prefix(self._match(key=key)).last_device_node
        indices = self.tree.path_device_indices(node)
        r2t[st["row"], st["cached"]:len(indices)] = indices[st["cached"]:].to(r2t.dtype)
        self.tree.dec_lock_ref(st["node"])
        self.tree.inc_lock_ref(node)
        st["node"], st["cached"] = node, len(indices)

    def append(self, rid: int, token: int) -> bool:
        st = self.reqs[rid]
        n = len(st["tokens"])
        r2t = self.r2t.req_to_token
        locs = self._alloc(n, 1, int(r2t[st["row"], n - 1]))
        if locs is None:
            return False
        r2t[st["row"], n] = int(locs[0])
        st["tokens"].append(token)
        return True

    def _release(self, rid: int, insert: bool) -> None:
        st = self.reqs.pop(rid)
        n = len(st["tokens"])
        kv = self.r2t.req_to_token[st["row"], :n].to(self.torch.int64)
        aligned = n // self.page * self.page
        done = st["cached"]
        if insert:
            key = self._key(self._array("q", st["tokens"][:aligned]))
            result = self.tree.insert(self._insert(key=key, value=kv[:aligned].clone()))
            if result.prefix_len > done:  # the tree already held these: free our copy
                self.alloc.free(kv[done:result.prefix_len])
            done = max(done, aligned)
        if done < n:
            self.alloc.free(kv[done:])
        self.tree.dec_lock_ref(st["node"])
        self.r2t.free_rows([st["row"]])

    def finish(self, rid: int) -> None:
        self._release(rid, insert=True)

    def preempt(self, rid: int) -> None:
        self._release(rid, insert=False)

    def slots(self, rid: int) -> List[int]:
        st = self.reqs[rid]
        return self.r2t.req_to_token[st["row"], :len(st["tokens"])].tolist()

    def usage(self, rids) -> tuple:
        torch = self.torch
        if not rids:
            return 0, 0
        rows = [self.r2t.req_to_token[self.reqs[r]["row"], :len(self.reqs[r]["tokens"])]
                for r in rids]
        slots = torch.unique(torch.cat(rows).to(torch.int64))
        pages = torch.unique(slots // self.page)
        return pages.numel() * self.page, slots.numel()

    def free_tokens(self) -> int:
        return self.alloc.available_size() + self.tree.evictable_size()

    def cached_tokens(self) -> int:
        return self.tree.evictable_size()


MANAGER_SPECS = "contiguous-max, contiguous-exact, vllm-B, vllm-B-nocache, sglang-P"


def parse_spec(spec: str) -> tuple:
    """``(kind, size, caching)`` of a manager spec (see :func:`make_manager`); a
    ValueError naming the spec for anything else (B and P: positive integers)."""
    if spec in ("contiguous-max", "contiguous-exact"):
        return spec, 1, False
    parts = spec.split("-")
    shape_ok = (parts[0] == "vllm" and (len(parts) == 2 or parts[2:] == ["nocache"])) or (
        parts[0] == "sglang" and len(parts) == 2)
    size = int(parts[1]) if shape_ok and parts[1].isdigit() else 0
    if size < 1:
        raise ValueError(f"unknown manager {spec!r}: one of {MANAGER_SPECS} (B, P: block "
                         f"and page sizes, positive integers), e.g. vllm-16, sglang-1")
    return parts[0], size, parts[0] == "vllm" and len(parts) == 2


def make_manager(spec: str, capacity: int, *, max_len: int):
    """``contiguous-max``, ``contiguous-exact``, ``vllm-B`` (block size B),
    ``vllm-B-nocache``, ``sglang-P`` (page size P)."""
    kind, size, caching = parse_spec(spec)
    if kind == "contiguous-max":
        return ContiguousManager(capacity, reserve="max-len", max_len=max_len)
    if kind == "contiguous-exact":
        return ContiguousManager(capacity, reserve="exact", max_len=max_len)
    if kind == "vllm":
        return VllmManager(capacity, block_size=size, max_len=max_len, caching=caching)
    return SglangManager(capacity, page_size=size, max_len=max_len)
