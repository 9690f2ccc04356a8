"""prefix_prefill_attention (Triton) against the float64 reference.

CPU: the kernel runs in Triton's interpreter on tiny shapes in fp16 (the interpreter's
bf16 ``tl.dot`` is broken). GPU (marked ``gpu``): the same checks at real sizes, bf16 too.
Every case draws fresh random inputs, poisons the output with NaN, and allows a small
multiple of the reference's own error in the input dtype (tests/support/budget.py).
"""

from __future__ import annotations

import functools

import math
from dataclasses import dataclass

import pytest
import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops import _device
from hygon_attn_backend.ops.prefill import tuning
from hygon_attn_backend.ops.prefill import plan as prefill_plan
from hygon_attn_backend.ops.prefill import plan_prefix_prefill, prefix_prefill_attention

from tests.support.budget import assert_within_budget

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu

def force_tile(monkeypatch, tile: str) -> None:
    """Force the prefill tile "BLOCK_M,BLOCK_N,warps,stages" for the plans the op builds."""
    value = tuple(int(x) for x in tile.split(","))
    monkeypatch.setattr(tuning, "tile_config", lambda **kw: value)



@dataclass(frozen=True)
class Case:
    """One batch: request ``b`` has ``prefix[b]`` cached tokens and ``extend[b]`` new ones."""

    name: str
    prefix: tuple
    extend: tuple
    group: int = 2
    kv_heads: int = 2
    page: int = 16
    head_dim: int = 64
    dtype: torch.dtype = torch.float16
    kv_dtype: torch.dtype | None = None  # None: q's dtype
    k_new: bool = False
    causal: bool = True
    layout: str = "bhsd"  # canonical view contiguous, or "bshd" (permuted storage)
    q_noncontig: bool = False
    window: int | None = None
    soft_cap: float | None = None
    sinks: bool = False
    lse: bool = True


# Tiny shapes for the interpreter: prefix 0, prefix ending mid-page, extend of 1, extend
# longer than the prefix, a mixed batch, groups {1, 4, 5, 8}, pages {1, 16, 64}.
CPU_CASES = [
    Case("prefix0", (0,), (37,), group=4, page=16),
    Case("prefix_mid_page", (21,), (9,), group=1, page=16),
    Case("extend1", (40,), (1,), group=4, page=16),
    Case("extend_gt_prefix", (5,), (33,), group=5, page=1),
    Case("mixed", (0, 21, 40, 5, 0), (17, 9, 1, 33, 1), group=8, kv_heads=1, page=64),
    Case("mixed_p1_knew", (0, 21, 40, 5), (17, 9, 1, 33), group=4, page=1, k_new=True),
    Case("mixed_p16_knew_bshd", (3, 18, 64), (17, 1, 20), group=5, page=16, k_new=True,
         layout="bshd"),
    Case("noncontig_q_d80", (19, 2), (13, 6), group=1, page=16, head_dim=80,
         q_noncontig=True, layout="bshd"),
    Case("noncausal", (19, 0), (13, 6), group=4, page=16, causal=False),
    Case("noncausal_knew_p1", (19, 0), (13, 6), group=4, page=1, causal=False, k_new=True),
    Case("fp8_e4m3", (30, 3), (12, 20), group=4, page=16, kv_dtype=torch.float8_e4m3fn),
    Case("fp8_e5m2_knew", (30, 3), (12, 20), group=1, page=16, kv_dtype=torch.float8_e5m2,
         k_new=True),
    Case("window", (30, 3), (12, 20), group=4, page=16, window=9),
    Case("soft_cap_sinks", (30, 3), (12, 20), group=4, page=1, soft_cap=2.5, sinks=True),
    Case("empty_requests", (7, 0, 0, 12), (0, 0, 5, 0), group=4, page=16),
]

