"""The driver's per-sample path: samples from the actors' zmq stream to the reward pool, rewards
back to the ledger (shaping, groups, advantages, the buffer) through the result router.

    FrameReceiver ─Sample─► ingest: ledger.on_generated, detokenize ─► RewardPool.submit_many
    RewardPool.poll ─RewardResult─► ResultRouter (scoring.py) ─► ledger.on_scored ─► buffer

A sample that arrives scored (reward.placement: actor: its actor ran the verifier beside the
engine, rollout/local_rewards.py) skips the pool: its reward goes to the router with the next poll.
With on-policy distillation (algo.distill) every training sample goes to the teacher first
(teacher.py) and takes the path above once the teacher has scored it, at a later poll.

The orchestrator's loop calls `ingest` with whatever the stream holds and `poll_rewards` once per
turn; tools/bench_orchestrator.py drives the same object to measure how many samples a second one
driver can take. Everything here runs on the driver's one Python thread (the pool's dispatcher
thread shares its interpreter lock), so it is written for per-sample cost: one pool call per
turn for every sample that arrived, not one per sample.

Except detokenizing, when there is much of it. The verifiers take text, and decoding long
responses is most of what the driver does when it scores: at 256 GPUs in the twin
(tools/twin_driver_scale.py, responses of ~6K tokens) 69% of its thread's time. The tokenizer's
Rust backend releases the interpreter lock while it decodes, so a turn whose new samples hold at
least OFF_THREAD_TOKENS response tokens is decoded on helper threads, and its samples go to the
pool, in arrival order, at a later turn once their texts are ready (`submit_decoded`). A turn of
short responses (the CPU demo's) decodes inline: the hop costs tens of microseconds, about what
a few hundred tokens take to decode (2K tokens: ~0.3 ms).
"""

from __future__ import annotations

from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from asyncrl.orchestrator.evaluation import Evaluator
from asyncrl.orchestrator.ledger import GroupLedger
from asyncrl.orchestrator.scoring import ResultRouter
from asyncrl.orchestrator.teacher import Teacher
from asyncrl.reward.decode import batch_decoder
from asyncrl.reward.episode_reward import verifier_metadata
from asyncrl.reward.pool import RewardPool, RewardResult
from asyncrl.types import Sample, as_list

OFF_THREAD_TOKENS = 2048
"""A turn's new samples with at least this many response tokens are detokenized off the driver's thread."""
DECODE_THREADS = 2


class SampleIntake:
    def __init__(self, ledger: GroupLedger, rewards: RewardPool, tokenizer: Any, route: ResultRouter,
                 evaluator: Evaluator, wait_decodes: bool = False, teacher: Teacher | None = None):
        self.ledger, self.rewards, self.tokenizer = ledger, rewards, tokenizer
        self.teacher = teacher  # algo.distill: training samples are scored by the teacher first
        # the twin's: its clock does not run while a helper thread decodes, so each poll waits for them
        self.wait_decodes = wait_decodes
        self.route, self.evaluator = route, evaluator
        self.decode = batch_decoder(tokenizer)
        self.probe_ids: list[int] | None = None  # the first sample seen: real text for this model
        self._scored: list[RewardResult] = []  # arrived with their rewards, routed at the next poll
        self._decoding: deque[tuple[list[Sample], Future]] = deque()  # oldest first
        self._decoder: ThreadPoolExecutor | None = None  # started the first time a turn needs it
        self.actor_outcomes: Counter = Counter()  # of those, by outcome (the actors' pools' timeouts, crashes)

    def ingest(self, samples: list[Sample]) -> None:
        """Samples as they arrive: recorded by the ledger, then off to the reward pool (unless
        their actor scored them), or to the teacher first."""
        arrived = []
        for s in samples:
            if self.probe_ids is None and s.response_ids:
                self.probe_ids = [*s.prompt_ids, *s.response_ids]  # a list: it goes to engines and checkpoints
            if self.ledger.on_generated(s) is not None:
                arrived.append(s)
        if self.teacher is not None:
            self.teacher.submit(arrived)
            arrived = []
        self._to_rewards(arrived)

    def _to_rewards(self, samples: list[Sample]) -> None:
        wanted = []
        for s in samples:
            if s.reward is None:
                wanted.append(s)
            else:
                self._scored.append(RewardResult(s, s.reward, s.reward_info, s.reward_latency_s))
                self.actor_outcomes[s.reward_info.get("outcome")] += 1
        if wanted:
            ids = [as_list(s.response_ids) for s in wanted]
            if sum(map(len, ids)) < OFF_THREAD_TOKENS and not self._decoding:
                self._submit(wanted, self.decode(ids))
            else:  # behind any decode still running, so the pool gets samples in arrival order
                if self._decoder is None:
                    self._decoder = ThreadPoolExecutor(DECODE_THREADS, thread_name_prefix="asyncrl-detokenize")
                self._decoding.append((wanted, self._decoder.submit(self.decode, ids)))
        self.submit_decoded()

    def submit_decoded(self, wait: bool = False) -> None:
        """Samples whose texts are ready go to the reward pool, oldest first (`wait`: all of them,
        once decoded: the twin, whose clock does not run while a helper thread works)."""
        while self._decoding and (wait or self._decoding[0][1].done()):
            wanted, texts = self._decoding.popleft()
            self._submit(wanted, texts.result())

    def _submit(self, samples: list[Sample], texts: list[str]) -> None:
        self.rewards.submit_many([(s, text, verifier_metadata(s.metadata, s.episode))
                                  for s, text in zip(samples, texts)])

    def restore_probe(self, probe_ids: list[int] | None) -> None:
        """A checkpoint's probe (the first sample of the run it continues)."""
        self.probe_ids = probe_ids

    def close(self) -> None:
        if self.teacher is not None:
            self.teacher.close()
        if self._decoder is not None:
            self._decoder.shutdown(wait=False, cancel_futures=True)

    def poll_rewards(self, step: int, timeout_s: float = 0.0) -> list[RewardResult]:
        """Rewards as they come back, routed; eval samples handed to the pool. Returns them."""
        if self.teacher is not None:
            self._to_rewards(self.teacher.poll())
        self.submit_decoded(self.wait_decodes)
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
                "reward/actor_pool_crashes_total": self.actor_outcomes["worker_crash"],
                **(self.teacher.take_metrics() if self.teacher is not None else {})}

