"""scripts/compat/run.py, the engine-version matrix driver: its table, its handling of an
environment that cannot be built, and of an engine module this checkout lacks (no engine
is installed here: the engine modules are stand-ins)."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import types

from tests import support

RUN = support.REPO / "scripts" / "compat" / "run.py"


def load_driver():
    spec = importlib.util.spec_from_file_location("compat_run", RUN)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def row(version, check, result, reason=""):
    return {"engine": "vllm", "version": version, "check": check, "result": result,
            "reason": reason}


def test_table_has_one_row_per_version_and_the_reasons():
    run = load_driver()
    text = run.table([row("0.15.1", "register", "pass", "ok"),
                      row("0.15.1", "greedy-v2", "n/a", "no V2 runner"),
                      row("0.32.0", "register", "fail", "ImportError: x")])
    lines = text.splitlines()
    assert lines[0] == "| engine | version | register | greedy-v2 |"
    assert lines[2] == "| vllm | 0.15.1 | pass | n/a |"
    assert lines[3] == "| vllm | 0.32.0 | fail |  |"
    assert "- vllm 0.32.0 register: fail: ImportError: x" in lines


def test_an_environment_that_fails_is_one_row_and_the_next_version_runs(tmp_path):
    run = load_driver()
    calls = []

    def build_env(version, cache_dir):
        if version == "bad":
            raise RuntimeError("pip install torch==0.0 failed (exit 1):\nno such version")
        return tmp_path / "python"

    def run_checks(version, python, repo):
        calls.append((version, python, repo))
        return [row(version, "register", "pass")]

    fake = types.SimpleNamespace(build_env=build_env, run_checks=run_checks)
    rows = run.run_engine(fake, "vllm", ["bad", "good"], tmp_path)
    assert rows[0] == row("bad", "env", "fail", "pip install torch==0.0 failed (exit 1):")
    assert rows[1] == row("good", "register", "pass")
    assert calls == [("good", tmp_path / "python", run.REPO)]


def test_build_only_builds_every_version_and_runs_no_check(tmp_path):
    run = load_driver()

    def build_env(version, cache_dir):
        if version == "bad":
            raise RuntimeError("pip install torch==0.0 failed (exit 1):\nno such version")
        return tmp_path / "python"

    def run_checks(version, python, repo):
        raise AssertionError("--build-only ran a check")

    fake = types.SimpleNamespace(build_env=build_env, run_checks=run_checks)
    rows = run.run_engine(fake, "vllm", ["bad", "good"], tmp_path, build_only=True)
    assert [(r["version"], r["check"], r["result"]) for r in rows] == [
        ("bad", "env", "fail"), ("good", "env", "pass")]
    assert rows[1]["reason"].startswith(str(tmp_path / "python"))


def test_the_vllm_module_exposes_the_driver_interface():
    sys.path.insert(0, str(RUN.parent))
    try:
        import vllm_checks
    finally:
        sys.path.remove(str(RUN.parent))
    # the oldest and the newest with every check, and the newest supported (interface
    # checks, --no-deps over the newest CPU build)
    assert vllm_checks.CI_VERSIONS == [vllm_checks.VERSIONS[0], "0.32.0",
                                       vllm_checks.VERSIONS[-1]]
    assert set(vllm_checks.CI_VERSIONS) <= set(vllm_checks.VERSIONS)
    assert set(vllm_checks.CI_VERSIONS) & vllm_checks.NODEPS_VERSIONS == {"0.34.0"}
    assert vllm_checks.NODEPS_BASE == vllm_checks.DEV_ENV_VERSION == "0.32.0"
    assert callable(vllm_checks.build_env) and callable(vllm_checks.run_checks)


def test_versions_need_one_engine():
    proc = subprocess.run([sys.executable, str(RUN), "--versions", "0.21.0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--versions needs one --engine" in proc.stderr


def test_sglang_ci_reuses_the_checkouts_env_for_its_newest_version(tmp_path, monkeypatch):
    sys.path.insert(0, str(RUN.parent))
    try:
        import sglang_checks
    finally:
        sys.path.remove(str(RUN.parent))
    assert sglang_checks.CI_VERSIONS == ["0.5.10", sglang_checks.DEV_ENV_VERSION]
    assert sglang_checks.DEV_ENV_VERSION == sglang_checks.VERSIONS[-1]
    # the version scripts/setup_cpu_env.sh installs (the file the Makefile rebuilds on)
    assert (support.REPO / "requirements"
            / f"sglang-{sglang_checks.DEV_ENV_VERSION}-cpu-nodeps.txt").exists()
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / ".hygon-env-ok").touch()
    monkeypatch.setattr(sglang_checks, "REPO", tmp_path)
    cache = tmp_path / "cache"
    got = sglang_checks.build_env(sglang_checks.DEV_ENV_VERSION, cache)
    assert got == tmp_path / ".venv" / "bin" / "python"
    assert not cache.exists()  # nothing built
