"""The ``hygon-attn`` command line."""

import re
import shutil
import subprocess
import sys

import pytest

from hygon_attn_backend.tools import cli, doctor


def test_doctor_reports_versions_and_implementations(capsys):
    assert cli.main(["doctor"]) == 0
    out = capsys.readouterr().out
    for key in ("python", "torch", "triton", "device", "vllm entry point",
                "sglang entry point", "triton interpreter", "reference (torch)", "native (csrc)",
                "native prefill", "native decode", "native MLA decode"):
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


def test_native_mla_status_names_the_rule(monkeypatch):
    """The doctor's native-MLA line: no GPU; a GPU other than sm_90 (why); sm_90 (the
    rule: widths, dtype, rows)."""
    from hygon_attn_backend.ops.mla import native

    assert doctor._native_mla_status(False).startswith("no")
    monkeypatch.setattr(native, "device_unsupported", lambda device: "compute capability 8.0")
    monkeypatch.setattr("torch.cuda.current_device", lambda: 0)
    assert "compute capability 8.0" in doctor._native_mla_status(True)
    monkeypatch.setattr(native, "device_unsupported", lambda device: None)
    line = doctor._native_mla_status(True)
    assert "512 + 64" in line and ">= 33 query rows" in line, line


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


# --- the command line as a user runs it (subprocess): exit codes and messages ---------

from tests import support  # noqa: E402

#: Run before the CLI in a child: makes the modules named in argv[1] unimportable, as on a
#: machine where they are not installed (the venv's start-up may have imported them:
#: those copies are dropped).
_BLOCKER = """
import runpy, sys
blocked = sys.argv[1].split(",")
def _hit(name):
    return any(name == b or name.startswith(b + ".") for b in blocked)
class _Absent:
    # every finder answers 'not here' for the blocked names, as when nothing provides them
    def __init__(self, inner):
        self.inner = inner
    def find_spec(self, name, path=None, target=None):
        return None if _hit(name) else self.inner.find_spec(name, path, target)
    def __getattr__(self, attr):
        return getattr(self.inner, attr)
for name in [m for m in sys.modules if _hit(m)]:
    del sys.modules[name]
sys.meta_path[:] = [_Absent(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
sys.argv = ["hygon-attn"] + sys.argv[2:]
runpy.run_module("hygon_attn_backend", run_name="__main__", alter_sys=True)
"""


