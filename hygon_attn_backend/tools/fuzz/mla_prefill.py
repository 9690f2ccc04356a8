"""Fuzz cases of MLA's up-projected prefill (``ops.mla_prefill.ragged_attention``) against
the fp64 reference, within the error budget.

A profile fixes what the kernels compile for (q dtype, the q/k and v heads, the GQA group,
the mask, LSE, vLLM's strided k / v views, the offsets' dtype); a case draws the batch
(ragged query and key lengths: a context chunk longer than the queries, fewer keys than
queries, empty requests), the softmax scale, and in a share of cases unchecked offsets past
k's rows (the answer is then the one of the offsets clipped to k).
"""

from __future__ import annotations

import random

import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops.mla_prefill import plan_ragged_attention
from hygon_attn_backend.tools.fuzz import problems as pb
from hygon_attn_backend.tools.fuzz.budget import budget_error, lse_error

WILD_SHARE = 0.1  # cases whose last cu_seqlens_k runs past k (validate off)
MAX_REF_ELEMS = 4e7  # Hq * Lq * Lk of one request (the reference's fp64 scores)


def ragged_profile(rng: random.Random, tiny: bool, strata: pb.Strata) -> dict:
    del rng
    heads = ((16, 64), (192, 128), (96, 32)) if tiny else (
        (192, 128), (192, 128), (128, 128), (96, 32), (80, 80), (256, 256))
    d_qk, d_v = strata.pick("heads", heads)
    return dict(
        dtype=torch.float16 if tiny else strata.pick("dtype", (torch.bfloat16, torch.float16)),
        d_qk=d_qk, d_v=d_v,
        kv_heads=strata.pick("kv_heads", (1, 2) if tiny else (1, 2, 4, 16)),
        group=strata.pick("group", (1, 1, 2) if tiny else (1, 1, 1, 4, 8)),
        causal=strata.pick("causal", (True, False)),
        lse=strata.pick("lse", (False, True)),
        strided=strata.pick("strided", (False, True)),
        index_dtype=strata.pick("index_dtype", (torch.int32, torch.int64)),
        impl="triton")  # the run's --impl replaces it


def _draw_lengths(rng: random.Random, tiny: bool, num_seqs: int, causal: bool, hq: int):
    len_q, len_k = [], []
    for _ in range(num_seqs):
        n = pb.draw_length(rng, tiny, allow_long=num_seqs <= 2)
        r = rng.random()
        if causal and r < 0.5:  # the new tokens' call: keys are the queries
            lq, lk = n, n
        elif r < 0.85:  # a context chunk or a prefix: more keys than queries
            lq = rng.randint(0, n) if n else 0
            lk = n
        else:  # fewer keys than queries (causal: the first rows see none)
            lq, lk = n, rng.randint(0, n) if n else 0
        if lq * lk * hq > MAX_REF_ELEMS:
            lq = max(1, int(MAX_REF_ELEMS / (max(lk, 1) * hq)))
        len_q.append(lq)
        len_k.append(lk)
    return len_q, len_k


def ragged_case(rng: random.Random, prof: dict, device, tiny: bool):
    """Returns ``(problem or None, description)``."""
    hkv = prof["kv_heads"]
    hq = hkv * prof["group"]
    d_qk, d_v, dtype = prof["d_qk"], prof["d_v"], prof["dtype"]
    num_seqs = pb.draw_batch_size(rng, tiny)
    len_q, len_k = _draw_lengths(rng, tiny, num_seqs, prof["causal"], hq)
    cu_q, cu_k = [0], [0]
    for a, b in zip(len_q, len_k):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + b)
    total_q, total_k = cu_q[-1], cu_k[-1]
    q = torch.randn(total_q, hq, d_qk, device=device).to(dtype)
    if prof["strided"]:  # vLLM: k = cat(k_nope, k_pe over the heads), v a slice
        rope = d_qk // 3
        k_pe = torch.randn(total_k, 1, rope, device=device).to(dtype).expand(-1, hkv, -1)
        k = torch.cat([torch.randn(total_k, hkv, d_qk - rope, device=device).to(dtype), k_pe],
                      dim=-1)
        v = torch.randn(total_k, hkv, d_qk - rope + d_v, device=device).to(dtype)[
            ..., d_qk - rope:]
    else:
        k = torch.randn(total_k, hkv, d_qk, device=device).to(dtype)
        v = torch.randn(total_k, hkv, d_v, device=device).to(dtype)
    idx = dict(dtype=prof["index_dtype"], device=device)
    cu_q_t, cu_k_t = torch.tensor(cu_q, **idx), torch.tensor(cu_k, **idx)
    wild = num_seqs > 0 and rng.random() < WILD_SHARE
    run_k = cu_k_t
    if wild:  # the last request's keys run past k: answered as clipped, nothing read past
        run_k = cu_k_t.clone()
        run_k[-1] += rng.randint(1, 300)
    scale = rng.uniform(0.02, 0.2) if rng.random() < 0.5 else None
    plan = plan_ragged_attention(
        cu_q_t, run_k, total_q=total_q, total_k=total_k, num_q_heads=hq, num_kv_heads=hkv,
        head_dim_qk=d_qk, head_dim_v=d_v, q_dtype=dtype,
        host_cu_seqlens_q=None if wild else cu_q, host_cu_seqlens_k=None if wild else cu_k,
        impl="auto" if prof["impl"] == "native" else prof["impl"])
    out = torch.full((total_q, hq, d_v), float("nan"), dtype=dtype, device=device)
    res = plan.run(q, k, v, scale=scale, causal=prof["causal"], out=out,
                   return_lse=prof["lse"])
    lse = res[1] if prof["lse"] else None
    desc = (f"impl={plan.impl} {str(dtype)[6:]} {d_qk}/{d_v} Hq={hq} Hkv={hkv} "
            f"causal={prof['causal']} lse={prof['lse']} strided={prof['strided']} "
            f"B={num_seqs} len_q={len_q[:8]} len_k={len_k[:8]} wild={wild}")
    args = (q, k, v, cu_q_t, cu_k_t)
    ref64, lse64 = reference.ragged_attention(*args, scale=scale, causal=prof["causal"],
                                              return_lse=True, compute_dtype=torch.float64)
    ref_lp = reference.ragged_attention(*args, scale=scale, causal=prof["causal"],
                                        compute_dtype=dtype)
    problem = budget_error(out, ref64, ref_lp, what="ragged")[2]
    if problem is None and lse is not None:
        problem = lse_error(lse, lse64, what="ragged")
    return problem, desc
