"""The MLA backend behind ``--attention-backend hygon`` (vLLM 0.15 to 0.32): selection by
the one flag, the impl against a float64 MLA oracle through the installed vLLM's own MLA
metadata builder (decode, prefill, chunked context split over chunks, with a continuation
where the version has them), the prefill-backend slot; the model-level check is in
``test_vllm_mla_engine.py`` (with why its model takes vLLM's RoPE as plain torch, last).
``scripts/compat`` runs the oracle cases in every vLLM version of ``compat.MLA_RANGE``."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("vllm")

import hygon_attn_backend.integrations.vllm as hv  # noqa: E402
from hygon_attn_backend.integrations.vllm import compat, mla_select  # noqa: E402

if not mla_select.mla_available():
    pytest.skip(f"the MLA backend is written against vLLM "
                f"{compat.range_text(compat.MLA_RANGE)}", allow_module_level=True)

from tests.support import vllm_mla_harness as harness  # noqa: E402

DENSE_CLASS = "hygon_attn_backend.integrations.vllm.backend.HygonAttentionBackend"
MLA_CLASS = "hygon_attn_backend.integrations.vllm.mla.HygonMLABackend"
CPU_MLA_CLASS = "vllm.v1.attention.backends.mla.cpu_mla.CPUMLABackend"
AMX_MLA_CLASS = "vllm.v1.attention.backends.mla.amx_mla.AMXMLABackend"


def vllms_own_cpu_mla_class():
    """What vLLM's CPU platform picks for an MLA model when no backend is named: its AMX
    backend on an x86 host with AMX tiles, its reference CPU backend elsewhere."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import CpuArchEnum

    amx = (current_platform.get_cpu_architecture() == CpuArchEnum.X86
           and torch.cpu._is_amx_tile_supported())
    return AMX_MLA_CLASS if amx else CPU_MLA_CLASS


@pytest.fixture(scope="module")
def mla_dir(tmp_path_factory):
    return harness.deepseek_config_dir(tmp_path_factory.mktemp("deepseek_cfg"), harness.Dims())


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from tests.support.vllm_harness import llama_config_dir

    return llama_config_dir(tmp_path_factory.mktemp("llama_cfg"), 4, 2, 32)


def engine_config(model_dir, *cli):
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", model_dir, "--skip-tokenizer-init", "--dtype",
                              "float16", "--max-model-len", "256", *cli])
    return EngineArgs.from_cli_args(args).create_engine_config()


def selected_class(vllm_config, *, head_size, use_mla):
    from vllm.config import set_current_vllm_config
    from vllm.v1.attention.selector import get_attn_backend

    with set_current_vllm_config(vllm_config):
        # vLLM 0.15 takes block_size (a required positional there)
        cls = compat.call_with_supported(get_attn_backend, head_size=head_size,
                                         dtype=torch.float16, kv_cache_dtype="auto",
                                         use_mla=use_mla, block_size=16)
    return f"{cls.__module__}.{cls.__qualname__}"


# ----------------------------------------------------------------------------- selection

def test_one_flag_selects_mla_for_an_mla_model(mla_dir, llama_dir):
    """`--attention-backend hygon`: vLLM's selector returns our MLA class for the MLA
    model's layers, our dense class for a dense model."""
    hv.register()
    mla_cfg = engine_config(mla_dir, "--attention-backend", "hygon")
    assert mla_cfg.model_config.use_mla
    assert hv.is_selected(mla_cfg.attention_config.backend)
    assert selected_class(mla_cfg, head_size=576, use_mla=True) == MLA_CLASS
    dense_cfg = engine_config(llama_dir, "--attention-backend", "hygon")
    assert not dense_cfg.model_config.use_mla
    assert selected_class(dense_cfg, head_size=32, use_mla=False) == DENSE_CLASS


