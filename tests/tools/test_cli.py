"""The ``hygon-attn`` command line."""

import subprocess
import sys

import pytest

from hygon_attn_backend.tools import cli, doctor


def test_doctor_reports_versions_and_implementations(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    for key in ("python", "torch", "triton", "device", "vllm entry point",
                "sglang entry point", "triton interpreter", "reference (torch)", "native (csrc)",
                "native prefill", "native decode"):
        assert key in out, f"doctor output lacks {key!r}:\n{out}"


def test_native_decode_status_names_the_rule(monkeypatch):
    """The doctor's native-decode line: no GPU, HIP (every call), NVIDIA (the grid rule
    with this GPU's program count: 1.5 an SM of 132 SMs is 198)."""
    import torch

    from hygon_attn_backend.ops import _device

    assert doctor._native_decode_status(False).startswith("no")
    monkeypatch.setattr(_device, "gpu_is_hip", lambda: True)
    assert "every call" in doctor._native_decode_status(True)
    monkeypatch.setattr(_device, "gpu_is_hip", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: type("P", (), {"multi_processor_count": 132})())
    line = doctor._native_decode_status(True)
    assert ">= 198 sequences x KV heads (132 SMs)" in line, line


def test_entry_point_status_detects_a_missing_plugin():
    status = doctor._entry_point_status("no.such.group", "x:y")
    assert status.startswith("missing")


def test_parser_knows_every_subcommand():
    parser = cli.build_parser()
    for argv in (["doctor"], ["demo", "--ops"], ["bench", "decode", "--help"]):
        if argv[-1] == "--help":
            with pytest.raises(SystemExit) as exc:
                parser.parse_args(argv)
            assert exc.value.code == 0
        else:
            assert parser.parse_args(argv).command == argv[0]
    with pytest.raises(SystemExit):
        parser.parse_args(["nope"])
    for bench in ("decode", "prefill", "cache"):
        args = parser.parse_args(["bench", bench])
        assert callable(args.func) and args.func.__module__.endswith(f"bench.{bench}")


def test_import_is_cheap():
    """Engines import the plugin in every process: importing the package must not load
    Triton or any kernel module."""
    code = ("import sys, hygon_attn_backend, hygon_attn_backend.integrations; "
            "bad = [m for m in sys.modules if m.startswith('triton') or "
            "m.startswith('hygon_attn_backend.kernels') or m.startswith('hygon_attn_backend.ops')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr
