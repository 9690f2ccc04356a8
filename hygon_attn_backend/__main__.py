"""``python -m hygon_attn_backend`` / ``hygon-attn``: the command line (``tools/cli.py``)."""

import sys

from hygon_attn_backend.tools.cli import main

if __name__ == "__main__":
    sys.exit(main())