# Real sizes on the GPU (bf16 and fp16, default tile configs).
GPU_CASES = [
    Case("g_prefix0", (0,), (1500,), group=4, kv_heads=8, page=16, head_dim=128,
         dtype=torch.bfloat16),
    Case("g_mid_page", (1000,), (777,), group=1, kv_heads=4, page=64, head_dim=128,
         dtype=torch.bfloat16),
    Case("g_mixed_p1_knew", (0, 333, 2048, 100, 7), (512, 1, 129, 1000, 64), group=5,
         kv_heads=2, page=1, head_dim=128, dtype=torch.bfloat16, k_new=True),
    Case("g_mixed_p16", (0, 333, 2048, 100, 7), (512, 1, 129, 1000, 64), group=8,
         kv_heads=2, page=16, head_dim=128, dtype=torch.float16, layout="bshd"),
    Case("g_d64_p64", (700, 64), (300, 900), group=4, kv_heads=4, page=64, head_dim=64,
         dtype=torch.bfloat16, q_noncontig=True),
    Case("g_d80", (700, 64), (300, 900), group=4, kv_heads=2, page=16, head_dim=80,
         dtype=torch.bfloat16),
    # a 32-wide head runs on the GPU's 64-wide head tile (ops._device.head_tile: the
    # ragged kernel's 32-wide value tiles were wrong on an H100)
    Case("g_d32", (700, 64), (300, 900), group=4, kv_heads=2, page=16, head_dim=32,
         dtype=torch.float16),
    Case("g_d96_knew", (700, 64), (300, 900), group=1, kv_heads=4, page=16, head_dim=96,
         dtype=torch.float16, k_new=True),
    Case("g_d256", (700, 64), (300, 900), group=4, kv_heads=2, page=16, head_dim=256,
         dtype=torch.bfloat16),
    Case("g_noncausal", (500, 0), (300, 257), group=4, kv_heads=2, page=16, head_dim=128,
         dtype=torch.bfloat16, causal=False),
    Case("g_fp8_e4m3", (900, 10), (300, 400), group=4, kv_heads=2, page=16, head_dim=128,
         dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn),
    Case("g_fp8_e5m2_knew", (900, 10), (300, 400), group=4, kv_heads=2, page=64,
         head_dim=128, dtype=torch.float16, kv_dtype=torch.float8_e5m2, k_new=True),
    Case("g_window_softcap", (900, 10), (300, 400), group=4, kv_heads=2, page=16,
         head_dim=128, dtype=torch.bfloat16, window=257, soft_cap=30.0),
    Case("g_sinks_g16", (900, 10), (300, 400), group=16, kv_heads=1, page=16,
         head_dim=128, dtype=torch.bfloat16, sinks=True),
]


