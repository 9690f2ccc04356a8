"""One compatibility check, run inside a vLLM version's environment (``vllm_checks.py``
starts it with the checkout under test first on ``PYTHONPATH``).

``python vllm_probe.py --check NAME`` prints one line ``CHECK {"check": NAME, "result":
"pass"|"fail"|"n/a", "reason": ...}`` and exits 0 (a crash before that line is read by
the caller as a failure). Checks: ``register``, ``interface``, ``harness``,
``greedy-v1``, ``greedy-v2``, ``mla`` (see ``vllm_checks.py``).
"""

from __future__ import annotations

import argparse
import inspect
import io
import json
import os
import re
import sys
import tempfile
import traceback

BACKEND_CLASS = "hygon_attn_backend.integrations.vllm.backend.HygonAttentionBackend"


class NotApplicable(Exception):
    """The check does not apply to this vLLM (the message says why)."""


def _filtered(func, **kwargs):
    params = inspect.signature(func).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def _tiny_config_dir(path: str) -> str:
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=256).save_pretrained(path)
    return path


def _registered_member():
    """vLLM's own plugin loading, then the member ``hygon`` names (asserted to be ours)."""
    from vllm.plugins import load_general_plugins
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    load_general_plugins()
    member = E.__members__.get("HYGON")
    assert member is not None, "vLLM's plugin loading did not register 'hygon'"
    assert member is E.CUSTOM, f"hygon parsed to {member}, not the CUSTOM slot"
    assert E.CUSTOM.get_path() == BACKEND_CLASS, E.CUSTOM.get_path()
    return member


def _no_abstract_left() -> None:
    from hygon_attn_backend.integrations.vllm import backend

    for cls in (backend.HygonAttentionBackend, backend.HygonAttentionMetadataBuilder,
                backend.HygonAttentionImpl):
        left = sorted(getattr(cls, "__abstractmethods__", ()))
        assert not left, f"{cls.__name__} leaves vLLM's abstract {left} undefined"


def _validate_defaults():
    """Our backend against the version's own selector config (defaults, fp16, D=64)."""
    import torch
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from hygon_attn_backend.integrations.vllm.backend import HygonAttentionBackend

    sel = AttentionSelectorConfig(head_size=64, dtype=torch.float16, kv_cache_dtype="auto",
                                  block_size=16)
    reasons = HygonAttentionBackend.validate_configuration(device_capability=None,
                                                           **sel._asdict())
    assert reasons == [], f"validate_configuration refused the defaults: {reasons}"
    bad = HygonAttentionBackend.validate_configuration(
        device_capability=None, **sel._replace(dtype=torch.float32)._asdict())
    assert "dtype not supported" in bad, bad


def check_register() -> str:
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.attention.selector import get_attn_backend

    from vllm.platforms import current_platform

    if not current_platform.is_cpu() and not torch.cuda.is_available():
        raise NotApplicable(f"no platform for this build here ({type(current_platform).__name__}):"
                            f" the engine config and the selector need one; registration is "
                            f"checked under 'interface'")
    member = _registered_member()
    with tempfile.TemporaryDirectory() as tmp:
        model = _tiny_config_dir(tmp)
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        args = parser.parse_args(["--model", model, "--skip-tokenizer-init", "--dtype",
                                  "float16", "--max-model-len", "256",
                                  "--attention-backend", "hygon"])
        cfg = EngineArgs.from_cli_args(args).create_engine_config()
    assert cfg.attention_config.backend is member, cfg.attention_config.backend
    with set_current_vllm_config(cfg):
        cls = get_attn_backend(**_filtered(get_attn_backend, head_size=32,
                                           dtype=torch.float16, kv_cache_dtype="auto",
                                           block_size=16))
    found = f"{cls.__module__}.{cls.__qualname__}"
    assert found == BACKEND_CLASS, f"vLLM's selector returned {found}"
    _no_abstract_left()
    _validate_defaults()
    return "plugin loaded by vLLM, --attention-backend hygon parsed and selected on CPU"


def check_interface() -> str:
    """For a vLLM installed --no-deps (no CPU build): registration through vLLM's plugin
    loader, the CLI value, the backend module's imports against the version's classes."""
    from vllm.config import AttentionConfig

    member = _registered_member()
    assert AttentionConfig(backend="hygon").backend is member
    _no_abstract_left()
    _validate_defaults()
    from hygon_attn_backend.integrations.vllm.backend import HygonAttentionBackend

    layouts = HygonAttentionBackend.supported_kv_cache_layouts()
    return (f"imports, plugin registration, AttentionConfig(backend='hygon'), "
            f"validate_configuration; {len(layouts)} KV-cache layouts declared")


def check_harness() -> str:
    import torch

    from tests.support.vllm_cases import BATCH_SPECS, make_case
    from tests.support.vllm_harness import check, llama_config_dir, run_backend, vllm_config_for

    interpreter = ["small_decode", "small_prefill", "mixed_small", "prefill_no_context",
                   "mixed_mid_page"]
    done = 0
    with tempfile.TemporaryDirectory() as tmp:
        model = llama_config_dir(tmp, 8, 2, 64)
        cfg16 = vllm_config_for(model, block_size=16, dtype="float16")
        runs = [("reference", name, {}) for name in BATCH_SPECS]
        runs += [("triton", name, {}) for name in interpreter]
        runs += [("reference", "mixed_small", {"kv_cache_dtype": "fp8"}),
                 ("reference", "mixed_mid_page", {"sliding_window": 20}),
                 ("reference", "mixed_mid_page", {"soft_cap": 5.0}),
                 ("reference", "mixed_mid_page",
                  {"sinks": torch.randn(8, generator=torch.Generator().manual_seed(1))})]
        for impl, name, opt in runs:
            os.environ["HYGON_ATTN_IMPL"] = impl
            seq_lens, query_lens = BATCH_SPECS[name]
            case = make_case(seq_lens, query_lens, layout="LBHNC", seed=len(name) + done,
                             kv_cache_dtype=opt.get("kv_cache_dtype", "auto"))
            options = {k: v for k, v in opt.items() if k != "kv_cache_dtype"}
            out, _ = run_backend(case, cfg16, **options)
            try:
                check(case, out, **options)
            except AssertionError as exc:
                raise AssertionError(f"{name} ({impl}, {opt or 'plain'}): {exc}") from None
            done += 1
        # speculative-decode routing: uniform 3-token requests as one decode batch
        os.environ["HYGON_ATTN_IMPL"] = "reference"
        case = make_case([40, 33, 64, 50], [3, 3, 3, 9], layout="LBHNC", seed=13)
        out, md = run_backend(case, cfg16, decode_threshold=3)
        assert (md.num_decodes, md.decode_query_len, md.num_prefills) == (3, 3, 1)
        check(case, out)
        done += 1
    return (f"{done} cases within budget of the float64 oracle ({len(interpreter)} with the "
            f"Triton kernels in the interpreter)")


def _has_cpu_v2_runner() -> bool:
    import importlib.util

    worker = importlib.util.find_spec("vllm.v1.worker.cpu_worker")
    source = open(worker.origin).read() if worker and worker.origin else ""
    return "use_v2_model_runner" in source


def _vllm_has_triton() -> bool:
    """vLLM's own verdict on Triton (False where Triton has no driver for this host)."""
    try:
        from vllm.triton_utils import HAS_TRITON
    except ImportError:
        return False
    return bool(HAS_TRITON)


def check_greedy(runner: str) -> str:
    if runner == "v2" and not _has_cpu_v2_runner():
        raise NotApplicable("this vLLM's CPU worker has no Model Runner V2")
    if runner == "v2" and not _vllm_has_triton():
        raise NotApplicable("vLLM's Model Runner V2 needs Triton with a CPU backend, which "
                            "this host's Triton lacks (vLLM disables Triton here): vLLM "
                            "refuses V2 with its own CPU backend too")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
    from hygon_attn_backend.tools.demo import engine as demo

    out = io.StringIO()
    rc = demo.run_demo(out=out, impl="triton", timeout=1200)
    text = out.getvalue()
    assert rc == 0 and "outputs match token for token: yes" in text, text[-1500:]
    kernels = next((line.split(":", 1)[1].split(",")[0].split("(")[0].strip()
                    for line in text.splitlines() if line.startswith("hygon run:")), "?")
    gap = next((line.rsplit(":", 1)[1].strip() for line in text.splitlines()
                if line.startswith("smallest top-2")), "?")
    return (f"6 prompts x 10 tokens equal to vLLM's CPU backend (hygon: {kernels}; "
            f"smallest top-2 logprob gap {gap})")


def _mla_refused() -> str:
    """On a vLLM outside ``compat.MLA_RANGE``: ``hygon`` on an MLA layer keeps the dense
    class, which refuses it by name (asserted)."""
    import torch
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from hygon_attn_backend.integrations.vllm import compat, mla_select

    sel = AttentionSelectorConfig(head_size=576, dtype=torch.float16, kv_cache_dtype="auto",
                                  block_size=16, use_mla=True)
    path = mla_select.backend_path(sel)
    assert path == BACKEND_CLASS, path
    reasons = mla_select.load(path).validate_configuration(device_capability=None,
                                                           **sel._asdict())
    refusal = next((r for r in reasons if "MLA" in r), None)
    assert refusal, reasons
    return (f"outside the MLA backend's vLLM range {compat.range_text(compat.MLA_RANGE)} "
            f"(this version's MLA interfaces differ: docs/compat.md); hygon refuses an MLA "
            f"layer here: {refusal}")


