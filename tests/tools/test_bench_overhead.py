"""``hygon-attn bench overhead``'s op rows (bench/_overhead_cases.py) on CPU: the rows a
GPU run times, with the decode plan's two combine forms side by side in the same run."""

import torch

from hygon_attn_backend.tools.bench import _overhead_cases


def test_op_rows_time_both_combine_forms_of_the_split_decode(monkeypatch):
    monkeypatch.setitem(_overhead_cases.DECODE, "num_seqs", 4)  # interpreter-sized
    monkeypatch.setitem(_overhead_cases.DECODE, "ctx", 600)
    rows = dict(_overhead_cases.op_rows(num_q_heads=4, num_kv_heads=1, head_dim=64,
                                        page_size=16, device=torch.device("cpu"),
                                        dtype=torch.float16))
    forms = [label for label in rows if label.startswith("decode plan.run")]
    assert sorted(forms) == ["decode plan.run (1 launch, fused combine)",
                             "decode plan.run (2 launches, combine kernel)"]
    fused = rows[forms[0]]().clone()
    assert torch.isfinite(fused).all()
    torch.testing.assert_close(rows[forms[1]](), fused, atol=2e-3, rtol=2e-3)
