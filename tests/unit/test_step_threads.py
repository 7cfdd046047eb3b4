"""Environment steps on StepThreads (rollout/step_threads.py): a step that hangs for good costs its
own call, never the others', however many hang; a step's timeout counts from its start."""

import asyncio
import threading
import time

import pytest

from asyncrl.rollout.step_threads import StepThreads, TooManyHungSteps


def test_hung_steps_many_times_the_pool_size_never_starve_the_others():
    release = threading.Event()  # the hung steps return only when the test ends

    def step(i):
        if i % 3 == 0:
            release.wait()
        return i * 10

    async def main(threads):
        return await asyncio.gather(*[threads.run(step, i, timeout_s=0.2) for i in range(60)], return_exceptions=True)

    threads = StepThreads(size=4)
    try:
        t0 = time.monotonic()
        results = asyncio.run(main(threads))
        took = time.monotonic() - t0
        hung = [i for i in range(60) if i % 3 == 0]
        assert all(isinstance(results[i], asyncio.TimeoutError) for i in hung)
        assert [results[i] for i in range(60) if i % 3] == [i * 10 for i in range(60) if i % 3]
        assert threads.hung == 20  # 5 times the pool: each hung step's turn went to the next one
        assert took < 10.0, took  # with a fixed pool of 4 the free steps would wait forever
    finally:
        release.set()
    threads.close()


def test_a_hung_step_that_returns_after_all_is_counted_off():
    release = threading.Event()

    async def main(threads):
        with pytest.raises(asyncio.TimeoutError):
            await threads.run(lambda _: release.wait(), None, timeout_s=0.05)
        assert threads.hung == 1
        release.set()
        for _ in range(100):
            await asyncio.sleep(0.01)
            if threads.hung == 0:
                break
        assert threads.hung == 0

    threads = StepThreads(size=2)
    asyncio.run(main(threads))
    threads.close()


def test_a_steps_timeout_counts_from_its_start_not_from_its_place_in_the_queue():
    async def main(threads):
        # six 0.15 s steps on two threads: the last starts ~0.3 s after it was queued
        return await asyncio.gather(*[threads.run(lambda i: (time.sleep(0.15), i)[1], i, timeout_s=0.25)
                                      for i in range(6)])

    threads = StepThreads(size=2)
    assert asyncio.run(main(threads)) == list(range(6)) and threads.hung == 0
    threads.close()


def test_past_max_hung_a_step_fails_at_once_saying_why():
    release = threading.Event()

    async def main(threads):
        with pytest.raises(asyncio.TimeoutError):
            await threads.run(lambda _: release.wait(), None, timeout_s=0.05)
        with pytest.raises(asyncio.TimeoutError):
            await threads.run(lambda _: release.wait(), None, timeout_s=0.05)
        with pytest.raises(TooManyHungSteps, match="2 environment steps are still running"):
            await threads.run(lambda _: 1, None, timeout_s=1.0)

    threads = StepThreads(size=8, max_hung=2)
    try:
        asyncio.run(main(threads))
    finally:
        release.set()
        threads.close()
