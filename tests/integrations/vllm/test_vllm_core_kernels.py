"""The vLLM backend's engine-free core with our Triton kernels, without vLLM installed.

vLLM cannot be installed on the H200 test machine, so the backend-harness cases
(``support/vllm_cases.BATCH_SPECS``, upstream ``tests/v1/attention``'s batch specs) drive
``integrations.vllm._core`` directly there: the same split (decodes first), metadata,
decode workspace and prefill plan that ``HygonAttentionMetadataBuilder.build`` makes,
then ``write_new_kv`` and ``attention`` as the impl calls them. On CPU the small cases
run under the Triton interpreter (this also checks the GPU test itself); the GPU
variants run every case at its real size, and a decode batch captured in a CUDA graph
and replayed with new inputs must equal the eager result.
"""

from __future__ import annotations

import pytest
import torch

from tests.support.budget import assert_within_budget
from tests.support.vllm_cases import BATCH_SPECS, make_case, oracle, split_point
from hygon_attn_backend.integrations.vllm import step as _core

CPU_CASES = ["small_decode", "small_prefill", "mixed_small", "prefill_no_context",
             "mixed_mid_page"]


def core_metadata(case, *, decode_threshold=1, max_num_seqs=64, for_graph=False):
    """What HygonAttentionMetadataBuilder.build produces for this batch."""
    from hygon_attn_backend.ops.decode import allocate_decode_workspace

    num_decodes, num_decode_tokens = split_point(case.query_lens, decode_threshold)
    md = _core.make_metadata(
        query_start_loc=case.query_start_loc, seq_lens=case.seq_lens_t,
        block_table=case.block_table, slot_mapping=case.slot_mapping,
        num_reqs=len(case.seq_lens), num_actual_tokens=case.num_tokens,
        max_query_len=max(case.query_lens), max_seq_len=max(case.seq_lens),
        num_decodes=num_decodes, num_decode_tokens=num_decode_tokens)
    workspace = allocate_decode_workspace(
        max_num_seqs=max_num_seqs, num_q_heads=case.num_q_heads,
        num_kv_heads=case.num_kv_heads, head_dim=case.head_size,
        max_context_len=case.block_table.shape[1] * case.block_size,
        device=case.query.device, num_tokens=decode_threshold)
    _core.plan_metadata(md, num_q_heads=case.num_q_heads, num_kv_heads=case.num_kv_heads,
                        head_size=case.head_size, block_size=case.block_size,
                        q_dtype=case.dtype,
                        kv_dtype=_core.kv_dtype_for(case.kv_cache_dtype, case.dtype),
                        impl="triton", workspace=workspace, for_graph=for_graph,
                        query_start_loc_cpu=case.query_start_loc.cpu())
    return md


def layer_spec(case, **options):
    return _core.LayerSpec(num_heads=case.num_q_heads, num_kv_heads=case.num_kv_heads,
                           head_size=case.head_size, scale=case.head_size ** -0.5,
                           kv_cache_dtype=case.kv_cache_dtype, **options)


def run_core(case, md, **options):
    layer = layer_spec(case, **options)
    _core.write_new_kv(case.key, case.value, case.kv_cache, case.slot_mapping, layer,
                       k_scale=case.k_scale, v_scale=case.v_scale, impl="triton")
    out = torch.full_like(case.query, float("nan"))
    _core.attention(case.query, case.kv_cache, md, out, layer, k_scale=case.k_scale,
                    v_scale=case.v_scale)
    return out


def check(case, out, **options):
    assert_within_budget(out, oracle(case, torch.float64, **options),
                         oracle(case, case.dtype, **options))


def _device_params():
    return [pytest.param("cpu", id="cpu-interpreter"),
            pytest.param("cuda", id="gpu", marks=pytest.mark.gpu)]


