"""The fp8 prefix prefill through the 16-bit workspace (``ops/prefill/workspace.py``):
the dequantizing page gather and the plan's route, against reference.py (CPU: Triton's
interpreter, fp16; a GPU runs the same cases)."""

from __future__ import annotations

import pytest
import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops.prefill import plan_prefix_prefill, prefix_prefill_attention
from hygon_attn_backend.ops.prefill import workspace
from tests.support.budget import assert_within_budget


def _batch(device, *, fp8=torch.float8_e4m3fn, page=4, hkv=2, group=2, dim=32,
           lens_q=(9, 0, 5), lens_k=(21, 3, 5), bad=True, scale_tensor=False):
    """scale_tensor: False (float scales), True (1-element k scale) or "per_head" ([hkv]
    k and v scales)."""
    gen = torch.Generator(device="cpu").manual_seed(3)
    width = max(-(-n // page) for n in lens_k) + 1
    num_blocks = len(lens_k) * width + 3
    perm = torch.randperm(num_blocks, generator=gen)
    table = perm[:len(lens_k) * width].view(len(lens_k), width).to(torch.int32)
    if bad:  # a bad id inside request 0's keys: those keys are absent
        table[0, 1] = -1
        table[0, 2] = num_blocks + 7
    k_scale, v_scale = 0.5, 1.75
    k = reference.quantize_fp8(torch.randn(num_blocks, hkv, page, dim, generator=gen), fp8,
                               k_scale)
    v = reference.quantize_fp8(torch.randn(num_blocks, hkv, page, dim, generator=gen), fp8,
                               v_scale)
    cu = [0]
    for n in lens_q:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], hkv * group, dim, generator=gen).half()
    ks = torch.tensor([k_scale]) if scale_tensor else k_scale
    vs = v_scale
    if scale_tensor == "per_head":  # each head's codes stand for other magnitudes
        ks = torch.linspace(0.25, 1.0, hkv)
        vs = torch.linspace(2.0, 0.5, hkv).to(device)
    tensors = [x.to(device) for x in (q, k, v, table)]
    return dict(q=tensors[0], k=tensors[1], v=tensors[2], table=tensors[3],
                cu=torch.tensor(cu, dtype=torch.int32, device=device),
                lens=torch.tensor(lens_k, dtype=torch.int32, device=device),
                host_cu=cu, host_lens=list(lens_k), page=page, width=width,
                k_scale=ks.to(device) if scale_tensor else ks, v_scale=vs)


def _plan(b, **kw):
    q = b["q"]
    return plan_prefix_prefill(b["cu"], b["lens"], total_q=q.shape[0], num_q_heads=q.shape[1],
                               num_kv_heads=b["k"].shape[1], head_dim=q.shape[2],
                               host_cu_seqlens_q=b["host_cu"], host_seq_lens_k=b["host_lens"],
                               capacity=b["width"] * b["page"], q_dtype=q.dtype,
                               kv_dtype=b["k"].dtype, page_size=b["page"],
                               max_blocks=b["width"], impl="triton", **kw)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scale_tensor", [False, True, "per_head"])
def test_workspace_route_matches_reference(device, fp8, scale_tensor):
    b = _batch(device, fp8=fp8, scale_tensor=scale_tensor)
    plan = _plan(b, fp8_workspace=True)
    assert plan.workspace is not None and plan.workspace.num_pages == 6 + 1 + 2
    args = (b["q"], b["k"], b["v"], b["table"], b["cu"], b["lens"])
    kw = dict(k_scale=b["k_scale"], v_scale=b["v_scale"])
    out = prefix_prefill_attention(*args, plan=plan, **kw)
    again = prefix_prefill_attention(*args, plan=plan, **kw)  # the kept tables and layer
    ref64 = reference.prefix_prefill_attention(*args, **kw, compute_dtype=torch.float64)
    ref_lp = reference.prefix_prefill_attention(*args, **kw, compute_dtype=b["q"].dtype)
    assert_within_budget(out, ref64, ref_lp, what="workspace route")
    assert torch.equal(out, again)
    direct = prefix_prefill_attention(*args, plan=_plan(b, fp8_workspace=False), **kw)
    assert_within_budget(direct, ref64, ref_lp, what="direct route")


