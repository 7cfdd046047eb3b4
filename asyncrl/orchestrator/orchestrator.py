"""The orchestrator: starts the components and runs the loops that connect them.

    prompt source ─► [admission] ─submit (Ray)─► rollout actors ─samples (zmq)─► [ingest]
                         ▲                            ▲                              │
                         │ learner version            │ weights (gloo / NCCL)        ▼
                         │                            │                    reward → group assembler
    [step] ◄─────────────┴──── token buffer ◄─────────┴──────────────────────── → token buffer
       │  batch (zmq) ─► learner ─► metrics, version + 1 ─► [push] every sync.every_steps

One thread drives three loops, interleaved, each step of which is cheap and non-blocking:

- rollout loop (actors, in their own processes): generates continuously; each actor runs the
  prompts it was given and streams every sample as it finishes. Waits for: prompts. Unblocked by:
  admission, which grants prompts when the staleness bound allows (orchestrator/admission.py).
- ingest loop (here): hands each arriving sample to the reward pool (worker processes, a hard
  timeout per sample), and as rewards come back completes groups, computes advantages, drops
  zero-variance groups, fills the token buffer. Waits for: samples on the zmq stream, rewards.
  A verifier that hangs or crashes costs its sample's reward (0, counted), never the loop.
- train loop (here + learner): when no step is running and the buffer holds Phi fresh loss
  tokens, streams the batch to the learner and starts the step. Waits for: the buffer (data) and
  the previous step. Unblocked by: ingest. After a step, every `sync.every_steps`, a drain push:
  actors stop starting requests, finish the running ones, and receive the new weights while the
  learner broadcasts them; the run's version advances only when every actor has applied them.

A push that does not complete within `sync.timeout_s` raises naming the step and the peer.

Between steps the orchestrator also moves through training stages (data/stages.py: sampling
settings, Phi and data change at a boundary; prompts already admitted finish with the settings
they were admitted with) and forwards reference-reset requests to the learner: call
`request_reference_reset()`, or create the file `RESET_REFERENCE` in the run directory.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from typing import Any

import ray

from asyncrl.algo.reward_shaping import shaped_reward
from asyncrl.buffer.group_assembler import GroupAssembler
from asyncrl.buffer.packing import split_for_ranks
from asyncrl.compat import hide_broken_torch_extras
from asyncrl.config import Config, write_resolved
from asyncrl.data.stages import PassRateTracker, ResolvedStage, StageTracker, resolve_stages, stage_mixture
from asyncrl.observe.console import ProgressDisplay
from asyncrl.observe.metrics import MetricsWriter
from asyncrl.observe.summary import format_summary, summarize
from asyncrl.orchestrator import components
from asyncrl.orchestrator.admission import (admission_capacity, assign_prompts, prompts_per_step,
                                            rollout_batch_capacity)
from asyncrl.orchestrator.step_stats import StepStats
from asyncrl.reward.pool import RewardPool, RewardResult
from asyncrl.reward.registry import RewardRouter, check_functions, check_sources
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.transport.codec import decode_sample, encode_batch
from asyncrl.transport.zmq_stream import FrameReceiver, FrameSender
from asyncrl.types import Batch, Sample, ScoredSample

log = logging.getLogger(__name__)


class Orchestrator:
    def __init__(self, cfg: Config, log_fn=print):
        self.cfg = cfg
        self.say = log_fn
        self.run_dir = cfg.run_dir.resolve()
        self.version = 0
        self.step = 0
        self.history: list[dict[str, Any]] = []
        self._train_ref = None
        self._step_started = 0.0
        self._admitted = 0
        # group_id -> [actor, samples still to generate, samples still to score]
        self._pending: dict[str, list[int]] = {}
        self._in_flight = [0] * cfg.rollout.num_actors  # groups each actor is still generating
        self._kept_group_tokens = 0
        self._kept_groups = 0
        self._pushes = 0
        self._admitted_with: dict[str, tuple[int, int]] = {}  # group_id -> (n, max_tokens) of its stage
        self._reset_requested = False
        self._excluded: set[str] = set()  # record keys dropped by online filtering, all stages
        self.probe_ids: list[int] | None = None  # the first sample seen: real text for this model

    # -- setup --------------------------------------------------------------------------------

    def start(self) -> None:
        cfg = self.cfg
        write_resolved(cfg, self.run_dir)
        hide_broken_torch_extras()
        self.model_path = components.resolve_model_path(cfg, log=self.say)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.stages = StageTracker(resolve_stages(cfg))
        self.stage = self.stages.current
        self.pass_rates = PassRateTracker()
        self.prompts = self._stage_source(self.stage)
        check_functions(cfg.reward)
        if cfg.reward.type is None:  # no default verifier: every dataset's sources must be routed
            for st in self.stages.stages:
                check_sources(cfg.reward, self._stage_source(st).data_sources() or set())
        self.rewards = RewardPool(functools.partial(RewardRouter, cfg.reward), cfg.reward.num_workers,
                                  cfg.reward.timeout_s)
        self.assembler = GroupAssembler(self.stage.group_size, cfg.algo.advantage,
                                        cfg.algo.advantage_eps, cfg.algo.drop_zero_variance_groups,
                                        cfg.algo.truncation_mask)
        self.buffer = components.build_buffer(cfg.buffer, self.stage.token_budget, cfg.seed)
        self.host = components.node_ip()
        self.samples = FrameReceiver(decode_sample, host=self.host)
        t0 = time.monotonic()
        self.say(f"starting learner and {cfg.rollout.num_actors} rollout actor(s) ({cfg.rollout.engine})")
        self.learner = components.start_learner(cfg, self.model_path, self.host)
        self.actors = components.start_rollout_actors(cfg, self.model_path, self.samples.endpoint)
        self.batch_senders = [FrameSender(ray.get(self.learner.batch_endpoint.remote()))]
        self.weight_meta: dict[str, Any] = {}
        if cfg.rollout.engine != "fake":
            self.weight_meta = components.init_weight_sync(cfg, self.learner, self.actors, self.host)
        self.say(f"components ready in {time.monotonic() - t0:.1f}s; run directory {self.run_dir}")
        self.metrics = MetricsWriter(self.run_dir, cfg.observe.tensorboard, cfg.observe.wandb_project,
                                     cfg.name, json.loads(cfg.model_dump_json()))
        self.metrics.event(0, "start", model=self.model_path, actors=cfg.rollout.num_actors)
        self.stats = StepStats()
        self._last_step_t = self._last_warn_t = time.monotonic()
        self._wait_for_data_s = 0.0

    # -- the loops ----------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.start()
        display = ProgressDisplay(self.cfg.total_steps, self.cfg.observe.console)
        t_start = time.monotonic()
        try:
            while self.step < self.cfg.total_steps:
                self._ingest(self.samples.drain())
                self._admit()
                if self._train_ref is None:
                    self._try_start_step()
                elif ray.wait([self._train_ref], timeout=0)[0]:
                    row = self._finish_step(ray.get(self._train_ref))
                    display.update(row)
                    continue
                sample = self.samples.recv(timeout_s=0.01)
                if sample is not None:
                    self._ingest([sample])
                self._score(self.rewards.poll())
                self._warn_if_stalled()
        finally:
            display.close()
        summary = summarize(self.history, time.monotonic() - t_start)
        if self.cfg.save_final:
            summary["final_policy"] = ray.get(self.learner.save.remote(str(self.run_dir / "final")))
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        self.say(format_summary(summary, str(self.run_dir)))
        return summary

    def _warn_if_stalled(self, every_s: float = 60.0) -> None:
        """Say why no step has happened for a while (the usual cause: every group is dropped
        because all its rewards are equal, i.e. the task is too hard or too easy)."""
        now = time.monotonic()
        if now - max(self._last_step_t, self._last_warn_t) < every_s:
            return
        self._last_warn_t = now
        a = self.assembler.stats
        self.say(f"warning: no optimizer step for {now - self._last_step_t:.0f}s; "
                 f"{self.samples.num_received} samples received, {a.groups_complete} groups complete, "
                 f"{a.groups_zero_variance} dropped for zero reward variance, "
                 f"{self.buffer.num_loss_tokens}/{self.stage.token_budget} loss tokens buffered, "
                 f"{sum(self._in_flight)} prompts generating, {self.rewards.num_pending} samples awaiting "
                 f"rewards ({self.rewards.stats.timeouts} reward timeouts so far)")

    def _ingest(self, samples: list[Sample]) -> None:
        """Samples as they arrive: off to the reward pool. A group frees its actor's slot when
        its last sample arrives; until it is scored it counts against the staleness bound unless
        the verifiers hold it (admission.py), so generation cannot outrun slow verifiers."""
        for s in samples:
            if self.probe_ids is None and s.response_ids:
                self.probe_ids = s.prompt_ids + s.response_ids
            pending = self._pending.get(s.group_id)
            if pending is not None:
                pending[1] -= 1
                if pending[1] == 0:
                    self._in_flight[pending[0]] -= 1
            self.rewards.submit(s, self.tokenizer.decode(s.response_ids, skip_special_tokens=True), s.metadata)

    def _score(self, results: list[RewardResult]) -> None:
        """Rewards as they come back: shaping, stats, pass rates, groups, the token buffer."""
        for r in results:
            s: Sample = r.key
            correct, info = r.reward, r.info
            # a group finishing after a stage boundary keeps the settings it was sampled with
            group_size, max_tokens = self._admitted_with.get(s.group_id, (None, self.stage.max_tokens))
            # the verifier's reward is what is reported; the shaped one is what is trained on
            reward, info["shaping"] = shaped_reward(
                correct, len(s.response_ids), s.finish_reason == "stop",
                no_eos_penalty_value=self.cfg.algo.no_eos_penalty, max_length=max_tokens,
                overlong_buffer=self.cfg.algo.overlong_buffer, overlong_factor=self.cfg.algo.overlong_penalty_factor)
            self.stats.add_sample(s, correct, info, r.latency_s)
            if "record_key" in s.metadata:
                self.pass_rates.add(s.metadata["record_key"], correct >= 1.0)
            group = self.assembler.add(ScoredSample(s, reward, info), group_size)
            pending = self._pending.get(s.group_id)
            if pending is not None:
                pending[2] -= 1
                if pending[2] == 0:
                    del self._pending[s.group_id]
                    self._admitted_with.pop(s.group_id, None)
            if group is not None:
                self._kept_groups += 1
                self._kept_group_tokens += sum(len(m.sample.response_ids) for m in group.samples)
                self.buffer.add_group(group)

    def _admit(self) -> None:
        cfg, stage = self.cfg, self.stage
        per_step = prompts_per_step(stage.token_budget,
                                    self._kept_group_tokens / self._kept_groups if self._kept_groups else None,
                                    stage.group_size, stage.max_tokens)
        if cfg.buffer.rollout_batch_prompts is None:
            verifiers_behind = self.rewards.num_queued > 0  # then more generation would only queue up
            capacity = admission_capacity(
                cfg.buffer.max_staleness, self.version, per_step, self._admitted,
                self.assembler.stats.groups_zero_variance, sum(self._in_flight),
                starving=self.buffer.num_loss_tokens < stage.token_budget and not verifiers_behind,
                held_by_verifiers=0 if verifiers_behind else min(
                    len(self._pending) - sum(self._in_flight), cfg.reward.num_workers))
        else:
            d_r = cfg.buffer.rollout_batch_prompts
            steps_per_batch = (d_r / cfg.buffer.minibatch_prompts if cfg.buffer.minibatch_prompts
                               else d_r / per_step) * cfg.buffer.num_reuse
            capacity = rollout_batch_capacity(
                cfg.buffer.max_staleness, self.buffer.steps_left + (self._train_ref is not None),
                steps_per_batch, d_r, len(self._pending) + self.buffer.num_collecting_groups)
        if capacity == 0:
            return
        shares = assign_prompts(capacity, self._in_flight, cfg.rollout.max_in_flight_prompts)
        for actor_id, k in enumerate(shares):
            if k == 0:
                continue
            items = self.prompts.take(k)
            for p in items:
                self._pending[p.prompt_id] = [actor_id, stage.group_size, stage.group_size]
                self._admitted_with[p.prompt_id] = (stage.group_size, stage.max_tokens)
            self._in_flight[actor_id] += k
            self._admitted += k
            spec = SamplingSpec(stage.temperature, cfg.rollout.top_p, stage.max_tokens)
            self.actors[actor_id].submit.remote(items, spec, stage.group_size)

    def _try_start_step(self) -> None:
        chunks = self.buffer.next_batch(self.version)
        if chunks is None:
            return
        step = self.step + 1
        self.stats.add_batch(chunks, self.version)
        self._wait_for_data_s = time.monotonic() - self._last_step_t
        for rank, part in enumerate(split_for_ranks(chunks, len(self.batch_senders))):
            batch = Batch(step=step, rank=rank, chunks=part,
                          num_loss_tokens_global=sum(c.num_loss_tokens for c in chunks),
                          num_sequences_global=len(chunks), token_budget=self.stage.token_budget)
            self.batch_senders[rank].send(encode_batch(batch))
        self._step_started = time.monotonic()
        self._train_ref = self.learner.train_step.remote(step, reset_reference=self._take_reset_request())

    def _finish_step(self, learner_metrics: dict[str, float]) -> dict[str, Any]:
        self._train_ref = None
        self._last_step_t = time.monotonic()
        self.step += 1
        self.version = int(learner_metrics["learner/version"])
        train_s = time.monotonic() - self._step_started
        sync = self._push() if self.step % self.cfg.sync.every_steps == 0 else {}
        reset_reason = learner_metrics.pop("event/reference_reset", None)
        row = {"step": self.step, **learner_metrics, **sync, "timing/train_s": train_s,
               "timing/wait_for_data_s": self._wait_for_data_s, "kl/reset": float(reset_reason is not None),
               **self.stats.flush(self.buffer, self.assembler, self.samples), **self.stages.metrics(),
               **self.rewards.metrics(),
               "data/prompts_filtered": len(self._excluded)}
        self.history.append(row)
        self.metrics.log(self.step, row)
        if reset_reason is not None:
            self.metrics.event(self.step, "reference_reset", reason=reset_reason, kl=row.get("kl/mean"))
            self.say(f"step {self.step}: reference reset ({reset_reason}); KL was {row.get('kl/mean', 0.0):.4g}")
        new_stage = self.stages.on_step(self.step, row["reward/mean"])
        if new_stage is not None:
            self._enter_stage(new_stage)
        return row

    # -- stages and requests ------------------------------------------------------------------

    def _stage_source(self, stage: ResolvedStage):
        from asyncrl.data.build import build_stage_source

        # each stage shuffles its data with its own seed, so a rebuilt source does not replay the
        # previous stage's prompt order
        mixture = [m.model_copy(update={"seed": m.seed + stage.index}) for m in stage_mixture(stage, self.cfg.data)]
        return build_stage_source(mixture, self.tokenizer,
                                  self.cfg.model.max_model_len - stage.max_tokens, seed=self.cfg.seed + stage.index,
                                  id_prefix=f"s{stage.index}-" if stage.index else "")

    def _enter_stage(self, stage: ResolvedStage) -> None:
        """From the next admission on: the stage's data, sampling settings and Phi. Online
        filtering drops the prompts every sample of which was correct in the stage that ended."""
        old = self.stage
        self.stage = stage
        solved = self.pass_rates.solved()
        self.pass_rates.reset()
        before = len(self._excluded)
        if stage.online_filter:
            self._excluded |= solved
        if stage.data is not None or old.data is not None or stage.max_tokens != old.max_tokens:
            self.prompts = self._stage_source(stage)  # max_tokens bounds the prompt length too
        self.prompts.exclude(self._excluded)  # a rebuilt source keeps earlier stages' exclusions
        excluded = len(self._excluded) - before
        self.buffer.token_budget = stage.token_budget
        self.metrics.event(self.step, "stage", name=stage.name, index=stage.index, prompts_excluded=excluded,
                           solved_in_previous=len(solved))
        self.say(f"step {self.step}: entering stage {stage.name} (max_tokens {stage.max_tokens}, group "
                 f"{stage.group_size}, temperature {stage.temperature}, Phi {stage.token_budget})"
                 + (f"; online filter dropped {excluded} solved prompts" if stage.online_filter else ""))

    def request_reference_reset(self) -> None:
        """Reset the reference policy (and the optimizer state) after the next step."""
        if not self.cfg.algo.kl.needs_reference:
            raise ValueError("no reference policy to reset: set algo.kl.coef > 0 or algo.kl.track=true")
        self._reset_requested = True

    def _take_reset_request(self) -> bool:
        flag = self.run_dir / "RESET_REFERENCE"
        if flag.exists():
            flag.unlink()
            if self.cfg.algo.kl.needs_reference:
                self._reset_requested = True
            else:
                self.say("warning: RESET_REFERENCE ignored: this run holds no reference policy")
        requested, self._reset_requested = self._reset_requested, False
        return requested

    def _push(self) -> dict[str, float]:
        """Drain push of the current version to every actor; raises on timeout, naming the peer."""
        t0 = time.monotonic()
        refs = [a.update_weights.remote(self.weight_meta, self.version) for a in self.actors]
        learner_ref = self.learner.push_weights.remote() if self.weight_meta else None
        names = {r: f"rollout actor {i}" for i, r in enumerate(refs)}
        if learner_ref is not None:
            refs.append(learner_ref)
            names[learner_ref] = "learner rank 0"
        done, waiting = ray.wait(refs, num_returns=len(refs), timeout=self.cfg.sync.timeout_s)
        if waiting:
            raise TimeoutError(
                f"weight push of version {self.version} (step {self.step}) did not finish within "
                f"{self.cfg.sync.timeout_s}s; still waiting for: {', '.join(names[r] for r in waiting)}")
        results = ray.get(refs)
        out = {"sync/push_s": time.monotonic() - t0, "sync/version": self.version}
        for r in results:
            for k, v in (r or {}).items():
                out[k] = max(out.get(k, 0.0), v)  # the slowest actor is what the step waited for
        self._pushes += 1
        if self.cfg.sync.probe_every and self._pushes % self.cfg.sync.probe_every == 0 and self.probe_ids:
            out["sync/probe_max_abs_diff"] = self.check_parity()
        return out

    def check_parity(self) -> float:
        """Max |actor - learner| logprob over the probe, over all actors; raises past tolerance.

        This is what catches a push that silently did not change what an engine computes
        (PLATFORM.md: tied embeddings and prepacked CPU weights)."""
        ids = self.probe_ids
        want = ray.get(self.learner.prompt_logprobs.remote(ids))
        worst = 0.0
        for i, got in enumerate(ray.get([a.prompt_logprobs.remote(ids) for a in self.actors])):
            gap = max(abs(a - b) for a, b in zip(got, want))
            worst = max(worst, gap)
            if gap > self.cfg.sync.probe_tolerance:
                self.metrics.event(self.step, "parity_failure", actor=i, gap=gap, version=self.version)
                raise RuntimeError(
                    f"after the push of version {self.version}, rollout actor {i}'s logprobs differ from "
                    f"the learner's by {gap:.3g} nats (tolerance {self.cfg.sync.probe_tolerance}): "
                    "the engine is not computing with the pushed weights")
        return worst

    def shutdown(self) -> None:
        if hasattr(self, "learner"):
            try:
                ray.get(self.learner.shutdown.remote(), timeout=30)
            except Exception as e:  # shutting down anyway; say what failed
                log.warning("learner shutdown failed: %r", e)
        for a in getattr(self, "actors", []):
            try:
                ray.get(a.shutdown.remote(), timeout=30)
            except Exception as e:  # shutting down anyway; say what failed
                log.warning("actor shutdown failed: %r", e)
        if hasattr(self, "rewards"):
            self.rewards.close()
        if hasattr(self, "metrics"):
            self.metrics.close()
