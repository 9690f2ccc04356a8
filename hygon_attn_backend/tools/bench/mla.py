"""``hygon-attn bench mla``: MLA decode latent-read GB/s beside an in-run device copy, and
beside the engines' Triton MLA decodes named by ``--compare``.

The decode reads each cached latent row once: ``B * ctx * (kv_lora_rank + rope_dim) *
elem`` bytes a call (q and out are < 1% of it at these sizes). Achieved GB/s is those
bytes over the median time of one CUDA-graph replay of the call, the L2 cleared before
every replay (:mod:`hygon_attn_backend.tools.bench._timing`); 100% is a device-to-device
copy measured in the same run. The cache is ``[num_blocks, P, W]``, every request's pages
a slice of a random permutation; each implementation's output is checked against the
reference before it is timed.

Rows per (B, ctx) shape, head count and page size: ours with the shipped rules (``auto``),
any ``--tiles`` / ``--partitions`` forced beside it, the MTP rows (``--mtp``: T query
tokens a request, the causal verify; the note gives the time over the T = 1 row's), the
peers, and a device copy moving the same bytes. Peers: ``sglang`` (``decode_attention_fwd``
of ``sglang.kernels.ops.attention.decode_attention`` with the MLA pool's ``[slots, 1, W]``
rows, the value its first ``kv_lora_rank`` columns, ``has_mla``, SGLang's own
``num_kv_splits`` of at most 8), ``vllm`` (``decode_attention_fwd`` of
``vllm.v1.attention.ops.triton_decode_attention`` with ``is_mla``, the block table and
``_compute_num_kv_splits``'s power-of-two split count, as its Triton MLA backend calls it),
``flashinfer`` (``BatchMLAPagedAttentionWrapper`` of ``flashinfer.mla``, FlashInfer 0.6.18:
the ``fa3`` backend on sm_90, ``fa2`` elsewhere, CUDA-graph buffers, ``plan`` once before
timing, the latent and rope parts of the cache passed as strided views; the one peer also
timed on the MTP rows, causal, its note giving the time over its own one-token row).

``--kv-dtype auto,fp8_e4m3,fp8_e5m2`` runs each point with each latent cache dtype: the same
random rows quantized with one per-tensor scale, the GB/s counting the bytes the cache holds
and an fp8 row's note its time over the same label's ``auto`` row. vLLM's peer gets the scale;
SGLang's and FlashInfer's are timed with 16-bit caches only.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from hygon_attn_backend.tools.argtypes import count, int_list, positive_float, tuple_list
from hygon_attn_backend.tools.bench import _harness, output
from hygon_attn_backend.tools.bench._runner import Runner, Unavailable
from hygon_attn_backend.tools.bench.decode import add_kv_dtype_option, labelled, relate_to_auto

DEFAULT_SHAPES = "32,4096;32,32768;64,8192;128,4096;128,32768"
GPU_DEFAULTS = dict(shapes=DEFAULT_SHAPES, heads="128,16", dtype="bfloat16")
CPU_DEFAULTS = dict(shapes="2,40", heads="16", dtype="float16")
MLA_PEERS = ("sglang", "vllm", "flashinfer")
MTP_PEERS = ("flashinfer",)  # the peers timed on the --mtp rows too
SGLANG_MAX_KV_SPLITS = 8  # server default of --triton-attention-num-kv-splits
VLLM_MIN_WORK_PER_SPLIT = 512  # vllm/v1/attention/backends/mla/triton_mla.py
VLLM_SPLIT_OCCUPANCY_MULTIPLIER = 2
CHECK_SEQS = 4


@dataclass
class MLAProblem:
    """q: ``[B, (T,) Hq, W]``; kv: ``[num_blocks, P, W]``; block_table ``[B, ctx / P]`` int32
    (a random permutation of the blocks); seq_lens ``[B]`` int32, all ``ctx``."""

    q: object
    kv: object
    block_table: object
    seq_lens: object
    ctx: int
    page_size: int
    rank: int
    scale: float
    kv_scale: float = 1.0  # an fp8 cache's per-tensor scale (1 for a 16-bit cache)

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def num_q_heads(self) -> int:
        return self.q.shape[-2]

    @property
    def num_tokens(self) -> int:
        return 1 if self.q.dim() == 3 else self.q.shape[1]

    @property
    def fp8(self) -> bool:
        return self.kv.element_size() == 1

    def kv_bytes(self) -> int:
        return self.batch * self.ctx * self.kv.shape[2] * self.kv.element_size()

    def token_slots(self):
        """``[B, ctx]`` int64 token slots (``block * P + offset``) of every key."""
        import torch
        pos = torch.arange(self.ctx, device=self.q.device)
        blocks = self.block_table.to(torch.int64)[:, pos // self.page_size]
        return blocks * self.page_size + pos % self.page_size


def build(*, batch, ctx, page_size, heads, rank, rope, tokens, dtype, device, seed=0,
          kv_dtype=None):
    """The problem; ``kv_dtype`` fp8: the same random cache quantized with one per-tensor
    scale (``problems.quantize_caches``' rule), None: ``dtype``."""
    import torch
    gen = torch.Generator(device=device).manual_seed(seed)
    blocks_per = -(-ctx // page_size)
    nb = batch * blocks_per
    kv = torch.randn((nb, page_size, rank + rope), device=device, generator=gen).to(dtype)
    kv_scale = 1.0
    if kv_dtype is not None and kv_dtype != dtype:
        from hygon_attn_backend.tools.bench.problems import quantize_caches
        kv, _, kv_scale, _ = quantize_caches(kv, kv[:0], kv_dtype)
    table = torch.randperm(nb, device=device, generator=gen).reshape(batch, blocks_per)
    lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    shape = (batch, heads, rank + rope) if tokens == 1 else (batch, tokens, heads, rank + rope)
    q = torch.randn(shape, device=device, generator=gen).to(dtype)
    return MLAProblem(q, kv, table.to(torch.int32), lens, ctx, page_size, rank,
                      (rank + rope) ** -0.5, kv_scale)


def check(prob: MLAProblem, out) -> tuple:
    """``(ok, max error, budget)`` of ``out`` on the first requests, the budget rule of
    the other benchmarks (``problems._budget``)."""
    import torch
    from hygon_attn_backend import reference
    from hygon_attn_backend.tools.bench.problems import _budget
    n = min(prob.batch, CHECK_SEQS)
    args = (prob.q[:n], prob.kv, prob.block_table[:n], prob.seq_lens[:n])
    kw = dict(kv_lora_rank=prob.rank, scale=prob.scale)
    if prob.fp8:
        kw["kv_scale"] = prob.kv_scale
    ref32 = reference.mla_decode_attention(*args, **kw, compute_dtype=torch.float32)
    ref_lowp = reference.mla_decode_attention(*args, **kw, compute_dtype=prob.q.dtype)
    return _budget(out[:n], ref32.float(), ref_lowp, str(prob.q.dtype).split(".")[-1])


def ours(prob: MLAProblem, *, tile=None, num_partitions=None, label="hygon") -> Runner:
    """Our MLA decode planned once (workspace, the host-known ``max_seq_len``), launched
    per call into a preallocated ``out``."""
    import torch
    from hygon_attn_backend.ops.mla import allocate_mla_decode_workspace, plan_mla_decode
    rope = prob.kv.shape[2] - prob.rank
    plan = plan_mla_decode(block_table=prob.block_table, seq_lens=prob.seq_lens,
                           page_size=prob.page_size, num_q_heads=prob.num_q_heads,
                           kv_lora_rank=prob.rank, rope_dim=rope, q_dtype=prob.q.dtype,
                           kv_dtype=prob.kv.dtype, num_tokens=prob.num_tokens,
                           scale=prob.scale, max_seq_len=prob.ctx, tile=tile,
                           num_partitions=num_partitions)
    ws = plan.workspace
    if ws is None and plan.config is not None and num_partitions is None and tile is None:
        ws = allocate_mla_decode_workspace(
            max_num_seqs=prob.batch, num_q_heads=prob.num_q_heads, kv_lora_rank=prob.rank,
            max_context_len=prob.ctx, device=prob.q.device, num_tokens=prob.num_tokens)
    out = torch.empty(prob.q.shape[:-1] + (prob.rank,), dtype=prob.q.dtype,
                      device=prob.q.device)
    cfg = plan.config
    note = "" if cfg is None else (f"tile {cfg.block_m}x{cfg.block_n}, {cfg.num_warps}w "
                                   f"{cfg.num_stages}s, x{cfg.num_partitions} partitions")
    kv_scale = prob.kv_scale if prob.fp8 else None
    return Runner(label, lambda: plan.run(prob.q, prob.kv, out=out, kv_scale=kv_scale), out,
                  note=note, keep=[plan, ws])


def _require(module: str):
    import importlib
    import importlib.util
    try:
        if importlib.util.find_spec(module.split(".")[0]) is None:
            raise Unavailable("not installed")
        return importlib.import_module(module)
    except Unavailable:
        raise
    except Exception as exc:  # an engine whose import chain breaks here
        raise Unavailable(f"import failed: {type(exc).__name__}: {str(exc)[:120]}") from exc


def sglang_mla(prob: MLAProblem) -> Runner:
    import torch
    import triton
    if prob.num_tokens != 1:
        raise Unavailable("decode of one token a request only")
    if prob.fp8:  # its output missed the reference's budget with the scale passed
        raise Unavailable("timed with 16-bit caches only")
    mod = _require("sglang.kernels.ops.attention.decode_attention")
    meta = _require("sglang.kernels.ops.attention.metadata")
    dev = prob.q.device
    b, hq, w = prob.batch, prob.num_q_heads, prob.kv.shape[2]
    k_buf = prob.kv.view(-1, 1, w)  # the MLA pool's [num_slots, 1, W] rows
    v_buf = k_buf[..., :prob.rank]
    kv_indptr = torch.zeros(b + 1, dtype=torch.int32, device=dev)
    kv_indptr[1:] = torch.cumsum(prob.seq_lens.to(torch.int64), 0).to(torch.int32)
    kv_indices = prob.token_slots().reshape(-1).contiguous()
    splits = torch.empty(b, dtype=torch.int32, device=dev)
    uneven = torch.zeros(1, dtype=torch.int32, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count \
        if dev.type == "cuda" else 132
    meta.get_num_kv_splits_triton[(1,)](
        splits, prob.seq_lens, b, 1, hq, 1, SGLANG_MAX_KV_SPLITS, sms,
        MAX_NUM_SEQ=256 if b < 256 else triton.next_power_of_2(b), uneven_batch_ptr=uneven)
    logits = torch.empty(b, hq, SGLANG_MAX_KV_SPLITS, prob.rank, dtype=torch.float32,
                         device=dev)
    lse = torch.empty(b, hq, SGLANG_MAX_KV_SPLITS, dtype=torch.float32, device=dev)
    out = torch.empty(b, hq, prob.rank, dtype=prob.q.dtype, device=dev)
    pdl = dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9

    def call():
        mod.decode_attention_fwd(prob.q, k_buf, v_buf, out, kv_indptr, kv_indices, logits,
                                 lse, splits, SGLANG_MAX_KV_SPLITS, prob.scale, 1.0, 1.0,
                                 has_mla=True, use_pdl=pdl, page_size=prob.page_size,
                                 uneven_batch=uneven)
    note = f"kv splits {','.join(map(str, sorted(set(splits.tolist()))))}"
    return Runner("sglang triton", call, out, note=note,
                  keep=[kv_indptr, kv_indices, splits, logits, lse, uneven])


def vllm_mla(prob: MLAProblem) -> Runner:
    import torch
    from hygon_attn_backend.ops._device import next_pow2
    if prob.num_tokens != 1:
        raise Unavailable("timed at one token a request only")
    mod = _require("vllm.v1.attention.ops.triton_decode_attention")
    dev = prob.q.device
    b, hq = prob.batch, prob.num_q_heads
    sms = torch.cuda.get_device_properties(dev).multi_processor_count \
        if dev.type == "cuda" else 132
    splits = min(next_pow2(max(1, prob.ctx // VLLM_MIN_WORK_PER_SPLIT)),
                 sms * VLLM_SPLIT_OCCUPANCY_MULTIPLIER)
    cache = prob.kv.unsqueeze(2)  # [num_blocks, P, 1, W]
    logits = torch.empty(b, hq, splits, prob.rank + 1, dtype=torch.float32, device=dev)
    out = torch.empty(b, hq, prob.rank, dtype=prob.q.dtype, device=dev)
    lse = torch.empty(b, hq, dtype=prob.q.dtype, device=dev)
    one = torch.full((), prob.kv_scale, dtype=torch.float32, device=dev)  # k and v scale

    def call():
        mod.decode_attention_fwd(prob.q, cache, cache[..., :prob.rank], out, lse,
                                 prob.block_table, prob.seq_lens, logits, splits,
                                 prob.scale, prob.page_size, k_scale=one, v_scale=one,
                                 is_mla=True)
    return Runner("vllm triton mla", call, out, note=f"kv splits {splits}",
                  keep=[logits, lse, one])


def flashinfer_mla_args(prob: MLAProblem) -> tuple:
    """The batch as FlashInfer's MLA ``plan`` describes it, int32 on the problem's device:
    ``(qo_indptr, kv_indptr, kv_indices, kv_len_arr)``: ``qo_indptr = arange(B + 1) * T``,
    ``kv_indptr`` the cumulative page counts ``ceil(seq_len / P)``, ``kv_indices`` every
    request's block-table row cut to its page count, the rows concatenated, and
    ``kv_len_arr`` the ``seq_lens``."""
    import torch
    dev = prob.q.device
    i32 = dict(dtype=torch.int32, device=dev)
    pages = (prob.seq_lens.to(torch.int64) + prob.page_size - 1) // prob.page_size
    qo_indptr = torch.arange(prob.batch + 1, **i32) * prob.num_tokens
    kv_indptr = torch.zeros(prob.batch + 1, **i32)
    kv_indptr[1:] = torch.cumsum(pages, 0).to(torch.int32)
    cols = torch.arange(prob.block_table.shape[1], device=dev)
    used = cols[None, :] < pages[:, None]  # a boolean index reads row after row
    kv_indices = prob.block_table[used].to(torch.int32).contiguous()
    return qo_indptr, kv_indptr, kv_indices, prob.seq_lens.to(torch.int32).contiguous()


def flashinfer_backend(device) -> str:
    """``fa3`` on compute capability 9 (what ``backend="auto"`` resolves to on sm_90a),
    ``fa2`` elsewhere."""
    import torch
    return "fa3" if torch.cuda.get_device_capability(device)[0] == 9 else "fa2"


def flashinfer_mla(prob: MLAProblem) -> Runner:
    """FlashInfer's ``BatchMLAPagedAttentionWrapper`` (``flashinfer.mla``, 0.6.18) on a GPU
    (:func:`flashinfer_mla_runner`); ``flashinfer`` itself is not imported
    (:func:`engine_peers.flashinfer_module`)."""
    import importlib.util
    from hygon_attn_backend.tools.bench.engine_peers import flashinfer_module
    if importlib.util.find_spec("flashinfer") is None:
        raise Unavailable("not installed")
    if prob.q.device.type != "cuda":
        raise Unavailable("needs a CUDA GPU")
    if prob.fp8:
        raise Unavailable("timed with 16-bit caches only")
    return flashinfer_mla_runner(prob, flashinfer_module("mla"),
                                 flashinfer_backend(prob.q.device))


def flashinfer_mla_runner(prob: MLAProblem, fi_mla, backend: str) -> Runner:
    """The wrapper of module ``fi_mla`` built with ``use_cuda_graph=True`` over fixed
    ``qo_indptr`` / ``kv_indptr`` / ``kv_indices`` / ``kv_len_arr`` buffers and planned once
    here, outside the timed (captured) call; ``causal`` for ``T > 1`` (query ``t`` of a
    request sees keys up to ``seq_len - T + t``, as the reference). The ``[num_blocks, P,
    W]`` cache goes in as two strided views, ``kv[..., :rank]`` (``ckv_cache``) and
    ``kv[..., rank:]`` (``kpe_cache``), q as ``[B * T, Hq, rank]`` / ``[B * T, Hq, rope]``
    views: FlashInfer's kernels take each tensor's page and token strides
    (``batch_mla_run.cu``, ``batch_mla_sm90_run.cu``) and assume only the last dimension
    dense, so nothing is copied."""
    import torch
    from hygon_attn_backend.tools.bench.engine_peers import FLASHINFER_WORKSPACE_BYTES
    dev = prob.q.device
    b, t, hq, rank = prob.batch, prob.num_tokens, prob.num_q_heads, prob.rank
    rope = prob.kv.shape[2] - rank
    names = ("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr")
    args = dict(zip(names, flashinfer_mla_args(prob)))
    bufs = {k: torch.empty_like(v) for k, v in args.items()}  # the buffers a graph replays
    ws = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=dev)
    wrapper = fi_mla.BatchMLAPagedAttentionWrapper(ws, use_cuda_graph=True, backend=backend,
                                                   **bufs)
    wrapper.plan(**args, num_heads=hq, head_dim_ckv=rank, head_dim_kpe=rope,
                 page_size=prob.page_size, causal=t > 1, sm_scale=prob.scale,
                 q_data_type=prob.q.dtype, kv_data_type=prob.kv.dtype)
    q3 = prob.q.reshape(b * t, hq, rank + rope)
    q_nope, q_pe = q3[..., :rank], q3[..., rank:]  # [B * T, Hq, rank], [B * T, Hq, rope]
    ckv, kpe = prob.kv[..., :rank], prob.kv[..., rank:]  # [num_blocks, P, rank / rope]
    out = torch.empty(prob.q.shape[:-1] + (rank,), dtype=prob.q.dtype, device=dev)
    out3 = out.view(b * t, hq, rank)
    fn = lambda: wrapper.run(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe, out=out3)
    name = "flashinfer mla" if t == 1 else f"flashinfer mla q_len {t}"
    note = f"{backend}, causal" if t > 1 else backend
    return Runner(name, fn, out, note=note, keep=[wrapper, ws, *args.values(), *bufs.values()])


PEER_MAKERS = {"sglang": sglang_mla, "vllm": vllm_mla, "flashinfer": flashinfer_mla}


def _parse_tiles(text: str):
    tiles = []
    for part in (text or "").split(";"):
        if part.strip():
            tiles.append(tuple(int(x) for x in part.split(",")))
    return tiles


def add_mla_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``mla`` on an argparse ``subparsers`` object; returns the parser."""
    p = subparsers.add_parser("mla", help="MLA decode GB/s vs an in-run copy and peers")
    p.add_argument("--shapes", default=None, type=tuple_list("B", "ctx"),
                   help=f"';'-separated B,ctx pairs (default: {DEFAULT_SHAPES}; on a CPU "
                        f"under Triton's interpreter {CPU_DEFAULTS['shapes']})")
    p.add_argument("--heads", default=None, type=int_list(),
                   help="query head counts Hq, comma-separated (default 128,16)")
    p.add_argument("--block-sizes", default="64,1", type=int_list(),
                   help="page sizes (64: vLLM's MLA blocks, 1: SGLang's token pool)")
    p.add_argument("--kv-lora-rank", type=count(1), default=512)
    p.add_argument("--rope-dim", type=count(0), default=64)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16"],
                   help="default: bfloat16; float16 on a CPU")
    add_kv_dtype_option(p, per_head=False)  # latent caches: per-tensor scales
    p.add_argument("--mtp", default="2,4", type=int_list(low=2, empty=True),
                   help="query tokens a request of the MTP rows ('' for none)")
    p.add_argument("--tiles", default="", type=str,
                   help="forced tiles timed beside the shipped rule: "
                        "'BLOCK_M,BLOCK_N,warps,stages;...'")
    p.add_argument("--partitions", default="", type=int_list(empty=True),
                   help="forced split counts timed beside the shipped rule")
    p.add_argument("--compare", default="",
                   help=f"peers: comma list of {', '.join(MLA_PEERS)} (or 'all'); one not "
                        f"installed here is reported, not an error")
    p.add_argument("--same-bytes-copy", action=argparse.BooleanOptionalAction, default=True,
                   help="time a device copy moving each shape's bytes beside it")
    p.add_argument("--rep-ms", type=positive_float, default=60.0)
    p.add_argument("--l2-flush", default="write", choices=["write", "read"])
    p.add_argument("--csv", default="")
    p.add_argument("--json", default="")
    p.add_argument("--markdown", default="")
    p.set_defaults(func=_cli, bench_func=_cli, plot="", impl="auto", num_q_heads=1,
                   num_kv_heads=1)
    return p


def _cli(args) -> int:
    return 0 if run_mla_bench(args) else 1


def _peers(text: str) -> list:
    names = [x.strip().lower() for x in (text or "").split(",") if x.strip()]
    if names == ["all"]:
        return list(MLA_PEERS)
    bad = [n for n in names if n not in MLA_PEERS]
    if bad:
        raise SystemExit(f"hygon-attn bench mla: --compare: unknown peer(s) {bad}; choose "
                         f"from {list(MLA_PEERS)}")
    return names


def _make(factory, label):
    try:
        return label, factory()
    except Exception as exc:  # Unavailable, or a forced tile the op refuses
        return label, exc


def run_mla_bench(args) -> dict:
    """Run the MLA benchmark described by ``args``; print a markdown table and return
    every number ({} without a device)."""
    import torch
    from hygon_attn_backend.tools.bench import _timing

    peers = _peers(args.compare)
    try:
        tiles = _parse_tiles(args.tiles)
        if any(len(t) != 4 for t in tiles):
            raise ValueError
    except ValueError:
        raise SystemExit(f"hygon-attn bench mla: --tiles must be "
                         f"'BLOCK_M,BLOCK_N,warps,stages[;...]', got {args.tiles!r}") from None
    started = _harness.start(args, "mla")
    if started is None:
        return {}
    _, _, device = started
    for name, value in (GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    dtype = getattr(torch, args.dtype)
    pages = [int(x) for x in str(args.block_sizes).split(",") if x]
    heads_list = [int(x) for x in str(args.heads).split(",") if x]
    mtp = [int(x) for x in str(args.mtp).split(",") if x.strip()]
    forced = [int(x) for x in str(args.partitions).split(",") if x.strip()]
    rank, rope = args.kv_lora_rank, args.rope_dim
    meta = _harness.header(device)
    copy, _ = _timing.copy_ceiling(args.rep_ms, device=device)
    meta.update(copy_gbps=copy, dtype=args.dtype, kv_lora_rank=rank, rope_dim=rope,
                peers=peers, l2_flush=_timing.L2_FLUSH)
    print(f"# mla bench: {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, "
          f"{args.dtype}, rows {rank}+{rope}; graph replay, L2 cleared before every replay "
          f"(by a {_timing.L2_FLUSH}), pages permuted", flush=True)
    print(f"device copy (read + write): {copy:.0f} GB/s = 100%", flush=True)
    rows = []
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shapes.split(";") if s.strip()]
    kv_names = args.kv_dtype.split(",")
    meta.update(kv_dtypes=kv_names)
    for batch, ctx in output.progress(shapes, desc="mla shapes"):
        for heads in heads_list:
            for page in pages:
                for kv_name in kv_names:
                    print(f"B={batch} ctx={ctx} Hq={heads} page {page} kv {kv_name}",
                          flush=True)
                    rows += _mla_point(args, batch=batch, ctx=ctx, heads=heads, page=page,
                                       kv_name=kv_name, dtype=dtype, mtp=mtp, tiles=tiles,
                                       forced=forced, peers=peers, copy=copy, device=device)
    relate_to_auto(rows)
    _harness.emit(rows, meta, args, op="decode", unit="GB/s", ceiling=copy,
                  ceiling_name="copy", title=f"MLA decode {args.dtype}, {rank}+{rope}")
    return dict(meta, rows=rows)


def _mla_point(args, *, batch, ctx, heads, page, kv_name, dtype, mtp, tiles, forced, peers,
               copy, device) -> list:
    """Every row of one (shape, Hq, page, cache dtype): ours (the rule, forced tiles and
    splits), the MTP rows, the peers and the same-bytes copy."""
    from hygon_attn_backend.tools.bench import problems
    from hygon_attn_backend.tools.bench.decode import _same_bytes_copy_row
    rank, rope = args.kv_lora_rank, args.rope_dim
    base = dict(op="decode", batch=batch, ctx=ctx, num_q_heads=heads, num_kv_heads=1,
                head_dim=rank + rope, page=page)
    rows, single_ms = [], {}  # impl -> ms of its one-token row
    for tokens in [1] + mtp:
        prob = build(batch=batch, ctx=ctx, page_size=page, heads=heads, rank=rank, rope=rope,
                     tokens=tokens, dtype=dtype, device=device,
                     kv_dtype=problems.kv_dtype_of(kv_name))
        name = "hygon" if tokens == 1 else f"hygon q_len {tokens}"
        made = [_make(lambda: ours(prob, label=name), name)]
        made += [_make(lambda t=t: ours(prob, tile=t, label=f"{name} (tile {t})"),
                       f"{name} (tile {t})") for t in tiles]
        if tokens == 1:
            made += [_make(lambda n=n: ours(prob, num_partitions=n,
                                            label=f"hygon (x{n} partitions)"),
                           f"hygon (x{n} partitions)") for n in forced]
            made += [_make(lambda n=n: PEER_MAKERS[n](prob), n) for n in peers]
        else:
            made += [_make(lambda n=n: PEER_MAKERS[n](prob), f"{n} q_len {tokens}")
                     for n in peers if n in MTP_PEERS]
        got = _harness.run_all(made, lambda out: check(prob, out), base=base, graph=True,
                               rep_ms=args.rep_ms, work=prob.kv_bytes(), ceiling=copy,
                               device=device)
        for row in got:
            if row["status"] != "ok":
                continue
            one = single_ms.get(row["impl"].split(" q_len ")[0])
            if tokens == 1:
                single_ms.setdefault(row["impl"], row["ms"])
            elif one:
                row["note"] += f"; {row['ms'] / one:.3f}x q_len 1"
        rows += labelled(got, kv_name)
        if tokens == 1 and args.same_bytes_copy:
            rows += labelled([_same_bytes_copy_row(prob.kv_bytes(), base, copy, args.rep_ms,
                                                   device)], kv_name)
            _harness.print_row(rows[-1])
        prob = made = None  # free the cache before the next row
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hygon-attn-bench-mla")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_mla_parser(sub)
    args = parser.parse_args(["mla"] + list(argv if argv is not None else sys.argv[1:]))
    return run_mla_bench(args)


if __name__ == "__main__":
    main()
