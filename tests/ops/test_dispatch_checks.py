"""Implementation choice and argument validation shared by the ops."""

import pytest
import torch

from hygon_attn_backend.ops import _checks, _dispatch


def test_select_impl(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert _dispatch.select_impl("auto", cpu) == "reference"
    assert _dispatch.select_impl("reference", cpu) == "reference"
    with pytest.raises(ValueError, match="impl='triton' cannot run"):
        _dispatch.select_impl("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _dispatch.select_impl("auto", cpu) == "triton"
    assert _dispatch.select_impl("auto", torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="impl must be one of"):
        _dispatch.select_impl("fast", cpu)


def test_check_tensor_names_the_argument():
    t = torch.zeros(2, 3, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"q must have 3 dims, got shape \(2, 3\)"):
        _checks.check_tensor("q", t, ndim=3)
    with pytest.raises(ValueError, match="seq_lens must have dtype"):
        _checks.check_tensor("seq_lens", t, dtypes=(torch.int32,))
    with pytest.raises(ValueError, match=r"block_table must have shape \(2, \*, 4\)"):
        _checks.check_tensor("block_table", t, shape=(2, None, 4))
    with pytest.raises(ValueError, match="k must be a torch.Tensor"):
        _checks.check_tensor("k", [1, 2])
    with pytest.raises(ValueError, match="contiguous in its last dim"):
        _checks.check_tensor("q", torch.zeros(4, 4).t(), last_dim_contiguous=True)


def test_check_kv_caches():
    k = torch.zeros(3, 2, 4, 16, dtype=torch.float16)
    assert _checks.check_kv_caches(k, k.clone(), device=k.device) == (3, 2, 4, 16)
    split = torch.zeros(3, 2, 2, 4, 8, dtype=torch.float16)
    assert _checks.check_kv_caches(split, k, device=k.device) == (3, 2, 4, 16)
    with pytest.raises(ValueError, match="same"):
        _checks.check_kv_caches(k, torch.zeros(3, 2, 4, 8, dtype=torch.float16), device=k.device)
    with pytest.raises(ValueError, match="share a dtype"):
        _checks.check_kv_caches(k, k.float(), device=k.device)
    with pytest.raises(ValueError, match="head_dim 16 does not match"):
        _checks.check_kv_caches(k, k, device=k.device, head_dim=32)
    with pytest.raises(ValueError, match="split-x"):
        _checks.check_kv_caches(torch.zeros(3, 2, 4, 4, 4, dtype=torch.float16), k, device=k.device)


def test_check_block_ids():
    table = torch.tensor([[0, 5], [2, 9]])
    _checks.check_block_ids("block_table", table, 10)
    with pytest.raises(ValueError, match=r"block_table holds block ids in \[0, 9\]"):
        _checks.check_block_ids("block_table", table, 9)
    with pytest.raises(ValueError, match=r"\[-1, 3\]"):
        _checks.check_block_ids("block_table", torch.tensor([-1, 3]), 9)
