"""What the benchmarks run: our ops and the peers named by ``--compare``.

Each maker takes a problem (:mod:`hygon_attn_backend.tools.bench.problems`) and returns a
:class:`Runner`: a no-argument ``fn`` that computes into the preallocated ``out``, with
every plan, workspace and metadata tensor built before (so ``fn`` is what an engine's
decode graph or prefill step launches). A peer that cannot run here raises
:class:`Unavailable` with the reason (``"not installed"``, ``"needs a CUDA GPU"``).

Peers: ``sdpa`` (torch ``scaled_dot_product_attention``, flash and cuDNN backends, on the
dense equivalent of the paged problem) here; ``sglang``, ``vllm`` and ``flashinfer`` in
:mod:`hygon_attn_backend.tools.bench.engine_peers`.
"""

from __future__ import annotations

from typing import Optional

from hygon_attn_backend.tools.bench._runner import Runner, Unavailable  # noqa: F401

PEERS = ("sglang", "vllm", "flashinfer", "sdpa")


def parse_compare(text: str) -> list:
    """``"sglang,sdpa"`` -> ``["sglang", "sdpa"]``; ``"all"`` -> every peer."""
    names = [x.strip().lower() for x in (text or "").split(",") if x.strip()]
    if names == ["all"]:
        return list(PEERS)
    bad = [n for n in names if n not in PEERS]
    if bad:
        raise ValueError(f"--compare: unknown peer(s) {bad}; choose from {list(PEERS)}")
    return names


# ----------------------------------------------------------------------------- ours

def ours_decode(prob, *, partition_size: Optional[int], kv_head_grid: bool = True,
                tile=None, fused_combine: Optional[bool] = None, impl: str = "auto",
                label: str = "hygon") -> Runner:
    """Our paged decode planned once (``plan_paged_decode`` with a workspace, the host-known
    ``max_seq_len`` and optional ``partition_size`` / ``tile`` / ``fused_combine``, the
    implementation ``impl``), launched per call."""
    import torch
    from hygon_attn_backend.ops.decode import allocate_decode_workspace, plan_paged_decode
    kview, vview = prob.kv_views()
    ws = allocate_decode_workspace(
        max_num_seqs=prob.batch, num_q_heads=prob.num_q_heads,
        num_kv_heads=prob.num_kv_heads, head_dim=prob.head_dim, max_context_len=prob.ctx,
        device=prob.q.device, partition_size=partition_size)
    plan = plan_paged_decode(
        prob.block_table, prob.seq_lens, num_q_heads=prob.num_q_heads,
        num_kv_heads=prob.num_kv_heads, head_dim=prob.head_dim, page_size=kview.shape[2],
        q_dtype=prob.q.dtype, kv_dtype=kview.dtype, max_seq_len=prob.ctx,
        partition_size=partition_size, workspace=ws, kv_head_grid=kv_head_grid, tile=tile,
        fused_combine=fused_combine, impl=impl)
    out = torch.empty_like(prob.q)
    scales = prob.scales()  # fp8: the problem's scales
    fn = lambda: plan.run(prob.q, kview, vview, out=out, **scales)
    note = ""
    cfg = plan.config
    if cfg is not None:
        note = f"partition {cfg.partition_size} (x{cfg.num_partitions})"
        if plan.split:
            note += ", per-sequence" if cfg.seq_split else ""
            note += ", fused combine" if plan.fused_combine else ", combine launch"
    if plan.impl == "native":
        note += (f", split-N {plan.native_tile}-token tiles, {plan.native_stages} stages"
                 if plan.native_stages else ", shared-softmax loop")
    return Runner(label, fn, out, note=note, keep=[ws, plan])


