"""Does the cache's layout or the order of its pages move the decode kernel's read rate?
(a CUDA GPU)

Large-batch decode reads its KV at 92-99% of the device copy through 16-token pages in a
random permutation, cuDNN at 101-105% on a dense cache (``docs/benchmarks.md``). This
script times the shipped decode (``bench.peers.ours_decode``: the op's own plan) on the same bytes stored
three ways: ``bshd`` (``[block, slot, head, dim]``: a token's KV heads side by side,
vLLM's and SGLang's layout) with pages permuted and in order, and ``bhsd`` (``[block,
head, slot, dim]``: one head's page contiguous) with pages permuted. Calls are replayed
from a CUDA graph, the L2 cleared before every call (``--l2-flush``), as ``hygon-attn
bench decode`` does; every number is a percentage of the device copy of the same run.
Each output is checked against ``reference.py`` before it is timed
(``bench.problems.check_decode``).

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
from hygon_attn_backend.bench.peers import ours_decode  # noqa: E402

PAGE = 16
SHAPES = "64,4096,32,8;64,16384,32,8;256,2048,32,8;64,4096,32,4;64,32768,32,8"


def problem(batch: int, ctx: int, hq: int, hkv: int, layout: str, order: str):
    """The benchmark's decode problem (``bench.problems.DecodeProblem``) with its cache
    stored in ``layout`` and its pages permuted or in order: ``k_store`` is the
    ``[num_blocks, P, Hkv, D]`` view of that storage, so every tool of the benchmark
    (plans, reference check, byte count) reads it through its strides."""
    nb = batch * (ctx // PAGE)
    shape = (nb, PAGE, hkv, 128) if layout == "bshd" else (nb, hkv, PAGE, 128)
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    if layout != "bshd":
        k, v = k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3)
    ids = torch.randperm(nb, device="cuda") if order == "permuted" else \
        torch.arange(nb, device="cuda")
    table = ids.reshape(batch, -1).to(torch.int32)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    q = torch.randn(batch, hq, 128, device="cuda", dtype=torch.bfloat16)
    return problems.DecodeProblem(q, k, v, table, lens, ctx, PAGE, 128 ** -0.5)


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
        cells = []
        for layout, order in variants:
            prob = problem(batch, ctx, hq, hkv, layout, order)
            runner = ours_decode(prob, partition_size=None)  # the shipped plan
            runner.fn()
            ok, err, budget = problems.check_decode(prob, runner.out)
            assert ok, f"decode differs from the reference: {err:.3e} > {budget:.3e}"
            ms = _timing.graph_ms(runner.fn, args.rep_ms)
            gbps = prob.kv_bytes() / ms / 1e6
            cells.append(f"{100 * gbps / copy:.1f}% ({ms * 1e3:.0f} us)")
            del prob, runner
            torch.cuda.empty_cache()
        print(f"| ({batch}, {ctx}), {hq}/{hkv} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