def make_inputs(case: Case, device, *, seed: int = 0, min_blocks: int = 0):
    """Random inputs for ``case``: a shuffled paged cache, packed q (and k_new/v_new)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape, dtype):
        return torch.randn(*shape, generator=gen, device=device).to(dtype=dtype)

    num_seqs = len(case.extend)
    hq, hkv, dim, page = case.group * case.kv_heads, case.kv_heads, case.head_dim, case.page
    kv_dtype = case.kv_dtype or case.dtype
    lens_k = [p + e for p, e in zip(case.prefix, case.extend)]
    max_blocks = max(1, max(-(-n // page) for n in lens_k)) + 1
    num_blocks = max(num_seqs * max_blocks + 3, min_blocks)
    k_scale = v_scale = None
    if kv_dtype in reference.FP8_DTYPES:
        k_scale, v_scale = 0.37, 1.9
        shape = (num_blocks, hkv, page, dim)
        k_src, v_src = rnd(*shape, dtype=torch.float32), rnd(*shape, dtype=torch.float32)
        k_store = reference.quantize_fp8(k_src, kv_dtype, k_scale)
        v_store = reference.quantize_fp8(v_src, kv_dtype, v_scale)
    else:
        k_store = rnd(num_blocks, hkv, page, dim, dtype=kv_dtype)
        v_store = rnd(num_blocks, hkv, page, dim, dtype=kv_dtype)
    if case.layout == "bshd":  # storage [N, P, H, D], canonical view by permute (no copy)
        k_cache = k_store.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
        v_cache = v_store.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    else:
        k_cache, v_cache = k_store, v_store
    # the used blocks sit at the top of the cache (high ids exercise int64 offsets)
    perm = (torch.randperm(num_seqs * max_blocks, generator=gen, device=device)
            + (num_blocks - num_seqs * max_blocks))
    block_table = perm.reshape(num_seqs, max_blocks).to(dtype=torch.int32)
    cu = [0]
    for e in case.extend:
        cu.append(cu[-1] + e)
    cu_seqlens_q = torch.tensor(cu, dtype=torch.int32, device=device)
    seq_lens_k = torch.tensor(lens_k, dtype=torch.int32, device=device)
    total_q = cu[-1]
    if case.q_noncontig:
        q = rnd(hq, total_q, dim, dtype=case.dtype).permute(1, 0, 2)
    else:
        q = rnd(total_q, hq, dim, dtype=case.dtype)
    kw = dict(k_scale=k_scale, v_scale=v_scale, causal=case.causal,
              sliding_window=case.window, soft_cap=case.soft_cap, return_lse=case.lse)
    if case.k_new:
        kw["k_new"] = rnd(total_q, hkv, dim, dtype=case.dtype)
        kw["v_new"] = rnd(total_q, hkv, dim, dtype=case.dtype)
    if case.sinks:
        kw["sinks"] = rnd(hq, dtype=torch.float32) * 2
    args = (q, k_cache, v_cache, block_table, cu_seqlens_q, seq_lens_k)
    return args, kw


def run_case(case: Case, device, *, seed: int = 0, min_blocks: int = 0, impl: str = "triton",
             inputs=None):
    """Run one case with ``impl``; assert within budget. Returns ``(max_err, budget)`` of
    the output. ``inputs``: ``(args, kw)`` as :func:`make_inputs` returns them, if made."""
    args, kw = inputs or make_inputs(case, device, seed=seed, min_blocks=min_blocks)
    q = args[0]
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=device)
    res = prefix_prefill_attention(*args, out=out, impl=impl, **kw)
    ref_kw = {k: v for k, v in kw.items() if k != "validate"}
    ref64 = reference.prefix_prefill_attention(*args, compute_dtype=torch.float64, **ref_kw)
    ref_lp = reference.prefix_prefill_attention(*args, compute_dtype=q.dtype, **ref_kw)
    if case.lse:
        res, lse = res
        ref64, ref_lse = ref64
        ref_lp, _ = ref_lp
        assert lse.dtype == torch.float32 and lse.shape == (q.shape[0], q.shape[1])
        finite = torch.isfinite(ref_lse)
        assert torch.equal(torch.isfinite(lse).cpu(), finite.cpu()), f"{case.name}: lse -inf rows"
        if finite.any():
            lse_err = (lse.double() - ref_lse.double())[finite].abs().max().item()
            assert lse_err < 2e-3, f"{case.name}: lse max abs error {lse_err:.3e}"
    assert res is out
    return assert_within_budget(out, ref64, ref_lp, what=case.name)


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_prefill_matches_reference(case, device):
    run_case(case, device)


def test_prefill_32_wide_head_on_the_gpu_tile(device, monkeypatch):
    """A 32-wide head on the 64-wide head tile a GPU takes (``ops._device.head_tile``; the
    interpreter keeps 32): the padded columns masked, the answer the reference's."""
    from hygon_attn_backend.ops.prefill import triton as prefill_triton

    assert _device.head_tile(32, device=torch.device("cuda")) == 64
    monkeypatch.setattr(prefill_triton, "head_tile", lambda width, device: 64)
    run_case(Case("d32_on_64", (21, 0, 5), (9, 17, 1), group=4, page=16, head_dim=32,
                  k_new=True), device)