def ours_dcp_shard(shard, *, world_size: int, label: str) -> Runner:
    """One rank's side of decode context parallelism over ``world_size`` ranks: our
    decode of the rank's shard (``shard``: the problem with ``1 / world_size`` of every
    sequence, the group's query heads) returning its LSE, then the merge of
    ``world_size`` partial outputs by their LSEs (``ops.lse_merge``; the other ranks'
    partials are stand-ins, the collectives that would carry them are not timed).
    ``out`` is the shard's own output (what the check reads)."""
    import torch
    from hygon_attn_backend.ops.decode import allocate_decode_workspace, plan_paged_decode
    from hygon_attn_backend.ops.lse_merge import merge_partials
    kview, vview = shard.kv_views()
    ws = allocate_decode_workspace(
        max_num_seqs=shard.batch, num_q_heads=shard.num_q_heads,
        num_kv_heads=shard.num_kv_heads, head_dim=shard.head_dim, max_context_len=shard.ctx,
        device=shard.q.device)
    plan = plan_paged_decode(
        shard.block_table, shard.seq_lens, num_q_heads=shard.num_q_heads,
        num_kv_heads=shard.num_kv_heads, head_dim=shard.head_dim, page_size=kview.shape[2],
        q_dtype=shard.q.dtype, kv_dtype=kview.dtype, max_seq_len=shard.ctx, workspace=ws,
        return_lse=True)
    outs = torch.randn((world_size,) + tuple(shard.q.shape), device=shard.q.device).to(
        shard.q.dtype)
    lses = torch.randn(outs.shape[:-1], device=shard.q.device) + 10.0

    def fn():
        plan.run(shard.q, kview, vview, out=outs[0], lse=lses[0])
        return merge_partials(outs, lses)

    cfg = plan.config
    note = f"ctx {shard.ctx} a rank" + (
        f", partition {cfg.partition_size} (x{cfg.num_partitions})" if cfg else "")
    return Runner(label, fn, outs[0], note=note, keep=[ws, plan, outs, lses])


def ours_prefill(prob, *, kv_source: str = "cache", tile=None, label: str = "hygon",
                 impl: str = "auto", fp8_workspace=None) -> Runner:
    """Our prefix prefill with the plan built once (host copies of the lengths, so no host
    check per call). ``kv_source``: ``cache`` reads the new tokens' K/V from the cache
    (vLLM), ``dense`` from the packed tensors (SGLang); ``impl`` as the op takes it;
    ``fp8_workspace`` as ``plan_prefix_prefill`` takes it."""
    import torch
    from hygon_attn_backend.ops.prefill import plan_prefix_prefill
    kview, vview = prob.kv_views()
    plan = plan_prefix_prefill(prob.cu_seqlens_q, prob.seq_lens_k, total_q=prob.q.shape[0],
                               num_q_heads=prob.num_q_heads, num_kv_heads=prob.num_kv_heads,
                               head_dim=prob.head_dim, tile=tile,
                               host_cu_seqlens_q=prob.cu_seqlens_q.cpu(),
                               host_seq_lens_k=prob.seq_lens_k.cpu(),
                               capacity=prob.block_table.shape[1] * prob.page_size,
                               has_k_new=kv_source == "dense", q_dtype=prob.q.dtype,
                               kv_dtype=prob.kv_dtype, page_size=prob.page_size,
                               max_blocks=prob.block_table.shape[1],
                               fp8_workspace=fp8_workspace, impl=impl)
    out = torch.empty_like(prob.q)
    kw = dict(k_new=prob.k_new, v_new=prob.v_new) if kv_source == "dense" else {}
    kw.update(prob.scales())
    fn = lambda: plan.run(prob.q, kview, vview, prob.block_table, prob.cu_seqlens_q,
                          prob.seq_lens_k, out=out, **kw)
    note = f"tile {plan.block_m},{plan.block_n},{plan.num_warps},{plan.num_stages}"
    if plan.impl == "native":
        note = f"native sm_90a, {plan.block_m} rows x 128 keys"
    if plan.workspace is not None:
        note += f", fp8 through a 16-bit workspace ({plan.workspace.num_pages} pages)"
    return Runner(label, fn, out, note=note, keep=[plan])


# ----------------------------------------------------------------------------- sdpa

SDPA_BACKENDS = ("flash", "cudnn")


