"""A run's start waits on its engines and learner ranks (orchestrator/components.py `wait_to_start`),
here on a real local Ray cluster with an actor whose calls sleep: it says now and then how many are
up, ends within a poll when a stop is asked for, and returns once every one is ready. A learner
rank still loading its model when the run shuts down (a stop during the start) is killed, not
waited for (LearnerGroup.shutdown, over stand-in ranks whose constructor sleeps)."""

import re
import time

import pytest
import ray
from ray.util.placement_group import placement_group

from asyncrl.orchestrator.components import START_POLL_S, wait_to_start
from asyncrl.orchestrator.learner_group import LearnerGroup
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
    assert 2.0 <= time.monotonic() - t0 < 4.0  # one poll after the slower call, and Ray's latency on 2 cores
    assert 2 <= len(said) <= 5 and all(
        re.fullmatch(r"1 of 2 rollout engines up after \ds; waiting for the rest", line) for line in said), said
    # a stop asked for 0.7 s in ends a wait that had 20 s to go, within one poll
    stop_at = time.monotonic() + 0.7
    with pytest.raises(StartInterrupted, match="^SIGTERM during start-up$"):
        wait_to_start([sleeper.sleep.remote(20)], lambda: "SIGTERM" if time.monotonic() > stop_at else None)
    assert time.monotonic() - stop_at < START_POLL_S + 1.0
    ray.kill(sleeper)


@ray.remote(num_cpus=0)
class LoadingRank:
    """A learner rank's stand-in whose constructor (a large model's load) takes `seconds`."""

    def __init__(self, seconds: float):
        time.sleep(seconds)

    def batch_endpoint(self) -> str:
        return "tcp://127.0.0.1:1"

    def shutdown(self) -> None:
        pass


class LoadingGroup(LearnerGroup):
    """The real LearnerGroup's waits and shutdown over stand-in ranks, in a placement group of their own."""

    def __init__(self, seconds: list[float]):
        self.placement = placement_group([{"CPU": 0.01}])
        ray.get(self.placement.ready())
        self.ranks = [LoadingRank.remote(s) for s in seconds]
        self._loaded = [rank.batch_endpoint.remote() for rank in self.ranks]
        self._senders = None


def test_ranks_still_loading_are_killed_at_shutdown_not_waited_for(ray_cluster):
    loading = LoadingGroup([0.0, 60.0])
    time.sleep(1.0)  # the first has started, the second loads for a minute
    t0 = time.monotonic()
    loading.shutdown()
    assert time.monotonic() - t0 < 5  # asked, it would answer after its load: 30 s (the shutdown's bound)
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(loading.ranks[1].batch_endpoint.remote(), timeout=30)
    # ranks that have loaded are asked to close their sockets first, and end the same way
    loaded = LoadingGroup([0.0])
    loaded.wait_started()
    loaded.shutdown()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(loaded.ranks[0].batch_endpoint.remote(), timeout=30)
