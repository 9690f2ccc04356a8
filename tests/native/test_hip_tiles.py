"""The Triton kernels' tiles fit AMD/Hygon GPUs: every tile ``tuning.tile_config_hip``
can return, and the decode tiles of ``ops.decode.tuning.tile_config`` at the head dims and
groups that change them, compiled for gfx90a by the installed Triton's AMD backend (no GPU
needed), use at most the 64 KB of LDS a workgroup gets and spill no VGPR. (The NVIDIA
prefill tiles do not: 128 x 128 / 8 warps / 3 stages needs 96 KB, and Triton refuses to
launch it there; docs/history.md.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hygon_attn_backend.ops.prefill import tuning
from tests import support

SCRIPTS = str(support.REPO / "scripts")


def _hip_tiles():
    """{(tile, head_dim): a group that takes it} over every input the rule tells apart."""
    seen = {}
    for head_dim in (64, 128, 256):
        for group_pow2 in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            for fills in (False, True):
                try:
                    tile = tuning.tile_config_hip(head_dim_pad=head_dim,
                                                          group_pow2=group_pow2,
                                                          fills_sms=fills)
                except ValueError:
                    continue
                seen.setdefault((tile, head_dim), group_pow2)
    return sorted(seen.items())


def _amd_backend():
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "amd" in backends


# (head_dim, group, split): one decode configuration per distinct tile / accumulator size
DECODE_CASES = [(64, 64, True), (128, 4, True), (128, 8, False), (128, 64, True),
                (256, 4, True), (256, 64, True)]


def _compile_in_child(code: str, arg) -> list:
    """Run ``code`` (prints one JSON line) without Triton's interpreter (the tests run under
    it, conftest; its kernels cannot be compiled)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code, json.dumps(arg)], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def gfx90a_resources():
    """{(tile, head_dim): (shared bytes, resources)} of the prefill tiles."""
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {SCRIPTS!r})\n"
        "from prefill_ptxas import amdgcn_resources, compile_tile_for\n"
        "out = []\n"
        "for (tile, head_dim), group in json.loads(sys.argv[1]):\n"
        "    c = compile_tile_for(*tile, head_dim=head_dim, group=min(group, tile[0]),\n"
        "                         target=('hip', 'gfx90a', 64))\n"
        "    out.append([tile, head_dim, c.metadata.shared, amdgcn_resources(c.asm['amdgcn'])])\n"
        "print(json.dumps(out))\n")
    return {(tuple(tile), head_dim): (shared, res)
            for tile, head_dim, shared, res in _compile_in_child(code, _hip_tiles())}


@pytest.mark.skipif(not _amd_backend(), reason="this Triton has no AMD backend to compile with")
@pytest.mark.parametrize("case", _hip_tiles(), ids=lambda c: f"{c[0][0]}-D{c[0][1]}-G{c[1]}")
def test_hip_prefill_tile_fits_gfx90a(case, gfx90a_resources):
    (tile, head_dim), _ = case
    shared, res = gfx90a_resources[(tuple(tile), head_dim)]
    assert shared <= tuning.HIP_LDS_BYTES, (tile, head_dim, shared, res)
    assert res["vgpr_spills"] == 0, (tile, head_dim, res)


@pytest.fixture(scope="module")
def gfx90a_decode_resources():
    """{(head_dim, group, split): (tile, shared bytes, resources)} of the decode kernel."""
    code = (
        "import json, sys\n"
        f"sys.path.insert(0, {SCRIPTS!r})\n"
        "from decode_ptxas import compile_config\n"
        "from prefill_ptxas import amdgcn_resources\n"
        "from hygon_attn_backend.ops.decode import tuning\n"
        "out = []\n"
        "for head_dim, group, split in json.loads(sys.argv[1]):\n"
        "    rows = 1 << max(0, (group - 1).bit_length())\n"
        "    tile = tuning.tile_config(block_m=max(16, rows), head_dim_pad=head_dim,\n"
        "                                     page_size=16, kv_elem_size=2, rows=group)\n"
        "    c, _ = compile_config(group, tile[0], tile[2], split, warps=tile[1],\n"
        "                          head_dim=head_dim, target=('hip', 'gfx90a', 64))\n"
        "    out.append([head_dim, group, split, list(tile), c.metadata.shared,\n"
        "                amdgcn_resources(c.asm['amdgcn'])])\n"
        "print(json.dumps(out))\n")
    return {(d, g, split): (tile, shared, res)
            for d, g, split, tile, shared, res in _compile_in_child(code, DECODE_CASES)}


@pytest.mark.skipif(not _amd_backend(), reason="this Triton has no AMD backend to compile with")
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"D{c[0]}-G{c[1]}-split{int(c[2])}")
def test_hip_decode_tile_fits_gfx90a(case, gfx90a_decode_resources):
    tile, shared, res = gfx90a_decode_resources[tuple(case)]
    assert shared <= tuning.HIP_LDS_BYTES, (case, tile, shared, res)
    assert res["vgpr_spills"] == 0, (case, tile, res)
