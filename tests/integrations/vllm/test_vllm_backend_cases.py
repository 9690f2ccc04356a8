"""vLLM's backend-harness cases, driving our builder and impl with vLLM's real classes.

Port of the batch cases of upstream ``tests/v1/attention`` (small/medium/large decode,
prefill with context, mixed, single; see ``support/vllm_cases.BATCH_SPECS``): each case builds
vLLM's ``CommonAttentionMetadata``, runs ``HygonAttentionMetadataBuilder.build``, then the
impl's ``do_kv_cache_update`` (our write op) and ``forward`` on vLLM's combined K|V cache
in several physical layouts, and compares with ``reference.py`` in float64 on contiguous
K/V. On CPU the backend's ops run the plain-torch reference for every case, and the
Triton kernels under the interpreter for the small ones (``HYGON_ATTN_IMPL``).
"""

from __future__ import annotations

import math
import os
import zlib

import pytest
import torch

pytest.importorskip("vllm")

from tests.support.vllm_cases import BATCH_SPECS, LAYOUTS, make_case, oracle  # noqa: E402
from tests.support.vllm_harness import (  # noqa: E402
    check,
    llama_config_dir,
    run_backend,
    vllm_config_for,
)

from hygon_attn_backend.integrations.vllm.backend import HygonAttentionBackend  # noqa: E402

INTERPRETER_CASES = ["small_decode", "small_prefill", "mixed_small", "prefill_no_context",
                     "mixed_mid_page"]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Config-only Llama folders (no weights): vLLM's ModelConfig reads the heads there."""
    made = {}

    def get(num_q_heads, num_kv_heads, head_size):
        key = (num_q_heads, num_kv_heads, head_size)
        if key not in made:
            path = tmp_path_factory.mktemp(f"llama_{num_q_heads}_{num_kv_heads}_{head_size}")
            llama_config_dir(path, num_q_heads, num_kv_heads, head_size)
            made[key] = str(path)
        return made[key]

    return get


IMPL_PARAMS = [pytest.param("reference", id="reference"),
               pytest.param("triton", id="interpreter")]


@pytest.fixture(params=IMPL_PARAMS)
def impl(request, monkeypatch):
    if request.param == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton interpreter needs TRITON_INTERPRET=1 set before import")
    monkeypatch.setenv("HYGON_ATTN_IMPL", request.param)
    return request.param


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLNHC"])
@pytest.mark.parametrize("name", list(BATCH_SPECS))
def test_batch_specs(name, layout, impl, model_dirs):
    """Every upstream batch spec, G=4, D=64, block 16, fp16, three cache layouts."""
    if impl == "triton" and (name not in INTERPRETER_CASES or layout == "BLNHC"):
        pytest.skip("interpreter: small cases only (0.5 ms per program instance)")
    seq_lens, query_lens = BATCH_SPECS[name]
    case = make_case(seq_lens, query_lens, layout=layout, seed=zlib.crc32(f"{name}/{layout}".encode()))
    cfg = vllm_config_for(model_dirs(8, 2, 64), block_size=16, dtype="float16")
    out, md = run_backend(case, cfg)
    # the routing: leading 1-token requests decode, the rest prefill
    assert md.num_decodes == next((i for i, q in enumerate(query_lens) if q != 1),
                                  len(query_lens))
    check(case, out)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_kv_cache_layout(layout, impl, model_dirs):
    """Every physical order the backend declares (supported_kv_cache_layouts)."""
    assert layout in {x.name for x in HygonAttentionBackend.supported_kv_cache_layouts()}
    seq_lens, query_lens = BATCH_SPECS["mixed_small"]
    case = make_case(seq_lens, query_lens, layout=layout, seed=17)
    cfg = vllm_config_for(model_dirs(8, 2, 64), block_size=16, dtype="float16")
    out, _ = run_backend(case, cfg)
    check(case, out)


@pytest.mark.parametrize("heads,block_size", [((4, 2, 32), 32), ((10, 2, 64), 1),
                                              ((5, 5, 128), 64), ((16, 1, 80), 16)])
def test_head_shapes_and_pages(heads, block_size, impl, model_dirs):
    """GQA 2/5/1/16, head sizes 32/64/128/80, page sizes 32/1/64/16 on the mixed batch."""
    seq_lens, query_lens = BATCH_SPECS["mixed_mid_page"]
    hq, hkv, d = heads
    case = make_case(seq_lens, query_lens, num_q_heads=hq, num_kv_heads=hkv, head_size=d,
                     block_size=block_size, layout="LBNHC", seed=block_size)
    cfg = vllm_config_for(model_dirs(hq, hkv, d), block_size=block_size, dtype="float16")
    out, _ = run_backend(case, cfg)
    check(case, out)