@pytest.mark.parametrize("case", CPU_CASES[:3], ids=lambda c: c.name)
def test_prefill_fresh_inputs_second_seed(case, device):
    run_case(case, device, seed=1)


@gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_prefill_gpu_real_sizes(case):
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    run_case(case, torch.device("cuda"))


@gpu
def test_prefill_gpu_cache_over_2g_elements():
    """Used pages above element 2^31 of a bf16 cache (int64 offsets)."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    case = Case("g_big_cache", (3000, 50), (200, 300), group=4, kv_heads=8, page=16,
                head_dim=128, dtype=torch.bfloat16)
    per_block = case.kv_heads * case.page * case.head_dim
    run_case(case, torch.device("cuda"), min_blocks=(2**31) // per_block + 64)


@gpu
@pytest.mark.parametrize("tile,head_dim,group", [
    ("128,64,8,2", 128, 4), ("64,64,4,2", 128, 4), ("256,16,16,2", 128, 256),
    ("64,32,4,2", 256, 4), ("128,16,8,2", 256, 128)])
def test_prefill_gpu_hip_tiles(tile, head_dim, group, monkeypatch):
    """The tiles AMD/Hygon GPUs get (tuning.tile_config_hip), checked for numbers on
    the CUDA GPU (the kernel is the same source; the tiles are its constexprs): paged and
    dense keys, page 16 and 1, odd lengths."""
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    force_tile(monkeypatch, tile)
    kv = 1 if group > 64 else 2
    run_case(Case("hip_" + tile, (0, 333, 1000), (300, 17, 129), group=group, kv_heads=kv,
                  page=16, head_dim=head_dim, dtype=torch.bfloat16), torch.device("cuda"))
    run_case(Case("hip_knew_" + tile, (5, 200), (64, 77), group=group, kv_heads=kv, page=1,
                  head_dim=head_dim, dtype=torch.float16, k_new=True), torch.device("cuda"))


@pytest.mark.parametrize("tile", ["32,16,4,1", "64,32,4,1"])
def test_prefill_larger_tiles(tile, device, monkeypatch):
    """Several tokens per M tile (GQA rows packed) and several pages per N tile."""
    force_tile(monkeypatch, tile)
    run_case(Case("tile_" + tile, (0, 21, 40, 5), (17, 9, 1, 33), group=5, page=16), device)
    run_case(Case("tile_knew_" + tile, (0, 21, 40, 5), (17, 9, 1, 33), group=4, page=1,
                  k_new=True, causal=False), device)


def test_prefill_plan_reuse_and_tile_map(device):
    """The tile map covers each request's m-blocks exactly once (no rectangular grid),
    and a plan built once serves several calls."""
    case = CPU_CASES[4]
    args, kw = make_inputs(case, device)
    q, k_cache, _, _, cu, lens_k = args
    plan = plan_prefix_prefill(cu, lens_k, total_q=q.shape[0], num_q_heads=q.shape[1],
                               num_kv_heads=k_cache.shape[1], head_dim=q.shape[2])
    tok_m = plan.block_m // plan.group
    req = plan.tile_req.cpu().tolist()
    mblk = plan.tile_mblock.cpu().tolist()
    pairs = sorted((r, m) for r, m in zip(req, mblk) if r >= 0)
    want = sorted((b, m) for b, e in enumerate(case.extend) for m in range(-(-e // tok_m)))
    assert pairs == want
    host = plan_prefix_prefill(cu, lens_k, total_q=q.shape[0], num_q_heads=q.shape[1],
                               num_kv_heads=k_cache.shape[1], head_dim=q.shape[2],
                               host_cu_seqlens_q=cu.cpu())
    assert torch.equal(host.tile_req, plan.tile_req)
    assert torch.equal(host.tile_mblock, plan.tile_mblock)
    assert host.tile_req.device == plan.tile_req.device
    ref = reference.prefix_prefill_attention(*args, compute_dtype=torch.float64, **kw)[0]
    for _ in range(2):
        out = prefix_prefill_attention(*args, plan=plan, impl="triton", **kw)[0]
        assert (out.double().cpu() - ref.cpu()).abs().max().item() < 1e-2


@pytest.mark.parametrize("lens,tok_m", [((), 8), ((0,), 8), ((5, 0, 33, 1), 8),
                                         ((4096,) * 3, 32), ((1,) * 40 + (700,), 1)])
def test_prefill_host_tile_map_equals_device(lens, tok_m):
    """The host tile map (array slices) equals the device one (tensor ops), empty requests
    and thousands of tiles included, and is a ``[2, max_tiles]`` int32 tensor."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    max_tiles = -(-cu[-1] // tok_m) + len(lens)
    host = prefill_plan.tile_map_host(cu, tok_m, max_tiles)
    req, mblock = prefill_plan.tile_map(torch.tensor(cu), len(lens), tok_m, max_tiles)
    assert host.dtype == torch.int32 and host.shape == (2, max_tiles)
    assert torch.equal(host[0], req) and torch.equal(host[1], mblock)
    assert int((host[0] >= 0).sum()) == sum(-(-n // tok_m) for n in lens)


def test_prefill_tile_config_pinned():
    nv = functools.partial(tuning.tile_config, is_hip=False)
    assert nv(head_dim_pad=128, group=4, total_q=8192, num_kv_heads=8) == (256, 64, 16, 3)
    assert nv(head_dim_pad=128, group=4, total_q=4096, num_kv_heads=8,
              num_seqs=32) == (256, 64, 16, 3)
    assert nv(head_dim_pad=128, group=4, total_q=256, num_kv_heads=8,
              num_seqs=2) == (64, 64, 4, 3)
    assert nv(head_dim_pad=256, group=4, total_q=8192, num_kv_heads=8) == (64, 64, 4, 2)
    assert tuning.tile_config(head_dim_pad=128, group=16, total_q=8, num_kv_heads=1,
                                      interpreter=True)[0] == 16
    cu, lens = torch.tensor([0, 8]), torch.tensor([8])
    plan = plan_prefix_prefill(cu, lens, total_q=8, num_q_heads=8, num_kv_heads=2,
                               head_dim=64, tile=(64, 32, 4, 2), impl="triton")
    assert (plan.block_m, plan.block_n, plan.num_warps, plan.num_stages) == (64, 32, 4, 2)
    with pytest.raises(ValueError, match="BLOCK_M"):
        plan_prefix_prefill(cu, lens, total_q=8, num_q_heads=8, num_kv_heads=1, head_dim=64,
                            tile=(4, 32, 4, 2), impl="triton")


def test_prefill_tile_config_hip():
    """On HIP the tiles that fit 64 KB of LDS without spills (tuning.tile_config_hip;
    tests/test_hip_tiles.py compiles each for gfx90a): 128 x 64 / 8 warps when the
    programs fill the GPU, else 64 x 64 / 4 warps; D=256 64 x 32; groups past 128 rows
    256 x 16 / 16 warps; what cannot fit is refused with the group named."""
    hip = functools.partial(tuning.tile_config, is_hip=True, num_sms=64)
    assert hip(head_dim_pad=128, group=4, total_q=8192, num_kv_heads=8) == (128, 64, 8, 2)
    assert hip(head_dim_pad=128, group=4, total_q=64, num_kv_heads=8) == (64, 64, 4, 2)
    assert hip(head_dim_pad=64, group=1, total_q=8192, num_kv_heads=32) == (128, 64, 8, 2)
    assert hip(head_dim_pad=128, group=128, total_q=8, num_kv_heads=1) == (128, 64, 8, 2)
    assert hip(head_dim_pad=128, group=256, total_q=8, num_kv_heads=1) == (256, 16, 16, 2)
    assert hip(head_dim_pad=256, group=4, total_q=8192, num_kv_heads=8) == (64, 32, 4, 2)
    assert hip(head_dim_pad=256, group=128, total_q=8, num_kv_heads=1) == (128, 16, 8, 2)
    with pytest.raises(ValueError, match="group of 512"):
        hip(head_dim_pad=128, group=512, total_q=8, num_kv_heads=1)
    with pytest.raises(ValueError, match="group of 256 .* head_dim 256"):
        hip(head_dim_pad=256, group=256, total_q=8, num_kv_heads=1)
    # the interpreter's tiny tiles come first
    assert hip(head_dim_pad=128, group=4, total_q=8192, num_kv_heads=8,
               interpreter=True) == (16, 16, 4, 1)


def _bad(args, kw, **changes):
    args = list(args)
    names = ["q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "seq_lens_k"]
    for key, val in list(changes.items()):
        if key in names:
            args[names.index(key)] = val
            del changes[key]
    return args, {**kw, **changes}


def test_prefill_bad_inputs_name_the_argument(device):
    case = Case("bad", (4, 6), (3, 5), group=2, kv_heads=2, page=4, head_dim=16)
    args, kw = make_inputs(case, device)
    q, k_cache, v_cache, bt, cu, lens_k = args
    checks = [
        ("cu_seqlens_q", dict(cu_seqlens_q=torch.tensor([0, 5, 3], dtype=torch.int32,
                                                          device=device))),
        ("seq_lens_k", dict(seq_lens_k=torch.tensor([2, 11], dtype=torch.int32,
                                                     device=device))),
        ("heads", dict(q=torch.randn(q.shape[0], 3, q.shape[2], dtype=q.dtype,
                                     device=device))),
        ("k_cache", dict(k_cache=k_cache.to(torch.bfloat16), v_cache=v_cache.to(torch.bfloat16))),
        ("k_new", dict(k_new=torch.randn(q.shape[0], 2, q.shape[2], dtype=q.dtype,
                                         device=device))),
        ("v_new", dict(k_new=torch.randn(q.shape[0], 2, q.shape[2], dtype=q.dtype, device=device),
                       v_new=torch.randn(q.shape[0], 2, q.shape[2], dtype=torch.float32,
                                         device=device))),
        ("block_table", dict(block_table=bt[:1])),
        ("q", dict(q=q.float())),
    ]
    for name, change in checks:
        a, k = _bad(args, kw, **change)
        with pytest.raises(ValueError, match=name):
            prefix_prefill_attention(*a, impl="triton", **k)


def test_prefill_reference_impl_matches_oracle(device):
    case = CPU_CASES[1]
    args, kw = make_inputs(case, device)
    out, _ = prefix_prefill_attention(*args, impl="reference", **kw)
    ref, _ = reference.prefix_prefill_attention(*args, compute_dtype=torch.float64, **kw)
    assert out.dtype == args[0].dtype
    assert (out.double().cpu() - ref.cpu()).abs().max().item() < 5e-3
    assert math.isfinite(out.float().abs().sum().item())


def test_two_walks_rule():
    """tuning.two_walks: only where the tile spans pages and the 16-warp tile at
    head_dim 128 is register-serialized anyway."""
    kw = dict(head_dim_pad=128, block_n=64, num_warps=16)
    assert tuning.two_walks(page_size=16, **kw)
    assert tuning.two_walks(page_size=1, **kw)
    assert not tuning.two_walks(page_size=64, **kw)  # one page a tile
    assert not tuning.two_walks(page_size=16, head_dim_pad=64, block_n=64,
                                        num_warps=16)
    assert not tuning.two_walks(page_size=16, head_dim_pad=128, block_n=64,
                                        num_warps=8)

