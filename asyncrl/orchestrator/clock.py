"""The run's clock: its wall time across resumes, and where each step's time went.

A step's row carries four columns from here (docs/metrics.md):
- `timing/wait_for_data_s`: from the previous step's end to this step's batch (the learner idle,
  waiting for the buffer to fill one);
- `timing/train_s`: from the batch sent to the learner's result back;
- `timing/loop_s`: the loop's own work around the step: the previous row, checkpoint and the like
  after its push, and this step's start;
- `throughput/gen_tokens_while_training`: response tokens that arrived while the learner trained
  (what asynchrony buys).

The wall time (`elapsed_s`) goes into each checkpoint, so a resumed run's summary counts the time
before the resume too.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


class RunClock:
    def __init__(self, now: Callable[[], float] = time.monotonic):
        self.now = now
        self.started = self.last_step = now()  # last_step: the stall watch counts from it
        self.elapsed_before, self.resumed_at = 0.0, None  # a resumed run's time before, and its step
        self._step_start = self._wait = self._loop = self._train = self._pushed = 0.0
        self._overlap = 0

    def resumed(self, elapsed_s: float, step: int) -> None:
        self.elapsed_before, self.resumed_at = elapsed_s, step

    def begin(self) -> None:
        """The run's time, the first row's and the stall watch count from now (after start-up)."""
        self.started = self.last_step = self.now()

    def rewound(self) -> None:
        """A learner restart: the stall watch counts from now."""
        self.last_step = self.now()

    def elapsed_s(self) -> float:
        return self.elapsed_before + self.now() - self.started

    def resume_summary(self) -> dict[str, Any]:
        """For a resumed run's summary: where it resumed, and the time since."""
        if self.resumed_at is None:
            return {}
        return {"resumed_at_step": self.resumed_at, "wall_s_since_resume": round(self.now() - self.started, 1)}

    def step_started(self, send: Callable[[], Any]) -> Any:
        """Time `send()`, which hands the learner its batch (part of the loop's own work)."""
        self._step_start = self.now()
        self._wait = self._step_start - self.last_step
        out = send()
        self._loop += self.now() - self._step_start
        return out

    def generated(self, tokens: int, training: bool) -> None:
        if training:
            self._overlap += tokens

    def step_done(self) -> None:
        self.last_step = self.now()
        self._train = self.last_step - self._step_start

    def pushed(self) -> None:
        self._pushed = self.now()

    def columns(self) -> dict[str, float]:
        """The step's timing columns; the loop's own work of the next row counts from the push."""
        out = {"timing/train_s": self._train, "timing/wait_for_data_s": self._wait, "timing/loop_s": self._loop,
               "throughput/gen_tokens_while_training": self._overlap}
        self._overlap = 0
        return out

    def row_done(self) -> None:
        self._loop = self.now() - self._pushed
