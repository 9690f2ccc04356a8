"""``hygon-attn bench step``: a vLLM step's attention, eager against graph-replayed.

What an engine pays for attention in one step is the kernels' GPU time plus whatever the
host adds: the per-step metadata work (vLLM's metadata builder: the batch split and the
plans) and, per layer, the time to issue the launches. When the host issues a layer's
launches faster than the GPU runs them, the step costs the kernels' time; when it does
not, the GPU waits. This bench measures both on vLLM's engine-free core
(``integrations/vllm/step.py``, which ``HygonAttentionMetadataBuilder`` and
``HygonAttentionImpl`` call; vLLM itself is not needed):

* ``builder``: host microseconds of ``make_metadata`` + ``plan_metadata`` (median);
* ``eager``: one step's attention for ``--layers`` layers (per layer: the K/V write, then
  the attention launches), issued eagerly, back to back, timed with CUDA events over many
  steps (no sync between them, as an engine runs);
* ``replayed``: the same layers captured once in a CUDA graph and replayed: the kernels
  alone, with no host in between;
* per layer: ``eager / layers``, ``replayed / layers`` and their difference, the host's
  cost that the GPU did not hide;
* ``--one-launch``: a batch with decodes and extends also as one prefill launch (what a
  mixed vLLM step would cost with every request through the prefix-prefill kernel: one
  launch fewer per layer, but decode rows without the split-KV grid).

No model work runs between the layers here, so the host has nothing to hide behind: this
is the worst case for the eager numbers. Each layer has its own cache (pages in a random
permutation, the same table for every layer, as vLLM allocates them).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Dict, List, Tuple

from hygon_attn_backend.tools.argtypes import count

# batch kinds: decodes (count, context), extends [(prefix, new tokens)]
KINDS: Dict[str, dict] = {
    "decode": dict(decodes=(64, 4096), extends=()),
    "decode-long": dict(decodes=(8, 32768), extends=()),
    "mixed": dict(decodes=(32, 4096), extends=((2048, 512), (2048, 512))),
    "prefill": dict(decodes=(0, 0), extends=((0, 2048),) * 4),
    "extend": dict(decodes=(0, 0), extends=((4096, 256),) * 8),
}


def add_step_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("step", help="a vLLM step's attention: builder + layers, eager "
                                           "against graph-replayed (GPU)")
    p.add_argument("--kinds", default=",".join(KINDS),
                   help=f"comma list of batch kinds: {', '.join(KINDS)}")
    p.add_argument("--layers", type=count(1), default=8)
    p.add_argument("--block-size", type=count(1), default=16)
    p.add_argument("--num-q-heads", type=count(1), default=32)
    p.add_argument("--num-kv-heads", type=count(1), default=8)
    p.add_argument("--head-dim", type=count(1), default=128)
    p.add_argument("--steps", type=count(1), default=20, help="steps per timed trial")
    p.add_argument("--one-launch", action="store_true",
                   help="also time each batch with decodes and extends as one prefill "
                        "launch (every request through the prefix-prefill kernel)")
    p.add_argument("--json", default=None, help="write the rows as JSON to this file")
    p.set_defaults(func=run)
    return p


def batch_lists(kind: str) -> Tuple[List[int], List[int], int]:
    """``(seq_lens, query_lens, num_decodes)`` of a kind, decodes first (vLLM's order)."""
    spec = KINDS[kind]
    n_dec, ctx = spec["decodes"]
    seq = [ctx] * n_dec + [p + n for p, n in spec["extends"]]
    qlen = [1] * n_dec + [n for _, n in spec["extends"]]
    return seq, qlen, n_dec


class Step:
    """One batch on ``layers`` layer caches: ``plan()`` is the builder's work, ``run()``
    one step's attention over every layer (write + attention per layer)."""

    def __init__(self, kind: str, *, layers: int, block_size: int, num_q_heads: int,
                 num_kv_heads: int, head_dim: int, device, dtype=None,
                 one_launch: bool = False):
        import torch

        from hygon_attn_backend import layouts
        from hygon_attn_backend.tools.bench._overhead_cases import _cumsum, _last_slots, permuted_table
        from hygon_attn_backend.integrations.vllm import step as vllm_step
        from hygon_attn_backend.ops.decode import allocate_decode_workspace

        dtype = dtype or torch.bfloat16
        seq, qlen, n_dec = batch_lists(kind)
        self.core, self.kind, self.layers = vllm_step, kind, layers
        self.seq, self.qlen, self.num_decodes = seq, qlen, n_dec
        table, num_blocks = permuted_table(seq, page_size=block_size, device=device)
        self.caches = layouts.allocate_vllm(
            "LBHNC", num_layers=layers, num_blocks=num_blocks, block_size=block_size,
            num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype, device=device)
        tokens = sum(qlen)
        cu = [0, *_cumsum(qlen)]
        self.inputs = dict(
            query_start_loc=torch.tensor(cu, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq, dtype=torch.int32, device=device), block_table=table,
            slot_mapping=_last_slots(table, seq, qlen, block_size),
            num_reqs=len(seq), num_actual_tokens=tokens, max_query_len=max(qlen),
            max_seq_len=max(seq), num_decodes=0 if one_launch else n_dec,
            num_decode_tokens=0 if one_launch else n_dec)
        self.query_start_loc_cpu = torch.tensor(cu, dtype=torch.int32)
        self.heads = dict(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                          head_size=head_dim, block_size=block_size, q_dtype=dtype,
                          kv_dtype=dtype)
        self.workspace = allocate_decode_workspace(
            max_num_seqs=max(1, len(seq)), num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim,
            max_context_len=table.shape[1] * block_size, device=device)
        self.layer = vllm_step.LayerSpec(num_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                     head_size=head_dim, scale=head_dim ** -0.5)
        self.query = torch.randn(tokens, num_q_heads, head_dim, device=device).to(dtype)
        self.key = torch.randn(tokens, num_kv_heads, head_dim, device=device).to(dtype)
        self.value = torch.randn_like(self.key)
        self.out = torch.full_like(self.query, float("nan"))
        self.md = None

    def plan(self):
        """The metadata builder's work for this batch (host only)."""
        md = self.core.make_metadata(**self.inputs)
        self.core.plan_metadata(md, **self.heads, workspace=self.workspace,
                                query_start_loc_cpu=self.query_start_loc_cpu)
        self.md = md
        return md

    def run(self) -> None:
        core, md, layer = self.core, self.md, self.layer
        slots = self.inputs["slot_mapping"]
        for kv in self.caches:
            core.write_new_kv(self.key, self.value, kv, slots, layer)
            core.attention(self.query, kv, md, self.out, layer)

    @property
    def launches_per_layer(self) -> int:
        return 1 + (self.md.num_launches if self.md is not None else 0)


def builder_us(step: Step, reps: int = 50) -> float:
    step.plan()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step.plan()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def steps_ms(fn, steps: int, trials: int = 5) -> float:
    """Median over ``trials`` of the mean milliseconds per call of ``steps`` calls issued
    back to back (CUDA events around the whole run)."""
    import torch

    out = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end) / steps)
    return statistics.median(out)


