"""SGLang's HTTP server on ``hygon`` (``hygon-attn sglang-serve``), queried over HTTP.

    python examples/sglang_server.py                      # tiny local model, compared
    python examples/sglang_server.py --model /path/to/llama --compare triton

Starts ``python -m hygon_attn_backend sglang-serve --model-path MODEL --attention-backend
hygon ...``: the server a deployment runs, and on SGLang 0.5.10 (no plugin loader) the one
way to serve ``hygon`` from the command line (``docs/compat.md``). Waits for ``/health``,
sends the three rounds of ``sglang_offline.py`` (chat A, then B and C sharing A's system
prompt, then A's second turn; as token ids, greedy) to ``/generate``, stops the server and
compares the tokens with SGLang's offline Engine on ``--compare`` (default
``torch_native`` on CPU, ``triton`` on a GPU; ``none`` to skip). Exit 0 when they match.
On a machine without a GPU the server runs on the CPU and our Triton kernels in Triton's
interpreter (float16). Needs the package installed (``pip install -e .``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sglang_offline  # noqa: E402  (the workload, the offline runs and the report)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> list:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        out = json.loads(reply.read())
    return out if isinstance(out, list) else [out]


def _wait_healthy(url: str, server: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited ({server.returncode}) before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=5) as reply:
                if reply.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(2)
    raise SystemExit(f"the server was not healthy after {timeout:.0f} s")


def serve_and_generate(args) -> dict:
    """Start the server, run the workload over HTTP, stop it; the offline run's dict."""
    port = args.port or _free_port()
    cmd = [sys.executable, "-m", "hygon_attn_backend", "sglang-serve",
           "--model-path", args.model, "--attention-backend", "hygon",
           "--device", args.device, "--dtype", "float16", "--page-size", str(args.page_size),
           "--skip-tokenizer-init", "--context-length", "256", "--max-total-tokens", "4096",
           "--host", "127.0.0.1", "--port", str(port), "--log-level", args.log_level]
    if args.device == "cpu":
        cmd.append("--disable-cuda-graph")
    env = dict(os.environ)
    if args.device == "cpu":
        env.setdefault("TRITON_INTERPRET", "1")
    server = subprocess.Popen(cmd, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    params = {"max_new_tokens": args.max_new_tokens, "temperature": 0.0}
    try:
        _wait_healthy(url, server, args.start_timeout)
        first_turns, follow_up = sglang_offline.workload()
        gen = url + "/generate"
        out_a = _post(gen, {"input_ids": first_turns[:1], "sampling_params": params}, 600)
        out_bc = _post(gen, {"input_ids": first_turns[1:], "sampling_params": params}, 600)
        turn2 = [first_turns[0] + out_a[0]["output_ids"] + follow_up]
        out_a2 = _post(gen, {"input_ids": turn2, "sampling_params": params}, 600)
    finally:
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            if server.poll() is not None:
                break
            try:
                os.killpg(server.pid, sig)
                server.wait(timeout=wait)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
    outs = out_a + out_bc + out_a2
    return {"backend": "hygon", "spec": None, "output_ids": [o["output_ids"] for o in outs],
            "cached": [o["meta_info"].get("cached_tokens", 0) for o in outs],
            "verify_steps": [0 for _ in outs]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model path (default: build a tiny random Llama)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--compare", default=None,
                        help="the offline Engine's backend to compare with (default: "
                             "torch_native on CPU, triton on GPU; 'none' to skip)")
    parser.add_argument("--port", type=int, default=0, help="the server's port (default: a "
                                                            "free one)")
    parser.add_argument("--start-timeout", type=float, default=900,
                        help="seconds to wait for the server's /health")
    parser.add_argument("--log-level", default="error", help="SGLang's log level")
    parser.add_argument("--max-new-tokens", type=int, default=sglang_offline.MAX_NEW_TOKENS)
    args = parser.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    # what sglang_offline's runs and report read
    args.tp_size, args.engine_args = 1, {}
    with tempfile.TemporaryDirectory(prefix="hygon-sglang-server-") as tmp:
        if args.model is None:
            from hygon_attn_backend.tools.demo import engine

            args.model = engine.build_tiny_llama(os.path.join(tmp, "model"))
        ours = serve_and_generate(args)
        compare = args.compare or ("torch_native" if args.device == "cpu" else "triton")
        theirs = None if compare == "none" else sglang_offline._run_in_process(
            args, compare, tp_size=1)
    print("hygon: served by hygon-attn sglang-serve over HTTP")
    return sglang_offline._report(args, ours, theirs, compare, None, None)


if __name__ == "__main__":
    sys.exit(main())
