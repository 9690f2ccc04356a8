"""The bad-input matrix of docs/reliability.md: every public op x every kind of wrong
input -> a ``ValueError`` naming the argument, or a defined result checked against the
reference. No hang, no crash, no silent wrong answer.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hygon_attn_backend import reference
from hygon_attn_backend.ops.cache import copy_blocks, write_kv
from hygon_attn_backend.ops.decode import (DecodeLayer, allocate_decode_workspace,
                                           paged_decode_attention, plan_paged_decode)
from hygon_attn_backend.ops.prefill import (PrefillLayer, plan_prefix_prefill,
                                            prefix_prefill_attention)

from tests.support.budget import assert_within_budget

CPU = torch.device("cpu")
META = torch.device("meta")  # a device the other tensors are not on
F16 = torch.float16


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def _cache(n=8, h=2, p=16, d=64):
    return torch.randn(n, h, p, d).half(), torch.randn(n, h, p, d).half()


def decode_args():
    k, v = _cache()
    return dict(q=torch.randn(2, 8, 64).half(), k_cache=k, v_cache=v,
                block_table=_i32([[0, 1, 2], [3, 4, 5]]), seq_lens=_i32([40, 19]))


def prefill_args():
    k, v = _cache()
    return dict(q=torch.randn(9, 8, 64).half(), k_cache=k, v_cache=v,
                block_table=_i32([[0, 1, 2], [3, 4, 5]]), cu_seqlens_q=_i32([0, 4, 9]),
                seq_lens_k=_i32([40, 19]))


def write_kv_args():
    k, v = _cache()
    return dict(k=torch.randn(5, 2, 64).half(), v=torch.randn(5, 2, 64).half(), k_cache=k,
                v_cache=v, slot_mapping=_i32([3, 17, -1, 100, 127]))


def copy_blocks_args():
    k, v = _cache()
    return dict(k_cache=k, v_cache=v, block_mapping=_i32([[0, 4], [1, 5]]))


OPS = {
    "decode": (paged_decode_attention, decode_args,
               ("q", "k_cache", "v_cache", "block_table", "seq_lens")),
    "prefill": (prefix_prefill_attention, prefill_args,
                ("q", "k_cache", "v_cache", "block_table", "cu_seqlens_q", "seq_lens_k")),
    "write_kv": (write_kv, write_kv_args, ("k", "v", "k_cache", "v_cache", "slot_mapping")),
    "copy_blocks": (copy_blocks, copy_blocks_args, ("k_cache", "v_cache", "block_mapping")),
}


def _call(op, args, impl="triton"):
    fn, _, positional = OPS[op]
    args = dict(args)
    pos = [args.pop(n) for n in positional]
    return fn(*pos, impl=impl, **args)


@dataclasses.dataclass
class Bad:
    op: str
    kind: str
    edit: object  # dict -> None, edits the arguments
    names: str  # regex the ValueError must match (the argument's name)


def _set(**kw):
    return lambda a: a.update(kw)


def _with(name, fn):
    return lambda a: a.update({name: fn(a[name])})


RAISES = [
    # wrong dtype
    Bad("decode", "dtype", _with("q", lambda t: t.float()), "q"),
    Bad("prefill", "dtype", _with("q", lambda t: t.float()), "q"),
    Bad("write_kv", "dtype", _with("k", lambda t: t.to(torch.int32)), "k"),
    Bad("copy_blocks", "dtype", _with("block_mapping", lambda t: t.float()), "block_mapping"),
    Bad("decode", "dtype", _with("block_table", lambda t: t.float()), "block_table"),
    Bad("prefill", "dtype", _with("seq_lens_k", lambda t: t.float()), "seq_lens_k"),
    Bad("write_kv", "dtype", _with("slot_mapping", lambda t: t.float()), "slot_mapping"),
    # wrong device
    Bad("decode", "device", _with("seq_lens", lambda t: t.to(META)), "seq_lens"),
    Bad("prefill", "device", _with("block_table", lambda t: t.to(META)), "block_table"),
    Bad("write_kv", "device", _with("slot_mapping", lambda t: t.to(META)), "slot_mapping"),
    Bad("copy_blocks", "device", _with("block_mapping", lambda t: t.to(META)),
        "block_mapping"),
    # wrong ndim
    Bad("decode", "ndim", _with("q", lambda t: t[0]), "q"),
    Bad("prefill", "ndim", _with("cu_seqlens_q", lambda t: t.view(1, -1)), "cu_seqlens_q"),
    Bad("write_kv", "ndim", _with("k", lambda t: t[0]), "k"),
    Bad("copy_blocks", "ndim", _with("block_mapping", lambda t: t.view(-1)), "block_mapping"),
    # mismatched head counts / head_dim
    Bad("decode", "heads", _with("q", lambda t: t[:, :7]), "heads"),
    Bad("prefill", "heads", _with("q", lambda t: t[:, :7]), "heads"),
    Bad("write_kv", "heads", _with("v", lambda t: t[:, :1]), "v"),
    Bad("decode", "head_dim", _with("q", lambda t: t[..., :32]), "head_dim"),
    Bad("prefill", "head_dim", _with("q", lambda t: t[..., :32]), "head_dim"),
    Bad("write_kv", "head_dim", _with("k_cache", lambda t: t[..., :32]), "head_dim"),
    Bad("copy_blocks", "blocks", _with("v_cache", lambda t: t[:4]), "number of blocks"),
    # seq_lens shorter than the query tokens
    Bad("prefill", "seq_lens<q", _set(seq_lens_k=_i32([3, 19])), "seq_lens_k"),
    # decreasing cu_seqlens_q / totals that disagree with q
    Bad("prefill", "decreasing cu", _set(cu_seqlens_q=_i32([0, 6, 5])), "non-decreasing"),
    Bad("prefill", "total", _set(cu_seqlens_q=_i32([0, 4, 8])), "q.shape"),
    Bad("decode", "total", _with("seq_lens", lambda t: t[:1]), "seq_lens"),
    Bad("write_kv", "total", _with("slot_mapping", lambda t: t[:4]), "slot_mapping"),
    # workspace / plan too small or for another batch
    Bad("decode", "workspace", _set(partition_size=16, workspace=allocate_decode_workspace(
        max_num_seqs=1, num_q_heads=8, num_kv_heads=2, head_dim=64, max_context_len=48,
        device=CPU, partition_size=16)), "workspace"),
    Bad("prefill", "plan", lambda a: a.update(plan=plan_prefix_prefill(
        _i32([0, 9]), _i32([19]), total_q=9, num_q_heads=8, num_kv_heads=2, head_dim=64)),
        "plan"),
    Bad("prefill", "plan", lambda a: a.update(plan=dataclasses.replace(plan_prefix_prefill(
        a["cu_seqlens_q"], a["seq_lens_k"], total_q=9, num_q_heads=8, num_kv_heads=2,
        head_dim=64), tile_req=_i32([0]), tile_mblock=_i32([0]))), "plan too small"),
]


@pytest.mark.parametrize("bad", RAISES, ids=lambda b: f"{b.op}-{b.kind}")
def test_wrong_input_raises_a_value_error_naming_it(bad):
    args = OPS[bad.op][1]()
    bad.edit(args)
    with pytest.raises(ValueError, match=bad.names):
        _call(bad.op, args)


DEBUG_RAISES = [
    Bad("decode", "bad id", lambda a: a["block_table"].__setitem__((0, 1), -4), "block_table"),
    Bad("decode", "bad id", lambda a: a["block_table"].__setitem__((1, 0), 8), "block_table"),
    Bad("prefill", "bad id", lambda a: a["block_table"].__setitem__((0, 2), 1000),
        "block_table"),
    Bad("write_kv", "slot past the end", _set(slot_mapping=_i32([3, 17, -1, 128, 0])),
        "slot_mapping"),
    Bad("write_kv", "slot < -1", _set(slot_mapping=_i32([3, 17, -2, 100, 0])), "slot_mapping"),
    Bad("copy_blocks", "bad id", _set(block_mapping=_i32([[0, 4], [1, 8]])), "block_mapping"),
    Bad("decode", "seq_lens<q", lambda a: a.update(q=a["q"].view(2, 1, 8, 64).expand(
        2, 20, 8, 64).contiguous()), "seq_lens"),
]


@pytest.mark.parametrize("bad", DEBUG_RAISES, ids=lambda b: f"{b.op}-{b.kind}")
def test_debug_mode_raises_before_launch(bad, monkeypatch):
    monkeypatch.setenv("HYGON_ATTN_DEBUG", "1")
    args = OPS[bad.op][1]()
    bad.edit(args)
    with pytest.raises(ValueError, match=bad.names):
        _call(bad.op, args)


# ----------------------------------------------------------------------------- defined results


def _check_attention(op, args, impl="triton", **kw):
    """The op (``impl``) and the fp64 reference on the same (hostile) arguments; ``kw`` go
    to both."""
    fn = {"decode": reference.paged_decode_attention,
          "prefill": reference.prefix_prefill_attention}[op]
    positional = [args[n] for n in OPS[op][2]]
    out = _call(op, dict(args, **kw), impl=impl)
    kw.pop("partition_size", None)
    ref = fn(*positional, compute_dtype=torch.float64, **kw)
    ref_lp = fn(*positional, compute_dtype=F16, **kw)
    return out, ref, ref_lp


@pytest.mark.parametrize("op", ["decode", "prefill"])
@pytest.mark.parametrize("bad_id", [-1, -(2**31), 8, 2**31 - 1])
def test_bad_block_ids_are_absent_keys(op, bad_id):
    args = OPS[op][1]()
    args["block_table"][0, 1] = bad_id
    out, ref, ref_lp = _check_attention(op, args)
    assert_within_budget(out, ref, ref_lp, what=f"{op} bad id {bad_id}")


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_non_contiguous_last_dim_is_read_through_strides(op):
    args = OPS[op][1]()
    q = args["q"]
    args["q"] = torch.randn(*q.shape[:-1], 2 * q.shape[-1]).half()[..., ::2]  # stride 2
    k = args["k_cache"]
    args["k_cache"] = torch.randn(*k.shape[:-1], 2 * k.shape[-1]).half()[..., 1::2]
    assert args["q"].stride(-1) == 2 and args["k_cache"].stride(-1) == 2
    out, ref, ref_lp = _check_attention(op, args)
    assert_within_budget(out, ref, ref_lp, what=f"{op} strided last dim")


@pytest.mark.parametrize("partition_size", [None, 16])
def test_decode_seq_lens_below_speculative_tokens(partition_size):
    """Without debug mode: token t sits at seq_len - T + t; rows before key 0 see nothing
    and give 0, as in the reference."""
    args = decode_args()
    args["q"] = torch.randn(2, 4, 8, 64).half()
    args["seq_lens"] = _i32([2, 19])
    out, ref, ref_lp = _check_attention("decode", args, partition_size=partition_size)
    assert torch.count_nonzero(out[0, :2]) == 0
    assert_within_budget(out, ref, ref_lp, what="decode seq_len < T")


@pytest.mark.parametrize("op", ["decode", "prefill"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nan_or_inf_in_q_stays_in_its_row(op, poison):
    args = OPS[op][1]()
    args["q"][1, 3, 5] = poison  # one element of one query row (a head of one token)
    clean = dict(args, q=args["q"].clone())
    clean["q"][1, 3, 5] = 0.0
    out = _call(op, args)
    out_clean, ref, ref_lp = _check_attention(op, clean)
    assert torch.isnan(out[1, 3]).all()
    keep = torch.ones(out.shape[:2], dtype=torch.bool)
    keep[1, 3] = False
    assert torch.equal(out[keep], out_clean[keep])
    assert_within_budget(out_clean, ref, ref_lp, what=f"{op} clean rows")


def test_write_kv_slots_outside_are_skipped_and_special_values_stored():
    args = write_kv_args()
    args["slot_mapping"] = _i32([3, 2**31 - 1, -1, -9, 128])  # one valid slot
    args["k"][0, 0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")]).half()
    before = args["k_cache"].clone()
    want_k, want_v = args["k_cache"].clone(), args["v_cache"].clone()
    reference.write_kv(args["k"], args["v"], want_k, want_v, args["slot_mapping"])
    _call("write_kv", args)
    assert torch.equal(args["k_cache"].view(torch.int16), want_k.view(torch.int16))
    assert torch.equal(args["v_cache"].view(torch.int16), want_v.view(torch.int16))
    changed = (args["k_cache"].view(torch.int16) != before.view(torch.int16)).any(dim=(1, 3))
    assert changed.nonzero().tolist() == [[0, 3]]  # block 0, slot 3 only


def test_fp8_write_saturates_inf_and_keeps_nan():
    k_cache = torch.zeros(2, 1, 4, 16, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros(2, 1, 4, 16, dtype=torch.float8_e4m3fn)
    k = torch.randn(1, 1, 16).half()
    k[0, 0, :3] = torch.tensor([float("inf"), float("-inf"), float("nan")]).half()
    write_kv(k, k.clone(), k_cache, v_cache, _i32([5]), k_scale=0.5, v_scale=0.5,
             impl="triton")
    row = k_cache[1, 0, 1].float()
    assert row[0] == 448 and row[1] == -448 and torch.isnan(row[2])


def test_copy_blocks_bad_pairs_are_skipped_without_debug():
    args = copy_blocks_args()
    before = args["k_cache"].clone()
    args["block_mapping"] = _i32([[0, 4], [-1, 5], [1, 2**31 - 1]])
    _call("copy_blocks", args)
    assert torch.equal(args["k_cache"][4], before[0])
    assert torch.equal(args["k_cache"][5], before[5])
    assert torch.equal(args["k_cache"][:4], before[:4])


# ----------------------------------------------------------------------------- one answer on every path

PATHS = ("reference", "triton")  # the engines' CPU fallback and the kernels (interpreter)
NO_BLOCKS = dict(k_cache=torch.zeros(0, 2, 16, 64).half(), v_cache=torch.zeros(0, 2, 16, 64).half())


@pytest.mark.parametrize("impl", PATHS)
def test_decode_cache_of_no_blocks_gives_zeros(impl):
    """Every key of a cache with no blocks is absent: the rows see no key and give 0."""
    out = _call("decode", dict(decode_args(), **NO_BLOCKS), impl=impl)
    assert out.shape == (2, 8, 64) and torch.count_nonzero(out) == 0


@pytest.mark.parametrize("k_new", [False, True], ids=["cache_only", "k_new"])
@pytest.mark.parametrize("impl", PATHS)
def test_prefill_cache_of_no_blocks_sees_only_the_new_keys(impl, k_new):
    kw = dict(return_lse=True)
    if k_new:
        kw.update(k_new=torch.randn(9, 2, 64).half(), v_new=torch.randn(9, 2, 64).half())
    (out, lse), ref, ref_lp = _check_attention("prefill", dict(prefill_args(), **NO_BLOCKS),
                                               impl=impl, **kw)
    if not k_new:
        assert torch.count_nonzero(out) == 0 and torch.isneginf(lse).all()
    assert_within_budget(out, ref[0], ref_lp[0], what=f"prefill no blocks ({impl})")


@pytest.mark.parametrize("partition_size", [None, 16])
@pytest.mark.parametrize("impl", PATHS)
def test_decode_negative_seq_len_gives_zeros(impl, partition_size):
    """A negative length is no key at all (debug mode raises, test_debug_mode_...): its row
    gives 0 and the batch's other rows are unaffected, on every path."""
    args = dict(decode_args(), seq_lens=_i32([-3, 19]))
    if impl == "triton":
        args["partition_size"] = partition_size
    out, ref, ref_lp = _check_attention("decode", args, impl=impl)
    assert torch.count_nonzero(out[0]) == 0 and torch.count_nonzero(out[1]) > 0
    assert_within_budget(out, ref, ref_lp, what=f"decode negative seq_len ({impl})")


