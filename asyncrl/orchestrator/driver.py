"""The driver: every decision of the orchestrator's loop, with no Ray, socket or process in it.

One loop turn, the same for every caller (the orchestrator, the twin, the orchestrator bench):

    turn(now, arrivals, learner) ─► Actions
      every turn:            arrivals ─► ingest ─► reward pool ─► poll_rewards ─► router ─► ledger
      every BOOKKEEPING_S:   admission ─► grants (prompts for one actor each)
                             learner idle ─► the next batch (chunks, role, start version, Phi)
                             learner done ─► step_done: the caller pushes, then end_step
    end_step(step, learner metrics) ─► the row's pipeline metrics, the buffer's ratio moments,
                                       the stage change if the step ended a stage

The caller feeds the turn what its processes produced (samples from the actors' stream) and a
`LearnerView` (the policy version, the actors, whether the step runs or is done; asked only when
bookkeeping is due, since on a cluster each look is a Ray check), then carries out the actions:
prompts to actors, a batch to the learner ranks, a push. It reads the driver only through its
methods below, never through its parts.

It holds the ledger, the intake (samples to the reward pool), the result router, the step
statistics, the stage runner, the evaluator's bookkeeping and the stale gate (buffer.stale_policy
wait and pace, stale_gate.py); `build_driver` makes all of them from a config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Protocol

from asyncrl.algo.batch_ess import ratio_moments
from asyncrl.buffer.base import Buffer, StepBatch
from asyncrl.buffer.group_assembler import GroupAssembler
from asyncrl.buffer.rollout_batch import RolloutBatchBuffer
from asyncrl.buffer.token_buffer import TokenBuffer
from asyncrl.config import BufferConfig, Config
from asyncrl.data.stages import ResolvedStage
from asyncrl.observe.metrics import EventLog, Say
from asyncrl.orchestrator.admission import assign_prompts
from asyncrl.orchestrator.evaluation import Evaluator
from asyncrl.orchestrator.intake import SampleIntake
from asyncrl.orchestrator.ledger import GroupLedger, Shaping, group_by_settings
from asyncrl.orchestrator.scoring import ResultRouter
from asyncrl.orchestrator.stage_runner import StageChange, StageRunner
from asyncrl.orchestrator.stale_gate import StaleGate
from asyncrl.orchestrator.teacher import Teacher
from asyncrl.orchestrator.step_stats import StepStats
from asyncrl.reward.errors import RewardErrorMonitor, env_error_monitor
from asyncrl.reward.pool import RewardPool, RewardResult
from asyncrl.reward.registry import build_reward_pool
from asyncrl.rollout.engine import SamplingSpec
from asyncrl.types import PromptItem, Sample


# Admission, the step's start and end and checkpoint commits run at most this often: each costs
# tens of microseconds (Ray checks among them), and under load the loop turns every few samples,
# so every turn would spend more on them than on its samples. 2 ms is nothing next to a step.
BOOKKEEPING_S = 0.002
# With no sample arriving, a loop turn waits this long for one before it looks at the learner
# again: a step that ends then is noticed up to this late (the twin charges it too).
RECV_WAIT_S = 0.01


@dataclass(frozen=True)
class Progress:
    """What the pipeline has done so far: the facts a stalled run is diagnosed from (requests.py)."""

    groups_complete: int
    groups_zero_variance: int  # complete groups dropped with equal rewards: no advantage signal
    buffered_tokens: int
    token_budget: int
    groups_in_flight: int
    rewards_pending: int
    rewards_completed: int
    reward_timeouts: int
    reward_outcomes: list[tuple[str, int]]  # the most common, with their counts
    answers_missing: tuple[int, int]  # (records without an answer, records)


@dataclass(frozen=True)
class Grant:
    """Prompts one actor is to generate, n samples each, all with the same settings."""

    actor: int
    spec: SamplingSpec
    group_size: int
    prompts: list[PromptItem]


class StepState(Enum):
    IDLE = "idle"  # no step runs: the turn may start one
    TRAINING = "training"
    DONE = "done"  # the step ended and the caller has not finished it yet


class LearnerView(Protocol):
    """What a loop turn reads of its caller: the policy, the actors and the learner's step."""

    step: int  # optimizer steps done
    version: int  # the policy version the learner holds (the one admitted groups are counted at)

    @property
    def actor_ids(self) -> list[int]: ...

    @property
    def stopping(self) -> bool:
        """No more admissions or steps: the run is winding down (the running step still ends)."""

    def step_state(self) -> StepState:
        """Asked only when bookkeeping is due (a Ray check on a cluster)."""


