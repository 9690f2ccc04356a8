"""Host cost of a native call, on a machine without a GPU: the Python path of
``PrefillPlan.run_layer`` / ``DecodePlan.run_layer`` with ``impl="native"`` and the torch
op each ends in.

csrc/binding.cpp is built with g++ against the CPU torch, its ops registered under the CPU
dispatch key (the stream query stubbed) and linked with entry points that return at once,
so a call costs what the host spends before a launch: the plan's checks, the argument
conversions, the dispatcher, the binding's checks and its parameter struct. The CUDA
launch itself (a few microseconds) is not in it. Back to back, no sync, median of 5 runs.

Usage: TRITON_INTERPRET=1 python scripts/native_host_cost.py [--calls 20000]
(TRITON_INTERPRET only lets the plan be built on CPU tensors; nothing runs in Triton.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
STUB = """#include "hab_ops.h"
extern "C" {
const char* hab_write_kv(const HabWriteKvParams*, void*) { return nullptr; }
const char* hab_copy_blocks(const HabCopyBlocksParams*, void*) { return nullptr; }
const char* hab_paged_decode(const HabDecodeParams*, void*) { return nullptr; }
const char* hab_prefix_prefill(const HabPrefillParams*, void*) { return nullptr; }
int hab_decode_programs_per_sm(int, int, int, int, int, int) { return 2; }
int hab_runtime_warp_size(void) { return 32; }
}
"""


def build(out_dir: Path) -> Path:
    """The CPU-dispatch binding with stub entry points, as a shared library."""
    src = (ROOT / "csrc" / "binding.cpp").read_text()
    src = src.replace("TORCH_LIBRARY_IMPL(hygon_attn, CUDA, m)", "TORCH_LIBRARY_IMPL(hygon_attn, CPU, m)")
    src = src.replace("  return impl->getStream(t.device()).native_handle();",
                      "  (void)impl->getStream(t.device());\n  return nullptr;")
    (out_dir / "binding_cpu.cpp").write_text(src)
    (out_dir / "stub.cpp").write_text(STUB)
    from torch.utils.cpp_extension import include_paths
    lib = Path(torch.__file__).parent / "lib"
    so = out_dir / "hab_cpu.so"
    cmd = ["g++", "-O2", "-std=c++17", "-fPIC", "-shared", f"-I{ROOT / 'csrc'}"]
    for path in include_paths():
        cmd += ["-isystem", path]
    cmd += [str(out_dir / "binding_cpu.cpp"), str(out_dir / "stub.cpp"), f"-L{lib}", "-lc10",
            "-ltorch_cpu", "-ltorch", "-o", str(so)]
    subprocess.run(cmd, check=True)
    return so


def per_call_us(fn, calls: int) -> float:
    for _ in range(calls // 10):
        fn()
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("set TRITON_INTERPRET=1 (the plan is built on CPU tensors)")
    with tempfile.TemporaryDirectory() as tmp:
        torch.ops.load_library(str(build(Path(tmp))))
    from hygon_attn_backend.ops import _native
    from hygon_attn_backend.ops.prefill_plan import PrefillLayer, plan_prefix_prefill

    _native._ops = lambda: torch.ops.hygon_attn  # the stub library's ops
    # one request of 64 new tokens after a 64-token prefix, 32/8 heads, D=128, page 16, bshd
    T, hq, hkv, d, blocks, page = 64, 32, 8, 128, 64, 16
    q = torch.randn(T, hq, d, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    k = torch.randn(blocks, page, hkv, d, dtype=torch.bfloat16).permute(0, 2, 1, 3)
    v = torch.randn(blocks, page, hkv, d, dtype=torch.bfloat16).permute(0, 2, 1, 3)
    table = torch.arange(8, dtype=torch.int32).view(1, 8)
    cu = torch.tensor([0, T], dtype=torch.int32)
    lens = torch.tensor([2 * T], dtype=torch.int32)
    plan = plan_prefix_prefill(cu, lens, total_q=T, num_q_heads=hq, num_kv_heads=hkv,
                               head_dim=d, impl="triton")
    # what plan_prefix_prefill sets on an sm_90 GPU, set by hand on the CPU plan
    plan.impl = plan.impl_requested = "native"
    plan.native_overlaps = (True, True)
    plan.sched = torch.zeros(2, dtype=torch.int32)
    layer = PrefillLayer(k, v, causal=True)
    layer.native_why = None
    op_args = (out, q, k, v, None, None, None, None, table, cu, lens, plan.tile_req,
               plan.tile_mblock, plan.sched, d ** -0.5, 0.0, True, 0, True, True)
    rows = [
        ("PrefillPlan.run_layer, impl native (to the op)",
         lambda: plan.run_layer(layer, q, table, cu, lens, out=out)),
        ("  _native.prefill_call_unsupported (q, out)",
         lambda: _native.prefill_call_unsupported(q, out, None, None)),
        ("  torch.ops.hygon_attn.prefix_prefill (dispatch + binding)",
         lambda: torch.ops.hygon_attn.prefix_prefill(*op_args)),
    ]
    rows += decode_rows()
    for name, fn in rows:
        print(f"{name:60s} {per_call_us(fn, args.calls):6.2f} us")


def decode_rows() -> list:
    """The native decode's per-layer call (the default on HIP): batch 32 at 512 tokens,
    32/8 heads, D=128, page 16, split in two partitions (the workspace's path)."""
    from hygon_attn_backend.ops.decode import allocate_decode_workspace
    from hygon_attn_backend.ops.decode_plan import DecodeLayer, plan_paged_decode

    B, hq, hkv, d, page, ctx = 32, 32, 8, 128, 16, 512
    blocks = B * ctx // page
    k = torch.randn(blocks, page, hkv, d, dtype=torch.bfloat16).permute(0, 2, 1, 3)
    v = torch.randn(blocks, page, hkv, d, dtype=torch.bfloat16).permute(0, 2, 1, 3)
    table = torch.arange(blocks, dtype=torch.int32).view(B, -1)
    lens = torch.full((B,), ctx, dtype=torch.int32)
    q = torch.randn(B, hq, d, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ws = allocate_decode_workspace(max_num_seqs=B, num_q_heads=hq, num_kv_heads=hkv,
                                   head_dim=d, max_context_len=ctx, device=q.device)
    plan = plan_paged_decode(table, lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                             page_size=page, q_dtype=q.dtype, kv_dtype=k.dtype,
                             max_seq_len=ctx, workspace=ws, partition_size=256, impl="triton")
    plan.impl, plan.native_stages, plan.native_tile = "native", 3, 64  # as on a GPU
    layer = DecodeLayer(k, v)
    return [("DecodePlan.run_layer, impl native (to the op)",
             lambda: plan.run_layer(layer, q, out))]


if __name__ == "__main__":
    main()
