"""LocalRewards: a rollout actor scores its own samples before it sends them (reward.placement:
actor), so verifier capacity grows with the actors and the driver only ingests.

    engine ─Sample─► submit: detokenize ─► RewardPool (beside the engine) ─► deliver ─► emit (zmq)

With one reward pool on the driver, every sample of every actor crosses the driver's one Python
thread twice more (to a worker and back) and the pool's num_workers are shared by all actors: a
verifier that costs milliseconds (math-verify, code tests) caps the whole run at what those
workers score, however many actors are added. Here each actor has its own pool (the same
RewardPool, hard timeouts and crash replacement included), and a sample leaves the actor with its
reward, the verifier's info and the call's latency (`Sample.reward`); the driver's intake routes
it straight to the ledger. Evaluation samples come back to the driver by Ray call and are scored
there.

`deliver` runs on the actor's event loop for the actor's life; the pool's wait runs in a thread
so the loop keeps generating. Samples are sent from the loop thread only, as without it (a zmq
socket is not thread-safe).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from asyncrl.reward.decode import batch_decoder
from asyncrl.reward.episode_reward import verifier_metadata
from asyncrl.reward.pool import RewardPool
from asyncrl.types import Locate, Sample

POLL_S = 0.1  # the longest one wait for results blocks its thread (bounds shutdown's wait too)


class LocalRewards:
    def __init__(self, pool: RewardPool, tokenizer: Any, emit: Callable[[Sample], None]):
        self.pool, self.emit = pool, emit
        self.decode = batch_decoder(tokenizer)

    @classmethod
    def build(cls, cfg, tokenizer_path: str, emit: Callable[[Sample], None],
              locate: Locate | None = None) -> LocalRewards:
        """In the actor's process: the run's verifiers in a pool of reward.num_workers, and the
        model's tokenizer for the response texts (`locate`: where the model's files are on this
        node, engine.Locate)."""
        from transformers import AutoTokenizer

        if locate is not None:
            tokenizer_path = locate(tokenizer_path)

        from asyncrl.reward.registry import reward_pool

        return cls(reward_pool(cfg), AutoTokenizer.from_pretrained(tokenizer_path), emit)

    def submit(self, sample: Sample) -> None:
        """A finished sample, to be scored and then sent."""
        self.pool.submit(sample, self.decode([sample.response_ids])[0],
                         verifier_metadata(sample.metadata, sample.episode))

    async def deliver(self) -> None:
        """Send each sample as its reward comes back, until cancelled. Raises what stopped the
        pool (e.g. a verifier that cannot be built)."""
        while True:
            for r in await asyncio.to_thread(self.pool.poll, POLL_S):
                sample = r.key
                sample.reward, sample.reward_info, sample.reward_latency_s = r.reward, r.info, r.latency_s
                self.emit(sample)

    @property
    def num_pending(self) -> int:
        """Samples being scored or not yet sent."""
        return self.pool.num_pending

    def close(self) -> None:
        self.pool.close()
