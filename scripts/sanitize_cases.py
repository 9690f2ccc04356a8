"""Driver for scripts/sanitize.sh: every kernel of the package on in-range and hostile
inputs, small enough to run under compute-sanitizer (10-100x slower).

Triton kernels (the default): paged decode (one partition, split + combine kernel, split +
fused combine, speculative tokens, split-x K), prefix prefill (cache only, with k_new),
write_kv, copy_blocks, the MLA decode and its cache write, the SGLang page table. Inputs: the reported prefill case (block ids
-5 and 1000 inside the used part of every row), bad ids in decode tables, slots -1 / past
the end / int32 max, copy pairs past the end, empty requests, seq_len 0, one-token pages,
D = 80 / 96 / 256, fp8 caches.

``--native``: the native kernels (csrc/) instead: every decode staging path (16-byte
vectors, fp8, strided V-transposed and split-x K), both decode loops, split and unsplit
launches, row chunks, options, hostile block ids and slots, write_kv and copy_blocks; the
sm_90 prefill (paged and dense keys, masks, options, hostile block ids; its ragged mode at
192 / 128 and 128 / 128 with wild offsets) and MLA decode where the GPU has them.

Run with ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` (sanitize.sh sets it) so every tensor is its
own allocation and an out-of-bounds access cannot land silently in a neighbour's memory.
Every output is also checked against the reference, so a masked lane that computed the
wrong thing fails here too. Usage: ``python scripts/sanitize_cases.py [--native]``.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hygon_attn_backend import (copy_blocks, paged_decode_attention,  # noqa: E402
                                prefix_prefill_attention, reference, write_kv)
from hygon_attn_backend.tools.fuzz import problems as pb  # noqa: E402
from hygon_attn_backend.tools.fuzz.budget import budget_error  # noqa: E402
from hygon_attn_backend.ops.tree_mask import pack_tree_mask, tree_mask_from_parents  # noqa: E402

DEV = torch.device("cuda")
LAUNCHES = []


def _i32(values):
    return torch.tensor(values, dtype=torch.int32, device=DEV)


def _cpu(obj):
    """The reference runs on CPU copies: only our kernels run under the sanitizer."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, tuple):
        return tuple(_cpu(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    return obj


def _check(name, out, ref64, ref_lp):
    problem = budget_error(out, ref64, ref_lp, what=name)[2]
    if problem:
        raise SystemExit(f"sanitize_cases: {problem}")
    LAUNCHES.append(name)


def prefill(name, *, dim=128, page=16, hkv=2, group=4, dtype=torch.bfloat16, kv_dtype=None,
            table=None, cu=(0, 5, 5, 40), lens=(20, 3, 60), num_blocks=12, k_new=False,
            layout="bhsd", **kw):
    cache = pb.build_cache(layout, num_blocks=num_blocks, page=page, kv_heads=hkv,
                           head_dim=dim, dtype=kv_dtype or dtype, device=DEV)
    total = cu[-1]
    q = torch.randn(total, hkv * group, dim, device=DEV).to(dtype)
    if kv_dtype in pb.FP8:
        kw.update(k_scale=0.7, v_scale=1.3)
    if k_new:
        kw["k_new"] = torch.randn(total, hkv, dim, device=DEV).to(dtype)
        kw["v_new"] = torch.randn(total, hkv, dim, device=DEV).to(dtype)
    table = _i32(table if table is not None else [[0, -5, 1000, 3]] * (len(cu) - 1))
    args = (q, cache.k, cache.v, table, _i32(list(cu)), _i32(list(lens)))
    out = torch.full_like(q, float("nan"))
    prefix_prefill_attention(*args, out=out, impl="triton", **kw)
    args, kw = _cpu(args), _cpu(kw)
    _check(name, out, reference.prefix_prefill_attention(*args, compute_dtype=torch.float64, **kw),
           reference.prefix_prefill_attention(*args, compute_dtype=dtype, **kw))


def decode(name, *, dim=128, page=16, hkv=2, group=4, tokens=1, dtype=torch.bfloat16,
           kv_dtype=None, table, lens, num_blocks=8, layout="bhsd", **kw):
    cache = pb.build_cache(layout, num_blocks=num_blocks, page=page, kv_heads=hkv,
                           head_dim=dim, dtype=kv_dtype or dtype, device=DEV)
    shape = (len(lens), hkv * group, dim) if tokens == 1 else (len(lens), tokens,
                                                               hkv * group, dim)
    q = torch.randn(shape, device=DEV).to(dtype)
    if kv_dtype in pb.FP8:
        kw.update(k_scale=0.7, v_scale=1.3)
    args = (q, cache.k, cache.v, _i32(table), _i32(list(lens)))
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(*args, out=out, impl="triton", **kw)
    kw.pop("partition_size", None)
    kw.pop("fused_combine", None)
    args, kw = _cpu(args), _cpu(kw)
    _check(name, out, reference.paged_decode_attention(*args, compute_dtype=torch.float64, **kw),
           reference.paged_decode_attention(*args, compute_dtype=dtype, **kw))


def cache_ops(name, *, layout, dim, page, dtype, slots, pairs, num_blocks=6, hkv=2):
    cache = pb.build_cache(layout, num_blocks=num_blocks, page=page, kv_heads=hkv,
                           head_dim=dim, dtype=dtype, device=DEV)
    want = pb.copy_cache(cache, torch.device("cpu"))
    k = torch.randn(len(slots), hkv, dim, device=DEV).to(torch.bfloat16)
    v = torch.randn(len(slots), hkv, dim, device=DEV).to(torch.bfloat16)
    kw = dict(k_scale=0.5, v_scale=2.0) if dtype in pb.FP8 else {}
    write_kv(k, v, cache.k, cache.v, _i32(slots), impl="triton", **kw)
    copy_blocks(cache.k_blocks, cache.v_blocks, _i32(pairs), impl="triton")
    reference.write_kv(k.cpu(), v.cpu(), want.k, want.v, _i32(slots).cpu(), **kw)
    reference.copy_blocks(want.k_blocks, want.v_blocks, _i32(pairs).cpu())
    for got, exp in zip(pb.storage_bytes(cache), pb.storage_bytes(want)):
        if not torch.equal(got.cpu(), exp):
            raise SystemExit(f"sanitize_cases: {name}: storage differs from the reference")
    LAUNCHES.append(name)


def mla(name, *, page, heads, tokens=1, rank=512, rope=64, kv_dtype=torch.bfloat16, table,
        lens, num_blocks=8, slots=(), impl="triton", **kw):
    """The MLA decode (and its cache write first, hostile slots included) against the
    reference; ``impl="native"``: the sm_90a kernel."""
    from hygon_attn_backend.ops.mla import mla_decode_attention, write_mla_cache

    kv = torch.randn((num_blocks, page, rank + rope), device=DEV)
    scale = 0.6 if kv_dtype in pb.FP8 else None
    kv = reference.quantize_fp8(kv, kv_dtype, scale) if scale else kv.to(kv_dtype)
    if slots:
        kv_c = torch.randn(len(slots), rank, device=DEV).to(torch.bfloat16)
        k_pe = torch.randn(len(slots), rope, device=DEV).to(torch.bfloat16)
        want = kv.cpu()
        write_mla_cache(kv_c, k_pe, kv, _i32(list(slots)), kv_scale=scale, impl="triton")
        reference.write_mla_cache(kv_c.cpu(), k_pe.cpu(), want, _i32(list(slots)).cpu(),
                                  kv_scale=scale)
        if not torch.equal(kv.cpu().view(torch.uint8), want.view(torch.uint8)):
            raise SystemExit(f"sanitize_cases: {name}: cache differs from the reference")
    shape = (len(lens), heads, rank + rope) if tokens == 1 else (len(lens), tokens, heads,
                                                                 rank + rope)
    q = torch.randn(shape, device=DEV).to(torch.bfloat16)
    args = (q, kv, _i32(table), _i32(list(lens)))
    out, _ = mla_decode_attention(*args, kv_lora_rank=rank, kv_scale=scale, return_lse=True,
                                  impl=impl, **kw)
    args = _cpu(args)
    ref = dict(kv_lora_rank=rank, kv_scale=scale)
    _check(name, out, reference.mla_decode_attention(*args, **ref, compute_dtype=torch.float64),
           reference.mla_decode_attention(*args, **ref, compute_dtype=torch.bfloat16))


def page_table(name, *, page, rows):
    """SGLang's req_to_token -> block table kernel, bad rows included (never read)."""
    from hygon_attn_backend.ops.page_table import launch_req_to_token_table

    req_to_token = torch.randint(0, 4096, (4, 96), dtype=torch.int32, device=DEV)
    out = torch.empty((len(rows), 96 // page), dtype=torch.int32, device=DEV)
    rows_t = torch.tensor(rows, dtype=torch.int64, device=DEV)
    launch_req_to_token_table(req_to_token, rows_t, out, page_size=page)
    want = torch.full((len(rows), 96 // page), -1, dtype=torch.int32)
    r2t = req_to_token.cpu()
    for b, r in enumerate(rows):
        if 0 <= r < 4:
            want[b] = torch.div(r2t[r, ::page], page, rounding_mode="floor")
    if not torch.equal(out.cpu(), want):
        raise SystemExit(f"sanitize_cases: {name}: table differs from the reference")
    LAUNCHES.append(name)


def triton_cases() -> None:
    torch.manual_seed(0)
    # the reported case: ids -5 and 1000 inside the used part of every row
    prefill("prefill issue repro, cache only")
    prefill("prefill issue repro, k_new", k_new=True)
    prefill("prefill D=80 page 1, bad ids, window + sinks", dim=80, page=1, num_blocks=64,
            table=[[i if i % 7 else 10**6 for i in range(60)]] * 3, sliding_window=9,
            sinks=torch.randn(8, device=DEV))
    prefill("prefill D=96 fp8 e4m3, empty requests, k_new", dim=96,
            kv_dtype=torch.float8_e4m3fn, cu=(0, 0, 7, 7), lens=(0, 30, 12),
            table=[[1, 2], [3, -1], [4, 5]], k_new=True)
    prefill("prefill D=256 soft cap, non-causal, vLLM LBNHC", dim=256, group=2,
            layout="vllm_LBNHC", causal=False, soft_cap=30.0,
            table=[[0, 1, 2, 3], [4, -3, 5, 6], [7, 8, 9, 2**31 - 1]])
    decode("decode one partition, bad ids, seq_len 0", table=[[0, -5, 1000], [1, 2, 3],
           [4, 5, 6]], lens=(40, 0, 33))
    decode("decode split + combine, bad ids", table=[[0, -5, 1000], [1, 2, 3], [4, 5, 6]],
           lens=(40, 0, 33), partition_size=16)
    decode("decode split + fused combine, bad ids", table=[[0, -5, 1000], [1, 2, 3],
           [4, 5, 6]], lens=(40, 0, 33), partition_size=16, fused_combine=True)
    decode("decode fused combine, D=96 T=3 G=6 sinks", dim=96, group=6, hkv=1, tokens=3,
           num_blocks=12, table=[list(range(12))], lens=(190,), partition_size=32,
           fused_combine=True, sinks=torch.randn(6, device=DEV))
    decode("decode split-x K, D=80, T=2, page 1", dim=80, page=1, layout="split_x",
           tokens=2, num_blocks=80, table=[list(range(40)) + [-1] * 4, list(range(40, 80))
                                           + [99] * 4], lens=(44, 37), partition_size=16)
    decode("decode D=256 fp8 e5m2 G=16", dim=256, group=16, hkv=1,
           kv_dtype=torch.float8_e5m2, table=[[0, 1, 7, 2**31 - 1]], lens=(60,),
           partition_size=32)
    decode("decode D=96 window soft cap sinks", dim=96, table=[[3, 4, -1], [0, 1, 2]],
           lens=(48, 30), sliding_window=5, soft_cap=20.0,
           sinks=torch.randn(8, device=DEV))
    d64_table = [[0, -5, 1000] + list(range(1, 18)), list(range(18, 38)),
                 [38, 39, 2**31 - 1] + list(range(40, 57))]
    decode("decode D=64 (128-key tile), bad ids, per-sequence split", dim=64,
           dtype=torch.float16, num_blocks=60, table=d64_table, lens=(300, 0, 77))
    decode("decode D=64 (128-key tile), bad ids, split + fused combine", dim=64,
           dtype=torch.float16, num_blocks=60, table=d64_table, lens=(300, 0, 77),
           partition_size=128, fused_combine=True)
    # speculative verify: packed tree masks (two words at T=40), bad ids inside the rows
    tree4 = pack_tree_mask(tree_mask_from_parents(torch.tensor([[-1, 0, 0, 1]] * 3))).to(DEV)
    prefill("prefill tree mask T=4, bad ids", cu=(0, 4, 8, 12), lens=(20, 9, 60),
            tree_mask=tree4)
    tree40 = pack_tree_mask(tree_mask_from_parents(
        torch.tensor([[i - 1 if i % 3 else -1 for i in range(40)]]))).to(DEV)
    prefill("prefill tree mask T=40 (two words), k_new", dim=64, cu=(0, 40), lens=(70,),
            table=[[2, 1000, 0, 3, 4]], k_new=True, tree_mask=tree40)
    decode("decode verify T=4 tree, bad ids, split", tokens=4, table=[[0, -5, 1000],
           [1, 2, 3], [4, 5, 6]], lens=(40, 4, 33), partition_size=16, tree_mask=tree4)
    # seq_lens past what the table holds: the work stops at the table's end
    decode("decode seq_lens past the table", table=[[0, 1, 2], [3, 4, 5]],
           lens=(200000, 40), partition_size=16)
    cache_ops("write_kv/copy_blocks bshd fp16, hostile", layout="bshd", dim=128, page=16,
              dtype=torch.float16, slots=[-1, 5, 96, 2**31 - 1, -7, 95, 0],
              pairs=[[0, 3], [1, 6], [-1, 4], [2, 5]])
    cache_ops("write_kv/copy_blocks split-x fp8, page 1", layout="split_x", dim=80, page=1,
              dtype=torch.float8_e4m3fn, slots=[-1, 5, 6, 2**31 - 1], pairs=[[0, 3], [1, 99]])
    cache_ops("write_kv/copy_blocks vLLM BLHNC D=256", layout="vllm_BLHNC", dim=256, page=16,
              dtype=torch.bfloat16, slots=[3, 200, -2, 17], pairs=[[5, 0], [6, 1]])
    mla("mla decode page 64 Hq 128, bad ids, seq_len 0, hostile cache writes", page=64,
        heads=128, table=[[0, -5, 1000], [1, 2, 3], [4, 5, 2**31 - 1]], lens=(150, 0, 140),
        slots=(-1, 5, 8 * 64, 2**31 - 1, 77))
    mla("mla decode page 1 Hq 16 T=3 fp8, split, past the table", page=1, heads=16, tokens=3,
        num_blocks=80, kv_dtype=torch.float8_e4m3fn,
        table=[list(range(40)), list(range(40, 80))], lens=(40, 500), max_seq_len=40,
        slots=(3, -1, 79, 80))
    page_table("page table, page 16, bad rows", page=16, rows=[3, -1, 4, 2**40, 0])
    page_table("page table, page 1", page=1, rows=[0, 1, 2, 3])
    torch.cuda.synchronize()
    print(f"sanitize_cases: {len(LAUNCHES)} cases ran and matched the reference")


def native_decode(name, *, hkv, group, d, p, lens, layout="bshd", dtype=torch.bfloat16,
                  kv_dtype=None, tokens=1, partition_size=None, bad_ids=False, v_layout=None,
                  past_table=0, **opts):
    gen = torch.Generator(device=DEV).manual_seed(0)
    need = sum(-(-s // p) for s in lens) + 2
    shape = {"bshd": (need, p, hkv, d), "bhsd": (need, hkv, p, d), "bhds": (need, hkv, d, p)}
    perm = {"bshd": (0, 2, 1, 3), "bhsd": (0, 1, 2, 3), "bhds": (0, 1, 3, 2)}
    kind = "bhsd" if layout == "split_x" else layout
    k = torch.randn(shape[kind], device=DEV, generator=gen).to(kv_dtype or dtype).permute(*perm[kind])
    v_kind = v_layout or kind  # V in another layout: other block and slot strides than K's
    v = torch.randn(shape[v_kind], device=DEV, generator=gen).to(kv_dtype or dtype).permute(*perm[v_kind])
    if layout == "split_x":
        x = 16 // k.element_size()
        k = k.reshape(need, hkv, p, d // x, x).permute(0, 1, 3, 2, 4).contiguous()
    cols = max(-(-s // p) for s in lens) + 1
    table = torch.full((len(lens), cols), need + 1000, dtype=torch.int32)
    order = torch.randperm(need)
    used = 0
    for i, s in enumerate(lens):
        n = -(-s // p)
        table[i, :n] = order[used:used + n]
        used += n
    if bad_ids:
        table[0, 0] = -1
    table = table.to(DEV)
    q = torch.randn(len(lens), tokens, hkv * group, d, device=DEV, generator=gen).to(dtype)
    # past_table: the first length runs this far past what its table row holds
    seq_lens = torch.tensor([lens[0] + past_table, *lens[1:]], dtype=torch.int32, device=DEV)
    scales = dict(k_scale=0.5, v_scale=torch.tensor([0.25], device=DEV)) if kv_dtype else {}
    out = paged_decode_attention(q, k, v, table, seq_lens, partition_size=partition_size,
                                 impl="native", **scales, **opts)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all(), name
    if not bad_ids:
        ref = reference.paged_decode_attention(q, k, v, table, seq_lens, **scales, **opts)
        err = (out.float() - ref.float()).abs().max().item()
        assert err < 0.1, f"{name}: max error {err}"
    print(f"decode {name}: ok", flush=True)


def native_cases() -> None:
    native_decode("bshd G8 unsplit", hkv=2, group=8, d=128, p=16, lens=[300, 17, 0])
    native_decode("bshd G8 split", hkv=2, group=8, d=128, p=16, lens=[700, 17, 0],
                  partition_size=256)
    # the split-N loop as planned (64-token tiles, 3 stages) at head_dim 64 and 128
    native_decode("split-N, hostile ids, D64 G4, window + sinks", hkv=2, group=4, d=64, p=16,
                  lens=[500, 33, 0], bad_ids=True, partition_size=128,
                  sinks=torch.randn(8, device=DEV), sliding_window=200)
    native_decode("split-N swizzled rows, hostile ids, D128 G4 (the NVIDIA auto shape)", hkv=2,
                  group=4, d=128, p=16, lens=[700, 65, 0], bad_ids=True, partition_size=256)
    native_decode("split-N, K bshd and V bhsd (V rows addressed on their own), hostile ids",
                  hkv=2, group=4, d=128, p=16, lens=[700, 65, 0], bad_ids=True,
                  partition_size=256, v_layout="bhsd")
    native_decode("bhds strided V, G1, P1", hkv=2, group=1, d=64, p=1, lens=[90, 3],
                  layout="bhds", partition_size=32)
    native_decode("split_x K fp16 D80", hkv=1, group=3, d=80, p=16, lens=[200], layout="split_x",
                  dtype=torch.float16)
    native_decode("fp8 e4m3 D256 hostile ids", hkv=1, group=4, d=256, p=64, lens=[300, 64],
                  kv_dtype=torch.float8_e4m3fn, bad_ids=True, partition_size=128)
    # the fp8 split-N loop (fp8 bytes staged, widened after ldmatrix): head_dim 128 and 96
    native_decode("fp8 e4m3 split-N D128 G8, hostile ids, past the table", hkv=2, group=8,
                  d=128, p=16, lens=[700, 65, 0], kv_dtype=torch.float8_e4m3fn, bad_ids=True,
                  partition_size=256, past_table=40)
    native_decode("fp8 e5m2 split-N D96 G4, K bshd and V bhsd, window + sinks", hkv=2, group=4,
                  d=96, p=16, lens=[500, 33], kv_dtype=torch.float8_e5m2, v_layout="bhsd",
                  sinks=torch.randn(8, device=DEV), sliding_window=200)
    native_decode("row chunks T2 G64 + options", hkv=1, group=64, d=128, p=16, lens=[500, 40],
                  tokens=2, partition_size=256, sliding_window=100, soft_cap=20.0,
                  sinks=torch.randn(64, device=DEV))
    native_decode("seq_lens past the table, split", hkv=2, group=4, d=128, p=16,
                  lens=[300, 40], past_table=200000, partition_size=256)
    native_decode("seq_lens past the table, unsplit", hkv=2, group=8, d=128, p=16,
                  lens=[300, 40], past_table=200000)
    k = torch.randn(9, 4, 128, device=DEV).to(torch.bfloat16)
    slots = torch.tensor([-1, 3, 700, 5, 10 ** 9, -7, 0, 63, 64], device=DEV)
    kc = torch.zeros(4, 16, 4, 128, device=DEV, dtype=torch.bfloat16).permute(0, 2, 1, 3)
    vc = torch.zeros_like(kc)
    write_kv(k, k, kc, vc, slots, impl="native")
    xk = torch.zeros(4, 4, 16, 16, 8, device=DEV, dtype=torch.float16)  # split-x K
    write_kv(k.half(), k.half(), xk, vc.half(), slots, impl="native")
    f8 = torch.zeros(4, 4, 16, 128, device=DEV, dtype=torch.float8_e5m2)
    write_kv(k, k, f8, f8.clone(), slots, k_scale=0.5, v_scale=2.0, impl="native")
    torch.cuda.synchronize()
    print("write_kv: ok", flush=True)
    mapping = torch.tensor([[0, 2], [1, 3], [-1, 0], [0, 99]], device=DEV)
    copy_blocks(kc, vc, mapping, impl="native")
    copy_blocks(xk, f8, mapping, impl="native")
    torch.cuda.synchronize()
    print("copy_blocks: ok", flush=True)
    if torch.cuda.get_device_capability() == (9, 0) and not torch.version.hip:
        native_prefill_cases()
        mla("native mla decode Hq 128 page 64, bad ids, seq_len 0, past the table, split",
            page=64, heads=128, num_blocks=40, impl="native",
            table=[[0, -5, 1000, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 2**31 - 1, 14, 15, 16]],
            lens=(300, 0, 5000))
        mla("native mla decode Hq 64 T=2 page 1, bad ids, unsplit", page=1, heads=64, tokens=2,
            num_blocks=200, impl="native", table=[list(range(100)), [150, -1] + list(range(2, 100))],
            lens=(100, 77))
        mla("native mla decode Hq 16 T=3 (48 rows) page 16, bad ids, past the table", page=16, heads=16,
            tokens=3, num_blocks=30, impl="native",
            table=[[0, 1, -7, 3, 4, 5, 6, 7], [8, 9, 10, 2**31 - 1, 12, 13, 14, 15]],
            lens=(120, 900))
        mla("native mla decode Hq 12 T=3 (36 rows) page 1, unsplit", page=1, heads=12, tokens=3,
            num_blocks=120, impl="native", table=[list(range(60)), list(range(60, 120))],
            lens=(60, 41))
        mla("native mla decode fp8 e4m3 Hq 128 page 64, bad ids, past the table, split",
            page=64, heads=128, num_blocks=40, impl="native", kv_dtype=torch.float8_e4m3fn,
            table=[[0, -5, 1000, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 13, 2**31 - 1, 14, 15, 16]],
            lens=(300, 0, 5000))
        mla("native mla decode fp8 e5m2 Hq 16 T=4 page 1, bad ids, unsplit", page=1, heads=16,
            tokens=4, num_blocks=200, impl="native", kv_dtype=torch.float8_e5m2,
            table=[list(range(100)), [150, -1] + list(range(2, 100))], lens=(100, 77))
    print("sanitize_cases: native cases ran, outputs checked", flush=True)


def native_prefill(name, *, prefix, extend, group, hkv=2, page=16, k_new=False, bad_ids=False,
                   kv_dtype=None, **opts):
    """One native prefix-prefill call on a shuffled paged cache, checked against the
    reference (hostile ids: finite only); ``kv_dtype`` fp8: the cache quantized with
    scales 0.5 / 2.0."""
    gen = torch.Generator(device=DEV).manual_seed(1)
    d, hq = 128, hkv * group
    lens_k = [a + b for a, b in zip(prefix, extend)]
    cols = max(-(-n // page) for n in lens_k) + 1
    need = len(lens_k) * cols
    k = torch.randn(need, hkv, page, d, device=DEV, generator=gen).to(torch.bfloat16)
    v = torch.randn(need, hkv, page, d, device=DEV, generator=gen).to(torch.bfloat16)
    kw = dict(opts)
    if kv_dtype is not None:
        k = reference.quantize_fp8(k.float(), kv_dtype, 0.5)
        v = reference.quantize_fp8(v.float(), kv_dtype, 2.0)
        kw.update(k_scale=0.5, v_scale=2.0)
    table = torch.randperm(need, device=DEV, generator=gen).reshape(len(lens_k), cols)
    table = table.to(torch.int32)
    if bad_ids:
        table[0, 1] = -3
        table[-1, 0] = need + 77
    cu = torch.tensor([0] + [sum(extend[:i + 1]) for i in range(len(extend))],
                      dtype=torch.int32, device=DEV)
    lens = torch.tensor(lens_k, dtype=torch.int32, device=DEV)
    total = int(cu[-1])
    q = torch.randn(total, hq, d, device=DEV, generator=gen).to(torch.bfloat16)
    if k_new:
        kw["k_new"] = torch.randn(total, hkv, d, device=DEV, generator=gen).to(torch.bfloat16)
        kw["v_new"] = torch.randn(total, hkv, d, device=DEV, generator=gen).to(torch.bfloat16)
    out = prefix_prefill_attention(q, k, v, table, cu, lens, impl="native", **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all(), name
    ref = reference.prefix_prefill_attention(q, k, v, table, cu, lens, **kw)
    err = (out.float() - ref.float()).abs().max().item()
    assert err < 0.05, f"{name}: max error {err}"
    print(f"prefill {name}: ok", flush=True)


def native_prefill_cases() -> None:
    native_prefill("paged causal G4", prefix=(300, 0, 129), extend=(200, 70, 1), group=4)
    native_prefill("dense new K/V G8 page 1", prefix=(100, 7), extend=(150, 300), group=8, page=1,
                   k_new=True)
    native_prefill("non-causal G3", prefix=(257, 0), extend=(60, 131), group=3, causal=False)
    native_prefill("window sinks soft cap", prefix=(400, 5), extend=(200, 90), group=4, page=64,
                   sliding_window=70, soft_cap=15.0,
                   sinks=torch.linspace(-1, 1, 8, device=DEV))
    native_prefill("hostile ids", prefix=(300, 40), extend=(100, 30), group=4, bad_ids=True)
    # fp8 caches: codes loaded a tile ahead and widened by the producers
    native_prefill("fp8 e4m3 G4, hostile ids", prefix=(300, 40), extend=(100, 30), group=4,
                   bad_ids=True, kv_dtype=torch.float8_e4m3fn)
    native_prefill("fp8 e5m2 G8 page 1, window sinks soft cap", prefix=(257, 3), extend=(60, 131),
                   group=8, page=1, kv_dtype=torch.float8_e5m2, sliding_window=70,
                   soft_cap=15.0, sinks=torch.linspace(-1, 1, 16, device=DEV))
    native_ragged("ragged MLA 192/128 causal, Lk < Lq, empty request", len_q=(300, 9, 0, 140),
                  len_k=(500, 4, 7, 140), heads=4, d_qk=192)
    native_ragged("ragged MLA 192/128 chunk, wild offsets past q and k", len_q=(130, 60),
                  len_k=(200, 90), heads=4, d_qk=192, causal=False, wild=True)
    native_ragged("ragged 128/128 G4, causal", len_q=(257, 1), len_k=(600, 1), heads=8, kv_heads=2,
                  d_qk=128)


def native_ragged(name, *, len_q, len_k, heads, kv_heads=None, d_qk, d_v=128, causal=True,
                  wild=False):
    """One native ragged-attention call (the prefill kernel's dense mode) checked against
    the reference; ``wild``: unchecked cu_seqlens past q's and k's rows (the kernel answers
    as for offsets clipped to them and touches nothing outside)."""
    from hygon_attn_backend.ops.mla_prefill import ragged_attention

    kv_heads = kv_heads or heads
    gen = torch.Generator(device=DEV).manual_seed(7)
    cu_q, cu_k = [0], [0]
    for a, b in zip(len_q, len_k):
        cu_q.append(cu_q[-1] + a)
        cu_k.append(cu_k[-1] + b)
    tq, tk = cu_q[-1], cu_k[-1]
    q = torch.randn(tq, heads, d_qk, generator=gen, device=DEV).bfloat16()
    k = torch.randn(tk, kv_heads, d_qk, generator=gen, device=DEV).bfloat16()
    v = torch.randn(tk, kv_heads, d_v, generator=gen, device=DEV).bfloat16()
    clip_q, clip_k = list(cu_q), list(cu_k)
    if wild:  # the last request runs past both tensors
        cu_q[-1], cu_k[-1] = tq + 50, tk + 77
    out, lse = ragged_attention(q, k, v, _i32(cu_q), _i32(cu_k), causal=causal,
                                return_lse=True, validate=False, impl="native")
    args = _cpu((q, k, v, _i32(clip_q), _i32(clip_k)))
    ref64 = reference.ragged_attention(*args, causal=causal, compute_dtype=torch.float64)
    ref_lp = reference.ragged_attention(*args, causal=causal, compute_dtype=torch.bfloat16)
    _check(name, out.cpu(), ref64, ref_lp)
    print(f"ragged {name}: ok", flush=True)


def main() -> None:
    if "--native" in sys.argv[1:]:
        native_cases()
    else:
        triton_cases()


if __name__ == "__main__":
    main()
