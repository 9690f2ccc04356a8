"""MLA models through ``hygon`` in SGLang, with SGLang's own MLA kit
(``sglang.test.kits.attention_unittest.attention_methods.mla_attention`` and its runner
modes): the kit builds its mock MLA runner, ``ReqToTokenPool`` and ``MLATokenToKVPool``,
our backend through the registered factory (``HygonMLABackend`` for an MLA runner), a
DeepSeek-style absorbed attention module, and compares with its latent reference at its
own tolerance.

Widths: DeepSeek's (``kv_lora_rank`` 512 + rope 64: a 576-wide latent row, value 512)
and the kit's default (32 + 0). CPU: float16 through the Triton kernels under the
interpreter, float32 through the reference; GPU: the same cases on CUDA.
"""

import pytest
import torch

pytest.importorskip("sglang.test.kits.attention_unittest.attention_methods.mla_attention")

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods import (  # noqa: E402
    mla_attention as kit,
)
from sglang.test.kits.attention_unittest.runner_modes import (  # noqa: E402
    cuda_graph_decode_runner as graph_kit,
)
from sglang.test.kits.attention_unittest.runner_modes import (  # noqa: E402
    speculative_draft_extend_runner as draft_kit,
)
from sglang.test.kits.attention_unittest.runner_modes import (  # noqa: E402
    speculative_target_verify_runner as verify_kit,
)

from hygon_attn_backend import reference  # noqa: E402
from hygon_attn_backend.integrations.sglang import register  # noqa: E402
from hygon_attn_backend.integrations.sglang.mla import HygonMLABackend  # noqa: E402
from hygon_attn_backend.ops.mla import MLADecodePlan  # noqa: E402
from hygon_attn_backend.ops.mla_prefill import RaggedPlan  # noqa: E402
from tests.support.budget import assert_within_budget  # noqa: E402

CASES = kit.make_mla_cases("hygon")
DTYPES = (torch.float16, torch.float32)
#: (kv_lora_rank, qk_rope_head_dim)
WIDTHS = {"deepseek": (512, 64), "kit_default": (kit.DEFAULT_KV_LORA_RANK,
                                                 kit.DEFAULT_QK_ROPE_HEAD_DIM)}


class _KitTestCase:
    """The kit calls ``testcase.skipTest`` when a backend cannot be built: for us that is
    a failure, never a skip."""

    def skipTest(self, reason):  # noqa: N802 (unittest's name)
        pytest.fail(f"the kit could not build the hygon backend: {reason}")


@pytest.fixture
def mla_calls(monkeypatch):
    """Counts the layer calls of this test by (op, impl): ``decode`` (``MLADecodePlan.run``)
    and ``extend`` (``RaggedPlan.run_extend``, the absorbed extend over the pool)."""
    calls = {}
    for op, cls, name in (("decode", MLADecodePlan, "run"), ("extend", RaggedPlan,
                                                             "run_extend")):
        real = getattr(cls, name)

        def counted(self, *args, _real=real, _op=op, **kwargs):
            calls[(_op, self.impl)] = calls.get((_op, self.impl), 0) + 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, counted)
    previous = torch.is_grad_enabled()
    # the kit fills the pool through nn.Linear outputs: an in-place store of a tensor that
    # requires grad fails on CPU
    torch.set_grad_enabled(False)
    register()
    yield calls
    torch.set_grad_enabled(previous)


def _impl(fixture_backend, dtype):
    return "triton" if fixture_backend._triton_here and dtype != torch.float32 else "reference"


def _triton(device):
    from hygon_attn_backend import envs
    from hygon_attn_backend.ops._dispatch import select_impl

    return select_impl(envs.impl(), torch.device(device)) == "triton"


def _widths(name):
    rank, rope = WIDTHS[name]
    return dict(kv_lora_rank=rank, qk_rope_head_dim=rope)