@pytest.mark.parametrize("impl", PATHS)
def test_prefill_negative_seq_len_is_rejected_on_every_path(impl):
    args = dict(prefill_args(), cu_seqlens_q=_i32([0, 0, 9]), seq_lens_k=_i32([-3, 19]))
    with pytest.raises(ValueError, match=r"seq_lens_k\[0\]=-3"):
        _call("prefill", args, impl=impl)


@pytest.mark.parametrize("debug", ["0", "1"])
@pytest.mark.parametrize("impl", PATHS)
@pytest.mark.parametrize("op", ["decode", "prefill", "write_kv"])
def test_page_size_zero_is_one_value_error_in_and_out_of_debug_mode(op, impl, debug,
                                                                    monkeypatch):
    """The debug checks divide by the page size: the caches' page size is checked first."""
    monkeypatch.setenv("HYGON_ATTN_DEBUG", debug)
    args = OPS[op][1]()
    args.update(k_cache=torch.zeros(8, 2, 0, 64).half(), v_cache=torch.zeros(8, 2, 0, 64).half())
    if op == "decode":
        args["seq_lens"] = _i32([0, 0])  # nothing past the (empty) table either
    with pytest.raises(ValueError, match="page_size must be a positive int, got 0"):
        _call(op, args, impl=impl)


