"""``hygon-attn bench verify``: a speculative verify step beside a plain decode of the same
batch, an in-run device copy, SGLang's Triton verify and FlashInfer's paged prefill with
a custom mask.

The batch: ``B`` requests of a ``--prefix`` key cache each, with ``T`` draft tokens a
request whose K/V are already in the paged cache (the last ``T`` keys of each sequence),
for two draft shapes: a chain of ``--chain`` drafts (the causal rule) and a tree given by
``--tree`` (parent indices; the default is 8 nodes: a root, two children, their children),
under its packed tree mask. Each implementation's output is checked against the reference
before it is timed (CUDA-graph replay, the L2 cleared before every replay; see
:mod:`hygon_attn_backend.tools.bench._timing`).

Rows per draft shape and page size:

* ``hygon verify (decode)``: ``plan_paged_decode(num_tokens=T, tree_mask=)``, the structure
  ``ops.decode.verify_on_decode`` picks while ``T x G`` rows fit a decode tile;
* ``hygon verify (prefill)``: ``plan_prefix_prefill(tree_mask=)``, the path past it;
* ``hygon decode, same batch``: our plain decode (one query a request) over the same keys;
* ``device copy, same bytes``: a device copy moving the KV bytes, timed the same way;
* ``sglang triton verify``: SGLang's ``extend_attention_fwd`` with its flattened custom
  mask over the prefix (the drafts' K/V passed dense, as SGLang's Triton backend runs a
  target-verify batch), when SGLang is importable (a row saying why not otherwise);
* ``flashinfer fa2 verify``: FlashInfer's paged prefill with the same custom mask over the
  whole paged ``prefix + T`` keys (how SGLang's FlashInfer backend verifies a tree), when
  FlashInfer is installed and a CUDA GPU is present.

GB/s counts the KV bytes of the prefix and the drafts once; the note of a verify row gives
its time over the plain decode's (what a verify step costs against the decode it replaces).
"""

from __future__ import annotations

import argparse
import sys

from hygon_attn_backend.tools.argtypes import count, int_list, positive_float
from hygon_attn_backend.tools.bench import _harness, _timing, problems
from hygon_attn_backend.tools.bench._runner import Runner, Unavailable

#: Defaults on a GPU (the shape the verify benchmarks report) and under Triton's CPU
#: interpreter (one small shape checks the wiring in seconds), for options left unset.
GPU_DEFAULTS = dict(batch=64, prefix=32768, dtype="bfloat16")
CPU_DEFAULTS = dict(batch=2, prefix=40, dtype="float16")
#: 8 nodes: a root, its two children, each with two children, one grandchild.
DEFAULT_TREE = "-1,0,0,1,1,2,2,3"


def _parents(text: str) -> list:
    """``--tree``: comma list of parent indices, ``-1`` for a child of the prefix, a parent
    before its child."""
    try:
        parents = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        parents = []
    if not parents or any(not -1 <= p < i for i, p in enumerate(parents)):
        raise argparse.ArgumentTypeError(
            f"must be a comma list of parent indices with -1 <= parent < its own index, got "
            f"{text!r}")
    return parents