def _run_case(case, dtype, device, width, loc_layout="shuffled_pages"):
    fixture = kit.build_mla_attention_fixture(_KitTestCase(), case, dtype=dtype,
                                              device=str(device), loc_layout=loc_layout,
                                              **_widths(width))
    assert isinstance(fixture.backend, HygonMLABackend)
    actual = kit.run_mla_fixture_eager(fixture)
    expected = kit.expected_mla_fixture_output(fixture)
    assert torch.isfinite(actual).all()
    torch.testing.assert_close(actual, expected, atol=kit.MLA_ATOL, rtol=kit.MLA_RTOL)
    return fixture


@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kit_mla_case(case, dtype, width, device, mla_calls):
    """Every kit case (extend with and without a cached prefix, page 1, 16 and 32, page
    edges; decode across page boundaries) equals the kit's reference, on the op the mode
    calls for."""
    fixture = _run_case(case, dtype, device, width)
    op = "decode" if case.forward_mode.is_decode() else "extend"
    assert mla_calls == {(op, _impl(fixture.backend, dtype)): 1}, mla_calls


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_kit_mla_case_fp8_pool(case, device, monkeypatch):
    """The kit's fp8 (e4m3) latent pool, DeepSeek widths, float16. SGLang's pool casts
    the rows to e4m3 unscaled; each of our kernel calls on that pool equals the fp64
    reference over the same codes within the shared budget, and the layer output stays
    within fp8's error of the kit's unquantized reference."""
    seen = []
    for cls, name in ((MLADecodePlan, "run"), (RaggedPlan, "run_extend")):
        real = getattr(cls, name)

        def recorded(self, q, kv_cache, *args, _real=real, **kwargs):
            out = _real(self, q, kv_cache, *args, **kwargs)
            seen.append((self, q.clone(), kv_cache, args, kwargs, out.clone()))
            return out

        monkeypatch.setattr(cls, name, recorded)
    previous = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    try:
        register()
        fixture = kit.build_mla_attention_fixture(_KitTestCase(), case, dtype=torch.float16,
                                                  device=str(device), fp8_kv_cache=True,
                                                  **_widths("deepseek"))
        assert isinstance(fixture.backend, HygonMLABackend)
        assert fixture.backend.kv_dtype == torch.float8_e4m3fn
        actual = kit.run_mla_fixture_eager(fixture)
        expected = kit.expected_mla_fixture_output(fixture)
    finally:
        torch.set_grad_enabled(previous)
    assert len(seen) == 1, len(seen)
    plan, q, kv_cache, args, kwargs, out = seen[0]
    assert kv_cache.dtype == torch.float8_e4m3fn
    if isinstance(plan, MLADecodePlan):
        ref = [reference.mla_decode_attention(q, kv_cache, plan.block_table, plan.seq_lens,
                                              kv_lora_rank=plan.kv_lora_rank, scale=plan.scale,
                                              compute_dtype=cd) for cd in (torch.float64,
                                                                           torch.float16)]
    else:
        ref = [reference.mla_extend_attention(q, kv_cache, args[0], plan.cu_seqlens_q,
                                              plan.cu_seqlens_k, v_head_dim=plan.head_dim_v,
                                              scale=kwargs.get("scale"), compute_dtype=cd)
               for cd in (torch.float64, torch.float16)]
    assert_within_budget(out, ref[0], ref[1], what=case.name)
    assert torch.isfinite(actual).all()
    # e4m3 keeps 3 mantissa bits: the layer output moves by a few percent of its range
    err = (actual.float() - expected.float()).abs().max().item()
    assert err < 0.1 * max(1.0, expected.float().abs().max().item()), err


# ``non_monotonic_extend`` permutes a request's extend slots: with pages of more than one
# token that breaks page contiguity (token j at its page's base + j % P), which SGLang's
# paged allocator guarantees and every paged reader relies on. The absorbed extend reads
# the new rows from the pool through the page table (the kit passes k = v = None), so that
# layout runs at page 1 only; at larger pages the debug check names it (below).
SCATTERED = [(c, layout) for c in CASES for layout in ("interleaved_pages",
                                                        "non_monotonic_extend")
             if layout == "interleaved_pages" or c.page_size == 1
             or c.forward_mode.is_decode()]