BAD_SCALES = [0.0, -0.125, float("nan"), float("inf"), -float("inf")]


@pytest.mark.parametrize("scale", BAD_SCALES)
@pytest.mark.parametrize("impl", PATHS)
@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_scale_must_be_finite_and_positive_on_every_op(op, impl, scale):
    with pytest.raises(ValueError, match=rf"scale must be a finite float > 0 or None, got "
                                         rf"{scale!r}"):
        _call(op, dict(OPS[op][1](), scale=scale), impl=impl)


@pytest.mark.parametrize("scale", BAD_SCALES + ["0.1"])
def test_scale_rule_holds_for_plans_and_layer_bindings(scale):
    """The same rule where an engine builds its plans and per-layer bindings once."""
    d, p = decode_args(), prefill_args()
    kw = dict(num_q_heads=8, num_kv_heads=2, head_dim=64, page_size=16,
              q_dtype=F16, kv_dtype=F16)
    match = "scale must be a finite float > 0 or None"
    with pytest.raises(ValueError, match=match):
        plan_paged_decode(d["block_table"], d["seq_lens"], scale=scale, **kw)
    with pytest.raises(ValueError, match=match):
        DecodeLayer(d["k_cache"], d["v_cache"], scale=scale)
    with pytest.raises(ValueError, match=match):
        PrefillLayer(p["k_cache"], p["v_cache"], scale=scale)
    plan = plan_paged_decode(d["block_table"], d["seq_lens"], impl="triton", **kw)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(d["q"], d["k_cache"], d["v_cache"], d["block_table"],
                               d["seq_lens"], plan=plan, scale=scale)
    pplan = plan_prefix_prefill(p["cu_seqlens_q"], p["seq_lens_k"], total_q=9, num_q_heads=8,
                                num_kv_heads=2, head_dim=64, impl="reference")
    with pytest.raises(ValueError, match=match):
        prefix_prefill_attention(p["q"], p["k_cache"], p["v_cache"], p["block_table"],
                                 p["cu_seqlens_q"], p["seq_lens_k"], plan=pplan, scale=scale)


@pytest.mark.parametrize("impl", PATHS)
@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_soft_cap_rule_is_one_on_every_op(op, impl):
    """``soft_cap`` 0 means no cap on both ops (the engines pass 0 for an uncapped layer):
    the answer equals the call without it; negative, NaN and inf are one ValueError."""
    args = OPS[op][1]()
    torch.manual_seed(0)
    plain = _call(op, args, impl=impl)
    zero = _call(op, dict(args, soft_cap=0.0), impl=impl)
    assert torch.equal(zero, plain)
    capped = _call(op, dict(args, soft_cap=0.5), impl=impl)
    assert not torch.allclose(capped.float(), plain.float())
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match=r"soft_cap must be a finite float >= 0"):
            _call(op, dict(args, soft_cap=bad), impl=impl)
