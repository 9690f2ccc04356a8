"""``hygon-attn demo --ops``: every public op on one built-in problem, checked against the
reference.

The problem is one engine step in miniature: two requests whose prompts are written into
a paged cache (``write_kv``), a prefix-prefill step over a cached prefix, then a decode
step, then a copy-on-write ``copy_blocks``. On a GPU the Triton kernels run natively; on
a CPU they run in Triton's interpreter (small sizes, a few seconds).
"""

from __future__ import annotations

import os
import time


def run(seed: int = 0) -> int:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported
    from hygon_attn_backend import layouts, reference
    from hygon_attn_backend.ops.cache import copy_blocks, write_kv
    from hygon_attn_backend.ops.decode import paged_decode_attention
    from hygon_attn_backend.ops.prefill import prefix_prefill_attention

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.float16  # the interpreter's bf16 dot is unreliable; fp16 runs everywhere
    gen = torch.Generator(device="cpu").manual_seed(seed)
    hkv, group, d, page, num_blocks = 2, 4, 64, 16, 12
    hq = hkv * group
    prefix, extend = [20, 7], [12, 5]
    total = [p + e for p, e in zip(prefix, extend)]

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dev, dtype)

    k_store = layouts.allocate("bshd", num_blocks=num_blocks, block_size=page,
                               num_kv_heads=hkv, head_dim=d, dtype=dtype, device=dev)
    v_store = layouts.allocate("bshd", num_blocks=num_blocks, block_size=page,
                               num_kv_heads=hkv, head_dim=d, dtype=dtype, device=dev)
    k_cache, v_cache = layouts.kv_views("bshd", k_store, v_store)
    table = torch.tensor([[3, 7, 1], [10, 0, 5]], dtype=torch.int32, device=dev)

    def slots(b, start, stop):
        t = torch.arange(start, stop, device=dev)
        return table[b, t // page].long() * page + t % page

    rows = []
    ok = True

    def check(name, got, ref64, ref_lowp, seconds):
        nonlocal ok
        err = (got.double() - ref64.double()).abs().max().item()
        ref_err = (ref_lowp.double() - ref64.double()).abs().max().item()
        passed = bool(torch.isfinite(got).all()) and err <= 4 * ref_err + 2e-3
        ok &= passed
        rows.append((name, tuple(got.shape), err, ref_err, seconds, passed))

    # 1. write every token's K/V (prefix and new) into the cache; one padding slot (-1)
    k_all = [randn(n, hkv, d) for n in total]
    v_all = [randn(n, hkv, d) for n in total]
    k_tok, v_tok = torch.cat(k_all), torch.cat(v_all)
    slot_map = torch.cat([slots(b, 0, n) for b, n in enumerate(total)])
    k_tok = torch.cat([k_tok, randn(1, hkv, d)])
    v_tok = torch.cat([v_tok, randn(1, hkv, d)])
    slot_map = torch.cat([slot_map, torch.tensor([-1], device=dev)])
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    t0 = time.perf_counter()
    write_kv(k_tok, v_tok, k_cache, v_cache, slot_map)
    sec = time.perf_counter() - t0
    reference.write_kv(k_tok, v_tok, ref_k, ref_v, slot_map)
    same = torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    ok &= same
    rows.append(("write_kv", tuple(k_tok.shape), 0.0 if same else float("inf"), 0.0, sec, same))

    # 2. prefix prefill: the new tokens attend to their cached prefix and to themselves
    q = randn(sum(extend), hq, d)
    cu = torch.tensor([0, extend[0], sum(extend)], dtype=torch.int32, device=dev)
    seq_k = torch.tensor(total, dtype=torch.int32, device=dev)
    t0 = time.perf_counter()
    out = prefix_prefill_attention(q, k_cache, v_cache, table, cu, seq_k)
    sec = time.perf_counter() - t0
    args = (q, k_cache, v_cache, table, cu, seq_k)
    check("prefix_prefill_attention", out,
          reference.prefix_prefill_attention(*args, compute_dtype=torch.float64),
          reference.prefix_prefill_attention(*args, compute_dtype=dtype), sec)

    # 3. decode one token per request over the whole cached sequence, forced split-KV
    qd = randn(2, hq, d)
    t0 = time.perf_counter()
    outd = paged_decode_attention(qd, k_cache, v_cache, table, seq_k, partition_size=16)
    sec = time.perf_counter() - t0
    args = (qd, k_cache, v_cache, table, seq_k)
    check("paged_decode_attention", outd,
          reference.paged_decode_attention(*args, compute_dtype=torch.float64),
          reference.paged_decode_attention(*args, compute_dtype=dtype), sec)

    # 4. copy-on-write: fork request 0's tail block (7 -> 11)
    mapping = torch.tensor([[7, 11]], dtype=torch.int64, device=dev)
    t0 = time.perf_counter()
    copy_blocks(k_store, v_store, mapping)
    sec = time.perf_counter() - t0
    same = torch.equal(k_cache[11], k_cache[7]) and torch.equal(v_cache[11], v_cache[7])
    ok &= same
    rows.append(("copy_blocks", tuple(mapping.shape), 0.0 if same else float("inf"), 0.0,
                 sec, same))

    where = "GPU " + torch.cuda.get_device_name(0) if dev.type == "cuda" else "CPU (Triton interpreter)"
    print(f"hygon-attn demo --ops on {where}: {hq} q heads / {hkv} kv heads, head_dim {d}, "
          f"page {page}, prefix {prefix}, new tokens {extend}, {dtype}")
    print(f"{'op':<28}{'shape':<18}{'max err':>10}{'ref own err':>13}{'time s':>9}  result")
    for name, shape, err, ref_err, sec, passed in rows:
        print(f"{name:<28}{str(shape):<18}{err:>10.2e}{ref_err:>13.2e}{sec:>9.3f}  "
              f"{'ok' if passed else 'FAIL'}")
    print("all ops match the reference" if ok else "MISMATCH against the reference")
    return 0 if ok else 1