@pytest.mark.parametrize("name", ["mixed_small", "mixed_medium"])
def test_bfloat16(name, impl, model_dirs):
    """bf16 with HYGON_ATTN_IMPL=triton too: where the interpreter's bf16 tl.dot is wrong
    (ops/_interpreter.py probes it) the ops run the reference, never a wrong answer."""
    if impl == "triton" and name not in INTERPRETER_CASES:
        pytest.skip("interpreter: small cases only")
    seq_lens, query_lens = BATCH_SPECS[name]
    case = make_case(seq_lens, query_lens, dtype=torch.bfloat16, layout="LBHNC", seed=3)
    cfg = vllm_config_for(model_dirs(8, 2, 64), block_size=16, dtype="bfloat16")
    out, _ = run_backend(case, cfg)
    check(case, out)


@pytest.mark.parametrize("name", ["mixed_small", "medium_decode"])
def test_fp8_kv_cache(name, impl, model_dirs):
    """kv_cache_dtype="fp8": vLLM's byte cache read as float8_e4m3fn with per-tensor
    scales; the oracle sees the dequantized values."""
    if impl == "triton" and name not in INTERPRETER_CASES:
        pytest.skip("interpreter: small cases only")
    seq_lens, query_lens = BATCH_SPECS[name]
    case = make_case(seq_lens, query_lens, kv_cache_dtype="fp8", layout="LBNHC", seed=5)
    assert case.kv_cache.dtype == torch.uint8
    cfg = vllm_config_for(model_dirs(8, 2, 64), block_size=16, dtype="float16")
    out, _ = run_backend(case, cfg)
    check(case, out)


def test_fp8_kv_cache_per_head_scales(impl, model_dirs):
    """vLLM's ``attn_head`` KV-cache scheme: ``layer._k_scale`` / ``_v_scale`` hold one
    scale a KV head (4x apart here); the cache write, the decode and the prefill read each
    head's own (the oracle dequantizes per head)."""
    seq_lens, query_lens = BATCH_SPECS["mixed_small"]
    case = make_case(seq_lens, query_lens, kv_cache_dtype="fp8", layout="LBNHC", seed=6,
                     per_head_scales=True)
    assert case.k_scale.shape == (case.num_kv_heads,)
    assert HygonAttentionBackend.supports_per_head_quant_scales()
    cfg = vllm_config_for(model_dirs(8, 2, 64), block_size=16, dtype="float16")
    out, _ = run_backend(case, cfg)
    check(case, out)


@pytest.mark.parametrize("option", ["sliding_window", "soft_cap", "sinks"])
def test_window_softcap_sinks(option, impl, model_dirs):
    seq_lens, query_lens = BATCH_SPECS["mixed_mid_page"]
    case = make_case(seq_lens, query_lens, layout="LBHNC", seed=11)
    options = {"sliding_window": dict(sliding_window=20), "soft_cap": dict(soft_cap=5.0),
               "sinks": dict(sinks=torch.randn(8, dtype=torch.float32) * 2)}[option]
    cfg = vllm_config_for(model_dirs(8, 2, 64), block_size=16, dtype="float16")
    out, _ = run_backend(case, cfg, **options)
    check(case, out, **options)
    plain = oracle(case, torch.float64)
    assert (out.double() - plain).abs().max() > 1e-2, f"{option} changed nothing"


def test_speculative_decode_tokens(impl, model_dirs):
    """Uniform 3-token verification requests go to the decode kernel as [S, T, Hq, D]."""
    case = make_case([40, 33, 64, 50], [3, 3, 3, 9], layout="LBHNC", seed=13)
    cfg = vllm_config_for(model_dirs(8, 2, 64), block_size=16, dtype="float16")
    out, md = run_backend(case, cfg, decode_threshold=3)
    assert (md.num_decodes, md.decode_query_len, md.num_prefills) == (3, 3, 1)
    check(case, out)


def test_capabilities():
    b = HygonAttentionBackend
    assert b.get_name() == "HYGON"
    assert b.forward_includes_kv_cache_update is False
    assert b.accept_output_buffer is True  # read by vLLM 0.18 and older
    assert b.supports_head_size(128) and not b.supports_head_size(48)
    assert b.supports_dtype(torch.bfloat16) and not b.supports_dtype(torch.float32)
    assert b.supports_kv_cache_dtype("fp8") and not b.supports_kv_cache_dtype("int8_per_token_head")
    assert b.supports_block_size(1) and b.supports_block_size(48)
    reasons = b.validate_configuration(
        head_size=64, dtype=torch.float16, kv_cache_dtype="auto", block_size=16,
        use_mla=False, has_sink=True, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=True, device_capability=None, attn_type="decoder",
        has_sliding_window=True)
    assert reasons == []
    reasons = b.validate_configuration(
        head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=16,
        use_mla=True, has_sink=False, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=None, attn_type="encoder")
    assert "dtype not supported" in reasons and "MLA not supported" in reasons
    reasons = b.validate_configuration(
        head_size=64, dtype=torch.bfloat16, kv_cache_dtype="float16", block_size=16,
        use_mla=False, has_sink=False, use_sparse=False, use_mm_prefix=False,
        use_per_head_quant_scales=False, device_capability=None, attn_type="decoder")
    assert any("differs from the model dtype" in r for r in reasons)
    assert math.isfinite(b.get_preferred_block_size(16))
