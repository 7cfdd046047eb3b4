"""Mixture-of-experts auxiliary losses from router logits (pure torch), added as in Ring-lite eq. 5:

    L = L_policy + alpha_lb * L_lb + alpha_z * L_z

- Load balance (Switch Transformer, Fedus et al. 2022, eq. 4; the form Hugging Face's MoE models
  compute): L_lb = E * sum_{j,e} f_{j,e} * P_e, where f_{j,e} is the fraction of tokens whose j-th
  choice (of the top k) is expert e and P_e the mean router probability of e. Uniform routing
  gives L_lb = k.
- Router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): L_z = mean_t (logsumexp_e x_{t,e})^2.

Router logits of all layers are pooled, as Hugging Face does; padded positions are excluded.
Deviation: Ring-lite does not spell out its load-balance form; this is the standard one above.

Split invariance. Both losses are means over every routed (token, layer) pair of an optimizer
step, so a step cut into micro-batches (and ranks) must not compute them per micro-batch: a
micro-batch's own f and P give a different number (e.g. 1.108 for two halves of a step whose
whole value is 1.059). `router_sums` gives a micro-batch's sums; with N the step's routed pairs
and f the step's fractions (which carry no gradient, so they can come from a no-grad pass over
the whole step first), each micro-batch adds

    load_balance_share = E * sum_e (sum_j f_{j,e}) * (sum of its p_e) / N,   z_share = (its sum of lse^2) / N

and the shares add up to exactly the whole step's L_lb and L_z, values and gradients alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _pool(router_logits: tuple[torch.Tensor, ...] | list[torch.Tensor], token_mask: torch.Tensor | None):
    """Layers' [N, E] logits -> [N_kept * layers, E], dropping positions where token_mask is 0."""
    logits = torch.cat([x.to(torch.promote_types(x.dtype, torch.float32)) for x in router_logits], dim=0)
    if token_mask is None:
        return logits
    keep = token_mask.reshape(-1).bool().repeat(len(router_logits))
    return logits[keep]


@dataclass
class RouterSums:
    """One micro-batch's routing, summed over its routed (token, layer) pairs."""

    counts: torch.Tensor    # [k, E] pairs whose j-th choice is expert e (no gradient)
    prob_sum: torch.Tensor  # [E] sum of router probabilities (differentiable)
    lse_sq_sum: torch.Tensor  # [] sum of (logsumexp of the logits)^2 (differentiable)
    num: int                # routed pairs


def router_sums(router_logits, top_k: int, token_mask: torch.Tensor | None = None) -> RouterSums:
    """router_logits: per layer [N, E] (N = batch * length); token_mask [B, L] or [N]."""
    logits = _pool(router_logits, token_mask)
    num_experts = logits.shape[-1]
    probs = torch.softmax(logits, dim=-1)                       # [N, E]
    chosen = torch.topk(probs.detach(), top_k, dim=-1).indices  # [N, k]
    counts = torch.nn.functional.one_hot(chosen, num_experts).to(probs.dtype).sum(0)  # [k, E]
    return RouterSums(counts, probs.sum(0), torch.logsumexp(logits, dim=-1).square().sum(), int(logits.shape[0]))


def load_balance_from_sums(counts: torch.Tensor, prob_sum: torch.Tensor, num: int) -> torch.Tensor:
    """E * sum_{j,e} (counts / num) * (prob_sum / num): the load-balance loss of the pairs summed."""
    if num == 0:
        return prob_sum.new_zeros(())
    return prob_sum.shape[-1] * ((counts / num) * (prob_sum / num)).sum()


def load_balance_share(prob_sum: torch.Tensor, frac: torch.Tensor, num: int) -> torch.Tensor:
    """A micro-batch's part of the step's load-balance loss: `prob_sum` [E] its probability sums,
    `frac` [k, E] the whole step's f (no gradient), `num` the whole step's routed pairs."""
    return prob_sum.shape[-1] * (frac.sum(0).to(prob_sum.dtype) * prob_sum).sum() / max(num, 1)


def load_balance_loss(router_logits, top_k: int, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The whole batch's L_lb. router_logits: per layer [N, E]; token_mask [B, L] or [N]; -> scalar."""
    s = router_sums(router_logits, top_k, token_mask)
    return load_balance_from_sums(s.counts, s.prob_sum, s.num)


def router_z_loss(router_logits, token_mask: torch.Tensor | None = None) -> torch.Tensor:
    """router_logits: per layer [N, E]; token_mask [B, L] or [N]; -> scalar mean squared logsumexp."""
    logits = _pool(router_logits, token_mask)
    if logits.shape[0] == 0:
        return logits.new_zeros(())
    return torch.logsumexp(logits, dim=-1).square().mean()


# -- rollout routing replay (R3, arXiv 2510.11370) -----------------------------------------------

def replayed_routing(router_logits: torch.Tensor, own_indices: torch.Tensor, recorded: torch.Tensor,
                     norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A top-k router's output with the engine's choice of experts forced (R3, eq. 3-4).

    router_logits [N, E]; own_indices [N, k] the router's own top-k; recorded [N, k] the experts the
    engine routed each position to, -1 in every slot where it recorded none (that row keeps its own
    choice). Returns (weights [N, k], indices [N, k]): the indices the experts run, and their gate
    weights, the softmax probabilities at those indices (renormalized over the k when
    `norm_topk_prob`, as the router does), so the gradient reaches the router through the
    replayed experts' probabilities. With recorded == own_indices it is the router's own output.
    """
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32 if router_logits.dtype != torch.float64
                          else torch.float64)
    indices = torch.where((recorded >= 0).all(dim=-1, keepdim=True), recorded, own_indices)
    weights = probs.gather(-1, indices)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), indices


def same_experts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[N] whether rows of two [N, k] expert choices are the same set (top-k order aside)."""
    return (a.sort(dim=-1).values == b.sort(dim=-1).values).all(dim=-1)
