"""What a person can ask of a running run, by creating a file in its run directory, and what the
run tells them when it is stuck (and when it gives up: observe.stall_timeout_s).

- `RESET_REFERENCE` (empty): reset the reference policy and the optimizer state after the next
  step (ProRL section 3.3.1). `touch runs/<name>/RESET_REFERENCE`.
- `SCALE_ACTORS` (a number): grow or shrink the rollout actors to that many at the next step
  boundary; `python launch/scale.py runs/<name> --actors 3` writes it. The learner is untouched:
  new actors join the weight-sync group and get the current weights before any prompt; a removed
  actor's groups in generation are requeued.

Files are read at step boundaries and removed once applied, so a request is applied once.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.config import Config
from asyncrl.observe.metrics import EventLog, Say
from asyncrl.orchestrator.driver import Progress
from asyncrl.types import RunFailed

if TYPE_CHECKING:  # it runs Ray; requests only call it
    from asyncrl.orchestrator.actor_pool import ActorPool

RESET_FILE = "RESET_REFERENCE"
SCALE_FILE = "SCALE_ACTORS"


class RunRequests:
    def __init__(self, run_dir: Path, metrics: EventLog, say: Say = print):
        self.run_dir, self.metrics, self.say = run_dir, metrics, say
        self.reset_requested = False
        self._last_warn_t = time.monotonic()

    def take_reset(self, cfg: Config) -> bool:
        """True once after a reset was requested (by `reset_requested = True` or the file)."""
        flag = self.run_dir / RESET_FILE
        if flag.exists():
            flag.unlink()
            if cfg.algo.kl.needs_reference:
                self.reset_requested = True
            else:
                self.say("warning: RESET_REFERENCE ignored: this run holds no reference policy")
        requested, self.reset_requested = self.reset_requested, False
        return requested

    def apply_scale(self, pool: ActorPool, requeue_actor: Callable[[int], int], step: int) -> None:
        flag = self.run_dir / SCALE_FILE
        if not flag.exists():
            return
        text = flag.read_text().strip()
        if not text:
            return  # created but not yet written (`echo 2 > SCALE_ACTORS`): read it next step
        flag.unlink()
        if not text.isdecimal() or int(text) < 1:
            self.say(f"warning: {SCALE_FILE} must hold a number of actors >= 1, got {text!r}; ignored")
            return
        started, stopped = pool.scale_to(int(text))
        requeued = sum(requeue_actor(a) for a in stopped)
        self.metrics.event(step, "scale", actors=int(text), started=started, stopped=stopped, groups_requeued=requeued)
        self.say(f"step {step}: scaling rollout actors to {text} (starting {started or 'none'}, "
                 f"stopping {stopped or 'none'})")

    def check_stall(self, now: float, last_step_t: float, timeout_s: float, facts: Callable[[], StallFacts],
                    every_s: float = 60.0) -> None:
        """Say why no step has happened since `last_step_t`, every `every_s`; after `timeout_s`
        (observe.stall_timeout_s), stop the run with that diagnosis (`RunStalled`). `facts` is
        asked only then."""
        idle = now - last_step_t
        if idle >= timeout_s:
            raise RunStalled(f"no optimizer step for {idle:.0f}s (observe.stall_timeout_s={timeout_s:g}): "
                             f"{stall_diagnosis(facts())}")
        if now - max(last_step_t, self._last_warn_t) < every_s:
            return
        self._last_warn_t = now
        self.say(f"warning: no optimizer step for {idle:.0f}s (the run stops after {timeout_s:g}s): "
                 f"{stall_diagnosis(facts())}")


class RunStalled(RunFailed):
    """No optimizer step for observe.stall_timeout_s."""


@dataclass(frozen=True)
class StallFacts:
    """What a stalled run is diagnosed from: the pipeline's progress and the run's own counts."""

    progress: Progress
    samples_received: int
    actors: int
    answer_field: str  # data.answer_field, named when the labels are missing
    stuck: tuple[str, ...] = ()  # per actor, what holds its episodes up (ActorPool.stuck_episodes)


def stall_diagnosis(facts: StallFacts) -> str:
    """What the run has seen, and the likely cause: usually every group dropped because all its
    rewards are equal (the task too hard or too easy, or a verifier that scores everything alike)."""
    p = facts.progress
    outcomes = ", ".join(f"{k} {v}" for k, v in p.reward_outcomes) or "none yet"
    seen = (f"{facts.samples_received} samples received, {p.groups_complete} groups complete, "
            f"{p.groups_zero_variance} dropped with no advantage signal, "
            f"{p.buffered_tokens}/{p.token_budget} loss tokens buffered, "
            f"{p.groups_in_flight} groups in flight on {facts.actors} actor(s), "
            f"{p.rewards_pending} samples awaiting rewards ({p.reward_timeouts} reward timeouts); "
            f"reward outcomes: {outcomes}")
    if facts.samples_received == 0:
        cause = "no sample has arrived: the rollout actors are not generating (see the run's logs/)"
    elif p.groups_complete and p.groups_zero_variance == p.groups_complete:
        cause = ("every complete group had equal rewards (after the truncation mask), so none has a learning "
                 "signal: the task is too hard or too easy for this model, or the verifier gives every "
                 "response the same reward")
        missing, records = p.answers_missing
        if missing:  # the likelier cause: a label field the reward function reads is misnamed
            cause = (f"answer is None on {missing} of {records} records (data.answer_field="
                     f"{facts.answer_field!r}), so a reward that compares with it scores every "
                     f"response alike; else {cause}")
    elif p.rewards_pending and p.rewards_completed == 0:
        cause = "no reward has come back: the verifiers are stuck or too slow (reward.timeout_s, reward.num_workers)"
    else:
        cause = "groups are completing; the step may need more time (raise observe.stall_timeout_s)"
    if facts.stuck:  # episodes held up in the actors explain a run that starves before anything above
        cause = f"episodes are held up in the actors ({'; '.join(facts.stuck)}); else: {cause}"
    return f"{cause}. {seen}"
