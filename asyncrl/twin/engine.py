"""A simulated inference engine: vLLM-style continuous batching on the twin's virtual clock.

Each engine step decodes one token for every running request and prefills the requests admitted
at its start (their first token comes out of that step); requests are admitted from the waiting
queue, oldest first, while fewer than `max_num_seqs` run and the KV cache holds their context for
one more step. When the running requests' context outgrows the cache the newest one is preempted
(vLLM's recompute mode: back to the head of the queue, its context prefilled again when it runs).

Between events nothing changes but the context, so a stretch of steps is computed in closed form
(costs.EngineCost.steps_s) and only the step that ends it is an event: the first request to
finish, the cache filling, or a step boundary at which something must happen (a new request that
can start, an abort).

Abort: at the end of the running step every request, running or waiting, is handed back with the
tokens it generated, as vLLM's abort returns a partial completion (the actor resumes them after a
weight load, rollout/actor.py's in-flight update). Pause (sync.keep_kv): at the end of the running
step the engine stops with every request in place, its KV cache kept, until `resume`; the
requests then go on decoding with no prefill (vLLM's pause mode "keep").

Utilisation is measured two ways: busy time (a step is running) and occupancy (running requests
over `max_num_seqs`, time-weighted). An engine can be busy all the time at a fraction of its
batch, which only the second shows.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.twin.costs import EngineCost
from asyncrl.twin.events import EventQueue


@dataclass
class Request:
    context: int
    """Prompt tokens plus the tokens generated so far: what a (re)prefill computes."""
    remaining: int
    """Tokens still to generate."""
    owner: Any = None
    generated: int = 0
    """Tokens this request generated (since it was submitted, or since the last pause)."""
    resumed: bool = False
    """It continues an aborted request: its first prefill recomputes a prefix (EngineStats.reprefill_s)."""


@dataclass
class _Stretch:
    t0: float
    cost: EngineCost
    batch: int
    context: int
    prefill: int
    started: int
    """Requests admitted at its start (each pays EngineCost.c_request_s)."""
    steps: int
    """Steps planned: the stretch ends after them unless cut short."""
    token: int = 0


@dataclass
class EngineStats:
    busy_s: float = 0.0
    steps: int = 0
    tokens: int = 0
    prefill_tokens: int = 0
    preemptions: int = 0
    reprefill_tokens: int = 0
    """Context prefilled again by requests resumed after an abort (prompt plus their prefix)."""
    reprefill_s: float = 0.0
    """The share of step time those prefills cost (their c_prefill_s and c_request_s)."""
    busy_by_bin: dict[int, float] = field(default_factory=dict)
    running_by_bin: dict[int, float] = field(default_factory=dict)
    """Request-seconds per bin: running requests times time (occupancy = this / (max_num_seqs x bin))."""


class SimEngine:
    def __init__(self, cost: EngineCost, max_num_seqs: int, kv_tokens: int, events: EventQueue,
                 on_finished: Callable[[list[Request], float], None],
                 on_idle: Callable[[float], None] | None = None, bin_s: float = 1.0,
                 on_busy: Callable[[bool, float], None] | None = None):
        self.cost, self.max_num_seqs, self.kv_tokens, self.events = cost, max_num_seqs, kv_tokens, events
        self.on_finished, self.on_idle, self.bin_s, self.on_busy = on_finished, on_idle, bin_s, on_busy
        self._was_busy = False
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.context = 0  # of the running requests
        self.stretch: _Stretch | None = None
        self._token = 0
        self._stop: tuple[str, Callable[..., None]] | None = None  # ("abort" | "pause", callback) at the next boundary
        self.paused = False
        self.slowdown = 1.0  # on the costs of the stretches planned from now on (set_slowdown)
        self.stats = EngineStats()

    @property
    def idle(self) -> bool:
        return self.stretch is None

    @property
    def empty(self) -> bool:
        return not self.running and not self.waiting

    def submit(self, requests: list[Request], t: float) -> None:
        for r in requests:
            if r.context + 1 > self.kv_tokens:
                raise ValueError(f"a request of {r.context} context tokens cannot fit the engine's KV cache of "
                                 f"{self.kv_tokens} tokens")
        self.waiting.extend(requests)
        if self.stretch is None:
            self._plan(t)
        elif len(self.running) < self.max_num_seqs:
            self._cut(t)  # they can join at the next step

    def set_slowdown(self, factor: float, t: float) -> None:
        """Steps from the next boundary on take `factor` times their cost (a machine where the
        engine shares cores with the learner: slower while it trains)."""
        if factor != self.slowdown:
            self.slowdown = factor
            if self.stretch is not None:
                self._cut(t)

    def abort(self, t: float, on_aborted: Callable[[list[Request], float], None]) -> None:
        """At the end of the running step (now, if idle): every request comes back to `on_aborted`."""
        self._stop_at_boundary(t, "abort", on_aborted)

    def pause(self, t: float, on_paused: Callable[[list[Request], float], None]) -> None:
        """At the end of the running step (now, if idle): stop stepping, every request kept in place
        with its KV cache; `on_paused` gets them (running first) until `resume`."""
        self._stop_at_boundary(t, "pause", on_paused)

    def resume(self, t: float) -> None:
        """Step again after a pause: kept requests decode on, with no prefill."""
        self.paused = False
        if self.stretch is None:
            self._plan(t)

    def _stop_at_boundary(self, t: float, kind: str, callback: Callable[[list[Request], float], None]) -> None:
        self._stop = (kind, callback)
        if self.stretch is None:
            self._stopped(t)
        else:
            self._cut(t)

    # -- stretches ------------------------------------------------------------------------------

    def _plan(self, t: float) -> None:
        if self.paused:
            return
        prefill = started = resumed = resumed_n = 0
        while (self.waiting and len(self.running) < self.max_num_seqs
               and self.context + prefill + self.waiting[0].context + len(self.running) + 1 <= self.kv_tokens):
            r = self.waiting.popleft()
            prefill += r.context
            started += 1
            if r.resumed:
                resumed, resumed_n, r.resumed = resumed + r.context, resumed_n + 1, False
            self.running.append(r)
        if not self.running:
            self.stretch = None
            self._notify(t)
            if self.on_idle is not None:
                self.on_idle(t)
            return
        self.context += prefill
        batch = len(self.running)
        by_finish = min(r.remaining for r in self.running)
        by_cache = (self.kv_tokens - self.context) // batch
        self._token += 1
        cost = self.cost if self.slowdown == 1.0 else self.cost.scaled(self.slowdown)
        self.stretch = _Stretch(t, cost, batch, self.context, prefill, started, max(1, min(by_finish, by_cache)),
                                self._token)
        self.stats.prefill_tokens += prefill
        if resumed:
            self.stats.reprefill_tokens += resumed
            self.stats.reprefill_s += cost.c_prefill_s * resumed + cost.c_request_s * resumed_n
        self._schedule()
        self._notify(t)

    def _notify(self, t: float) -> None:
        busy = self.stretch is not None
        if busy != self._was_busy:
            self._was_busy = busy
            if self.on_busy is not None:
                self.on_busy(busy, t)

    def _schedule(self) -> None:
        s = self.stretch
        self.events.at(s.t0 + s.cost.steps_s(s.steps, s.batch, s.context, s.prefill, s.started),
                       lambda t, token=s.token: self._end(t, token))

    def _cut(self, t: float) -> None:
        """End the stretch at the first step boundary at or after t."""
        s = self.stretch
        done = s.cost.steps_done(t - s.t0, s.batch, s.context, s.prefill, s.started)
        steps = done if s.cost.steps_s(done, s.batch, s.context, s.prefill, s.started) >= t - s.t0 and done else done + 1
        if steps < s.steps:
            self._token += 1
            s.steps, s.token = steps, self._token
            self._schedule()

    def _end(self, t: float, token: int) -> None:
        s = self.stretch
        if s is None or token != s.token:
            return  # cut short: a later event ends it
        k = s.steps
        self._account(s.t0, t, k, s.batch)
        for r in self.running:
            r.context += k
            r.remaining -= k
            r.generated += k
        self.context += k * s.batch
        finished = [r for r in self.running if r.remaining <= 0]
        if finished:
            self.running = [r for r in self.running if r.remaining > 0]
            self.context -= sum(r.context for r in finished)
        while self.running and self.context + len(self.running) > self.kv_tokens:
            r = self.running.pop()  # the newest: recomputed when it runs again
            self.context -= r.context
            self.waiting.appendleft(r)
            self.stats.preemptions += 1
        self.stretch = None
        if finished:
            self.on_finished(finished, t)
        if self._stop is not None:
            self._stopped(t)
        elif self.stretch is None:  # on_finished may have submitted (and planned) already
            self._plan(t)

    def _stopped(self, t: float) -> None:
        (kind, callback), self._stop, self.stretch = self._stop, None, None
        requests = [*self.running, *self.waiting]
        if kind == "abort":
            self.running, self.waiting, self.context = [], deque(), 0
        else:
            self.paused = True
        self._notify(t)
        callback(requests, t)

    def _account(self, t0: float, t1: float, steps: int, batch: int) -> None:
        st = self.stats
        st.busy_s += t1 - t0
        st.steps += steps
        st.tokens += steps * batch
        b, w = int(t0 // self.bin_s), self.bin_s
        while t0 < t1:  # busy time and occupancy per bin of the utilisation timeline
            end = min(t1, (b + 1) * w)
            st.busy_by_bin[b] = st.busy_by_bin.get(b, 0.0) + end - t0
            st.running_by_bin[b] = st.running_by_bin.get(b, 0.0) + (end - t0) * batch
            t0, b = end, b + 1
