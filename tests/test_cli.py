"""The ``hygon-attn`` command line."""

import subprocess
import sys

import pytest

from hygon_attn_backend import __main__ as cli


def test_doctor_reports_versions_and_implementations(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    for key in ("python", "torch", "triton", "device", "vllm entry point",
                "sglang entry point", "triton interpreter", "reference (torch)", "native (csrc)",
                "native prefill"):
        assert key in out, f"doctor output lacks {key!r}:\n{out}"


def test_entry_point_status_detects_a_missing_plugin():
    status = cli._entry_point_status("no.such.group", "x:y")
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
