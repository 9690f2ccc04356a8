"""SGLang decode context parallelism (``--dcp-size 2``) through ``HygonAttnBackend``, on two
CPU processes (gloo).

Each process is one rank of SGLang's DCP group, set up as SGLang 0.5.23 sets it: a
``GroupCoordinator`` over gloo published as ``get_parallel().dcp_group`` with
``attn_dcp_size`` / ``attn_dcp_rank``; the allocator and the radix tree page ``P * 2``
slots over the global slot space while the rank's ``MHATokenToKVPool`` pages ``P`` rows
(``tests/support/sglang_harness.Server(dcp_size=2)``). Both ranks schedule identically (the
same seed), as SGLang's ranks do. The backend writes each new token through its own write
path (SGLang's masked ``set_kv_buffer``: row ``out_cache_loc // 2`` on the rank of
``position % 2``), so each rank's pool holds its shard only (checked); then decode and
extend (a first prefill of two requests, decodes, a mixed batch: a second turn over the
radix-cached prefix, a decode row and a new request) run on both ranks, and each rank's
heads are checked against ``reference.py`` in fp64 on the unsharded sequence (the keys read
from an fp8 pool rounded as it stores them), within the budget the other tests use (4x the
fp16 reference's own error, plus the floor). SGLang's own Triton backend runs every pass of
the fp16 cases too, on the same batches, pool and group (built on the runner of SGLang's
attention test kit): its outputs meet the same budget and lie within it of ours, except
where it is wrong (see ``OVER_A_PREFIX``). The Triton kernels (ours, SGLang's attention
and its masked write) run in the interpreter.

The refusals (HND pool, speculative decoding, CUDA graphs, sliding window, sinks) are
checked in this process with a stand-in group (they stop before any collective).
"""

from __future__ import annotations

import os
import random
import tempfile
import types

import pytest
import torch

pytest.importorskip("sglang.srt.layers.dcp")

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from hygon_attn_backend import reference  # noqa: E402
from hygon_attn_backend.integrations.sglang import dcp  # noqa: E402
from hygon_attn_backend.ops.context_parallel import local_lens  # noqa: E402

WORLD = 2
#: (query heads, KV heads) of the model, page size, KV cache: a rank holds half the query
#: heads and every KV head; (8, 2): each rank's heads read one KV head of two, (4, 1): all
#: one head; "fp8": an e4m3 pool with scale 0.5 (SGLang's --kv-cache-dtype, layer scales)
CASES = [((8, 2), 1, None), ((8, 2), 16, None), ((4, 1), 16, None), ((8, 2), 16, "fp8")]
FP8, FP8_SCALE = torch.float8_e4m3fn, 0.5
HEAD_DIM = 32
#: the rows of the extend pass that attend over a cached prefix. SGLang 0.5.23's own Triton
#: DCP extend (``_forward_extend_dcp``) gets them wrong when the group has more than one KV
#: head: it passes the prefix kernel an empty ``k`` sliced to the rank's KV heads, and
#: ``extend_attention_fwd`` takes the GQA group from that (``q.shape[1] //
#: k_extend.shape[1]``: ``W`` times too large), so the all-gathered heads read the wrong KV
#: heads of the shard (rank 1 of 8 q / 2 kv heads: off by up to 34 where the fp64 oracle and
#: ours agree to 1e-2). Our output is checked there against the oracle only.
OVER_A_PREFIX = ("mixed: c over the cache", "mixed: b's decode row")


def _tokens(rng, n):
    return [rng.randrange(1, 1000) for _ in range(n)]


def fp8_round(x):
    """SGLang's fp8 write (``x / scale`` cast to e4m3) and our read (``* scale``)."""
    return ((x / FP8_SCALE).to(FP8).to(torch.float32) * FP8_SCALE).to(x.dtype)


