"""The SGLang backend's start-up prefill warm-up (integrations/sglang/warmup.py): which
specializations it enumerates, that it launches each one, and that the backend hands it
the model's attention layers. On a GPU the last test checks that an extend after the
warm-up compiles nothing."""

import itertools

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.radix_cache")

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from tests.support.sglang_harness import Server, TinyModel  # noqa: E402
from hygon_attn_backend.ops.prefill import tuning  # noqa: E402
from hygon_attn_backend.integrations.sglang import warmup  # noqa: E402
from hygon_attn_backend.integrations.sglang.backend import HygonAttnBackend  # noqa: E402


def _brute_force_tiles(*, hq, hkv, d, num_sms, max_seqs, max_tokens):
    group = hq // hkv
    found = set()
    for num_seqs in range(1, max_seqs + 1):
        for total_q in range(num_seqs, max_tokens + 1):
            found.add(tuning.tile_config(
                head_dim_pad=max(16, 1 << (d - 1).bit_length()), group=group, total_q=total_q,
                num_kv_heads=hkv, num_seqs=num_seqs, num_sms=num_sms))
    return found


@pytest.mark.parametrize("hq,hkv,d,num_sms", [(8, 8, 64, 16), (16, 4, 64, 20),
                                              (64, 1, 128, 24), (6, 2, 128, 12),
                                              (8, 2, 256, 16)])
def test_tile_configs_are_every_config_the_rule_returns(hq, hkv, d, num_sms):
    got = warmup.prefill_tile_configs(num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                      num_sms=num_sms)
    assert len(got) == len(set(got))
    # a search well past the function's own bounds finds nothing more
    assert set(got) == _brute_force_tiles(hq=hq, hkv=hkv, d=d, num_sms=num_sms,
                                          max_seqs=2 * num_sms, max_tokens=1500)


def test_tile_configs_h200_layouts(monkeypatch):
    for hq, hkv in ((32, 8), (16, 4)):
        got = warmup.prefill_tile_configs(num_q_heads=hq, num_kv_heads=hkv, head_dim=128,
                                          num_sms=132)
        assert {t[0] for t in got} == {64, 128, 256}
    monkeypatch.setattr(tuning, "tile_config", lambda **kw: (128, 64, 8, 2))
    assert warmup.prefill_tile_configs(num_q_heads=32, num_kv_heads=8, head_dim=128,
                                       num_sms=132) == [(128, 64, 8, 2)]


def test_table_widths_cover_every_aligned_width():
    for max_blocks in (1, 5, 16, 17, 2048, 2049, 4096 + 3):
        widths = warmup.table_widths(max_blocks)
        classes = {("1" if w == 1 else "D" if w % 16 == 0 else "") for w in widths}
        seen = set()
        for n in range(1, max_blocks + 1):
            w = warmup.aligned_table_width(n, max_blocks)
            assert n <= w <= max_blocks
            seen.add("1" if w == 1 else "D" if w % 16 == 0 else "")
        assert seen == classes and len(widths) == len(classes)


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, plan, **kw):
        self.calls.append((plan, kw))


def _server(page_size=16, **model_kw):
    model = TinyModel(num_heads=8, num_kv_heads=2, head_dim=32, dtype=torch.float16,
                      **model_kw)
    return Server(model, page_size=page_size, max_context=256)


def test_warm_up_launches_every_specialization():
    srv = _server()
    st = srv.backend._layer(srv.layer, None)
    rec = _Recorder()
    done = warmup.warm_up_prefill([st, st], q_dtype=torch.float16, page_size=16,
                                  max_blocks=srv.backend.max_blocks, device=torch.device("cpu"),
                                  num_sms=132, impl="reference", run=rec)
    tiles = warmup.prefill_tile_configs(num_q_heads=8, num_kv_heads=2, head_dim=32, num_sms=132)
    widths = warmup.table_widths(srv.backend.max_blocks)
    # the same layer twice is one variant: tiles x (with, without new K/V) x widths
    expected = set(itertools.product(tiles, (True, False), widths))
    assert {(t, h, w) for t, h, w, _ in done} == expected
    assert len(rec.calls) == len(done) == len(expected)
    for plan, kw in rec.calls:
        assert (plan.block_m, plan.block_n, plan.num_warps, plan.num_stages) in tiles
        assert kw["k_cache"] is st.k_view and kw["block_table"].shape[1] in widths
        assert kw["q"].shape == (1, 8, 32) and kw["q"].stride() == (8 * 32, 32, 1)
    assert {kw["k_new"] is None for _, kw in rec.calls} == {True, False}


def test_warm_up_separates_layer_options():
    srv = _server(page_size=1)
    plain = srv.backend._layer(srv.layer, None)
    windowed = type(plain)(**{**plain.__dict__, "sliding_window": 8})
    rec = _Recorder()
    done = warmup.warm_up_prefill([plain, windowed, plain], q_dtype=torch.float16, page_size=1,
                                  max_blocks=srv.backend.max_blocks, device=torch.device("cpu"),
                                  num_sms=16, impl="reference", run=rec)
    assert {opts[4] for *_, opts in done} == {None, 8}
    assert {kw["sliding_window"] for _, kw in rec.calls} == {None, 8}


