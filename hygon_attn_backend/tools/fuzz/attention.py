"""Fuzz cases of the attention ops: ``paged_decode_attention`` and
``prefix_prefill_attention`` against the fp64 reference, within the error budget.

A profile fixes what Triton compiles for (dtypes, head_dim, page size, heads, layout,
which of window / soft cap / sinks / lse / k_new are on, speculative tokens, partition
size, tile, the block table's width class); a case draws the batch (ragged lengths
0..64k, prefixes 0 and > 0, extends of one token, empty requests), the block table (a
share with bad ids: absent keys), scales, window sizes, soft caps and sink values.
"""

from __future__ import annotations

import random

import torch

from hygon_attn_backend import reference
from hygon_attn_backend.tools.fuzz import problems as pb
from hygon_attn_backend.tools.fuzz.budget import budget_error
from hygon_attn_backend.ops.decode import native as decode_native
from hygon_attn_backend.ops.prefill import tuning as prefill_tuning
from hygon_attn_backend.ops.decode import (allocate_decode_workspace, paged_decode_attention,
                                            plan_paged_decode)
from hygon_attn_backend.ops.prefill import plan_prefix_prefill, prefix_prefill_attention

HOSTILE_SHARE = 0.2
# Sizes that keep a case cheap: the reference works in fp64 and expands K/V to every
# query head (``Hq * Lk * D`` elements per request), so long contexts come with few heads.
MAX_KV_ELEMS = 2e8  # sum(Lk) * Hkv * D of one case (the cache)
MAX_REF_ELEMS = 6e7  # Hq * Lk * D of one request (the reference's expanded K/V)
MAX_PREFILL_Q = 8192  # new tokens per case
MAX_SCORE_ELEMS = 6e7  # Hq * Lq * Lk of one request (the reference's fp64 score matrix)


def _heads(strata: pb.Strata, tiny: bool) -> "tuple[int, int]":
    group = strata.pick("group", pb.GROUPS_TINY if tiny else pb.GROUPS)
    kv_heads = strata.pick("kv_heads", (1, 2) if tiny or group > 16 else (1, 2, 4, 8))
    return group, kv_heads


def _common_profile(tiny: bool, strata: pb.Strata, layouts_: tuple) -> dict:
    """Everything a kernel specialises on is fixed here (stratified over the profiles):
    dtypes, head_dim, page size, heads, layout, flags, the index dtype, how scales are
    passed (a float, a tensor, one per KV head), the class of the block table's width. A
    case varies only what Triton does not specialise on (``do_not_specialize`` sizes,
    values, lengths, ids)."""
    dtype = torch.float16 if tiny else strata.pick("dtype", (torch.float16, torch.bfloat16))
    group, kv_heads = _heads(strata, tiny)
    return dict(
        dtype=dtype,
        kv_dtype=strata.pick("kv_dtype", (dtype,) * 6 + pb.FP8),
        head_dim=strata.pick("head_dim", pb.HEAD_DIMS_TINY if tiny else pb.HEAD_DIMS),
        page=strata.pick("page", pb.PAGES_TINY if tiny else pb.PAGES),
        group=group, kv_heads=kv_heads, layout=strata.pick("layout", layouts_),
        window=strata.pick("window", (False,) * 4 + (True,)),
        soft_cap=strata.pick("soft_cap", (False,) * 4 + (True,)),
        sinks=strata.pick("sinks", (False,) * 4 + (True,)),
        index_dtype=strata.pick("index_dtype", (torch.int32, torch.int64)),
        scales=strata.pick("scales", pb.SCALE_KINDS),
        table_x16=strata.pick("table_x16", (False, True)))


