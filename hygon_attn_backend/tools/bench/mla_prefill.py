"""``hygon-attn bench mla-prefill``: MLA's up-projected prefill (``ragged_attention``, q/k
``D_QK``, v ``D_V``: 192/128 by default) in TFLOP/s beside an in-run bf16 matmul, and
beside torch SDPA and FlashAttention's varlen kernel where they import.

Each ``(B, prefix, extend)`` shape packs ``B`` requests of ``extend`` queries over ``prefix
+ extend`` dense keys (``Hq == Hkv`` heads, as vLLM's ``forward_mha`` passes them; prefix 0
is its new-tokens call). ``--mask causal`` is the bottom-right causal mask, ``none`` a
context chunk (every key). Work is the unmasked FLOPs: ``2 * (D_QK + D_V) * H * extend *
(prefix + (extend + 1) / 2)`` a request causal, ``2 * (D_QK + D_V) * H * extend * (prefix
+ extend)`` without the mask. The plan is built once outside the timed call; every output
is checked against the reference before it is timed; 100% is a bf16 ``8192^3`` matmul
measured in the same run. The table's ``page`` column names the mask.

``--op extend`` times the absorbed extend instead (``mla_extend_attention``: q ``[N, H,
D_QK]`` over a paged latent cache, one KV head, v the row's first ``D_V`` columns; run it
with ``--head-dim-qk 576 --head-dim-v 512 --block-size 64``), causal, no peers.

Peers (``--compare``): ``sdpa`` (torch SDPA, flash and cuDNN backends, ``[B, H, L, D]``
tensors; v zero-padded to ``D_QK`` where a backend wants one head size, its output
sliced), ``fa`` (``flash_attn_varlen_func`` of vLLM's ``vllm_flash_attn``, else of
``flash_attn``, on the packed tensors; v padded where it asks for one head size).
"""

from __future__ import annotations

import argparse
import sys

from hygon_attn_backend.tools.argtypes import count, tuple_list
from hygon_attn_backend.tools.bench import _harness
from hygon_attn_backend.tools.bench._runner import Runner, Unavailable
from hygon_attn_backend.tools.bench.decode import _add_common
from hygon_attn_backend.tools.bench.prefill import _parse_shapes, _parse_tiles, _tiles_text

DEFAULT_SHAPES = "8,0,4096;8,4096,4096;1,0,16384;32,1024,512"
PEERS = ("sdpa", "fa")
CHECK_ROWS = 64  # the last query rows of the first request checked against the reference


