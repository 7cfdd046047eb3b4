"""The orchestrator: owns a run's processes and turns the loop that connects them.

    prompt source ─► [admission] ─submit (Ray)─► rollout actors ─samples (zmq)─► [ingest]
                         ▲                            ▲                              │
                         │ learner version            │ weights (gloo / NCCL)        ▼
                         │                            │                    reward pool → ledger
    [step] ◄─────────────┴──── token buffer ◄─────────┴──── (shaping, groups, advantages) ◄┘
       │  a part per rank (zmq) ─► learner ranks ─► StepResult (version + 1) ─► [push]

Every decision is the driver's: one turn (`Driver.turn`, driver.py; no Ray) ingests the samples
that arrived and routes their rewards, and every BOOKKEEPING_S grants prompts under the staleness
bound, cuts the next batch for an idle learner, or says the running step is done. This object
feeds it the sample stream and the learner's state and carries out its actions: prompts to the
actors (actor_pool.py), the batch to the learner ranks (learner_group.py), and after each step the
push every `sync.every_steps` (weight_sync.py: actors drain and load while the learner broadcasts)
and the step's row. The three loops it interleaves (rollout, ingest, train), what each waits for
and what unblocks it: docs/design/loop.md.

Versions: the orchestrator owns the policy version; it advances with every optimizer step (the
learner's StepResult must agree). An actor's version advances when it has applied a push.

Start, take-over of the run before's processes and a learner's replacement: lifecycle.py. Actors
joining and lost, and the pushes around them: membership.py. At step boundaries: checkpoints
(checkpointer.py), requests from the run directory and the stall watch (requests.py).
`request_stop` (SIGTERM / SIGINT) stops admission, lets the step finish, checkpoints and ends. A
learner rank that dies is restarted in place from the newest checkpoint, up to
`fault.max_restarts` times; after that the run ends and says how to resume.
"""

from __future__ import annotations

import functools
import json
import time
from typing import Any

from ray.exceptions import RayActorError

