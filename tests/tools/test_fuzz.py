"""The fuzzer's CPU slice (Triton interpreter, fp16, tiny shapes, fixed seed) and its
reproducibility. The GPU run (>= 10,000 cases per op) is recorded in docs/reliability.md.
"""

from __future__ import annotations

import io

import pytest
import torch

from hygon_attn_backend.ops.mla import tuning
from hygon_attn_backend.tools import fuzz
from hygon_attn_backend.tools.cli import build_parser

CPU = torch.device("cpu")
SLICE = {"decode": 24, "prefill": 24, "mla": 24, "mla_prefill": 24, "write_kv": 32,
         "copy_blocks": 24}


@pytest.mark.parametrize("op", fuzz.OPS)
def test_cpu_slice_has_no_failures(op):
    log = io.StringIO()
    failures = fuzz.fuzz(op, cases=SLICE[op], seed=20261130, device="cpu", out=log)
    assert failures == 0, log.getvalue()
    assert f"fuzz {op}: {SLICE[op]} cases, 0 failures" in log.getvalue()


@pytest.mark.parametrize("op", ["decode", "write_kv"])
def test_a_case_is_a_function_of_seed_and_index(op):
    profiles = fuzz.profiles_for(op, 7, tiny=True)
    first = fuzz.run_case(op, 7, 3, CPU, profiles)
    again = fuzz.run_case(op, 7, 3, CPU, profiles)
    other = fuzz.run_case(op, 8, 3, CPU, fuzz.profiles_for(op, 8, tiny=True))
    assert first == again and first[0] is None
    assert first[1] != other[1]


def test_a_failure_prints_seed_case_and_rerun_line(monkeypatch):
    """A case that raises is a failure: reported with the line that reruns it alone."""
    from hygon_attn_backend.tools.fuzz import cache

    def broken(rng, prof, device, tiny):
        raise RuntimeError("planted")
    monkeypatch.setattr(cache, "copy_blocks_case", broken)
    log = io.StringIO()
    assert fuzz.fuzz("copy_blocks", cases=3, seed=5, device="cpu", out=log) == 3
    text = log.getvalue()
    assert "FAIL copy_blocks seed=5 case=2: raised RuntimeError: planted" in text
    assert "rerun: hygon-attn fuzz --op copy_blocks --seed 5 --case 2 --device cpu" in text


def test_shards_partition_the_cases():
    logs = [io.StringIO() for _ in range(2)]
    for i, log in enumerate(logs):
        fuzz.fuzz("copy_blocks", cases=5, seed=1, device="cpu", shard=(i, 2), out=log)
    assert "3 cases, 0 failures" in logs[0].getvalue()
    assert "2 cases, 0 failures" in logs[1].getvalue()


def test_skip_resumes_a_shard_after_its_first_cases(monkeypatch):
    """--skip N leaves out exactly the shard's first N cases (the ones a stopped run did)."""
    from hygon_attn_backend.tools.fuzz import cache
    seen = []

    def record(rng, prof, device, tiny):
        seen.append(rng.random())
        return None, ""
    monkeypatch.setattr(cache, "copy_blocks_case", record)
    fuzz.fuzz("copy_blocks", cases=9, seed=3, device="cpu", shard=(1, 2), out=io.StringIO())
    whole = list(seen)
    seen.clear()
    log = io.StringIO()
    fuzz.fuzz("copy_blocks", cases=9, seed=3, device="cpu", shard=(1, 2), skip=3, out=log)
    assert len(whole) == 4 and seen == whole[3:]
    assert "1 cases, 0 failures" in log.getvalue() and "first 3 skipped" in log.getvalue()


def test_cli_registers_fuzz():
    args = build_parser().parse_args(["fuzz", "--op", "prefill", "--cases", "3", "--seed",
                                      "9", "--shard", "1/4", "--device", "cpu"])
    assert (args.op, args.cases, args.seed, args.shard, args.device) == ("prefill", 3, 9,
                                                                         (1, 4), "cpu")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["fuzz", "--op", "nope"])


def test_impl_is_a_prefill_and_decode_option():
    """--impl reaches the prefill and decode cases; the cache ops refuse it by name."""
    args = build_parser().parse_args(["fuzz", "--op", "prefill", "--impl", "auto"])
    assert args.impl == "auto"
    assert build_parser().parse_args(["fuzz", "--op", "prefill"]).impl == "triton"
    for op in ("write_kv", "copy_blocks"):
        with pytest.raises(ValueError, match=f"impl='auto'.*op='{op}'"):
            fuzz.fuzz(op, cases=1, seed=1, device="cpu", impl="auto", out=io.StringIO())


