"""Token-level clipped policy loss with separate lower and upper clip bounds (pure torch).

    rho_t = exp(logp_t - old_logp_t)       (the log-ratio clamped to +-20 first, as verl does)
    l_t   = -min(rho_t * A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) * A_t)

eps_high > eps_low is DAPO's clip-higher (ProRL: 0.2 / 0.4); eps_low == eps_high is GRPO/PPO's
symmetric clip (Skywork-OR1 eq. 2.4, 3.1). Two optional extensions, both off by default:

- Decoupled PPO (AReaL, Fu et al. 2025): the ratio is taken against the proximal policy
  pi_prox (the learner's weights at the start of the rollout batch, recomputed by the learner
  and fixed over the batch's N_SGD steps, learner/proximal.py) instead of the behaviour policy
  pi_b, and the term is weighted by the truncated importance weight w_t = min(pi_prox / pi_b, C).
  AReaL drops tokens whose weight exceeds the cap; asyncrl truncates it at C instead (truncated
  importance sampling).
- Dual clip (Ye et al. 2020): for A_t < 0 the term is also capped at -c * A_t, c > 1, so a huge
  ratio on a negative-advantage token cannot blow up the loss.

The aggregation that turns per-token terms into the step's loss divides by *global* counts
(`token_weights` for all four modes, in aggregation.py and re-exported here), so micro-batching and ranks never change the gradient.
"""

from __future__ import annotations

import torch

from asyncrl.algo.aggregation import AGGREGATIONS, StepCounts, token_weights, weighted_sum

__all__ = ["AGGREGATIONS", "LOG_RATIO_CLAMP", "StepCounts", "clamp_log_ratio", "clipped_policy_loss", "token_weights",
           "weighted_sum"]

LOG_RATIO_CLAMP = 20.0
"""|log rho_t| above this is clamped before exp, here and in every loss and weight of
corrections.py (verl's value): e^20 is 4.9e8, finite in float32 and bfloat16, where an inf ratio
would make the step's gradient NaN."""


def clamp_log_ratio(log_ratio: torch.Tensor, bound: float = LOG_RATIO_CLAMP) -> torch.Tensor:
    """log_ratio clamped to [-bound, bound]; the gradient is 0 outside (verl's clamp)."""
    return torch.clamp(log_ratio, -bound, bound)


def clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    *,
    proximal_logprobs: torch.Tensor | None = None,
    is_weight_cap: float | None = None,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token loss and per-token diagnostics.

    Shapes: all inputs [T] over the loss tokens; `old_logprobs` are the behaviour logprobs.
    Returns loss [T] and a dict of [T] tensors: ratio, clipped_low (ratio < 1 - eps_low with
    A < 0, gradient stopped), clipped_high (ratio > 1 + eps_high with A > 0, gradient stopped);
    with `dual_clip`, clipped_dual (A < 0 and the -c * A cap is active); with
    `proximal_logprobs`, is_weight (w_t after truncation) and is_weight_capped (w_t hit C).
    A ratio exactly at a bound counts as not clipped and keeps its gradient.
    """
    if is_weight_cap is not None and proximal_logprobs is None:
        raise ValueError("is_weight_cap only applies in decoupled mode (pass proximal_logprobs)")
    if is_weight_cap is not None and is_weight_cap <= 0:
        raise ValueError(f"is_weight_cap must be > 0, got {is_weight_cap}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    anchor = old_logprobs if proximal_logprobs is None else proximal_logprobs
    ratio = torch.exp(clamp_log_ratio(logprobs - anchor))
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    with torch.no_grad():
        diag = {
            "ratio": ratio.detach(),
            "clipped_low": (ratio < 1.0 - eps_low) & (advantages < 0),
            "clipped_high": (ratio > 1.0 + eps_high) & (advantages > 0),
        }
    if dual_clip is not None:
        cap = -dual_clip * advantages
        dual = (advantages < 0) & (loss.detach() > cap)
        diag["clipped_dual"] = dual
        loss = torch.where(dual, cap.to(loss.dtype), loss)
    if proximal_logprobs is not None:
        with torch.no_grad():
            weight = torch.exp(clamp_log_ratio(proximal_logprobs - old_logprobs))
            if is_weight_cap is not None:
                diag["is_weight_capped"] = weight > is_weight_cap
                weight = torch.clamp(weight, max=is_weight_cap)
            else:
                diag["is_weight_capped"] = torch.zeros_like(weight, dtype=torch.bool)
            diag["is_weight"] = weight
        loss = loss * weight
    return loss, diag

