"""The serving loop the simulator replays a trace through (no model, CPU only).

One step is one engine iteration:

1. admission, first come first served: a waiting request that has arrived (its
   ``after`` request has finished) is prefilled if the manager finds room for its
   tokens (reusing what it can); the first one that does not fit stops admission;
2. every running request, in admission order, generates one token (one more K/V slot);
   when the manager has no slot, the most recently admitted other running request is
   preempted (its memory freed; it waits at the head of the queue and is prefilled
   again, prompt plus what it had generated), as vLLM's scheduler does;
3. the step's memory is sampled; requests that generated their last token finish.

Accounting per step, over the running requests: ``used`` = distinct K/V slots they read,
``reserved`` = slots held for them (whole pages, or whole contiguous regions); internal
waste = reserved - used; external waste = free slots a blocked waiting request could not
use (free slots >= its need, yet no region of its size: only the contiguous manager has
any). Prefix reuse: ``hit`` tokens are prompt tokens whose K/V a request found cached at
its first admission; ``prefill computed`` counts every token prefilled, re-prefills of
preempted requests included.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass


@dataclass
class SimResult:
    manager: str
    trace: str
    capacity: int
    requests: int
    steps: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    prefill_computed: int = 0
    preemptions: int = 0
    sum_reserved: int = 0
    sum_used: int = 0
    sum_external: int = 0
    sum_running: int = 0
    peak_running: int = 0
    cached_at_end: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def internal_waste(self) -> float:
        """(reserved - used) / reserved, summed over steps."""
        return 1 - self.sum_used / self.sum_reserved if self.sum_reserved else 0.0

    @property
    def external_waste(self) -> float:
        """Free slots a blocked request could not use, over capacity, summed over steps."""
        return self.sum_external / (self.capacity * self.steps) if self.steps else 0.0

    @property
    def mean_reserved(self) -> float:
        return self.sum_reserved / self.steps if self.steps else 0.0

    @property
    def mean_used(self) -> float:
        return self.sum_used / self.steps if self.steps else 0.0

    @property
    def mean_running(self) -> float:
        return self.sum_running / self.steps if self.steps else 0.0

    def as_row(self) -> dict:
        row = asdict(self)
        row.update(hit_rate=self.hit_rate, internal_waste=self.internal_waste,
                   external_waste=self.external_waste, mean_reserved=self.mean_reserved,
                   mean_used=self.mean_used, mean_running=self.mean_running)
        return row


def simulate(trace, manager, *, trace_name: str = "trace", max_steps: int = 1_000_000
             ) -> SimResult:
    """Replay ``trace`` (a list of :class:`~hygon_attn_backend.tools.simulate.traces.TraceRequest`)
    through ``manager``; returns the accounting."""
    res = SimResult(manager=manager.name, trace=trace_name, capacity=_capacity(manager),
                    requests=len(trace))
    if hasattr(manager, "set_final_len"):
        for i, r in enumerate(trace):
            manager.set_final_len(i, r.final_len)
    waiting = deque(range(len(trace)))
    generated = [0] * len(trace)
    first_admission = [True] * len(trace)
    finished = set()
    running = []  # rids in admission order
    while waiting or running:
        if res.steps >= max_steps:
            raise RuntimeError(f"{manager.name}: no progress after {max_steps} steps")
        external = _admit(trace, manager, waiting, running, finished, generated,
                          first_admission, res)
        if not running:
            if waiting:
                raise ValueError(f"{manager.name}: request {waiting[0]} does not fit in "
                                 f"{res.capacity} slots even alone")
            break
        _decode(trace, manager, waiting, running, generated, res)
        res.steps += 1
        reserved, used = manager.usage(running)
        res.sum_reserved += reserved
        res.sum_used += used
        res.sum_external += external
        res.sum_running += len(running)
        res.peak_running = max(res.peak_running, len(running))
        for rid in [r for r in running if generated[r] == trace[r].output_len]:
            running.remove(rid)
            manager.finish(rid)
            finished.add(rid)
    res.cached_at_end = manager.cached_tokens()
    return res


def _capacity(manager) -> int:
    return getattr(manager, "capacity", None) or manager.free_tokens()


def _admit(trace, manager, waiting, running, finished, generated, first_admission, res):
    """Admit arrived requests in order; returns the external waste of this step."""
    for rid in list(waiting):
        req = trace[rid]
        if req.after is not None and req.after not in finished:
            continue  # not arrived yet
        tokens = req.prompt + req.output[:generated[rid]]
        hit = manager.admit(rid, tokens)
        if hit is None:
            free = manager.free_tokens()
            need = manager.region_size(rid, len(tokens)) if hasattr(
                manager, "region_size") else len(tokens)
            return free if free >= need else 0
        waiting.remove(rid)
        running.append(rid)
        if first_admission[rid]:
            first_admission[rid] = False
            res.prompt_tokens += len(req.prompt)
            res.hit_tokens += hit
        res.prefill_computed += len(tokens) - hit
    return 0


def _decode(trace, manager, waiting, running, generated, res):
    for rid in list(running):
        if rid not in running:
            continue  # preempted earlier in this step
        req = trace[rid]
        if generated[rid] == req.output_len:
            continue
        while not manager.append(rid, req.output[generated[rid]]):
            victim = running[-1]
            running.remove(victim)
            manager.preempt(victim)
            waiting.appendleft(victim)
            res.preemptions += 1
            if victim == rid:
                break
        else:
            generated[rid] += 1