@pytest.mark.gpu
def test_decode_impl_native_runs_the_native_kernel():
    """On a GPU, --impl native runs the native decode on every case it covers (head_dim
    64-256, 16-bit KV in q's dtype or fp8) and passes against the reference."""
    log = io.StringIO()
    assert fuzz.fuzz("decode", cases=60, seed=11, device="cuda", impl="native",
                     out=log) == 0, log.getvalue()
    summary = log.getvalue().strip().splitlines()[-1]
    native = int(summary.split("impl native: ")[1].split(" native")[0])
    assert native > 0, summary


@pytest.mark.parametrize("op,seed", [("prefill", 20261130), ("decode", 20261201)])
def test_impl_auto_counts_the_native_cases(op, seed):
    """impl="auto" (prefill and decode cases): the plan picks per case (Triton on a CPU,
    no native case), the cases pass and the summary says how many ran native."""
    log = io.StringIO()
    assert fuzz.fuzz(op, cases=3, seed=seed, device="cpu", impl="auto",
                     out=log) == 0, log.getvalue()
    assert "3 cases, 0 failures" in log.getvalue()
    assert "impl auto: 0 native" in log.getvalue()


def test_impl_reaches_the_mla_plans(monkeypatch):
    """--impl reaches every MLA case's plan (the MLA profiles' own "triton" is replaced),
    so ``--impl auto`` can take the native MLA decode where it applies."""
    from hygon_attn_backend.tools.fuzz import mla as fuzz_mla
    seen = []
    real = fuzz_mla.plan_mla_decode

    def recording(*args, **kw):
        seen.append(kw["impl"])
        return real(*args, **dict(kw, impl="triton"))

    monkeypatch.setattr(fuzz_mla, "plan_mla_decode", recording)
    log = io.StringIO()
    assert fuzz.fuzz("mla", cases=2, seed=3, device="cpu", impl="auto", out=log) == 0, \
        log.getvalue()
    assert seen == ["auto", "auto"], seen


def _auto_cases_run_native(op: str, what: str, covers) -> None:
    """Two ``impl="auto"`` cases of each seed-11 ``op`` profile for which ``covers(profile)``
    holds pass the reference on this sm_90 GPU, each run by the native kernel (skips
    elsewhere, saying why)."""
    if not torch.cuda.is_available() or getattr(torch.version, "hip", None) or \
            torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"{what} runs on NVIDIA sm_90 GPUs only")
    from hygon_attn_backend import native
    if not native.available():
        pytest.skip("the native kernels cannot be built here")
    seed, dev = 11, torch.device("cuda")
    profiles = fuzz.profiles_for(op, seed, tiny=False)
    for prof in profiles:
        prof["impl"] = "auto"
    covered = [i for i, p in enumerate(profiles) if covers(p)]
    assert covered, f"no profile of this seed is one {what} covers"
    descs = []
    for i in covered:
        for case in (i, i + len(profiles)):  # two cases of each such profile
            problem, desc = fuzz.run_case(op, seed, case, dev, profiles)
            assert problem is None, f"{problem}: {desc}"
            descs.append(desc)
    assert all("impl=native" in d for d in descs), descs


@pytest.mark.gpu
def test_mla_impl_auto_runs_the_native_kernel_on_sm90():
    """On an H100/H200 the auto cases of the MLA profiles the native decode covers (16-bit
    512 + 64 caches, 33 query rows a request or more) run it and pass the reference."""
    _auto_cases_run_native(
        "mla", "the native MLA decode",
        lambda p: (p["rank"], p["rope"]) == (512, 64) and not p["fp8"]
        and p["tokens"] * p["heads"] >= tuning.MLA_NATIVE_MIN_ROWS
        and not (p["tree"] and p["tokens"] > 1))  # a draft tree runs Triton


@pytest.mark.gpu
def test_mla_prefill_impl_auto_runs_the_native_kernel_on_sm90():
    """On an H100/H200 the auto cases of the ragged profiles the native kernel covers (q/k
    / v heads 192 / 128 and 128 / 128, GQA groups up to 64) run it and pass the
    reference."""
    _auto_cases_run_native(
        "mla_prefill", "the native ragged attention",
        lambda p: (p["d_qk"], p["d_v"]) in ((192, 128), (128, 128)))


