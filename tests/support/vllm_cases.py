"""Batch cases of vLLM's attention-backend harness (upstream ``tests/v1/attention``), engine-free.

The cases (small/medium/large decode, prefill with context, mixed, single) follow the
batch specs of vLLM's own backend tests; the data, the paged cache and the oracle are
ours. Nothing here imports vLLM: the GPU tests drive the backend's engine-free core
(``integrations.vllm._core``) with these cases on machines where vLLM cannot be
installed, and the CPU tests wrap the same data in vLLM's real metadata classes.

A case: for each request ``b`` a context of ``seq_len - query_len`` tokens already in
the cache and ``query_len`` new tokens whose K/V the backend writes itself. The cache is
vLLM's combined per-layer tensor, logical ``[num_blocks, Hkv, P, 2*D]``, with the
physical order of a ``KVCacheLayout`` and blocks handed out in a random order (block 0
is vLLM's null block and never used). The oracle is ``reference.prefix_prefill_attention``
on one contiguous block per request, in float64 (and in the input dtype for the budget).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hygon_attn_backend import reference

# name -> (seq_lens, query_lens), as upstream's BATCH_SPECS (plus a few of ours, marked).
BATCH_SPECS = {
    "small_decode": ([32, 40], [1, 1]),
    "small_prefill": ([32, 40], [8, 8]),
    "mixed_small": ([32, 40, 48, 56], [1, 1, 5, 5]),
    "medium_decode": ([128, 256, 512, 1024, 128, 256, 512, 1024], [1] * 8),
    "medium_prefill": ([256, 512, 1024, 2048], [16, 16, 16, 16]),
    "mixed_medium": ([512, 1024, 2048, 512, 1024, 2048], [1, 1, 1, 7, 7, 7]),
    "large_decode": ([2048] * 32, [1] * 32),
    "large_prefill": ([4096] * 8, [32] * 8),
    "single_decode": ([1024], [1]),
    "single_prefill": ([1024], [64]),
    # ours: first prefills (no context), sequences ending mid-page, one-token extends
    "prefill_no_context": ([17, 33, 5], [17, 33, 5]),
    "mixed_mid_page": ([1, 19, 45, 31, 70], [1, 1, 1, 30, 13]),
}

# KVCacheLayout name -> physical axis order of the (layers, blocks, heads, slots, content)
# storage, as in vllm.v1.kv_cache_layout (L B H N C logical axes).
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
NUM_LAYERS = 2  # the storage holds two layers; the case uses the second (non-zero offset)


@dataclass
class Case:
    seq_lens: list
    query_lens: list
    num_q_heads: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    kv_cache_dtype: str  # vLLM's string: "auto" or "fp8"
    # per batch
    query: torch.Tensor  # [T, Hq, D]
    key: torch.Tensor  # [T, Hkv, D] new tokens
    value: torch.Tensor
    kv_cache: torch.Tensor  # [num_blocks, Hkv, P, 2D] view (uint8 storage for fp8)
    block_table: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens_t: torch.Tensor  # [B] int32
    k_scale: torch.Tensor  # [1] float32
    v_scale: torch.Tensor
    k_full: list  # per request [seq_len, Hkv, D] as the oracle sees it (fp8: dequantized)
    v_full: list

    @property
    def num_tokens(self) -> int:
        return int(sum(self.query_lens))


def make_case(seq_lens, query_lens, *, num_q_heads=8, num_kv_heads=2, head_size=64,
              block_size=16, dtype=torch.float16, kv_cache_dtype="auto", layout="LBHNC",
              device="cpu", seed=0, per_head_scales=False) -> Case:
    """Random inputs and a prepopulated paged cache for one batch (see module doc).
    ``per_head_scales``: fp8 scales of ``[num_kv_heads]`` elements (vLLM's ``attn_head``
    KV-cache scheme), a different one a head."""
    gen = torch.Generator().manual_seed(seed)
    device = torch.device(device)
    batch = len(seq_lens)
    fp8 = kv_cache_dtype.startswith("fp8")
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    k_scale = torch.tensor([0.75 if fp8 else 1.0], dtype=torch.float32)
    v_scale = torch.tensor([1.25 if fp8 else 1.0], dtype=torch.float32)
    if fp8 and per_head_scales:
        k_scale = torch.tensor([0.75 / 4 ** h for h in range(num_kv_heads)])
        v_scale = torch.tensor([1.25 * 2 ** h for h in range(num_kv_heads)])

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(dtype)

    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = 1 + sum(blocks_per_req) + 3  # null block 0 and a few spare
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    max_blocks = max(blocks_per_req) + 1
    block_table = torch.zeros(batch, max_blocks, dtype=torch.int32)
    at = 0
    for b, n in enumerate(blocks_per_req):
        block_table[b, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n

    # Combined storage [L, B, H, N, C] in the layout's physical order, as bytes for fp8.
    logical = (NUM_LAYERS, num_blocks, num_kv_heads, block_size, 2 * head_size)
    order = LAYOUTS[layout]
    storage = torch.empty([logical[i] for i in order],
                          dtype=torch.uint8 if fp8 else dtype)
    inverse = [order.index(i) for i in range(5)]
    layer = storage.permute(*inverse)[1]  # logical [B, H, N, 2D], strided
    # Unwritten slots hold finite garbage, as reused blocks do in vLLM (e4m3 0x7E = 448).
    layer.fill_(0x7E) if fp8 else layer.fill_(3000.0)
    cache = layer.view(cache_dtype) if fp8 else layer
    k_cache, v_cache = cache[..., :head_size], cache[..., head_size:]

    queries, keys, values, slots, k_full, v_full = [], [], [], [], [], []
    for b, (s, q) in enumerate(zip(seq_lens, query_lens)):
        k = randn(s, num_kv_heads, head_size)
        v = randn(s, num_kv_heads, head_size)
        if fp8:  # what the cache can hold: the oracle sees the dequantized values
            k = reference.dequantize_fp8(reference.quantize_fp8(k, cache_dtype, k_scale),
                                         k_scale, dtype)
            v = reference.dequantize_fp8(reference.quantize_fp8(v, cache_dtype, v_scale),
                                         v_scale, dtype)
        ctx = s - q
        pos = torch.arange(s)
        slot = block_table[b, pos // block_size].long() * block_size + pos % block_size
        reference.write_kv(k[:ctx], v[:ctx], k_cache, v_cache, slot[:ctx],
                           k_scale=k_scale, v_scale=v_scale)
        slots.append(slot[ctx:])
        queries.append(randn(q, num_q_heads, head_size))
        keys.append(k[ctx:])
        values.append(v[ctx:])
        k_full.append(k)
        v_full.append(v)
    qsl = torch.zeros(batch + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)

    def dev(t):
        return t.to(device)

    return Case(seq_lens=list(seq_lens), query_lens=list(query_lens),
                num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_size=head_size,
                block_size=block_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                query=dev(torch.cat(queries)), key=dev(torch.cat(keys)),
                value=dev(torch.cat(values)),
                kv_cache=dev(storage).permute(*inverse)[1],
                block_table=dev(block_table), slot_mapping=dev(torch.cat(slots)),
                query_start_loc=dev(qsl), seq_lens_t=dev(torch.tensor(seq_lens, dtype=torch.int32)),
                k_scale=dev(k_scale), v_scale=dev(v_scale), k_full=k_full, v_full=v_full)


def oracle(case: Case, compute_dtype: torch.dtype, *, sliding_window: Optional[int] = None,
           soft_cap: Optional[float] = None, sinks: Optional[torch.Tensor] = None
           ) -> torch.Tensor:
    """The reference on contiguous K/V (one block per request): ``[T, Hq, D]`` on CPU."""
    batch = len(case.seq_lens)
    longest = max(case.seq_lens)
    kc = torch.zeros(batch, case.num_kv_heads, longest, case.head_size, dtype=torch.float64)
    vc = torch.zeros_like(kc)
    for b, s in enumerate(case.seq_lens):
        kc[b, :, :s] = case.k_full[b].double().transpose(0, 1)
        vc[b, :, :s] = case.v_full[b].double().transpose(0, 1)
    kc, vc = kc.to(compute_dtype), vc.to(compute_dtype)
    table = torch.arange(batch, dtype=torch.int32).unsqueeze(1)
    q = case.query.cpu().to(compute_dtype)
    return reference.prefix_prefill_attention(
        q, kc, vc, table, case.query_start_loc.cpu(), case.seq_lens_t.cpu(),
        scale=case.head_size ** -0.5, causal=True, sliding_window=sliding_window,
        soft_cap=soft_cap, sinks=None if sinks is None else sinks.cpu(),
        compute_dtype=compute_dtype)


def split_point(query_lens, decode_threshold: int = 1):
    """vLLM's split of a reordered batch (``split_decodes_and_prefills`` with
    ``require_uniform``): the leading requests of one query length <= threshold."""
    num_decodes = 0
    first = query_lens[0] if query_lens else 0
    if first <= decode_threshold:
        while num_decodes < len(query_lens) and query_lens[num_decodes] == first:
            num_decodes += 1
    return num_decodes, int(sum(query_lens[:num_decodes]))
