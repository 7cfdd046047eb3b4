"""A rollout actor that stops answering (a frozen process, a blocked event loop) is found by the
pool's pings within fault.actor_timeout_s and killed; one that answers is left alone. Without
this a frozen vLLM actor held its groups, which count as generating and so hold the admission
room, and the run made no step until the actor thawed (40 s in the fault matrix's sigstop_actor
with vLLM engines) or stalled for good."""

import asyncio
import time

import ray

from asyncrl.config import Config
from asyncrl.orchestrator.actor_pool import ActorPool


@ray.remote
class Member:
    def __init__(self, hang: bool):
        self.hang = hang

    async def ping(self):
        if self.hang:  # what a frozen actor does with every call: never answers
            await asyncio.sleep(3600)

    async def failed(self):
        await asyncio.sleep(3600)


def pool_of(members, actor_timeout_s):
    cfg = Config().model_copy(update={"fault": Config().fault.model_copy(update={"actor_timeout_s": actor_timeout_s})})
    pool = ActorPool(cfg, "unused", "tcp://127.0.0.1:1")
    pool.actors = dict(enumerate(members))
    return pool


def test_an_actor_that_does_not_answer_is_lost_and_killed_one_that_answers_is_not(ray_cluster):
    members = [Member.remote(hang=False), Member.remote(hang=True)]
    ray.get(members[0].ping.remote())  # both processes are up before the clock starts
    pool = pool_of(members, actor_timeout_s=3.0)
    start, dead = time.monotonic(), {}
    while not dead and time.monotonic() - start < 30:
        dead = pool.find_dead()  # what the orchestrator's health check calls every 0.5 s
        time.sleep(0.5)
    waited = time.monotonic() - start
    assert list(dead) == [1] and "fault.actor_timeout_s=3" in dead[1], dead
    assert 3.0 < waited < 10.0, waited  # the timeout, not never (and not at once)
    assert pool.ids == [0]
    try:  # killed: a thawed actor cannot come back with an old version
        ray.get(members[1].ping.remote(), timeout=10)
        killed = False
    except ray.exceptions.RayActorError:
        killed = True
    assert killed
    for _ in range(6):  # the live one keeps answering: never lost
        assert pool.find_dead() == {}
        time.sleep(0.5)


def test_no_ping_without_a_timeout(ray_cluster):
    pool = pool_of([Member.remote(hang=True)], actor_timeout_s=None)
    for _ in range(4):
        assert pool.find_dead() == {}
        time.sleep(0.2)
    assert pool._pings == {}
