"""The package as an index would show it: pyproject's metadata, the LICENSE, the README's
install lines against the extras, and the built wheel's and sdist's metadata (built
offline with setuptools' own PEP 517 hooks from a copy of the tree; ``twine check`` runs
where twine is installed)."""

import email.parser
import importlib.util
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile

import pytest

from hygon_attn_backend.tools import needs
from tests import support

PYPROJECT = tomllib.loads((support.REPO / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
EXTRAS = PROJECT["optional-dependencies"]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].lower()


def test_license_file_is_the_declared_apache_2():
    assert PROJECT["license"] == "Apache-2.0"
    assert PROJECT["license-files"] == ["LICENSE"]
    text = (support.REPO / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text


def test_project_metadata_names_authors_python_and_engines():
    assert PROJECT["authors"] and all(a.get("name") for a in PROJECT["authors"])
    assert {"vllm", "sglang"} <= set(PROJECT["keywords"])
    low = PROJECT["requires-python"].removeprefix(">=")
    versions = [c.rsplit(" :: ", 1)[1] for c in PROJECT["classifiers"]
                if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert versions and versions[0] == low, (versions, low)
    # an SPDX license expression excludes License :: classifiers (PEP 639)
    assert not [c for c in PROJECT["classifiers"] if c.startswith("License ::")]
    assert {"vllm", "sglang", "test", "bench"} <= set(EXTRAS)


def test_install_hints_name_the_extras_requirements():
    """What the CLI tells a user to install is what the extras pull."""
    assert needs.VLLM in EXTRAS["vllm"]
    assert needs.SGLANG in EXTRAS["sglang"]
    assert needs.PLOT in [_name(r) for r in EXTRAS["bench"]]
    assert set(needs.INTERPRETER_NEEDS.values()) <= {
        _name(r) for r in PROJECT["dependencies"] + EXTRAS["test"]}


def test_readme_install_lines_name_what_each_extra_pulls():
    """``pip install ".[X]"   # + a, b (...)``: the names after ``+`` are the extra's."""
    lines = re.findall(r'pip install "\.\[(\w+)\]"\s+# \+ (.*)', (support.REPO / "README.md")
                       .read_text())
    assert {extra for extra, _ in lines} == set(EXTRAS), lines
    for extra, said in lines:
        named = {w.strip().lower() for w in re.sub(r"\([^)]*\)", "", said).split(",")}
        assert named == {_name(r) for r in EXTRAS[extra]}, (extra, said)


def test_readme_links_work_outside_the_repository():
    """An index shows the README without the repository: no images, and every link
    absolute."""
    text = (support.REPO / "README.md").read_text()
    assert "![" not in text and "<img" not in text
    relative = [t for t in re.findall(r"\]\(([^)]+)\)", text)
                if not t.startswith(("http://", "https://", "#"))]
    assert relative == []


def _setuptools_builds() -> bool:
    spec = PYPROJECT["build-system"]["requires"][0]  # "setuptools>=77"
    try:
        import setuptools
    except ImportError:
        return False
    have = tuple(int(x) for x in setuptools.__version__.split(".")[:1])
    return have >= (int(spec.split(">=")[1]),)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """``(wheel, sdist)`` built from a copy of the tree (the build's egg-info and build/
    folders stay out of the checkout), offline."""
    if not _setuptools_builds():
        pytest.skip(f"needs {PYPROJECT['build-system']['requires'][0]} to build offline")
    src = tmp_path_factory.mktemp("src")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(support.REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so")
    for name in ("hygon_attn_backend", "csrc"):
        shutil.copytree(support.REPO / name, src / name, ignore=ignore)
    out = tmp_path_factory.mktemp("dist")
    built_files = []
    for hook in ("build_wheel", "build_sdist"):  # one process each: setuptools keeps state
        code = f"import sys, setuptools.build_meta as b; print('built:', b.{hook}(sys.argv[1]))"
        res = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        built_files.append(res.stdout.rsplit("built:", 1)[1].strip())
    wheel, sdist = built_files
    return out / wheel, out / sdist


def _metadata(text: str):
    return email.parser.Parser().parsestr(text)


def test_wheel_metadata_shows_python_engines_extras_and_license(built):
    wheel, _ = built
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        info = next(n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA"))
        meta = _metadata(z.read(f"{info}/METADATA").decode())
        entry_points = z.read(f"{info}/entry_points.txt").decode()
    assert meta["Name"] == PROJECT["name"] and meta["Version"] == PROJECT["version"]
    assert meta["Requires-Python"] == PROJECT["requires-python"]
    assert meta["License-Expression"] == "Apache-2.0"
    assert f"{info}/licenses/LICENSE" in names
    assert "vLLM" in meta["Summary"] and "SGLang" in meta["Summary"]
    assert set(meta.get_all("Provides-Extra")) == set(EXTRAS)
    requires = meta.get_all("Requires-Dist")
    assert any(r.startswith("vllm") and 'extra == "vllm"' in r for r in requires), requires
    assert any(r.startswith("sglang") and 'extra == "sglang"' in r for r in requires)
    assert meta["Description-Content-Type"] == "text/markdown"
    assert meta.get_payload().startswith("# hygon-attn-backend")
    assert set(meta.get_all("Classifier")) == set(PROJECT["classifiers"])
    assert "[vllm.general_plugins]" in entry_points and "[sglang.srt.plugins]" in entry_points
    assert "hygon-attn = hygon_attn_backend.__main__:main" in entry_points


def test_wheel_holds_every_package_and_the_native_sources(built):
    """Every folder of the package on disk is in the wheel (the package list in
    pyproject.toml is explicit), and so is csrc/ as ``hygon_attn_backend/_csrc``."""
    wheel, _ = built
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    root = support.REPO / "hygon_attn_backend"
    for init in root.rglob("__init__.py"):
        rel = init.relative_to(root.parent).as_posix()
        assert rel in names, f"{rel} is not in the wheel (pyproject.toml's package list)"
    for src in (support.REPO / "csrc").iterdir():
        if src.suffix in (".cu", ".cuh", ".h", ".cpp"):
            assert f"hygon_attn_backend/_csrc/{src.name}" in names, src.name


def test_sdist_holds_license_readme_and_metadata(built):
    _, sdist = built
    with tarfile.open(sdist) as tar:
        names = tar.getnames()
        top = names[0].split("/")[0]
        pkg_info = _metadata(tar.extractfile(f"{top}/PKG-INFO").read().decode())
    for name in ("LICENSE", "README.md", "pyproject.toml", "PKG-INFO"):
        assert f"{top}/{name}" in names, name
    assert pkg_info["Requires-Python"] == PROJECT["requires-python"]


def test_twine_check_passes(built):
    if importlib.util.find_spec("twine") is None:
        pytest.skip("twine is not installed (pip install twine to run this check)")
    res = subprocess.run([sys.executable, "-m", "twine", "check", "--strict", *map(str, built)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_environment_build_resolves_nothing_after_sglang():
    """pip checks what an install touches against the installed tree; with SGLang in it
    (installed --no-deps, without its CUDA-only requirements) that check prints an ERROR
    and a page of expected conflicts. So every install that resolves dependencies comes
    before SGLang's, and the ones after it take --no-deps."""
    script = (support.REPO / "scripts" / "setup_cpu_env.sh").read_text().splitlines()
    installs = [line.strip() for line in script
                if 'pip" install' in line and not line.strip().startswith("#")]
    at = next(i for i, line in enumerate(installs) if "requirements/sglang" in line)
    assert "--no-deps" in installs[at]
    assert [line for line in installs[at + 1:] if "--no-deps" not in line] == []


def test_readme_points_at_what_a_new_user_needs():
    """Prerequisites and disk, the features and refusals, troubleshooting, the changelog
    and where to report a bug, each reachable from the README; every file it names
    exists."""
    text = (support.REPO / "README.md").read_text()
    assert "Python >= 3.11" in text and "3.75 GB" in text
    for path in ("docs/features.md", "docs/troubleshooting.md", "CHANGELOG.md", "LICENSE"):
        assert f"`{path}`" in text, path
    assert "## Reporting bugs" in text
    named = re.findall(r"`((?:docs|examples|patches|scripts|requirements)/[\w./-]*|"
                       r"[A-Z]+\.md|LICENSE)`", text)
    missing = [p for p in named if not (support.REPO / p.rstrip("/")).exists()]
    assert named and missing == [], missing
    features = (support.REPO / "docs" / "features.md").read_text()
    for refused in ("ALiBi", "cross", "encoder", "MLA"):
        assert refused in features, refused