def _options(rng: random.Random, prof: dict, num_q_heads: int, max_len: int, device) -> dict:
    """Keyword options shared by both ops (fp8 scales, scale, window, soft cap, sinks)."""
    kw = pb.fp8_scales(rng, prof["kv_dtype"], kind=prof["scales"],
                       num_kv_heads=prof["kv_heads"], device=device, lo=0.2, hi=2.0)
    if rng.random() < 0.3:
        kw["scale"] = rng.uniform(0.02, 0.3)
    if prof["window"]:
        kw["sliding_window"] = rng.randint(1, max(1, max_len))
    if prof["soft_cap"]:
        kw["soft_cap"] = rng.choice((5.0, 30.0))
    if prof["sinks"]:
        kw["sinks"] = torch.randn(num_q_heads, device=device) * 2
    return kw


def _shrink(lengths: list, limit: int) -> list:
    """Scale lengths down until their sum fits ``limit`` (keeps zeros and the shape)."""
    total = sum(lengths)
    if total <= limit:
        return lengths
    return [n if n == 0 else max(1, n * limit // total) for n in lengths]


def _describe(prof: dict, **extra) -> str:
    short = {k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v)
             for k, v in {**prof, **extra}.items()}
    return " ".join(f"{k}={v}" for k, v in short.items())


# ----------------------------------------------------------------------------- decode


def decode_profile(rng: random.Random, tiny: bool, strata: pb.Strata) -> dict:
    prof = _common_profile(tiny, strata, pb.ALL_LAYOUTS)
    prof["tokens"] = strata.pick("tokens", (1, 1, 1, 2, 4) if not tiny else (1, 1, 2))
    prof["partition_size"] = strata.pick(
        "partition_size", (None, 16) if tiny else (None, None, 16, 64, 256, 512))
    # a split launch merges in the decode kernel or in a second kernel
    prof["fused_combine"] = strata.pick("fused_combine", (False, True))
    if not tiny and prof["kv_dtype"] in pb.FP8 and strata.pick("fp8_rules", (False, True)):
        # half the fp8 profiles sit where the fp8 tile and split rules act
        # (ops.decode.tuning.fp8_regime: D=128, at most 4 rows a program, pages of 16+)
        prof.update(head_dim=128, tokens=1, partition_size=None,
                    group=strata.pick("fp8_group", (1, 2, 4)),
                    page=strata.pick("fp8_page", (16, 32, 64)))
    return prof


def decode_case(rng: random.Random, prof: dict, device, tiny: bool):
    """Returns ``(problem or None, description)``."""
    num_seqs = pb.draw_batch_size(rng, tiny)
    t, page, dim = prof["tokens"], prof["page"], prof["head_dim"]
    hq, hkv = prof["group"] * prof["kv_heads"], prof["kv_heads"]
    lens = [min(pb.draw_length(rng, tiny, allow_long=num_seqs <= 4),
                int(MAX_REF_ELEMS / (hq * dim))) for _ in range(num_seqs)]
    lens = [0 if n == 0 else max(n, t) for n in _shrink(lens, int(MAX_KV_ELEMS / (hkv * dim)))]
    hostile = rng.random() < HOSTILE_SHARE
    tbl = pb.build_table(rng, [pb.cdiv(n, page) for n in lens], index_dtype=prof["index_dtype"],
                         device=device, hostile=hostile, width_x16=prof["table_x16"])
    cache = pb.build_cache(prof["layout"], num_blocks=tbl.num_blocks, page=page,
                           kv_heads=hkv, head_dim=dim, dtype=prof["kv_dtype"], device=device)
    shape = (num_seqs, hq, dim) if t == 1 else (num_seqs, t, hq, dim)
    q = torch.randn(shape, device=device).to(prof["dtype"])
    seq_lens = torch.tensor(lens, dtype=prof["index_dtype"], device=device)
    kw = _options(rng, prof, hq, max(lens), device)
    call = dict(kw, partition_size=prof["partition_size"], fused_combine=prof["fused_combine"])
    if rng.random() < 0.3:
        call["max_seq_len"] = max(lens)
    if prof["partition_size"] and rng.random() < 0.3:
        call["workspace"] = allocate_decode_workspace(
            max_num_seqs=num_seqs, num_q_heads=hq, num_kv_heads=hkv, head_dim=dim,
            max_context_len=call.get("max_seq_len") or tbl.table.shape[1] * page,
            device=device, num_tokens=t, partition_size=prof["partition_size"])
    out = torch.full(shape, float("nan"), dtype=q.dtype, device=device)
    args = (q, cache.k, cache.v, tbl.table, seq_lens)
    # prof["impl"] (fuzz --impl): "triton" runs the op as called; "auto" lets the plan
    # choose; "native" runs the native kernel on the cases it covers and Triton on the rest
    impl, plan = prof.get("impl", "triton"), None
    if impl != "triton":
        if impl == "native" and decode_native.unsupported(
                head_dim=dim, q_dtype=q.dtype, kv_dtype=cache.k.dtype):
            impl = "triton"
        plan = plan_paged_decode(
            tbl.table, seq_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=dim,
            page_size=page, q_dtype=q.dtype, kv_dtype=cache.k.dtype, num_tokens=t,
            max_seq_len=call.get("max_seq_len"), partition_size=call["partition_size"],
            workspace=call.get("workspace"), fused_combine=call["fused_combine"], impl=impl)
        impl = plan.impl
    desc = _describe(prof, num_seqs=num_seqs, lens=_clip(lens), bad_ids=tbl.hostile,
                     window=kw.get("sliding_window"), max_seq_len=call.get("max_seq_len"),
                     workspace="workspace" in call, impl=impl)
    if plan is None:
        paged_decode_attention(*args, out=out, impl="triton", **call)
    else:
        paged_decode_attention(*args, out=out, plan=plan, **kw)
    ref64 = reference.paged_decode_attention(*args, compute_dtype=torch.float64, **kw)
    ref_lp = reference.paged_decode_attention(*args, compute_dtype=q.dtype, **kw)
    return budget_error(out, ref64, ref_lp, what="decode")[2], desc


# ----------------------------------------------------------------------------- prefill


def prefill_profile(rng: random.Random, tiny: bool, strata: pb.Strata) -> dict:
    prof = _common_profile(tiny, strata, pb.ATTN_LAYOUTS)
    prof.update(k_new=strata.pick("k_new", (False, False, False, True, True)),
                causal=strata.pick("causal", (True,) * 6 + (False,)),
                lse=strata.pick("lse", (False, True)))
    prof["window"] = prof["window"] and prof["causal"]  # a window is causal only
    prof["tile"] = None
    if not tiny:  # one of the tiles the heuristic picks (small or large grids)
        prof["tile"] = prefill_tuning.tile_config(
            head_dim_pad=max(16, 1 << (prof["head_dim"] - 1).bit_length()),
            group=prof["group"], total_q=strata.pick("tile", (16, 100_000)),
            num_kv_heads=prof["kv_heads"], num_seqs=1, num_sms=132)
    return prof


def _draw_extend(rng: random.Random, tiny: bool) -> int:
    r = rng.random()
    if r < 0.05:
        return 0
    if r < 0.3:
        return 1
    if tiny:
        return rng.randint(2, 24)
    return rng.randint(2, 512) if r < 0.95 else rng.randint(513, 2048)


def prefill_case(rng: random.Random, prof: dict, device, tiny: bool):
    """Returns ``(problem or None, description)``."""
    num_seqs = pb.draw_batch_size(rng, tiny)
    page, dim = prof["page"], prof["head_dim"]
    hq, hkv = prof["group"] * prof["kv_heads"], prof["kv_heads"]
    ext_cap = int((MAX_SCORE_ELEMS / hq) ** 0.5)  # Hq * Lq * Lk <= MAX_SCORE_ELEMS
    ext = _shrink([min(_draw_extend(rng, tiny), ext_cap) for _ in range(num_seqs)],
                  MAX_PREFILL_Q)
    pre = [0 if rng.random() < 0.3 else pb.draw_length(rng, tiny, allow_long=num_seqs <= 4)
           for _ in range(num_seqs)]
    pre = [min(p, int(MAX_REF_ELEMS / (hq * dim))) for p in pre]
    pre = _shrink(pre, max(0, int(MAX_KV_ELEMS / (hkv * dim)) - sum(ext)))
    # the reference's score matrix of one request stays bounded
    pre = [min(p, max(0, int(MAX_SCORE_ELEMS / max(1, hq * e)) - e)) for p, e in zip(pre, ext)]
    lens_k = [p + e for p, e in zip(pre, ext)]
    paged = pre if prof["k_new"] else lens_k
    hostile = rng.random() < HOSTILE_SHARE
    tbl = pb.build_table(rng, [pb.cdiv(n, page) for n in paged],
                         index_dtype=prof["index_dtype"], device=device, hostile=hostile,
                         width_x16=prof["table_x16"])
    cache = pb.build_cache(prof["layout"], num_blocks=tbl.num_blocks, page=page,
                           kv_heads=hkv, head_dim=dim, dtype=prof["kv_dtype"], device=device)
    total_q = sum(ext)
    cu = [0]
    for e in ext:
        cu.append(cu[-1] + e)
    cu_t = torch.tensor(cu, dtype=prof["index_dtype"], device=device)
    lens_t = torch.tensor(lens_k, dtype=prof["index_dtype"], device=device)
    q = torch.randn(total_q, hq, dim, device=device).to(prof["dtype"])
    kw = _options(rng, prof, hq, max(lens_k + [1]), device)
    kw.update(causal=prof["causal"], return_lse=prof["lse"])
    if prof["k_new"]:
        kw["k_new"] = torch.randn(total_q, hkv, dim, device=device).to(prof["dtype"])
        kw["v_new"] = torch.randn(total_q, hkv, dim, device=device).to(prof["dtype"])
    # prof["impl"] (fuzz --impl): "triton" runs the profile's tile; "auto" / "native" let
    # the plan choose, so the native kernel runs the cases it covers on this GPU
    impl = prof.get("impl", "triton")
    plan = plan_prefix_prefill(cu_t, lens_t, total_q=total_q, num_q_heads=hq,
                               num_kv_heads=hkv, head_dim=dim,
                               tile=prof["tile"] if impl == "triton" else None,
                               has_k_new=prof["k_new"], q_dtype=prof["dtype"],
                               kv_dtype=prof["kv_dtype"], impl=impl)
    desc = _describe(prof, num_seqs=num_seqs, prefix=_clip(pre), extend=_clip(ext),
                     bad_ids=tbl.hostile, window=kw.get("sliding_window"), impl=plan.impl)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=device)
    args = (q, cache.k, cache.v, tbl.table, cu_t, lens_t)
    res = prefix_prefill_attention(*args, out=out, plan=plan, impl=impl, **kw)
    ref64 = reference.prefix_prefill_attention(*args, compute_dtype=torch.float64, **kw)
    ref_lp = reference.prefix_prefill_attention(*args, compute_dtype=q.dtype, **kw)
    if prof["lse"]:
        problem = _lse_problem(res[1], ref64[1])
        if problem:
            return problem, desc
        ref64, ref_lp = ref64[0], ref_lp[0]
    return budget_error(out, ref64, ref_lp, what="prefill")[2], desc


def _lse_problem(lse: torch.Tensor, ref: torch.Tensor):
    lse, ref = lse.detach().double(), ref.detach().to(lse.device, torch.float64)
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(lse), finite):
        return "prefill lse: -inf rows differ from the reference's (or NaN)"
    if finite.any():
        err = ((lse - ref).abs() / (1.0 + ref.abs()))[finite].max().item()
        if err > 2e-3:
            return f"prefill lse: max error {err:.3e} > 2e-3 (relative to 1 + |lse|)"
    return None


def _clip(values: list, n: int = 8) -> str:
    head = ",".join(map(str, values[:n]))
    return f"[{head}{',...' if len(values) > n else ''}] (sum {sum(values)})"