@pytest.mark.gpu
def test_prefill_impl_auto_runs_the_native_kernel_on_sm90():
    """On an H100/H200 the auto cases of the profiles the native prefill covers (head_dim
    128, 16-bit KV) run it, and pass against the reference. Seed 11 has four such
    profiles (SGLang's and vLLM's layouts); its run on the H200 (254 cases before a time
    limit) ran every case of them native (docs/reliability.md)."""
    _auto_cases_run_native(
        "prefill", "the native prefill",
        lambda p: p["head_dim"] == 128 and p["kv_dtype"] in (torch.float16, torch.bfloat16))


# ----------------------------------------------------------------------------- compile budget

# kernels one profile may compile: decode one-partition, split and combine; prefill one
KEYS_PER_PROFILE = {"decode": 3, "prefill": 1}


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_a_gpu_run_compiles_a_bounded_number_of_kernels(op):
    """The GPU-sized cases (4 per profile here) launch at most KEYS_PER_PROFILE distinct
    Triton specialisations per profile: a case that changes a stride's class, a dtype or
    a constexpr would make a 10,000-case run compile-bound again."""
    from hygon_attn_backend.tools.fuzz import speckeys

    cases = 4 * fuzz.NUM_PROFILES[op]
    res = speckeys.count_keys(op, cases=cases, seed=20261130, shards=8)
    assert res["per_profile"] <= KEYS_PER_PROFILE[op], res
    assert res["total"] <= KEYS_PER_PROFILE[op] * fuzz.NUM_PROFILES[op], res
    assert res["launches"] >= cases * 0.9, res  # the cases did launch their kernels
    assert 0 < res["work_max"] <= 8 * 2e8, res  # the reference's fp64 work stays bounded


def test_table_width_keeps_its_class():
    import random

    from hygon_attn_backend.tools.fuzz.problems import table_width

    rng = random.Random(0)
    for needed in (0, 1, 2, 15, 16, 17, 31, 32, 100):
        for _ in range(5):
            wide, narrow = (table_width(rng, needed, x16=c) for c in (True, False))
            assert wide % 16 == 0 and wide >= max(needed, 1)
            assert narrow % 16 != 0 and narrow >= max(needed, 2)


def test_speckeys_follow_tritons_specialisation():
    """Keys change with a constexpr, a dtype, an integer's ``== 1`` / ``% 16`` class and a
    pointer's 16-byte alignment; not with an integer in ``do_not_specialize`` or within a
    class."""
    import triton
    import triton.language as tl

    from hygon_attn_backend.tools.fuzz.speckeys import launch_key

    @triton.jit(do_not_specialize=["n"])
    def kern(x_ptr, stride, n, BLOCK: tl.constexpr):
        pass

    fn = kern.fn if hasattr(kern, "fn") else kern
    no_spec = ("n",)
    x = torch.zeros(64, dtype=torch.float16)

    def key(t=x, stride=32, n=5, block=16, **opts):
        return launch_key(fn, (t, stride, n), dict(BLOCK=block, **opts),
                          do_not_specialize=no_spec)

    assert key() == key(stride=48) == key(n=1) == key(n=32)
    for other in (key(stride=33), key(stride=1), key(block=32), key(t=x[1:]),
                  key(t=x.to(torch.bfloat16)), key(num_warps=8)):
        assert other != key()


def test_profiles_cover_every_listed_value():
    """Over one seed's profiles (GPU sizes) every layout, page size, group, head_dim, cache
    dtype and flag of the issue's list appears."""
    from hygon_attn_backend.tools.fuzz import problems as pb

    for op, layouts in (("decode", pb.ALL_LAYOUTS), ("prefill", pb.ATTN_LAYOUTS)):
        profs = fuzz.profiles_for(op, 3, tiny=False)
        seen = {name: {p[name] for p in profs} for name in profs[0]}
        assert seen["layout"] == set(layouts)
        assert seen["page"] == set(pb.PAGES) and seen["head_dim"] == set(pb.HEAD_DIMS)
        assert seen["group"] == set(pb.GROUPS)
        assert {torch.float16, torch.bfloat16, *pb.FP8} <= seen["kv_dtype"]
        for flag in ("window", "soft_cap", "sinks", "table_x16"):
            assert seen[flag] == {False, True}, flag
        assert seen["scales"] == set(pb.SCALE_KINDS)
        if op == "decode":
            assert seen["tokens"] == {1, 2, 4}
            assert seen["partition_size"] == {None, 16, 64, 256, 512}
        else:
            assert seen["k_new"] == seen["causal"] == seen["lse"] == {False, True}
            assert len(seen["tile"]) >= 3


