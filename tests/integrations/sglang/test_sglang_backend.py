"""HygonAttnBackend features on SGLang's pools: the HND pool, fp8 KV with scales, sliding
window / soft cap / sinks, the CUDA-graph hooks (real capture and replay on a GPU, the same
hooks eagerly on CPU), and the modes it refuses.

The oracle is a full recompute (tests/support/sglang_harness.py); budgets are a small multiple of
that recompute's own error in the model dtype.
"""

import random
import types

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.radix_cache")

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from tests.support.budget import assert_within_budget  # noqa: E402
from tests.support.sglang_harness import Server, TinyModel  # noqa: E402

HEADS = dict(num_heads=8, num_kv_heads=2, head_dim=32)  # GQA group 4


def _tokens(rng, n):
    return [rng.randrange(1, 1000) for _ in range(n)]


def _check(srv, req, out, positions, what, kv_transform=None, mult=4.0):
    model = srv.model
    upto = req.tokens[: max(positions) + 1]
    ref64 = model.oracle(upto, positions, dtype=torch.float64, kv_transform=kv_transform)
    ref_lowp = model.oracle(upto, positions, dtype=model.dtype, kv_transform=kv_transform)
    assert_within_budget(out, ref64, ref_lowp, what=what, mult=mult)


def _chat(srv, rng, *, kv_transform_for=None):
    """Turn 1 (prefill + 2 decodes), then turn 2 extending over turn 1's cached prefix;
    checks every output. ``kv_transform_for(cached_len)`` gives the oracle's K/V rounding
    for a pass whose first ``cached_len`` positions are read from the cache."""
    tf = kv_transform_for or (lambda n: None)
    n1 = 29 if srv.page_size <= 16 else 29 + srv.page_size  # turn 1 ends mid-page
    t1 = srv.start(_tokens(rng, n1))
    (out,) = srv.extend([t1])
    _check(srv, t1, out, list(range(n1)), "turn 1 prefill", tf(0))
    for _ in range(2):
        (out,) = srv.decode([t1], [rng.randrange(1, 1000)])
        _check(srv, t1, out, [t1.kv_len - 1], "turn 1 decode", tf(t1.kv_len))
    history = list(t1.tokens)
    srv.finish(t1)
    t2 = srv.start(history + _tokens(rng, 13))
    assert t2.cached_len == len(history) // srv.page_size * srv.page_size > 0
    (out,) = srv.extend([t2])
    _check(srv, t2, out, list(range(t2.cached_len, len(t2.tokens))), "turn 2 over the cache",
           tf(t2.cached_len))
    srv.finish(t2)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_hnd_pool(page_size, monkeypatch, device):
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if "kv_cache_layout" not in MHATokenToKVPool.__init__.__code__.co_varnames:
        pytest.skip("this SGLang has no HND pool (0.5.10)")
    srv = Server(TinyModel(dtype=torch.float16, seed=11, device=device, **HEADS),
                 page_size=page_size, seed=11)
    assert srv.pool.kv_cache_layout == "hnd"
    _chat(srv, random.Random(11))


def _fp8_round(fp8_dtype, scale, num_cached):
    """SGLang's fp8 write (``k / scale`` in the model dtype, cast to fp8) and our read
    (``x * scale``), applied to the first ``num_cached`` positions."""

    def transform(k, v):
        def rnd(x):
            stored = (x / torch.tensor(scale, dtype=x.dtype, device=x.device)).to(fp8_dtype)
            return (stored.to(torch.float32) * scale).to(x.dtype)

        k, v = k.clone(), v.clone()
        k[:num_cached], v[:num_cached] = rnd(k[:num_cached]), rnd(v[:num_cached])
        return k, v

    return transform


