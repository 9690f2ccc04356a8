"""``hygon-attn sglang-serve``: SGLang's HTTP server with ``hygon`` (examples/sglang_server.py).
The server process (its scheduler process spawned by SGLang) serves the tiny Llama's
three rounds over ``/generate`` with the tokens of SGLang's offline ``torch_native``
Engine, radix-cache hits included. About two and a half minutes on a 2-core CPU, hence
``slow``. SGLang 0.5.10, which needs this command, runs it in the compat matrix's
``server`` check."""

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("sglang")

from tests.support import REPO  # noqa: E402
from tests.support.sglang_example import run_example  # noqa: E402


@pytest.mark.slow
def test_the_http_server_serves_the_offline_tokens():
    server = os.path.join(str(REPO), "examples", "sglang_server.py")
    proc = run_example([], script=server)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "served by hygon-attn sglang-serve" in out, out
    assert re.search(r"^MATCH \(hygon at TP=1 vs torch_native", out, re.M), out
    cached = re.findall(r"^chat [ABC] turn \d: cached\s+(\d+)", out, re.M)
    assert len(cached) == 4 and int(cached[1]) > 0 and int(cached[3]) > 0, out


def test_sglangs_help_comes_through():
    proc = subprocess.run([sys.executable, "-m", "hygon_attn_backend", "sglang-serve", "--help"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--attention-backend" in proc.stdout and "--model-path" in proc.stdout