def add_mla_prefill_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``mla-prefill`` on an argparse ``subparsers`` object; returns the parser."""
    p = subparsers.add_parser("mla-prefill",
                              help="MLA ragged prefill (192/128) TFLOP/s vs matmul and peers")
    p.add_argument("--shapes", default=DEFAULT_SHAPES,
                   type=tuple_list("B", "prefix", "extend", lows=[1, 0, 1]),
                   help=f"';'-separated B,prefix,extend triples (default: {DEFAULT_SHAPES})")
    p.add_argument("--num-heads", type=count(1), default=16,
                   help="query heads = KV heads (MLA's up-projected attention)")
    p.add_argument("--head-dim-qk", type=count(1), default=192)
    p.add_argument("--head-dim-v", type=count(1), default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--mask", default="causal", choices=["causal", "none", "both"],
                   help="bottom-right causal (new tokens) or none (a context chunk)")
    p.add_argument("--tiles", default="", type=_tiles_text,
                   help="';'-separated BLOCK_M,BLOCK_N,warps,stages configs to sweep "
                        "(passed to plan_ragged_attention), 'default' for the heuristic")
    p.add_argument("--impl", default="auto",
                   help="our implementations: a comma list of auto, triton, native")
    p.add_argument("--op", default="ragged", choices=["ragged", "extend"],
                   help="ragged: the up-projected prefill; extend: the absorbed extend over "
                        "a paged latent cache (causal)")
    p.add_argument("--block-size", type=count(1), default=64,
                   help="--op extend: the latent cache's page size")
    _add_common(p, rep_ms=100.0)
    p.set_defaults(func=_cli)
    return p


def _cli(args) -> int:
    return 0 if run_mla_prefill_bench(args) else 1


class Problem:
    """``B`` requests of ``extend`` queries over ``prefix + extend`` keys, packed; with
    ``page`` (the absorbed extend) the keys are one latent row a token in a paged cache
    (pages a random permutation of the blocks) and ``k`` / ``v`` stay None."""

    def __init__(self, *, batch, prefix, extend, heads, d_qk, d_v, dtype, device, causal,
                 page=None):
        import torch
        gen = torch.Generator(device=device).manual_seed(0)
        self.batch, self.prefix, self.extend, self.causal = batch, prefix, extend, causal
        self.heads, self.d_qk, self.d_v, self.page = heads, d_qk, d_v, page
        len_k = prefix + extend
        self.q = torch.randn(batch * extend, heads, d_qk, device=device,
                             generator=gen).to(dtype)
        self.cu_q = torch.arange(batch + 1, device=device, dtype=torch.int32) * extend
        self.scale = d_qk ** -0.5
        self.k = self.v = self.kv = self.table = None
        if page is None:
            self.k = torch.randn(batch * len_k, heads, d_qk, device=device,
                                 generator=gen).to(dtype)
            self.v = torch.randn(batch * len_k, heads, d_v, device=device,
                                 generator=gen).to(dtype)
            self.cu_k = torch.arange(batch + 1, device=device, dtype=torch.int32) * len_k
        else:
            blocks = -(-len_k // page)
            self.kv = torch.randn(batch * blocks, page, d_qk, device=device,
                                  generator=gen).to(dtype)
            perm = torch.randperm(batch * blocks, device=device, generator=gen)
            self.table = perm.reshape(batch, blocks).to(torch.int32)
            self.cu_k = torch.full((batch,), len_k, device=device, dtype=torch.int32)

    def flops(self) -> float:
        e, p = self.extend, self.prefix
        pairs = e * (p + (e + 1) / 2) if self.causal else e * (p + e)
        return 2.0 * (self.d_qk + self.d_v) * self.heads * pairs * self.batch

    def check(self, out) -> tuple:
        """``(ok, max error, budget)`` of the last query rows of the first request."""
        import torch
        from hygon_attn_backend import reference
        from hygon_attn_backend.tools.bench.problems import _budget
        m = min(self.extend, CHECK_ROWS)
        rows = slice(self.extend - m, self.extend)
        len_k = self.prefix + self.extend
        dev = self.q.device
        cu_q = torch.tensor([0, m], dtype=torch.int32, device=dev)
        # the checked rows are the last m queries: their keys are the request's first
        # len_k keys, bottom-right aligned as in the full request
        ref_out = torch.empty(m, self.heads, self.d_v, dtype=torch.float32, device=dev)
        if self.page is not None:
            args = (self.q[rows], self.kv, self.table[:1], cu_q, self.cu_k[:1])
            kw = dict(v_head_dim=self.d_v, scale=self.scale)
            ref32 = reference.mla_extend_attention(*args, out=ref_out, **kw)
            ref_lowp = reference.mla_extend_attention(*args, compute_dtype=self.q.dtype, **kw)
            return _budget(out[rows], ref32, ref_lowp, str(self.q.dtype).split(".")[-1])
        cu_k = torch.tensor([0, len_k], dtype=torch.int32, device=dev)
        args = (self.q[rows], self.k[:len_k], self.v[:len_k], cu_q, cu_k)
        ref32 = reference.ragged_attention(*args, scale=self.scale, causal=self.causal,
                                           out=ref_out)
        ref_lowp = reference.ragged_attention(*args, scale=self.scale, causal=self.causal,
                                              compute_dtype=self.q.dtype)
        return _budget(out[rows], ref32, ref_lowp, str(self.q.dtype).split(".")[-1])


def ours(prob: Problem, *, tile, impl: str, label: str) -> Runner:
    """``ragged_attention`` (``mla_extend_attention`` for a paged problem) with its plan
    built once (host copies of the offsets)."""
    import torch
    from hygon_attn_backend.ops.mla_prefill import plan_mla_extend, plan_ragged_attention
    out = torch.empty(prob.q.shape[0], prob.heads, prob.d_v, dtype=prob.q.dtype,
                      device=prob.q.device)
    if prob.page is not None:
        plan = plan_mla_extend(prob.cu_q, prob.cu_k, total_q=prob.q.shape[0],
                               num_q_heads=prob.heads, head_dim=prob.d_qk,
                               v_head_dim=prob.d_v, page_size=prob.page,
                               host_cu_seqlens_q=prob.cu_q.cpu(), q_dtype=prob.q.dtype,
                               tile=tile, impl=impl)
        fn = lambda: plan.run_extend(prob.q, prob.kv, prob.table,  # noqa: E731
                                     scale=prob.scale, out=out)
        return Runner(label, fn, out, note=_note(plan), keep=[plan])
    plan = plan_ragged_attention(prob.cu_q, prob.cu_k, total_q=prob.q.shape[0],
                                 total_k=prob.k.shape[0], num_q_heads=prob.heads,
                                 num_kv_heads=prob.heads, head_dim_qk=prob.d_qk,
                                 head_dim_v=prob.d_v, host_cu_seqlens_q=prob.cu_q.cpu(),
                                 host_cu_seqlens_k=prob.cu_k.cpu(), q_dtype=prob.q.dtype,
                                 tile=tile, impl=impl)
    fn = lambda: plan.run(prob.q, prob.k, prob.v, scale=prob.scale,  # noqa: E731
                          causal=prob.causal, out=out)
    return Runner(label, fn, out, note=_note(plan), keep=[plan])


def _note(plan) -> str:
    cfg = plan.config
    if cfg.impl == "native":
        return f"native sm_90 kernel, {cfg.block_m} rows, {cfg.num_stages} stages"
    return (f"tile {cfg.block_m},{cfg.block_n},{cfg.num_warps},{cfg.num_stages}, "
            f"QK {cfg.d1}+{cfg.d2}, {cfg.heads} heads a tile"
            + (" [reference]" if plan.impl == "reference" else ""))


def sdpa(prob: Problem, backend: str) -> Runner:
    """Dense ``[B, H, L, D]`` SDPA restricted to ``backend``; v as it is, else zero-padded
    to ``D_QK`` (the output sliced back)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    b, e, h = prob.batch, prob.extend, prob.heads
    len_k = prob.prefix + e
    q = prob.q.view(b, e, h, -1).transpose(1, 2).contiguous()
    k = prob.k.view(b, len_k, h, -1).transpose(1, 2).contiguous()
    v = prob.v.view(b, len_k, h, -1).transpose(1, 2).contiguous()
    out = torch.empty(prob.q.shape[0], h, prob.d_v, dtype=prob.q.dtype, device=prob.q.device)
    out_view = out.view(b, e, h, -1).transpose(1, 2)
    kw = dict(scale=prob.scale)
    if prob.causal and prob.prefix == 0:
        kw["is_causal"] = True
    elif prob.causal:
        from torch.nn.attention.bias import causal_lower_right
        kw["attn_mask"] = causal_lower_right(e, len_k)
    errors = []
    for pad in (False, True):
        vv = torch.nn.functional.pad(v, [0, prob.d_qk - prob.d_v]) if pad else v

        def call(vv=vv):
            with sdpa_kernel([which]):
                return F.scaled_dot_product_attention(q, k, vv, **kw)
        try:
            call()
        except Exception as exc:  # the backend refuses this form: try the next
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}")
            continue

        def fn(call=call):
            out_view.copy_(call()[..., :prob.d_v])
        return Runner(f"sdpa {backend}", fn, out, note="v padded to D_QK" if pad else "",
                      keep=[q, k, vv])
    raise Unavailable("refused: " + "; ".join(errors[:2]))


