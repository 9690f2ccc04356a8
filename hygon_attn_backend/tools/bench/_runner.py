"""What a benchmark row runs: a :class:`Runner`, or :class:`Unavailable` with the reason."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


class Unavailable(Exception):
    """The implementation cannot run on this machine; the message says why."""


@dataclass
class Runner:
    name: str  # row label, e.g. "sglang triton" or "sdpa flash"
    fn: Callable[[], object]
    out: object  # the output ``fn`` writes, shaped like the problem's q
    note: str = ""  # e.g. "3-D kernel", "K/V expanded to Hq heads"
    keep: list = field(default_factory=list)  # tensors fn needs alive