@pytest.mark.slow
def test_without_flag_an_mla_model_keeps_vllms_cpu_mla(mla_dir):
    """Without the flag vLLM answers as without the plugin: its CPU MLA backend, or on a
    CPU build that has none (0.25 and older) its own refusal."""
    import importlib.util

    hv.register()
    cfg = engine_config(mla_dir)
    if importlib.util.find_spec("vllm.v1.attention.backends.mla.cpu_mla") is None:
        with pytest.raises(NotImplementedError, match="MLA is not supported on CPU"):
            selected_class(cfg, head_size=576, use_mla=True)
        return
    chosen = selected_class(cfg, head_size=576, use_mla=True)
    assert chosen in (CPU_MLA_CLASS, AMX_MLA_CLASS)
    assert chosen == vllms_own_cpu_mla_class()


def test_backend_path_by_use_mla():
    from vllm.v1.attention.selector import AttentionSelectorConfig

    mla = AttentionSelectorConfig(head_size=576, dtype=torch.float16, kv_cache_dtype="auto",
                                  block_size=16, use_mla=True)
    dense = mla._replace(head_size=128, use_mla=False)
    assert mla_select.backend_path(mla) == MLA_CLASS
    assert mla_select.backend_path(dense) == DENSE_CLASS
    # a vLLM outside MLA_RANGE keeps the dense path (vLLM's validation then refuses it)
    assert mla_select.backend_path(mla, version="0.14.1") == DENSE_CLASS
    assert mla_select.backend_path(mla, version="0.15.1") == MLA_CLASS


