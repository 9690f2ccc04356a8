"""Small native decode / prefill / write_kv / copy_blocks calls for compute-sanitizer
(memcheck, racecheck): every decode staging path (16-byte vectors, fp8, strided
V-transposed and split-x K), split and unsplit launches, row chunks, options, hostile block
ids and slots; the sm_90 prefill (paged and dense keys, masks, options, persistent and
one-program-per-item launches, hostile block ids) where the GPU has it.

Usage (GPU): compute-sanitizer --tool memcheck python scripts/native_sanitize.py
Prints one line per call and ``sanitize script done``; the sanitizer reports errors.
"""

from __future__ import annotations

import os

import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops.cache import copy_blocks, write_kv
from hygon_attn_backend.ops.decode import paged_decode_attention
from hygon_attn_backend.ops.prefill import prefix_prefill_attention

DEV = torch.device("cuda")


def decode_case(name, *, hkv, group, d, p, lens, layout="bshd", dtype=torch.bfloat16,
                kv_dtype=None, tokens=1, partition_size=None, bad_ids=False, v_layout=None,
                **opts):
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
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEV)
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


def main():
    decode_case("bshd G8 unsplit", hkv=2, group=8, d=128, p=16, lens=[300, 17, 0])
    decode_case("bshd G8 split", hkv=2, group=8, d=128, p=16, lens=[700, 17, 0],
                partition_size=256)
    for tile, stages in (("64", "3"), ("32", "2"), ("32", "4")):  # both split-N tiles
        os.environ["HYGON_ATTN_NATIVE_TILE"], os.environ["HYGON_ATTN_NATIVE_STAGES"] = tile, stages
        decode_case(f"split-N {tile}-token tiles, {stages} stages, hostile ids, D64 G4", hkv=2,
                    group=4, d=64, p=16, lens=[500, 33, 0], bad_ids=True, partition_size=128,
                    sinks=torch.randn(8, device=DEV), sliding_window=200)
        decode_case(f"split-N {tile}-token tiles, {stages} stages, hostile ids, D128 G4", hkv=2,
                    group=4, d=128, p=16, lens=[700, 65, 0], bad_ids=True, partition_size=256)
    del os.environ["HYGON_ATTN_NATIVE_TILE"], os.environ["HYGON_ATTN_NATIVE_STAGES"]
    decode_case("split-N swizzled rows, hostile ids, D128 G4 (the NVIDIA auto shape)", hkv=2,
                group=4, d=128, p=16, lens=[700, 65, 0], bad_ids=True, partition_size=256)
    decode_case("split-N, K bshd and V bhsd (V rows addressed on their own), hostile ids",
                hkv=2, group=4, d=128, p=16, lens=[700, 65, 0], bad_ids=True,
                partition_size=256, v_layout="bhsd")
    decode_case("bhds strided V, G1, P1", hkv=2, group=1, d=64, p=1, lens=[90, 3],
                layout="bhds", partition_size=32)
    decode_case("split_x K fp16 D80", hkv=1, group=3, d=80, p=16, lens=[200], layout="split_x",
                dtype=torch.float16)
    decode_case("fp8 e4m3 D256 hostile ids", hkv=1, group=4, d=256, p=64, lens=[300, 64],
                kv_dtype=torch.float8_e4m3fn, bad_ids=True, partition_size=128)
    decode_case("row chunks T2 G64 + options", hkv=1, group=64, d=128, p=16, lens=[500, 40],
                tokens=2, partition_size=256, sliding_window=100, soft_cap=20.0,
                sinks=torch.randn(64, device=DEV))
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
        prefill_cases()
    print("sanitize script done", flush=True)


def prefill_case(name, *, prefix, extend, group, hkv=2, page=16, k_new=False, bad_ids=False,
                 persistent="1", **opts):
    """One native prefix-prefill call on a shuffled paged cache, checked against the
    reference (hostile ids: finite only)."""
    os.environ["HYGON_ATTN_NATIVE_PREFILL_PERSISTENT"] = persistent
    gen = torch.Generator(device=DEV).manual_seed(1)
    d, hq = 128, hkv * group
    lens_k = [a + b for a, b in zip(prefix, extend)]
    cols = max(-(-n // page) for n in lens_k) + 1
    need = len(lens_k) * cols
    k = torch.randn(need, hkv, page, d, device=DEV, generator=gen).to(torch.bfloat16)
    v = torch.randn(need, hkv, page, d, device=DEV, generator=gen).to(torch.bfloat16)
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
    kw = dict(opts)
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


def prefill_cases():
    prefill_case("paged causal G4", prefix=(300, 0, 129), extend=(200, 70, 1), group=4)
    prefill_case("paged causal G4 per-item", prefix=(300, 0, 129), extend=(200, 70, 1), group=4,
                 persistent="0")
    prefill_case("dense new K/V G8 page 1", prefix=(100, 7), extend=(150, 300), group=8, page=1,
                 k_new=True)
    prefill_case("non-causal G3", prefix=(257, 0), extend=(60, 131), group=3, causal=False)
    prefill_case("window sinks soft cap", prefix=(400, 5), extend=(200, 90), group=4, page=64,
                 sliding_window=70, soft_cap=15.0,
                 sinks=torch.linspace(-1, 1, 8, device=DEV))
    prefill_case("hostile ids", prefix=(300, 40), extend=(100, 30), group=4, bad_ids=True)
    os.environ.pop("HYGON_ATTN_NATIVE_PREFILL_PERSISTENT", None)


if __name__ == "__main__":
    main()