@pytest.mark.parametrize("fp8_dtype, scale", [(torch.float8_e4m3fn, 0.5),
                                              (torch.float8_e5m2, None)], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fp8_kv_cache(fp8_dtype, scale, page_size, device, monkeypatch):
    """Also: turn 1's prefill (no prefix: nothing to dequantize) goes through the 16-bit
    workspace, turn 2's extend over its cached prefix does not (the rule)."""
    from hygon_attn_backend.integrations.sglang import backend as sgl_backend

    plans = []
    real = sgl_backend.plan_prefix_prefill
    monkeypatch.setattr(sgl_backend, "plan_prefix_prefill",
                        lambda *a, **kw: plans.append(real(*a, **kw)) or plans[-1])
    srv = Server(TinyModel(dtype=torch.float16, seed=12, device=device, **HEADS),
                 page_size=page_size, kv_dtype=fp8_dtype, k_scale=scale, seed=12)
    assert srv.pool.dtype == fp8_dtype
    _chat(srv, random.Random(12),
          kv_transform_for=lambda n: _fp8_round(fp8_dtype, 1.0 if scale is None else scale, n))
    pages = [None if p.workspace is None else p.workspace.num_pages for p in plans]
    assert pages == [0, None], pages


@pytest.mark.parametrize("option", ["window", "soft_cap", "sinks"])
def test_attention_options(option, device):
    model = TinyModel(dtype=torch.float16, seed=13, device=device, **HEADS)
    if option == "window":
        model.window = 9  # SGLang: a query at i sees keys i - 9 .. i
    elif option == "soft_cap":
        model.soft_cap = 5.0
    else:
        model.sinks = torch.randn(HEADS["num_heads"], generator=torch.Generator().manual_seed(3),
                                  dtype=torch.float32).to(device)
    srv = Server(model, page_size=16, seed=13)
    _chat(srv, random.Random(13))


def _graph_decode_steps(srv, rng, steps):
    """Three requests prefilled, then ``steps`` decodes through the graph hooks with a
    padded static batch of 4, each output checked; returns the requests."""
    reqs = [srv.start(_tokens(rng, n)) for n in (21, 40, 5)]
    srv.extend(reqs)
    state = {}
    for step in range(steps):
        outs = srv.decode_graph(reqs, [rng.randrange(1, 1000) for _ in reqs], graph_bs=4,
                                state=state)
        for r, out in zip(reqs, outs):
            _check(srv, r, out, [r.kv_len - 1], f"graph decode step {step}")
    return reqs


@pytest.mark.parametrize("page_size", [1, 16])
def test_cuda_graph_hooks_decode(page_size, device):
    """Decode through ``init_cuda_graph_state`` / ``init_forward_metadata_out_graph`` /
    ``init_forward_metadata_in_graph`` with a padded static batch, for several steps (on a
    GPU: captured once, replayed with new buffer contents)."""
    rng = random.Random(14)
    srv = Server(TinyModel(dtype=torch.float16, seed=14, device=device, **HEADS),
                 page_size=page_size, seed=14)
    reqs = _graph_decode_steps(srv, rng, 3)
    meta = srv.backend.forward_metadata
    assert meta.graph and meta.block_table.shape == (4, srv.backend.max_blocks)
    assert int(meta.seq_lens[3]) == srv.backend.get_cuda_graph_seq_len_fill_value()
    # replay metadata is built once per batch size: the same object and plans every step
    plans = {k: id(p) for k, p in meta.plans.items()}
    assert plans, "the graph steps planned their launches"
    again = types.SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=4)
    srv.backend.init_forward_metadata_out_graph(again)
    assert srv.backend.forward_metadata is meta
    assert {k: id(p) for k, p in meta.plans.items()} == plans
    # eager metadata of the same batch addresses the same blocks
    eager = srv.decode([reqs[0]], [3])
    _check(srv, reqs[0], eager[0], [reqs[0].kv_len - 1], "eager decode after graph steps")


def test_refuses_what_it_cannot_serve(device):
    srv = Server(TinyModel(dtype=torch.float16, seed=15, device=device, **HEADS), page_size=1)
    req = srv.start(_tokens(random.Random(15), 8))
    batch = srv._batch(ForwardMode.DLLM_EXTEND, [req], [8], torch.zeros(8, dtype=torch.int64,
                                                                       device=srv.device),
                       list(range(8)))
    with pytest.raises(NotImplementedError, match="dLLM"):
        srv.backend.init_forward_metadata(batch)
    srv.layer.is_cross_attention = True
    with pytest.raises(NotImplementedError, match="cross-attention"):
        srv.extend([req])


def test_model_heads_follow_the_attention_tp_size(monkeypatch):
    """The per-pass plans are built in init_forward_metadata from the model config's heads
    divided over this rank's attention-TP size (SGLang 0.5.23's runtime context)."""
    import types

    runtime_context = pytest.importorskip("sglang.srt.runtime_context")  # 0.5.17 on

    from hygon_attn_backend.integrations.sglang import backend as sgl_backend

    class Config:
        num_attention_heads, head_dim = 32, 128

        def get_num_kv_heads(self, tp, dcp=1):
            return max(1, 8 // tp)

    runner = types.SimpleNamespace(model_config=Config(), dtype=torch.bfloat16)
    monkeypatch.setattr(runtime_context, "get_parallel",
                        lambda: types.SimpleNamespace(attn_tp_size=2))
    assert sgl_backend._model_heads(runner) == (16, 4, 128, torch.bfloat16)
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: None)  # not initialised
    monkeypatch.setattr(sgl_backend, "_attention_tp_size", lambda: None)
    assert sgl_backend._model_heads(runner) is None