from asyncrl import preflight
from asyncrl.compat import hide_broken_torch_extras
from asyncrl.buffer.base import StepBatch
from asyncrl.config import Config, write_resolved
from asyncrl.observe.console import ProgressDisplay
from asyncrl.observe.metrics import MetricsWriter, Say
from asyncrl.observe.summary import format_summary, summarize
from asyncrl.orchestrator import checkpoint, components, lifecycle
from asyncrl.orchestrator.actor_pool import ActorPool
from asyncrl.orchestrator.checkpointer import Checkpointer, StartPoint
from asyncrl.orchestrator.collector import ScheduledCollector
from asyncrl.orchestrator.driver import RECV_WAIT_S, Actions, Driver, StepState, build_driver
from asyncrl.orchestrator.evaluation import eval_summary, format_eval_summary
from asyncrl.orchestrator.learner_group import GroupCall, LearnerGroup
from asyncrl.orchestrator.membership import ActorMembership
from asyncrl.orchestrator.requests import RunRequests, StallFacts
from asyncrl.orchestrator.run_lock import RunLock, claim_run_dir
from asyncrl.orchestrator.warm import Warm, process_key
from asyncrl.orchestrator.weight_sync import WeightSync
from asyncrl.transport.codec import decode_samples
from asyncrl.transport.zmq_stream import FrameReceiver
from asyncrl.types import Sample, StepResult


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

    def __init__(self, cfg: Config, log_fn: Say = print, run_lock: RunLock | None = None):
        self.cfg, self.say = preflight.resolve(cfg), log_fn  # max_model_len from the model when unset
        self.run_dir = self.cfg.run_dir.resolve()
        self.version = self.step = 0
        self.history: list[dict[str, Any]] = []
        self.stop_reason: str | None = None
        # what the end summary tells beyond the metric rows: time before a resume, lost actors
        self._t_start, self._elapsed_before, self._resumed_at = time.monotonic(), 0.0, None
        self.members: ActorMembership | None = None  # the actors as they join and are lost
        self._stop_deadline = 0.0
        self._train_ref: GroupCall | None = None
        self._wait_for_data_s = self._step_started = self._last_step_t = self._last_health_t = 0.0
        self._loop_s = 0.0  # the loop's own work between two steps (timing/loop_s)
        self.restarts = 0  # learner restarts in place (fault.max_restarts)
        self._start_point: StartPoint | None = None
        self._overlap_tokens = 0  # response tokens that arrived while the learner trained
        self.model_path = ""
        self.driver = self.samples = self.learner = self.pool = self.weight_sync = None
        self.metrics = self.requests = None
        self.collector = ScheduledCollector()
        self.run_lock = run_lock  # launch takes it before Ray starts; else `start` does
        self.checkpoints = Checkpointer(self.cfg, self.run_dir, log_fn, on_commit=self._on_checkpoint,
                                        on_failure=self._on_checkpoint_failed)

    def _on_checkpoint(self, step: int, **info: Any) -> None:
        self.metrics.event(step, "checkpoint", **info)

    def _on_checkpoint_failed(self, step: int, **info: Any) -> None:
        self.metrics.event(step, "checkpoint_failed", **info)

    def start(self, warm: Warm | None = None) -> None:
        """Start the run's processes, or take over `warm`'s, the processes of the run before it on
        the same cluster (warm.py; they must fit this config); lifecycle.py does the work."""
        cfg = self.cfg
        if self.run_lock is None:
            self.run_lock = claim_run_dir(self.run_dir, cfg.resume)
        resume = self.checkpoints.find_resume()
        write_resolved(cfg, self.run_dir)
        hide_broken_torch_extras()
        if resume:
            MetricsWriter.truncate(self.run_dir, resume.state["step"])  # rows after the checkpoint are rewritten
        self.metrics = MetricsWriter(self.run_dir, cfg.observe.tensorboard, cfg.observe.wandb_project,
                                     cfg.name, json.loads(cfg.model_dump_json()))
        # actors always start from the base model and get the current weights pushed (a resumed
        # run's checkpoint may be pruned before a replacement actor starts); the learner loads it
        base_model = components.resolve_model_path(cfg, log=self.say)
        self.model_path = resume.model_path(base_model) if resume else base_model
        self.driver = build_driver(cfg, self.model_path, self.metrics, self.say)
        self.samples = FrameReceiver(decode_samples, host=components.node_ip())  # each run its own
        t0, tiny = time.monotonic(), None if resume else components.tiny_spec(cfg)
        begin = lifecycle.start_processes if warm is None else functools.partial(lifecycle.take_over, warm)
        procs = begin(cfg, self.model_path, base_model, self.samples.endpoint, tiny, self.say)
        self.learner, self.pool, self.weight_sync = procs.learner, procs.pool, procs.weight_sync
        self.members = ActorMembership(self.pool, self.weight_sync, self.driver.requeue_actor, self.metrics, self.say)
        # the storage contract (checkpoint.py), before the learner reads or writes the run directory
        checkpoint.check_shared(self.run_dir, self.learner.answer_storage_probe)
        if resume:
            self.version = self.learner.load_checkpoint(str(resume.learner_dir)).result()
        if warm is None:
            lifecycle.form_weight_sync_group(cfg, self.weight_sync)
        if self.version > 0 or warm is not None:  # the actors hold the base model, or the last run's
            self.weight_sync.push(self.version, step=None)
        parity = lifecycle.check_parity(cfg, self.weight_sync, warm.probe_ids, self.version) if warm else None
        self.say(f"components ready in {time.monotonic() - t0:.1f}s; run directory {self.run_dir}")
        self.driver.restart_clock()  # the first row's rates count from here, not from start-up
        if resume:
            self.load_state_dict(resume.state)
            self.say(f"resumed from {resume.path} at step {self.step} (version {self.version}); "
                     f"{self.driver.requeued()} groups in flight then are regenerated")
        # where a learner restart goes back to before this run writes a checkpoint
        self._start_point = StartPoint(resume.path if resume else None, checkpoint.snapshot(self.state_dict()))
        self.requests = RunRequests(self.run_dir, self.metrics, self.say)
        self.metrics.event(self.step, "resume" if resume else "start", model=self.model_path,
                           actors=cfg.rollout.num_actors, **({"checkpoint": str(resume.path)} if resume else {}),
                           **({"warm": True, "parity_max_abs_diff": parity} if warm is not None else {}))
        self._last_step_t = self._last_health_t = time.monotonic()
        self.driver.start_eval(self.version, self.pool)
        self.collector.start()  # the garbage collector runs from the loop from now on (collector.py)

    def release(self) -> Warm | None:
        """End the run but keep its learner ranks and actors for the next one (warm.py); the rest
        shuts down as in `shutdown`. None when the run did not get as far as starting them."""
        if self.learner is None or self.pool is None or self.weight_sync is None:
            self.shutdown()
            return None
        warm = Warm(process_key(self.cfg), self.learner, self.pool, self.weight_sync, self.probe_ids)
        self.learner = self.pool = None
        self.shutdown()
        return warm

    def run(self, warm: Warm | None = None) -> dict[str, Any]:
        try:
            return self._run(warm)
        except BaseException as e:  # a stall, reward errors, a lost learner, a bug: events.jsonl says so
            self._end("failed", str(e) or repr(e))
            raise

    def _run(self, warm: Warm | None) -> dict[str, Any]:
        self.start(warm)
        display = ProgressDisplay(self.cfg.total_steps, self.cfg.observe.console)
        self._t_start = time.monotonic()
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
        # the last step too, so resume=auto on a finished run finds it finished
        if self.stop_reason is not None or (self.cfg.checkpoint.every_steps and
                                            self.step % self.cfg.checkpoint.every_steps):
            self.checkpoints.save(self.step, self.state_dict(), self.learner)
        self.checkpoints.poll(block=True)
        if self.stop_reason is not None:
            self._end("interrupted", self.stop_reason)
            self.say(f"stopped at step {self.step} ({self.stop_reason}); continue with resume=auto")
            return {"steps": self.step, "stopped": self.stop_reason}
        part_s = time.monotonic() - self._t_start
        summary = summarize(self.history, self._elapsed_before + part_s)
        if self._resumed_at is not None:
            summary.update(resumed_at_step=self._resumed_at, wall_s_since_resume=round(part_s, 1))
        summary["actors_lost"] = self.members.lost
        if self.cfg.save_final:
            summary["final_policy"] = self.learner.save(str(self.run_dir / "final")).result()
        summary.update(eval_summary(self.history))
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self._end("finished")
        self.say(format_summary(summary, str(self.run_dir)) + format_eval_summary(summary))
        return summary

    def _turn(self, display: ProgressDisplay) -> None:
        """One turn of the loops (the module's docstring): the driver's turn on what arrived (with
        none, after waiting RECV_WAIT_S for one), its actions carried out."""
        arrivals = self._receive()
        if self._train_ref is not None:  # generation overlapping training: what asynchrony buys
            self._overlap_tokens += sum(len(s.response_ids) for s in arrivals)
        self._carry_out(self.driver.turn(time.monotonic(), arrivals, self), display)
        self._check_health()

    def _receive(self) -> list[Sample]:
        """What the stream holds; with nothing there, what arrives within RECV_WAIT_S."""
        arrivals = self.samples.drain()
        if not arrivals and (sample := self.samples.recv(timeout_s=RECV_WAIT_S)) is not None:
            arrivals = [sample]
        return arrivals

    # the driver's view of this run's learner (driver.py LearnerView)
    @property
    def actor_ids(self) -> list[int]:
        return self.pool.ids

    @property
    def stopping(self) -> bool:
        return self.stop_reason is not None

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
            self.members.join_started(self.version, self.step, self.probe_ids)
        if acts.batch is not None:
            self._start_step(acts.batch)
        if acts.step_done:
            display.update(self._finish_step(self._train_ref.result()))
            return
        self.checkpoints.poll()
        self.collector.maybe_collect()

    def _restart_learner(self, error: BaseException) -> None:
        """A learner rank died: new ranks from the newest checkpoint (or where this run started),
        the run's state rewound to it, the actors (kept) pushed its weights; the groups they are
        generating are orphaned, the ones in flight at the checkpoint regenerated under new ids.
        A restart whose own ranks die counts as one more; past fault.max_restarts, LearnerDied."""
        while True:
            if self.restarts >= self.cfg.fault.max_restarts:
                raise self.checkpoints.learner_died(self.step + 1, error) from None
            try:
                return self._restart_learner_once(error)
            except RayActorError as again:
                error = again

    def _restart_learner_once(self, error: BaseException) -> None:
        self.restarts += 1
        died_at, self._train_ref = self.step + 1, None
        self.checkpoints.abandon()  # the dead learner may have been writing it
        self.learner.kill()
        start = self.checkpoints.newest_resumable() or self._start_point
        self.say(f"step {self.step}: the learner died during step {died_at} ({type(error).__name__}); "
                 f"restart {self.restarts} of {self.cfg.fault.max_restarts} (fault.max_restarts) from "
                 f"{start.path or 'the base model'}")
        self.model_path = start.model_path(self.pool.model_path)
        self.learner, self.version = lifecycle.replace_learner(self.cfg, self.weight_sync, self.run_dir, start,
                                                               self.model_path)
        self.weight_sync.push(self.version, step=None, on_lost=self.members.on_lost_at(self.step), rewind=True)
        parity = lifecycle.check_parity(self.cfg, self.weight_sync, self.probe_ids, self.version)
        self._restore(start.state, renew_requeued=True)
        self.metrics.rewind(self.step)
        self._last_step_t = time.monotonic()  # the stall watch counts from the restart
        self.metrics.event(self.step, "learner_restarted", restart=self.restarts, died_at_step=died_at,
                           checkpoint=str(start.path) if start.path else None, reason=str(error).splitlines()[0][:300],
                           **({"parity_max_abs_diff": parity} if parity is not None else {}))

    def _end(self, status: str, reason: str | None = None) -> None:  # the last line of events.jsonl
        if self.metrics is not None:
            self.metrics.event(self.step, "end", status=status, **({"reason": reason} if reason else {}))

    @property
    def probe_ids(self) -> list[int] | None:
        """The first sample seen (prompt and response): real text for this model's parity probe."""
        return self.driver.probe_ids

    def _poll_rewards(self, timeout_s: float = 0.0) -> None:
        """Rewards as they come back (scoring.py routes them), and eval samples to be scored:
        while a push waits for an evaluation, outside the turn."""
        self.driver.poll_rewards(self.step, timeout_s)

    def _start_step(self, batch: StepBatch) -> None:
        self._wait_for_data_s = time.monotonic() - self._last_step_t
        self._step_started = time.monotonic()
        self._train_ref = self.learner.train_step(self.step + 1, batch, self.requests.take_reset(self.cfg))
        self._loop_s += time.monotonic() - self._step_started

    def _finish_step(self, result: StepResult) -> dict[str, Any]:
        self._train_ref = None
        overlap, self._overlap_tokens = self._overlap_tokens, 0
        self._last_step_t = time.monotonic()
        self.step += 1
        self.version += 1
        if result.version != self.version:
            raise RuntimeError(f"learner reports version {result.version} after step {self.step}, "
                               f"expected {self.version}")
        train_s = time.monotonic() - self._step_started
        sync = self.members.after_step(self.version, self.step, self.probe_ids,
                                       due=self.step % self.cfg.sync.every_steps == 0)
        pushed = time.monotonic()
        if sync:  # the actors now hold this version: its evaluation, if due
            self.driver.eval_after_push(self.version, self.pool, last=self.step >= self.cfg.total_steps,
                                        poll=self._poll_rewards)
        pipeline, change = self.driver.end_step(self.step, result.metrics, self.samples.num_dropped)
        row = {"step": self.step, "learner/version": self.version, **result.metrics, **sync,
               "timing/train_s": train_s, "timing/wait_for_data_s": self._wait_for_data_s,
               "timing/loop_s": self._loop_s, "throughput/gen_tokens_while_training": overlap,
               "kl/reset": float(any(e["event"] == "reference_reset" for e in result.events)),
               **pipeline, **self.collector.metrics(),
               "rollout/actors": len(self.pool.ids)}
        self.history.append(row)
        self.metrics.log(self.step, row)
        self.metrics.log_samples(self.step, self.driver.take_examples())
        for e in result.events:
            self.metrics.event(self.step, e["event"], **{k: v for k, v in e.items() if k != "event"})
            self.say(f"step {self.step}: {e['event']} ({e.get('reason')}); KL was {e.get('kl', 0.0):.4g}")
        if change is not None:
            self.metrics.event(self.step, "stage", **change.describe())
            self.say(f"step {self.step}: {change}")
        self.requests.apply_scale(self.pool, self.driver.requeue_actor, self.step)
        if self.cfg.checkpoint.every_steps and self.step % self.cfg.checkpoint.every_steps == 0:
            self.checkpoints.save(self.step, self.state_dict(), self.learner)
        self._loop_s = time.monotonic() - pushed  # the next row's, with the next step's start
        return row

    def _check_health(self, every_s: float = 0.5) -> None:
        if time.monotonic() - self._last_health_t >= every_s:
            self._last_health_t = time.monotonic()
            self.members.check(self.step)
            self.requests.check_stall(self._last_health_t, self._last_step_t, self.cfg.observe.stall_timeout_s,
                                      self._stall_facts)

    def _stall_facts(self) -> StallFacts:
        return StallFacts(self.driver.progress(), self.samples.num_received, len(self.pool.ids),
                          self.cfg.data.answer_field)

    def request_stop(self, reason: str, drain_s: float = 20.0) -> None:
        """Stop admitting; the running step finishes, a checkpoint is written, the run ends. Groups
        in flight get up to `drain_s` to complete first (fewer to regenerate after a resume)."""
        if self.stop_reason is None:
            self.stop_reason, self._stop_deadline = reason, time.monotonic() + drain_s

    def _stopped(self) -> bool:
        return (self.stop_reason is not None and self._train_ref is None
                and (not self.driver.in_flight() or time.monotonic() > self._stop_deadline))

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version, "history": self.history,
                **self.weight_sync.state_dict(), "actors_lost": self.members.lost,
                "elapsed_s": self._elapsed_before + time.monotonic() - self._t_start, **self.driver.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """After the learner loaded its part (the versions must agree)."""
        self._restore(state)
        self.members.restore(state.get("actors_lost", []))  # checkpoints written before they were kept: none
        self._elapsed_before, self._resumed_at = state.get("elapsed_s", 0.0), state["step"]

    def _restore(self, state: dict[str, Any], renew_requeued: bool = False) -> None:
        """The training state of `state` (a resume's, or a learner restart's in this process)."""
        if state["version"] != self.version:
            raise RuntimeError(f"run state at version {state['version']}, learner at {self.version}")
        self.step, self.history = state["step"], list(state["history"])
        self.weight_sync.load_state_dict(state)
        self.driver.load_state_dict(state, renew_requeued=renew_requeued)

    def shutdown(self) -> None:
        """Whatever the run started, in reverse (each part only if it got that far)."""
        if self.learner is not None:
            try:
                self.learner.shutdown()
            except Exception as e:  # shutting down anyway; say what failed
                self.say(f"warning: learner shutdown failed: {e!r}")
        if self.pool is not None:
            self.pool.shutdown()
        if self.samples is not None:
            self.samples.close()
        if self.driver is not None:
            self.driver.close()
        if self.metrics is not None:
            self.metrics.close()
        self.collector.release()
        if self.run_lock is not None:
            self.run_lock.release()
