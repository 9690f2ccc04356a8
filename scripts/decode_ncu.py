"""One call of each decode kernel under Nsight Compute, for the hardware counters that
timing alone cannot give (a CUDA GPU with ``ncu``; Firecracker machines read them).

Each case is a shape, a head split and an implementation (Triton or native), planned as
the op plans it (partitions, tile, stages), on a bshd cache of 16-token pages in a
random permutation (``bench.problems``). Every case runs twice unprofiled (compiles,
warm-up), then once between ``cudaProfilerStart`` / ``cudaProfilerStop``, so with
``--profile-from-start off`` ncu sees exactly one call per case, in the order printed.

    ncu --profile-from-start off --clock-control none --section SpeedOfLight \\
        --section Occupancy --section WarpStateStats --section SchedulerStats \\
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \\
        --section InstructionStats --csv --page details \\
        python3 scripts/decode_ncu.py [--cases "1,32768,32,8,triton;..."] > ncu.csv

(The run of 2026-12-01 in ``docs/native-measurements.md`` used the first five sections;
ComputeWorkloadAnalysis and InstructionStats add the pipe utilization and the instruction
mix that say which unit the native loop waits on.)
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

CASES = ("1,32768,32,8,triton;1,32768,32,8,native;1,32768,32,4,triton;1,32768,32,4,native;"
         "64,4096,32,8,triton;64,4096,32,8,native;64,4096,32,4,triton;64,4096,32,4,native;"
         "8,8192,32,8,triton")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=CASES, help="';'-separated B,ctx,Hq,Hkv,impl")
    args = parser.parse_args(argv)
    import torch
    from hygon_attn_backend.bench import problems
    from hygon_attn_backend.bench.peers import ours_decode

    for case in args.cases.split(";"):
        b, ctx, hq, hkv, impl = case.split(",")
        prob = problems.build_decode(batch=int(b), ctx=int(ctx), page_size=16,
                                     num_q_heads=int(hq), num_kv_heads=int(hkv),
                                     head_dim=128, dtype=torch.bfloat16, device="cuda")
        runner = ours_decode(prob, partition_size=None, impl=impl, label=case)
        runner.fn()
        ok, err, budget = problems.check_decode(prob, runner.out)
        runner.fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        runner.fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        print(f"case {case}: {runner.note}; max error {err:.2e} within {budget:.2e}: {ok}",
              file=sys.stderr, flush=True)
        del prob, runner
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
