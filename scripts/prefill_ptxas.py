"""Compile the prefix-prefill kernel for sm_90 on any machine (no GPU) and report, per
tile, what ptxas says about it: registers, spills, shared memory and whether it
serializes the kernel's wgmma instructions (its C7510-C7520 "Potential Performance Loss"
notes). A serialized kernel waits for every wgmma before issuing the next one, so a tile
that compiles without that note is the one worth timing.

Needs the Triton version of the GPU machine beside the project's (its compiler and the
ptxas it bundles), e.g. ``pip install --target /tmp/t36 triton==3.6.0``, then:

    PYTHONPATH=/tmp/t36 python scripts/prefill_ptxas.py --tiles "256,64,16,3;128,64,8,3"

Shapes of the compile: bf16, head_dim 128, GQA group 4, page size ``--page``, every key
from the cache (``--k-new`` for dense new keys), causal, no window / soft cap / sinks.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

POINTERS = {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16", "k_new_ptr": "*bf16",
            "v_new_ptr": "*bf16", "out_ptr": "*bf16", "lse_ptr": "*fp32", "sinks_ptr": "*fp32",
            "block_table_ptr": "*i32", "cu_seqlens_q_ptr": "*i32", "seq_lens_k_ptr": "*i32",
            "tile_req_ptr": "*i32", "tile_mblock_ptr": "*i32", "k_scale_ptr": "*fp32",
            "v_scale_ptr": "*fp32", "tree_ptr": "*i32"}
FLOATS = {"sm_scale", "k_scale_val", "v_scale_val", "soft_cap"}
# innermost strides of contiguous tensors: Triton specializes an argument equal to 1
UNIT_STRIDES = {"stride_qd", "stride_kd", "stride_vd", "stride_knd", "stride_vnd", "stride_od",
                "stride_bt_block", "stride_lseh"}


def compile_sm90(kernel, const: dict, pointers: dict, floats, unit_strides, *, warps: int,
                 stages: int):
    """Compile a ``@triton.jit`` kernel for sm_90 with no GPU: ``const`` its constexprs,
    ``pointers`` the element type of each pointer argument (16-byte aligned), ``floats``
    the fp32 arguments, ``unit_strides`` the strides that are 1 (Triton specializes them);
    every other argument is an int32, the strides multiples of 16 (page-aligned caches)."""
    return compile_offline(kernel, const, pointers, floats, unit_strides, warps=warps,
                           stages=stages, target=("cuda", 90, 32))


def compile_offline(kernel, const: dict, pointers: dict, floats, unit_strides, *, warps: int,
                    stages: int, target: tuple):
    """:func:`compile_sm90` for any ``target`` ``(backend, arch, warp size)``, e.g.
    ``("hip", "gfx90a", 64)`` (Triton's AMD backend compiles with no GPU too)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = dict(const)
    names = kernel.arg_names
    signature, attrs = {}, {}
    for i, name in enumerate(names):
        if name in const:
            signature[name] = "constexpr"
        elif name in unit_strides:
            signature[name] = "constexpr"
            const[name] = 1
        elif name in pointers:
            signature[name] = pointers[name]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name in floats:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=signature,
                    constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget(*target),
                          options=dict(num_warps=warps, num_stages=stages))


def compile_tile(block_m: int, block_n: int, warps: int, stages: int, *, page: int,
                 k_new: bool, head_dim: int = 128, group: int = 4, two_walks: bool = False,
                 fp8: bool = False):
    """``(ptx, shared bytes)`` of the kernel for one tile, compiled for sm_90."""
    compiled = compile_tile_for(block_m, block_n, warps, stages, page=page, k_new=k_new,
                                head_dim=head_dim, group=group, two_walks=two_walks, fp8=fp8)
    return compiled.asm["ptx"], compiled.metadata.shared


def compile_tile_for(block_m: int, block_n: int, warps: int, stages: int, *, page: int = 16,
                     k_new: bool = False, head_dim: int = 128, group: int = 4,
                     two_walks: bool = False, fp8: bool = False,
                     target: tuple = ("cuda", 90, 32)):
    """The compiled kernel of one tile for ``target`` (:func:`compile_offline`)."""
    from hygon_attn_backend.kernels.prefill import prefix_prefill_kernel as kernel

    const = dict(GROUP=group, BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim,
                 PAGE_SIZE=page, CAUSAL=True, HAS_K_NEW=k_new, RETURN_LSE=False,
                 SCALE_FROM_PTR=False, WINDOW=False, SOFT_CAP=False, HAS_SINKS=False,
                 KV_SCALED=fp8, PAD_D=False, TWO_WALKS=two_walks, TREE=False)
    pointers = dict(POINTERS)
    if fp8:
        pointers.update(k_cache_ptr="*fp8e4nv", v_cache_ptr="*fp8e4nv")
    return compile_offline(kernel, const, pointers, FLOATS, UNIT_STRIDES, warps=warps,
                           stages=stages, target=target)


