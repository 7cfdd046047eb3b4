"""The orchestrator: starts the components and runs the loops that connect them.

    prompt source ─► [admission] ─submit (Ray)─► rollout actors ─samples (zmq)─► [ingest]
                         ▲                            ▲                              │
                         │ learner version            │ weights (gloo / NCCL)        ▼
                         │                            │                    reward pool → ledger
    [step] ◄─────────────┴──── token buffer ◄─────────┴──── (shaping, groups, advantages) ◄┘
       │  batch (zmq) ─► learner ─► StepResult (version + 1) ─► [push] every sync.every_steps

One thread drives three loops, interleaved, each step of which is cheap and non-blocking:

- rollout loop (actors, in their own processes): generates continuously; each actor runs the
  prompts it was given and streams every sample as it finishes. Waits for: prompts. Unblocked by:
  admission, which grants prompts when the buffer's staleness bound allows (buffer/admission.py).
- ingest loop (here): hands each arriving sample to the reward pool (worker processes, a hard
  timeout per sample); as rewards come back the group ledger (ledger.py) shapes them, completes
  groups, drops zero-variance ones and fills the buffer. Waits for: samples, rewards.
- train loop (here + learner): when no step is running and the buffer can fill one, streams the
  batch to the learner and starts the step. Waits for: the buffer and the previous step. After a
  step, every `sync.every_steps`, a drain push (actor_pool.py): actors stop starting requests,
  finish the running ones and load the new weights while the learner broadcasts them.

Versions: the orchestrator owns the policy version. It advances by one with every optimizer step
(the learner's StepResult must agree); an actor's version advances when it has applied a push, so
between a step and its push the actors lag by one, which the staleness bound counts.

Durability, at step boundaries (the learner is idle then): a checkpoint every
`checkpoint.every_steps` (checkpoint.py; the learner writes its part while generation goes on),
dead actors replaced and the weight-sync group rebuilt around the live ones (actor_pool.py), the
actor count changed on request (`SCALE_ACTORS` in the run directory), a reference reset on request
(`RESET_REFERENCE`). `request_stop` (SIGTERM / SIGINT in launch/run.py) stops admission, lets the
running step finish, writes a checkpoint and ends the run; `resume` continues from one.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError

from asyncrl.buffer.group_assembler import GroupAssembler
from asyncrl.buffer.packing import split_for_ranks
from asyncrl.compat import hide_broken_torch_extras
from asyncrl.config import Config, ConfigError, write_resolved
from asyncrl.observe.console import ProgressDisplay
from asyncrl.observe.metrics import MetricsWriter
from asyncrl.observe.summary import format_summary, summarize
from asyncrl.orchestrator import checkpoint, components
from asyncrl.orchestrator.actor_pool import ActorPool, PushFailed
from asyncrl.orchestrator.admission import assign_prompts
from asyncrl.orchestrator.ledger import GroupLedger, Shaping
from asyncrl.orchestrator.requests import RunRequests
from asyncrl.orchestrator.stage_runner import StageRunner
from asyncrl.orchestrator.step_stats import StepStats
from asyncrl.reward.pool import RewardPool, RewardResult
from asyncrl.reward.registry import RewardRouter, check_functions, check_sources
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.transport.codec import decode_sample, encode_batch
from asyncrl.transport.zmq_stream import FrameReceiver, FrameSender
from asyncrl.types import Batch, Sample, StepResult


class LearnerDied(RuntimeError):
    """The learner process is gone; the message says where to resume from."""


class Orchestrator:
    def __init__(self, cfg: Config, log_fn=print):
        self.cfg, self.say = cfg, log_fn
        self.run_dir = cfg.run_dir.resolve()
        self.version = self.step = 0
        self.history: list[dict[str, Any]] = []
        self.probe_ids: list[int] | None = None  # the first sample seen: real text for this model
        self.stop_reason: str | None = None
        self._train_ref = None
        self._pending_ckpt = None
        self._pushes = 0

    # -- setup --------------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.cfg
        resume = self._find_resume()
        write_resolved(cfg, self.run_dir)
        hide_broken_torch_extras()
        self.model_path = (str(resume[0] / checkpoint.LEARNER_DIR / "policy") if resume
                           else components.resolve_model_path(cfg, log=self.say))
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.stages = StageRunner(cfg, self.tokenizer)
        check_functions(cfg.reward)
        if cfg.reward.type is None:  # no default verifier: every dataset's sources must be routed
            check_sources(cfg.reward, self.stages.data_sources())
        self.rewards = RewardPool(functools.partial(RewardRouter, cfg.reward), cfg.reward.num_workers,
                                  cfg.reward.timeout_s)
        a = cfg.algo
        self.ledger = GroupLedger(
            components.build_buffer(cfg.buffer, self.stages.current.token_budget, cfg.seed),
            GroupAssembler(self.stages.current.group_size, a.advantage, a.advantage_eps,
                           a.drop_zero_variance_groups, a.truncation_mask),
            Shaping(a.no_eos_penalty, a.overlong_buffer, a.overlong_penalty_factor), cfg.reward.num_workers)
        self.host = components.node_ip()
        self.samples = FrameReceiver(decode_sample, host=self.host)
        self.rpc_dir = tempfile.mkdtemp(prefix="asyncrl-vllm-rpc-")
        t0 = time.monotonic()
        self.say(f"starting learner and {cfg.rollout.num_actors} rollout actor(s) ({cfg.rollout.engine})")
        self.learner = components.start_learner(cfg, self.model_path, self.host)
        if resume:
            self.version = ray.get(self.learner.load_checkpoint.remote(str(resume[0] / checkpoint.LEARNER_DIR)))
        self.batch_senders = [FrameSender(ray.get(self.learner.batch_endpoint.remote()))]
        self.pool = ActorPool(cfg, self.model_path, self.samples.endpoint, self.learner, self.host, self.rpc_dir)
        self.pool.start(cfg.rollout.num_actors, self.version)
        self.say(f"components ready in {time.monotonic() - t0:.1f}s; run directory {self.run_dir}")
        self.stats = StepStats()
        if resume:
            self._restore(*resume)
        self.metrics = MetricsWriter(self.run_dir, cfg.observe.tensorboard, cfg.observe.wandb_project,
                                     cfg.name, json.loads(cfg.model_dump_json()))
        self.requests = RunRequests(self.run_dir, self.metrics, self.say)
        self.metrics.event(self.step, "resume" if resume else "start", model=self.model_path,
                           actors=cfg.rollout.num_actors, **({"checkpoint": str(resume[0])} if resume else {}))
        self._last_step_t = self._last_warn_t = self._last_health_t = time.monotonic()
        self._wait_for_data_s = 0.0

    # -- the loops ----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.start()
        display = ProgressDisplay(self.cfg.total_steps, self.cfg.observe.console)
        t_start = time.monotonic()
        try:
            while self.step < self.cfg.total_steps and not self._stopped():
                self._ingest(self.samples.drain())
                if self.stop_reason is None:
                    self._admit()
                if self._train_ref is None:
                    if self.stop_reason is None:
                        self._try_start_step()
                elif ray.wait([self._train_ref], timeout=0)[0]:
                    display.update(self._finish_step(self._step_result()))
                    continue
                sample = self.samples.recv(timeout_s=0.01)
                if sample is not None:
                    self._ingest([sample])
                self._score(self.rewards.poll())
                self._poll_checkpoint()
                self._check_health()
        finally:
            display.close()
        if self.stop_reason is not None:
            return self._stop()
        if self.cfg.checkpoint.every_steps and self.step % self.cfg.checkpoint.every_steps:
            self._checkpoint()  # the last step too, so resume=auto on a finished run finds it finished
        self._poll_checkpoint(block=True)
        summary = summarize(self.history, time.monotonic() - t_start)
        if self.cfg.save_final:
            summary["final_policy"] = ray.get(self.learner.save.remote(str(self.run_dir / "final")))
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.metrics.event(self.step, "end", status="finished")
        self.say(format_summary(summary, str(self.run_dir)))
        return summary

    def _ingest(self, samples: list[Sample]) -> None:
        """Samples as they arrive: recorded by the ledger, then off to the reward pool."""
        for s in samples:
            if self.probe_ids is None and s.response_ids:
                self.probe_ids = s.prompt_ids + s.response_ids
            if self.ledger.on_generated(s) is not None:
                self.rewards.submit(s, self.tokenizer.decode(s.response_ids, skip_special_tokens=True), s.metadata)

    def _score(self, results: list[RewardResult]) -> None:
        """Rewards as they come back: the ledger shapes them and fills groups and the buffer."""
        for r in results:
            s: Sample = r.key
            if self.ledger.on_scored(s, r.reward, r.info) is None:
                continue  # its group was given up (actor lost) and is being regenerated
            self.stats.add_sample(s, r.reward, r.info, r.latency_s)
            self.stages.record(s.metadata, r.reward)

    def _admit(self) -> None:
        stage, cfg = self.stages.current, self.cfg
        capacity = self.ledger.capacity(self.version, stage.token_budget, stage.group_size, stage.max_tokens,
                                        step_running=self._train_ref is not None,
                                        verifiers_behind=self.rewards.num_queued > 0)
        if capacity == 0:
            return
        load = self.ledger.generating_by_actor(self.pool.ids)
        for actor, k in assign_prompts(capacity, load, cfg.rollout.max_in_flight_prompts).items():
            if k == 0:
                continue
            records = [self.ledger.readmit(r, actor) for r in self.ledger.take_requeued(k)]
            spec = SamplingSpec(stage.temperature, cfg.rollout.top_p, stage.max_tokens)
            records += [self.ledger.admit(p, stage.index, spec, stage.group_size, actor)
                        for p in self.stages.take(k - len(records))]
            by_settings: dict[tuple, list] = {}  # requeued groups keep the settings they had
            for r in records:
                by_settings.setdefault((r.spec.temperature, r.spec.top_p, r.spec.max_tokens, r.group_size),
                                       []).append(r.prompt)
            for (temp, top_p, max_tokens, n), prompts in by_settings.items():
                self.pool.submit(actor, prompts, SamplingSpec(temp, top_p, max_tokens), n)

    def _try_start_step(self) -> None:
        chunks = self.ledger.buffer.next_batch(self.version)
        if chunks is None:
            return
        step = self.step + 1
        self.stats.add_batch(chunks, self.version)
        self._wait_for_data_s = time.monotonic() - self._last_step_t
        for rank, part in enumerate(split_for_ranks(chunks, len(self.batch_senders))):
            batch = Batch(step=step, rank=rank, chunks=part,
                          num_loss_tokens_global=sum(c.num_loss_tokens for c in chunks),
                          num_sequences_global=len(chunks), token_budget=self.stages.current.token_budget)
            self.batch_senders[rank].send(encode_batch(batch))
        self._step_started = time.monotonic()
        self._train_ref = self.learner.train_step.remote(step, reset_reference=self.requests.take_reset(self.cfg))

    def _step_result(self) -> StepResult:
        try:
            return ray.get(self._train_ref)
        except RayActorError as e:
            found = checkpoint.list_complete(checkpoint.checkpoints_dir(self.run_dir))
            where = f"the newest checkpoint is {found[-1]}" if found else "no checkpoint was written yet"
            raise LearnerDied(f"the learner process died during step {self.step + 1} ({type(e).__name__}); "
                              f"{where}: run the same command with resume=auto to continue") from None

    def _finish_step(self, result: StepResult) -> dict[str, Any]:
        self._train_ref = None
        self._last_step_t = time.monotonic()
        self.step += 1
        self.version += 1
        if result.version != self.version:
            raise RuntimeError(f"learner reports version {result.version} after step {self.step}, expected {self.version}")
        train_s = time.monotonic() - self._step_started
        joined = self.pool.admit_started()
        sync = self._push() if joined or self.step % self.cfg.sync.every_steps == 0 else {}
        row = {"step": self.step, "learner/version": self.version, **result.metrics, **sync,
               "timing/train_s": train_s, "timing/wait_for_data_s": self._wait_for_data_s,
               "kl/reset": float(any(e["event"] == "reference_reset" for e in result.events)),
               **self.stats.flush(self.ledger.buffer, self.ledger.assembler, self.samples),
               **self.stages.metrics(), **self.rewards.metrics(), **self.ledger.metrics(),
               "rollout/actors": len(self.pool.ids)}
        self.history.append(row)
        self.metrics.log(self.step, row)
        for e in result.events:
            self.metrics.event(self.step, **e)
            self.say(f"step {self.step}: {e['event']} ({e.get('reason')}); KL was {e.get('kl', 0.0):.4g}")
        change = self.stages.on_step(self.step, row["reward/mean"])
        if change is not None:
            self._enter_stage(change)
        self.requests.apply_scale(self.pool, self.ledger, self.step)
        if self.cfg.checkpoint.every_steps and self.step % self.cfg.checkpoint.every_steps == 0:
            self._checkpoint()
        return row

    def _enter_stage(self, change) -> None:
        st = change.stage
        self.ledger.buffer.token_budget = st.token_budget
        self.metrics.event(self.step, "stage", name=st.name, index=st.index, prompts_excluded=change.prompts_excluded,
                           solved_in_previous=change.solved_in_previous)
        self.say(f"step {self.step}: entering stage {st.name} (max_tokens {st.max_tokens}, group "
                 f"{st.group_size}, temperature {st.temperature}, Phi {st.token_budget})"
                 + (f"; online filter dropped {change.prompts_excluded} solved prompts" if st.online_filter else ""))

    # -- weights and failures -----------------------------------------------------------------

    def _push(self) -> dict[str, float]:
        """Drain push of the current version; actors lost on the way are replaced and the push
        is retried around the survivors."""
        try:
            out = self.pool.push(self.version, self.step)
        except PushFailed as e:
            self._actors_lost(e.dead, str(e))
            out = self.pool.push(self.version, self.step)
        self._pushes += 1
        every = self.cfg.sync.probe_every
        if every and self._pushes % every == 0 and self.probe_ids and self.pool.ids:
            out["sync/probe_max_abs_diff"] = self.check_parity()
        return out

    def check_parity(self) -> float:
        """Max |actor - learner| logprob over the probe; raises past tolerance. This is what
        catches a push that silently did not change what an engine computes (tied embeddings and
        prepacked CPU weights, see sync/vllm_gloo_engine.py)."""
        worst, bad = self.pool.check_parity(self.probe_ids, self.cfg.sync.probe_tolerance)
        for actor, gap in bad:
            self.metrics.event(self.step, "parity_failure", actor=actor, gap=gap, version=self.version)
            raise RuntimeError(
                f"after the push of version {self.version}, rollout actor {actor}'s logprobs differ from the "
                f"learner's by {gap:.3g} nats (tolerance {self.cfg.sync.probe_tolerance}): the engine is "
                "not computing with the pushed weights")
        return worst

    def _check_health(self, every_s: float = 0.5) -> None:
        now = time.monotonic()
        if now - self._last_health_t >= every_s:
            self._last_health_t = now
            dead = self.pool.find_dead()
            if dead:
                self._actors_lost(dead, "actor process died")
            self.requests.warn_if_stalled(self, now)

    def _actors_lost(self, dead: list[int], why: str) -> None:
        for actor in dead:
            requeued = self.ledger.requeue_actor(actor)
            self.pool.replace(actor)
            self.metrics.event(self.step, "actor_lost", actor=actor, groups_requeued=requeued, reason=why)
            self.say(f"step {self.step}: rollout actor {actor} lost ({why}); {requeued} groups requeued, "
                     "a replacement is starting")

    # -- checkpoints, stop, resume ------------------------------------------------------------

    def request_stop(self, reason: str, drain_s: float = 20.0) -> None:
        """Stop admitting; the running step finishes, a checkpoint is written, the run ends. Groups
        in flight get up to `drain_s` to complete first (fewer to regenerate after a resume)."""
        if self.stop_reason is None:
            self.stop_reason, self._stop_deadline = reason, time.monotonic() + drain_s

    def _stopped(self) -> bool:
        return (self.stop_reason is not None and self._train_ref is None
                and (not self.ledger.records or time.monotonic() > self._stop_deadline))

    def _stop(self) -> dict[str, Any]:
        self._checkpoint()
        self._poll_checkpoint(block=True)
        self.metrics.event(self.step, "end", status="interrupted", reason=self.stop_reason)
        self.say(f"stopped at step {self.step} ({self.stop_reason}); checkpoint written: continue with resume=auto")
        return {"steps": self.step, "stopped": self.stop_reason}

    def _state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "version": self.version, "history": self.history, "pushes": self._pushes,
                "probe_ids": self.probe_ids, "ledger": self.ledger.state_dict(),
                "stages": self.stages.state_dict(), "stats": self.stats.state_dict()}

    def _checkpoint(self) -> None:
        """The orchestrator's state now; the learner saves its part before its next step (Ray
        runs its calls in order), so generation never waits for the write."""
        self._poll_checkpoint(block=True)
        tmp = checkpoint.begin(self.run_dir, self.step, self._state_dict(), self.cfg)
        self._pending_ckpt = (tmp, self.step, self.learner.save_checkpoint.remote(str(tmp / checkpoint.LEARNER_DIR)))

    def _poll_checkpoint(self, block: bool = False) -> None:
        if self._pending_ckpt is None or not (block or ray.wait([self._pending_ckpt[2]], timeout=0)[0]):
            return
        tmp, step, ref = self._pending_ckpt
        self._pending_ckpt = None
        saved = ray.get(ref)
        path = checkpoint.commit(tmp, step, self.cfg.checkpoint.keep)
        self.metrics.event(step, "checkpoint", path=str(path), learner_save_s=saved["save_s"])

    def _find_resume(self):
        if self.cfg.resume is None:
            return None
        if self.cfg.resume == "auto":
            found = checkpoint.find_resumable(self.run_dir, warn=lambda m: self.say(f"warning: {m}"))
            if found is None:
                self.say(f"resume=auto: no checkpoint in {self.run_dir}; starting fresh")
        else:
            path = Path(self.cfg.resume).expanduser().resolve()
            try:
                found = path, checkpoint.validate(path)
            except ValueError as e:
                raise ConfigError(f"resume: {e}") from None
        if found is not None:
            checkpoint.check_compatible(found[0], self.cfg)
        return found

    def _restore(self, path, state: dict[str, Any]) -> None:
        if state["version"] != self.version:
            raise RuntimeError(f"{path}: run state at version {state['version']}, learner at {self.version}")
        self.step, self.history = state["step"], state["history"]
        self._pushes, self.probe_ids = state["pushes"], state["probe_ids"]
        self.ledger.load_state_dict(state["ledger"])
        self.stages.load_state_dict(state["stages"])
        self.ledger.buffer.token_budget = self.stages.current.token_budget
        self.stats.load_state_dict(state["stats"])
        MetricsWriter.truncate(self.run_dir, self.step)  # rows after the checkpoint are rewritten
        self.say(f"resumed from {path} at step {self.step} (version {self.version}); "
                 f"{len(self.ledger.requeued)} groups in flight then are regenerated")

    def shutdown(self) -> None:
        if hasattr(self, "learner"):
            try:
                ray.get(self.learner.shutdown.remote(), timeout=30)
            except Exception as e:  # shutting down anyway; say what failed
                self.say(f"warning: learner shutdown failed: {e!r}")
        if hasattr(self, "pool"):
            self.pool.shutdown()
        if hasattr(self, "rewards"):
            self.rewards.close()
        if hasattr(self, "metrics"):
            self.metrics.close()
        if hasattr(self, "rpc_dir"):
            shutil.rmtree(self.rpc_dir, ignore_errors=True)  # vLLM's sockets, killed engines' too
