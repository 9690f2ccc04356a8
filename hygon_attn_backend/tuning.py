"""Named, documented heuristics: partition size for split-KV decode, tile shapes.

Each heuristic is a function whose docstring gives the reasoning and the measurement
behind it (docs/benchmarks.md), with an environment override where users need one.
No model names here: only shapes and device facts.
"""

from __future__ import annotations

import os