def test_warm_up_runs_the_kernel_on_dummy_data():
    """The default ``run`` launches the plan (the reference here: the CPU) and writes the
    output rows, reading only the pool's padding block."""
    srv = _server()
    st = srv.backend._layer(srv.layer, None)
    outs = []

    def run(plan, **kw):
        kw["out"].fill_(float("nan"))
        plan.run(**kw)
        outs.append(kw["out"].clone())

    warmup.warm_up_prefill([st], q_dtype=torch.float16, page_size=16, max_blocks=16,
                           device=torch.device("cpu"), num_sms=132, impl="reference", run=run)
    assert outs and all(torch.isfinite(o).all() for o in outs)


def test_backend_hands_the_models_attention_layers_to_the_warm_up(monkeypatch):
    srv = _server()
    seen = {}

    def fake(states, **kw):
        seen["layers"] = [s.layer for s in states]
        seen.update(kw)
        return []

    monkeypatch.setattr(warmup, "warm_up_prefill", fake)
    backend = srv.backend
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ModuleList([srv.layer]))
    backend._warm_up_prefill(model, torch.float16)
    assert seen["layers"] == [srv.layer]
    assert seen["max_blocks"] == backend.max_blocks and seen["page_size"] == 16
    seen.clear()
    backend._warm_up_prefill(model, torch.float32)  # the reference serves fp32: no warm-up
    assert not seen


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU path of SGLang's pools: on a "
                    "CUDA host its store and allocator kernels refuse CPU tensors (no "
                    "interpreter there); test_no_prefill_compile_after_warm_up covers the GPU")
def test_metadata_table_width_is_aligned():
    srv = _server()
    req = srv.start(list(range(1, 40)))
    srv.extend([req])
    meta = srv.backend.forward_metadata
    assert meta.block_table.shape[1] == warmup.aligned_table_width(3, srv.backend.max_blocks)
    assert meta.block_table.shape[1] in warmup.table_widths(srv.backend.max_blocks) or \
        meta.block_table.shape[1] % 16 == 0


@pytest.mark.gpu
def test_no_prefill_compile_after_warm_up():
    """On a GPU: after the backend's warm-up, extends of new shapes load no new
    prefix_prefill_kernel specialization."""
    import triton

    model = TinyModel(num_heads=8, num_kv_heads=2, head_dim=32, dtype=torch.float16,
                      device="cuda")
    srv = Server(model, page_size=16, max_context=256)
    backend = srv.backend
    backend._warm_up_prefill(torch.nn.ModuleList([srv.layer]), torch.float16)
    loads = []
    hook = triton.knobs.runtime.kernel_load_start_hook

    def on_load(module, function, name, metadata_group, hash):
        loads.append(name)

    hook.add(on_load)
    try:
        for n in (3, 40, 130):
            req = srv.start(list(range(1, n + 1)))
            srv.extend([req], mode=ForwardMode.EXTEND)
            srv.finish(req)
    finally:
        hook.remove(on_load)
    assert not [n for n in loads if "prefix_prefill" in n], loads
    assert isinstance(backend, HygonAttnBackend)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU form of the GPU test above: "
                    "Triton's specialization keys read from the interpreter's launches")
def test_warm_up_keys_cover_real_extends_on_cpu(monkeypatch):
    """Every prefix_prefill_kernel launch of real extends (3, 40 and 130 new tokens) has
    the specialization key of a warm-up launch: Triton's own argument specialization
    (pointer alignment, ``== 1`` / ``% 16`` integers, constexprs, launch options), with
    the tiles the GPU rule picks (the interpreter's own small tile is patched out)."""
    from triton.runtime.interpreter import InterpretedFunction

    from hygon_attn_backend.tools.fuzz.speckeys import launch_key

    rule = tuning.tile_config
    monkeypatch.setattr(tuning, "tile_config",
                        lambda **kw: rule(**dict(kw, interpreter=False)))
    keys = []
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        if self.fn.__name__ == "prefix_prefill_kernel":
            keys.append(launch_key(self.fn, args, kwargs, do_not_specialize=self.kwargs.get(
                "do_not_specialize") or ()))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    model = TinyModel(num_heads=8, num_kv_heads=2, head_dim=32, dtype=torch.float16,
                      device="cpu")
    srv = Server(model, page_size=16, max_context=256)
    backend = srv.backend
    warmup.warm_up_prefill([backend._layer(srv.layer, {})], q_dtype=torch.float16,
                           page_size=16, max_blocks=backend.max_blocks,
                           device=torch.device("cpu"), num_sms=132)
    warmed = set(keys)
    keys.clear()
    for n in (3, 40, 130):
        req = srv.start(list(range(1, n + 1)))
        srv.extend([req], mode=ForwardMode.EXTEND)
        srv.finish(req)
    assert len(keys) == 3
    assert not [k for k in keys if k not in warmed]
