"""The twin's learner on the virtual clock: a step's work (LearnerCost), slowed while engines that
share its cores compute, then the push (every actor idle first, by sync mode, then PushCost).

    idle ─start(tokens)─► training ─(work done)─► done ─push()─► pushing ─(loads done)─► idle

`on_done(t)` tells the twin the step ended (the driver sees it when it next looks); `on_pushed(t)`
that the actors hold the new weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from asyncrl.twin.events import EventQueue
from asyncrl.twin.scenario import Scenario


@dataclass
class Busy:
    """Busy time per timeline bin."""

    bin_s: float
    by_bin: dict[int, float] = field(default_factory=dict)

    def add(self, t0: float, t1: float) -> None:
        b = int(t0 // self.bin_s)
        while t0 < t1:
            end = min(t1, (b + 1) * self.bin_s)
            self.by_bin[b] = self.by_bin.get(b, 0.0) + end - t0
            t0, b = end, b + 1


class SimLearner:
    def __init__(self, sc: Scenario, events: EventQueue, bin_s: float, engines: list[Any], actors: list[Any],
                 on_done: Callable[[float], None], on_pushed: Callable[[float], None]):
        self.sc, self.events, self.engines, self.actors = sc, events, engines, actors
        self.cost, self.push_cost = sc.learner_cost(), sc.push_cost()
        self.ranks = sc.learner.ranks or sc.split.train_gpus  # a batch is split over them
        self.on_done, self.on_pushed = on_done, on_pushed
        self.state = "idle"  # training | done (waiting for the driver to see it) | pushing
        self.busy = Busy(bin_s)
        self.push_s: list[float] = []
        self._engines_busy = 0
        self._work = (0.0, 0.0)  # the running step's work left (s at full speed), since when
        self._token = 0  # of the step's scheduled end: a reschedule makes the earlier one stale
        self._t0 = 0.0  # when the running step or push started
        self._ready = (0, 0.0)  # actors not yet idle for the push, the last one's time
        self._version = 0  # the push's

    def _slowdown(self) -> float:
        return self.sc.learner.slowdown_while_generating if self._engines_busy else 1.0

    def start(self, tokens: int, t: float) -> None:
        """A step over `tokens` (prompts and responses)."""
        self.state, self._t0 = "training", t
        self._contend(t)
        self._work = (self.cost.step_s(tokens), t)
        self._schedule_end(t)

    def _schedule_end(self, t: float) -> None:
        self._token += 1
        self.events.at(t + self._work[0] * self._slowdown(), lambda now, token=self._token: self._step_done(now, token))

    def engine_busy(self, busy: bool, t: float) -> None:
        """An engine started or stopped computing: a learner that shares its cores (on a machine
        like the CPU demo) goes slower or faster from now on."""
        before = self._slowdown()
        self._engines_busy += 1 if busy else -1
        if self.state == "training" and self._slowdown() != before:
            left, since = self._work
            self._work = (left - (t - since) / before, t)
            self._schedule_end(t)

    def _contend(self, t: float) -> None:
        """Engines that share cores with the learner are slower while it trains."""
        factor = self.sc.engine.slowdown_while_training if self.state == "training" else 1.0
        if factor != 1.0 or self.sc.engine.slowdown_while_training != 1.0:
            for e in self.engines:
                e.set_slowdown(factor, t)

    def _step_done(self, t: float, token: int) -> None:
        if token != self._token:
            return  # rescheduled: the engines' load changed during the step
        self.busy.add(self._t0, t)
        self.state = "done"
        self._contend(t)
        self.on_done(t)

    def push(self, version: int, t: float) -> None:
        """Every actor gets idle (drain or abort), then the broadcast and the loads of `version`;
        the driver waits in it, as the orchestrator's loop waits in WeightSync.push."""
        self.state, self._t0, self._version = "pushing", t, version
        self._ready = (len(self.actors), t)
        for a in self.actors:
            a.begin_update(t, self._actor_ready)

    def _actor_ready(self, t: float) -> None:
        left, last = self._ready
        self._ready = (left - 1, max(last, t))
        if left == 1:
            self.events.at(self._ready[1] + self.push_cost.push_s(self.sc.full_push(self._version)),
                           self._push_done)

    def _push_done(self, t: float) -> None:
        self.push_s.append(t - self._t0)
        for a in self.actors:
            a.end_update(self._version, t)
        self.state = "idle"
        self.on_pushed(t)
