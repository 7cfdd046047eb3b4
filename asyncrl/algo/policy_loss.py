"""Token-level clipped policy loss with separate lower and upper clip bounds (pure torch).

    rho_t = exp(logp_t - old_logp_t)
    l_t   = -min(rho_t * A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) * A_t)

eps_high > eps_low is DAPO's clip-higher (ProRL: 0.2 / 0.4); eps_low == eps_high is GRPO/PPO's
symmetric clip. The entropy bonus and the aggregation that turns per-token terms into the step's
loss live beside it; `aggregate` divides by a *global* count given by the caller (Phi, or the
step's loss tokens over all ranks), so micro-batching and ranks never change the gradient.
"""

from __future__ import annotations

import torch


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss and per-token diagnostics.

    Shapes: all inputs [T] over the loss tokens; returns loss [T] and a dict of [T] tensors:
    ratio, clipped_low (ratio < 1 - eps_low with A < 0, gradient stopped), clipped_high
    (ratio > 1 + eps_high with A > 0, gradient stopped).
    """
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        clipped_low = (ratio < 1.0 - eps_low) & (advantages < 0)
        clipped_high = (ratio > 1.0 + eps_high) & (advantages > 0)
    return loss, {"ratio": ratio.detach(), "clipped_low": clipped_low, "clipped_high": clipped_high}


def aggregate(per_token: torch.Tensor, normalizer: int | float) -> torch.Tensor:
    """Sum of per-token terms [T] over a global count (budget: Phi; token_mean: step tokens)."""
    if normalizer <= 0:
        raise ValueError(f"normalizer must be positive, got {normalizer}")
    return per_token.sum() / normalizer


def step_normalizer(aggregation: str, token_budget: int, step_loss_tokens: int) -> int:
    """The denominator shared by every micro-batch and rank of one optimizer step."""
    if aggregation == "budget":
        return token_budget
    if aggregation == "token_mean":
        return step_loss_tokens
    raise ValueError(f"unknown aggregation {aggregation!r} (allowed: budget, token_mean)")
