"""Request traces for ``hygon-attn simulate``: three built-in workloads and a JSON-lines
reader for the user's own.

A trace is a list of :class:`TraceRequest`. Token ids matter only for prefix reuse: two
requests share cached K/V exactly where their id sequences agree. The ids a request
generates are :func:`output_ids` of its index unless the trace gives them, so a chat's
next turn (whose prompt holds the previous answer) can hit the previous turn's cache.

``--trace FILE``: one JSON object per line with
``prompt`` (a list of token ids) or ``prompt_len`` (random ids, unique to the request),
``output_len`` (tokens to generate), and optionally ``output`` (the generated ids) and
``after`` (the 0-based line of a request that must finish before this one arrives, as a
chat turn waits for the previous answer). Example::

    {"prompt": [1, 2, 3, 4], "output_len": 8}
    {"prompt_len": 300, "output_len": 20, "after": 0}
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import List, Optional

BUILTIN = ("chat", "few-shot", "random")
_ID_SPACE = 1 << 30


@dataclass
class TraceRequest:
    prompt: List[int]
    output_len: int
    output: List[int] = field(default_factory=list)  # generated ids (len == output_len)
    after: Optional[int] = None  # index of a request that must finish first

    @property
    def final_len(self) -> int:
        return len(self.prompt) + self.output_len


def output_ids(index: int, n: int) -> List[int]:
    """The ``n`` ids request ``index`` generates (deterministic, unique to it)."""
    rng = random.Random(f"out-{index}")
    return [rng.randrange(1, _ID_SPACE) for _ in range(n)]


def _ids(rng: random.Random, n: int) -> List[int]:
    return [rng.randrange(1, _ID_SPACE) for _ in range(n)]


def _finish(reqs: List[TraceRequest]) -> List[TraceRequest]:
    for i, r in enumerate(reqs):
        if len(r.output) != r.output_len:
            r.output = output_ids(i, r.output_len)
    return reqs


def chat_trace(*, conversations: int = 24, turns: int = 4, system_len: int = 64,
               user_len=(16, 96), output_len=(32, 192), seed: int = 0) -> List[TraceRequest]:
    """Multi-turn chat: each turn's prompt is the whole conversation so far (system
    prompt, earlier questions and answers) plus a new question; turn ``t`` arrives when
    turn ``t - 1`` has finished. Turns are ordered round-robin over conversations."""
    rng = random.Random(seed)
    history = [_ids(rng, system_len) for _ in range(conversations)]
    last = [None] * conversations
    reqs: List[TraceRequest] = []
    for _ in range(turns):
        for c in range(conversations):
            prompt = history[c] + _ids(rng, rng.randint(*user_len))
            n_out = rng.randint(*output_len)
            index = len(reqs)
            out = output_ids(index, n_out)
            reqs.append(TraceRequest(prompt, n_out, out, after=last[c]))
            history[c] = prompt + out
            last[c] = index
    return reqs


def few_shot_trace(*, requests: int = 64, shared_len: int = 1024, question_len=(16, 64),
                   output_len=(16, 128), seed: int = 0) -> List[TraceRequest]:
    """Every request starts with the same few-shot prefix, then its own question."""
    rng = random.Random(seed)
    shared = _ids(rng, shared_len)
    reqs = [TraceRequest(shared + _ids(rng, rng.randint(*question_len)),
                         rng.randint(*output_len)) for _ in range(requests)]
    return _finish(reqs)


def random_trace(*, requests: int = 64, prompt_len=(32, 1536), output_len=(16, 512),
                 seed: int = 0) -> List[TraceRequest]:
    """Independent requests of uniformly random prompt and output lengths (no sharing)."""
    rng = random.Random(seed)
    reqs = [TraceRequest(_ids(rng, rng.randint(*prompt_len)), rng.randint(*output_len))
            for _ in range(requests)]
    return _finish(reqs)


def builtin(name: str, *, seed: int = 0) -> List[TraceRequest]:
    makers = {"chat": chat_trace, "few-shot": few_shot_trace, "random": random_trace}
    if name not in makers:
        raise ValueError(f"unknown built-in trace {name!r}; choose from {list(BUILTIN)}")
    return makers[name](seed=seed)


def load_trace(path: str, *, seed: int = 0) -> List[TraceRequest]:
    """Read a JSON-lines trace (see the module docstring). A malformed line is a
    ValueError naming the file, the line and what is wrong with it."""
    rng = random.Random(seed)
    reqs: List[TraceRequest] = []
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            line = line.strip()
            if line:
                reqs.append(_parse_line(line, f"{path}:{lineno}", rng, len(reqs)))
    if not reqs:
        raise ValueError(f"{path}: no requests")
    return _finish(reqs)


def _ids_of(value, where: str, key: str) -> List[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                              and t >= 0 for t in value):
        raise ValueError(f"{where}: {key!r} must be a list of token ids (integers >= 0)")
    return list(value)


def _count(rec: dict, key: str, where: str, low: int) -> int:
    value = rec[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{where}: {key!r} must be an integer >= {low}, got {value!r}")
    return value


def _parse_line(line: str, where: str, rng: random.Random, earlier: int) -> TraceRequest:
    """One trace line; ``earlier``: how many requests precede it."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(rec, dict):
        raise ValueError(f"{where}: a line must be a JSON object, got {type(rec).__name__}")
    if "prompt" in rec:
        prompt = _ids_of(rec["prompt"], where, "prompt")
        if not prompt:
            raise ValueError(f"{where}: 'prompt' is empty")
    elif "prompt_len" in rec:
        prompt = _ids(rng, _count(rec, "prompt_len", where, 1))
    else:
        raise ValueError(f"{where}: needs 'prompt' or 'prompt_len'")
    if "output_len" not in rec:
        raise ValueError(f"{where}: needs 'output_len'")
    output_len = _count(rec, "output_len", where, 1)
    output = _ids_of(rec.get("output", []), where, "output")
    if output and len(output) != output_len:
        raise ValueError(f"{where}: 'output' holds {len(output)} ids, 'output_len' is "
                         f"{output_len}")
    after = rec.get("after")
    if after is not None and (not isinstance(after, int) or isinstance(after, bool)
                              or not 0 <= after < earlier):
        raise ValueError(f"{where}: 'after' must name an earlier line, got {after!r}")
    return TraceRequest(prompt, output_len, output, after)