def add_verify_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``verify`` on an argparse ``subparsers`` object; returns the parser."""
    p = subparsers.add_parser("verify", help="speculative verify vs plain decode, a copy, "
                                             "SGLang's Triton and FlashInfer's verify")
    p.add_argument("--batch", type=count(1), default=None,
                   help=f"requests (default {GPU_DEFAULTS['batch']}; "
                        f"{CPU_DEFAULTS['batch']} on a CPU)")
    p.add_argument("--prefix", type=count(1), default=None,
                   help=f"cached keys a request before its drafts (default "
                        f"{GPU_DEFAULTS['prefix']}; {CPU_DEFAULTS['prefix']} on a CPU)")
    p.add_argument("--chain", type=count(1), default=4, help="drafts of the chain case")
    p.add_argument("--tree", type=_parents, default=_parents(DEFAULT_TREE),
                   help=f"parent indices of the tree case (default {DEFAULT_TREE})")
    p.add_argument("--block-sizes", default="16", type=int_list(), help="page sizes")
    p.add_argument("--num-q-heads", type=count(1), default=32)
    p.add_argument("--num-kv-heads", type=count(1), default=8)
    p.add_argument("--head-dim", type=count(1), default=128)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float16"],
                   help="default: bfloat16; float16 on a CPU (the interpreter's bf16 dot)")
    p.add_argument("--impl", default="auto",
                   help="our implementations, comma list of auto, triton, native")
    p.add_argument("--rep-ms", type=positive_float, default=60.0,
                   help="timed milliseconds per point")
    p.add_argument("--l2-flush", default="write", choices=["write", "read"],
                   help="how the L2 is evicted before each timed call (see bench decode)")
    p.add_argument("--csv", default="", help="write every row to this CSV file")
    p.add_argument("--json", default="", help="write all results to this JSON file")
    p.add_argument("--markdown", default="", help="write the table to this file")
    p.set_defaults(func=_cli, bench_func=_cli, compare="", plot="")
    return p


def _cli(args) -> int:
    return 0 if run_verify_bench(args) else 1


class _Verify:
    """One verify batch over a decode problem of ``prefix + T`` keys a request: q
    ``[B, T, Hq, D]``, the tree's packed mask ``[B * T, 1]`` int32 (None: the chain) and
    its dense form ``[T, T]`` bool."""

    def __init__(self, prob, *, width: int, parents, gen):
        import torch
        from hygon_attn_backend.ops import tree_mask

        self.prob, self.width = prob, width
        dev, b = prob.q.device, prob.batch
        self.q = torch.randn(b, width, prob.num_q_heads, prob.head_dim, device=dev,
                             generator=gen).to(prob.q.dtype)
        if parents is None:
            self.visible = torch.tril(torch.ones(width, width, dtype=torch.bool, device=dev))
            self.tree = None
        else:
            p = torch.tensor([parents] * b, dtype=torch.int64, device=dev)
            dense = tree_mask.tree_mask_from_parents(p)  # [B * T, T]
            self.visible = dense[:width]
            self.tree = tree_mask.pack_tree_mask(dense)

    def check(self, out) -> tuple:
        """``(ok, max error, budget)`` of ``out [B, T, Hq, D]`` on the first sequences."""
        import torch
        from hygon_attn_backend import reference

        prob, n = self.prob, min(self.prob.batch, problems.CHECK_SEQS)
        kview, vview = prob.kv_views()
        tree = None if self.tree is None else self.tree[:n * self.width]
        args = (self.q[:n], kview, vview, prob.block_table[:n], prob.seq_lens[:n])
        ref32 = reference.paged_decode_attention(
            *args, scale=prob.scale, tree_mask=tree,
            out=torch.empty(self.q[:n].shape, dtype=torch.float32, device=self.q.device))
        ref_lowp = reference.paged_decode_attention(*args, scale=prob.scale, tree_mask=tree,
                                                    compute_dtype=self.q.dtype)
        return problems._budget(out[:n], ref32, ref_lowp, str(self.q.dtype).split(".")[-1])

    def flat_mask(self):
        """The engines' custom mask: per request ``[T, prefix + T]`` bool (the prefix all
        visible, the drafts as :attr:`visible`), flattened and concatenated over the batch
        (``[B * T * (prefix + T)]``)."""
        import torch
        prefix = self.prob.ctx - self.width
        ones = torch.ones(self.width, prefix, dtype=torch.bool, device=self.q.device)
        return torch.cat([ones, self.visible], 1).reshape(-1).repeat(self.prob.batch)


def _ours_verify_decode(v: _Verify, impl: str, label: str) -> Runner:
    import torch
    from hygon_attn_backend.ops.decode import allocate_decode_workspace, plan_paged_decode

    prob = v.prob
    kview, vview = prob.kv_views()
    ws = allocate_decode_workspace(
        max_num_seqs=prob.batch, num_q_heads=prob.num_q_heads,
        num_kv_heads=prob.num_kv_heads, head_dim=prob.head_dim, max_context_len=prob.ctx,
        device=prob.q.device, num_tokens=v.width)
    plan = plan_paged_decode(
        prob.block_table, prob.seq_lens, num_q_heads=prob.num_q_heads,
        num_kv_heads=prob.num_kv_heads, head_dim=prob.head_dim, page_size=prob.page_size,
        q_dtype=prob.q.dtype, kv_dtype=kview.dtype, num_tokens=v.width, max_seq_len=prob.ctx,
        workspace=ws, tree_mask=v.tree, impl=impl)
    out = torch.empty_like(v.q)
    return Runner(label, lambda: plan.run(v.q, kview, vview, out=out), out,
                  note=f"T={v.width}", keep=[ws, plan])


def _ours_verify_prefill(v: _Verify, impl: str, label: str) -> Runner:
    import torch
    from hygon_attn_backend.ops.prefill import plan_prefix_prefill

    prob, width = v.prob, v.width
    b, dev = prob.batch, prob.q.device
    kview, vview = prob.kv_views()
    cu = torch.arange(0, b + 1, dtype=torch.int32, device=dev) * width
    total = b * width
    host_cu = [i * width for i in range(b + 1)]
    plan = plan_prefix_prefill(
        cu, prob.seq_lens, total_q=total, num_q_heads=prob.num_q_heads,
        num_kv_heads=prob.num_kv_heads, head_dim=prob.head_dim, host_cu_seqlens_q=host_cu,
        host_seq_lens_k=[prob.ctx] * b, capacity=prob.block_table.shape[1] * prob.page_size,
        q_dtype=prob.q.dtype, kv_dtype=kview.dtype, tree_mask=v.tree, impl=impl)
    q = v.q.reshape(total, prob.num_q_heads, prob.head_dim)
    out = torch.empty_like(v.q)
    flat = out.view(total, prob.num_q_heads, prob.head_dim)
    return Runner(label, lambda: plan.run(q, kview, vview, prob.block_table, cu, prob.seq_lens,
                                          out=flat), out, note=f"T={width}", keep=[cu, plan])


def _sglang_verify(v: _Verify) -> Runner:
    """SGLang's Triton verify: ``extend_attention_fwd`` over the prefix through
    ``kv_indices``, the drafts' K/V dense, the per-request ``[T, prefix + T]`` custom mask
    flattened with ``mask_indptr`` (its target-verify call)."""
    import importlib.util
    import os
    import torch

    prob, width = v.prob, v.width
    dev = prob.q.device
    if importlib.util.find_spec("sglang") is None:
        raise Unavailable("not installed")
    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise Unavailable("needs a CUDA GPU (or TRITON_INTERPRET=1)")
    try:
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    except Exception as exc:  # moved in another SGLang version, or its import chain breaks
        raise Unavailable(f"import failed: {type(exc).__name__}: {str(exc)[:120]}") from exc
    b, hkv, d = prob.batch, prob.num_kv_heads, prob.head_dim
    prefix = prob.ctx - width
    k_buf, v_buf = prob.k_store.view(-1, hkv, d), prob.v_store.view(-1, hkv, d)
    drafts = prob.token_slots()[:, prefix:].reshape(-1)
    k_new, v_new = k_buf[drafts].contiguous(), v_buf[drafts].contiguous()
    q = v.q.reshape(b * width, prob.num_q_heads, d)
    qo_indptr = torch.arange(0, b + 1, dtype=torch.int64, device=dev) * width
    kv_indptr = torch.arange(0, b + 1, dtype=torch.int32, device=dev) * prefix
    kv_indices = prob.token_slots()[:, :prefix].reshape(-1).contiguous()
    custom_mask = v.flat_mask()
    mask_indptr = torch.arange(0, b + 1, dtype=torch.int64, device=dev) * (width * prob.ctx)
    out = torch.empty_like(v.q)
    flat = out.view(b * width, prob.num_q_heads, d)

    def fn():
        extend_attention_fwd(q, k_new, v_new, flat, k_buf, v_buf, qo_indptr, kv_indptr,
                             kv_indices, custom_mask, True, mask_indptr, width, 1.0, 1.0,
                             sm_scale=prob.scale, extend_seq_lens_cpu=[width] * b)
    return Runner("sglang triton verify", fn, out, note=f"T={width}, custom mask",
                  keep=[k_new, v_new, qo_indptr, kv_indptr, kv_indices, custom_mask,
                        mask_indptr])


def _flashinfer_verify(v: _Verify) -> Runner:
    """FlashInfer's paged prefill with a custom mask (``BatchPrefillWithPagedKVCacheWrapper``
    of ``flashinfer.prefill``, ``backend="fa2"``: its fa3 kernels take no custom mask): each
    request's T queries over its ``prefix + T`` paged keys under :meth:`_Verify.flat_mask`,
    which ``plan`` packs (outside the timed call)."""
    import torch
    from hygon_attn_backend.tools.bench import engine_peers

    prob, width = v.prob, v.width
    wrapper_cls, ws, indptr, indices, last = engine_peers._flashinfer_setup(
        prob, "BatchPrefillWithPagedKVCacheWrapper", prob.ctx, module="prefill")
    b, hq, d = prob.batch, prob.num_q_heads, prob.head_dim
    qo_indptr = torch.arange(0, b + 1, dtype=torch.int32, device=prob.q.device) * width
    wrapper = wrapper_cls(ws, "NHD", backend="fa2")
    wrapper.plan(qo_indptr, indptr, indices, last, hq, prob.num_kv_heads, d, prob.page_size,
                 custom_mask=v.flat_mask(), sm_scale=prob.scale, q_data_type=prob.q.dtype,
                 kv_data_type=prob.k_store.dtype)
    q = v.q.reshape(b * width, hq, d)
    out = torch.empty_like(v.q)
    flat = out.view(b * width, hq, d)
    fn = lambda: wrapper.run(q, (prob.k_store, prob.v_store), out=flat)
    return Runner("flashinfer fa2 verify", fn, out, note=f"T={width}, custom mask",
                  keep=[wrapper, ws, qo_indptr, indptr, indices, last])


def _ours_plain_decode(prob, impl: str) -> Runner:
    from hygon_attn_backend.tools.bench.peers import ours_decode

    return ours_decode(prob, partition_size=None, impl=impl, label="hygon decode, same batch")


def _made(factory, label):
    try:
        return label, factory()
    except Exception as exc:  # Unavailable, or a setup the op refuses
        return label, exc


def run_verify_bench(args) -> dict:
    """Run the verify benchmark described by ``args`` (see :func:`add_verify_parser`);
    print a markdown table and return all numbers as a dict ({} without a device)."""
    import torch

    if not hasattr(args, "plot"):
        args.plot, args.compare = "", ""
    started = _harness.start(args, "verify")
    if started is None:
        return {}
    impls, _, device = started
    for name, value in (GPU_DEFAULTS if device.type == "cuda" else CPU_DEFAULTS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    dtype = getattr(torch, args.dtype)
    hq, hkv, dim = args.num_q_heads, args.num_kv_heads, args.head_dim
    meta = _harness.header(device)
    copy, _ = _timing.copy_ceiling(args.rep_ms, device=device)
    meta.update(copy_gbps=copy, dtype=args.dtype, num_q_heads=hq, head_dim=dim,
                l2_flush=_timing.L2_FLUSH, tree=list(args.tree), chain=args.chain)
    print(f"# verify bench: {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, "
          f"{args.dtype}, B={args.batch}, prefix {args.prefix}, Hq={hq}, Hkv={hkv}, D={dim}; "
          f"graph replay, L2 cleared before every replay", flush=True)
    print(f"device copy (read + write): {copy:.0f} GB/s = 100%", flush=True)
    cases = [(f"chain {args.chain}", args.chain, None),
             (f"tree {len(args.tree)}", len(args.tree), list(args.tree))]
    rows = []
    for page in [int(x) for x in str(args.block_sizes).split(",") if x]:
        for case, width, parents in cases:
            prob = problems.build_decode(batch=args.batch, ctx=args.prefix + width,
                                         page_size=page, num_q_heads=hq, num_kv_heads=hkv,
                                         head_dim=dim, dtype=dtype, device=device)
            gen = torch.Generator(device=device).manual_seed(1)
            v = _Verify(prob, width=width, parents=parents, gen=gen)
            base = dict(op="decode", batch=args.batch, ctx=prob.ctx, num_q_heads=hq,
                        num_kv_heads=hkv, head_dim=dim, page=page)
            tag = (lambda impl: f" [{impl}]" if len(impls) > 1 else "")
            made = [_made(lambda: _ours_plain_decode(prob, impl), "hygon decode, same batch"
                          + tag(impl)) for impl in impls]
            plain = _harness.run_all(made, lambda out: problems.check_decode(prob, out),
                                     base=base, graph=True, rep_ms=args.rep_ms,
                                     work=prob.kv_bytes(), ceiling=copy, device=device)
            made = []
            for impl in impls:
                made.append(_made(lambda: _ours_verify_decode(
                    v, impl, f"hygon verify (decode){tag(impl)}"), "hygon verify (decode)"))
                made.append(_made(lambda: _ours_verify_prefill(
                    v, impl, f"hygon verify (prefill){tag(impl)}"), "hygon verify (prefill)"))
            made.append(_made(lambda: _sglang_verify(v), "sglang triton verify"))
            made.append(_made(lambda: _flashinfer_verify(v), "flashinfer fa2 verify"))
            verify = _harness.run_all(made, v.check, base=base, graph=True, rep_ms=args.rep_ms,
                                      work=prob.kv_bytes(), ceiling=copy, device=device)
            decode_ms = next((r["ms"] for r in plain if r["status"] == "ok"), None)
            for r in plain:
                r["case"], r["note"] = case, f"{case}, {r.get('note', '')}".rstrip(", ")
            for r in verify:
                r["case"] = case
                if r["status"] == "ok" and decode_ms:
                    r["note"] = f"{case}, {r['ms'] / decode_ms:.2f}x decode"
                else:
                    r["note"] = case
            rows += plain + verify
            rows.append(dict(_same_bytes_copy(prob.kv_bytes(), base, copy, args.rep_ms,
                                              device), case=case))
            _harness.print_row(rows[-1])
            prob = v = made = None  # free the caches before the next case
    _harness.emit(rows, meta, args, op="decode", unit="GB/s", ceiling=copy,
                  ceiling_name="copy", title=f"verify {args.dtype}, Hq={hq}, D={dim}")
    return dict(meta, rows=rows)


def _same_bytes_copy(nbytes: int, base: dict, copy: float, rep_ms: float, device) -> dict:
    ms = _timing.same_bytes_copy_ms(nbytes, rep_ms, device=device)
    value = nbytes / ms / 1e6
    return dict(base, impl="device copy, same bytes", note="reference, not attention",
                status="ok", ms=ms, value=value, unit="GB/s", ceiling=copy,
                pct=100 * value / copy)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="hygon-attn-bench-verify")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_verify_parser(sub)
    args = parser.parse_args(["verify"] + list(argv if argv is not None else sys.argv[1:]))
    return run_verify_bench(args)


if __name__ == "__main__":
    main()
