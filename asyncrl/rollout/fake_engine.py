"""A deterministic stand-in engine for tests of scheduling, streaming and staleness logic.

It "generates" seeded pseudo-random tokens with uniform logprobs after a short async sleep, so
requests overlap and finish out of order like a real engine's. Weight loads just record the
version; no process group is joined.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from asyncrl.rollout.engine import Completion, SamplingSpec


class FakeEngine:
    def __init__(self, vocab_size: int = 16, eos_id: int = 0, delay_s: float = 0.001):
        self.vocab_size = vocab_size
        self.eos_id = eos_id
        self.delay_s = delay_s
        self.loaded_versions: list[int] = []

    async def start(self) -> None:
        pass

    async def generate(self, prompt_ids: list[int], spec: SamplingSpec, request_id: str) -> Completion:
        rng = random.Random(f"{spec.seed}/{request_id}")
        tokens: list[int] = []
        while len(tokens) < spec.max_tokens:
            await asyncio.sleep(self.delay_s * rng.random())
            tokens.append(rng.randrange(self.vocab_size))
            if tokens[-1] == self.eos_id:
                break
        reason = "stop" if tokens[-1] == self.eos_id else "length"
        return Completion(tokens, [-math.log(self.vocab_size)] * len(tokens), reason)

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        return [-math.log(self.vocab_size)] * (len(token_ids) - 1)

    async def init_weight_sync(self, host: str, port: int, rank: int, world_size: int,
                               timeout_s: float) -> None:
        pass

    async def load_weights(self, metadata: dict[str, Any], version: int) -> dict[str, float]:
        self.loaded_versions.append(version)
        return {"sync/load_s": 0.0}

    async def shutdown(self) -> None:
        pass
