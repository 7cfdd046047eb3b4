"""The twin: a cluster's engines, learner and network as cost models on a virtual clock, and the
real driver (orchestrator/driver.py) deciding everything, turned as orchestrator.py turns it.

    SimActor/SimEngine ─frame (real codec)─► inbox ─► [Driver.turn, as the orchestrator's: ingest, verifiers
        (TwinRewardPool); every BOOKKEEPING_S: admit, next batch (split and encoded per rank), step done]
    grants ─► actors        batch ─► SimLearner (twin/learner.py: LearnerCost) ─► push (PushCost; the
    engines drain or abort first, by sync mode) ─► the next version

The driver is one thread: a turn starts when the previous one ended and no push is running (the
orchestrator's loop waits in the push), and, with `charge_driver`, lasts the real CPU time its
calls took (time.thread_time), so a driver that cannot keep up shows as engines waiting for
prompts and a learner waiting for batches. Without it the run is a pure function of the
scenario (what the determinism test compares); its CPU time is measured either way
(`driver_core_frac`).

Modes (MODES), each labelled by its layout:

- `sync`: the baseline TRL and verl users run, colocated: every GPU generates a rollout batch of
  `sync_prompts` prompts, then every GPU trains one optimizer step on all of it, a push, repeat
  (buffer.rollout_batch_prompts = minibatch_prompts, max_staleness 0; tools/bench_async_vs_sync.py
  runs the same on the real system). Offload and reload between the phases cost
  `push.switch_s` a push (0 unless the scenario gives it: verl measured 74 s for a 7B).
- `sync_decoupled`: the same schedule on the asynchronous split (AReaL's synchronous variant:
  generation GPUs wait while training GPUs train, and the other way round).
- `drain`, `inflight`: asyncrl's asynchronous loop on the split, with that sync.mode and the
  scenario's max_staleness.
- `colocate_async`: the asynchronous loop on one set of GPUs (verl's colocated asynchronous
  layout): generation and training interleave with one step of overlap (max_staleness 1), each
  slowed by `run.colocate_slowdown` while the other computes.

`trained_tokens_per_s` counts the loss tokens with a non-zero advantage: the asynchronous modes
drop zero-variance groups before training (dynamic sampling), the synchronous step trains them
with no gradient, and only the tokens that move the policy compare the two.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.orchestrator.driver import RECV_WAIT_S, StepState
from asyncrl.twin.actor import SimActor
from asyncrl.twin.capacity import gen_tokens_per_s, train_tokens_per_s
from asyncrl.twin.engine import SimEngine
from asyncrl.twin.events import EventQueue
from asyncrl.twin.learner import SimLearner
from asyncrl.twin.rewards import TwinRewardPool
from asyncrl.twin.scenario import Scenario

MODES = ("sync", "sync_decoupled", "drain", "inflight", "colocate_async")
SYNC_MODES = ("sync", "sync_decoupled")


def sync_prompts(sc: Scenario, mean_len: float) -> int:
    """Prompts of a synchronous step: Phi's worth of responses at the mean length."""
    if sc.run.sync_prompts is not None:
        return sc.run.sync_prompts
    return max(1, round(sc.run.token_budget / (sc.workload.group_size * mean_len)))