def oracle(model, tokens, positions, heads: slice, *, cached: int = 0, fp8: bool = False):
    """reference.py on the unsharded sequence: ``positions`` (the last ones of ``tokens``)
    attending causally to every earlier key, in fp64 and in fp16; this rank's heads. With
    ``fp8`` the first ``cached`` keys (those the pass reads from the pool) are rounded as the
    pool stores them."""
    q, k, v = model.qkv(tokens, range(len(tokens)))
    if fp8:
        k, v = k.clone(), v.clone()
        k[:cached], v[:cached] = fp8_round(k[:cached]), fp8_round(v[:cached])
    # every query head (the GQA grouping is the model's), this rank's kept afterwards
    q = q.view(len(tokens), model.num_heads, model.head_dim)[positions[0]:positions[-1] + 1]
    k_cache = k.transpose(0, 1).unsqueeze(0)  # [1 block, Hkv, L, D]
    v_cache = v.transpose(0, 1).unsqueeze(0)
    table = torch.zeros(1, 1, dtype=torch.int32)
    cu = torch.tensor([0, len(positions)], dtype=torch.int32)
    lens = torch.tensor([len(tokens)], dtype=torch.int32)
    args = (k_cache, v_cache, table, cu, lens)
    ref64 = reference.prefix_prefill_attention(q.double(), *args, scale=model.scale,
                                               compute_dtype=torch.float64)
    ref16 = reference.prefix_prefill_attention(q, *args, scale=model.scale,
                                               compute_dtype=torch.float16)
    return ref64[:, heads], ref16[:, heads]