def flash_varlen(prob: Problem) -> Runner:
    """``flash_attn_varlen_func`` on the packed tensors (vLLM's build, else flash_attn)."""
    import torch
    try:
        from vllm.vllm_flash_attn import flash_attn_varlen_func
        where = "vllm_flash_attn"
    except ImportError:
        try:
            from flash_attn import flash_attn_varlen_func
            where = "flash_attn"
        except ImportError:
            raise Unavailable("neither vllm.vllm_flash_attn nor flash_attn imports") from None
    len_k = prob.prefix + prob.extend
    out = torch.empty(prob.q.shape[0], prob.heads, prob.d_v, dtype=prob.q.dtype,
                      device=prob.q.device)
    errors = []
    for pad in (False, True):
        vv = torch.nn.functional.pad(prob.v, [0, prob.d_qk - prob.d_v]) if pad else prob.v

        def call(vv=vv):
            return flash_attn_varlen_func(prob.q, prob.k, vv, cu_seqlens_q=prob.cu_q,
                                          cu_seqlens_k=prob.cu_k, max_seqlen_q=prob.extend,
                                          max_seqlen_k=len_k, softmax_scale=prob.scale,
                                          causal=prob.causal)
        try:
            call()
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}")
            continue

        def fn(call=call):
            res = call()
            res = res[0] if isinstance(res, tuple) else res
            out.copy_(res[..., :prob.d_v])
        return Runner(f"fa varlen ({where})", fn, out,
                      note="v padded to D_QK" if pad else "", keep=[vv])
    raise Unavailable("refused: " + "; ".join(errors[:2]))


def peer_runners(name: str, prob: Problem) -> list:
    """``[(label, Runner or exception)]`` for peer ``name``."""
    if prob.q.device.type != "cuda":
        return [(name, Unavailable("not available on CPU (the peers need a CUDA GPU)"))]
    makers = ([(f"sdpa {b}", lambda b=b: sdpa(prob, b)) for b in ("flash", "cudnn")]
              if name == "sdpa" else [("fa varlen", lambda: flash_varlen(prob))])
    rows = []
    for label, make in makers:
        try:
            rows.append((label, make()))
        except Exception as exc:  # Unavailable, or a setup failure
            rows.append((label, exc))
    return rows


