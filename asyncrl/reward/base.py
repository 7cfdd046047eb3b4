"""The reward edge: a verifier maps (response text, prompt metadata) to (reward, info).

    sample ─► RewardPool (worker processes, hard timeout) ─► RewardRouter (by data_source) ─► verifier

Real verifiers: math_reward.MathReward, code_reward.CodeReward (in sandbox.run_sandboxed),
text_rewards.AnswerTagReward / MultipleChoiceReward, or a user function (registry.CustomReward);
test ones: fault_injection. `info["outcome"]` names what happened, for the metrics.
"""

from __future__ import annotations

from typing import Any, Protocol


class RewardFn(Protocol):
    def __call__(self, response: str, metadata: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        """(reward, info) for one response; must not raise on bad input (reward 0 instead)."""
        ...