def _mla_cases() -> tuple:
    """vLLM's MLA builder + our impl on the harness cases against the float64 oracle:
    every case with the reference ops and the Triton kernels (interpreter), the fp8 cache
    (where the platform keeps one) and speculative-verify cases with the reference ops.
    Returns ``(cases run, whether the fp8 ones ran)``."""
    import torch

    from tests.support import vllm_mla_harness as h

    done = 0
    with tempfile.TemporaryDirectory() as tmp:
        model = h.deepseek_config_dir(tmp, h.Dims())
        runs = [(impl, name, {}) for impl in ("reference", "triton") for name in h.CASES]
        fp8 = h.fp8_cache_kept(model)  # 0.15 and 0.18's CPU platforms turn fp8 KV off
        runs += [("reference", name, {"k_scale": 0.02})
                 for name in ("mixed_context", "chunked_continuation") if fp8]
        runs += [("reference", "spec", {"spec": (2, [6, 13, 20, 4], [3, 3, 3, 5])}),
                 ("reference", "spec", {"spec": (3, [30, 1], [4, 4])})]
        for impl, name, opt in runs:
            os.environ["HYGON_ATTN_IMPL"] = impl
            if "spec" in opt:
                tokens, ctx, ql = opt["spec"]
                case = h.make_case(ctx, ql, seed=tokens)
                out, md = h.run(case, model, spec_tokens=tokens)
                assert md.decode.plan.num_tokens == tokens + 1, md.decode.plan.num_tokens
                ref, tol = h.oracle(case), 2e-3
            else:
                ctx, ql, rows = h.CASES[name]
                case = h.make_case(ctx, ql, seed=len(name))
                out, md = h.run(case, model, workspace_rows=rows, k_scale=opt.get("k_scale"))
                if rows is not None:
                    assert len(md.context_chunks) >= 2, md.context_chunks
                ref = h.oracle(case, k_scale=opt.get("k_scale"))
                tol = 3e-3 if opt else 2e-3
            if md.decode is not None:
                assert md.decode.plan.impl == impl, md.decode.plan.impl
            try:
                torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
            except AssertionError as exc:
                first = str(exc).strip().splitlines()[0]
                raise AssertionError(f"{name} ({impl}, {opt or 'plain'}): {first}") from None
            done += 1
    return done, fp8


def check_mla() -> str:
    import shutil

    from hygon_attn_backend.integrations.vllm import mla_select
    from hygon_attn_backend.tools.demo import engine as demo_engine
    from tests.support import vllm_mla

    if not mla_select.mla_available():
        raise NotApplicable(_mla_refused())
    cases, fp8 = _mla_cases()
    folder = os.environ.get("HYGON_MLA_ORACLE")
    if not folder:
        raise AssertionError("HYGON_MLA_ORACLE (the oracle's folder) is not set")
    with open(os.path.join(folder, vllm_mla.ORACLE_FILE)) as f:
        oracle = json.load(f)
    env = {"HYGON_ATTN_IMPL": "auto", "TRITON_INTERPRET": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        # the oracle's weights and config; the tokenizer (the same word list, so the same
        # ids) written again by this environment's transformers: 0.18's cannot read the
        # files 0.32's wrote
        model = shutil.copytree(os.path.join(folder, "model"), os.path.join(tmp, "model"))
        demo_engine.save_word_tokenizer(model)
        ours = vllm_mla.generate(model, "hygon", env=env, timeout=1200)
    assert "HygonMLABackend" in ours["log"], ours["log"][-1500:]
    assert "hygon attention backend (MLA): Triton kernels" in ours["log"], ours["log"][-1500:]
    theirs = oracle["tokens"]
    assert len(ours["tokens"]) == len(theirs), (len(ours["tokens"]), len(theirs))
    for i, (a, b) in enumerate(zip(ours["tokens"], theirs)):
        assert a == b, (f"prompt {i}: hygon {a} vs {oracle['backend']} (vLLM "
                        f"{oracle['vllm']}) {b}; its top-2 logprob gaps {oracle['gaps'][i]}")
    n = sum(len(t) for t in theirs)
    gap = min(min(g) for g in oracle["gaps"])
    return (f"{cases} MLA cases within budget of the float64 oracle (through this vLLM's "
            f"MLA builder; 5 with the Triton kernels"
            f"{'' if fp8 else '; no fp8 cases: its CPU platform turns fp8 KV off'}); "
            f"tiny DeepSeek greedy: "
            f"{len(theirs)} prompts, {n} tokens equal to vLLM {oracle['vllm']}'s "
            f"{oracle['backend']} (hygon: Triton kernels; smallest top-2 gap {gap:.4f})")


CHECKS = {"register": check_register, "interface": check_interface,
          "harness": check_harness, "greedy-v1": lambda: check_greedy("v1"),
          "greedy-v2": lambda: check_greedy("v2"), "mla": check_mla}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", choices=sorted(CHECKS), required=True)
    args = parser.parse_args()
    try:
        result, reason = "pass", CHECKS[args.check]()
    except NotApplicable as exc:
        result, reason = "n/a", str(exc)
    except Exception as exc:  # the reason goes into the table; the trace to stderr
        traceback.print_exc()
        lines = str(exc).strip().splitlines()
        first = lines[0] if lines else ""
        # an engine child's failure: its own last error line says what went wrong
        cause = next((ln.strip() for ln in reversed(lines[1:])
                      if re.match(r"^\s*[\w.]*(Error|Exception): ", ln)), "")
        reason = f"{type(exc).__name__}: {first}" + (f" ... {cause}" if cause else "")
        result, reason = "fail", reason[:400]
    sys.stdout.flush()
    print("CHECK " + json.dumps({"check": args.check, "result": result, "reason": reason}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
