"""TeacherActor: owns one engine serving the teacher of on-policy distillation (algo.distill) and
scores the student's samples with it: log pi_teacher of every response token, from the engine's
prompt logprobs over prompt + response (one prefill a sample, no token generated).

Its weights never change, so it joins no weight-sync group. Its engine starts in `start` while
the run starts its other parts; a `score` call that comes first waits for it. Like RolloutActor,
the class is plain asyncio; the driver's `TeacherEngines` (orchestrator/teacher_engines.py) runs
it as a Ray actor.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from asyncrl.observe.worker_logs import redirect_output
from asyncrl.rollout.engine import InferenceEngine


def response_logprobs(sequence_logprobs: list[float], prompt_len: int) -> list[float]:
    """The response tokens' part of an engine's prompt logprobs over prompt + response
    (`InferenceEngine.prompt_logprobs`: one per token after the first, so response token j is at
    prompt_len + j - 1)."""
    return sequence_logprobs[prompt_len - 1:]


class TeacherActor:
    def __init__(self, engine_factory: Callable[[], InferenceEngine]):
        self._engine_factory = engine_factory
        self.engine: InferenceEngine | None = None
        self._started = asyncio.Event()
        self._start_error: BaseException | None = None
        redirect_output()  # to the run's logs/ when the orchestrator asked (before the engine starts)

    async def start(self) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            self.engine = self._engine_factory()
            await self.engine.start()
        except BaseException as e:
            self._start_error = e
            raise
        finally:
            self._started.set()
        return {"start_s": time.monotonic() - t0}

    async def score(self, sequences: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """For each (prompt_ids, response_ids), the teacher's logprob of every response token."""
        await self._started.wait()
        if self._start_error is not None:
            raise RuntimeError(f"the teacher's engine failed to start: {self._start_error!r}")
        outs = await asyncio.gather(*[self.engine.prompt_logprobs(prompt + response) for prompt, response in sequences])
        return [response_logprobs(out, len(prompt)) for out, (prompt, _) in zip(outs, sequences)]

    async def shutdown(self) -> None:
        if self.engine is not None:
            await self.engine.shutdown()