def check_shard(srv, reqs):
    """The rank's pool holds exactly its tokens: position ``j`` of a request (slot ``L``) is
    at row ``L // W`` iff ``j % W == rank`` (and ``L % W == j % W``); no other row is
    written. Returns the local lengths."""
    W, rank = srv.dcp_size, srv.dcp_rank
    k_buf = srv.pool.get_key_buffer(0)
    fp8 = k_buf.dtype == FP8
    r2t = srv.req_to_token_pool.req_to_token
    mine = 0
    for r in reqs:
        _, k, _ = srv.model.qkv(r.tokens[:r.kv_len], range(r.kv_len))
        for j in range(r.kv_len):
            slot = int(r2t[r.row, j])
            assert slot % W == j % W, f"slot {slot} of position {j}: not the owner rule"
            if j % W == rank:
                want = (k[j] / FP8_SCALE).to(FP8) if fp8 else k[j]
                assert torch.equal(k_buf[slot // W].view(torch.uint8), want.view(torch.uint8)), \
                    f"position {j} not at row {slot // W}"
                mine += 1
    written = int((k_buf.view(torch.uint8) != 0).flatten(1).any(dim=1).sum())
    assert written == mine, f"{written} rows written on rank {rank}, {mine} tokens owned"
    return mine


def check_block_table(srv, reqs):
    """The last pass's local block table addresses, for local token ``t``, the row SGLang's
    ``create_triton_kv_indices_for_dcp_triton`` reads: ``req_to_token[row, t * W + rank] //
    W``."""
    W, rank, P = srv.dcp_size, srv.dcp_rank, srv.pool.page_size
    meta = srv.backend.forward_metadata
    r2t = srv.req_to_token_pool.req_to_token
    for b, r in enumerate(reqs):
        n = int(meta.local_lens[b])
        t = torch.arange(n)
        ours = meta.block_table[b].long()[t // P] * P + t % P
        theirs = r2t[r.row, t * W + rank].long() // W
        assert torch.equal(ours, theirs), f"request {b}: {ours.tolist()} vs {theirs.tolist()}"


def sglang_triton_twin(srv, model):
    """SGLang's own Triton backend (``TritonAttnBackend``, its DCP path) over the same
    ``ReqToTokenPool``, pool and allocator as ``srv``'s backend, built on the runner of
    SGLang's attention test kit (``sglang.test.kits.attention_unittest``), its model config
    holding the model's heads (the backend divides them by ``attn_tp_size`` and multiplies
    them by ``attn_dcp_size`` itself)."""
    from sglang.srt.layers.attention.triton_backend import TritonAttnBackend
    from sglang.test.kits.attention_unittest.attention_methods import dense_attention as kit

    # the kit enters get_parallel().override(attn_tp_size=1, attn_dcp_rank=0) when imported
    # (for its one-process cases), which would hide this rank's DCP state: leave it
    if getattr(kit, "_parallel_override", None) is not None and \
            not getattr(kit, "_left_by_dcp_test", False):
        kit._parallel_override.__exit__(None, None, None)
        kit._left_by_dcp_test = True
    case = kit.DenseAttentionCase(name="dcp", backend="triton", forward_mode=ForwardMode.DECODE,
                                  num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                                  page_size=srv.pool.page_size, prefix_lens=(1,))
    cfg = kit.TinyModelConfig(num_heads=model.num_heads, num_kv_heads=model.num_kv_heads,
                              head_dim=model.head_dim, hidden_size=64,
                              context_len=srv.req_to_token_pool.req_to_token.shape[1])
    runner = kit.MockModelRunner(case=case, model_config=cfg, dtype=model.dtype, device="cpu",
                                 max_context_len=srv.req_to_token_pool.req_to_token.shape[1],
                                 head_dim=model.head_dim,
                                 runner_batch_size=srv.req_to_token_pool.req_to_token.shape[0])
    runner.req_to_token_pool = srv.req_to_token_pool
    runner.token_to_kv_pool = srv.pool
    runner.token_to_kv_pool_allocator = srv.allocator
    runner.init_kv_index_translator()
    return TritonAttnBackend(runner)


def run_case(rank: int, heads, page_size: int, kv) -> dict:
    from tests.support.sglang_harness import Server, TinyModel

    class TwinServer(Server):
        """Each pass run by our backend, then by SGLang's Triton backend on the same batch
        (its masked write stores the same rows again)."""

        def _run(self, batch, q, k, v):
            out = super()._run(batch, q, k, v)
            if self.twin is None:
                return out
            h, d = self.num_heads, self.model.head_dim
            q_rank = q.view(q.shape[0], -1, d)[:, self.dcp_rank * h:(self.dcp_rank + 1) * h]
            self.twin.init_forward_metadata(batch)
            theirs = self.twin.forward(q_rank.reshape(q.shape[0], h * d), k, v, self.layer,
                                       batch)
            self.twin_out = theirs.view(-1, h, d)
            return out

    num_heads, num_kv_heads = heads
    seed = 31 + page_size + num_heads
    model = TinyModel(dtype=torch.float16, seed=seed, num_heads=num_heads,
                      num_kv_heads=num_kv_heads, head_dim=HEAD_DIM)
    fp8 = dict(kv_dtype=FP8, k_scale=FP8_SCALE) if kv == "fp8" else {}
    srv = TwinServer(model, page_size=page_size, seed=seed, dcp_size=WORLD, dcp_rank=rank,
                     **fp8)
    # SGLang's Triton decode over this fp8 pool came out 0.3 to 3 off the oracle here (its
    # kernels in the CPU interpreter; where that goes wrong was not looked into): the fp8
    # case runs ours only
    srv.twin = None if fp8 else sglang_triton_twin(srv, model)
    assert srv.twin is None or (srv.twin.dcp_size, srv.twin.dcp_rank) == (WORLD, rank)
    rng = random.Random(seed)
    h = num_heads // WORLD
    mine = slice(rank * h, (rank + 1) * h)
    checks, twins = [], []

    def record(outs, *rows):
        """``rows``: ``(request, positions, what, cached)`` of each request of the pass
        (``cached``: the keys it reads from the pool; the others come as the pass's k/v)."""
        theirs = srv.twin_out.split([o.shape[0] for o in outs]) if srv.twin else outs
        for out, twin, (req, positions, what, cached) in zip(outs, theirs, rows):
            ref64, ref16 = oracle(model, req.tokens[:positions[-1] + 1], positions, mine,
                                  cached=cached, fp8=bool(fp8))
            checks.append((what, out.clone(), ref64, ref16))
            if srv.twin is not None:
                twins.append((what, twin.clone(), ref64, ref16, out.clone()))

    n1 = 29 if page_size == 1 else 29 + 2 * page_size  # ends mid-page
    a, b = srv.start(_tokens(rng, n1)), srv.start(_tokens(rng, 7))
    outs = srv.extend([a, b])  # first prefill of two requests (no prefix anywhere)
    record(outs, (a, list(range(n1)), "prefill a", 0), (b, list(range(7)), "prefill b", 0))
    for step in range(3):
        outs = srv.decode([a, b], [rng.randrange(1, 1000), rng.randrange(1, 1000)])
        record(outs, (a, [a.kv_len - 1], f"decode {step} a", a.kv_len),
               (b, [b.kv_len - 1], f"decode {step} b", b.kv_len))
    check_block_table(srv, [a, b])
    owned = check_shard(srv, [a, b])
    history = list(a.tokens)
    srv.finish(a)
    c = srv.start(history + _tokens(rng, 13))  # second turn over the cached prefix
    assert c.cached_len == len(history) // srv.page_size * srv.page_size > 0
    d = srv.start(_tokens(rng, 5))  # a new request: no prefix on either rank
    b.tokens.append(rng.randrange(1, 1000))  # b's next token as a decode row of the batch
    outs = srv.extend([c, b, d], mode=ForwardMode.MIXED)
    record(outs, (c, list(range(c.cached_len, len(c.tokens))), "mixed: c over the cache",
                  c.cached_len),
           (b, [b.kv_len - 1], "mixed: b's decode row", b.kv_len - 1),
           (d, list(range(5)), "mixed: d's first prefill", 0))
    outs = srv.decode([c, b, d], [rng.randrange(1, 1000) for _ in range(3)])
    record(outs, *[(r, [r.kv_len - 1], f"turn 2 decode {name}", r.kv_len)
                   for r, name in zip([c, b, d], "cbd")])
    check_block_table(srv, [c, b, d])
    plans = srv.backend.forward_metadata.plans.values()
    return dict(checks=checks, twins=twins, owned=owned,
                plans=sorted({p.impl for by_kind in plans for p in by_kind.values()}))


def publish_dcp(rank: int, group) -> None:
    """This process as rank ``rank`` of a DCP group of ``WORLD`` over the TP group of
    ``WORLD`` (SGLang's parallel state)."""
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(
        attn_tp_size=WORLD, dcp_size=WORLD, dcp_enabled=True,
        attn_dcp_size=WORLD, dcp_rank=rank, attn_dcp_rank=rank, dcp_group=group)


def rank_main(rank: int, store: str, results: str) -> None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD)
    try:
        from sglang.srt.distributed.parallel_state import GroupCoordinator
        from sglang.srt.runtime_context import get_parallel

        group = GroupCoordinator([list(range(WORLD))], rank, "gloo", use_pynccl=False,
                                 use_mscclpp=False, use_custom_allreduce=False,
                                 use_torch_symm_mem_all_reduce=False,
                                 use_hpu_communicator=False, use_xpu_communicator=False,
                                 group_name="dcp")
        publish_dcp(rank, group)
        res = {case: run_case(rank, *case) for case in CASES}
        torch.save(res, os.path.join(results, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_two_rank_dcp_decode_and_extend_match_the_reference():
    import torch.multiprocessing as mp

    from tests.support.budget import assert_within_budget

    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(rank_main, args=(os.path.join(tmp, "store"), tmp), nprocs=WORLD,
                           join=True, start_method="spawn")
        results = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]
    for case in CASES:
        for rank in range(WORLD):
            res = results[rank][case]
            for what, out, ref64, ref16 in res["checks"]:
                assert_within_budget(out, ref64, ref16,
                                     what=f"{case} rank {rank} {what}")
            assert len(res["checks"]) == 14
            assert len(res["twins"]) == (0 if case[2] == "fp8" else 14)
            for what, theirs, ref64, ref16, ours in res["twins"]:
                if case[0][1] > 1 and what in OVER_A_PREFIX:
                    continue  # SGLang 0.5.23 reads the wrong KV heads there (see above)
                # SGLang's Triton backend on the same shards: the same budget, and close to ours
                _, budget = assert_within_budget(theirs, ref64, ref16,
                                                 what=f"{case} rank {rank} {what} (SGLang)")
                diff = (ours.double() - theirs.double()).abs().max().item()
                assert diff <= budget, f"{case} rank {rank} {what}: ours vs SGLang's {diff:.3e}"
            assert res["plans"] == ["triton"], res["plans"]  # our kernels (the interpreter)
        # the shards split the sequences: both ranks' stored tokens add up to the whole
        assert results[0][case]["owned"] + results[1][case]["owned"] == \
            (29 if case[1] == 1 else 29 + 2 * case[1]) + 3 + 7 + 3


# ---------------------------------------------------------------------- one process


class _Group:
    """A stand-in DCP group for what stops before any collective."""

    def __init__(self, world_size=WORLD, rank_in_group=0):
        self.world_size, self.rank_in_group = world_size, rank_in_group

    def all_gather(self, *args, **kwargs):
        raise AssertionError("no collective expected")


@pytest.fixture
def dcp2(monkeypatch):
    runtime_context = pytest.importorskip("sglang.srt.runtime_context")
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: types.SimpleNamespace(
        attn_tp_size=WORLD, attn_dcp_size=WORLD, attn_dcp_rank=0, dcp_group=_Group()))


def _server(**kw):
    from tests.support.sglang_harness import Server, TinyModel

    model = TinyModel(dtype=torch.float16, seed=5, num_heads=8, num_kv_heads=2,
                      head_dim=HEAD_DIM)
    for name in ("window", "sinks"):
        if name in kw:
            setattr(model, name, kw.pop(name))
    return Server(model, page_size=16, dcp_size=WORLD, dcp_rank=0, **kw)


def test_hnd_pool_is_refused_under_dcp(dcp2, monkeypatch):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    if "kv_cache_layout" not in MHATokenToKVPool.__init__.__code__.co_varnames:
        pytest.skip("this SGLang has no HND pool")
    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    with pytest.raises(NotImplementedError, match=r"layout is 'hnd'.*SGLANG_USE_HND_KVCACHE"):
        _server()


def test_speculative_decoding_and_cuda_graphs_are_refused_under_dcp(dcp2):
    from hygon_attn_backend.integrations.sglang.backend import HygonAttnBackend

    srv = _server()
    req = srv.start(_tokens(random.Random(5), 8))
    batch = srv._batch(ForwardMode.TARGET_VERIFY, [req], [8], torch.zeros(8, dtype=torch.int64),
                       list(range(8)))
    with pytest.raises(NotImplementedError, match=r"TARGET_VERIFY \(speculative decoding\) "
                                                  r"with decode context parallelism"):
        srv.backend.init_forward_metadata(batch)
    with pytest.raises(NotImplementedError, match="speculative decoding with decode context "
                                                  r"parallelism \(--dcp-size 2\)"):
        HygonAttnBackend(types.SimpleNamespace(
            device="cpu", req_to_token_pool=srv.req_to_token_pool, token_to_kv_pool=srv.pool),
            draft_rows_per_request=2)
    with pytest.raises(NotImplementedError, match="CUDA graphs with decode context "
                                                  r"parallelism.*--disable-cuda-graph"):
        srv.backend.init_cuda_graph_state(4, 4)


@pytest.mark.parametrize("option", ["window", "sinks"])
def test_window_and_sinks_are_refused_under_dcp(dcp2, option):
    value = 9 if option == "window" else torch.zeros(8)
    srv = _server(**{option: value})
    req = srv.start(_tokens(random.Random(6), 8))
    with pytest.raises(NotImplementedError, match="sliding-window" if option == "window"
                       else "attention sinks"):
        srv.extend([req])


def test_rank_kv_heads_match_sglangs_split_and_refuse_straddling():
    for hq, hkv, w in [(4, 2, 2), (2, 1, 2), (1, 2, 4), (4, 8, 2), (3, 2, 2), (6, 3, 4)]:
        if (hq * w) % hkv:
            continue
        for r in range(w):
            try:
                ours = dcp.rank_kv_heads(hq, hkv, w, r)
            except ValueError:
                continue
            # SGLang's Triton extend (_forward_extend_dcp)
            start = r * hkv // w
            stop = max((r + 1) * hkv // w, start + 1)
            assert (ours.start, ours.stop) == (start, stop), (hq, hkv, w, r)
            group = hq * w // hkv
            heads = range(r * hq, (r + 1) * hq)
            assert {h // group for h in heads} == set(range(ours.start, ours.stop))
    with pytest.raises(ValueError, match="straddle"):
        dcp.rank_kv_heads(2, 2, 3, 0)  # group 3 of 2 heads a rank: rank 1 reads KV heads 0, 1
    with pytest.raises(ValueError, match="num_kv_heads \\(3\\) must divide"):
        dcp.rank_kv_heads(2, 3, 2, 0)
    with pytest.raises(ValueError, match="rank must be in"):
        dcp.rank_kv_heads(2, 1, 2, 2)


def test_local_lens_equal_sglangs_get_dcp_lens():
    from sglang.srt.layers.dcp.layout import get_dcp_lens

    lens = torch.tensor([0, 1, 2, 3, 5, 16, 17, 33, 100, 257], dtype=torch.int64)
    for world in (2, 4):
        for rank in range(world):
            ours = local_lens(lens, world_size=world, rank=rank)
            assert ours.tolist() == get_dcp_lens(lens, world, rank).tolist(), (world, rank)


def test_write_mask_is_sglangs():
    batch = types.SimpleNamespace(positions=torch.arange(10), dcp_kv_mask=None)
    assert dcp.dcp_write_mask(batch, 2, 1, 10).tolist() == [j % 2 == 1 for j in range(10)]
    batch.dcp_kv_mask = torch.ones(4, dtype=torch.bool)
    assert dcp.dcp_write_mask(batch, 2, 1, 4).tolist() == [True] * 4
    batch.dcp_kv_mask = None
    with pytest.raises(ValueError, match="positions of the 4 new tokens"):
        dcp.dcp_write_mask(batch, 2, 1, 4)


def test_dcp_group_checks_its_arguments():
    with pytest.raises(ValueError, match="world_size must be an int >= 2"):
        dcp.DcpGroup(1, 0, _Group(), pool_page_size=1)
    with pytest.raises(ValueError, match="rank must be in"):
        dcp.DcpGroup(2, 2, _Group(), pool_page_size=1)
    with pytest.raises(ValueError, match="group: decode context parallelism needs"):
        dcp.DcpGroup(2, 0, None, pool_page_size=1)
    with pytest.raises(ValueError, match="group: dcp_group has world_size 2, rank 1"):
        dcp.DcpGroup(2, 0, _Group(rank_in_group=1), pool_page_size=1)


def test_model_heads_under_dcp_replicate_kv_heads(monkeypatch):
    """Under DCP a rank's KV heads are ``get_num_kv_heads(attn_tp_size, dcp_size)`` (the
    group's, replicated), as SGLang's pool and Triton backend read them."""
    runtime_context = pytest.importorskip("sglang.srt.runtime_context")
    from hygon_attn_backend.integrations.sglang import backend as sgl_backend

    class Config:
        num_attention_heads, head_dim = 32, 128

        def get_num_kv_heads(self, tp, dcp=1):
            return max(1, 8 // (tp // dcp))

    runner = types.SimpleNamespace(model_config=Config(), dtype=torch.bfloat16)
    monkeypatch.setattr(runtime_context, "get_parallel", lambda: types.SimpleNamespace(
        attn_tp_size=4, attn_dcp_size=2))
    assert sgl_backend._model_heads(runner) == (8, 4, 128, torch.bfloat16)


def test_dcp_size_one_is_the_plain_backend(monkeypatch):
    """Unpublished parallel state, or ``attn_dcp_size`` 1: no DCP side, nothing refused."""
    runtime_context = pytest.importorskip("sglang.srt.runtime_context")
    from tests.support.sglang_harness import Server, TinyModel

    model = TinyModel(dtype=torch.float16, seed=3, num_heads=8, num_kv_heads=2,
                      head_dim=HEAD_DIM)
    assert Server(model, page_size=16).backend._dcp is None
    monkeypatch.setattr(runtime_context, "get_parallel",
                        lambda: types.SimpleNamespace(attn_tp_size=2, attn_dcp_size=1))
    assert Server(model, page_size=16).backend._dcp is None
