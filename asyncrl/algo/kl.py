"""Per-token KL estimators against a reference policy, and the reference-reset decision.

With log-ratio d_t = log pi_ref(a_t) - log pi_theta(a_t), a_t ~ pi_theta (Schulman, "Approximating
KL divergence", 2020):

    k1 = -d_t                    unbiased for KL(pi_theta || pi_ref), can be negative
    k2 = d_t^2 / 2               biased, low variance, >= 0
    k3 = exp(d_t) - d_t - 1      unbiased, >= 0 (Skywork-OR1 D_ij^t in eq. 2.4; ProRL eq. 5)

k3 clamps d_t to [-20, 20] first (`KL_LOG_RATIO_CLAMP`, the bound verl's low_var_kl uses):
exp(d_t) overflows float32 for d_t above ~88, which would make the loss inf and every gradient
NaN. A clamped token keeps a finite value (e^20 - 21 at most) and gets no KL gradient; inside
the bound nothing changes. verl also clamps the resulting k3 to [-10, 10]; asyncrl does not,
because that zeroes the KL gradient of every token with d_t above ~2.5, exactly the tokens the
penalty is meant to pull back.

The loss adds beta * agg(k_t) (beta 0 in Skywork-OR1, 1e-4 in ProRL, 1e-3 in Ring-lite).
Reference reset (ProRL section 3.3.1): pi_ref <- pi_theta and the optimizer state is reset,
periodically, when the KL spikes, or by hand; ProRL decides by watching validation metrics, which
asyncrl replaces by the explicit triggers of `should_reset_reference`.

Deviation: the tokens are sampled from the behaviour policy, not pi_theta, so off-policy the
estimators are those of the sampled tokens' KL, without importance correction.
"""

from __future__ import annotations

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
KL_LOG_RATIO_CLAMP = 20.0
"""|d_t| above this is clamped in k3 (verl's value), so exp(d_t) stays finite in float32."""


def token_kl(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3"
) -> torch.Tensor:
    """logprobs, ref_logprobs [T] (of the sampled tokens) -> per-token KL estimate [T]."""
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} vs ref {tuple(ref_logprobs.shape)}")
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        d = torch.clamp(log_ratio, -KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
        return torch.expm1(d) - d
    raise ValueError(f"unknown KL estimator {estimator!r} (allowed: {', '.join(KL_ESTIMATORS)})")


def should_reset_reference(
    step: int,
    kl: float,
    every_k: int | None = None,
    kl_threshold: float | None = None,
    requested: bool = False,
) -> tuple[bool, str]:
    """Whether to reset pi_ref after optimizer step `step` (1-based), and why.

    Triggers, checked in this order: "requested"; "kl_threshold" when kl > kl_threshold;
    "every_k" when step is a positive multiple of every_k. None disables a trigger. Returns
    (False, "") when none fires.
    """
    if every_k is not None and every_k <= 0:
        raise ValueError(f"every_k must be positive, got {every_k}")
    if requested:
        return True, "requested"
    if kl_threshold is not None and kl > kl_threshold:
        return True, "kl_threshold"
    if every_k is not None and step > 0 and step % every_k == 0:
        return True, "every_k"
    return False, ""