@pytest.mark.parametrize("case,loc_layout", SCATTERED,
                         ids=lambda v: v.name if hasattr(v, "name") else v)
def test_kit_mla_case_scattered_slots(case, loc_layout, device, mla_calls):
    """The kit's non-tidy slot layouts (pages of different requests interleaved, extend
    tokens scattered), DeepSeek widths, float16."""
    _run_case(case, torch.float16, device, "deepseek", loc_layout=loc_layout)


def test_kit_mla_non_contiguous_pages_are_named(device, mla_calls, monkeypatch):
    """``HYGON_ATTN_DEBUG=1``: an extend whose slots break page contiguity (the kit's
    ``non_monotonic_extend`` at page 16) is refused by name before any launch."""
    monkeypatch.setenv("HYGON_ATTN_DEBUG", "1")
    case = next(c for c in CASES if c.name == "mla_extend_total_exact_page")
    with pytest.raises(ValueError, match="not page-contiguous"):
        _run_case(case, torch.float16, device, "deepseek", loc_layout="non_monotonic_extend")
    assert mla_calls == {}


@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("page", [1, 16])
def test_kit_mla_cuda_graph_decode(page, width, device, mla_calls):
    """Decode from the CUDA-graph metadata (capture at the fill length, replay with
    padded rows; on CPU the kit runs the hooks without a real graph): the replay equals
    the kit's reference."""
    case = kit.MLAAttentionCase(name="mla_decode_page_boundary", backend="hygon",
                                forward_mode=ForwardMode.DECODE, num_heads=4,
                                page_size=page, prefix_lens=(14, 15, 16))
    graph_kit.run_mla_cuda_graph_decode_case(_KitTestCase(), case, dtype=torch.float16,
                                             device=str(device), **_widths(width))
    assert set(mla_calls) == {("decode", "triton" if _triton(device) else "reference")}, \
        mla_calls


def _verify_case(page, prefix, drafts):
    return kit.MLAAttentionCase(name="v", backend="hygon",
                                forward_mode=ForwardMode.TARGET_VERIFY, num_heads=4,
                                page_size=page, prefix_lens=prefix,
                                extend_lens=(drafts,) * len(prefix))


@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("drafts", [3, 6])
def test_kit_mla_target_verify_chain(drafts, page, width, device, mla_calls):
    """An EAGLE chain (topk 1) verify: the drafts on the decode kernel (``num_tokens =
    T``) under the custom mask SGLang gives, equal to the kit's masked reference."""
    verify_kit.run_mla_eagle_verify_case(_KitTestCase(), _verify_case(page, (5, 17), drafts),
                                         topk=1, dtype=torch.float16, device=str(device),
                                         **_widths(width))
    assert mla_calls == {("decode", "triton" if _triton(device) else "reference"): 1}, \
        mla_calls


@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("page", [1, 16])
def test_kit_mla_target_verify_tree(page, width, device, mla_calls):
    """A draft tree (EAGLE topk 3): the drafts under the batch's packed tree mask on the
    decode kernel, equal to the kit's masked reference (a chain's answer would not be)."""
    verify_kit.run_mla_eagle_verify_case(_KitTestCase(), _verify_case(page, (5, 17), 3),
                                         topk=3, dtype=torch.float16, device=str(device),
                                         **_widths(width))
    assert mla_calls == {("decode", "triton" if _triton(device) else "reference"): 1}, \
        mla_calls


# As in test_sglang_spec.py: the kit's CUDA-graph verify fixture fails for SGLang's own
# `triton` backend too with page 1 and several requests (the same mismatch), so page 1
# runs one request.
@pytest.mark.parametrize("topk", [1, 3])
@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("page,prefix", [(16, (40, 2, 19)), (1, (4,))])
def test_kit_mla_target_verify_cuda_graph(page, prefix, width, topk, device, mla_calls):
    """Verify from the static graph buffers (capture, padded replay; a chain and a topk-3
    tree, whose mask is packed into the static buffer): equals the reference and the
    eager run of the same batch."""
    verify_kit.run_mla_eagle_verify_cuda_graph_case(
        _KitTestCase(), _verify_case(page, prefix, 3), topk=topk, dtype=torch.float16,
        device=str(device), **_widths(width))
    assert set(mla_calls) == {("decode", "triton" if _triton(device) else "reference")}, \
        mla_calls


