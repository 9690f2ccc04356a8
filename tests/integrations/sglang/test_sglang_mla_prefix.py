"""The MLA path against our reference, driven as DeepSeek's attention drives it: a
radix-style shared prefix (request B's first pages are request A's), page size 4, an
extend of both requests over their cached prefixes with the new latent rows passed as
``k [N, 1, 576]`` / ``v [N, 1, 512]`` (written by the backend), then a decode step; and
the MHA-method extend (no prefix, ``attn_mha`` with q/k 192-style and v 128-style heads).

The oracle is ``reference_mla_prefill.ragged_attention`` over each request's latent rows
gathered by position from a logical copy (no page table, no pool), keys the whole row,
values its first ``kv_lora_rank`` columns, bottom-right causal.
"""

import pytest
import torch

pytest.importorskip("sglang.test.kits.attention_unittest.attention_methods.mla_attention")

from sglang.srt.layers.radix_attention import RadixAttention  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from sglang.test.kits.attention_unittest.attention_methods import (  # noqa: E402
    mla_attention as kit,
)

from hygon_attn_backend import reference_mla_prefill as ref  # noqa: E402
from hygon_attn_backend.integrations.sglang import register  # noqa: E402
from hygon_attn_backend.integrations.sglang.mla import HygonMLABackend  # noqa: E402

RANK, ROPE, HEADS, PAGE, CONTEXT = 512, 64, 4, 4, 32
WIDTH = RANK + ROPE
SCALE = 0.125  # not the default 1/sqrt(576): the layer's own scale must be used


@pytest.fixture
def no_grad():
    previous = torch.is_grad_enabled()
    torch.set_grad_enabled(False)
    register()
    yield
    torch.set_grad_enabled(previous)


def _runner(dtype, device, *, batch=2):
    case = kit.MLAAttentionCase(name="radix", backend="hygon", forward_mode=ForwardMode.EXTEND,
                                num_heads=HEADS, page_size=PAGE, prefix_lens=(0,) * batch,
                                extend_lens=(1,) * batch)
    config = kit.TinyMLAModelConfig(num_heads=HEADS, kv_lora_rank=RANK,
                                    qk_rope_head_dim=ROPE, hidden_size=64,
                                    context_len=CONTEXT)
    return kit.MockMLAModelRunner(case=case, model_config=config, dtype=dtype,
                                  device=str(device), max_context_len=CONTEXT,
                                  kv_lora_rank=RANK, qk_rope_head_dim=ROPE)


def _batch(runner, mode, rows, prefix, new, device):
    """A ForwardBatch of ``mode`` whose request ``b`` holds ``rows[b]`` (slot of each
    position) with ``prefix[b]`` cached and ``new[b]`` new tokens."""
    for b, slots in enumerate(rows):
        runner.req_to_token_pool.req_to_token[b, :len(slots)] = torch.tensor(slots)
    seq = [p + n for p, n in zip(prefix, new)]
    out_loc = [rows[b][p + i] for b, (p, n) in enumerate(zip(prefix, new)) for i in range(n)]
    positions = [p + i for p, n in zip(prefix, new) for i in range(n)]
    dev = dict(device=device)
    fb = ForwardBatch(forward_mode=mode, batch_size=len(rows),
                      input_ids=torch.zeros(len(out_loc), dtype=torch.int64, **dev),
                      req_pool_indices=torch.arange(len(rows), dtype=torch.int32, **dev),
                      seq_lens=torch.tensor(seq, dtype=torch.int32, **dev),
                      seq_lens_cpu=torch.tensor(seq, dtype=torch.int32),
                      out_cache_loc=torch.tensor(out_loc, dtype=torch.int64, **dev),
                      seq_lens_sum=sum(seq),
                      positions=torch.tensor(positions, dtype=torch.int64, **dev))
    runner.kv_index_translator.bind_own_plan(fb)
    if mode.is_extend():
        fb.extend_prefix_lens = torch.tensor(prefix, dtype=torch.int32, **dev)
        fb.extend_prefix_lens_cpu = list(prefix)
        fb.extend_seq_lens = torch.tensor(new, dtype=torch.int32, **dev)
        fb.extend_seq_lens_cpu = list(new)
        fb.extend_start_loc = torch.tensor([0] + list(torch.tensor(new).cumsum(0)[:-1]),
                                           dtype=torch.int32, **dev)
        fb.extend_num_tokens = sum(new)
    return fb


