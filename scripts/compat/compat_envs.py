"""Cached engine environments for the compatibility matrix (shared by the engine modules).

Layout under the cache folder (default ``~/.cache/hygon-attn-compat``, ``--cache`` or
``HYGON_COMPAT_CACHE`` override):

* ``wheels/``: the engine wheels, downloaded once with ``pip download --no-deps``.
* ``torch-<version>/``: one virtualenv per torch version holding torch (and Triton) only.
* ``<engine>-<version>/``: one virtualenv per engine version, holding the engine and its
  other requirements; a ``.pth`` file puts the matching torch environment's site-packages
  after its own, so several engine versions share one torch install.

An environment is complete when its ``.hygon-compat-ok`` marker exists; a half-built one
(an interrupted build) is deleted and rebuilt.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import zipfile

MARKER = ".hygon-compat-ok"
#: The interpreter the environments are made from (the one running the driver).
BASE_PYTHON = os.environ.get("HYGON_COMPAT_PYTHON", sys.executable)


def default_cache() -> pathlib.Path:
    return pathlib.Path(os.environ.get("HYGON_COMPAT_CACHE",
                                       pathlib.Path.home() / ".cache" / "hygon-attn-compat"))


def log(msg: str) -> None:
    print(f"[compat] {msg}", file=sys.stderr, flush=True)


def run(cmd, **kw) -> None:
    """Run a build step; on failure raise with the tail of its output."""
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr)[-3000:]
        raise RuntimeError(f"{' '.join(map(str, cmd[:6]))} ... failed "
                           f"(exit {proc.returncode}):\n{tail}")


def python_of(venv: pathlib.Path) -> pathlib.Path:
    return venv / "bin" / "python"


def site_packages(python: pathlib.Path) -> pathlib.Path:
    out = subprocess.run([str(python), "-c",
                          "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True).stdout.strip()
    return pathlib.Path(out)


def fresh_venv(path: pathlib.Path) -> pathlib.Path:
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    run([BASE_PYTHON, "-m", "venv", path])
    run([python_of(path), "-m", "pip", "install", "-q", "--upgrade", "pip"])
    return python_of(path)


def pip(python: pathlib.Path, *args) -> None:
    run([python, "-m", "pip", "install", "-q", "--disable-pip-version-check", *args])


def download_wheel(dist: str, version: str, cache: pathlib.Path) -> pathlib.Path:
    """The ``dist==version`` wheel from the cache, downloaded there first if missing."""
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    stem = dist.replace("-", "_")
    found = sorted(wheels.glob(f"{stem}-{version}-*.whl"))
    if not found:
        log(f"downloading {dist}=={version}")
        run([BASE_PYTHON, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             f"{dist}=={version}", "-d", wheels])
        found = sorted(wheels.glob(f"{stem}-{version}-*.whl"))
    if not found:
        raise RuntimeError(f"pip download of {dist}=={version} left no wheel in {wheels}")
    return found[0]


def wheel_requirements(wheel: pathlib.Path) -> list[str]:
    """The wheel's ``Requires-Dist`` lines (requirement; marker), in order."""
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(name).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines()
            if line.startswith("Requires-Dist:")]


def marker_holds(requirement: str) -> bool:
    """Whether a requirement applies on this machine (no extras). Uses ``packaging``
    (pip vendors it), evaluated for the interpreter that builds the environments."""
    from pip._vendor.packaging.requirements import Requirement

    req = Requirement(requirement)
    if req.marker is None:
        return True
    return req.marker.evaluate({"extra": ""})


def requirement_name(requirement: str) -> str:
    from pip._vendor.packaging.requirements import Requirement

    return Requirement(requirement).name.lower().replace("_", "-")


def torch_env(version: str, cache: pathlib.Path) -> pathlib.Path:
    """A virtualenv with ``torch==version`` (the CPU build where the registry serves it,
    else the default build, which runs on CPU too) and Triton; returns its Python."""
    venv = cache / f"torch-{version}"
    py = python_of(venv)
    if (venv / MARKER).exists():
        return py
    log(f"building the torch {version} environment in {venv}")
    py = fresh_venv(venv)
    try:
        pip(py, f"torch=={version}+cpu")
    except RuntimeError:
        pip(py, f"torch=={version}")
    # Our kernels run under Triton's interpreter on CPU; the CPU torch builds lack it.
    has_triton = subprocess.run([str(py), "-c", "import triton"],
                                capture_output=True).returncode == 0
    if not has_triton:
        pip(py, "triton")
    (venv / MARKER).touch()
    return py


def layered_env(venv: pathlib.Path, under: pathlib.Path) -> pathlib.Path:
    """A fresh virtualenv whose ``sys.path`` ends with ``under``'s site-packages (and the
    ``.pth`` files there, so layers chain). Returns its Python."""
    py = fresh_venv(venv)
    below = site_packages(under)
    (site_packages(py) / "hygon_compat_layer.pth").write_text(
        f"import site; site.addsitedir({str(below)!r})\n")
    return py


def write_entry_point(python: pathlib.Path, group: str, name: str, target: str) -> None:
    """Declare one entry point in the environment without installing a project: a bare
    dist-info (the code itself comes from ``PYTHONPATH``, the checkout under test)."""
    info = site_packages(python) / "hygon_attn_compat_entry_point-0.0.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hygon-attn-compat-entry-point\n"
                                   "Version: 0.0.0\n")
    (info / "entry_points.txt").write_text(f"[{group}]\n{name} = {target}\n")
    (info / "RECORD").write_text("")


def disk_free_gb(path: pathlib.Path) -> float:
    path.mkdir(parents=True, exist_ok=True)
    return shutil.disk_usage(path).free / 2 ** 30
