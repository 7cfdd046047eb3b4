"""The teacher edge of on-policy distillation (algo.distill): the driver hands each arriving
training sample to a teacher, which returns it with `Sample.teacher_logprobs` set (log pi_teacher
of every response token); only then does the sample go on to its reward (intake.py). The
teacher's engines work while the student's generate, as the reward pool does.

`Teacher` is the protocol the intake sees; `TeacherEngines` (teacher_engines.py) is the real one,
vLLM engines in Ray actors; `InlineTeacher` here scores with a function, for tests of the loop's
logic. Both keep a `TeacherTally`: the row's `distill/` metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from asyncrl.types import IntSeq, Sample, as_list


class Teacher(Protocol):
    def submit(self, samples: list[Sample]) -> None:
        """Samples to score (they come back from `poll`, in any order)."""
        ...

    def poll(self) -> list[Sample]:
        """The submitted samples the teacher has scored since the last poll, each with its
        `teacher_logprobs` set; raises RunFailed when the teacher cannot score any more."""
        ...

    @property
    def num_pending(self) -> int: ...

    def take_metrics(self) -> dict[str, float]:
        """The `distill/` metrics since the last call (a step's row)."""
        ...

    def close(self) -> None: ...


def loss_positions(loss_mask: IntSeq, n: int) -> list[int]:
    """The response positions the student sampled (an episode's observations left out)."""
    return list(range(n)) if not loss_mask else [i for i, m in enumerate(loss_mask) if m]


class TeacherTally:
    """Sums for a step's row: reverse KL per sampled token (log pi_b - log pi_teacher, its
    single-sample estimate), the teacher's latency per sample, samples scored."""

    def __init__(self) -> None:
        self.total = 0
        self._reset()

    def _reset(self) -> None:
        self.tokens, self.kl_sum, self.samples, self.latency_s = 0, 0.0, 0, 0.0

    def add(self, sample: Sample, latency_s: float) -> None:
        keep = loss_positions(sample.loss_mask, len(sample.response_ids))
        self.kl_sum += sum(sample.logprobs[i] - sample.teacher_logprobs[i] for i in keep)
        self.tokens += len(keep)
        self.samples += 1
        self.total += 1
        self.latency_s += latency_s

    def take(self, pending: int) -> dict[str, float]:
        out = {"distill/reverse_kl": self.kl_sum / self.tokens if self.tokens else float("nan"),
               "distill/teacher_latency_s": self.latency_s / self.samples if self.samples else float("nan"),
               "distill/scored_total": float(self.total), "distill/pending": float(pending)}
        self._reset()
        return out


def attach(sample: Sample, logprobs: list[float]) -> Sample:
    """The sample with the teacher's response logprobs (one per response token, or ValueError)."""
    if len(logprobs) != len(sample.response_ids):
        raise ValueError(f"the teacher returned {len(logprobs)} logprobs for sample {sample.group_id}/"
                         f"{sample.sample_index} of {len(sample.response_ids)} response tokens")
    sample.teacher_logprobs = logprobs
    return sample


class InlineTeacher:
    """Scores each sample when it is submitted, with `logprobs(prompt_ids, response_ids)` (one
    logprob per response token): the test implementation of `Teacher`."""

    def __init__(self, logprobs: Callable[[list[int], list[int]], list[float]]):
        self.logprobs = logprobs
        self.tally = TeacherTally()
        self._done: list[Sample] = []

    def submit(self, samples: list[Sample]) -> None:
        for s in samples:
            t0 = time.monotonic()
            self._done.append(attach(s, self.logprobs(as_list(s.prompt_ids), as_list(s.response_ids))))
            self.tally.add(s, time.monotonic() - t0)

    def poll(self) -> list[Sample]:
        done, self._done = self._done, []
        return done

    @property
    def num_pending(self) -> int:
        return len(self._done)

    def take_metrics(self) -> dict[str, float]:
        return self.tally.take(self.num_pending)

    def close(self) -> None:
        pass
