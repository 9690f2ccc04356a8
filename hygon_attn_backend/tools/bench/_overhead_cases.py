"""The per-layer calls ``bench overhead`` times, each a zero-argument callable over a tiny
problem whose batch-level state (plans, workspaces, engine metadata) is built once here.

Pages are a random permutation of the cache's blocks, as in every benchmark.
"""

from __future__ import annotations

import importlib.util
from typing import Callable, Iterator, Optional, Tuple

import torch

from hygon_attn_backend.tools.bench._overhead_shapes import DECODE, EXTEND, MIXED

Row = Tuple[str, Optional[Callable[[], object]]]


def _paged_batch(seq_lens, *, page_size, num_kv_heads, head_dim, dtype, device, spare=4):
    """A vLLM combined K|V cache (``LBHNC``) holding ``seq_lens`` tokens per request on
    randomly permuted pages, and its block table / seq lens tensors."""
    from hygon_attn_backend import layouts

    table, num_blocks = permuted_table(seq_lens, page_size=page_size, device=device,
                                       spare=spare)
    kv = layouts.allocate_vllm("LBHNC", num_layers=1, num_blocks=num_blocks,
                               block_size=page_size, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, dtype=dtype, device=device)[0]
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    return kv, table, lens


def permuted_table(seq_lens, *, page_size, device, spare=4):
    """``(block_table [B, max_blocks] int32, num_blocks)``: each request's pages drawn from
    a random permutation of ``sum(pages) + spare`` blocks."""
    blocks_per = [-(-n // page_size) for n in seq_lens]
    num_blocks = sum(blocks_per) + spare
    perm = torch.randperm(num_blocks, device=device).to(torch.int32)
    table = torch.zeros((len(seq_lens), max(blocks_per)), dtype=torch.int32, device=device)
    start = 0
    for i, n in enumerate(blocks_per):
        table[i, :n] = perm[start:start + n]
        start += n
    return table, num_blocks


def _combine_form(plan) -> str:
    """``1 launch`` / ``1 launch, fused combine`` / ``2 launches, combine kernel``."""
    n = plan.num_launches
    text = f"{n} launch" + ("es" if n > 1 else "")
    if plan.split:
        text += ", fused combine" if plan.fused_combine else ", combine kernel"
    return text


def op_rows(*, num_q_heads, num_kv_heads, head_dim, page_size, device,
            dtype=torch.bfloat16) -> Iterator[Row]:
    """The public ops, plain and with their plans."""
    from hygon_attn_backend import layouts
    from hygon_attn_backend.ops import decode as dec
    from hygon_attn_backend.ops import prefill as pre

    b = DECODE["num_seqs"]
    kv, table, lens = _paged_batch([DECODE["ctx"]] * b, page_size=page_size,
                                   num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                                   device=device)
    k_cache, v_cache = layouts.vllm_kv_views(kv)
    k_cache_d, v_cache_d = k_cache, v_cache  # the decode problem's (the names are reused)
    q = torch.randn(b, num_q_heads, head_dim, device=device, dtype=dtype)
    out = torch.empty_like(q)
    # default arguments bind this problem's tensors (the prefill rows below reuse names)
    yield "decode op, plain", lambda q=q, k_cache=k_cache, v_cache=v_cache, table=table, \
        lens=lens, out=out: dec.paged_decode_attention(q, k_cache, v_cache, table, lens, out=out)
    ws = dec.allocate_decode_workspace(
        max_num_seqs=b, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, max_context_len=table.shape[1] * page_size, device=device)
    yield "decode op, workspace", lambda q=q, k_cache=k_cache, v_cache=v_cache, table=table, \
        lens=lens, out=out: dec.paged_decode_attention(
            q, k_cache, v_cache, table, lens, out=out, workspace=ws, max_seq_len=DECODE["ctx"])
    plan = dec.plan_paged_decode(
        table, lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        page_size=page_size, q_dtype=dtype, kv_dtype=dtype, max_seq_len=DECODE["ctx"],
        workspace=ws)
    yield "decode op, plan", lambda q=q, k_cache=k_cache, v_cache=v_cache, table=table, \
        lens=lens, out=out: dec.paged_decode_attention(q, k_cache, v_cache, table, lens,
                                                       out=out, plan=plan)
    yield f"decode plan.run ({_combine_form(plan)})", \
        lambda q=q, k_cache=k_cache, v_cache=v_cache, out=out: plan.run(q, k_cache, v_cache,
                                                                        out=out)
    layer = dec.DecodeLayer(k_cache, v_cache)  # what an engine keeps per layer
    yield f"decode run_layer ({_combine_form(plan)}; the engines' per-layer call)", \
        lambda q=q, out=out: plan.run_layer(layer, q, out)
    if plan.split:  # the other combine form of the same split, in the same run
        other = dec.plan_paged_decode(
            table, lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, page_size=page_size, q_dtype=dtype, kv_dtype=dtype,
            max_seq_len=DECODE["ctx"], workspace=ws, fused_combine=not plan.fused_combine)
        yield f"decode plan.run ({_combine_form(other)})", \
            lambda q=q, k_cache=k_cache, v_cache=v_cache, out=out, other=other: other.run(
                q, k_cache, v_cache, out=out)

    n, prefix, new = EXTEND["num_seqs"], EXTEND["prefix"], EXTEND["new"]
    kv, table, lens = _paged_batch([prefix + new] * n, page_size=page_size,
                                   num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype,
                                   device=device)
    k_cache, v_cache = layouts.vllm_kv_views(kv)
    qp = torch.randn(n * new, num_q_heads, head_dim, device=device, dtype=dtype)
    outp = torch.empty_like(qp)
    cu = torch.arange(0, n * new + 1, new, dtype=torch.int32, device=device)
    yield "prefill op, plain", lambda: pre.prefix_prefill_attention(
        qp, k_cache, v_cache, table, cu, lens, out=outp)
    pplan = pre.plan_prefix_prefill(cu, lens, total_q=n * new, num_q_heads=num_q_heads,
                                    num_kv_heads=num_kv_heads, head_dim=head_dim,
                                    host_cu_seqlens_q=cu.cpu())
    yield "prefill op, plan", lambda: pre.prefix_prefill_attention(
        qp, k_cache, v_cache, table, cu, lens, out=outp, plan=pplan)
    yield "prefill plan.run", lambda: pplan.run(qp, k_cache, v_cache, table, cu, lens,
                                                out=outp)
    player = pre.PrefillLayer(k_cache, v_cache)
    yield f"prefill run_layer ({pplan.impl}; the engines' per-layer call)", \
        lambda: pplan.run_layer(player, qp, table, cu, lens, out=outp)
    if device.type == "cuda":  # the other implementation of the same call, where it runs
        for impl in ("triton", "native"):
            alt = pre.plan_prefix_prefill(
                cu, lens, total_q=n * new, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, host_cu_seqlens_q=cu.cpu(), impl=impl)
            if alt.impl == impl != pplan.impl:
                yield f"prefill run_layer ({impl})", \
                    lambda alt=alt: alt.run_layer(player, qp, table, cu, lens, out=outp)
    if device.type == "cuda":
        yield from launcher_rows([
            lambda: plan.run(q, k_cache_d, v_cache_d, out=out),
            lambda: pplan.run(qp, k_cache, v_cache, table, cu, lens, out=outp)])


def launcher_rows(calls) -> Iterator[Row]:
    """Triton's launcher alone, every argument prebuilt: an empty kernel of two arguments
    (the floor of any Triton launch on this host) and each kernel that ``calls`` (each runs
    one layer through a plan) launch, to tell the launcher's cost from the Python around
    it. CUDA only (the interpreter has no launcher)."""
    from hygon_attn_backend.ops._launch import NO_LAYER, Launch

    recorded = []
    real_call = Launch.__call__

    def record(self, *values):  # the LayerArgs, then the call's values
        recorded.append((self, values))
        return real_call(self, *values)

    Launch.__call__ = record
    try:
        x = torch.zeros(16, device="cuda")
        noop = Launch(_noop_kernel(), (1, 1, 1), {}, ("x_ptr", "n"), num_warps=4,
                      num_stages=1)
        for _ in range(2):  # the first call compiles, the second takes the direct path
            noop(NO_LAYER, x, 3)
        for call in calls:
            call(), call()
    finally:
        Launch.__call__ = real_call
    yield "empty kernel, 2 arguments: Triton's launcher alone", noop.direct_call(NO_LAYER, x, 3)
    seen = set()
    for launch, values in recorded:
        if launch is noop or id(launch) in seen:
            continue
        seen.add(id(launch))
        name = getattr(launch.kernel, "__name__", "kernel")
        yield (f"{name}, {len(launch.kernel.arg_names)} arguments: Triton's launcher alone",
               launch.direct_call(*values))


def _noop_kernel():
    import triton

    @triton.jit
    def noop_kernel(x_ptr, n):
        pass

    return noop_kernel


def vllm_rows(*, num_q_heads, num_kv_heads, head_dim, page_size, device,
              dtype=torch.bfloat16) -> Iterator[Row]:
    """The vLLM backend's per-layer path (engine-free core: what ``do_kv_cache_update``
    and ``forward`` call), metadata and plans built as ``HygonAttentionMetadataBuilder``
    builds them, once, outside the timed calls."""
    from hygon_attn_backend.integrations.vllm import step as vllm_step
    from hygon_attn_backend.ops.decode import allocate_decode_workspace

    for name, dec_n, ext_n in (("vLLM layer, decode batch", DECODE["num_seqs"], 0),
                               ("vLLM layer, mixed batch", MIXED["num_decodes"],
                                MIXED["num_extends"])):
        ctx = DECODE["ctx"] if not ext_n else MIXED["ctx"]
        seq = [ctx] * dec_n + [MIXED["prefix"] + MIXED["new"]] * ext_n
        qlen = [1] * dec_n + [MIXED["new"]] * ext_n
        kv, table, lens = _paged_batch(seq, page_size=page_size, num_kv_heads=num_kv_heads,
                                       head_dim=head_dim, dtype=dtype, device=device)
        tokens = sum(qlen)
        qsl = torch.tensor([0] + list(_cumsum(qlen)), dtype=torch.int32, device=device)
        slots = _last_slots(table, seq, qlen, page_size)
        query = torch.randn(tokens, num_q_heads, head_dim, device=device, dtype=dtype)
        key = torch.randn(tokens, num_kv_heads, head_dim, device=device, dtype=dtype)
        value = torch.randn_like(key)
        out = torch.empty_like(query)
        md = vllm_step.make_metadata(
            query_start_loc=qsl, seq_lens=lens, block_table=table, slot_mapping=slots,
            num_reqs=len(seq), num_actual_tokens=tokens, max_query_len=max(qlen),
            max_seq_len=max(seq), num_decodes=dec_n, num_decode_tokens=dec_n)
        ws = allocate_decode_workspace(
            max_num_seqs=64, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, max_context_len=table.shape[1] * page_size, device=device)
        vllm_step.plan_metadata(md, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                            head_size=head_dim, block_size=page_size, q_dtype=dtype,
                            kv_dtype=dtype, workspace=ws, query_start_loc_cpu=qsl.cpu())
        layer = vllm_step.LayerSpec(num_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                head_size=head_dim, scale=head_dim ** -0.5)

        def write(kv=kv, key=key, value=value, slots=slots, layer=layer):
            vllm_step.write_new_kv(key, value, kv, slots, layer)

        def forward(kv=kv, query=query, md=md, out=out, layer=layer):
            vllm_step.attention(query, kv, md, out, layer)

        yield name + ": do_kv_cache_update", write
        yield name + ": forward", forward


def _cumsum(xs):
    total = 0
    for x in xs:
        total += x
        yield total


def _last_slots(table, seq, qlen, page_size):
    """Cache slots of each request's last ``qlen`` tokens (where the new K/V go)."""
    slots = []
    tab = table.cpu()
    for i, (n, q) in enumerate(zip(seq, qlen)):
        for t in range(n - q, n):
            slots.append(int(tab[i, t // page_size]) * page_size + t % page_size)
    return torch.tensor(slots, dtype=torch.int64, device=table.device)


def sglang_rows(*, num_q_heads, num_kv_heads, head_dim, page_size, device,
                dtype=torch.bfloat16) -> Iterator[Row]:
    """SGLang's ``forward_decode`` / ``forward_extend`` of our backend on SGLang's own pools,
    after ``init_forward_metadata`` (once per step, outside the loop)."""
    if importlib.util.find_spec("sglang") is None:
        yield "SGLang forward_decode", None
        yield "SGLang forward_extend", None
        return
    from hygon_attn_backend.tools.bench import _overhead_sglang

    yield from _overhead_sglang.rows(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                                     head_dim=head_dim, page_size=page_size, device=device,
                                     dtype=dtype)


def all_rows(**shape) -> Iterator[Row]:
    yield from op_rows(**shape)
    yield from vllm_rows(**shape)
    yield from sglang_rows(**shape)