def _oracle(q, latent, lens_q, lens_k):
    """Each request's queries over its latent rows (``latent[b]`` ``[Lk, W]``)."""
    cu_q = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32)
    keys = torch.cat(latent).float().unsqueeze(1)  # [sum Lk, 1, W]
    out = ref.ragged_attention(q.float().cpu(), keys.cpu(), keys[..., :RANK].cpu(), cu_q,
                               cu_k, scale=SCALE, causal=True, compute_dtype=torch.float64)
    return out.to(q.device)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_radix_shared_prefix_extend_then_decode(dtype, device, no_grad):
    gen = torch.Generator().manual_seed(7)
    runner = _runner(dtype, device)
    backend = HygonMLABackend(runner)
    pool = runner.token_to_kv_pool
    layer = RadixAttention(num_heads=HEADS, head_dim=WIDTH, scaling=SCALE, num_kv_heads=1,
                           layer_id=0, v_head_dim=RANK)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.5).to(dtype=dtype, device=device)

    # Request A cached 10 tokens on pages 2, 3, 4 (the last half full); request B shares
    # A's first two whole pages (8 tokens) as a radix hit, then owns pages 6 and 7.
    # A extends by 3 (into page 4 and page 5), B by 5 (the rest of page 6, page 7).
    pages = {"A": [2, 3, 4, 5], "B": [2, 3, 6, 7]}
    rows = [[p * PAGE + s for p in pages[r] for s in range(PAGE)] for r in ("A", "B")]
    prefix, new = [10, 8], [3, 5]
    logical = [rand(prefix[b] + new[b], WIDTH) for b in range(2)]
    logical[1][:8] = logical[0][:8]  # the shared pages hold A's rows
    cache = pool.get_key_buffer(0)
    for b in range(2):
        cache[torch.tensor(rows[b][:prefix[b]]), 0] = logical[b][:prefix[b]]

    fb = _batch(runner, ForwardMode.EXTEND, rows, prefix, new, device)
    new_rows = torch.cat([logical[b][prefix[b]:] for b in range(2)]).unsqueeze(1)
    q = rand(sum(new), HEADS, WIDTH)
    backend.init_forward_metadata(fb)
    out = backend.forward_extend(q.reshape(sum(new), -1), new_rows, new_rows[..., :RANK],
                                 layer, fb)
    assert out.shape == (sum(new), HEADS * RANK) and out.dtype == dtype
    # the new rows were written where the batch says
    assert torch.equal(cache[fb.out_cache_loc, 0], new_rows[:, 0])
    want = _oracle(q, logical, new, [p + n for p, n in zip(prefix, new)])
    tol = 2e-2 if dtype == torch.float16 else 1e-5
    torch.testing.assert_close(out.view(-1, HEADS, RANK).float(), want, atol=tol, rtol=tol)

    # a decode step: each request appends one token (A in page 5, B in page 7)
    step = [rand(1, WIDTH) for _ in range(2)]
    logical = [torch.cat([logical[b], step[b]]) for b in range(2)]
    seq = [p + n for p, n in zip(prefix, new)]
    fb = _batch(runner, ForwardMode.DECODE, rows, seq, [1, 1], device)
    qd = rand(2, HEADS, WIDTH)
    backend.init_forward_metadata(fb)
    out = backend.forward_decode(qd.reshape(2, -1), torch.cat(step).unsqueeze(1),
                                 torch.cat(step).unsqueeze(1)[..., :RANK], layer, fb)
    want = _oracle(qd, logical, [1, 1], [n + 1 for n in seq])
    torch.testing.assert_close(out.view(-1, HEADS, RANK).float(), want, atol=tol, rtol=tol)


def test_mha_method_extend_without_prefix(device, no_grad):
    """DeepSeek's MHA method (an extend with no cached prefix): ``attn_mha``'s up-projected
    heads (q/k 24, v 16 here; 192/128 in DeepSeek V3) over the new tokens, causal; over a
    cached prefix the same layer is refused by name."""
    gen = torch.Generator().manual_seed(3)
    dtype = torch.float16
    runner = _runner(dtype, device)
    backend = HygonMLABackend(runner)
    mha = RadixAttention(num_heads=HEADS, head_dim=24, scaling=SCALE, num_kv_heads=HEADS,
                         layer_id=0, v_head_dim=16)
    rows = [[p * PAGE + s for p in (2, 3, 4) for s in range(PAGE)],
            [p * PAGE + s for p in (5, 6) for s in range(PAGE)]]
    new = [9, 6]
    fb = _batch(runner, ForwardMode.EXTEND, rows, [0, 0], new, device)
    q, k = (torch.randn(15, HEADS, 24, generator=gen).to(dtype=dtype, device=device)
            for _ in range(2))
    v = torch.randn(15, HEADS, 16, generator=gen).to(dtype=dtype, device=device)
    backend.init_forward_metadata(fb)
    out = backend.forward_extend(q.reshape(15, -1), k, v, mha, fb, save_kv_cache=False)
    cu = torch.tensor([0, 9, 15], dtype=torch.int32)
    want = ref.ragged_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), cu, cu,
                                scale=SCALE, causal=True, compute_dtype=torch.float64)
    torch.testing.assert_close(out.view(15, HEADS, 16).float().cpu(), want, atol=2e-2,
                               rtol=2e-2)

    fb = _batch(runner, ForwardMode.EXTEND, rows, [4, 0], [5, 6], device)
    backend.init_forward_metadata(fb)
    with pytest.raises(NotImplementedError, match="cached prefix"):
        backend.forward_extend(q[:11].reshape(11, -1), k[:11], v[:11], mha, fb,
                               save_kv_cache=False)