def _sdpa_call(backend: str, q, k, v, **kw):
    """A function running SDPA restricted to ``backend`` (or raising on first call)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
             "math": SDPBackend.MATH}[backend]  # math: the CPU check of this wiring

    def fn():
        with sdpa_kernel([which]):
            return F.scaled_dot_product_attention(q, k, v, **kw)
    return fn


def _sdpa_runner(backend, q, k, v, out, out_view, label, masks, scale):
    """The first form SDPA's ``backend`` accepts: grouped-query K/V, else K/V expanded to
    every query head; for each, the mask forms of ``masks`` (``[(name, kwargs)]``) in
    order."""
    errors = []
    group = q.shape[1] // k.shape[1]
    for gqa in (True, False) if group > 1 else (False,):
        kk = k if gqa else k.repeat_interleave(group, dim=1)
        vv = v if gqa else v.repeat_interleave(group, dim=1)
        for mask_name, mask_kw in masks:
            kw = dict(mask_kw, scale=scale, **({"enable_gqa": True} if gqa else {}))
            call = _sdpa_call(backend, q, kk, vv, **kw)
            try:
                call()
            except Exception as exc:  # backend refuses this form: try the next
                errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:60]}")
                continue

            def fn(call=call):
                out_view.copy_(call())
            notes = [mask_name] + ([] if gqa or group == 1 else ["K/V expanded to Hq heads"])
            return Runner(label, fn, out, note=", ".join(n for n in notes if n),
                          keep=[kk, vv])
    raise Unavailable("refused: " + "; ".join(errors[:2]))


def sdpa_decode(prob, backend: str) -> Runner:
    """Dense ``[B, H, ctx, D]`` K/V gathered from the cache; one query row per sequence."""
    import torch
    slots = prob.token_slots()  # [B, ctx]
    k = prob.k_store.view(-1, prob.num_kv_heads, prob.head_dim)[slots].transpose(1, 2)
    v = prob.v_store.view(-1, prob.num_kv_heads, prob.head_dim)[slots].transpose(1, 2)
    k, v = k.contiguous(), v.contiguous()  # [B, Hkv, ctx, D]
    q = prob.q.unsqueeze(2)  # [B, Hq, 1, D]
    out = torch.empty_like(prob.q)
    return _sdpa_runner(backend, q, k, v, out, out.unsqueeze(2), f"sdpa {backend}",
                        [("", {})], prob.scale)


def sdpa_prefill(prob, backend: str) -> Runner:
    """Dense ``[B, H, L, D]`` tensors, bottom-right causal mask (``is_causal`` when there
    is no prefix)."""
    import torch
    b, e, hq, d = prob.batch, prob.extend, prob.num_q_heads, prob.head_dim
    len_k = prob.prefix + e
    slots = prob.token_slots(0, len_k)
    k = prob.k_store.view(-1, prob.num_kv_heads, d)[slots].transpose(1, 2).contiguous()
    v = prob.v_store.view(-1, prob.num_kv_heads, d)[slots].transpose(1, 2).contiguous()
    q = prob.q.view(b, e, hq, d).transpose(1, 2).contiguous()
    out = torch.empty_like(prob.q)
    out_view = out.view(b, e, hq, d).transpose(1, 2)
    if prob.prefix == 0:
        masks = [("is_causal", dict(is_causal=True))]
    else:
        from torch.nn.attention.bias import causal_lower_right
        bool_mask = torch.ones(e, len_k, device=q.device, dtype=torch.bool).tril(prob.prefix)
        masks = [("causal_lower_right", dict(attn_mask=causal_lower_right(e, len_k))),
                 ("bool mask", dict(attn_mask=bool_mask))]
    return _sdpa_runner(backend, q, k, v, out, out_view, f"sdpa {backend}", masks,
                        prob.scale)


def make_peers(name: str, prob, op: str) -> list:
    """``[(label, Runner or Unavailable)]`` for peer ``name`` on ``prob`` (``op``:
    ``decode`` or ``prefill``)."""
    if name == "sdpa":
        maker = sdpa_decode if op == "decode" else sdpa_prefill
        rows = []
        for backend in SDPA_BACKENDS:
            if prob.fp8:
                rows.append((f"sdpa {backend}", Unavailable(
                    "no fp8 KV (SDPA takes K/V in the query's dtype)")))
                continue
            if prob.q.device.type != "cuda":
                rows.append((f"sdpa {backend}", Unavailable(
                    "not available on CPU (flash and cuDNN need a CUDA GPU)")))
                continue
            try:
                rows.append((f"sdpa {backend}", maker(prob, backend)))
            except Exception as exc:  # Unavailable, or a setup failure
                rows.append((f"sdpa {backend}", exc))
        return rows
    from hygon_attn_backend.tools.bench import engine_peers
    maker = getattr(engine_peers, f"{name}_{op}")
    label = engine_peers.LABELS[name]
    if prob.fp8 and prob.per_head_scales:
        return [(label, Unavailable("per-tensor fp8 scales only in this comparison"))]
    try:
        return [(label, maker(prob))]
    except Exception as exc:  # Unavailable, or a peer that breaks while setting up
        return [(label, exc)]