def test_dequant_pages_writes_code_times_scale_and_skips_absent_pages(device):
    src = reference.quantize_fp8(torch.randn(5, 2, 3, 24), torch.float8_e4m3fn, 0.25)
    src = src.to(device)
    dst = torch.full((3, 2, 3, 24), 7.0, dtype=torch.float16, device=device)
    page_map = torch.tensor([4, -1, 0], dtype=torch.int64, device=device)
    workspace.dequant_pages(src, dst, page_map, 0.25)
    want = (src.float() * 0.25).half()
    assert torch.equal(dst[0], want[4]) and torch.equal(dst[2], want[0])
    assert bool((dst[1] == 7.0).all())  # an absent page is not written
    heads = torch.tensor([0.5, 4.0], device=device)  # one scale a KV head
    workspace.dequant_pages(src, dst, page_map, heads)
    want = (src.float() * heads.view(1, 2, 1, 1).cpu().to(src.device)).half()
    assert torch.equal(dst[0], want[4]) and torch.equal(dst[2], want[0])


def test_workspace_tables_mark_bad_ids_absent(device):
    b = _batch(device)
    counts = workspace.page_counts(b["host_lens"], b["page"], b["width"])
    ws = workspace.build(counts, page_size=b["page"], width=b["width"],
                         device=device)
    page_map, ws_table = ws.tables(b["table"], b["k"].shape[0])
    assert ws_table.shape == b["table"].shape
    assert ws_table[0, :6].tolist() == [0, -1, -1, 3, 4, 5] and ws_table[0, 6:].eq(-1).all()
    assert ws_table[1, 0].item() == 6 and ws_table[2, :2].tolist() == [7, 8]
    assert page_map[1].item() == -1 and page_map[0].item() == b["table"][0, 0].item()
    assert ws.tables(b["table"], b["k"].shape[0])[1] is ws_table  # kept for the same table


def test_the_rule_takes_batches_with_nothing_to_dequantize():
    assert workspace.use_workspace(num_seqs=4, pages=0)
    assert not workspace.use_workspace(num_seqs=1, pages=1)  # the pass is not timed yet
    assert not workspace.use_workspace(num_seqs=0, pages=0)
    b = _batch(torch.device("cpu"))
    with pytest.raises(ValueError, match="fp8_workspace must be None, True or False"):
        _plan(b, fp8_workspace="on")
    with pytest.raises(ValueError, match="fp8_workspace=True needs"):
        plan_prefix_prefill(b["cu"], b["lens"], total_q=14, num_q_heads=4, num_kv_heads=2,
                            head_dim=32, kv_dtype=b["k"].dtype, fp8_workspace=True,
                            impl="triton")


@pytest.mark.parametrize("scale_tensor", [False, "per_head"])
def test_workspace_with_dense_new_keys_holds_the_prefix_only(device, scale_tensor):
    """SGLang's extend: the new tokens' K/V come dense (q's dtype), the fp8 cache holds the
    prefix; the workspace dequantizes the prefix pages only and the 16-bit kernel reads
    both sources, against the reference over the same two sources."""
    b = _batch(device, scale_tensor=scale_tensor)
    gen = torch.Generator(device="cpu").manual_seed(5)
    total, hkv, dim = b["q"].shape[0], b["k"].shape[1], b["q"].shape[2]
    k_new = torch.randn(total, hkv, dim, generator=gen).half().to(device)
    v_new = torch.randn(total, hkv, dim, generator=gen).half().to(device)
    plan = _plan(b, fp8_workspace=True, has_k_new=True)
    # prefixes 21 - 9 = 12, 3 - 0 = 3, 5 - 5 = 0 keys: 3 + 1 + 0 pages of 4
    assert plan.workspace is not None and plan.workspace.num_pages == 4
    args = (b["q"], b["k"], b["v"], b["table"], b["cu"], b["lens"])
    kw = dict(k_scale=b["k_scale"], v_scale=b["v_scale"], k_new=k_new, v_new=v_new)
    out = prefix_prefill_attention(*args, plan=plan, **kw)
    ref64 = reference.prefix_prefill_attention(*args, **kw, compute_dtype=torch.float64)
    ref_lp = reference.prefix_prefill_attention(*args, **kw, compute_dtype=b["q"].dtype)
    assert_within_budget(out, ref64, ref_lp, what="workspace with dense new keys")
    direct = prefix_prefill_attention(*args, plan=_plan(b, fp8_workspace=False,
                                                        has_k_new=True), **kw)
    assert_within_budget(direct, ref64, ref_lp, what="direct route with dense new keys")
    no_new = dict(k_scale=b["k_scale"], v_scale=b["v_scale"])
    with pytest.raises(ValueError, match="holds the prefix pages only"):
        prefix_prefill_attention(*args, plan=plan, **no_new)  # the new keys are not there


def test_the_rule_takes_dense_new_keys_without_a_prefix(device):
    b = _batch(device, lens_q=(3, 5), lens_k=(3, 5), bad=False)
    plan = _plan(b, has_k_new=True)  # no prefix: nothing to dequantize
    assert plan.workspace is not None and plan.workspace.num_pages == 0
    assert _plan(b).workspace is None  # the keys in the cache, 8 x 2 rows: the fp8 kernels
