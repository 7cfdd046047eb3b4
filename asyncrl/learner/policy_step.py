"""One optimizer step's forward/backward over micro-batches, with every loss term from asyncrl.algo.

    loss = sum_t w_t * (l_t - alpha * H_t + beta * KL_t)  +  share * (c_lb * L_lb + c_z * L_z)

Every token's weight w_t comes from the step's global counts (`StepCounts`), a micro-batch's
MoE term is weighted by its share of the step's loss tokens, and gradients accumulate, so the
step's gradient equals the full-batch gradient however the batch was cut.

Decoupled PPO: pi_prox is the learner's policy at the start of the step. The step makes one
optimizer update after all its micro-batches, so while they run pi_theta still *is* pi_prox and
its logprobs equal this forward's values: they are taken as `logp.detach()`, exactly what a
separate no-grad pass would recompute, without the extra forward.

Returns the step's metrics, pooled over all its loss tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from asyncrl.algo.aggregation import StepCounts, token_weights, weighted_sum
from asyncrl.algo.kl import token_kl
from asyncrl.algo.moe import load_balance_loss, router_z_loss
from asyncrl.algo.policy_loss import clipped_policy_loss
from asyncrl.config import AlgoConfig
from asyncrl.learner.collate import MicroBatch
from asyncrl.learner.model_forward import TokenForward


class Tally:
    """Sums over loss tokens (and maxima), turned into means at the end."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {}
        self.maxima: dict[str, float] = {}
        self.minima: dict[str, float] = {}
        self.tokens = 0

    def add(self, key: str, values: torch.Tensor) -> None:
        values = values.detach().double()
        self.sums[key] = self.sums.get(key, 0.0) + float(values.sum())
        self.maxima[key] = max(self.maxima.get(key, -float("inf")), float(values.max()))
        self.minima[key] = min(self.minima.get(key, float("inf")), float(values.min()))

    def mean(self, key: str) -> float:
        return self.sums.get(key, 0.0) / max(self.tokens, 1)


def forward_backward(
    forward: Callable[[MicroBatch], TokenForward],
    micro_batches: list[MicroBatch],
    algo: AlgoConfig,
    counts: StepCounts,
    *,
    entropy_coef: float = 0.0,
    ref_logprobs: Callable[[MicroBatch], torch.Tensor] | None = None,
    moe_top_k: int = 0,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
    reduce: Callable[[Tally, dict[str, float]], None] | None = None,
) -> dict[str, float]:
    """Accumulate the step's gradients; `forward(mb)` gives the loss tokens' logprobs/entropies,
    `ref_logprobs(mb)` the reference policy's logprobs of the same tokens (no grad). `backward`
    is the training backend's; `reduce(tally, scalars)` combines the ranks' sums in place, so
    the metrics describe the whole step."""
    tally, scalars = Tally(), {"loss": 0.0, "pg": 0.0, "kl_term": 0.0, "lb": 0.0, "z": 0.0}
    for mb in micro_batches:
        if mb.num_loss_tokens == 0:
            continue
        out = forward(mb)
        logp, entropy = out.logprobs, out.entropy
        dev = logp.device
        old, adv = mb.old_logprobs.to(dev), mb.advantages.to(dev)
        pg, diag = clipped_policy_loss(
            logp, old, adv, algo.eps_low, algo.eps_high, dual_clip=algo.dual_clip,
            proximal_logprobs=logp.detach() if algo.decoupled else None, is_weight_cap=algo.is_weight_cap)
        weights = token_weights(algo.aggregation, mb.seq_loss_tokens.to(dev), counts, dtype=pg.dtype)
        pg_share = weighted_sum(pg, weights)
        loss = pg_share - entropy_coef * weighted_sum(entropy, weights)
        if ref_logprobs is not None:
            kl = token_kl(logp, ref_logprobs(mb).to(dev), algo.kl.estimator)
            kl_share = weighted_sum(kl, weights)
            if algo.kl.coef > 0:
                loss = loss + algo.kl.coef * kl_share
            scalars["kl_term"] += float(kl_share.detach())
            tally.add("kl", kl)
        if out.router_logits is not None and moe_top_k:
            share = mb.num_loss_tokens / max(counts.num_tokens, 1)
            lb = load_balance_loss(out.router_logits, moe_top_k, mb.attention_mask.to(dev))
            z = router_z_loss(out.router_logits, mb.attention_mask.to(dev))
            loss = loss + share * (algo.moe_aux_loss_coef * lb + algo.moe_z_loss_coef * z)
            scalars["lb"] += share * float(lb.detach())
            scalars["z"] += share * float(z.detach())
        backward(loss)
        scalars["loss"] += float(loss.detach())
        scalars["pg"] += float(pg_share.detach())
        tally.tokens += mb.num_loss_tokens
        tally.add("entropy", entropy)
        tally.add("behaviour_nll", -old)  # E[-log pi_b(a)] = H(pi_b): the actors' entropy, sampled
        tally.add("ratio", diag["ratio"])
        tally.add("abs_logp_diff", (logp - old).abs())
        for flag in ("clipped_low", "clipped_high", "clipped_dual", "is_weight_capped"):
            if flag in diag:
                tally.add(flag, diag[flag])
        if "is_weight" in diag:
            tally.add("is_weight", diag["is_weight"])
    if reduce is not None:
        reduce(tally, scalars)
    return _metrics(tally, scalars, ref_logprobs is not None, algo.decoupled, moe_top_k > 0)


def _metrics(t: Tally, s: dict[str, float], with_kl: bool, decoupled: bool, moe: bool) -> dict[str, float]:
    m = {
        "loss/total": s["loss"],
        "loss/policy": s["pg"],
        "entropy/learner": t.mean("entropy"),
        "entropy/behaviour_sampled": t.mean("behaviour_nll"),
        "ratio/mean": t.mean("ratio"),
        "ratio/max": t.maxima.get("ratio", 0.0),
        "ratio/min": t.minima.get("ratio", 0.0),
        "clip/low_frac": t.mean("clipped_low"),
        "clip/high_frac": t.mean("clipped_high"),
        "clip/dual_frac": t.mean("clipped_dual"),
        "loss/abs_logp_diff_behaviour": t.mean("abs_logp_diff"),
        "learner/loss_tokens": t.tokens,
    }
    if with_kl:
        m.update({"kl/mean": t.mean("kl"), "kl/max": t.maxima.get("kl", 0.0), "loss/kl": s["kl_term"]})
    if decoupled:
        m.update({"is_weight/mean": t.mean("is_weight"), "is_weight/max": t.maxima.get("is_weight", 0.0),
                  "is_weight/min": t.minima.get("is_weight", 0.0),
                  "is_weight/capped_frac": t.mean("is_weight_capped")})
    if moe:
        m.update({"loss/moe_load_balance": s["lb"], "loss/moe_z": s["z"]})
    return m
