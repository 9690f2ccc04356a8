"""ops/_launch.py: a planned launch fixes the batch-level arguments once; per layer it
takes Triton's path on a new argument signature and the compiled kernel directly after."""

import pytest
import torch

from tests.support.budget import assert_within_budget
from hygon_attn_backend import layouts, reference
from hygon_attn_backend.kernels.decode import paged_decode_kernel
from hygon_attn_backend.ops._launch import NO_LAYER, LayerArgs, Launch
from hygon_attn_backend.ops.decode import plan_paged_decode


def test_launch_rejects_missing_and_unknown_arguments():
    with pytest.raises(TypeError, match="missing .*'seq_lens_ptr'"):
        Launch(paged_decode_kernel, (1, 1, 1), {}, ["out_ptr"], num_warps=4, num_stages=1)
    names = list(paged_decode_kernel.arg_names)
    with pytest.raises(TypeError, match="unknown .*'not_an_arg'"):
        Launch(paged_decode_kernel, (1, 1, 1), {n: 0 for n in names},
               ["not_an_arg"], num_warps=4, num_stages=1)


def _problem(device, dtype, seed, num_seqs=6, page=16, hq=8, hkv=2, d=64):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 200, (num_seqs,), generator=g)
    blocks = -(-int(lens.max()) // page)
    n_blocks = num_seqs * blocks + 3
    k, v = (layouts.allocate("bshd", num_blocks=n_blocks, block_size=page, num_kv_heads=hkv,
                             head_dim=d, dtype=dtype, device=device) for _ in range(2))
    k_view, v_view = layouts.view(k, "bshd"), layouts.view(v, "bshd")
    table = torch.randperm(n_blocks, generator=g)[:num_seqs * blocks].view(num_seqs, blocks)
    return (k_view, v_view, table.to(device=device, dtype=torch.int32),
            lens.to(device=device, dtype=torch.int32))


def test_plan_reused_across_layers_matches_reference(device):
    """One plan, three "layers" (different caches and queries, same shapes): each equals
    the reference; after the first, calls take the direct path on a GPU."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    _, _, table, lens = _problem(device, dtype, 0)
    plan = plan_paged_decode(table, lens, num_q_heads=8, num_kv_heads=2, head_dim=64,
                             page_size=16, q_dtype=dtype, kv_dtype=dtype, partition_size=64,
                             fused_combine=False)
    assert plan.split and plan.num_launches == 2  # decode + combine kernel
    for layer in range(3):
        k, v, _, _ = _problem(device, dtype, 0)  # same table/lens, fresh cache contents
        k.normal_(), v.normal_()
        q = torch.randn(6, 8, 64, device=device, dtype=dtype)
        out = plan.run(q, k, v, out=torch.full_like(q, float("nan")))
        ref64 = reference.paged_decode_attention(q, k, v, table, lens,
                                                 compute_dtype=torch.float64)
        ref_lowp = reference.paged_decode_attention(q, k, v, table, lens, compute_dtype=dtype)
        assert_within_budget(out, ref64, ref_lowp, what=f"layer {layer}")
    decode, combine = next(iter(plan._variants.values()))
    if device.type == "cuda":
        assert decode.num_direct_signatures == 1 and combine.num_direct_signatures == 1
    else:  # the interpreter always takes Triton's path
        assert decode.num_direct_signatures == 0


@pytest.mark.gpu
def test_direct_launch_skips_tritons_path():
    """After the first call, a layer's launch never enters JITFunction.run."""
    device = torch.device("cuda")
    k, v, table, lens = _problem(device, torch.float16, 1)
    plan = plan_paged_decode(table, lens, num_q_heads=8, num_kv_heads=2, head_dim=64,
                             page_size=16, q_dtype=torch.float16, kv_dtype=torch.float16,
                             partition_size=1 << 20)
    q = torch.randn(6, 8, 64, device=device, dtype=torch.float16)
    first = plan.run(q, k, v).clone()
    real_run = paged_decode_kernel.run
    paged_decode_kernel.run = None  # any call through Triton's path would fail
    try:
        second = plan.run(q, k, v)
    finally:
        paged_decode_kernel.run = real_run
    torch.cuda.synchronize()
    assert torch.equal(first, second)


def test_signature_tells_apart_alignment_dtype_and_scalars():
    names = list(paged_decode_kernel.arg_names)
    per_call = ("out_ptr", "q_ptr", "num_blocks")
    launch = Launch(paged_decode_kernel, (1, 1, 1),
                    {n: 0 for n in names if n not in per_call}, per_call,
                    num_warps=4, num_stages=1)
    buf = torch.zeros(64, dtype=torch.float16)
    base = launch.signature(NO_LAYER, (buf, buf, 7))
    assert launch.signature(NO_LAYER, (buf[8:], buf, 7)) == base  # 16 bytes further
    assert launch.signature(NO_LAYER, (buf[1:], buf, 7)) != base  # 2 bytes off: unaligned
    assert launch.signature(NO_LAYER, (buf, buf.view(torch.bfloat16), 7)) != base
    assert launch.signature(NO_LAYER, (buf, buf, 8)) != base
    for order in (("num_blocks", "out_ptr", "q_ptr"), ):
        with pytest.raises(TypeError, match="tensors"):
            Launch(paged_decode_kernel, (1, 1, 1), {n: 0 for n in names if n not in order},
                   order, num_warps=4, num_stages=1)
    with pytest.raises(TypeError, match="tensors"):  # the layer's part likewise
        Launch(paged_decode_kernel, (1, 1, 1),
               {n: 0 for n in names if n not in ("k_ptr", "num_blocks")}, (),
               per_layer=("num_blocks", "k_ptr"), num_warps=4, num_stages=1)


def test_layer_args_signature_read_once_and_told_apart():
    """A layer's part of the signature is one int, equal for equal layers (alignment class,
    dtypes, scalar values) and different when any of them differs."""
    buf = torch.zeros(64, dtype=torch.float16)
    base = LayerArgs((buf, buf), (3, 1.0))
    assert LayerArgs((buf[8:], buf), (3, 1.0)).sig == base.sig
    assert base.ints == (buf.data_ptr(), buf.data_ptr(), 3, 1.0)
    assert base.values[0] is buf
    for other in (LayerArgs((buf[1:], buf), (3, 1.0)),
                  LayerArgs((buf, buf.view(torch.bfloat16)), (3, 1.0)),
                  LayerArgs((buf, buf), (4, 1.0)), LayerArgs((buf, buf), (3, 2.0))):
        assert other.sig != base.sig
    names = list(paged_decode_kernel.arg_names)
    per_layer, per_call = ("k_ptr", "num_blocks"), ("out_ptr", "q_ptr")
    launch = Launch(paged_decode_kernel, (1, 1, 1),
                    {n: 0 for n in names if n not in per_layer + per_call}, per_call,
                    per_layer=per_layer, num_warps=4, num_stages=1)
    with pytest.raises(TypeError, match="expected 2 layer and 2 call arguments"):
        launch(base, buf, buf)  # four layer values where the launch takes two


def test_direct_launch_passes_integer_pointers_and_falls_back_to_tensors(monkeypatch):
    """The direct path hands the launcher every pointer (the call's, the layer's and the
    batch-level ones) as an integer address; a launcher that refuses integers gets tensors
    from then on."""
    from hygon_attn_backend.ops import _launch

    names = list(paged_decode_kernel.arg_names)
    per_layer, per_call = ("k_ptr", "stride_k_block"), ("out_ptr", "q_ptr", "num_blocks")
    table = torch.arange(8, dtype=torch.int32)
    fixed = {n: 0 for n in names if n not in per_call + per_layer}
    fixed["block_table_ptr"] = table
    launch = Launch(paged_decode_kernel, (2, 1, 1), fixed, per_call, per_layer=per_layer,
                    num_warps=4, num_stages=1)
    out, q = torch.zeros(16, dtype=torch.float16), torch.ones(16, dtype=torch.float16)
    k = torch.zeros(32, dtype=torch.float16)
    layer = LayerArgs((k,), (77,))
    seen = []

    def fake_run(*args, refuse_ints=False):
        kernel_args = list(args[9:])  # grid (3), stream, function, metadata, 3 hooks
        if refuse_ints and isinstance(kernel_args[names.index("q_ptr")], int):
            raise TypeError("Pointer argument must be either uint64 or have data_ptr")
        seen.append(kernel_args)

    monkeypatch.setattr(_launch, "_no_hooks", lambda: True)
    monkeypatch.setattr(_launch, "_stream_of", lambda device: 0)
    launch._compiled[launch.signature(layer, (out, q, 5))] = (fake_run, "fn", "meta", 0)
    launch(layer, out, q, 5)
    args = seen[-1]
    assert args[names.index("out_ptr")] == out.data_ptr()
    assert args[names.index("q_ptr")] == q.data_ptr()
    assert args[names.index("k_ptr")] == k.data_ptr()
    assert args[names.index("stride_k_block")] == 77
    assert args[names.index("block_table_ptr")] == table.data_ptr()
    assert args[names.index("num_blocks")] == 5
    assert all(not isinstance(a, torch.Tensor) for a in args)

    launch._compiled[launch.signature(layer, (out, q, 5))] = (
        lambda *a: fake_run(*a, refuse_ints=True), "fn", "meta", 0)
    launch(layer, out, q, 5)
    args = seen[-1]
    assert args[names.index("q_ptr")] is q and args[names.index("block_table_ptr")] is table
    assert args[names.index("k_ptr")] is k
    assert launch._int_pointers is False
    launch(layer, out, q, 5)  # stays on tensors
    assert seen[-1][names.index("out_ptr")] is out and len(seen) == 3


def test_layer_binding_serves_every_step_and_equals_run(device):
    """A ``DecodeLayer`` / ``PrefillLayer`` built once gives the same output as ``run``
    with the same options, under two different plans (two steps of an engine)."""
    from hygon_attn_backend.ops.decode import DecodeLayer
    from hygon_attn_backend.ops.prefill import PrefillLayer, plan_prefix_prefill

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    k, v, table, lens = _problem(device, dtype, 3)
    layer = DecodeLayer(k, v, scale=0.11, soft_cap=20.0)
    for partition in (64, 1 << 20):  # a split step, then an unsplit one
        plan = plan_paged_decode(table, lens, num_q_heads=8, num_kv_heads=2, head_dim=64,
                                 page_size=16, q_dtype=dtype, kv_dtype=dtype,
                                 partition_size=partition)
        q = torch.randn(6, 8, 64, device=device, dtype=dtype)
        bound = plan.run_layer(layer, q)
        plain = plan.run(q, k, v, scale=0.11, soft_cap=20.0)
        assert torch.equal(bound, plain)
        ref64 = reference.paged_decode_attention(q, k, v, table, lens, scale=0.11,
                                                 soft_cap=20.0, compute_dtype=torch.float64)
        ref_lp = reference.paged_decode_attention(q, k, v, table, lens, scale=0.11,
                                                  soft_cap=20.0, compute_dtype=dtype)
        assert_within_budget(bound, ref64, ref_lp, what=f"partition {partition}")

    player = PrefillLayer(k, v, scale=0.11, causal=True)
    lens_k = torch.tensor([40, 17], dtype=torch.int32, device=device)
    for new in ((5, 3), (9, 1)):
        cu = torch.tensor([0, new[0], new[0] + new[1]], dtype=torch.int32, device=device)
        plan = plan_prefix_prefill(cu, lens_k, total_q=sum(new), num_q_heads=8,
                                   num_kv_heads=2, head_dim=64, q_dtype=dtype)
        q = torch.randn(sum(new), 8, 64, device=device, dtype=dtype)
        bound = plan.run_layer(player, q, table[:2], cu, lens_k)
        plain = plan.run(q, k, v, table[:2], cu, lens_k, scale=0.11, causal=True)
        assert torch.equal(bound, plain)
        ref64 = reference.prefix_prefill_attention(q, k, v, table[:2], cu, lens_k, scale=0.11,
                                                   compute_dtype=torch.float64)
        ref_lp = reference.prefix_prefill_attention(q, k, v, table[:2], cu, lens_k,
                                                    scale=0.11, compute_dtype=dtype)
        assert_within_budget(bound, ref64, ref_lp, what=f"extend {new}")


def test_vllm_layer_keeps_its_binding_until_the_cache_changes():
    from hygon_attn_backend.integrations.vllm import step as _core

    spec = _core.LayerSpec(num_heads=8, num_kv_heads=2, head_size=64, scale=0.125)
    kv = torch.zeros(4, 16, 2, 128, dtype=torch.float16)
    first = spec.decode_layer(kv, None, None)
    assert spec.decode_layer(kv, None, None) is first
    assert spec.prefill_layer(kv, None, None, True) is spec.prefill_layer(kv, None, None, True)
    assert spec.prefill_layer(kv, None, None, False).causal is False
    other = torch.zeros_like(kv)  # a reallocated cache: a new binding over its views
    rebuilt = spec.decode_layer(other, None, None)
    assert rebuilt is not first and rebuilt.k_cache.data_ptr() == other.data_ptr()


def test_forwarding_function_generated_once_per_layout():
    """Two launches with the same argument layout (two steps' plans) share one generated
    binder; each forwards its own grid and batch-level values in the kernel's order."""
    from hygon_attn_backend.ops import _launch

    names = list(paged_decode_kernel.arg_names)
    per_call = ("out_ptr", "q_ptr", "num_blocks")
    calls = []
    fake_run = lambda *a: calls.append(a)  # noqa: E731
    launches = []
    for step in (1, 2):
        fixed = {n: (step if n == "num_partitions" else 0) for n in names
                 if n not in per_call}
        launches.append(Launch(paged_decode_kernel, (step, 1, 1), fixed, per_call,
                               num_warps=4, num_stages=1))
    layout = (len(names), (), tuple(names.index(n) for n in per_call))
    assert layout in _launch._BINDERS
    for step, launch in enumerate(launches, 1):
        launch._forward(fake_run, "stream", "fn", "meta", (), 111, 222, 5)
        args = calls[-1]
        assert args[:9] == (step, 1, 1, "stream", "fn", "meta", None, None, None)
        kernel_args = args[9:]
        assert kernel_args[names.index("out_ptr")] == 111
        assert kernel_args[names.index("q_ptr")] == 222
        assert kernel_args[names.index("num_blocks")] == 5
        assert kernel_args[names.index("num_partitions")] == step


def test_run_keeps_one_binding_per_cache_and_options(device):
    """``plan.run`` resolves a layer's side once per (caches, options) and reuses it: the
    same caches and options find it again, a new scale or cache gets its own, and the
    reused binding gives the same output."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    k, v, table, lens = _problem(device, dtype, 4)
    plan = plan_paged_decode(table, lens, num_q_heads=8, num_kv_heads=2, head_dim=64,
                             page_size=16, q_dtype=dtype, kv_dtype=dtype)
    q = torch.randn(6, 8, 64, device=device, dtype=dtype)
    first = plan.run(q, k, v, scale=0.125).clone()
    assert torch.equal(plan.run(q, k, v, scale=0.125), first) and len(plan._layers) == 1
    other = plan.run(q, k, v, scale=0.25)
    assert len(plan._layers) == 2 and not torch.equal(other, first)
    k2, v2 = k.clone(), v.clone()
    k2.mul_(2)  # a different cache: its own binding, read from its own memory
    doubled = plan.run(q, k2, v2, scale=0.125)
    assert len(plan._layers) == 3 and torch.equal(doubled, plan.run(q, k, v, scale=0.25))