@pytest.mark.parametrize("width", list(WIDTHS))
@pytest.mark.parametrize("page", [1, 16])
def test_kit_mla_draft_extend_v2_cuda_graph(page, width, device, mla_calls):
    """EAGLE v2's draft extend from CUDA-graph metadata (fixed tokens a request, padded
    replay rows): the absorbed extend over the prefix, equal to the kit's reference."""
    case = kit.MLAAttentionCase(name="v", backend="hygon",
                                forward_mode=ForwardMode.DRAFT_EXTEND_V2, num_heads=4,
                                page_size=page, prefix_lens=(5, 17), extend_lens=(3, 3))
    draft_kit.run_mla_draft_extend_v2_cuda_graph_case(_KitTestCase(), case,
                                                      dtype=torch.float16,
                                                      device=str(device), **_widths(width))
    assert set(mla_calls) == {("extend", "triton" if _triton(device) else "reference")}, \
        mla_calls


def _mla_runner(device):
    case = next(c for c in CASES if c.name == "mla_decode_bsz1_nonzero_prefix")
    config = kit.TinyMLAModelConfig(num_heads=4, kv_lora_rank=512, qk_rope_head_dim=64,
                                    hidden_size=64, context_len=kit.DEFAULT_MAX_CONTEXT_LEN)
    return kit.MockMLAModelRunner(case=case, model_config=config, dtype=torch.float16,
                                  device=str(device),
                                  max_context_len=kit.DEFAULT_MAX_CONTEXT_LEN,
                                  kv_lora_rank=512, qk_rope_head_dim=64)


def test_draft_backends_of_an_mla_draft_model(device, mla_calls, monkeypatch):
    """EAGLE's draft extend on an MLA draft runner gets the MLA backend (a dense one would
    misread the latent pool), and so does every step of its multi-step draft decode
    (``test_sglang_draft.py`` runs those steps)."""
    from types import SimpleNamespace

    from hygon_attn_backend.integrations.sglang import draft_factory
    from hygon_attn_backend.integrations.sglang.backend import HygonAttnBackend
    from hygon_attn_backend.integrations.sglang.draft import HygonMultiStepDraftBackend

    runner = _mla_runner(device)
    factory = SimpleNamespace(draft_model_runner=runner, topk=1, speculative_num_steps=3)
    name, backend = draft_factory._hygon_entry(factory, multi_step=False)()
    assert name == "hygon" and isinstance(backend, HygonMLABackend)
    name, steps = draft_factory._hygon_entry(factory, multi_step=True)()
    assert name == "hygon" and isinstance(steps, HygonMultiStepDraftBackend)
    assert len(steps.attn_backends) == 2
    assert all(type(c) is HygonMLABackend for c in steps.attn_backends)
    # a tree's step decodes topk rows a request: the split-KV scratch is sized for them all
    from hygon_attn_backend.integrations.sglang import mla as mla_module

    sized = []
    real = mla_module.allocate_mla_decode_workspace
    monkeypatch.setattr(mla_module, "allocate_mla_decode_workspace",
                        lambda **kw: sized.append(kw["max_num_seqs"]) or real(**kw))
    factory.topk = 2
    _, tree = draft_factory._hygon_entry(factory, multi_step=True)()
    assert tree.attn_backends[0]._mla_workspace(4, torch.float16, 1) is not None
    assert sized == [2 * runner.req_to_token_pool.req_to_token.shape[0]]
    runner.use_mla_backend = False  # the same runner as a dense model: the dense class
    _, dense = draft_factory._hygon_entry(factory, multi_step=False)()
    assert type(dense) is HygonAttnBackend
