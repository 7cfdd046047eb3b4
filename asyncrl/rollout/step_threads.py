"""StepThreads: worker threads for environment steps that may block, where a hung step costs its
own episode and nothing else.

Python cannot stop a thread. A step past its timeout keeps running on its thread until it returns,
which may be never. With a fixed pool, every such step would hold a thread for good, and once most
threads were held the other episodes' steps would queue behind them and time out in turn: a
3%-hanging environment became a run stopped for errors (a new user saw errors jump from 5% to
28% once ~60 of 64 threads were stuck). So:

- at most `size` steps run at once; a step's timeout counts from its start, not from its wait
  for a turn;
- a step that times out is written off with its thread: its turn goes to the next step at once,
  on a fresh thread, and its own thread ends when (if) the step returns. However many steps hang,
  `size` others can run;
- each step still hung costs one parked thread (its stack, ~64 KiB resident). Past `max_hung` of
  them, a step fails at once with an error that says so: an environment that hangs that often is
  broken, and the run's error limit (env.max_error_frac) stops it.

`hung` (steps timed out and not returned) goes into the actor's stats, and from there into the
stall warning, which names stuck environment steps when they are why nothing trains.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

STEP_THREADS = 64
MAX_HUNG = 2048


class TooManyHungSteps(RuntimeError):
    """More environment steps hang past their timeout than the actor keeps threads for."""


class StepThreads:
    def __init__(self, size: int = STEP_THREADS, max_hung: int = MAX_HUNG):
        self.size, self.max_hung = size, max_hung
        # threads start as steps need them: `size` running, plus one parked per hung step
        self._pool = ThreadPoolExecutor(size + max_hung, thread_name_prefix="env-step")
        self._turns: asyncio.Semaphore | None = None  # made on the actor's loop, at the first step
        self.hung = 0  # timed out and still running

    async def run(self, fn: Callable[[Any], Any], arg: Any, timeout_s: float) -> Any:
        """`fn(arg)` on a thread; asyncio.TimeoutError when it runs longer than `timeout_s`."""
        if self.hung >= self.max_hung:
            raise TooManyHungSteps(f"{self.hung} environment steps are still running past env.step_timeout_s; "
                                   f"each holds a thread, and this actor keeps at most {self.max_hung}")
        self._turns = self._turns or asyncio.Semaphore(self.size)
        async with self._turns:
            work = asyncio.get_running_loop().run_in_executor(self._pool, fn, arg)
            done, _ = await asyncio.wait({work}, timeout=timeout_s)
            if work in done:
                return work.result()
            self.hung += 1  # written off: its turn goes to the next step as this block ends
            work.add_done_callback(self._returned)
            raise asyncio.TimeoutError()

    def _returned(self, work: asyncio.Future) -> None:
        """A written-off step came back after all (its result is dropped; its thread is free)."""
        self.hung -= 1
        if not work.cancelled():
            work.exception()  # retrieved, so asyncio does not log it as never retrieved

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
