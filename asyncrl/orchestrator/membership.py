"""The rollout actors a run generates with, as they come and go.

An actor that started after the run did (scaled up, or replacing a lost one) joins once it holds
the current weights; one that died, or failed a push, is lost: its groups are requeued for the
others and a fresh actor starts in its place (actor_pool.py). Each change is an event and a line.
The pushes go through here too, since a push is where actors join and where they are found lost
(weight_sync.py retries it around the rest).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from asyncrl.observe.metrics import EventLog, Say
from asyncrl.orchestrator.actor_pool import ActorPool
from asyncrl.orchestrator.weight_sync import WeightSync


class ActorMembership:
    def __init__(self, pool: ActorPool, weight_sync: WeightSync, requeue: Callable[[int], int],
                 metrics: EventLog, say: Say):
        self.pool, self.weight_sync, self.requeue, self.metrics, self.say = pool, weight_sync, requeue, metrics, say
        self.lost: list[dict[str, Any]] = []  # every actor lost in the run: step, actor, reason

    def push(self, version: int, step: int, probe_ids: list[int] | None) -> dict[str, float]:
        """Drain push (and, every sync.probe_every, the parity probe); lost actors are replaced."""
        return self.weight_sync.push_and_probe(
            version, step, probe_ids, self.on_lost_at(step),
            lambda error: self.metrics.event(step, "parity_failure", version=version, error=error))

    def after_step(self, version: int, step: int, probe_ids: list[int] | None, due: bool) -> dict[str, float]:
        """At a step's end: the push if one is `due`, or if actors started meanwhile (they join
        with it); its metrics, or {} without one."""
        joined = self.pool.admit_started()
        sync = self.push(version, step, probe_ids) if joined or due else {}
        self._announce(joined, version, step)
        return sync

    def join_started(self, version: int, step: int, probe_ids: list[int] | None) -> None:
        """Actors whose engines came up while no step runs join now, not at the next step
        boundary: with every actor lost there would be no next step. The push gives them the
        current weights (and rebuilds the group) before they get prompts."""
        if self.pool.starting and (joined := self.pool.admit_started()):
            self.push(version, step, probe_ids)
            self._announce(joined, version, step)

    def check(self, step: int) -> None:
        """Actors found dead since the last check are lost."""
        for actor, why in self.pool.find_dead().items():
            self.on_lost([actor], why, step)

    def on_lost_at(self, step: int) -> Callable[[list[int], str], None]:
        """`on_lost(dead, why)` for a push at `step`."""
        return functools.partial(self.on_lost, step=step)

    def on_lost(self, dead: list[int], why: str, step: int) -> None:
        for actor in dead:  # its groups are regenerated elsewhere; a fresh actor starts meanwhile
            requeued = self.requeue(actor)
            self.pool.replace(actor)
            self.metrics.event(step, "actor_lost", actor=actor, groups_requeued=requeued, reason=why)
            self.lost.append({"step": step, "actor": actor, "reason": why})
            self.say(f"step {step}: rollout actor {actor} lost ({why}); {requeued} groups requeued")

    def restore(self, lost: list[dict[str, Any]]) -> None:
        """A checkpoint's record of lost actors (a resumed run's summary counts them all)."""
        self.lost = list(lost)

    def _announce(self, joined: list[int], version: int, step: int) -> None:
        """Actors that started after the run did, once they hold the current weights."""
        for actor in joined:
            self.metrics.event(step, "actor_joined", actor=actor, actors=len(self.pool.ids), version=version)
            self.say(f"step {step}: rollout actor {actor} joined ({len(self.pool.ids)} generating, "
                     f"weights of version {version})")