def run_cli(*argv, absent=(), env=None, timeout=180):
    """``python -m hygon_attn_backend ARGV`` from the repository root (this checkout's
    package), with the modules of ``absent`` unimportable and ``env`` over the
    environment (a None value unsets the variable); returns the CompletedProcess."""
    cmd = [sys.executable, "-m", "hygon_attn_backend", *argv]
    if absent:
        cmd = [sys.executable, "-c", _BLOCKER, ",".join(absent), *argv]
    full_env = dict(__import__("os").environ, **(env or {}))
    full_env = {k: v for k, v in full_env.items() if v is not None}
    return subprocess.run(cmd, cwd=support.REPO, capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def _one_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line, got:\n{text}"
    assert "Traceback" not in text
    return lines[0]


def test_version_prints_the_installed_version():
    import importlib.metadata as md

    import hygon_attn_backend

    try:
        expected = md.version("hygon-attn-backend")
    except md.PackageNotFoundError:
        expected = hygon_attn_backend.__version__
    res = run_cli("--version")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == f"hygon-attn {expected}"


@pytest.mark.parametrize("argv, names", [
    (["fuzz", "--op", "decode", "--cases", "-5"], "--cases"),
    (["fuzz", "--op", "decode", "--cases", "0"], "--cases"),
    (["fuzz", "--op", "decode", "--skip", "-1"], "--skip"),
    (["fuzz", "--op", "decode", "--case", "-2"], "--case"),
    (["fuzz", "--op", "decode", "--shard", "3/2"], "--shard"),
    (["fuzz", "--op", "decode", "--shard", "half"], "--shard"),
    (["fuzz", "--op", "attention"], "--op"),
    (["simulate", "--memory-tokens", "-5"], "--memory-tokens"),
    (["simulate", "--memory-tokens", "many"], "--memory-tokens"),
    (["simulate", "--max-len", "0"], "--max-len"),
    (["simulate", "--managers", "vllm-0"], "--managers"),
    (["simulate", "--managers", "vllm-x"], "--managers"),
    (["simulate", "--managers", "sglang"], "--managers"),
    (["simulate", "--managers", ","], "--managers"),
    (["simulate", "--trace", "no-such-trace"], "--trace"),
    (["fuzz", "--op", "write_kv", "--impl", "auto"], "--impl"),
    (["bench", "decode", "--rep-ms", "fast"], "--rep-ms"),
    (["bench", "decode", "--rep-ms", "-1"], "--rep-ms"),
    (["bench", "decode", "--impl", "cuda"], "--impl"),
    (["bench", "decode", "--shapes", "2x40"], "--shapes"),
    (["bench", "decode", "--block-sizes", "16,x"], "--block-sizes"),
    (["bench", "decode", "--partitions", "20"], "--partitions"),
    (["bench", "decode", "--groups", "a"], "--groups"),
    (["bench", "decode", "--num-kv-heads", "0"], "--num-kv-heads"),
    (["bench", "decode", "--num-kv-heads", "5"], "--num-kv-heads 5"),
    (["bench", "prefill", "--shapes", "1,2"], "--shapes"),
    (["bench", "prefill", "--tiles", "1,2"], "--tiles"),
    (["bench", "prefill", "--impl", "x"], "--impl"),
    (["bench", "cache", "--num-tokens", "-1"], "--num-tokens"),
    (["bench", "engine", "--pages", "0"], "--pages"),
    (["bench", "step", "--layers", "0"], "--layers"),
    (["no-such-command"], "no-such-command"),
    ([], "command"),
])
def test_a_bad_argument_is_one_line_naming_it(argv, names):
    res = run_cli(*argv, timeout=120)
    assert res.returncode != 0, res.stdout
    line = _one_line(res.stderr)
    assert names in line, line


@pytest.mark.parametrize("content, says", [
    ("{not json}\n", "t.jsonl:1: not JSON"),
    ('{"prompt": [1, 2], "output_len": 1}\n[1, 2, 3]\n', "t.jsonl:2: a line must be a JSON object"),
    ('{"prompt": ["a"], "output_len": 1}\n', "'prompt' must be a list of token ids"),
    ('{"prompt_len": -4, "output_len": 1}\n', "'prompt_len' must be an integer >= 1"),
    ('{"prompt": [1, 2]}\n', "needs 'output_len'"),
    ('{"prompt": [1, 2], "output_len": 0}\n', "'output_len' must be an integer >= 1"),
    ('{"prompt": [1], "output_len": 2, "output": [5]}\n', "'output' holds 1 ids"),
    ('{"prompt": [1], "output_len": 1, "after": 3}\n', "'after' must name an earlier line"),
    ("\n\n", "no requests"),
    (b"\xff\xfe\x00", "--trace"),
])
def test_a_malformed_trace_file_is_one_line_naming_file_and_line(tmp_path, content, says):
    path = tmp_path / "t.jsonl"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    res = run_cli("simulate", "--trace", str(path), "--managers", "contiguous-max")
    assert res.returncode != 0, res.stdout
    line = _one_line(res.stderr)
    assert says in line and "--trace" in line, line


def test_simulate_numbers_that_cannot_hold_a_request_are_one_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt_len": 100, "output_len": 4}\n')
    res = run_cli("simulate", "--trace", str(path), "--managers", "contiguous-max",
                  "--max-len", "50")
    assert res.returncode != 0
    line = _one_line(res.stderr)
    assert "exceed max_len 50" in line and "--max-len 50" in line, line
    res = run_cli("simulate", "--trace", str(path), "--managers", "contiguous-exact",
                  "--memory-tokens", "20")
    assert res.returncode != 0
    assert "does not fit in 20 slots" in _one_line(res.stderr)


def test_without_numpy_doctor_says_the_interpreter_cannot_run():
    res = run_cli("doctor", absent=["numpy"])
    assert res.returncode == 0, res.stderr
    line = next(x for x in res.stdout.splitlines() if "triton interpreter" in x)
    assert "no (needs numpy: pip install numpy)" in line, res.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU path")
@pytest.mark.parametrize("argv, command", [
    (["fuzz", "--op", "decode", "--cases", "5"], "hygon-attn fuzz"),
    (["demo", "--ops"], "hygon-attn demo"),
    (["demo"], "hygon-attn demo"),
    (["bench", "decode"], "hygon-attn bench decode"),
])
def test_without_numpy_the_cpu_commands_say_what_to_install(argv, command):
    """Triton's interpreter imports numpy: a command that would run the kernels in it says
    so in one line (exit 2) instead of a traceback or failed fuzz cases."""
    res = run_cli(*argv, absent=["numpy"], env={"TRITON_INTERPRET": "1"})
    assert res.returncode != 0
    line = _one_line(res.stderr)
    assert line.startswith(command) and "pip install numpy" in line, line
    assert "failures" not in res.stdout and "FAIL" not in res.stdout, res.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU path")
def test_the_cpu_commands_run_the_interpreter_where_numpy_is_installed():
    """The other side of the check above, as a user types the commands (no
    TRITON_INTERPRET in the environment: each command sets it itself, and its check must
    not import Triton before that, which would leave the kernels compiled for a GPU)."""
    pytest.importorskip("numpy")
    res = run_cli("fuzz", "--op", "decode", "--cases", "2", env={"TRITON_INTERPRET": None})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "fuzz decode: 2 cases, 0 failures" in res.stdout
    res = run_cli("demo", "--ops", env={"TRITON_INTERPRET": None})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all ops match the reference" in res.stdout


def _readme_commands(prefix: str) -> list:
    """The README's shell lines (in ``bash`` blocks) that start with ``prefix``, without
    their trailing comments."""
    text = (support.REPO / "README.md").read_text()
    blocks = text.split("```bash\n")[1:]
    lines = [line for block in blocks for line in block.split("```")[0].splitlines()]
    return [line.split("  #")[0].strip() for line in lines if line.startswith(prefix)]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU recipe")
def test_the_readme_cpu_bench_recipe_runs_as_written():
    """The README's benchmark line for a machine without a GPU: it runs through Triton's
    interpreter (a small default shape, not a timed test), prints a progress line per point, and every row passes
    the reference check (bf16, broken in the interpreter, is not the CPU default)."""
    import shlex

    (recipe,) = _readme_commands("TRITON_INTERPRET=1 hygon-attn bench decode")
    words = shlex.split(recipe)
    env = dict(w.split("=", 1) for w in words if "=" in w and w.split("=")[0].isupper())
    argv = words[words.index("hygon-attn") + 1:]
    res = run_cli(*argv, env=env, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    progress = [line for line in res.stdout.splitlines() if line.startswith("[")]
    assert progress and progress[0].startswith("[1/"), res.stdout
    rows = [line for line in res.stdout.splitlines() if line.startswith("| B=")]
    assert rows and not [r for r in rows if "wrong" in r or "error" in r], res.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the no-GPU path")
def test_bench_engine_without_a_gpu_says_so_at_once_and_leaves_nothing(tmp_path):
    import time

    t0 = time.perf_counter()
    res = run_cli("bench", "engine", "--quick", env={"TMPDIR": str(tmp_path)}, timeout=60)
    took = time.perf_counter() - t0
    assert res.returncode == 2, res.stdout + res.stderr
    line = _one_line(res.stderr)
    assert line.startswith("hygon-attn bench engine: needs a CUDA or ROCm GPU"), line
    assert res.stdout == "" and took < 30
    assert list(tmp_path.iterdir()) == []


def _make_targets() -> list:
    text = (support.REPO / "Makefile").read_text()
    return re.search(r"^\.PHONY:(.*)$", text, re.M).group(1).split()


def test_every_make_target_has_a_recipe():
    """``make -n -B TARGET`` (prints, runs nothing; every file target taken as out of
    date, as on a fresh clone) shows commands for every phony target, never "Nothing to
    be done"; gpu-test runs the GPU suite."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    targets = _make_targets()
    assert {"demo", "test", "env", "gpu-test", "clean-env"} <= set(targets)
    for target in targets:
        res = subprocess.run(["make", "-n", "-B", target], cwd=support.REPO,
                             capture_output=True, text=True, timeout=60)
        assert res.returncode == 0 and res.stdout.strip(), (target, res.stdout, res.stderr)
        assert "Nothing to be done" not in res.stdout + res.stderr, target
    dry = subprocess.run(["make", "-n", "gpu-test"], cwd=support.REPO, capture_output=True,
                         text=True, timeout=60).stdout
    assert "scripts/gpu_suite.sh" in dry


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the no-GPU path")
def test_make_gpu_test_without_a_gpu_says_so_in_one_line_and_fails():
    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    res = subprocess.run(["make", "-s", "gpu-test", f"PYTHON={sys.executable}"],
                         cwd=support.REPO, capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    ours = [line for line in res.stderr.splitlines() if line.startswith("gpu-test:")]
    assert len(ours) == 1 and "no GPU here" in ours[0], res.stderr
    assert "sees no CUDA or ROCm device" in ours[0], ours[0]
    assert res.stdout == ""  # nothing ran
