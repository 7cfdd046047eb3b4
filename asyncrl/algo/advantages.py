"""Group-relative advantages (pure, plain floats in and out).

GRPO (DeepSeekMath): A_i = (r_i - mean(r)) / (std(r) + eps), std the population std over the
group. Dr. GRPO drops the std. Every token of a response shares its response's advantage.
A group whose rewards are all equal has no learning signal under either estimator; DAPO's dynamic
sampling and Skywork-OR1 section 3.1 drop such groups rather than train on zeros.
"""

from __future__ import annotations

import math


def group_advantages(rewards: list[float], kind: str = "grpo", eps: float = 1e-6) -> list[float]:
    if not rewards:
        raise ValueError("a group needs at least one reward")
    n = len(rewards)
    mean = sum(rewards) / n
    centered = [r - mean for r in rewards]
    if kind == "drgrpo":
        return centered
    if kind == "grpo":
        std = math.sqrt(sum(c * c for c in centered) / n)
        return [c / (std + eps) for c in centered]
    raise ValueError(f"unknown advantage estimator {kind!r} (allowed: grpo, drgrpo)")


def is_zero_variance(rewards: list[float], tol: float = 1e-12) -> bool:
    """True when every reward in the group is the same (single-sample groups included)."""
    return max(rewards) - min(rewards) <= tol
