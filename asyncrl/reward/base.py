"""The reward edge: a verifier maps (response text, prompt metadata) to a reward in [0, 1].

The orchestrator scores each sample as it arrives through `RewardFn`; the full reward system
(registry by data_source, worker pool with hard timeouts, code sandbox) plugs in behind the
same call.
"""

from __future__ import annotations

from typing import Any, Protocol


class RewardFn(Protocol):
    def __call__(self, response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        """(reward, info) for one response; must not raise on bad input (reward 0 instead)."""
        ...


def make_reward_fn(kind: str) -> RewardFn:
    if kind == "math_verify":
        from asyncrl.reward.math_reward import MathReward

        return MathReward()
    raise ValueError(f"unknown reward type {kind!r} (allowed: math_verify)")