@pytest.fixture(params=_device_params())
def device(request):
    if request.param == "cpu":
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("CPU needs TRITON_INTERPRET=1 set before import")
    return torch.device(request.param)


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC"])
@pytest.mark.parametrize("name", list(BATCH_SPECS))
def test_batch_specs(name, layout, device):
    if device.type == "cpu" and name not in CPU_CASES:
        pytest.skip("interpreter: small cases only")
    seq_lens, query_lens = BATCH_SPECS[name]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    heads = dict(num_q_heads=32, num_kv_heads=8, head_size=128) if device.type == "cuda" \
        else dict(num_q_heads=8, num_kv_heads=2, head_size=64)
    case = make_case(seq_lens, query_lens, dtype=dtype, layout=layout, device=device,
                     seed=len(name), **heads)
    md = core_metadata(case)
    check(case, run_core(case, md))


@pytest.mark.parametrize("kv", ["auto", "fp8"])
@pytest.mark.parametrize("heads,block_size", [((4, 2, 32), 32), ((10, 2, 64), 1),
                                              ((40, 8, 128), 64), ((16, 1, 80), 16)])
def test_shapes_pages_fp8(heads, block_size, kv, device):
    seq_lens, query_lens = BATCH_SPECS["mixed_mid_page"]
    hq, hkv, d = heads
    case = make_case(seq_lens, query_lens, num_q_heads=hq, num_kv_heads=hkv, head_size=d,
                     block_size=block_size, kv_cache_dtype=kv, layout="BLNHC",
                     device=device, seed=block_size)
    check(case, run_core(case, core_metadata(case)))


@pytest.mark.parametrize("option", ["sliding_window", "soft_cap", "sinks"])
def test_window_softcap_sinks(option, device):
    seq_lens, query_lens = BATCH_SPECS["mixed_mid_page"]
    case = make_case(seq_lens, query_lens, device=device, seed=7)
    options = {"sliding_window": dict(sliding_window=20), "soft_cap": dict(soft_cap=5.0),
               "sinks": dict(sinks=torch.randn(8, device=device) * 2)}[option]
    check(case, run_core(case, core_metadata(case), **options), **options)


def test_routing_launch_counts(device):
    """A uniform decode batch is one decode launch (two with a split) and no prefill; a
    mixed batch adds one prefill launch; the K/V write is one launch per layer."""
    from hygon_attn_backend.ops import _launch

    launched = []
    real_call = _launch.Launch.__call__

    def counting(self, *values):
        launched.append(self.kernel.__name__ if hasattr(self.kernel, "__name__")
                        else str(self.kernel))
        return real_call(self, *values)

    for name, want in (("small_decode", {"paged_decode_kernel"}),
                       ("mixed_small", {"paged_decode_kernel", "prefix_prefill_kernel"})):
        seq_lens, query_lens = BATCH_SPECS[name]
        case = make_case(seq_lens, query_lens, device=device, seed=3)
        md = core_metadata(case)
        _launch.Launch.__call__ = counting
        try:
            launched.clear()
            out = run_core(case, md)
        finally:
            _launch.Launch.__call__ = real_call
        check(case, out)
        kernels = [k.split(".")[-1] for k in launched]
        assert kernels[0].startswith("write_kv"), kernels
        assert {k for k in kernels[1:] if "combine" not in k} == want, kernels
        assert len(kernels) == 1 + md.num_launches <= 4, kernels
        assert (md.prefill_plan is None) == (name == "small_decode")


def test_speculative_decode_tokens(device):
    case = make_case([40, 33, 64, 50], [3, 3, 3, 9], device=device, seed=13)
    md = core_metadata(case, decode_threshold=3)
    assert (md.num_decodes, md.decode_query_len, md.num_prefills) == (3, 3, 1)
    check(case, run_core(case, md))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens_per_seq", [1, 3])
