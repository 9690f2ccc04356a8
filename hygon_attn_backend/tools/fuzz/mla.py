"""Fuzz cases of the MLA decode (``ops.mla``) against the fp64 reference, within the error
budget.

A profile fixes what Triton compiles for (q dtype, the latent row ``kv_lora_rank +
rope_dim``, heads, page size, query tokens, causal drafts or a draft tree, fp8 or 16-bit
cache, the split, LSE, the block table's width class); a case draws the batch (ragged
lengths, empty requests, a share of tables with bad ids: absent keys), the draft tree
(random parents), the fp8 scale and a ``max_seq_len`` below the lengths.
"""

from __future__ import annotations

import random

import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops.mla import plan_mla_decode
from hygon_attn_backend.ops.tree_mask import pack_tree_mask, tree_mask_from_parents
from hygon_attn_backend.tools.fuzz import problems as pb
from hygon_attn_backend.tools.fuzz.budget import budget_error, lse_error

HOSTILE_SHARE = 0.2
MAX_CACHE_ROWS = 3e5  # latent rows of one case's cache
MAX_REF_ELEMS = 6e7  # Hq * T * Lk of one request (the reference's fp64 scores)


def mla_profile(rng: random.Random, tiny: bool, strata: pb.Strata) -> dict:
    del rng
    widths = ((32, 16), (32, 0), (16, 16)) if tiny else ((512, 64), (512, 64), (256, 32),
                                                          (128, 0))
    rank, rope = strata.pick("width", widths)
    return dict(
        dtype=torch.float16 if tiny else strata.pick("dtype", (torch.bfloat16, torch.float16)),
        rank=rank, rope=rope,
        heads=strata.pick("heads", (8, 16) if tiny else (16, 16, 32, 64, 128)),
        page=strata.pick("page", (1, 4, 16) if tiny else (1, 16, 64, 128, 256)),
        tokens=strata.pick("tokens", (1, 1, 2, 3) if tiny else (1, 1, 2, 4, 8)),
        tree=strata.pick("tree", (False, True)),  # with tokens > 1: a random draft tree
        fp8=strata.pick("fp8", (False, False, True)),
        partitions=strata.pick("partitions", (None, 1, 3)),
        lse=strata.pick("lse", (False, True)),
        index_dtype=strata.pick("index_dtype", (torch.int32, torch.int64)),
        table_x16=strata.pick("table_x16", (False, True)),
        impl="triton")  # the run's --impl replaces it


def mla_case(rng: random.Random, prof: dict, device, tiny: bool):
    """Returns ``(problem or None, description)``."""
    num_seqs = pb.draw_batch_size(rng, tiny)
    t, page, hq = prof["tokens"], prof["page"], prof["heads"]
    rank, rope = prof["rank"], prof["rope"]
    lens = [min(pb.draw_length(rng, tiny, allow_long=num_seqs <= 4),
                int(MAX_REF_ELEMS / (hq * t)), int(MAX_CACHE_ROWS / num_seqs))
            for _ in range(num_seqs)]
    lens = [0 if n == 0 else max(n, t) for n in lens]
    hostile = rng.random() < HOSTILE_SHARE
    tbl = pb.build_table(rng, [pb.cdiv(n, page) for n in lens], index_dtype=prof["index_dtype"],
                         device=device, hostile=hostile, width_x16=prof["table_x16"])
    kv = torch.randn((tbl.num_blocks, page, rank + rope), device=device)
    kv_scale = None
    if prof["fp8"]:
        kv_scale = rng.uniform(0.25, 2.0)
        kv = reference.quantize_fp8(kv, torch.float8_e4m3fn, kv_scale)
        if rng.random() < 0.5:
            kv_scale = torch.tensor([kv_scale], device=device)
    else:
        kv = kv.to(prof["dtype"])
    shape = (num_seqs, hq, rank + rope) if t == 1 else (num_seqs, t, hq, rank + rope)
    q = torch.randn(shape, device=device).to(prof["dtype"])
    seq_lens = torch.tensor(lens, dtype=prof["index_dtype"], device=device)
    tree = None
    if prof["tree"] and t > 1:  # draft i extends a random earlier draft (or the prefix)
        parents = torch.tensor([[rng.randrange(-1, i) for i in range(t)]
                                for _ in range(num_seqs)], dtype=torch.int64)
        tree = pack_tree_mask(tree_mask_from_parents(parents)).to(device)
    max_seq_len = max(lens) // 2 if rng.random() < 0.2 else None  # below: the same answer
    scale = rng.uniform(0.02, 0.2) if rng.random() < 0.5 else None
    plan = plan_mla_decode(block_table=tbl.table, seq_lens=seq_lens, page_size=page,
                           num_q_heads=hq, kv_lora_rank=rank, rope_dim=rope,
                           q_dtype=q.dtype, kv_dtype=kv.dtype, num_tokens=t, scale=scale,
                           max_seq_len=max_seq_len, return_lse=prof["lse"],
                           num_partitions=prof["partitions"], tree_mask=tree,
                           impl="auto" if prof["impl"] == "native" else prof["impl"])
    out = torch.full(shape[:-1] + (rank,), float("nan"), dtype=q.dtype, device=device)
    lse = torch.full(shape[:-1], float("nan"), device=device) if prof["lse"] else None
    plan.run(q, kv, out=out, lse=lse, kv_scale=kv_scale)
    desc = (f"impl={plan.impl} {str(q.dtype)[6:]} {rank}+{rope} Hq={hq} page={page} T={t} "
            f"tree={tree is not None} fp8={prof['fp8']} partitions={prof['partitions']} "
            f"lse={prof['lse']} "
            f"B={num_seqs} lens={lens[:8]} bad_ids={tbl.hostile} max_seq_len={max_seq_len}")
    args = (q, kv, tbl.table, seq_lens)
    kw = dict(kv_lora_rank=rank, scale=scale, kv_scale=kv_scale, return_lse=True,
              tree_mask=tree)
    ref64, lse64 = reference.mla_decode_attention(*args, **kw, compute_dtype=torch.float64)
    ref_lp, _ = reference.mla_decode_attention(*args, **kw, compute_dtype=q.dtype)
    problem = budget_error(out, ref64, ref_lp, what="mla")[2]
    if problem is None and lse is not None:
        problem = lse_error(lse, lse64, what="mla")
    return problem, desc
