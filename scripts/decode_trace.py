"""Where each native decode program's time goes: per-program %globaltimer stamps (a GPU).

Needs a trace build of the native kernels: a copy of csrc/ with ``#define HAB_DECODE_TRACE
1`` at the top of compat.h, built into its own directory, e.g.

    cp -r csrc /tmp/trace-src && sed -i '1i #define HAB_DECODE_TRACE 1' /tmp/trace-src/compat.h
    HYGON_ATTN_CSRC=/tmp/trace-src TORCH_EXTENSIONS_DIR=/tmp/ext-trace \\
        python scripts/decode_trace.py --cases "64,4096,64,4;64,16384,64,4"

Each program's thread 0 stamps (csrc/decode_trace.cuh): its entry, the prologue's copies
issued, tile 0 landed (the loop's first barrier), the loop's end and its exit, with its
SM. Per case the call is run eagerly ``--repeats`` times, each after the bench's read flush
(the L2 holds no K/V), and the medians over the repeats are printed: the grid's span from
the first entry to the last exit, how late the last program enters, each phase's median
over the programs, the spread of the loop's durations, and the tail (the last exit after
the median exit). The 64-token split-N loop at head_dim 128 only (decode_d128.cu).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics

import torch

from hygon_attn_backend import native
from hygon_attn_backend.bench._timing import read_flush
from hygon_attn_backend.ops.decode import paged_decode_attention

from bench_native_decode import build  # scripts/ is on the path when a script runs

SLOTS = 8  # csrc/decode_trace.cuh: TRACE_SLOTS
MAX_PROGRAMS = 1 << 16


def trace_setter():
    native.load()
    lib = ctypes.CDLL(str(native.build_dir() / f"{native._EXT_NAME}.so"))
    try:
        setter = lib.hab_decode_trace_set
    except AttributeError:
        raise SystemExit("not a trace build: see this script's docstring (HAB_DECODE_TRACE)")
    setter.restype = ctypes.c_char_p
    setter.argtypes = [ctypes.c_void_p]
    return setter


def one_run(setter, call, flush):
    buf = torch.zeros(MAX_PROGRAMS * SLOTS, dtype=torch.int64, device="cuda")
    err = setter(ctypes.c_void_p(buf.data_ptr()))
    if err:
        raise RuntimeError(err.decode())
    flush()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    torch.cuda.synchronize()
    setter(ctypes.c_void_p(0))
    rows = buf.view(MAX_PROGRAMS, SLOTS)
    rows = rows[rows[:, 0] != 0].cpu().double()
    t0 = rows[:, 0].min()
    us = (rows[:, :5] - t0) / 1000.0  # entry, prologue, tile 0, loop end, exit
    loop = us[:, 3] - us[:, 2]
    exit_ = us[:, 4]
    sms = rows[:, 5].long()
    per_sm = torch.bincount(sms)
    return {
        "event_us": start.elapsed_time(end) * 1000.0,
        "programs": int(rows.shape[0]),
        "span_us": float(exit_.max()),
        "last_entry_us": float(us[:, 0].max()),
        "prologue_us": float((us[:, 1] - us[:, 0]).median()),
        "tile0_us": float((us[:, 2] - us[:, 0]).median()),
        "loop_us": float(loop.median()),
        "loop_p10_p90_max": [float(loop.quantile(0.1)), float(loop.quantile(0.9)), float(loop.max())],
        "epilogue_us": float((us[:, 4] - us[:, 3]).median()),
        "tail_us": float(exit_.max() - exit_.median()),
        "programs_per_sm": [int(per_sm[per_sm > 0].min()), int(per_sm.max())],
        "tiles": int(rows[:, 6].max()),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", default="64,4096,64,4;64,8192,64,4;64,16384,64,4;64,4096,32,8")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    setter = trace_setter()
    flush = read_flush()
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}; native trace build")
    for case in args.cases.split(";"):
        b, ctx, hq, hkv = (int(x) for x in case.split(","))
        q, k, v, table, lens = build(b, ctx, hq, hkv)

        def call():
            return paged_decode_attention(q, k, v, table, lens, impl="native")

        call()  # compiled, planned, warm
        runs = [one_run(setter, call, flush) for _ in range(args.repeats)]
        med = {key: statistics.median(r[key] for r in runs)
               for key in runs[0] if not isinstance(runs[0][key], list)}
        spread = [statistics.median(r["loop_p10_p90_max"][i] for r in runs) for i in range(3)]
        print(f"{case:16s} programs {med['programs']:.0f} ({runs[0]['programs_per_sm']} an SM), "
              f"{med['tiles']:.0f} tiles | event {med['event_us']:6.1f} us, span "
              f"{med['span_us']:6.1f} | last entry {med['last_entry_us']:4.1f} | prologue "
              f"{med['prologue_us']:4.1f}, tile 0 landed {med['tile0_us']:4.1f} | loop "
              f"{med['loop_us']:6.1f} (p10 {spread[0]:6.1f}, p90 {spread[1]:6.1f}, max "
              f"{spread[2]:6.1f}) | epilogue {med['epilogue_us']:4.1f} | tail "
              f"{med['tail_us']:4.1f}", flush=True)


if __name__ == "__main__":
    main()