def _start(args):
    """``(impls, peers, device)``, or None without a device (after saying so); bad
    ``--impl`` / ``--compare`` lists stop here, before the run."""
    impls = [x.strip() for x in str(args.impl).split(",") if x.strip()]
    if not impls or any(x not in ("auto", "triton", "native") for x in impls) or \
            len(set(impls)) != len(impls):
        raise SystemExit(f"hygon-attn bench mla-prefill: --impl: a comma list of auto, "
                         f"triton, native without repeats, got {args.impl!r}")
    peers = [x.strip().lower() for x in (args.compare or "").split(",") if x.strip()]
    peers = list(PEERS) if peers == ["all"] else peers
    bad = [x for x in peers if x not in PEERS]
    if bad:
        raise SystemExit(f"hygon-attn bench mla-prefill: --compare: unknown peer(s) {bad}; "
                         f"choose from {list(PEERS)}")
    from hygon_attn_backend.tools.bench import _timing, output
    if args.plot:
        output.pyplot()
    _timing.set_l2_flush(args.l2_flush)
    device = _harness.pick_device()
    if device is None:
        print(_harness.no_device_message("mla-prefill"), file=sys.stderr)
        return None
    if device.type == "cpu":
        from hygon_attn_backend.tools import needs
        problem = needs.interpreter_problem("hygon-attn bench mla-prefill")
        if problem:
            print(problem, file=sys.stderr)
            return None
    return impls, peers, device


def run_mla_prefill_bench(args) -> dict:
    """Run the benchmark described by ``args`` (see :func:`add_mla_prefill_parser`); print
    a markdown table and return all numbers as a dict ({} without a device)."""
    import torch
    from hygon_attn_backend.tools.bench import _timing, output

    started = _start(args)
    if started is None:
        return {}
    impls, peers, device = started
    dtype = getattr(torch, args.dtype)
    h, d_qk, d_v = args.num_heads, args.head_dim_qk, args.head_dim_v
    tiles = _parse_tiles(args.tiles)
    masks = [True, False] if args.mask == "both" else [args.mask == "causal"]
    extend_op = args.op == "extend"
    if extend_op:
        masks = [True]  # the extend is causal
        if peers:
            print("bench mla-prefill --op extend: no peers run beside the extend",
                  file=sys.stderr)
            peers = []
    meta = _harness.header(device)
    mm, mm_ms = _timing.matmul_ceiling(args.rep_ms, device=device)
    meta.update(matmul_tflops=mm, dtype=args.dtype, num_heads=h, head_dim_qk=d_qk,
                head_dim_v=d_v, peers=peers, l2_flush=_timing.L2_FLUSH)
    print(f"# mla-prefill bench: {meta['gpu']}, torch {meta['torch']}, triton "
          f"{meta['triton']}, {args.dtype}, H={h}, D_QK={d_qk}, D_V={d_v}; plan outside the "
          f"timed call, L2 cleared before every call (by a {_timing.L2_FLUSH})")
    print(f"matmul ceiling: {mm:.1f} TFLOP/s ({mm_ms:.3f} ms) = 100%")
    rows = []
    for batch, prefix, extend in output.progress(_parse_shapes(args.shapes),
                                                 desc="mla-prefill shapes"):
        for causal in masks:
            prob = Problem(batch=batch, prefix=prefix, extend=extend, heads=h, d_qk=d_qk,
                           d_v=d_v, dtype=dtype, device=device, causal=causal,
                           page=args.block_size if extend_op else None)
            mask = "causal" if causal else "no mask"
            if extend_op:
                mask = f"extend P={args.block_size}"
            base = dict(op="mla-prefill", batch=batch, prefix=prefix, extend=extend,
                        num_q_heads=h, num_kv_heads=1 if extend_op else h,
                        head_dim=f"{d_qk}/{d_v}", page=mask)
            made = []
            for tile in tiles:
                for impl in impls:
                    label = "hygon" + (f" [{impl}]" if len(impls) > 1 else "")
                    try:
                        made.append((label, ours(prob, tile=tile, impl=impl, label=label)))
                    except Exception as exc:  # e.g. a swept tile the op refuses
                        made.append((label, exc))
            for name in peers:
                made += peer_runners(name, prob)
            rows += _harness.run_all(made, prob.check, base=base, graph=False,
                                     rep_ms=args.rep_ms, work=prob.flops(), ceiling=mm,
                                     device=device)
            prob = made = None  # free the tensors before the next shape
    _harness.emit(rows, meta, args, op="mla-prefill", unit="TFLOP/s", ceiling=mm,
                  ceiling_name="matmul",
                  title=f"MLA prefill {args.dtype}, H={h}, {d_qk}/{d_v}")
    return dict(meta, rows=rows)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hygon-attn-bench-mla-prefill")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_mla_prefill_parser(sub)
    args = parser.parse_args(["mla-prefill"] + list(argv if argv is not None else sys.argv[1:]))
    return args.func(args)


if __name__ == "__main__":
    main()
