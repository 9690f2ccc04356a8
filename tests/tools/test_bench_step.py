"""``hygon-attn bench step`` on a CPU: the batch kinds, and one step of the engine-free
vLLM core over several layer caches (Triton interpreter) against the reference."""

import pytest
import torch

from tests.support.budget import assert_within_budget
from hygon_attn_backend import layouts, reference
from hygon_attn_backend.tools.cli import build_parser
from hygon_attn_backend.tools.bench import step as bench_step


def test_kinds_put_decodes_first():
    for kind in bench_step.KINDS:
        seq, qlen, n_dec = bench_step.batch_lists(kind)
        assert len(seq) == len(qlen) and all(q <= s for s, q in zip(seq, qlen))
        assert qlen[:n_dec] == [1] * n_dec and all(q > 1 for q in qlen[n_dec:])
    args = build_parser().parse_args(["bench", "step", "--kinds", "mixed", "--layers", "4"])
    assert args.kinds == "mixed" and args.layers == 4 and args.func is bench_step.run


def test_one_step_over_layers_equals_the_reference(monkeypatch):
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU needs TRITON_INTERPRET=1 (the GPU runs this bench itself)")
    monkeypatch.setitem(bench_step.KINDS, "tiny-mixed",
                        dict(decodes=(3, 40), extends=((20, 5), (0, 7))))
    st = bench_step.Step("tiny-mixed", layers=2, block_size=16, num_q_heads=4,
                         num_kv_heads=2, head_dim=32, device=torch.device("cpu"),
                         dtype=torch.float16)
    md = st.plan()
    assert (md.num_decodes, md.num_prefills) == (3, 2) and st.launches_per_layer == 3
    st.run()
    kw = dict(compute_dtype=torch.float64)
    k, v = layouts.vllm_kv_views(st.caches[-1])  # the last layer's cache, new K/V written
    args = (st.query, k, v, st.inputs["block_table"], st.inputs["query_start_loc"],
            st.inputs["seq_lens"])
    ref64 = reference.prefix_prefill_attention(*args, **kw)
    ref_lp = reference.prefix_prefill_attention(*args, compute_dtype=torch.float16)
    assert_within_budget(st.out, ref64, ref_lp)
    for b, (s, q) in enumerate(zip(st.seq, st.qlen)):  # every layer's cache got the write
        for kv in st.caches:
            kk, _ = layouts.vllm_kv_views(kv)
            pos = s - 1
            blk = int(st.inputs["block_table"][b, pos // 16])
            row = sum(st.qlen[:b + 1]) - 1
            assert torch.equal(kk[blk, :, pos % 16], st.key[row])


def test_one_launch_form_sends_every_request_to_the_prefill_kernel(monkeypatch):
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("CPU needs TRITON_INTERPRET=1 (the GPU runs this bench itself)")
    monkeypatch.setitem(bench_step.KINDS, "tiny-mixed",
                        dict(decodes=(3, 40), extends=((20, 5),)))
    kw = dict(layers=1, block_size=16, num_q_heads=4, num_kv_heads=2, head_dim=32,
              device=torch.device("cpu"), dtype=torch.float16)
    torch.manual_seed(5)  # the same pages, cache and inputs for both forms
    split = bench_step.Step("tiny-mixed", **kw)
    torch.manual_seed(5)
    one = bench_step.Step("tiny-mixed", one_launch=True, **kw)
    assert torch.equal(one.inputs["block_table"], split.inputs["block_table"])
    md = one.plan()
    assert (md.num_decodes, md.num_prefills) == (0, 4) and one.launches_per_layer == 2
    split.plan()
    assert split.launches_per_layer == 3
    split.run(), one.run()
    torch.testing.assert_close(one.out, split.out, rtol=0, atol=2e-3)
    args = build_parser().parse_args(["bench", "step", "--one-launch"])
    assert args.one_launch
