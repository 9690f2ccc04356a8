"""Does the cache's layout or the order of its pages move the decode kernel's read rate?
(a CUDA GPU)

Large-batch decode reads its KV at 92-99% of the device copy through 16-token pages in a
random permutation, cuDNN at 101-105% on a dense cache (``docs/benchmarks.md``). This
script times the shipped decode (``plan_paged_decode``, Triton) on the same bytes stored
three ways: ``bshd`` (``[block, slot, head, dim]``: a token's KV heads side by side,
vLLM's and SGLang's layout) with pages permuted and in order, and ``bhsd`` (``[block,
head, slot, dim]``: one head's page contiguous) with pages permuted. Calls are replayed
from a CUDA graph, the L2 cleared before every call (``--l2-flush``), as ``hygon-attn
bench decode`` does; every number is a percentage of the device copy of the same run.
Each output is checked against ``reference.py`` before it is timed.

    python scripts/decode_locality.py [--shapes "64,4096,32,8;..."] [--l2-flush read]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
import triton  # noqa: E402

from hygon_attn_backend.bench import _timing, problems  # noqa: E402

PAGE = 16
SHAPES = "64,4096,32,8;64,16384,32,8;256,2048,32,8;64,4096,32,4;64,32768,32,8"


def caches(batch: int, ctx: int, hkv: int, dim: int, layout: str, order: str):
    """``(k, v, table, page)``: canonical ``[num_blocks, Hkv, P, D]`` views of a cache
    stored in ``layout``, and its ``[B, ctx / P]`` int32 block table."""
    page = PAGE
    blocks_per = ctx // page
    nb = batch * blocks_per
    if layout == "bshd":
        k = torch.randn(nb, page, hkv, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    else:
        k = torch.randn(nb, hkv, page, dim, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
    ids = torch.randperm(nb, device="cuda") if order == "permuted" else \
        torch.arange(nb, device="cuda")
    return k, v, ids.reshape(batch, blocks_per).to(torch.int32), page


def decode_fn(k, v, table, page, ctx, hq):
    from hygon_attn_backend import reference
    from hygon_attn_backend.ops.decode import allocate_decode_workspace, plan_paged_decode
    batch, hkv, dim = table.shape[0], k.shape[1], k.shape[3]
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, hq, dim, device="cuda", dtype=torch.bfloat16)
    ws = allocate_decode_workspace(max_num_seqs=batch, num_q_heads=hq, num_kv_heads=hkv,
                                   head_dim=dim, max_context_len=ctx, device="cuda")
    plan = plan_paged_decode(table, lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=dim,
                             page_size=page, q_dtype=q.dtype, kv_dtype=k.dtype,
                             max_seq_len=ctx, workspace=ws)
    out = torch.empty_like(q)
    fn = lambda: plan.run(q, k, v, out=out)

    def check():  # the benchmark's budget: from the reference's own bf16 error
        fn()
        args = (q[:2], k, v, table[:2], lens[:2])
        ref32 = reference.paged_decode_attention(*args, scale=dim ** -0.5,
                                                 compute_dtype=torch.float32)
        ref_lowp = reference.paged_decode_attention(*args, scale=dim ** -0.5,
                                                    compute_dtype=q.dtype)
        ok, err, budget = problems._budget(out[:2], ref32.float(), ref_lowp, "bfloat16")
        assert ok, f"decode differs from the reference: {err:.3e} > {budget:.3e}"
    return fn, check


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default=SHAPES, help="';'-separated B,ctx,Hq,Hkv")
    parser.add_argument("--l2-flush", choices=_timing.L2_FLUSHES, default="read")
    parser.add_argument("--rep-ms", type=float, default=30.0)
    args = parser.parse_args(argv)
    _timing.set_l2_flush(args.l2_flush)
    copy, _ = _timing.copy_ceiling(args.rep_ms)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}; bf16, D=128, page {PAGE}; L2 cleared by a {args.l2_flush}; "
          f"copy {copy:.0f} GB/s = 100%")
    variants = [("bshd", "permuted"), ("bshd", "in order"), ("bhsd", "permuted")]
    print("| (B, ctx), Hq/Hkv | " + " | ".join(" ".join(x) for x in variants) + " |")
    print("|---" * (len(variants) + 1) + "|")
    for shape in args.shapes.split(";"):
        batch, ctx, hq, hkv = (int(x) for x in shape.split(","))
        nbytes = 2 * batch * ctx * hkv * 128 * 2
        cells = []
        for layout, order in variants:
            k, v, table, page = caches(batch, ctx, hkv, 128, layout, order)
            fn, check = decode_fn(k, v, table, page, ctx, hq)
            check()
            ms = _timing.graph_ms(fn, args.rep_ms)
            cells.append(f"{100 * nbytes / ms / 1e6 / copy:.1f}% ({ms * 1e3:.0f} us)")
            del k, v, table, fn, check
            torch.cuda.empty_cache()
        print(f"| ({batch}, {ctx}), {hq}/{hkv} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
