"""Compile the paged-decode kernel for sm_90 on any machine (no GPU) and report, per
configuration, what ptxas says: registers, spills, shared memory. Registers decide how
many programs fit on an SM (65,536 registers; 4 warps of 128 registers fit 4), and the
decode's split rule aims at whole waves of programs, so a few registers more can cost a
wave (``ops.decode.tuning.combine_chunk``).

Needs the Triton version of the GPU machine beside the project's (its compiler and
ptxas), e.g. ``pip install --target /tmp/t36 triton==3.6.0``, then:

    PYTHONPATH=/tmp/t36 python scripts/decode_ptxas.py --configs "8,64,2,1;16,64,2,1"

A configuration is ``G,BLOCK_N,stages,split`` (split 1: the fused-combine split launch
with the planned merge chunk); bf16, head_dim 128, page 16, one query token, 4 warps.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

from prefill_ptxas import compile_offline, ptxas_report  # noqa: E402

POINTERS = {"out_ptr": "*bf16", "q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16",
            "block_table_ptr": "*i32", "seq_lens_ptr": "*i32", "sinks_ptr": "*fp32",
            "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32", "max_logits_ptr": "*fp32",
            "exp_sums_ptr": "*fp32", "partial_out_ptr": "*fp32", "counters_ptr": "*i32",
            "tree_ptr": "*i32", "lse_ptr": "*fp32"}
FLOATS = {"scale", "k_scale_value", "v_scale_value", "soft_cap"}
# innermost strides of contiguous tensors: Triton specializes an argument equal to 1
UNIT_STRIDES = {"stride_q_dim", "stride_o_dim", "stride_k_dim", "stride_v_dim",
                "stride_bt_block", "stride_po_dim", "stride_k_chunk"}


def compile_config(group: int, block_n: int, stages: int, split: bool, *, warps: int = 4,
                   head_dim: int = 128, chunk=None, target: tuple = ("cuda", 90, 32)):
    """The compiled kernel of one configuration for ``target`` (default sm_90; e.g.
    ``("hip", "gfx90a", 64)``), and its merge chunk; ``chunk`` overrides the merge's."""
    from hygon_attn_backend.ops.decode import tuning
    from hygon_attn_backend.kernels.decode import paged_decode_kernel as kernel

    rows_pad = 1 << max(0, (group - 1).bit_length())
    if chunk is None:
        chunk = tuning.combine_chunk(rows_pad=rows_pad, head_dim_pad=head_dim,
                                            num_warps=warps)
    const = dict(GROUP=group, HEADS_PER_PROG=group, NUM_TOKENS=1, BLOCK_M=max(16, rows_pad),
                 BLOCK_N=block_n, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim, PAGE_SIZE=16,
                 K_SPLIT_X=0, SPLIT=split, SEQ_SPLIT=split, SCALES_FROM_PTR=False,
                 USE_SOFT_CAP=False, USE_WINDOW=False, USE_SINKS=False, PAGE_PREFETCH=True,
                 FUSED_COMBINE=split, COMBINE_ROWS_PAD=rows_pad, COMBINE_CHUNK=chunk,
                 LAUNCH_DEPENDENTS=False, TREE=False, KV_WIDEN=0, RETURN_LSE=False)
    return compile_offline(kernel, const, POINTERS, FLOATS, UNIT_STRIDES, warps=warps,
                           stages=stages, target=target), chunk


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="1,64,2,1;4,64,2,1;8,64,2,1;16,64,2,1;8,64,2,0",
                        help="';'-separated G,BLOCK_N,stages,split")
    parser.add_argument("--chunk", type=int, default=None, help="force the merge chunk")
    args = parser.parse_args(argv)
    import triton
    print(f"# paged_decode_kernel for sm_90a, Triton {triton.__version__}, bf16, head_dim 128, "
          f"page 16, 4 warps")
    print("| G | BLOCK_N | stages | launch | merge chunk | shared bytes | registers | spill bytes "
          "| programs an SM (registers) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for item in args.configs.split(";"):
        group, block_n, stages, split = (int(x) for x in item.split(","))
        compiled, chunk = compile_config(group, block_n, stages, bool(split), chunk=args.chunk)
        rep = ptxas_report(compiled.asm["ptx"])
        regs = rep["registers"] or 0
        per_warp = -(-regs * 32 // 256) * 256  # allocated in units of 256 per warp
        fit = 65536 // (4 * per_warp) if per_warp else "?"
        print(f"| {group} | {block_n} | {stages} | {'split, fused' if split else 'unsplit'} | "
              f"{chunk if split else '-'} | {compiled.metadata.shared} | {regs} | "
              f"{rep['spill_bytes']} | {fit} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