def measure(kind: str, args, device, *, one_launch: bool = False) -> dict:
    from hygon_attn_backend.tools.bench._timing import capture_graph

    step = Step(kind, layers=args.layers, block_size=args.block_size,
                num_q_heads=args.num_q_heads, num_kv_heads=args.num_kv_heads,
                head_dim=args.head_dim, device=device, one_launch=one_launch)
    b_us = builder_us(step)  # leaves the step planned
    step.run()  # compiles and first launches outside the timing
    eager = steps_ms(step.run, args.steps)
    graph = capture_graph(step.run)
    replayed = steps_ms(graph.replay, args.steps)
    del graph
    n = args.layers
    return dict(kind=kind + (" (one launch)" if one_launch else ""), seqs=len(step.seq),
                decodes=step.num_decodes,
                tokens=sum(step.qlen), layers=n, launches_per_layer=step.launches_per_layer,
                builder_us=b_us, eager_us_per_layer=eager * 1e3 / n,
                replayed_us_per_layer=replayed * 1e3 / n,
                host_us_per_layer=(eager - replayed) * 1e3 / n)


def format_rows(rows: List[dict]) -> str:
    lines = ["| batch | requests (decodes) | new tokens | launches per layer | builder us | "
             "per layer: eager us | replayed us | eager - replayed us |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['seqs']} ({r['decodes']}) | {r['tokens']} | "
                     f"{r['launches_per_layer']} | {r['builder_us']:.0f} | "
                     f"{r['eager_us_per_layer']:.1f} | {r['replayed_us_per_layer']:.1f} | "
                     f"{r['host_us_per_layer']:+.1f} |")
    return "\n".join(lines)


def run(args) -> int:
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench step needs a CUDA GPU (CUDA events and graphs)")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        sys.exit(f"--kinds: unknown {unknown}; choose from {list(KINDS)}")
    device = torch.device("cuda")
    rows = []
    for k in kinds:
        rows.append(measure(k, args, device))
        if args.one_launch and KINDS[k]["decodes"][0] and KINDS[k]["extends"]:
            rows.append(measure(k, args, device, one_launch=True))
    print(f"# bench step: {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"Hq/Hkv {args.num_q_heads}/{args.num_kv_heads}, D={args.head_dim}, bf16, page "
          f"{args.block_size}, {args.layers} layers, {args.steps} steps per trial")
    print(format_rows(rows))
    if args.json:
        import json

        with open(args.json, "w") as fh:
            json.dump(dict(rows=rows, device=torch.cuda.get_device_name(),
                           torch=torch.__version__), fh, indent=1)
    return 0
