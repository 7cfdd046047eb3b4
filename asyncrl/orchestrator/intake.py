"""The driver's per-sample path: samples from the actors' zmq stream to the reward pool, rewards
back to the ledger (shaping, groups, advantages, the buffer) through the result router.

    FrameReceiver ─Sample─► ingest: ledger.on_generated, detokenize ─► RewardPool.submit_many
    RewardPool.poll ─RewardResult─► ResultRouter (scoring.py) ─► ledger.on_scored ─► buffer

A sample that arrives scored (reward.placement: actor: its actor ran the verifier beside the
engine, rollout/local_rewards.py) skips the pool: its reward goes to the router with the next poll.

The orchestrator's loop calls `ingest` with whatever the stream holds and `poll_rewards` once per
turn; tools/bench_orchestrator.py drives the same object to measure how many samples a second one
driver can take. Everything here runs on the driver's one Python thread (the pool's dispatcher
thread shares its interpreter lock), so it is written for per-sample cost: one pool call per
turn for every sample that arrived, not one per sample.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from asyncrl.orchestrator.evaluation import Evaluator
from asyncrl.orchestrator.ledger import GroupLedger
from asyncrl.orchestrator.scoring import ResultRouter
from asyncrl.reward.decode import batch_decoder
from asyncrl.reward.pool import RewardPool, RewardResult
from asyncrl.types import Sample


class SampleIntake:
    def __init__(self, ledger: GroupLedger, rewards: RewardPool, tokenizer: Any, route: ResultRouter,
                 evaluator: Evaluator):
        self.ledger, self.rewards, self.tokenizer = ledger, rewards, tokenizer
        self.route, self.evaluator = route, evaluator
        self.decode = batch_decoder(tokenizer)
        self.probe_ids: list[int] | None = None  # the first sample seen: real text for this model
        self._scored: list[RewardResult] = []  # arrived with their rewards, routed at the next poll
        self.actor_outcomes: Counter = Counter()  # of those, by outcome (the actors' pools' timeouts, crashes)

    def ingest(self, samples: list[Sample]) -> None:
        """Samples as they arrive: recorded by the ledger, then off to the reward pool (unless
        their actor scored them)."""
        wanted = []
        for s in samples:
            if self.probe_ids is None and s.response_ids:
                self.probe_ids = [*s.prompt_ids, *s.response_ids]  # a list: it goes to engines and checkpoints
            if self.ledger.on_generated(s) is None:
                continue
            if s.reward is None:
                wanted.append(s)
            else:
                self._scored.append(RewardResult(s, s.reward, s.reward_info, s.reward_latency_s))
                self.actor_outcomes[s.reward_info.get("outcome")] += 1
        if wanted:
            texts = self.decode([s.response_ids for s in wanted])
            self.rewards.submit_many([(s, text, s.metadata) for s, text in zip(wanted, texts)])

    def poll_rewards(self, step: int, timeout_s: float = 0.0) -> list[RewardResult]:
        """Rewards as they come back, routed; eval samples handed to the pool. Returns them."""
        self.evaluator.poll(self.rewards, self.tokenizer, step)
        results, self._scored = self._scored, []
        results += self.rewards.poll(0.0 if results else timeout_s)
        self.route(results, step)
        return results

    def metrics(self) -> dict[str, float]:
        """Samples that arrived scored by their actors, and the actors' pools' failures among them
        (their outcomes): the driver's pool reports its own in `reward/pool_*`."""
        return {"reward/actor_scored_total": self.actor_outcomes.total(),
                "reward/actor_pool_timeouts_total": self.actor_outcomes["timeout"],
                "reward/actor_pool_crashes_total": self.actor_outcomes["worker_crash"]}

