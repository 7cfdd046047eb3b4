"""A deterministic stand-in engine for tests of scheduling, streaming and staleness logic.

It "generates" seeded pseudo-random tokens after a short async sleep, so requests overlap and
finish out of order like a real engine's. Each token's logprob is uniform, shifted by 0.001 nats
per loaded weight version (`logprob_at`), so tests can tell which weights sampled a token. Weight
loads just record the version; no process group is joined. `pause` holds every request before its
next token, as vLLM's pause mode "keep" does, and a completion then reports each token's version.
"""

from __future__ import annotations

import asyncio
import math
import random
from typing import Any

from asyncrl.rollout.engine import Completion, SamplingSpec


class FakeEngine:
    def __init__(self, vocab_size: int = 16, eos_id: int = 0, delay_s: float = 0.001, max_num_seqs: int = 256):
        self.vocab_size, self.max_num_seqs = vocab_size, max_num_seqs
        self.eos_id = eos_id
        self.delay_s = delay_s
        self.loaded_versions: list[int] = []
        self._running: set[str] = set()
        self._aborted: set[str] = set()
        self._go = asyncio.Event()
        self._go.set()  # cleared while paused

    def logprob_at(self, version: int) -> float:
        return -math.log(self.vocab_size) - 0.001 * version

    async def start(self) -> None:
        pass

    async def generate(self, prompt_ids: list[int], spec: SamplingSpec, request_id: str) -> Completion:
        rng = random.Random(f"{spec.seed}/{request_id}")
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        self._running.add(request_id)
        try:
            while len(tokens) < spec.max_tokens:
                await asyncio.sleep(self.delay_s * rng.random())
                await self._go.wait()
                if request_id in self._aborted:
                    return Completion(tokens, logprobs, "abort", versions)
                version = self.loaded_versions[-1] if self.loaded_versions else 0
                tokens.append(rng.randrange(self.vocab_size))
                logprobs.append(self.logprob_at(version))
                versions.append(version)
                if tokens[-1] == self.eos_id:
                    break
        finally:
            self._running.discard(request_id)
            self._aborted.discard(request_id)
        reason = "stop" if tokens[-1] == self.eos_id else "length"
        return Completion(tokens, logprobs, reason, versions)

    async def pause(self) -> None:
        self._go.clear()

    async def resume(self) -> None:
        self._go.set()

    async def abort(self, request_ids: list[str]) -> None:
        self._aborted.update(set(request_ids) & self._running)

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        return [-math.log(self.vocab_size)] * (len(token_ids) - 1)

    async def init_weight_sync(self, host: str, port: int, rank: int, world_size: int,
                               timeout_s: float, join_timeout_s: float | None = None) -> None:
        pass

    async def load_weights(self, metadata: dict[str, Any], version: int) -> dict[str, float]:
        if self._running and self._go.is_set():  # a real engine would serve them with a mix of two versions
            raise RuntimeError(f"weights loaded while {len(self._running)} requests run")
        self.loaded_versions.append(version)
        return {"sync/load_s": 0.0}

    async def shutdown(self) -> None:
        pass
