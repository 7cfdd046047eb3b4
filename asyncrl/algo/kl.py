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

k3's gradient with respect to log pi_theta is 1 - exp(d_t): about -2,980 a token at d_t = 8, so a
few tokens the reference finds very unlikely can dominate the step. `grad_cap` C bounds each
token's gradient to [-C, C] and leaves the value unchanged (the surrogate
sg(k_t) + clip(g_t, -C, C) * (log pi_theta - sg(log pi_theta)), g_t the exact gradient), as verl's
value cap on low_var_kl is meant to, without zeroing the gradient of the tokens it pulls back.
k2 (gradient -d_t, linear) is the other remedy.

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
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3", grad_cap: float | None = None
) -> torch.Tensor:
    """logprobs, ref_logprobs [T] (of the sampled tokens) -> per-token KL estimate [T]; with
    `grad_cap` C, each token's gradient with respect to logprobs is clipped to [-C, C]."""
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} vs ref {tuple(ref_logprobs.shape)}")
    if grad_cap is not None and grad_cap <= 0:
        raise ValueError(f"grad_cap must be > 0, got {grad_cap}")
    log_ratio = ref_logprobs - logprobs
    if estimator == "k1":
        value, grad = -log_ratio, torch.ones_like(log_ratio)
    elif estimator == "k2":
        value, grad = 0.5 * log_ratio.square(), -log_ratio
    elif estimator == "k3":
        d = torch.clamp(log_ratio, -KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
        value, grad = torch.expm1(d) - d, -torch.expm1(d)
    else:
        raise ValueError(f"unknown KL estimator {estimator!r} (allowed: {', '.join(KL_ESTIMATORS)})")
    if grad_cap is None:
        return value
    grad = torch.clamp(grad.detach(), -grad_cap, grad_cap)
    return value.detach() + grad * (logprobs - logprobs.detach())


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
