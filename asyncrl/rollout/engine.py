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
    versions: list[int | None] | None = None
    """The weight version that sampled each token as the engine labels it (a request kept across a
    load, `pause`, changes version mid-request); None where it has no label (before the first load):
    the version the request started with."""
    routed_experts: Any = None
    """With routing recorded (algo.moe_routing: replay): uint8 numpy [positions, MoE layers, top-k],
    the experts each position of prompt + completion was routed to (rollout/routes.py)."""


class EngineFailed(RuntimeError):
    """A rollout actor's engine failed a request: the actor cannot generate any more (its calls
    raise this from then on) and the pool replaces it."""


class InferenceEngine(Protocol):
    max_num_seqs: int
    """Requests it runs at once (more wait in its queue): the actor's occupancy is over this."""

    async def start(self) -> None: ...

    async def generate(self, prompt_ids: list[int], spec: SamplingSpec, request_id: str) -> Completion: ...

    async def abort(self, request_ids: list[str]) -> None:
        """End these requests now: each one's `generate` returns what it has generated so far
        with finish_reason "abort". Unknown or finished ids are ignored."""
        ...

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """log p(token_i | tokens_<i) for i >= 1 under the engine's current weights (T = 1)."""
        ...

    async def pause(self) -> None:
        """Stop stepping after the running step, every request kept in place with its KV cache
        (sync.keep_kv); a load may follow, then `resume`. Tokens sampled after the load carry its
        version in their Completion's `versions`."""
        ...

    async def resume(self) -> None: ...

    async def init_weight_sync(self, host: str, port: int, rank: int, world_size: int,
                               timeout_s: float, join_timeout_s: float | None = None) -> None:
        """Join the learner's weight-sync group as `rank`, within join_timeout_s (default
        timeout_s); each later push fails past timeout_s."""
        ...

    async def load_weights(self, metadata: dict[str, Any], version: int) -> dict[str, float]:
        """Receive one push (the learner broadcasts concurrently) and apply it in place: with no
        request running, or all of them paused."""
        ...

    async def shutdown(self) -> None: ...