@dataclass(frozen=True)
class Actions:
    """What the caller is to carry out after a turn."""

    grants: list[Grant] = field(default_factory=list)
    batch: StepBatch | None = None  # start this step (step + 1)
    step_done: bool = False  # the running step ended: take its result, push, then `end_step`
    bookkeeping: bool = False  # the turn looked at admission and the step (the caller's periodic work rides on it)
    recheck: bool = False
    """The bookkeeping moved tokens out of the buffer (a batch, or stale tokens dropped by a cut):
    the next one may admit more though nothing arrives (the twin, which turns on events, asks for it)."""


class Driver:
    cfg: Config
    # the run's memory: groups from admission to the buffer, and the prompt supply
    ledger: GroupLedger
    stages: StageRunner
    # the per-sample path: samples to the reward pool, rewards to the ledger or the evaluator
    rewards: RewardPool
    intake: SampleIntake
    route: ResultRouter
    evaluator: Evaluator
    # what a step's row reports
    stats: StepStats
    # whether the learner waits for stragglers or admission pauses for them (buffer.stale_policy)
    gate: StaleGate

    def __init__(self, cfg: Config, ledger: GroupLedger, stages: StageRunner, rewards: RewardPool,
                 intake: SampleIntake, route: ResultRouter, evaluator: Evaluator, stats: StepStats,
                 gate: StaleGate) -> None:
        self.cfg, self.ledger, self.stages, self.rewards = cfg, ledger, stages, rewards
        self.intake, self.route, self.evaluator, self.stats, self.gate = intake, route, evaluator, stats, gate
        self._next_bookkeeping = 0.0

    # -- the loop turn ------------------------------------------------------------------------

    @property
    def next_bookkeeping_at(self) -> float:
        """When the next turn looks at admission and the step (the twin schedules a turn then)."""
        return self._next_bookkeeping

    def turn(self, now: float, arrivals: list[Sample], learner: LearnerView) -> Actions:
        """One turn of the loop (the module's docstring): `arrivals` ingested and rewards routed
        every turn; admission and the step looked at every BOOKKEEPING_S, each costs tens of
        microseconds and the loop turns every few samples under load."""
        self.intake.ingest(arrivals)
        self.intake.poll_rewards(learner.step)
        if now < self._next_bookkeeping:
            return Actions()
        self._next_bookkeeping = now + BOOKKEEPING_S
        state, stopping, buffered = learner.step_state(), learner.stopping, self.buffered_tokens()
        grants = [] if stopping else self.admit(learner.version, learner.actor_ids,
                                                step_running=state is not StepState.IDLE)
        batch = self.next_batch(learner.version) if state is StepState.IDLE and not stopping else None
        return Actions(grants, batch, step_done=state is StepState.DONE, bookkeeping=True,
                       recheck=self.buffered_tokens() != buffered)

    # -- samples and rewards ------------------------------------------------------------------

    def ingest(self, samples: list[Sample]) -> None:
        """Samples as they arrive: recorded by the ledger, then off to the reward pool."""
        self.intake.ingest(samples)

    def poll_rewards(self, step: int, timeout_s: float = 0.0) -> list[RewardResult]:
        """Rewards as they come back, routed (ledger, statistics, stages, evaluator)."""
        return self.intake.poll_rewards(step, timeout_s)

    def wait_ready(self) -> None:
        """Until the reward pool's workers have started (a benchmark's measure starts after)."""
        self.rewards.wait_ready()

    def close(self) -> None:
        """The reward pool's workers and the detokenizing threads."""
        self.intake.close()
        self.rewards.close()

    @property
    def probe_ids(self) -> list[int] | None:
        """The first sample seen (prompt and response): real text for this model's parity probe."""
        return self.intake.probe_ids

    def progress(self) -> Progress:
        groups, pool = self.ledger.assembler.stats, self.rewards
        return Progress(groups.groups_complete, groups.groups_zero_variance, self.ledger.token_accounting()["buffered"],
                        self.stages.current.token_budget, len(self.ledger.records), pool.num_pending,
                        pool.stats.completed, pool.stats.timeouts, pool.stats.outcomes.most_common(6),
                        self.stages.source.answers_missing())

    def requeue_actor(self, actor: int) -> int:
        """A lost or removed actor's groups go back to be generated elsewhere; how many."""
        return self.ledger.requeue_actor(actor)

    # -- admission ----------------------------------------------------------------------------

    def capacity(self, version: int, step_running: bool) -> int:
        """How many more prompts may be admitted now (the staleness bound, buffer/admission.py);
        none while `pace` waits for an at-risk group to finish generating."""
        if self.gate.pauses_admission(self.ledger.generating_versions.oldest, version):
            return 0
        stage = self.stages.current
        return self.ledger.capacity(version, stage.token_budget, stage.group_size, stage.max_tokens,
                                    step_running=step_running, verifiers_behind=self.rewards.num_queued > 0)

    def admit(self, version: int, actor_ids: list[int], step_running: bool) -> list[Grant]:
        """The prompts to hand out now (requeued groups first), to the least-loaded actors, by
        prompts or, with rollout.max_in_flight_requests, by samples still generating."""
        capacity = self.capacity(version, step_running)
        if capacity == 0:
            return []
        stage, ro = self.stages.current, self.cfg.rollout
        if ro.max_in_flight_requests is None:
            load, cap, per_prompt = self.ledger.generating_by_actor(actor_ids), ro.max_in_flight_prompts, 1
        else:  # a group's finished samples free their slots
            load, cap, per_prompt = (self.ledger.requests_by_actor(actor_ids), ro.max_in_flight_requests,
                                     stage.group_size)
        spec = SamplingSpec(stage.temperature, ro.top_p, stage.max_tokens)
        grants = []
        for actor, k in assign_prompts(capacity, load, cap, per_prompt).items():
            records = [self.ledger.readmit(r, actor, version=version) for r in self.ledger.take_requeued(k)]
            records += [self.ledger.admit(p, stage.index, spec, stage.group_size, actor, version=version)
                        for p in self.stages.take(k - len(records))]
            grants += [Grant(actor, spec_, n, prompts) for spec_, n, prompts in group_by_settings(records)]
        return grants

    # -- steps --------------------------------------------------------------------------------

    def next_batch(self, version: int) -> StepBatch | None:
        """The next step's data for learner `version` (counted in the step's staleness), or None
        until the buffer can fill one, or while `wait` holds the step for groups in flight."""
        if self.gate.holds_step(self.ledger.in_flight_versions.oldest, version):
            return None
        batch = self.ledger.next_batch(version)
        if batch is not None:
            self.stats.add_batch(batch.chunks, version, batch.start_version)
        return batch

    def end_step(self, step: int, learner_metrics: dict[str, Any],
                 frames_dropped: int) -> tuple[dict[str, Any], StageChange | None]:
        """After optimizer step `step` and its push: the pipeline's part of its row (what the
        statistics accumulated since the last row, the stage, the reward pool, the intake, the
        ledger, reward errors and evaluation), and the new stage if the step ended one (its Phi
        applies from the next batch on). The learner's ratio moments per staleness bucket go to
        the buffer (exponentially averaged), for the ESS of the batches it cuts next."""
        self.ledger.observe_ratio_moments(ratio_moments(learner_metrics))
        row = {**self.stats.flush({**self.ledger.token_metrics(), "rollout/frames_dropped_total": frames_dropped}),
               **self.stages.metrics(), **self.rewards.metrics(), **self.intake.metrics(), **self.ledger.metrics(),
               **self.route.errors.metrics(), **(self.route.env_errors.metrics() if self.route.env_errors else {}),
               **self.evaluator.take_metrics(step), **self.gate.take_metrics()}
        change = self.stages.on_step(step, row["reward/mean"])
        if change is not None:
            self.ledger.set_token_budget(change.stage.token_budget)
        return row, change

    def take_examples(self) -> list[dict[str, Any]]:
        """The example completions kept since the last call (observe.samples_per_step)."""
        return self.stats.take_examples()

    def restart_clock(self) -> None:
        """The next row's rates count from now (not from the start-up before it)."""
        self.stats.restart_clock()

    # -- evaluation ---------------------------------------------------------------------------

    def start_eval(self, version: int, engines: Any) -> None:
        """The held-out evaluation of `version` if one is due (at the start), on `engines`."""
        self.evaluator.maybe_start(version, engines, self.stages.current)

    def eval_after_push(self, version: int, engines: Any, last: bool, poll: Any) -> None:
        """The engines now hold `version`: its evaluation, if due (`last`: the run's final one)."""
        self.evaluator.after_push(version, engines, self.stages.current, last=last, poll=poll)

    # -- what callers may read ----------------------------------------------------------------

    def in_flight(self) -> int:
        """Groups admitted and not yet kept, rejected or requeued."""
        return len(self.ledger.records)

    def requeued(self) -> int:
        """Groups waiting to be generated again (a lost actor's, or in flight at a checkpoint)."""
        return len(self.ledger.requeued)

    def buffered_tokens(self) -> int:
        return self.ledger.buffer.num_loss_tokens

    def accounting(self) -> dict[str, dict[str, int]]:
        """Where every sample and every loss token went: the ledger's two balance sheets."""
        return {"samples": self.ledger.accounting(), "tokens": self.ledger.token_accounting()}

    def reward_stats(self) -> Any:
        """The reward pool's running totals (submitted, completed, timeouts, crashes)."""
        return self.rewards.stats

    def buffer_stats(self) -> Any:
        """The buffer's running totals (tokens in, dropped stale, the length bias)."""
        return self.ledger.buffer.stats

    def group_stats(self) -> Any:
        """The assembler's group counts (complete, dropped with zero variance)."""
        return self.ledger.assembler.stats

    # -- checkpoints --------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"probe_ids": self.probe_ids, "ledger": self.ledger.state_dict(),
                "stages": self.stages.state_dict(), "stats": self.stats.state_dict(), "gate": self.gate.state_dict()}

    def load_state_dict(self, state: dict[str, Any], *, renew_requeued: bool = False) -> None:
        """`renew_requeued`: a learner restart's rewind in a running process, whose actors may
        still send samples of the attempts in flight then (they arrive orphaned)."""
        self.intake.restore_probe(state["probe_ids"])
        self.ledger.load_state_dict(state["ledger"])
        self.stages.load_state_dict(state["stages"])
        self.ledger.set_token_budget(self.stages.current.token_budget)
        self.stats.load_state_dict(state["stats"])
        self.gate.load_state_dict(state.get("gate", {"num_holds": 0}))  # none in a checkpoint older than it
        if renew_requeued:
            self.ledger.renew_requeued()


