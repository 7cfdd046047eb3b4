"""What a person can ask of a running run, by creating a file in its run directory, and what the
run tells them when it is stuck.

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

RESET_FILE = "RESET_REFERENCE"
SCALE_FILE = "SCALE_ACTORS"


class RunRequests:
    def __init__(self, run_dir: Path, metrics, say=print):
        self.run_dir, self.metrics, self.say = run_dir, metrics, say
        self.reset_requested = False
        self._last_warn_t = time.monotonic()

    def take_reset(self, cfg) -> bool:
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

    def apply_scale(self, pool, ledger, step: int) -> None:
        flag = self.run_dir / SCALE_FILE
        if not flag.exists():
            return
        text = flag.read_text().strip()
        flag.unlink()
        if not text.isdecimal() or int(text) < 1:
            self.say(f"warning: {SCALE_FILE} must hold a number of actors >= 1, got {text!r}; ignored")
            return
        started, stopped = pool.scale_to(int(text))
        requeued = sum(ledger.requeue_actor(a) for a in stopped)
        self.metrics.event(step, "scale", actors=int(text), started=started, stopped=stopped, groups_requeued=requeued)
        self.say(f"step {step}: scaling rollout actors to {text} (starting {started or 'none'}, "
                 f"stopping {stopped or 'none'})")

    def warn_if_stalled(self, orch, now: float, every_s: float = 60.0) -> None:
        """Say why no step has happened for a while (the usual cause: every group is dropped
        because all its rewards are equal, i.e. the task is too hard or too easy)."""
        if now - max(orch._last_step_t, self._last_warn_t) < every_s:
            return
        self._last_warn_t = now
        a, led = orch.ledger.assembler.stats, orch.ledger
        self.say(f"warning: no optimizer step for {now - orch._last_step_t:.0f}s; "
                 f"{orch.samples.num_received} samples received, {a.groups_complete} groups complete, "
                 f"{a.groups_zero_variance} dropped for zero reward variance, "
                 f"{led.buffer.num_loss_tokens}/{orch.stages.current.token_budget} loss tokens buffered, "
                 f"{len(led.records)} groups in flight on {len(orch.pool.ids)} actor(s), "
                 f"{orch.rewards.num_pending} samples awaiting rewards "
                 f"({orch.rewards.stats.timeouts} reward timeouts so far)")
