"""SGLang rows of ``bench overhead``: our backend on SGLang's own pools (imports SGLang)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from hygon_attn_backend.tools.bench._overhead_shapes import DECODE, EXTEND


def rows(*, num_q_heads, num_kv_heads, head_dim, page_size, device, dtype):
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    from hygon_attn_backend.integrations.sglang.backend import HygonAttnBackend

    max_ctx = max(DECODE["ctx"], EXTEND["prefix"] + EXTEND["new"]) + page_size
    max_reqs = max(DECODE["num_seqs"], EXTEND["num_seqs"])
    pages = max_reqs * (-(-max_ctx // page_size)) + 2
    dev = str(device)
    pool = MHATokenToKVPool(size=pages * page_size, page_size=page_size, dtype=dtype,
                            head_num=num_kv_heads, head_dim=head_dim, layer_num=1, device=dev,
                            enable_memory_saver=False, enable_alt_stream=False)
    req_pool = ReqToTokenPool(size=max_reqs, max_context_len=max_ctx, device=dev,
                              enable_memory_saver=False)
    # each request owns whole pages in a random order (page 0 is SGLang's padding page)
    perm = (torch.randperm(pages - 1, device=device) + 1).view(-1)
    per_req = -(-max_ctx // page_size)
    slots = (perm[:max_reqs * per_req].view(max_reqs, per_req, 1) * page_size
             + torch.arange(page_size, device=device)).view(max_reqs, -1)[:, :max_ctx]
    req_pool.req_to_token[:max_reqs, :max_ctx] = slots.to(torch.int32)
    layer = RadixAttention(num_heads=num_q_heads, head_dim=head_dim, scaling=head_dim ** -0.5,
                           num_kv_heads=num_kv_heads, layer_id=0)
    runner = SimpleNamespace(device=dev, req_to_token_pool=req_pool, token_to_kv_pool=pool,
                             page_size=page_size)
    backend = HygonAttnBackend(runner)

    def batch(mode, n, seq, new):
        lens = [seq] * n
        rows_ = torch.arange(n, dtype=torch.int64, device=device)
        loc = slots[:n, seq - new:seq].reshape(-1).to(torch.int64)
        kw = {}
        if mode == ForwardMode.EXTEND:
            kw = dict(extend_seq_lens=torch.full((n,), new, dtype=torch.int32, device=device),
                      extend_seq_lens_cpu=[new] * n,
                      extend_prefix_lens=torch.full((n,), seq - new, dtype=torch.int32,
                                                    device=device),
                      extend_prefix_lens_cpu=[seq - new] * n, extend_num_tokens=n * new)
        return ForwardBatch(
            forward_mode=mode, batch_size=n,
            input_ids=torch.zeros(n * new, dtype=torch.int64, device=device),
            req_pool_indices=rows_, seq_lens=torch.tensor(lens, device=device),
            seq_lens_cpu=torch.tensor(lens), out_cache_loc=loc, seq_lens_sum=sum(lens),
            positions=torch.zeros(n * new, dtype=torch.int64, device=device), **kw)

    def row(mode, n, seq, new, part="layer"):
        """part: ``layer`` (SGLang's K/V store + our attention, as a layer calls it),
        ``attention`` (ours alone: ``save_kv_cache=False``), ``store`` (SGLang's
        ``set_kv_buffer`` alone, which every backend's layer pays)."""
        fb = batch(mode, n, seq, new)
        q = torch.randn(n * new, num_q_heads * head_dim, device=device, dtype=dtype)
        k = torch.randn(n * new, num_kv_heads, head_dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        backend.init_forward_metadata(fb)  # once per step (every layer shares it)
        meta = backend.forward_metadata

        def step():
            backend.forward_metadata = meta
            return backend.forward(q, k, v, layer, fb, save_kv_cache=part == "layer")

        def store():
            pool.set_kv_buffer(layer, fb.out_cache_loc, k, v)

        return store if part == "store" else step

    decode = (ForwardMode.DECODE, DECODE["num_seqs"], DECODE["ctx"], 1)
    extend = (ForwardMode.EXTEND, EXTEND["num_seqs"], EXTEND["prefix"] + EXTEND["new"],
              EXTEND["new"])
    yield "SGLang forward_decode", row(*decode)
    yield "SGLang forward_decode, attention only (save_kv_cache=False)", row(*decode,
                                                                            "attention")
    yield "SGLang set_kv_buffer alone (decode batch)", row(*decode, "store")
    yield "SGLang forward_extend", row(*extend)
    yield "SGLang forward_extend, attention only (save_kv_cache=False)", row(*extend,
                                                                            "attention")
    yield "SGLang set_kv_buffer alone (extend batch)", row(*extend, "store")
