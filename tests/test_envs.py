"""envs.py: every variable the package reads is parsed there and listed in the README."""

import re

import pytest

from hygon_attn_backend import envs
from tests import support

ROOT = support.REPO


def test_readme_lists_exactly_the_variables():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    listed = set(re.findall(r"^\| `([A-Z][A-Z0-9_]+)` \|", section, flags=re.M))
    assert listed == set(envs.VARIABLES)


def test_no_other_module_reads_the_environment_for_our_variables():
    """Our variables are read through envs.py only (bench and demo set variables for the
    processes they start, which is writing, not reading)."""
    offenders = []
    for path in (ROOT / "hygon_attn_backend").rglob("*.py"):
        if path.name == "envs.py":
            continue
        for name in envs.VARIABLES:
            if re.search(rf"environ(\.get)?\(?\[?[\"']{name}[\"']", path.read_text()):
                offenders.append(f"{path.relative_to(ROOT)}: {name}")
    assert not offenders, offenders


@pytest.mark.parametrize("name,value,accessor", [
    ("HYGON_ATTN_IMPL", "cuda", envs.impl),
    ("HYGON_ATTN_PARTITION_SIZE", "100", envs.decode_partition_size),
    ("PA_PARTITION_SIZE", "x", envs.decode_partition_size),
    ("HYGON_ATTN_DECODE_PDL", "yes", envs.decode_pdl),
])
def test_bad_values_name_the_variable(name, value, accessor, monkeypatch):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        accessor()


def test_values_parse(monkeypatch):
    monkeypatch.setenv("HYGON_ATTN_PARTITION_SIZE", "2048")
    monkeypatch.setenv("PA_PARTITION_SIZE", "512")
    monkeypatch.setenv("HYGON_ATTN_DECODE_PDL", "0")
    assert envs.decode_partition_size() == 2048
    assert envs.decode_pdl() is False
    monkeypatch.delenv("HYGON_ATTN_PARTITION_SIZE")
    assert envs.decode_partition_size() == 512