def test_decode_cuda_graph_replay_with_new_inputs(tokens_per_seq):
    """The backend's decode forward captured in a CUDA graph, replayed after new queries,
    longer sequences and a different block table were written into the same buffers,
    equals the eager forward on those inputs (and the oracle)."""
    device = torch.device("cuda")
    num_seqs, block_size = 16, 16
    lens_a = [100 + 37 * i for i in range(num_seqs)]
    lens_b = [s + 300 + 11 * i for i, s in enumerate(lens_a)]  # longer: more partitions
    q_lens = [tokens_per_seq] * num_seqs
    # One cache holding case B's tokens; case A sees a prefix of each sequence.
    case_b = make_case(lens_b, q_lens, num_q_heads=32, num_kv_heads=8, head_size=128,
                       block_size=block_size, dtype=torch.bfloat16, device=device, seed=21)
    layer = layer_spec(case_b)
    _core.write_new_kv(case_b.key, case_b.value, case_b.kv_cache, case_b.slot_mapping, layer,
                       impl="triton")
    md = core_metadata(case_b, decode_threshold=tokens_per_seq, for_graph=True)
    md_eager = core_metadata(case_b, decode_threshold=tokens_per_seq)
    assert md.num_decodes == num_seqs and md.num_prefills == 0
    seq_lens = md.decode_seq_lens  # the planned tensors: new values go into them
    query = torch.randn_like(case_b.query)
    out = torch.full_like(query, float("nan"))

    def forward(md=md):
        _core.attention(query, case_b.kv_cache, md, out, layer)

    seq_lens.copy_(torch.tensor(lens_a, dtype=torch.int32))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        forward()  # warm-up (compiles the kernels)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()

    # New inputs in the same buffers: longer sequences, new queries, permuted table rows.
    perm = torch.randperm(num_seqs, device=device)
    seq_lens.copy_(torch.tensor(lens_b, dtype=torch.int32, device=device)[perm])
    block_table = case_b.block_table[perm].clone()
    md.block_table.copy_(block_table)
    query.copy_(torch.randn_like(query))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    replayed = out.clone()

    out.fill_(float("nan"))
    md_eager.decode_seq_lens.copy_(seq_lens)
    md_eager.decode_block_table.copy_(block_table)
    forward(md_eager)  # eager, grid sized by the batch
    torch.cuda.synchronize()
    assert torch.isfinite(replayed).all()
    torch.testing.assert_close(replayed, out, atol=2e-2, rtol=2e-2)
    # and both equal the oracle on the permuted batch
    from hygon_attn_backend import reference

    ref = reference.paged_decode_attention(
        query.view(num_seqs, tokens_per_seq, 32, 128).double().cpu(),
        case_b.kv_cache[..., :128].double().cpu(), case_b.kv_cache[..., 128:].double().cpu(),
        block_table.cpu(), seq_lens.cpu(), scale=128 ** -0.5, compute_dtype=torch.float64)
    err = (replayed.view_as(ref).double().cpu() - ref).abs().max().item()
    assert err < 3e-2, err


@pytest.mark.parametrize("name", ["small_decode", "mixed_small"])
def test_padding_rows_are_neither_read_into_results_nor_written(name, device):
    """vLLM passes query/out with padding rows past num_actual_tokens (a padded batch):
    the results equal the unpadded ones and the padding rows of out stay untouched (the
    decode launch takes the whole tensors; its grid bounds the rows)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    case = make_case(*BATCH_SPECS[name], device=device, dtype=dtype)
    md = core_metadata(case)
    layer = layer_spec(case)
    _core.write_new_kv(case.key, case.value, case.kv_cache, case.slot_mapping, layer,
                       impl="triton")
    pad = 5
    query = torch.cat([case.query, torch.randn(pad, *case.query.shape[1:]).to(case.query)])
    out = torch.full_like(query, float("nan"))
    out[case.num_tokens:] = 7.0
    _core.attention(query, case.kv_cache, md, out, layer)
    assert (out[case.num_tokens:] == 7.0).all(), "padding rows written"
    check(case, out[:case.num_tokens])
