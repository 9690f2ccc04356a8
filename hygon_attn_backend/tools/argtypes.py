"""argparse ``type=`` checks the command line shares: a value that does not parse is
argparse's one-line error naming the option (``argument --cases: must be an integer >=
1, got '-5'``), never a traceback from deep inside a run.

The list checks return the text unchanged (the commands parse it where they use it);
they only refuse what would fail there.
"""

from __future__ import annotations

import argparse


def _int(text: str):
    try:
        return int(text)
    except ValueError:
        return None


def count(low: int = 1):
    """An integer >= ``low``."""
    def parse(text: str) -> int:
        value = _int(text)
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value
    parse.__name__ = f"integer >= {low}"
    return parse


def positive_float(text: str) -> float:
    """A number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def int_list(*, low: int = 1, empty: bool = False):
    """A comma list of integers >= ``low`` (``''`` too when ``empty``); the text back."""
    def parse(text: str) -> str:
        items = [x.strip() for x in text.split(",") if x.strip()]
        bad = [x for x in items if _int(x) is None or _int(x) < low]
        if bad or (not items and not empty):
            raise argparse.ArgumentTypeError(
                f"must be a comma list of integers >= {low}"
                + (" (or '' for none)" if empty else "") + f", got {text!r}")
        return text
    parse.__name__ = "integer list"
    return parse


def tuple_list(*names: str, lows=None, single: bool = False):
    """``';'``-separated tuples of comma-separated integers, one per name (e.g.
    ``B,ctx;B,ctx``), each >= its ``lows`` entry (default 1); ``single``: exactly one
    tuple. The text back."""
    lows = lows or [1] * len(names)
    form = ",".join(names)

    def parse(text: str) -> str:
        groups = [g for g in text.split(";") if g.strip()]
        ok = bool(groups) and (not single or len(groups) == 1)
        for group in groups:
            values = [_int(x.strip()) for x in group.split(",")]
            ok &= len(values) == len(names) and all(
                v is not None and v >= low for v, low in zip(values, lows))
        if not ok:
            shape = form if single else f"{form}[;{form}...]"
            floor = ", ".join(f"{n} >= {low}" for n, low in zip(names, lows))
            raise argparse.ArgumentTypeError(f"must be {shape} ({floor}), got {text!r}")
        return text
    parse.__name__ = f"{form} list"
    return parse
