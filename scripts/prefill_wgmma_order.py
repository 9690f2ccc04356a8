"""Does Triton keep a wgmma group in flight across the softmax? (no GPU needed)

Compiles a reduced attention loop (dense K/V, no mask) for sm_90a twice: as the prefill
kernel is written, and with the next tile's ``Q K^T`` issued before the current tile's
softmax (FA3's intra-warpgroup pipelining, by hand). Prints, per tile, ptxas's registers
and the order of ``wgmma.mma_async`` (M), ``wgmma.commit_group`` (c), ``wgmma.wait_group
N`` (WN) and the first ``ex2`` of each run (e) in the PTX. A ``W0`` right after every
commit means each dot is waited for before anything else runs (``docs/notes-prefill.md``
v7). Needs the GPU machine's Triton beside the project::

    PYTHONPATH=/tmp/t36 python scripts/prefill_wgmma_order.py
"""

from __future__ import annotations

import os
import sys

import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(__file__))

from prefill_ptxas import compile_sm90, ptxas_report  # noqa: E402


@triton.jit
def _softmax_pv(s, v, m_i, l_i, acc, qk_scale):
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)  # [BLOCK_M]
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * qk_scale - m_new[:, None])  # [BLOCK_M, BLOCK_N]
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])  # [BLOCK_M, D]
    return m_new, l_i, acc


@triton.jit
def reduced_attention(q_ptr, k_ptr, v_ptr, o_ptr, n_keys, qk_scale, stride_t,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                      NEXT_FIRST: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + offs_m[:, None].to(tl.int64) * stride_t + offs_d[None, :])
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    if NEXT_FIRST:
        k = tl.load(k_ptr + offs_n[:, None].to(tl.int64) * stride_t + offs_d[None, :])
        s = tl.dot(q, tl.trans(k))  # [BLOCK_M, BLOCK_N]
        for start in tl.range(BLOCK_N, n_keys + BLOCK_N, BLOCK_N):
            rows = start + offs_n  # [BLOCK_N] the next tile's keys
            k = tl.load(k_ptr + rows[:, None].to(tl.int64) * stride_t + offs_d[None, :],
                        mask=rows[:, None] < n_keys, other=0.0)
            s_next = tl.dot(q, tl.trans(k))  # issued before this tile's softmax
            v = tl.load(v_ptr + (rows - BLOCK_N)[:, None].to(tl.int64) * stride_t
                        + offs_d[None, :])
            m_i, l_i, acc = _softmax_pv(s, v, m_i, l_i, acc, qk_scale)
            s = s_next
    else:
        for start in tl.range(0, n_keys, BLOCK_N):
            rows = start + offs_n
            k = tl.load(k_ptr + rows[:, None].to(tl.int64) * stride_t + offs_d[None, :])
            v = tl.load(v_ptr + rows[:, None].to(tl.int64) * stride_t + offs_d[None, :])
            m_i, l_i, acc = _softmax_pv(tl.dot(q, tl.trans(k)), v, m_i, l_i, acc, qk_scale)
    tl.store(o_ptr + offs_m[:, None].to(tl.int64) * stride_t + offs_d[None, :],
             (acc / l_i[:, None]).to(tl.bfloat16))


def op_order(ptx: str) -> str:
    seq = []
    for line in ptx.splitlines():
        line = line.strip()
        if line.startswith("wgmma.mma_async"):
            seq.append("M")
        elif line.startswith("wgmma.commit_group"):
            seq.append("c")
        elif line.startswith("wgmma.wait_group"):
            seq.append("W" + line.split()[-1].rstrip(";"))
        elif line.startswith("ex2.approx") and (not seq or seq[-1] != "e"):
            seq.append("e")
    return "".join(seq)


def main() -> int:
    pointers = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "o_ptr": "*bf16"}
    print(f"# reduced attention loop for sm_90a, Triton {triton.__version__}, bf16, D=128")
    print("| tile | form | registers | spill bytes | wgmma | order in the PTX |")
    print("| --- | --- | --- | --- | --- | --- |")
    for bm, bn, warps, stages in ((128, 64, 8, 3), (128, 128, 8, 2), (256, 64, 16, 3)):
        for next_first in (False, True):
            compiled = compile_sm90(
                reduced_attention, dict(BLOCK_M=bm, BLOCK_N=bn, D=128, NEXT_FIRST=next_first),
                pointers, {"qk_scale"}, set(), warps=warps, stages=stages)
            ptx = compiled.asm["ptx"]
            rep = ptxas_report(ptx)
            form = "next Q K^T first" if next_first else "as written"
            wgmma = "; ".join(x.split(":")[0] for x in rep["serialized"]) or "asynchronous"
            print(f"| {bm}x{bn}, {warps}w, {stages}s | {form} | {rep['registers']} | "
                  f"{rep['spill_bytes']} | {wgmma} | {op_order(ptx)[:60]} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