def driver_overrides(sc: Scenario, mode: str, mean_len: float, workdir: Path) -> list[str]:
    """The asyncrl config the real driver runs with in this mode."""
    if mode not in MODES:
        raise ValueError(f"twin mode must be one of {', '.join(MODES)}, got {mode!r}")
    w, r = sc.workload, sc.run
    per_actor = r.max_in_flight_prompts or max(1, -(-2 * sc.engine.max_num_seqs // w.group_size))
    out = [f"seed={sc.seed}", f"total_steps={r.steps}", f"reward.placement={r.reward_placement}",
           f"reward.num_workers={r.reward_workers}", "eval.every_steps=0",
           f"rollout.num_actors={sc.split.engines}", f"rollout.group_size={w.group_size}",
           f"rollout.max_tokens={w.max_tokens}", f"rollout.max_in_flight_prompts={per_actor}",
           *([f"rollout.max_in_flight_requests={r.max_in_flight_requests}"] if r.max_in_flight_requests else []),
           f"model.max_model_len={w.max_tokens + 512}", f"buffer.token_budget={r.token_budget}",
           "observe.tensorboard=false", "observe.console=off", f"observe.output_dir={workdir}", *r.overrides]
    given = {o.split("=", 1)[0].strip() for o in r.overrides}
    if mode in SYNC_MODES:
        n = sync_prompts(sc, mean_len)
        # a rollout batch trained whole, zero-variance groups too (no dynamic sampling: its
        # replacement groups would start late and lengthen the step; they carry no gradient,
        # so trained_tokens_per_s counts only tokens with a non-zero advantage in every mode)
        return [*out, "buffer.max_staleness=0", f"buffer.rollout_batch_prompts={n}", f"buffer.minibatch_prompts={n}",
                "sync.mode=drain", *(["algo.drop_zero_variance_groups=false"]
                                     if "algo.drop_zero_variance_groups" not in given else [])]
    sync_mode = r.sync_mode if mode == "colocate_async" else mode
    keep_kv = ["sync.keep_kv=true"] if r.keep_kv and sync_mode == "inflight" else []
    return [*out, f"buffer.max_staleness={r.max_staleness}", f"sync.mode={sync_mode}", *keep_kv,
            f"buffer.stale_policy={r.stale_policy}"]


@dataclass
class _Row:
    t: float
    loss_tokens: int
    useful_tokens: int
    """Loss tokens with a non-zero advantage (a zero-variance group's carry no gradient)."""
    staleness_mean: float
    staleness_max: float
    driver_cpu_s: float


class Twin:
    def __init__(self, sc: Scenario, mode: str, charge_driver: bool = True):
        from asyncrl.config import load_config
        from asyncrl.observe.metrics import MetricsWriter
        from asyncrl.orchestrator.driver import build_driver
        from asyncrl.tiny.tokenizer import save_tokenizer

        sc = sc.for_mode(mode)
        self.sc, self.mode, self.charge = sc, mode, charge_driver
        self.lengths, pass_rates = sc.lengths(), sc.pass_rates()
        self._tmp = Path(tempfile.mkdtemp(prefix="asyncrl-twin-"))
        save_tokenizer(self._tmp)  # the driver's prompts are the built-in task's; the twin sets lengths
        self.cfg = load_config(None, driver_overrides(sc, mode, self.lengths.expected(), self._tmp))
        self.events = EventQueue()
        # the driver's verifiers on this clock (reward.placement driver), or the actors' (actor):
        # then the driver's pool only scores evaluations, and there are none
        pool = TwinRewardPool(self.events, sc.run.reward_workers, sc.workload.verify_s, pass_rates, self._on_wake)
        self.driver = build_driver(self.cfg, str(self._tmp), MetricsWriter(self._tmp / "twin", tensorboard=False),
                                   say=lambda *_: None, rewards=pool, virtual_clock=True)
        engine_cost, kv_tokens = sc.engine_cost(), sc.kv_tokens()
        self.bin_s = sc.run.timeline_bin_s or max(sc.learner_cost().step_s(sc.run.token_budget) / 4, 1e-3)
        self.engines = [SimEngine(engine_cost, sc.engine.max_num_seqs, kv_tokens, self.events,
                                  on_finished=lambda *_: None, bin_s=self.bin_s,
                                  on_busy=lambda busy, t: self.learner.engine_busy(busy, t))
                        for _ in range(sc.split.engines)]
        self.actors = [SimActor(i, e, self.cfg.sync.mode, sc.workload.prompt_tokens, self.lengths, pass_rates,
                                self._deliver, scored=sc.run.reward_placement == "actor", keep_kv=self.cfg.sync.keep_kv)
                       for i, e in enumerate(self.engines)]
        self.actor_ids = list(range(len(self.actors)))
        # the driver's thread
        self.inbox: list[bytes] = []
        self.driver_free = 0.0
        self.driver_cpu_s = 0.0
        self._turn_at: float | None = None  # when the next turn is scheduled (None: none is)
        self._turn_token = 0
        # the learner and pushes
        self.step = self.version = 0
        self.learner = SimLearner(sc, self.events, self.bin_s, self.engines, self.actors,
                                  on_done=self._on_wake, on_pushed=self._pushed)
        self.rows: list[_Row] = []
        self._batch_tokens = (0, 0)  # loss tokens, useful ones
        self.frames = self.samples_in = 0

    # -- the driver's thread ------------------------------------------------------------------

    def _deliver(self, frame: bytes, samples: int, t: float) -> None:
        self.inbox.append(frame)
        self.frames += 1
        self.samples_in += samples
        self._request_turn(t)

    def _request_turn(self, t: float) -> None:
        """A turn at t, or as soon after as the driver is free (unless one comes sooner)."""
        t = max(t, self.driver_free)
        if self.learner.state != "pushing" and (self._turn_at is None or t < self._turn_at):
            self._turn_at, self._turn_token = t, self._turn_token + 1
            self.events.at(t, lambda now, token=self._turn_token: self._turn(now, token))

    def _on_wake(self, t: float) -> None:
        """Something the driver sees only when it looks (the learner's step ended): with no sample
        arriving, its loop looks every RECV_WAIT_S from when it last went idle."""
        waited = max(t - self.driver_free, 0.0)
        self._request_turn(max(t, self.driver_free + math.ceil(waited / RECV_WAIT_S - 1e-9) * RECV_WAIT_S))

    # the driver's view of this twin's learner (orchestrator/driver.py LearnerView)
    stopping = False

    def step_state(self) -> StepState:
        return StepState(self.learner.state)

    def _turn(self, t: float, token: int) -> None:
        from asyncrl.buffer.packing import rank_batches
        from asyncrl.transport.codec import decode_samples, encode_batch

        if token != self._turn_token:
            return  # superseded by an earlier turn
        self._turn_at = None
        if self.learner.state == "pushing":  # the push ends with a turn
            return
        d, cpu0 = self.driver, time.thread_time()
        frames, self.inbox = self.inbox, []
        # long responses are detokenized on the driver's helper threads (orchestrator/intake.py):
        # not its thread's time, and, on a head node with cores to spare, done within the turn
        # (the driver was built with virtual_clock)
        acts = d.turn(t, [s for f in frames for s in decode_samples(f)], self)
        if acts.batch is not None:  # streamed to the ranks as learner_group.py does
            b = acts.batch
            for part in rank_batches(self.step + 1, b.chunks, self.learner.ranks, b.token_budget, b.role,
                                     b.opened if b.role == "open" else None):
                encode_batch(part)
        if acts.step_done:
            self.step += 1
            self.version += 1
        t_end = self._charge(t, cpu0)
        acted = bool(acts.grants) or acts.batch is not None or acts.step_done
        if acted:
            self.events.at(t_end, lambda now: self._carry_out(now, acts.grants, acts.batch, acts.step_done))
        if not acts.bookkeeping or acted or acts.recheck:
            # the orchestrator's loop looks again BOOKKEEPING_S later; what this turn did (a step
            # started, stale tokens dropped by a cut) may open room for more, with no event to say so
            self._request_turn(max(d.next_bookkeeping_at, t_end))

    def _charge(self, t: float, cpu0: float) -> float:
        cpu = time.thread_time() - cpu0
        self.driver_cpu_s += cpu
        self.driver_free = t + (cpu if self.charge else 0.0)
        return self.driver_free

    def _carry_out(self, t: float, grants: list, batch: Any, finished: bool) -> None:
        for g in grants:
            self.actors[g.actor].submit(g.prompts, g.spec, g.group_size, t)
        if batch is not None:
            self._start_step(batch, t)
        if finished:
            self.learner.push(self.version, t)

    # -- the learner --------------------------------------------------------------------------

    def _start_step(self, batch: Any, t: float) -> None:
        prompt = self.sc.workload.prompt_tokens
        self._batch_tokens = (sum(len(c.old_logprobs) for c in batch.chunks),
                              sum(len(c.old_logprobs) for c in batch.chunks if c.advantage != 0))
        self.learner.start(sum(prompt + len(c.response_ids) for c in batch.chunks), t)

    def _pushed(self, t: float) -> None:
        """The actors hold the new version: the step's row, as the orchestrator writes it then."""
        cpu0 = time.thread_time()
        row, _ = self.driver.end_step(self.step, {}, 0)
        self.driver_free = self._charge(t, cpu0) + self.sc.learner.loop_overhead_s
        self.rows.append(_Row(t, *self._batch_tokens, float(row.get("staleness/mean") or 0.0),
                              float(row.get("staleness/max") or 0.0), self.driver_cpu_s))
        self._request_turn(t)

    # -- the run ------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        try:
            self._request_turn(0.0)
            while len(self.rows) < self.sc.run.steps:
                if not self.events.run_next():
                    raise RuntimeError(f"twin ({self.mode}) stalled at step {self.step}: nothing is left to happen "
                                       f"({self.driver.accounting()['samples']})")
            return self.result()
        finally:
            self.close()

    def close(self) -> None:
        self.driver.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def result(self) -> dict[str, Any]:
        sc, w = self.sc, min(self.sc.run.warmup_steps, len(self.rows) - 1)
        first, last = self.rows[w - 1] if w else None, self.rows[-1]
        t0 = first.t if first else 0.0
        window = last.t - t0
        measured = self.rows[w:]
        loss_tokens = sum(r.loss_tokens for r in measured)
        useful = sum(r.useful_tokens for r in measured)
        # the share of generated work that can carry a gradient (groups with mixed rewards)
        if self.cfg.algo.drop_zero_variance_groups:
            a = self.driver.group_stats()
            keep = 1 - a.groups_zero_variance / max(a.groups_complete, 1)
        else:  # trained with zero advantages: their share of the tokens trained
            keep = useful / max(loss_tokens, 1)
        mean_len, kv_tokens = self.lengths.expected(), sc.kv_tokens()
        gen_cap = gen_tokens_per_s(sc.engine_cost(), len(self.engines), sc.engine.max_num_seqs, kv_tokens,
                                   sc.workload.prompt_tokens, mean_len, self.lengths.expected_square())
        train_cap = train_tokens_per_s(self.learner.cost, self.learner.push_cost, sc.run.token_budget,
                                       sc.workload.prompt_tokens, mean_len)
        # in useful tokens: zero-variance groups take generation time, and training time too
        # when they are not dropped; split: both sides run at once; colocated: they take turns
        gen_useful = gen_cap * keep
        train_useful = train_cap * (1.0 if self.cfg.algo.drop_zero_variance_groups else keep)
        ideal = 1 / (1 / gen_useful + 1 / train_useful) if sc.split.colocated else min(gen_useful, train_useful)
        b0, b1 = math.ceil(t0 / self.bin_s), math.floor(last.t / self.bin_s)
        span = max(b1 - b0, 1) * self.bin_s
        gen_busy = sum(e.stats.busy_by_bin.get(b, 0.0) for e in self.engines for b in range(b0, b1))
        running = sum(e.stats.running_by_bin.get(b, 0.0) for e in self.engines for b in range(b0, b1))
        train_busy = sum(self.learner.busy.by_bin.get(b, 0.0) for b in range(b0, b1))
        tokens = sum(r.loss_tokens * r.staleness_mean for r in measured)
        stats = self.driver.buffer_stats()
        rate = useful / window
        return {
            "scenario": sc.name, "mode": self.mode, "steps": len(self.rows), "measured_steps": len(measured),
            "sim_s": round(last.t, 3), "window_s": round(window, 3), "steps_per_s": len(measured) / window,
            "trained_tokens_per_s": rate, "all_trained_tokens_per_s": loss_tokens / window,
            "ideal_tokens_per_s": ideal, "fraction_of_ideal": rate / ideal,
            "gen_capacity_tokens_per_s": gen_cap, "train_capacity_tokens_per_s": train_cap, "keep_frac": keep,
            "gen_util": gen_busy / (len(self.engines) * span), "train_util": train_busy / span,
            # running requests over max_num_seqs, time-weighted: an engine busy all the time at a
            # fraction of its batch has gen_util 1 and a low occupancy
            "gen_occupancy": running / (len(self.engines) * span * sc.engine.max_num_seqs),
            # engine time spent prefilling again what in-flight updates aborted (whole run)
            "reprefill_frac": (sum(e.stats.reprefill_s for e in self.engines)
                               / max(sum(e.stats.busy_s for e in self.engines), 1e-12)),
            "staleness_mean": tokens / loss_tokens if loss_tokens else 0.0,
            "staleness_max": max(r.staleness_max for r in measured),
            "length_bias": stats.length_bias,
            "stale_dropped_frac": stats.tokens_dropped_stale / max(stats.tokens_in, 1),
            "push_s_mean": sum(self.learner.push_s) / len(self.learner.push_s),
            "driver_core_frac": (last.driver_cpu_s - (first.driver_cpu_s if first else 0.0)) / window,
            "driver_charged": self.charge,
            "engines": len(self.engines), "kv_tokens": kv_tokens, "samples": self.samples_in,
            "frames": self.frames, "preemptions": sum(e.stats.preemptions for e in self.engines),
            "resumed_requests": sum(a.resumed for a in self.actors),
            "timeline": self.timeline(b0, b1),
        }

    def timeline(self, b0: int, b1: int) -> dict[str, list[float]]:
        """GPU utilisation per bin: the engines' mean and the learner's."""
        n = len(self.engines)
        return {"t": [b * self.bin_s for b in range(b1)],
                "gen": [sum(e.stats.busy_by_bin.get(b, 0.0) for e in self.engines) / (n * self.bin_s) for b in range(b1)],
                "train": [self.learner.busy.by_bin.get(b, 0.0) / self.bin_s for b in range(b1)],
                "window": [b0 * self.bin_s, b1 * self.bin_s]}
