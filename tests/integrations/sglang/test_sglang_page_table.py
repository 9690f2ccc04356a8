"""SGLang's structures as our block tables (ops.page_table, integrations/sglang/page_table.py).

Includes the worked example of DESIGN/issue 2: three requests with extend lens [2, 3, 1]
and seq lens [6, 3, 6] over token slots scattered in a page-size-1 pool, given once as a
block table and once as SGLang's ``kv_indptr / kv_indices``.
"""

import pytest
import torch

from hygon_attn_backend import layouts, reference
from hygon_attn_backend.integrations.sglang import page_table as shims

# ---------------------------------------------------------------- the worked example

EXTEND_LENS = [2, 3, 1]
SEQ_LENS = [6, 3, 6]
QO_INDPTR = [0, 2, 5, 6]
KV_INDPTR = [0, 6, 9, 15]
KV_INDICES = [108, 109, 110, 111, 42, 43, 201, 202, 203, 80, 81, 82, 83, 84, 99]
TABLE = [[108, 109, 110, 111, 42, 43],
         [201, 202, 203, 0, 0, 0],
         [80, 81, 82, 83, 84, 99]]
ROWS = [5, 2, 7]  # the requests' req_to_token rows (any rows: the batch order is the rows')


def _dense_causal(q, k, v, prefix, scale):
    """Dense causal attention of one request in float64: row i sees keys j <= i + prefix."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    i = torch.arange(q.shape[0]).unsqueeze(1)
    j = torch.arange(k.shape[0]).unsqueeze(0)
    s = s.masked_fill(~(j <= i + prefix).unsqueeze(0), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v)


def _worked_example_inputs(num_q_heads=4, num_kv_heads=2, head_dim=16):
    torch.manual_seed(0)
    slots = 256
    k_store = torch.randn(slots, num_kv_heads, head_dim, dtype=torch.float64)  # sglang_nhd
    v_store = torch.randn(slots, num_kv_heads, head_dim, dtype=torch.float64)
    q = torch.randn(QO_INDPTR[-1], num_q_heads, head_dim, dtype=torch.float64)
    return q, k_store, v_store


# ---------------------------------------------------------------- req_to_token -> table

PAGE_SIZES = (1, 16, 64)


def _paged_rows(page_size, seq_lens, *, max_context=256, num_rows=6, seed=0):
    """req_to_token rows as SGLang's paged allocator fills them: whole pages, scattered
    (shuffled page ids), each page's tokens consecutive; sequences end mid-page."""
    g = torch.Generator().manual_seed(seed)
    req_to_token = torch.zeros(num_rows, max_context, dtype=torch.int32)
    pages_per_row = max_context // page_size
    perm = torch.randperm(num_rows * pages_per_row, generator=g) + 1  # page 0 is padding
    rows = torch.randperm(num_rows - 1, generator=g)[: len(seq_lens)] + 1
    for i, (row, length) in enumerate(zip(rows.tolist(), seq_lens)):
        pages = perm[i * pages_per_row:(i + 1) * pages_per_row]
        pos = torch.arange(length)
        req_to_token[row, :length] = (pages[pos // page_size] * page_size + pos % page_size).int()
    return req_to_token, rows


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_req_to_token_table_addresses_every_token(page_size):
    seq_lens = [1, page_size + 3, 3 * page_size - 1, 130]
    req_to_token, rows = _paged_rows(page_size, seq_lens)
    table = shims.req_to_token_table(req_to_token, rows, page_size=page_size)
    assert table.dtype == torch.int32 and table.shape == (4, -(-256 // page_size))
    shims.check_paged_rows(req_to_token, rows, torch.tensor(seq_lens), page_size=page_size)
    for b, (row, length) in enumerate(zip(rows.tolist(), seq_lens)):
        pos = torch.arange(length)
        addr = table[b, pos // page_size].long() * page_size + pos % page_size
        assert torch.equal(addr, req_to_token[row, :length].long())


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_req_to_token_table_out_form_is_static_and_equal(page_size):
    req_to_token, rows = _paged_rows(page_size, [5, 70, 200])
    want = shims.req_to_token_table(req_to_token, rows, page_size=page_size)
    buf = torch.full((8, want.shape[1]), -7, dtype=torch.int32)
    got = shims.req_to_token_table(req_to_token, rows, page_size=page_size, out=buf[:3])
    assert got.data_ptr() == buf.data_ptr() and torch.equal(buf[:3], want)
    assert (buf[3:] == -7).all(), "rows past the batch are left alone"


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_paged_attention_through_the_table_equals_token_gather(page_size):
    """Attention read through the page table and a ``[pages, H, P, D]`` view equals the
    same attention read token by token from the ``[rows, H, 1, D]`` view."""
    seq_lens = [page_size + 5, 2 * page_size + 1, 7]
    req_to_token, rows = _paged_rows(page_size, seq_lens, seed=1)
    num_slots = (req_to_token.max().item() // page_size + 1) * page_size
    torch.manual_seed(1)
    k_store = torch.randn(num_slots, 2, 16, dtype=torch.float64)
    v_store = torch.randn(num_slots, 2, 16, dtype=torch.float64)
    q = torch.randn(3, 4, 16, dtype=torch.float64)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    paged = reference.paged_decode_attention(
        q, layouts.view(k_store, "sglang_nhd", block_size=page_size),
        layouts.view(v_store, "sglang_nhd", block_size=page_size),
        shims.req_to_token_table(req_to_token, rows, page_size=page_size), lens,
        compute_dtype=torch.float64)
    tokens = reference.paged_decode_attention(
        q, layouts.view(k_store, "sglang_nhd", block_size=1),
        layouts.view(v_store, "sglang_nhd", block_size=1),
        shims.req_to_token_table(req_to_token, rows, page_size=1), lens,
        compute_dtype=torch.float64)
    torch.testing.assert_close(paged, tokens, rtol=0, atol=1e-12)


def test_check_paged_rows_rejects_a_scattered_page():
    req_to_token, rows = _paged_rows(16, [40])
    req_to_token[rows[0], 20] += 1  # token 20 no longer next to token 19 in its page
    with pytest.raises(ValueError, match="not page-contiguous"):
        shims.check_paged_rows(req_to_token, rows, torch.tensor([40]), page_size=16)


# ---------------------------------------------------------------- ragged <-> padded


# ---------------------------------------------------------------- bad input


# ---------------------------------------------------------------- SGLang's pools


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU path of SGLang's pools: on a "
                    "CUDA host its store and allocator kernels refuse CPU tensors (no "
                    "interpreter there); the GPU form runs in tests/test_sglang_backend.py")
@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_pool_views_read_what_set_kv_buffer_wrote(layout, page_size, monkeypatch):
    pytest.importorskip("sglang.srt.mem_cache.memory_pool")
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1" if layout == "hnd" else "0")
    pool = MHATokenToKVPool(size=256, page_size=page_size, dtype=torch.float16, head_num=2,
                            head_dim=16, layer_num=2, device="cpu", enable_memory_saver=False,
                            enable_alt_stream=False)
    if not hasattr(pool, "kv_cache_layout"):  # SGLang 0.5.10: one layout
        if layout == "hnd":
            pytest.skip("this SGLang's MHATokenToKVPool stores NHD only (no "
                        "SGLANG_USE_HND_KVCACHE)")
    else:
        assert pool.kv_cache_layout == layout
    layer = RadixAttention(num_heads=4, head_dim=16, scaling=0.25, num_kv_heads=2, layer_id=1)
    locs = torch.randperm(256)[:40] + page_size
    k = torch.randn(40, 2, 16, dtype=torch.float16)
    v = torch.randn(40, 2, 16, dtype=torch.float16)
    pool.set_kv_buffer(layer, locs, k, v)
    k_view, v_view, p = shims.pool_kv_views(pool, 1)
    assert p == page_size and k_view.shape[1:] == (2, page_size, 16)
    assert k_view.data_ptr() == pool.get_key_buffer(1).data_ptr(), "a view, not a copy"
    assert torch.equal(k_view[locs // page_size, :, locs % page_size], k)
    assert torch.equal(v_view[locs // page_size, :, locs % page_size], v)


@pytest.mark.parametrize("page_size", [1, 16, 5])
@pytest.mark.parametrize("rows_dtype", [torch.int32, torch.int64])
def test_req_to_token_table_kernel_equals_the_torch_gather(page_size, rows_dtype):
    """The Triton kernel (CUDA, or the interpreter here) and the torch gather agree
    entry for entry, floor division of negative locations included; rows repeat; the
    destination may be a slice of a wider table (row stride > width)."""
    from hygon_attn_backend.ops.page_table import launch_req_to_token_table

    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the interpreter
    g = torch.Generator().manual_seed(3)
    req_to_token = torch.randint(-40, 5000, (7, 300), generator=g, dtype=torch.int32).to(dev)
    rows = torch.tensor([6, 0, 3, 3], dtype=rows_dtype, device=dev)
    width = -(-300 // page_size)
    firsts = req_to_token.index_select(0, rows.long())[:, ::page_size]
    want = torch.div(firsts, page_size, rounding_mode="floor").int()
    wide = torch.full((4, width + 9), -7, dtype=torch.int32, device=dev)
    launch_req_to_token_table(req_to_token, rows, wide[:, :width], page_size=page_size,
                              block=32)
    assert torch.equal(wide[:, :width], want)
    assert (wide[:, width:] == -7).all(), "columns past the table are left alone"


def test_req_to_token_table_kernel_never_reads_a_bad_row():
    """A row index outside the pool (hostile or corrupt input) is never read: its blocks
    come back as -1, which every attention kernel treats as absent keys."""
    from hygon_attn_backend.ops.page_table import launch_req_to_token_table

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    req_to_token = torch.arange(4 * 64, dtype=torch.int32, device=dev).view(4, 64)
    rows = torch.tensor([2, -1, 4, 1 << 30, 0], dtype=torch.int64, device=dev)
    out = torch.zeros((5, 4), dtype=torch.int32, device=dev)
    launch_req_to_token_table(req_to_token, rows, out, page_size=16)
    want = torch.tensor([[8, 9, 10, 11], [-1] * 4, [-1] * 4, [-1] * 4, [0, 1, 2, 3]],
                        dtype=torch.int32)
    assert torch.equal(out.cpu(), want)
