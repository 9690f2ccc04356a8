"""``hygon-attn bench mla --compare flashinfer`` on a CPU: the page description built from
the block table, the wrapper's wiring (through a stand-in module with FlashInfer's
signatures that computes what its documentation says), and the row of a machine without
FlashInfer or a GPU."""

import os
import subprocess
import sys

import pytest
import torch

from hygon_attn_backend.tools.bench import mla


def _problem(tokens=1, batch=3, ctx=40, page=16, heads=4, rank=32, rope=16):
    return mla.build(batch=batch, ctx=ctx, page_size=page, heads=heads, rank=rank, rope=rope,
                     tokens=tokens, dtype=torch.float16, device="cpu")


def test_args_follow_the_block_table():
    prob = _problem(tokens=2)
    prob.seq_lens = torch.tensor([40, 17, 1], dtype=torch.int32)  # 3, 2 and 1 pages of 16
    qo_indptr, kv_indptr, kv_indices, kv_len = mla.flashinfer_mla_args(prob)
    assert all(t.dtype == torch.int32 for t in (qo_indptr, kv_indptr, kv_indices, kv_len))
    assert qo_indptr.tolist() == [0, 2, 4, 6]
    assert kv_indptr.tolist() == [0, 3, 5, 6]
    table = prob.block_table.tolist()
    assert kv_indices.tolist() == table[0][:3] + table[1][:2] + table[2][:1]
    assert kv_len.tolist() == [40, 17, 1]


def test_args_at_page_one():
    prob = _problem(batch=2, ctx=5, page=1)
    _, kv_indptr, kv_indices, _ = mla.flashinfer_mla_args(prob)
    assert kv_indptr.tolist() == [0, 5, 10]
    assert kv_indices.tolist() == prob.block_table.reshape(-1).tolist()


class _Wrapper:
    """``BatchMLAPagedAttentionWrapper``'s constructor, ``plan`` and ``run`` signatures
    (FlashInfer 0.6.18); ``run`` attends in float32 from what ``plan`` copied into the
    graph buffers, the causal mask aligned to the end of each request's keys."""

    made = []

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None,
                 kv_indptr=None, kv_indices=None, kv_len_arr=None, backend="auto"):
        assert use_cuda_graph and backend in ("fa2", "fa3")
        self.bufs = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)
        _Wrapper.made.append(self)

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
             head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type,
             use_profiler=False):
        for buf, src in zip(self.bufs, (qo_indptr, kv_indptr, kv_indices, kv_len_arr)):
            buf[:len(src)].copy_(src)
        self.planned = dict(num_heads=num_heads, head_dim_ckv=head_dim_ckv,
                            head_dim_kpe=head_dim_kpe, page_size=page_size, causal=causal,
                            sm_scale=sm_scale, q_data_type=q_data_type,
                            kv_data_type=kv_data_type)

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None, lse=None, return_lse=False):
        p = self.planned
        assert q_nope.shape[1:] == (p["num_heads"], p["head_dim_ckv"])
        assert q_pe.shape[1:] == (p["num_heads"], p["head_dim_kpe"])
        assert ckv_cache.shape[1:] == (p["page_size"], p["head_dim_ckv"])
        assert kpe_cache.shape[1:] == (p["page_size"], p["head_dim_kpe"])
        assert out.shape == q_nope.shape and q_nope.dtype == p["q_data_type"]
        qo, kvp, idx, lens = (b.tolist() for b in self.bufs)
        for i, n in enumerate(lens):
            pages = torch.tensor(idx[kvp[i]:kvp[i + 1]], dtype=torch.long)
            ckv = ckv_cache[pages].reshape(-1, p["head_dim_ckv"])[:n].float()
            kpe = kpe_cache[pages].reshape(-1, p["head_dim_kpe"])[:n].float()
            qn, qp = q_nope[qo[i]:qo[i + 1]].float(), q_pe[qo[i]:qo[i + 1]].float()
            s = (torch.einsum("thr,kr->thk", qn, ckv)
                 + torch.einsum("thr,kr->thk", qp, kpe)) * p["sm_scale"]
            if p["causal"]:
                t = qn.shape[0]
                hidden = torch.arange(n)[None, :] > (n - t + torch.arange(t))[:, None]
                s = s.masked_fill(hidden[:, None, :], float("-inf"))
            o = torch.einsum("thk,kr->thr", s.softmax(-1), ckv)
            out[qo[i]:qo[i + 1]] = o.to(out.dtype)
        return out


class _Module:
    BatchMLAPagedAttentionWrapper = _Wrapper


@pytest.mark.parametrize("tokens", [1, 3])
def test_runner_wiring_matches_the_reference(tokens):
    prob = _problem(tokens=tokens)
    runner = mla.flashinfer_mla_runner(prob, _Module, "fa3")
    wrapper = _Wrapper.made[-1]
    assert wrapper.planned["causal"] == (tokens > 1)
    assert wrapper.planned["sm_scale"] == prob.scale
    assert runner.name == ("flashinfer mla" if tokens == 1 else f"flashinfer mla q_len {tokens}")
    assert runner.out.shape == prob.q.shape[:-1] + (prob.rank,)
    runner.out.fill_(float("nan"))
    runner.fn()
    ok, err, budget = mla.check(prob, runner.out)
    assert ok, (err, budget)


def test_cache_and_query_go_in_as_views():
    prob = _problem()
    seen = {}
    orig = _Wrapper.run

    def spy(self, q_nope, q_pe, ckv_cache, kpe_cache, out=None):
        seen.update(q_nope=q_nope, q_pe=q_pe, ckv=ckv_cache, kpe=kpe_cache, out=out)
        return orig(self, q_nope, q_pe, ckv_cache, kpe_cache, out=out)

    class Module:
        BatchMLAPagedAttentionWrapper = type("W", (_Wrapper,), {"run": spy})

    runner = mla.flashinfer_mla_runner(prob, Module, "fa2")
    runner.fn()
    elem = prob.kv.element_size()
    assert seen["ckv"].data_ptr() == prob.kv.data_ptr()
    assert seen["kpe"].data_ptr() == prob.kv.data_ptr() + prob.rank * elem
    assert seen["ckv"].stride()[:2] == prob.kv.stride()[:2]
    assert seen["q_nope"].data_ptr() == prob.q.data_ptr()
    assert seen["out"].data_ptr() == runner.out.data_ptr()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU row of a machine without a GPU")
def test_compare_flashinfer_reports_a_row_without_it():
    env = dict(os.environ, TRITON_INTERPRET="1")
    res = subprocess.run([sys.executable, "-m", "hygon_attn_backend", "bench", "mla",
                          "--kv-lora-rank", "32", "--rope-dim", "16", "--block-sizes", "16",
                          "--mtp", "2", "--rep-ms", "1", "--compare", "flashinfer"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    table = res.stdout[res.stdout.index("| shape |"):]
    rows = {line.split("|")[4].strip(): line for line in table.splitlines()
            if line.startswith("| B=")}
    for impl in ("flashinfer", "flashinfer q_len 2"):
        assert impl in rows, table
        assert ("not installed" in rows[impl] or "needs a CUDA GPU" in rows[impl]
                or "import failed" in rows[impl]), rows[impl]
    assert "Traceback" not in res.stderr
