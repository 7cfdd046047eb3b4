"""A run's start waits on its engines and learner ranks (orchestrator/components.py `wait_to_start`),
here on a real local Ray cluster with an actor whose calls sleep: it says now and then how many are
up, ends within a poll when a stop is asked for, and returns once every one is ready."""

import re
import time

import pytest
import ray

from asyncrl.orchestrator.components import START_POLL_S, wait_to_start
from asyncrl.types import StartInterrupted


@ray.remote(num_cpus=0, max_concurrency=4)
class Sleeper:
    def sleep(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds


def test_a_start_says_how_far_it_is_and_ends_at_once_on_a_stop(ray_cluster):
    sleeper = Sleeper.remote()
    ray.get(sleeper.sleep.remote(0))
    said = []
    t0 = time.monotonic()
    wait_to_start([sleeper.sleep.remote(0.1), sleeper.sleep.remote(2.0)], None, "rollout engines", said.append,
                  every_s=0.4)
    assert 2.0 <= time.monotonic() - t0 < 3.0
    assert 2 <= len(said) <= 5 and all(
        re.fullmatch(r"1 of 2 rollout engines up after \ds; waiting for the rest", line) for line in said), said
    # a stop asked for 0.7 s in ends a wait that had 20 s to go, within one poll
    stop_at = time.monotonic() + 0.7
    with pytest.raises(StartInterrupted, match="^SIGTERM during start-up$"):
        wait_to_start([sleeper.sleep.remote(20)], lambda: "SIGTERM" if time.monotonic() > stop_at else None)
    assert time.monotonic() - stop_at < START_POLL_S + 0.5
    ray.kill(sleeper)
