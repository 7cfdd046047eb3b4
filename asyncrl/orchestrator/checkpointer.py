"""Writes the run's checkpoints without holding up generation, and finds the one to resume from.

`save(step, state)` writes the orchestrator's state at once (a few milliseconds of msgpack) and
asks the learner to write its part; Ray runs a learner's calls in order, so the learner saves the
weights of exactly this step before it trains the next, while the actors keep generating. `poll`
commits the checkpoint (checkpoint.py: rename into place, prune) once the learner is done.

A checkpoint that cannot be written (a full disk, a permission, on the driver's side or the
learner's) is not the end of the run: its temporary directory is removed, the newest complete
checkpoint stays as it was (nothing is pruned before a commit), the run says so (a warning and
a `checkpoint_failed` event) and goes on; the next save tries again.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config import Config, ConfigError
from asyncrl.observe.metrics import Say
from asyncrl.orchestrator import checkpoint
from asyncrl.orchestrator.learner_group import GroupCall, LearnerGroup
from asyncrl.types import RunFailed


class LearnerDied(RunFailed):
    """The learner process is gone; the message says where to resume from."""


@dataclass(frozen=True)
class StartPoint:
    """Where a run or a learner restart starts: a checkpoint directory and the run state saved in
    it, or (path None) the base model and the state the run started with."""

    path: Path | None
    state: dict[str, Any]

    @property
    def learner_dir(self) -> Path | None:
        return self.path / checkpoint.LEARNER_DIR if self.path else None

    def model_path(self, base_model: str) -> str:
        """The policy the learner loads from here."""
        return str(self.path / checkpoint.LEARNER_DIR / "policy") if self.path else base_model


class Checkpointer:
    def __init__(self, cfg: Config, run_dir: Path, say: Say = print,
                 event: Callable[..., None] | None = None):
        self.cfg, self.run_dir, self.say = cfg, run_dir, say
        # event(step, "checkpoint", path=..., learner_save_s=...) or (step, "checkpoint_failed", error=...)
        self.event = event
        self.failures = 0
        self._pending: tuple[Path, int, GroupCall] | None = None

    def find_resume(self) -> StartPoint | None:
        """The checkpoint `resume` names (None: start fresh); ConfigError if it cannot be used."""
        resume = self.cfg.resume
        if resume is None:
            return None
        if resume == "auto":
            skipped: list[str] = []
            def warn(message: str) -> None:
                skipped.append(message)
                self.say(f"warning: {message}")

            found = checkpoint.find_resumable(self.run_dir, warn=warn)
            if found is None and skipped:  # a fresh start would silently lose the run
                raise ConfigError(f"resume=auto: none of the {len(skipped)} checkpoint(s) in {self.run_dir} can be "
                                  f"resumed (newest: {skipped[0]}); give resume=<a checkpoint directory>, or a new "
                                  "name to start over")
            if found is None:
                self.say(f"resume=auto: no checkpoint in {self.run_dir}; starting fresh")
                return None
        else:
            path = Path(resume).expanduser().resolve()
            try:
                found = path, checkpoint.validate(path)
            except ValueError as e:
                raise ConfigError(f"resume: {e}") from None
        checkpoint.check_compatible(found[0], self.cfg)
        return StartPoint(*found)

    def save(self, step: int, state: dict[str, Any], learner: LearnerGroup) -> None:
        self.poll(block=True)  # one at a time
        try:
            tmp = checkpoint.begin(self.run_dir, step, state, self.cfg)
        except OSError as e:
            self._failed(step, checkpoint.checkpoints_dir(self.run_dir) / f".tmp_step_{step}", e)
            return
        self._pending = (tmp, step, learner.save_checkpoint(str(tmp / checkpoint.LEARNER_DIR)))

    def poll(self, block: bool = False) -> Path | None:
        """Commit the pending checkpoint if the learner has written its part (or wait for it)."""
        if self._pending is None:
            return None
        tmp, step, call = self._pending
        try:  # a learner's OSError comes back as one (Ray's error subclasses it), from ready() too
            if not (block or call.ready()):
                return None
            self._pending = None
            saved = call.result()
            path = checkpoint.commit(tmp, step, self.cfg.checkpoint.keep)
        except OSError as e:
            self._pending = None
            self._failed(step, tmp, e)
            return None
        if self.event is not None:
            self.event(step, "checkpoint", path=str(path), learner_save_s=saved["save_s"])
        return path

    def _failed(self, step: int, tmp: Path, error: OSError) -> None:
        shutil.rmtree(tmp, ignore_errors=True)
        self.failures += 1
        newest = self.newest()
        why = f"{type(error).__name__}: {error}".splitlines()[0][:300]
        self.say(f"warning: the checkpoint of step {step} could not be written ({why}); "
                 f"{f'the newest is still {newest}' if newest else 'there is none yet'}; the run goes on")
        if self.event is not None:
            self.event(step, "checkpoint_failed", error=why)

    def abandon(self) -> None:
        """Forget the pending checkpoint (its learner died writing it): its temporary directory goes."""
        if self._pending is not None:
            shutil.rmtree(self._pending[0], ignore_errors=True)
            self._pending = None

    def newest_resumable(self) -> StartPoint | None:
        """The newest checkpoint of this run that validates, and its state (a learner restart's)."""
        found = checkpoint.find_resumable(self.run_dir, warn=lambda m: self.say(f"warning: {m}"))
        return StartPoint(*found) if found else None

    def newest(self) -> Path | None:
        found = checkpoint.list_complete(checkpoint.checkpoints_dir(self.run_dir))
        return found[-1] if found else None

    def learner_died(self, step: int, error: BaseException) -> LearnerDied:
        newest = self.newest()
        where = f"the newest checkpoint is {newest}" if newest else "no checkpoint was written yet"
        restarts = f" after {self.cfg.fault.max_restarts} restart(s) (fault.max_restarts)" \
            if self.cfg.fault.max_restarts else ""
        return LearnerDied(f"the learner process died during step {step} ({type(error).__name__}){restarts}; "
                           f"{where}: run the same command with resume=auto to continue")