def test_fp8_profiles_pass_scales_every_way():
    """Over the fp8 profiles of the seeds the GPU runs use, scales come as floats, 1-element
    tensors and per-KV-head tensors, the last with more than one KV head; the per-head
    keyword arguments hold one fp32 scale a KV head."""
    import random

    from hygon_attn_backend.tools.fuzz import problems as pb

    for op in ("decode", "prefill"):
        for seed in (3, 11):
            profs = fuzz.profiles_for(op, seed, tiny=False, kv_dtype="fp8")
            assert {p["scales"] for p in profs} == set(pb.SCALE_KINDS)
            assert sum(p["scales"] == "per_head" and p["kv_heads"] > 1 for p in profs) >= 3
    kw = pb.fp8_scales(random.Random(0), torch.float8_e4m3fn, kind="per_head", num_kv_heads=4,
                       device=CPU, lo=0.2, hi=2.0)
    assert kw["k_scale"].shape == kw["v_scale"].shape == (4,)
    assert kw["k_scale"].dtype == torch.float32 and len(set(kw["k_scale"].tolist())) == 4
    assert pb.fp8_scales(random.Random(0), torch.bfloat16, kind="per_head", num_kv_heads=4,
                         device=CPU, lo=0.2, hi=2.0) == {}
    with pytest.raises(ValueError, match="kind must be one of"):
        pb.fp8_scales(random.Random(0), torch.float8_e5m2, kind="heads", num_kv_heads=4,
                      device=CPU, lo=0.2, hi=2.0)


def test_profile_writes_a_readable_profile(tmp_path):
    import pstats

    path = tmp_path / "fuzz.prof"
    args = build_parser().parse_args(["fuzz", "--op", "copy_blocks", "--cases", "2", "--seed",
                                      "4", "--device", "cpu", "--profile", str(path)])
    assert args.func(args) == 0
    stats = pstats.Stats(str(path))
    assert any(name == "run_case" for (_, _, name) in stats.stats)


def test_budget_floor_is_two_ulps_at_the_outputs_magnitude():
    from hygon_attn_backend.tools.fuzz.budget import FLOOR, budget_error, output_floor

    bf16 = torch.bfloat16
    assert output_floor(bf16, 0.5, FLOOR[bf16]) == FLOOR[bf16]  # small outputs: the floor
    assert output_floor(bf16, 6.0, FLOOR[bf16]) == 2 * 2.0 ** -5  # ulp of [4, 8) is 2^-5
    assert output_floor(torch.float16, 0.0, FLOOR[torch.float16]) == FLOOR[torch.float16]
    # case 6137 of the prefill fuzz: an output near 6 that the low-precision reference
    # rounds exactly as fp64 does (its own error 0); the kernel lands one unit away
    ref64 = torch.tensor([6.03125], dtype=torch.float64)  # a bf16 value: ulp 2^-5 here
    ref_lp = ref64.to(bf16)
    one_up = (ref64 + 2.0 ** -5).to(bf16)
    assert budget_error(one_up, ref64, ref_lp)[2] is None
    assert budget_error(one_up, ref64, ref_lp, floor=FLOOR[bf16])[2] is not None  # old floor
    three_up = (ref64 + 3 * 2.0 ** -5).to(bf16)
    assert budget_error(three_up, ref64, ref_lp)[2] is not None


def test_kv_dtype_filter_keeps_only_those_profiles():
    """--kv-dtype fp8 draws every profile's cache dtype from the fp8 ones (each case names
    its filter in the rerun line); the cache ops refuse it."""
    import contextlib

    args = build_parser().parse_args(["fuzz", "--op", "decode", "--kv-dtype", "fp8"])
    assert args.kv_dtype == "fp8"
    out = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()):
        assert fuzz.fuzz("decode", cases=4, seed=3, device="cpu", kv_dtype="fp8_e5m2",
                         out=out) == 0
    assert "kv fp8_e5m2" in out.getvalue()
    kept = fuzz.profiles_for("decode", 3, True, "fp8_e5m2")
    assert len(kept) == fuzz.NUM_PROFILES["decode"]
    assert all(p["kv_dtype"] == torch.float8_e5m2 for p in kept)
    with pytest.raises(ValueError, match="kv_dtype='fp8'.*op='write_kv'"):
        fuzz.fuzz("write_kv", cases=1, seed=1, device="cpu", kv_dtype="fp8", out=io.StringIO())
