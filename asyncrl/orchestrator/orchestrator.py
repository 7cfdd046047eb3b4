"""The orchestrator: owns a run's processes and turns the loop that connects them.

    prompt source ─► [admission] ─submit (Ray)─► rollout actors ─samples (zmq)─► [ingest]
                         ▲                            ▲                              │
                         │ learner version            │ weights (gloo / NCCL)        ▼
    [step] ◄──── token buffer ◄──── ledger (shaping, groups, advantages) ◄──── reward pool
       │  a part per rank (zmq) ─► learner ranks ─► StepResult (version + 1) ─► [push]

Every decision is the driver's (`Driver.turn`, driver.py; no Ray): this object feeds it the
sample stream and the learner's state and carries out its actions (prompts to the actors, a batch
to the learner ranks), and after each step pushes the weights every `sync.every_steps` and writes
the step's row. The loops it interleaves and each component's edges: docs/design/loop.md.

The orchestrator owns the policy version; it advances with every optimizer step (the learner's
StepResult must agree). An actor's version advances when it has applied a push.

Start, take-over, a dead learner's replacement (up to `fault.max_restarts`) and shutdown: lifecycle.py;
actors joining and lost: membership.py; at step boundaries, checkpoints (checkpointer.py) and the run
directory's requests and the stall watch (requests.py). `request_stop` (SIGTERM / SIGINT) stops admission,
lets the step finish, checkpoints and ends; while the run starts, it ends the start (nothing to save).
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

from ray.exceptions import RayActorError

from asyncrl import preflight
from asyncrl.buffer.base import StepBatch
from asyncrl.config import Config
from asyncrl.observe.console import ProgressDisplay
from asyncrl.observe.metrics import MetricsWriter, Say
from asyncrl.observe.summary import format_summary, summarize
from asyncrl.orchestrator import checkpoint, lifecycle
from asyncrl.orchestrator.actor_pool import ActorPool
from asyncrl.orchestrator.checkpointer import Checkpointer, StartPoint
from asyncrl.orchestrator.clock import RunClock
from asyncrl.orchestrator.collector import ScheduledCollector
from asyncrl.orchestrator.driver import RECV_WAIT_S, Actions, Driver, StepState
from asyncrl.orchestrator.evaluation import eval_summary, format_eval_summary
from asyncrl.orchestrator.learner_group import GroupCall, LearnerGroup
from asyncrl.orchestrator.membership import ActorMembership
from asyncrl.orchestrator.requests import RunRequests, StallFacts
from asyncrl.orchestrator.run_lock import RunLock, claim_run_dir
from asyncrl.orchestrator.warm import Warm, process_key
from asyncrl.orchestrator.weight_sync import WeightSync
from asyncrl.transport.zmq_stream import FrameReceiver
from asyncrl.types import ReferenceReset, Sample, StartInterrupted, StepResult


class Orchestrator:
    cfg: Config
    # the loop's decisions (ledger, intake, rewards, statistics, stages), no Ray in it
    driver: Driver | None
    # processes and sockets, started by `start` (None until then: `shutdown` stops what started)
    samples: FrameReceiver | None
    learner: LearnerGroup | None
    pool: ActorPool | None
    weight_sync: WeightSync | None
    # the run's files and the person running it
    metrics: MetricsWriter | None
    checkpoints: Checkpointer
    requests: RunRequests | None
    collector: ScheduledCollector
    clock: RunClock  # the run's wall time across resumes; each step's timing columns

    def __init__(self, cfg: Config, log_fn: Say = print, run_lock: RunLock | None = None):
        self.cfg, self.say = preflight.resolve(cfg), log_fn  # max_model_len from the model when unset
        self.run_dir = self.cfg.run_dir.resolve()
        self.version = self.step = 0
        self.history: list[dict[str, Any]] = []
        self.stop_reason: str | None = None
        self.members: ActorMembership | None = None  # the actors as they join and are lost
        self._stop_deadline = self._last_health_t = 0.0
        self._train_ref: GroupCall | None = None
        self.driver = self.samples = self.learner = self.pool = self.weight_sync = self.metrics = self.requests = None
        self.collector, self.clock = ScheduledCollector(), RunClock()
        self.run_lock = run_lock  # launch takes it before Ray starts; else `start` does
        self.checkpoints = Checkpointer(self.cfg, self.run_dir, log_fn,
                                        event=lambda step, name, **i: self.metrics.event(step, name, **i))
        self.restarts = lifecycle.LearnerRestarts(self.cfg, self.run_dir, self.checkpoints, log_fn)

    def start(self, warm: Warm | None = None) -> None:
        """Start the run's processes, or take over `warm`'s, the processes of the run before it on
        the same cluster (warm.py; they must fit this config); lifecycle.py does the work."""
        cfg = self.cfg
        self.run_lock = self.run_lock or claim_run_dir(self.run_dir, cfg.resume)
        resume = self.checkpoints.find_resume()
        self.metrics = lifecycle.open_metrics(cfg, self.run_dir, resume)
        run = lifecycle.start_run(cfg, self.run_dir, resume, warm, self.metrics, self.say, lambda: self.stop_reason)
        self.driver, self.samples, self.version = run.driver, run.samples, run.version
        self.learner, self.pool, self.weight_sync = run.procs.learner, run.procs.pool, run.procs.weight_sync
        self.members = ActorMembership(self.pool, self.weight_sync, self.driver.requeue_actor, self.metrics, self.say)
        self.driver.restart_clock()  # the first row's rates count from here, not from start-up
        self.clock.begin()
        if resume:
            self.load_state_dict(resume.state)
            self.say(f"resumed from {resume.path} at step {self.step} (version {self.version}); "
                     f"{self.driver.requeued()} groups in flight then are regenerated")
        self.restarts.begin_at(StartPoint(resume.path if resume else None, checkpoint.snapshot(self.state_dict())))
        self.requests = RunRequests(self.run_dir, self.metrics, self.say)
        self.metrics.event(self.step, "resume" if resume else "start", model=run.model_path,
                           actors=cfg.rollout.num_actors, **({"checkpoint": str(resume.path)} if resume else {}),
                           **({"warm": True, "parity_max_abs_diff": run.parity} if warm is not None else {}))
        self._last_health_t = time.monotonic()
        self.driver.start_eval(self.version, self.pool)
        self.collector.start()  # the garbage collector runs from the loop from now on (collector.py)

    def release(self) -> Warm | None:
        """End the run but keep its learner ranks and actors for the next one (warm.py); the rest
        shuts down as in `shutdown`. None when the run did not get as far as starting them."""
        warm = None
        if self.learner is not None and self.pool is not None and self.weight_sync is not None:
            warm = Warm(process_key(self.cfg), self.learner, self.pool, self.weight_sync, self.driver.probe_ids)
            self.learner = self.pool = None  # they keep running: the next run takes them over
        self.shutdown()
        return warm

    def run(self, warm: Warm | None = None) -> dict[str, Any]:
        try:
            return self._run(warm)
        except BaseException as e:  # a stall, reward errors, a lost learner, a bug: events.jsonl says so
            self._end("interrupted" if isinstance(e, StartInterrupted) else "failed", str(e) or repr(e))
            raise

    def _run(self, warm: Warm | None) -> dict[str, Any]:
        self.start(warm)
        display = ProgressDisplay(self.cfg.total_steps, self.cfg.observe.console)
        try:
            while self.step < self.cfg.total_steps and not self._stopped():
                try:
                    self._turn(display)
                except RayActorError as e:  # actors' deaths are handled in the pool; this is the learner's
                    if getattr(e, "actor_id", None) is not None and not self.learner.owns(e.actor_id):
                        raise
                    self._restart_learner(e)
        finally:
            display.close()
        # the last step too, so resume=auto on a finished run finds it finished (stopped at step 0: nothing to save)
        if self.step and (self.stop_reason is not None or (self.cfg.checkpoint.every_steps and
                                                           self.step % self.cfg.checkpoint.every_steps)):
            self.checkpoints.save(self.step, self.state_dict(), self.learner)
        self.checkpoints.poll(block=True)
        if self.stop_reason is not None:
            self._end("interrupted", self.stop_reason)
            self.say(f"stopped at step {self.step} ({self.stop_reason}); continue with resume=auto")
            return {"steps": self.step, "stopped": self.stop_reason}
        summary = {**summarize(self.history, self.clock.elapsed_s()), **self.clock.resume_summary(),
                   "actors_lost": self.members.lost, **eval_summary(self.history)}
        if self.cfg.save_final:
            summary["final_policy"] = self.learner.save(str(self.run_dir / "final"),
                                                        self.cfg.learner.lora.save_merged).result()
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self._end("finished")
        self.say(format_summary(summary, str(self.run_dir)) + format_eval_summary(summary))
        return summary

    def _turn(self, display: ProgressDisplay) -> None:
        """The driver's turn on what arrived (with none, within RECV_WAIT_S), its actions carried out."""
        arrivals = self._receive()
        self.clock.generated(sum(len(s.response_ids) for s in arrivals), training=self._train_ref is not None)
        self._carry_out(self.driver.turn(time.monotonic(), arrivals, self), display)
        self._check_health()

    def _receive(self) -> list[Sample]:  # what the stream holds, or the first arrival within RECV_WAIT_S
        return self.samples.take(RECV_WAIT_S)

    # the driver's view of this run's learner (driver.py LearnerView)
    @property
    def actor_ids(self) -> list[int]:
        return self.pool.ids

    @property
    def stopping(self) -> bool:
        return self.stop_reason is not None

    @property
    def starting(self) -> bool:  # until `start` has the run's parts: a stop asked for now ends the start
        return self.driver is None

    def step_state(self) -> StepState:
        if self._train_ref is None:
            return StepState.IDLE
        return StepState.DONE if self._train_ref.ready() else StepState.TRAINING

    def _carry_out(self, acts: Actions, display: ProgressDisplay) -> None:
        for grant in acts.grants:
            self.pool.submit(grant.actor, grant.prompts, grant.spec, grant.group_size)
        if not acts.bookkeeping:
            return
        if self._train_ref is None:
            self.members.join_started(self.version, self.step, self.driver.probe_ids)
        if acts.batch is not None:
            self._start_step(acts.batch)
        if acts.step_done:
            display.update(self._finish_step(self._train_ref.result()))
            return
        self.checkpoints.poll()
        self.collector.maybe_collect()

    def _restart_learner(self, error: BaseException) -> None:
        """A learner rank died: new ranks (lifecycle.LearnerRestarts) and the run's state rewound to
        where they started; the groups the actors are generating are orphaned, the ones in flight
        then regenerated under new ids."""
        self._train_ref = None
        new = self.restarts.replace(self.learner, self.weight_sync, self.pool.model_path, error, self.step,
                                    self.members.on_lost_at(self.step), self.driver.probe_ids)
        self.learner, self.version = new.learner, new.version
        self._restore(new.start.state, renew_requeued=True)
        self.metrics.rewind(self.step)
        self.clock.rewound()
        self.metrics.event(self.step, "learner_restarted", **new.event)

    def _end(self, status: str, reason: str | None = None) -> None:  # the last line of events.jsonl
        if self.metrics is not None:
            self.metrics.event(self.step, "end", status=status, **({"reason": reason} if reason else {}))

    def _start_step(self, batch: StepBatch) -> None:
        reset = self.requests.take_reset(self.cfg)
        self._train_ref = self.clock.step_started(lambda: self.learner.train_step(self.step + 1, batch, reset))

    def _finish_step(self, result: StepResult) -> dict[str, Any]:
        self._train_ref = None
        self.clock.step_done()
        self.step, self.version = self.step + 1, self.version + 1
        if result.version != self.version:
            raise RuntimeError(f"learner reports version {result.version} after step {self.step}, "
                               f"expected {self.version}")
        sync = self.members.after_step(self.version, self.step, self.driver.probe_ids,
                                       due=self.step % self.cfg.sync.every_steps == 0)
        self.clock.pushed()
        if sync:  # the actors now hold this version: its evaluation, if due (rewards polled meanwhile)
            self.driver.eval_after_push(self.version, self.pool, last=self.step >= self.cfg.total_steps,
                                        poll=functools.partial(self.driver.poll_rewards, self.step))
        pipeline, change = self.driver.end_step(self.step, result.metrics, self.samples.num_dropped)
        row = {"step": self.step, "learner/version": self.version, **result.metrics, **sync, **self.clock.columns(),
               "kl/reset": float(any(isinstance(e, ReferenceReset) for e in result.events)),
               **pipeline, **self.collector.metrics(), "rollout/actors": len(self.pool.ids)}
        self.history.append(row)
        self.metrics.log(self.step, row)
        self.metrics.log_samples(self.step, self.driver.take_examples())
        for e in result.events:
            self.metrics.event(self.step, e.event, **e.fields())
            self.say(f"step {self.step}: {e}")
        if change is not None:
            self.metrics.event(self.step, "stage", **change.describe())
            self.say(f"step {self.step}: {change}")
        self.requests.apply_scale(self.pool, self.driver.requeue_actor, self.step)
        if self.cfg.checkpoint.every_steps and self.step % self.cfg.checkpoint.every_steps == 0:
            self.checkpoints.save(self.step, self.state_dict(), self.learner)
        self.clock.row_done()
        return row

    def _check_health(self, every_s: float = 0.5) -> None:
        if time.monotonic() - self._last_health_t >= every_s:
            self._last_health_t = time.monotonic()
            self.members.check(self.step)
            facts = lambda: StallFacts(self.driver.progress(), self.samples.num_received, len(self.pool.ids),  # noqa
                                       self.cfg.data.answer_field, self.pool.stuck_episodes())
            self.requests.check_stall(self._last_health_t, self.clock.last_step,
                                      self.cfg.observe.stall_timeout_s, facts)

    def request_stop(self, reason: str, drain_s: float = 20.0) -> None:
        """Stop admitting; the running step finishes, a checkpoint is written, the run ends. Groups
        in flight get up to `drain_s` to complete first (fewer to regenerate after a resume)."""
        if self.stop_reason is None:
            self.stop_reason, self._stop_deadline = reason, time.monotonic() + drain_s

    def _stopped(self) -> bool:
        return (self.stop_reason is not None and self._train_ref is None
                and (not self.driver.in_flight() or time.monotonic() > self._stop_deadline))

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version, "history": self.history, "actors_lost": self.members.lost,
                **self.weight_sync.state_dict(), "elapsed_s": self.clock.elapsed_s(), **self.driver.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After the learner loaded its part (the versions must agree)."""
        self._restore(state)
        self.members.restore(state.get("actors_lost", []))  # checkpoints written before they were kept: none
        self.clock.resumed(state.get("elapsed_s", 0.0), state["step"])

    def _restore(self, state: dict[str, Any], renew_requeued: bool = False) -> None:
        """The training state of `state` (a resume's, or a learner restart's in this process)."""
        if state["version"] != self.version:
            raise RuntimeError(f"run state at version {state['version']}, learner at {self.version}")
        self.step, self.history = state["step"], list(state["history"])
        self.weight_sync.load_state_dict(state)
        self.driver.load_state_dict(state, renew_requeued=renew_requeued)

    def shutdown(self) -> None:
        """Whatever the run started, in reverse (each part only if it got that far)."""
        lifecycle.shut_down(self.say, self.learner and self.learner.shutdown, self.pool and self.pool.shutdown,
                            self.samples and self.samples.close, self.driver and self.driver.close,
                            self.metrics and self.metrics.close, self.collector.release,
                            self.run_lock and self.run_lock.release)
