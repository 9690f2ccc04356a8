"""Registers, scratch and occupancy of the native kernels as hipcc builds them for AMD/Hygon
targets, on a machine without a GPU: csrc/ compiled at -O3 (the optimised build, unlike the
CI compile check's -O0) with ``-Rpass-analysis=kernel-resource-usage``, one row a kernel.

Scratch past the 16 bytes every decode kernel keeps is spilled registers (the ISA's
"Folded Spill/Reload"); on gfx9 scratch goes through the same vector memory path as the
KV loads. The occupancy is what the register budget allows (waves a SIMD).

Usage: python scripts/native_hip_resources.py [--archs gfx906,gfx90a]
           [--files decode_d64.cu,decode_d128.cu,decode_d256.cu] [-D NAME=VALUE ...]
Needs hipcc (Debian's package, as scripts/ci_native_compile.sh installs it).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"
REMARK = re.compile(r"remark:\s+(Function Name|VGPRs|AGPRs|ScratchSize \[bytes/lane\]|"
                    r"Occupancy \[waves/SIMD\]):\s*(\S+)")
# paged_decode_kernel<KIND, ROWS, HEAD_DIM_PAD, WARP, SN>
DECODE = re.compile(r"paged_decode_kernelI7Hab(\w+?)Li(\d+)ELi(\d+)ELi(\d+)ELi(\d+)E")


def resources(arch: str, source: str, defines) -> list:
    """[(kernel, vgprs, agprs, scratch, occupancy)] of one file for one arch."""
    cmd = ["hipcc", f"--offload-arch={arch}", "-O3", "-std=c++17", "-fPIC", "-c", source,
           "-o", os.devnull, "-Rpass-analysis=kernel-resource-usage"]
    cmd += [f"-D{d}" for d in defines]
    env = dict(os.environ, HIP_PLATFORM="amd")
    run = subprocess.run(cmd, cwd=CSRC, env=env, capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"hipcc failed on {source} for {arch}:\n{run.stderr[-3000:]}")
    rows, cur = [], {}
    for key, value in REMARK.findall(run.stderr):
        if key == "Function Name":
            if cur:
                rows.append(cur)
            cur = {"name": value}
        else:
            cur[key.split(" ")[0]] = value
    if cur:
        rows.append(cur)
    return rows


def short(name: str) -> str:
    m = DECODE.search(name)
    if m:
        kind, rows, dim, warp, sn = m.groups()
        return f"decode {kind} rows {rows} D{dim} wave {warp}" + (f" SN{sn}" if sn != "0" else "")
    return re.sub(r"^_ZN\w*?(\d+)([a-z_]+kernel).*$", r"\2", name)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archs", default="gfx906,gfx90a")
    parser.add_argument("--files", default="decode_d64.cu,decode_d128.cu,decode_d256.cu")
    parser.add_argument("-D", dest="defines", action="append", default=[],
                        help="a macro for the build (e.g. HAB_DECODE_MIN_BLOCKS=1)")
    args = parser.parse_args()
    jobs = [(a, f) for a in args.archs.split(",") for f in args.files.split(",")]
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(lambda job: (job, resources(*job, args.defines)), jobs))
    print("| arch | kernel | VGPRs | AGPRs | scratch B/lane | waves/SIMD |")
    print("| --- | --- | --- | --- | --- | --- |")
    for (arch, _), rows in results:
        for r in rows:
            if r.get("VGPRs", "0") == "0":  # the other wave size's empty instantiation
                continue
            print(f"| {arch} | {short(r['name'])} | {r.get('VGPRs')} | {r.get('AGPRs', '-')} | "
                  f"{r.get('ScratchSize')} | {r.get('Occupancy')} |")


if __name__ == "__main__":
    main()
