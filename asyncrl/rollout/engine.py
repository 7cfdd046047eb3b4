"""The inference-engine edge: what a rollout actor needs from the engine it owns.

`VLLMEngine` (rollout/vllm_engine.py) is the real one; `FakeEngine` (rollout/fake_engine.py)
stands in for tests of scheduling logic. Everything outside those two files talks to this
protocol and never imports vllm.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass
class SamplingSpec:
    temperature: float
    top_p: float
    max_tokens: int
    seed: int | None = None
    stop: tuple[str, ...] = ()
    """Stop strings (an environment's tool-call end); the completion keeps the tokens that made one."""


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float]
    """Behaviour logprob of each generated token, after temperature (what the sampler used)."""
    finish_reason: str
    """stop | length | abort"""


class EngineFailed(RuntimeError):
    """A rollout actor's engine failed a request: the actor cannot generate any more (its calls
    raise this from then on) and the pool replaces it."""


class InferenceEngine(Protocol):
    async def start(self) -> None: ...

    async def generate(self, prompt_ids: list[int], spec: SamplingSpec, request_id: str) -> Completion: ...

    async def abort(self, request_ids: list[str]) -> None:
        """End these requests now: each one's `generate` returns what it has generated so far
        with finish_reason "abort". Unknown or finished ids are ignored."""
        ...

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token_i | tokens_<i) for i >= 1 under the engine's current weights (T = 1)."""
        ...

    async def init_weight_sync(self, host: str, port: int, rank: int, world_size: int,
                               timeout_s: float) -> None: ...

    async def load_weights(self, metadata: dict[str, Any], version: int) -> dict[str, float]:
        """Receive one push (the learner broadcasts concurrently) and apply it in place."""
        ...

    async def shutdown(self) -> None: ...