def test_mla_class_refuses_what_it_cannot_serve():
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from hygon_attn_backend.integrations.vllm.mla import HygonMLABackend

    sel = AttentionSelectorConfig(head_size=576, dtype=torch.float16, kv_cache_dtype="auto",
                                  block_size=16, use_mla=True)
    assert HygonMLABackend.validate_configuration(device_capability=None,
                                                  **sel._asdict()) == []
    for fp8 in ("fp8", "fp8_e4m3"):  # vLLM's MLA layer views its byte cache as e4m3
        assert HygonMLABackend.validate_configuration(
            device_capability=None, **sel._replace(kv_cache_dtype=fp8)._asdict()) == []
    for bad, word in ((sel._replace(use_mla=False), "MLA"),
                      (sel._replace(use_sparse=True), "parse"),
                      (sel._replace(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype"),
                      (sel._replace(dtype=torch.float32), "dtype")):
        reasons = HygonMLABackend.validate_configuration(device_capability=None,
                                                         **bad._asdict())
        assert reasons and any(word in r for r in reasons), (bad, reasons)


def test_gpu_platform_wrapper_routes_only_our_mla_layers():
    """The wrapper installed on non-CPU platforms (ROCm/CUDA): our selection with use_mla
    gets the MLA class; a dense layer and other selections get the platform's answer."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E
    from vllm.v1.attention.selector import AttentionSelectorConfig

    class Base:
        @classmethod
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            return f"platform:{selected_backend}"

        @classmethod
        def get_device_capability(cls):
            return None

    class FakePlatform(Base):
        pass

    member = hv.register()
    sel = AttentionSelectorConfig(head_size=576, dtype=torch.float16, kv_cache_dtype="auto",
                                  block_size=64, use_mla=True)
    assert mla_select.install(hv.vllm_version(), FakePlatform)
    try:
        assert FakePlatform.get_attn_backend_cls(member, sel) == MLA_CLASS
        assert FakePlatform.get_attn_backend_cls(member, sel._replace(use_mla=False)) == \
            f"platform:{member}"
        assert FakePlatform.get_attn_backend_cls(E.TRITON_MLA, sel) == \
            f"platform:{E.TRITON_MLA}"
        with pytest.raises(ValueError, match="not valid"):
            FakePlatform.get_attn_backend_cls(member, sel._replace(dtype=torch.float32))
    finally:
        assert mla_select.uninstall(FakePlatform)
    assert "get_attn_backend_cls" not in FakePlatform.__dict__
    assert FakePlatform.get_attn_backend_cls(member, sel) == f"platform:{member}"


# ------------------------------------------------------------------ impl against oracle

IMPLS = [pytest.param("reference", id="reference"), pytest.param("triton", id="interpreter")]

CASES = harness.CASES


@pytest.fixture(params=IMPLS)
def impl(request, monkeypatch):
    if request.param == "triton" and os.environ.get("TRITON_INTERPRET") != "1" \
            and not torch.cuda.is_available():
        pytest.skip("the Triton interpreter needs TRITON_INTERPRET=1 set before import")
    monkeypatch.setenv("HYGON_ATTN_IMPL", request.param)
    return request.param


@pytest.mark.parametrize("name", list(CASES))
def test_impl_matches_mla_oracle(name, impl, mla_dir):
    ctx, ql, rows = CASES[name]
    case = harness.make_case(ctx, ql, seed=len(name))
    out, md = harness.run(case, mla_dir, workspace_rows=rows)
    ref = harness.oracle(case)
    if md.decode is not None:
        assert md.decode.plan.impl == impl  # the planned op is the one asked for
        assert md.decode.plan.scale == pytest.approx(case.scale)
    if rows is not None:
        chunks = md.context_chunks  # one form on every version (compat.mla_context_chunks)
        assert len(chunks) >= 2
        theirs = md.prefill.chunked_context
        if hasattr(theirs, "chunks"):  # vLLM 0.28+: a request's context may continue
            assert any(c.is_continuation for c in theirs.chunks)
        else:  # older: every chunk spans all prefills, request 2's 9 rows split over 3
            assert len(theirs.seq_tot) == len(chunks) == 3
    torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("name", ["mixed_context", "chunked_continuation"])
def test_impl_fp8_cache_matches_mla_oracle(name, impl, mla_dir):
    """An fp8 latent cache (vLLM's bytes, kv_cache_dtype "fp8", k_scale 0.02): the new rows
    written as e4m3 codes of x / k_scale, decode reading the codes with the layer's scale,
    the prefill's context gathered and dequantised; against the oracle over the values
    the cache holds."""
    if not harness.fp8_cache_kept(mla_dir):
        pytest.skip("this vLLM's CPU platform turns fp8 KV caches off (0.15, 0.18: back "
                    "to auto)")
    ctx, ql, rows = CASES[name]
    case = harness.make_case(ctx, ql, seed=len(name))
    out, md = harness.run(case, mla_dir, workspace_rows=rows, k_scale=0.02)
    assert md.decode.plan.kv_dtype == torch.float8_e4m3fn
    ref = harness.oracle(case, k_scale=0.02)
    torch.testing.assert_close(out.double(), ref, atol=3e-3, rtol=3e-3)
    # the cache's rounding is visible: the exact oracle is further away
    assert (harness.oracle(case) - ref).abs().max() > 3e-3


@pytest.mark.parametrize("spec_tokens,ctx,ql", [
    (2, [6, 13, 20, 4], [3, 3, 3, 5]),     # three verified requests, then a prefill
    (3, [30, 1], [4, 4]),                  # decodes only, a request with one prefix token
])
def test_spec_verify_block_runs_as_one_decode(spec_tokens, ctx, ql, impl, mla_dir):
    """MTP / EAGLE verify: with a decode threshold of ``1 + num_speculative_tokens`` vLLM's
    builder hands the decode path a uniform block of T tokens a request; it runs as one
    MLA decode of ``num_tokens = T`` (token t sees the prefix and drafts 0..t), equal to the
    oracle, and the longer request stays a prefill."""
    case = harness.make_case(ctx, ql, seed=spec_tokens)
    out, md = harness.run(case, mla_dir, spec_tokens=spec_tokens)
    t = spec_tokens + 1
    decodes = sum(1 for q in ql if q <= t)
    assert md.num_decodes == decodes and md.num_decode_tokens == decodes * t
    assert md.decode.plan.num_tokens == t and md.decode.plan.impl == impl
    torch.testing.assert_close(out.double(), harness.oracle(case), atol=2e-3, rtol=2e-3)


def test_decode_block_of_another_shape_is_refused(mla_dir):
    from hygon_attn_backend.integrations.vllm import mla_step

    case = harness.make_case([5, 9], [3, 3], seed=5)
    _, md = harness.run(case, mla_dir, spec_tokens=2)
    d = case.dims
    cache = torch.zeros(case.num_blocks, case.block_size, d.rank + d.rope,
                        dtype=torch.float16)
    q = torch.zeros(5, d.heads, d.rank + d.rope, dtype=torch.float16)  # not 2 x 3 rows
    with pytest.raises(ValueError, match="2 requests x 3 tokens"):
        mla_step.decode(md.decode.plan, q, cache, scale=case.scale)


def test_model_scale_reaches_both_paths(mla_dir):
    """A scale other than 1/sqrt(qk_head_dim) (DeepSeek's YaRN mscale**2 folds into it):
    decode and prefill both follow it."""
    case = harness.make_case([5, 7], [1, 4], scale=0.31, seed=3)
    out, _ = harness.run(case, mla_dir)
    torch.testing.assert_close(out.double(), harness.oracle(case), atol=2e-3, rtol=2e-3)
    default = harness.make_case([5, 7], [1, 4], seed=3)
    assert (harness.oracle(default) - harness.oracle(case)).abs().max() > 1e-2


def test_decode_refuses_a_plan_of_another_scale(mla_dir):
    from hygon_attn_backend.integrations.vllm import mla_step

    case = harness.make_case([5], [1], seed=4)
    _, md = harness.run(case, mla_dir)
    d = case.dims
    q = torch.zeros(1, d.heads, d.rank + d.rope, dtype=torch.float16)
    cache = torch.zeros(case.num_blocks, case.block_size, d.rank + d.rope,
                        dtype=torch.float16)
    with pytest.raises(ValueError, match="scale"):
        mla_step.decode(md.decode.plan, q, cache, scale=case.scale * 2)


@pytest.mark.parametrize("name,rows", [("mixed_context", None), ("long_context", None),
                                       ("long_context", 16)])
def test_impl_matches_vllms_cpu_mla_layer(name, rows, mla_dir):
    """Layer by layer against vLLM's own CPU MLA backend on the same inputs (its decode
    kernel takes block size 16 only): the same metadata, cache and projections, so any
    convention our impl got wrong (scale, rope order, the decode/prefill split, the
    chunk merge) shows here as well as against the oracle. ``rows``: 16-row context
    chunks (splits and continuations)."""
    # 0.28's CPU MLA impl prefills through vLLM's prefill backend, and its CPU build has
    # none (FlashAttention's, unavailable); 0.25 and older have no CPU MLA at all
    pytest.importorskip("vllm.v1.attention.backends.mla.prefill.cpu_sdpa",
                        reason="this vLLM's CPU build has no CPU MLA prefill backend for its "
                               "own CPU MLA impl (0.28 and older)")
    ctx, ql, _ = CASES[name]
    case = harness.make_case(ctx, ql, block_size=16, seed=11)
    ours, _ = harness.run(case, mla_dir, workspace_rows=rows)
    theirs, md = harness.run(case, mla_dir, workspace_rows=rows, vllm_cpu_mla=True)
    assert md.num_decodes == 2 and md.prefill.chunked_context is not None
    if rows is not None:
        assert any(c.is_continuation for c in md.prefill.chunked_context.chunks)
    ref = harness.oracle(case)
    torch.testing.assert_close(theirs.double(), ref, atol=2e-3, rtol=2e-3)  # the harness
    torch.testing.assert_close(ours.double(), theirs.double(), atol=2e-3, rtol=2e-3)


# ----------------------------------------------------------------------------- engine model


def test_vllms_cpu_rope_kernel_misreads_the_mla_views():
    """Why the engine test's model takes vLLM's RoPE as plain torch
    (``tests/support/vllm_mla.NATIVE_OPS``): on the views the MLA layer passes (the rope
    columns of ``q [N, H, nope + rope]`` and of the ``[N, rank + rope]`` ``kv_a`` output),
    vLLM's CPU kernel turns head ``h`` of token ``t`` by token ``t * H + h``'s position.
    When this fails, vLLM reads those views right and ``NATIVE_OPS`` can go."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope
    from vllm.platforms import current_platform

    from tests.support import vllm_mla

    if not current_platform.is_cpu():
        pytest.skip("vLLM's CPU rotary kernel only")
    assert "rotary_embedding" in vllm_mla.NATIVE_OPS
    n, heads, nope, rope_dim, rank = 23, 4, 32, 64, 512
    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(rope_dim, max_position=256, is_neox_style=False,
                        dtype=torch.float16)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(n, heads, nope + rope_dim, generator=gen).half()
    kv_a = torch.randn(n, rank + rope_dim, generator=gen).half()
    positions = torch.arange(n)
    q_pe = q[..., nope:].clone()  # the kernel turns the views in place
    want_q, want_k = rope.forward_native(positions, q_pe.clone(),
                                         kv_a[:, rank:].unsqueeze(1).clone())
    got_q, got_k = rope.forward_cpu(positions, q[..., nope:], kv_a[:, rank:].unsqueeze(1))
    torch.testing.assert_close(got_q[0, 0], want_q[0, 0])  # row 0: token 0's own position
    assert (got_q[0, 1] - want_q[0, 1]).abs().max() > 0.1  # head 1: token 1's position
    shifted, _ = rope.forward_native(torch.tensor([1]), q_pe[:1, 1:2].clone(),
                                     q_pe[:1, :1].clone())
    torch.testing.assert_close(got_q[0, 1], shifted[0, 0], atol=2e-3, rtol=2e-3)
    assert (got_k.float() - want_k.float()).abs().max() > 0.1


# ------------------------------------------------------------------ the prefill slot

#: vLLM 0.15 and 0.18 have no MLA prefill backends (the impl prefills): no slot to fill
needs_prefill_slot = pytest.mark.skipif(
    not hasattr(__import__("vllm.model_executor.layers.attention.mla_attention",
                           fromlist=["_"]), "get_mla_prefill_backend"),
    reason="this vLLM has no MLA prefill-backend slot (0.15, 0.18: the impl prefills)")


def _config_with(backend, mla_prefill_backend=None):
    from types import SimpleNamespace

    return SimpleNamespace(attention_config=SimpleNamespace(
        backend=backend, mla_prefill_backend=mla_prefill_backend))


class _Usable:
    @classmethod
    def is_available(cls):
        return True

    @staticmethod
    def get_name():
        return "USABLE"


class _Unusable(_Usable):
    @classmethod
    def is_available(cls):
        return False


@needs_prefill_slot
def test_prefill_slot_gets_the_placeholder_only_where_vllms_choice_is_unusable():
    """``mla_prefill.choose``: vLLM's answer whenever it is usable, or the selection is not
    ours, or the user named a prefill backend; the placeholder only for our layers where
    vLLM's answer is unusable (an unavailable class, a ValueError, an ImportError)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    from hygon_attn_backend.integrations.vllm import mla_prefill

    ours, other = _config_with(hv.register()), _config_with(E.TRITON_MLA)
    named = _config_with(hv.register(), mla_prefill_backend="FLASH_ATTN")
    placeholder = mla_prefill.placeholder_class()

    def raising(exc):
        def select(vllm_config):
            raise exc("no MLA prefill backend")
        return select

    assert mla_prefill.choose(lambda c: _Usable, ours) is _Usable
    assert mla_prefill.choose(lambda c: _Unusable, ours) is placeholder
    assert mla_prefill.choose(lambda c: _Unusable, other) is _Unusable
    assert mla_prefill.choose(lambda c: _Unusable, named) is _Unusable
    for exc in (ValueError, ImportError):
        assert mla_prefill.choose(raising(exc), ours) is placeholder
        with pytest.raises(exc):
            mla_prefill.choose(raising(exc), other)
    with pytest.raises(ValueError):
        mla_prefill.choose(raising(ValueError), named)


@needs_prefill_slot
def test_prefill_placeholder_holds_metadata_and_computes_nothing(mla_dir):
    from hygon_attn_backend.integrations.vllm import mla_prefill

    cfg = harness.vllm_config_for(mla_dir, block_size=4)
    d = harness.Dims()
    slot = mla_prefill.placeholder_class()(
        num_heads=d.heads, scale=0.1, kv_lora_rank=d.rank, qk_nope_head_dim=d.nope,
        qk_rope_head_dim=d.rope, v_head_dim=d.v, vllm_config=cfg)
    twin = slot.clone()  # vLLM's builder clones the layer's slot
    assert type(twin) is type(slot) and twin.num_heads == d.heads
    meta = object()
    twin.prepare_metadata(meta)
    assert twin._prefill_metadata is meta
    q = torch.zeros(2, d.heads, d.nope + d.rope)
    with pytest.raises(NotImplementedError, match="runs the MLA prefill itself"):
        twin.run_prefill_new_tokens(q=q, k=q, v=q, return_softmax_lse=False)
    with pytest.raises(NotImplementedError, match="runs the MLA prefill itself"):
        twin.run_prefill_context_chunk(chunk_idx=0, q=q, k=q, v=q)


@needs_prefill_slot
def test_prefill_slot_wrapper_installs_once_and_uninstalls():
    from vllm.model_executor.layers.attention import mla_attention

    from hygon_attn_backend.integrations.vllm import mla_prefill

    was_installed = mla_prefill.uninstall()
    vllms = mla_attention.get_mla_prefill_backend
    try:
        assert mla_prefill.install() and mla_prefill.install()
        wrapper = mla_attention.get_mla_prefill_backend
        assert wrapper is not vllms and wrapper.__wrapped__ is vllms
        assert mla_prefill.uninstall() and not mla_prefill.uninstall()
        assert mla_attention.get_mla_prefill_backend is vllms
    finally:
        if was_installed:
            mla_prefill.install()


def test_stacked_context_chunks_become_one_chunk_each():
    """vLLM 0.25 and older stack the chunks (``compat.mla_context_chunks``): chunk ``i``
    spans every prefill, ``token_to_seq[i]`` padded to the longest chunk; each becomes one
    chunk over all prefill rows, an empty one dropped, and gathers request ``s``'s
    positions ``starts[i][s] ..`` from the latent cache."""
    from types import SimpleNamespace

    from hygon_attn_backend.integrations.vllm import mla_step

    i32 = dict(dtype=torch.int32)
    # two prefills with contexts 6 and 3, chunks of 4 rows each, and a trailing empty one
    stacked = SimpleNamespace(
        seq_tot=[7, 2, 0],
        cu_seq_lens=torch.tensor([[0, 4, 7], [0, 2, 2], [0, 0, 0]], **i32),
        starts=torch.tensor([[0, 0], [4, 4], [8, 8]], **i32),
        token_to_seq=torch.tensor([[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0, 0],
                                   [0] * 7], **i32))
    qsl = torch.tensor([0, 2, 5], **i32)
    chunks = compat.mla_context_chunks(SimpleNamespace(chunked_context=stacked,
                                                       query_start_loc=qsl))
    assert len(chunks) == 2 and all(c.query_start_loc is qsl for c in chunks)
    assert [c.num_context_tokens for c in chunks] == [7, 2]
    page, width = 4, 3
    cache = torch.arange(5 * page * width, dtype=torch.float32).view(5, page, width)
    table = torch.tensor([[3, 1], [4, 0]], **i32)  # request 0: pages 3, 1; request 1: 4

    def row(req, pos):
        return cache[table[req, pos // page], pos % page]

    got = [mla_step.gather_latent(cache, table, c) for c in chunks]
    want0 = torch.stack([row(0, p) for p in range(4)] + [row(1, p) for p in range(3)])
    torch.testing.assert_close(got[0], want0)
    torch.testing.assert_close(got[1], torch.stack([row(0, 4), row(0, 5)]))
    assert compat.mla_context_chunks(None) == []
    assert compat.mla_context_chunks(SimpleNamespace(chunked_context=None)) == []
