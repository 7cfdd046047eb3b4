"""The driver's reward pool on the twin's clock: `reward.num_workers` verifiers, each taking
`verify_s` a sample, first come first served; rewards from the pass-rate model. It answers the
calls the driver makes of reward/pool.py's RewardPool (submit_many, poll, num_queued, metrics),
so admission sees what it sees in a run: groups held by verifiers, verifiers behind."""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any

from asyncrl.reward.pool import RewardResult
from asyncrl.twin.events import EventQueue
from asyncrl.twin.workload import PassRates
from asyncrl.types import Sample


def score(rewards: PassRates, s: Sample) -> tuple[float, dict[str, Any]]:
    """A sample's reward from its prompt's pass rate at the version that began it."""
    reward = rewards.reward(s.metadata.get("record_key", s.prompt_id), s.prompt_id, s.sample_index,
                            s.versions[0] if s.versions else 0)
    return reward, {"outcome": "correct" if reward else "wrong", "verifier": "twin",
                    "data_source": s.metadata.get("data_source", "twin")}


class TwinRewardPool:
    def __init__(self, events: EventQueue, workers: int, verify_s: float, rewards: PassRates,
                 on_result: Callable[[float], None]):
        self.events, self.verify_s, self.rewards, self.on_result = events, verify_s, rewards, on_result
        self._free_at = [0.0] * workers  # when each worker is next free
        self._starts: list[float] = []  # start times of calls not started yet (a heap)
        self._done: list[tuple[float, int, RewardResult]] = []  # (finished at, seq, result): a heap
        self._seq = 0
        self.completed = 0

    def submit(self, key: Any, response: str, metadata: dict[str, Any]) -> None:
        self.submit_many([(key, response, metadata)])

    def submit_many(self, calls: list[tuple[Any, str, dict[str, Any]]]) -> None:
        now = self.events.now
        for key, _, _ in calls:
            free = min(range(len(self._free_at)), key=self._free_at.__getitem__)
            start = max(now, self._free_at[free])
            end = self._free_at[free] = start + self.verify_s
            heapq.heappush(self._starts, start)
            reward, info = score(self.rewards, key)
            self._seq += 1
            heapq.heappush(self._done, (end, self._seq, RewardResult(key, reward, info, self.verify_s)))
            self.events.at(end, self.on_result)

    def poll(self, timeout_s: float = 0.0) -> list[RewardResult]:
        now, out = self.events.now, []
        while self._done and self._done[0][0] <= now:
            out.append(heapq.heappop(self._done)[2])
        self.completed += len(out)
        return out

    @property
    def num_queued(self) -> int:
        """Calls waiting for a free worker (the verifiers are behind)."""
        now = self.events.now
        while self._starts and self._starts[0] <= now:
            heapq.heappop(self._starts)
        return len(self._starts)

    @property
    def num_pending(self) -> int:
        return len(self._done)

    def wait_ready(self, timeout_s: float = 60.0) -> bool:
        return True

    def metrics(self) -> dict[str, float]:
        return {"reward/pool_pending": self.num_pending}

    def close(self) -> None:
        pass
