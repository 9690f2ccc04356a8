"""``hygon-attn sglang-serve``: SGLang's HTTP server with ``hygon`` registered first.

    hygon-attn sglang-serve --model-path MODEL --attention-backend hygon [SGLang's options]

Takes exactly ``python -m sglang.launch_server``'s arguments. SGLang 0.5.17 and later run
our plugin in every process, so there ``python -m sglang.launch_server --attention-backend
hygon`` works by itself and this command is the same server. SGLang 0.5.10 (what Hygon
DCU images ship) has no plugin loader: its launcher parses ``--attention-backend`` before
anything of ours runs and refuses ``hygon``, and its HTTP server starts the scheduler
processes with SGLang's own function, where nothing registers us. This command registers
``hygon`` in the launching process, parses the arguments with SGLang's own
``prepare_server_args`` and, on such a version, starts SGLang's HTTP server with
``run_scheduler_process_func`` set to :func:`.compat.run_scheduler_process` (SGLang's
extension point; ``patches/sglang-0.5.10-scheduler-spawn.md``), which registers in each
scheduler process before running SGLang's. The gRPC, encoder-only and Ray modes of
0.5.10's launcher have no such parameter: they are refused there with the reason.
"""

from __future__ import annotations

import os
import sys
from typing import List, Optional

#: 0.5.10 launcher modes whose servers start their scheduler processes out of our reach
_UNREACHABLE_MODES = ("grpc_mode", "encoder_only", "use_ray")


def main(argv: Optional[List[str]] = None) -> int:
    """Parse SGLang's server arguments (``argv``, default ``sys.argv[1:]``) and run the
    server until it stops; returns its exit status (2 when ``hygon`` cannot be
    registered or a mode is out of reach)."""
    from hygon_attn_backend.integrations.sglang import compat, register

    argv = list(sys.argv[1:] if argv is None else argv)
    if not register():
        print("hygon-attn sglang-serve: the hygon backend could not be registered with "
              f"SGLang {compat.sglang_version()} (the log line above says why)",
              file=sys.stderr)
        return 2
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    server_args = prepare_server_args(argv)
    if compat.has_plugin_loader():
        from sglang.launch_server import run_server

        launch = run_server
    else:
        modes = [m for m in _UNREACHABLE_MODES if getattr(server_args, m, False)]
        if modes:
            print(f"hygon-attn sglang-serve: SGLang {compat.sglang_version()} starts the "
                  f"scheduler processes of --{modes[0].replace('_', '-')} without a hook "
                  "for plugins; only its HTTP server can run hygon", file=sys.stderr)
            return 2
        from sglang.srt.entrypoints.http_server import launch_server

        def launch(args):
            launch_server(args, run_scheduler_process_func=compat.run_scheduler_process)
    try:
        launch(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0