def amdgcn_resources(asm: str) -> dict:
    """VGPRs, SGPRs, scratch bytes a lane and spill counts from a HIP kernel's listing."""
    def field(name):
        m = re.search(rf"\.{name}:\s+(\d+)", asm)
        return int(m.group(1)) if m else None
    return {"vgprs": field("vgpr_count"), "sgprs": field("sgpr_count"),
            "scratch": field("private_segment_fixed_size"),
            "vgpr_spills": field("vgpr_spill_count"), "sgpr_spills": field("sgpr_spill_count")}


def ptxas_report(ptx: str) -> dict:
    """Registers, spill bytes and serialization notes of ``ptxas -arch=sm_90a -v``."""
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as fh:
            fh.write(ptx)
        out = subprocess.run([ptxas, "-arch=sm_90a", "-v", path, "-o", path + ".cubin"],
                             capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores", text)
    notes = re.findall(r"\((C75\d\d)\) Potential Performance Loss: ([^\n]*)", text)
    return {"registers": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spill.group(1)) if spill else None,
            "serialized": [f"{code}: {msg.split(' in the function')[0]}" for code, msg in notes]}


def hip_table(args) -> int:
    import triton
    print(f"# prefix_prefill_kernel for {args.hip}, Triton {triton.__version__}, bf16, group 4, "
          f"head_dim {args.head_dim}, page {args.page}")
    print("| tile | shared bytes | VGPRs | scratch B/lane | VGPR spills | SGPR spills |")
    print("| --- | --- | --- | --- | --- | --- |")
    for item in args.tiles.split(";"):
        bm, bn, warps, stages = (int(x) for x in item.split(","))
        compiled = compile_tile_for(bm, bn, warps, stages, page=args.page, k_new=args.k_new,
                                    head_dim=args.head_dim, fp8=args.fp8,
                                    target=("hip", args.hip, 64))
        r = amdgcn_resources(compiled.asm["amdgcn"])
        print(f"| {bm}x{bn}, {warps}w, {stages}s | {compiled.metadata.shared} | {r['vgprs']} | "
              f"{r['scratch']} | {r['vgpr_spills']} | {r['sgpr_spills']} |", flush=True)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiles", default="256,64,16,3;256,32,16,3;128,64,8,3;128,128,8,3",
                        help="';'-separated BLOCK_M,BLOCK_N,warps,stages")
    parser.add_argument("--page", type=int, default=16)
    parser.add_argument("--k-new", action="store_true", help="dense new keys (SGLang's extend)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--two-walks", action="store_true",
                        help="TWO_WALKS: the unmasked walk compiled with and without key checks")
    parser.add_argument("--fp8", action="store_true", help="fp8 e4m3 K/V cache")
    parser.add_argument("--hip", default=None, metavar="ARCH",
                        help="compile for this AMD target instead (e.g. gfx90a): shared bytes "
                        "against its 64 KB of LDS, VGPRs, scratch, spills")
    args = parser.parse_args(argv)
    if args.hip:
        return hip_table(args)
    import triton
    print(f"# prefix_prefill_kernel for sm_90a, Triton {triton.__version__}, bf16, "
          f"group 4, head_dim {args.head_dim}, page {args.page}, "
          f"{'dense new keys' if args.k_new else 'keys from the cache'}"
          f"{', fp8 KV' if args.fp8 else ''}{', two walks' if args.two_walks else ''}")
    print("| tile | shared bytes | registers | spill bytes | wgmma |")
    print("| --- | --- | --- | --- | --- |")
    for item in args.tiles.split(";"):
        bm, bn, warps, stages = (int(x) for x in item.split(","))
        ptx, shared = compile_tile(bm, bn, warps, stages, page=args.page, k_new=args.k_new,
                                   head_dim=args.head_dim, two_walks=args.two_walks,
                                   fp8=args.fp8)
        rep = ptxas_report(ptx)
        wgmma = "; ".join(rep["serialized"]) or "asynchronous"
        print(f"| {bm}x{bn}, {warps}w, {stages}s | {shared} | {rep['registers']} | "
              f"{rep['spill_bytes']} | {wgmma} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
