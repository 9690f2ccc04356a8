"""The prefix-prefill tiles of AMD/Hygon GPUs fit them: every tile
``tuning.prefill_tile_config_hip`` can return, compiled for gfx90a by the installed Triton's
AMD backend (no GPU needed), uses at most the 64 KB of LDS a workgroup gets and spills no
VGPR. (The NVIDIA tiles do not: 128 x 128 / 8 warps / 3 stages needs 96 KB, and Triton
refuses to launch it there; docs/notes-prefill.md, 2026-12-01.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from hygon_attn_backend import tuning

SCRIPTS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "scripts"))


def _hip_tiles():
    """{(tile, head_dim): a group that takes it} over every input the rule tells apart."""
    seen = {}
    for head_dim in (64, 128, 256):
        for group_pow2 in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            for fills in (False, True):
                try:
                    tile = tuning.prefill_tile_config_hip(head_dim_pad=head_dim,
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


@pytest.fixture(scope="module")
def gfx90a_resources():
    """{(tile, head_dim): (shared bytes, resources)}, compiled in a child process: the
    tests run under Triton's interpreter (conftest), whose kernels cannot be compiled."""
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
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code, json.dumps(_hip_tiles())], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    return {(tuple(tile), head_dim): (shared, res)
            for tile, head_dim, shared, res in json.loads(run.stdout.splitlines()[-1])}


@pytest.mark.skipif(not _amd_backend(), reason="this Triton has no AMD backend to compile with")
@pytest.mark.parametrize("case", _hip_tiles(), ids=lambda c: f"{c[0][0]}-D{c[0][1]}-G{c[1]}")
def test_hip_prefill_tile_fits_gfx90a(case, gfx90a_resources):
    (tile, head_dim), _ = case
    shared, res = gfx90a_resources[(tuple(tile), head_dim)]
    assert shared <= tuning.HIP_LDS_BYTES, (tile, head_dim, shared, res)
    assert res["vgpr_spills"] == 0, (tile, head_dim, res)