def build_buffer(cfg: BufferConfig, token_budget: int, seed: int) -> Buffer:
    """Streaming Phi-token buffer, or the D_R / D_T / N_reuse rollout-batch schedule."""
    if cfg.rollout_batch_prompts is None:
        return TokenBuffer(token_budget, cfg.max_staleness, cfg.cut, cfg.stale_policy, cfg.ess_min, cfg.ess_max_lag)
    return RolloutBatchBuffer(token_budget, cfg.max_staleness, cfg.rollout_batch_prompts,
                              cfg.minibatch_prompts, cfg.num_reuse, seed=seed)


def build_ledger(cfg: Config, stage: ResolvedStage) -> GroupLedger:
    """The group ledger with the buffer, assembler and shaping of the run's config and first stage."""
    a = cfg.algo
    return GroupLedger(
        build_buffer(cfg.buffer, stage.token_budget, cfg.seed),
        GroupAssembler(a.advantage, a.advantage_eps, a.drop_zero_variance_groups, a.truncation_mask, a.advantage_std,
                       distill=a.distill.reward if a.distill.enabled else None),
        Shaping(a.no_eos_penalty, a.overlong_buffer, a.overlong_penalty_factor), cfg.reward.num_workers)


def build_driver(cfg: Config, model_path: str, metrics: EventLog, say: Say = print,
                 rewards: RewardPool | None = None, virtual_clock: bool = False,
                 teacher: Teacher | None = None) -> Driver:
    """The driver of a run of `cfg` on the model at `model_path` (its tokenizer and data);
    `metrics` receives the run's events (reward errors, evaluations). `rewards`: a pool to use
    instead of the config's; `virtual_clock`: each turn waits for the texts its samples are
    decoded into off the thread (both the twin's, whose clock stands still meanwhile); `teacher`:
    what scores every training sample first, with algo.distill (the driver closes it)."""
    if cfg.algo.distill.enabled and teacher is None:
        raise ValueError("algo.distill is on: build_driver needs the teacher that scores the samples")
    stages = StageRunner(cfg, model_path)
    rewards = rewards or build_reward_pool(cfg.reward, stages.data_sources)
    ledger = build_ledger(cfg, stages.current)
    stats = StepStats(cfg.observe.samples_per_step)
    evaluator = Evaluator.build(cfg, stages.tokenizer, metrics, say)
    route = ResultRouter(ledger, stats, stages, evaluator, stages.tokenizer,
                         RewardErrorMonitor(cfg.reward.max_error_frac), metrics, say,
                         env_errors=env_error_monitor(cfg.env.max_error_frac) if cfg.env.type else None)
    intake = SampleIntake(ledger, rewards, stages.tokenizer, route, evaluator, wait_decodes=virtual_clock,
                          teacher=teacher)
    return Driver(cfg, ledger, stages, rewards, intake, route, evaluator, stats,
                  StaleGate(cfg.buffer.stale_policy, cfg.buffer.max_staleness))
