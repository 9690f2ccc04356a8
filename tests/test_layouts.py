"""Layouts: every canonical view must address the storage by the documented formula."""

import pytest
import torch

from hygon_attn_backend import layouts

torch.set_grad_enabled(False)
NB, B, H, D = 5, 4, 3, 16


def offset_formula(layout, p, off, h, d):
    if layout in ("bshd", "sglang_nhd"):
        return ((p * B + off) * H + h) * D + d
    if layout in ("bhsd", "sglang_hnd"):
        return ((p * H + h) * B + off) * D + d
    if layout == "bhds":
        return ((p * H + h) * D + d) * B + off
    raise AssertionError(layout)


@pytest.mark.parametrize("layout", ["bshd", "bhsd", "bhds", "sglang_nhd", "sglang_hnd"])
def test_view_addresses_storage_by_formula(layout):
    storage = layouts.allocate(layout, num_blocks=NB, block_size=B, num_kv_heads=H,
                               head_dim=D, dtype=torch.float32)
    storage.copy_(torch.arange(storage.numel(), dtype=torch.float32).view(storage.shape))
    v = layouts.view(storage, layout, block_size=B)
    assert v.shape == (NB, H, B, D)
    assert v.data_ptr() == storage.data_ptr()  # a view, no copy
    for p, off, h, d in [(0, 0, 0, 0), (3, 1, 2, 5), (4, 3, 1, 15), (2, 2, 0, 9)]:
        assert int(v[p, h, off, d]) == offset_formula(layout, p, off, h, d)
        # strides give the same element offset
        s = v.stride()
        assert p * s[0] + h * s[1] + off * s[2] + d * s[3] == offset_formula(layout, p, off, h, d)


def test_split_x_formula():
    x = layouts.split_x_factor(torch.float16)
    assert x == 8
    storage = layouts.allocate("split_x", num_blocks=NB, block_size=B, num_kv_heads=H,
                               head_dim=D, dtype=torch.float16)
    canon = torch.randn(NB, H, B, D).half()
    split = layouts.convert(canon, "split_x")
    assert split.shape == storage.shape
    flat = split.reshape(-1)
    for p, off, h, d in [(1, 2, 1, 9), (4, 3, 2, 15)]:
        idx = (((p * H + h) * (D // x) + d // x) * B + off) * x + d % x
        assert flat[idx] == canon[p, h, off, d]


@pytest.mark.parametrize("order", layouts.VLLM_ORDERS)
def test_vllm_combined_views(order):
    per_layer = layouts.allocate_vllm(order, num_layers=2, num_blocks=NB, block_size=B,
                                      num_kv_heads=H, head_dim=D, dtype=torch.float32)
    kv = per_layer[1]
    assert kv.shape == (NB, H, B, 2 * D)
    k, v = layouts.kv_views("vllm", kv)
    assert k.shape == v.shape == (NB, H, B, D)
    assert k.data_ptr() == kv.data_ptr() and v.data_ptr() == kv.data_ptr() + D * 4
    assert torch.equal(k[2, 1, 3], kv[2, 1, 3, :D]) and torch.equal(v[2, 1, 3], kv[2, 1, 3, D:])
    if order == "LBNHC":  # token-major: K offset ((P*B + off)*H + h)*2D + d within the layer
        base = kv.data_ptr()
        ptr = k[3, 2, 1, 5:].data_ptr()
        assert (ptr - base) // 4 == ((3 * B + 1) * H + 2) * 2 * D + 5


@pytest.mark.parametrize("src", ["bshd", "bhsd", "bhds", "sglang_nhd", "sglang_hnd"])
@pytest.mark.parametrize("dst", ["bshd", "bhsd", "bhds", "split_x", "sglang_nhd"])
def test_convert_round_trip(src, dst):
    storage = layouts.allocate(src, num_blocks=NB, block_size=B, num_kv_heads=H,
                               head_dim=D, dtype=torch.float16)
    canon = layouts.view(storage, src, block_size=B)
    converted = layouts.convert(canon, dst)
    back = converted if dst == "split_x" else layouts.view(converted, dst, block_size=B)
    if dst == "split_x":
        back = back.permute(0, 1, 3, 2, 4).reshape(NB, H, B, D)
    assert torch.equal(back, canon)
    if src == dst:
        assert converted.data_ptr() == storage.data_ptr()  # same layout: no copy


def test_convert_pair_to_vllm():
    k = torch.randn(NB, H, B, D)
    v = torch.randn(NB, H, B, D)
    kv = layouts.convert_pair_to_vllm(k, v)
    kk, vv = layouts.vllm_kv_views(kv)
    assert torch.equal(kk, k) and torch.equal(vv, v)


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="layout must be one of"):
        layouts.view(torch.zeros(2, 2, 2, 2), "nope")
    with pytest.raises(ValueError, match="block_size"):
        layouts.view(torch.zeros(10, 2, 4), "sglang_nhd", block_size=3)
    with pytest.raises(ValueError, match="2\\*head_dim"):
        layouts.vllm_kv_views(torch.zeros(2, 2, 2, 3))
