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
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.config import Config
from asyncrl.observe.metrics import EventLog, Say
from asyncrl.orchestrator.ledger import GroupLedger
from asyncrl.types import RunFailed

if TYPE_CHECKING:  # both run Ray; requests only call them
    from asyncrl.orchestrator.actor_pool import ActorPool
    from asyncrl.orchestrator.orchestrator import Orchestrator

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

    def apply_scale(self, pool: ActorPool, ledger: GroupLedger, step: int) -> None:
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
        requeued = sum(ledger.requeue_actor(a) for a in stopped)
        self.metrics.event(step, "scale", actors=int(text), started=started, stopped=stopped, groups_requeued=requeued)
        self.say(f"step {step}: scaling rollout actors to {text} (starting {started or 'none'}, "
                 f"stopping {stopped or 'none'})")

    def check_stall(self, orch: Orchestrator, now: float, every_s: float = 60.0) -> None:
        """Say why no step has happened for a while, every `every_s`; after
        observe.stall_timeout_s, stop the run with that diagnosis (`RunStalled`)."""
        idle = now - orch._last_step_t
        timeout_s = orch.cfg.observe.stall_timeout_s
        if idle >= timeout_s:
            raise RunStalled(f"no optimizer step for {idle:.0f}s (observe.stall_timeout_s={timeout_s:g}): "
                             f"{stall_diagnosis(orch)}")
        if now - max(orch._last_step_t, self._last_warn_t) < every_s:
            return
        self._last_warn_t = now
        self.say(f"warning: no optimizer step for {idle:.0f}s (the run stops after {timeout_s:g}s): "
                 f"{stall_diagnosis(orch)}")


class RunStalled(RunFailed):
    """No optimizer step for observe.stall_timeout_s."""


def stall_diagnosis(orch: Orchestrator) -> str:
    """What the run has seen, and the likely cause: usually every group dropped because all its
    rewards are equal (the task too hard or too easy, or a verifier that scores everything alike)."""
    driver = orch.driver
    a, led, pool = driver.ledger.assembler.stats, driver.ledger, driver.rewards
    outcomes = ", ".join(f"{k} {v}" for k, v in pool.stats.outcomes.most_common(6)) or "none yet"
    facts = (f"{orch.samples.num_received} samples received, {a.groups_complete} groups complete, "
             f"{a.groups_zero_variance} dropped with no advantage signal, "
             f"{led.token_accounting()['buffered']}/{driver.stages.current.token_budget} loss tokens buffered, "
             f"{len(led.records)} groups in flight on {len(orch.pool.ids)} actor(s), "
             f"{pool.num_pending} samples awaiting rewards ({pool.stats.timeouts} reward timeouts); "
             f"reward outcomes: {outcomes}")
    if orch.samples.num_received == 0:
        cause = "no sample has arrived: the rollout actors are not generating (see the run's logs/)"
    elif a.groups_complete and a.groups_zero_variance == a.groups_complete:
        cause = ("every complete group had equal rewards (after the truncation mask), so none has a learning "
                 "signal: the task is too hard or too easy for this model, or the verifier gives every "
                 "response the same reward")
        missing, records = driver.stages.source.answers_missing()
        if missing:  # the likelier cause: a label field the reward function reads is misnamed
            cause = (f"answer is None on {missing} of {records} records (data.answer_field="
                     f"{orch.cfg.data.answer_field!r}), so a reward that compares with it scores every "
                     f"response alike; else {cause}")
    elif pool.num_pending and pool.stats.completed == 0:
        cause = "no reward has come back: the verifiers are stuck or too slow (reward.timeout_s, reward.num_workers)"
    else:
        cause = "groups are completing; the step may need more time (raise observe.stall_timeout_s)"
    return f"{cause}. {facts}"
