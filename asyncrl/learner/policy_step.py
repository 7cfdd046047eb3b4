"""One optimizer step's forward/backward over micro-batches, with every loss term from asyncrl.algo.

    loss = sum_t w_t * (l_t - alpha * H_t + beta * KL_t)  +  c_lb * L_lb + c_z * L_z

Every token's weight w_t comes from the step's global counts (`StepCounts`), and gradients
accumulate, so the step's gradient equals the full-batch gradient however the batch was cut.
The MoE losses are means over every routed token of the step (algo/moe.py): each micro-batch
adds its sums divided by the step's routed count, the load balance with the step's expert
fractions f (`MoeStep`, from a no-grad routing pass when its coefficient is > 0), so they too
equal the whole batch's, values and gradients, on any split into micro-batches and ranks.

Decoupled PPO: pi_prox is the learner's policy at the start of the step's rollout batch,
fixed across that batch's N_SGD steps (learner/proximal.py): `proximal(mb)` gives its logprobs.
Without it the step is its own batch: pi_prox is the policy at the start of the step, and since
the step makes its one optimizer update after all its micro-batches, pi_theta still *is*
pi_prox while they run, so this forward's logprobs, detached, are exactly what a separate
no-grad pass would recompute (ratio 1 in value).

The policy loss is algo.policy_loss (ppo: clip-higher with dual clip; is, cispo, gspo, m2po:
algo/corrections.py) against an anchor, pi_prox when decoupled, else pi_b; decoupled, each token
is also weighted by algo.behaviour_weight of pi_prox / pi_b (token_tis truncated at
is_weight_cap: AReaL's decoupled PPO; seq_tis; icepop).

Returns the step's metrics, pooled over all its loss tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.algo.aggregation import StepCounts, token_weights, weighted_sum
from asyncrl.algo.corrections import behaviour_weight, m2po_candidates, m2po_log_ratio, policy_terms
from asyncrl.algo.kl import token_kl
from asyncrl.algo.moe import load_balance_from_sums, load_balance_share, router_sums
from asyncrl.algo.token_decomposition import TokenTable, decompose
from asyncrl.config import AlgoConfig
from asyncrl.learner.collate import MicroBatch
from asyncrl.learner.model_forward import TokenForward
from asyncrl.learner.replay import ROUTE_COUNTS

ROUTE_KEYS = tuple(f"route_{name}" for name in ROUTE_COUNTS)  # routing replay's sums in the step's scalars


class Tally:
    """Sums over loss tokens (and maxima, minima), kept as float64 tensors on the step's device and
    read once a step (`read`): a float() per key per micro-batch was a host sync each on a GPU."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.maxima: dict[str, torch.Tensor] = {}
        self.minima: dict[str, torch.Tensor] = {}
        self.vectors: dict[str, torch.Tensor] = {}  # summed elementwise (float64, CPU)
        self.tables: list[torch.Tensor] = []  # TokenTable.to_matrix() per micro-batch (off-policy decomposition)
        self.tokens = 0

    def add(self, key: str, values: torch.Tensor) -> None:
        values = values.detach().to(torch.float64)
        total, high, low = values.sum(), values.max(), values.min()
        if key in self.sums:
            total, high, low = (self.sums[key] + total, torch.maximum(self.maxima[key], high),
                                torch.minimum(self.minima[key], low))
        self.sums[key], self.maxima[key], self.minima[key] = total, high, low

    def read(self) -> "TallyValues":
        """Every sum, maximum and minimum as floats, from one device-to-host copy."""
        keys = list(self.sums)
        flat = (torch.stack([self.sums[k] for k in keys] + [self.maxima[k] for k in keys]
                            + [self.minima[k] for k in keys]).tolist() if keys else [])
        n = len(keys)
        return TallyValues(dict(zip(keys, flat[:n])), dict(zip(keys, flat[n:2 * n])), dict(zip(keys, flat[2 * n:])),
                           self.tokens)

    def add_vector(self, key: str, values: torch.Tensor) -> None:
        values = values.detach().double().cpu()
        self.vectors[key] = self.vectors[key] + values if key in self.vectors else values


@dataclass
class TallyValues:
    """A Tally read out (Tally.read): plain floats, for the step's metrics."""

    sums: dict[str, float]
    maxima: dict[str, float]
    minima: dict[str, float]
    tokens: int

    def mean(self, key: str) -> float:
        return self.sums.get(key, 0.0) / max(self.tokens, 1)


def read_scalars(scalars: dict[str, Any]) -> dict[str, float]:
    """The step's loss terms (tensors summed over micro-batches, or numbers) as floats, in one copy."""
    if not scalars:
        return {}
    device = next((v.device for v in scalars.values() if torch.is_tensor(v)), torch.device("cpu"))
    names = list(scalars)
    values = torch.stack([torch.as_tensor(scalars[n], dtype=torch.float64, device=device) for n in names])
    return dict(zip(names, values.tolist()))


@dataclass
class MoeStep:
    """The step-wide numbers the MoE losses divide by: `num_positions`, the routed positions of
    the whole step (all micro-batches, all ranks; times the model's MoE layers it is the routed
    count N), and `frac` [k, E], the step's expert fractions f (needed when the load-balance
    loss trains). `num_experts` lets every rank hold accumulators of one shape."""

    top_k: int
    num_experts: int
    num_positions: int
    frac: torch.Tensor | None = None


@torch.no_grad()
def measure_pass(forward: Callable[[MicroBatch], TokenForward], micro_batches: list[MicroBatch],
                 top_k: int = 0, num_experts: int = 0) -> tuple[float, torch.Tensor | None]:
    """A no-grad pass over the step before its update: the sum of its loss tokens' entropies and,
    with top_k > 0, the routing counts [k, E] (float64): how many routed (position, layer) pairs
    chose each expert as their j-th (f = counts / counts[0].sum()). With `num_experts` the counts
    exist (zeros) even without micro-batches, as an all-reduce over ranks needs."""
    entropy = 0.0
    counts = torch.zeros(top_k, num_experts, dtype=torch.float64) if top_k and num_experts else None
    for mb in micro_batches:
        out = forward(mb)
        entropy += float(out.entropy.double().sum())
        if top_k:
            mask = mb.attention_mask.to(out.logprobs.device)
            mine = router_sums(out.router_logits, top_k, mask).counts.double().cpu()
            counts = mine if counts is None else counts + mine
    return entropy, counts


def routed_positions(micro_batches: list[MicroBatch]) -> int:
    return sum(int(mb.attention_mask.sum()) for mb in micro_batches)


def fractions(counts: torch.Tensor) -> torch.Tensor:
    """f [k, E] from routing counts [k, E] (each row sums to the routed pairs)."""
    return counts / max(float(counts[0].sum()), 1.0)


def forward_backward(
    forward: Callable[[MicroBatch], TokenForward],
    micro_batches: list[MicroBatch],
    algo: AlgoConfig,
    counts: StepCounts,
    *,
    entropy_coef: float = 0.0,
    ref_logprobs: Callable[[MicroBatch], torch.Tensor] | None = None,
    proximal: Callable[[MicroBatch], torch.Tensor] | None = None,
    moe_top_k: int = 0,
    moe: MoeStep | None = None,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
    reduce: Callable[[Tally, dict[str, float]], None] | None = None,
    m2po_cut: float = math.inf,
    version: int | None = None,
    max_response_tokens: int = 0,
) -> dict[str, float]:
    """Accumulate the step's gradients; `forward(mb)` gives the loss tokens' logprobs/entropies,
    `ref_logprobs(mb)` the reference policy's logprobs of the same tokens (no grad), `proximal(mb)`
    decoupled PPO's pi_prox of them (None: the step is its own rollout batch). `backward`
    is the training backend's; `reduce(tally, scalars)` combines the ranks' sums in place, so
    the metrics describe the whole step. A MoE model needs `moe` (the step over all ranks) or
    `moe_top_k` (then this process's micro-batches are the whole step). `m2po_cut`: M2PO's
    threshold over the whole step (`m2po_log_ratios`), with algo.policy_loss m2po. With `version` (the
    learner's, before this step's update) the step's tokens are also decomposed by staleness,
    entropy and length (algo/token_decomposition.py; length quarters of `max_response_tokens`)."""
    if moe is None and moe_top_k:
        routing = measure_pass(forward, micro_batches, moe_top_k)[1]
        moe = MoeStep(moe_top_k, routing.shape[-1], routed_positions(micro_batches), fractions(routing))
    # summed as tensors, read once after the last micro-batch (no host sync per micro-batch)
    tally, scalars = Tally(), {"loss": 0.0, "pg": 0.0, "kl_term": 0.0, "moe_lse_sq": 0.0, "moe_num": 0.0,
                               **dict.fromkeys(ROUTE_KEYS, 0.0)}
    if moe is not None:  # every rank holds them, micro-batches or not, for the all-reduce
        tally.vectors = {"moe_counts": torch.zeros(moe.top_k, moe.num_experts, dtype=torch.float64),
                         "moe_prob": torch.zeros(moe.num_experts, dtype=torch.float64)}
    for mb in micro_batches:
        if mb.num_loss_tokens == 0:
            continue
        out = forward(mb)
        logp, entropy = out.logprobs, out.entropy
        dev = logp.device
        old, adv = mb.old_logprobs.to(dev), mb.advantages.to(dev)
        anchor = None
        if algo.decoupled:
            anchor = proximal(mb).to(device=dev, dtype=logp.dtype) if proximal is not None else logp.detach()
        pg, diag = policy_and_weight(algo, logp, old, adv, mb.sequence_ids().to(dev), anchor, m2po_cut)
        weights = token_weights(algo.aggregation, mb.seq_loss_tokens.to(dev), counts, dtype=pg.dtype)
        pg_share = weighted_sum(pg, weights)
        loss = pg_share - entropy_coef * weighted_sum(entropy, weights)
        if ref_logprobs is not None:
            kl = token_kl(logp, ref_logprobs(mb).to(dev), algo.kl.estimator, algo.kl.grad_cap)
            kl_share = weighted_sum(kl, weights)
            if algo.kl.coef > 0:
                loss = loss + algo.kl.coef * kl_share
            scalars["kl_term"] += kl_share.detach().double()
            tally.add("kl", kl)
        if out.router_logits is not None and moe is not None:
            loss = loss + _moe_terms(out.router_logits, mb, moe, algo, tally, scalars)
        if out.routes is not None:
            for key, value in zip(ROUTE_KEYS, out.routes.unbind()):  # on the device: no sync
                scalars[key] += value
        backward(loss)
        scalars["loss"] += loss.detach().double()
        scalars["pg"] += pg_share.detach().double()
        _tally_tokens(tally, mb, logp, entropy, old, diag, version)
    if reduce is not None:
        reduce(tally, scalars)
    metrics = _metrics(tally.read(), read_scalars(scalars), tally.vectors, ref_logprobs is not None, algo.decoupled,
                       moe is not None)
    if version is not None and tally.tables:
        table = TokenTable.from_matrix(torch.cat(tally.tables, dim=1))
        longest = int(table.response_length.max()) if table.num_tokens else 1
        metrics.update(decompose(table, max(max_response_tokens, longest, 1)))
    return metrics


def policy_and_weight(algo: AlgoConfig, logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor,
                      seq_ids: torch.Tensor, proximal: torch.Tensor | None,
                      m2po_cut: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token policy loss [T] and its diagnostics: algo.policy_loss against pi_prox
    (`proximal`, decoupled) or pi_b (`old`), times algo.behaviour_weight of pi_prox / pi_b when
    decoupled (algo/corrections.py)."""
    anchor = old if proximal is None else proximal
    candidates = None
    if algo.policy_loss == "m2po":
        candidates = m2po_candidates(m2po_log_ratio(logp, old), adv, algo.m2po_candidates, algo.eps_low, algo.eps_high)
    pg, diag = policy_terms(algo.policy_loss, logp, anchor, adv, eps_low=algo.eps_low, eps_high=algo.eps_high,
                            dual_clip=algo.dual_clip, seq_ids=seq_ids, m2po_cut=m2po_cut, behaviour_logprobs=old,
                            m2po_candidates=candidates, cispo_eps_low=algo.cispo_eps_low)
    if proximal is not None:
        weight, weight_diag = behaviour_weight(algo.behaviour_weight, proximal - old, cap=algo.is_weight_cap,
                                               seq_ids=seq_ids, icepop_low=algo.icepop_low,
                                               icepop_high=algo.icepop_high)
        pg = pg * weight.to(pg.dtype)
        diag.update(weight_diag)
    return pg, diag


def _tally_tokens(tally: Tally, mb: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor, old: torch.Tensor,
                  diag: dict[str, torch.Tensor], version: int | None) -> None:
    """A micro-batch's loss tokens into the step's sums, and (with `version`) its token table."""
    tally.tokens += mb.num_loss_tokens
    tally.add("entropy", entropy)
    tally.add("behaviour_nll", -old)  # E[-log pi_b(a)] = H(pi_b): the actors' entropy, sampled
    tally.add("ratio", diag["ratio"])
    tally.add("abs_logp_diff", (logp - old).abs())
    tally.add("advantage", mb.advantages.to(logp.device))  # with algo.distill: the group's plus the teacher's term
    for flag in ("clipped_low", "clipped_high", "clipped_dual", "is_weight_capped", "is_weight_masked", "masked"):
        if flag in diag:
            tally.add(flag, diag[flag])
    if "is_weight" in diag:
        tally.add("is_weight", diag["is_weight"])
    if version is not None:  # on the step's device, as one [F, T] tensor (gathered over ranks as such)
        dev = logp.device
        tally.tables.append(TokenTable.from_policy_loss(
            version, mb.versions.to(dev), logp, entropy, old, mb.advantages.to(dev), diag,
            mb.response_lengths.to(dev)).to_matrix())


@torch.no_grad()
def m2po_log_ratios(forward: Callable[[MicroBatch], TokenForward], micro_batches: list[MicroBatch],
                    algo: AlgoConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """For M2PO's threshold over the whole step (algo/corrections.py m2po_threshold, over every
    rank's values): a no-grad pass gives each loss token's log q_t = log pi_theta - log pi_b
    (m2po_log_ratio: the behaviour policy's ratio, decoupled or not) and whether it is a candidate
    for the mask, [T] float64 and [T] bool. The policy does not move during the step, so the loss
    sees exactly these values."""
    ratios, candidates = [torch.zeros(0, dtype=torch.float64)], [torch.zeros(0, dtype=torch.bool)]
    for mb in micro_batches:
        log_q = m2po_log_ratio(forward(mb).logprobs.cpu(), mb.old_logprobs)
        ratios.append(log_q)
        candidates.append(m2po_candidates(log_q, mb.advantages, algo.m2po_candidates, algo.eps_low, algo.eps_high))
    return torch.cat(ratios), torch.cat(candidates)


def padding_loss(out: TokenForward, algo: AlgoConfig, moe: MoeStep | None = None) -> torch.Tensor:
    """Zero, over a padding micro-batch (a rank with fewer micro-batches than the busiest one), from
    the same outputs of the forward that a real micro-batch's loss uses: logprobs, entropies and,
    when an MoE loss trains, the router logits. ZeRO-3 gathers a module's parameters in backward
    once for each of its outputs that gets a gradient, and records the order of those gathers; a
    padding backward that skipped one (e.g. the token head's entropies) records another order on
    its rank, which then checks the order with the other ranks (a broadcast) while they reduce
    gradients: a hang."""
    loss = out.logprobs.sum() + out.entropy.sum()
    if out.router_logits is not None and moe is not None and (algo.moe_z_loss_coef > 0 or algo.moe_aux_loss_coef > 0):
        loss = loss + sum(r.sum() for r in out.router_logits)
    return loss * 0.0


def _moe_terms(router_logits, mb: MicroBatch, moe: MoeStep, algo: AlgoConfig, tally: Tally,
               scalars: dict[str, float]) -> torch.Tensor:
    """This micro-batch's part of c_lb * L_lb + c_z * L_z; its routing sums go to the tally."""
    sums = router_sums(router_logits, moe.top_k, mb.attention_mask.to(router_logits[0].device))
    num = moe.num_positions * len(router_logits)  # the step's routed (position, layer) pairs
    term = sums.lse_sq_sum.new_zeros(())
    if algo.moe_z_loss_coef > 0:
        term = term + algo.moe_z_loss_coef * sums.lse_sq_sum / num
    if algo.moe_aux_loss_coef > 0:
        term = term + algo.moe_aux_loss_coef * load_balance_share(sums.prob_sum, moe.frac, num)
    tally.add_vector("moe_counts", sums.counts)
    tally.add_vector("moe_prob", sums.prob_sum)
    scalars["moe_lse_sq"] += sums.lse_sq_sum.detach().double()
    scalars["moe_num"] += sums.num
    return term


def _metrics(t: TallyValues, s: dict[str, float], vectors: dict[str, torch.Tensor], with_kl: bool, decoupled: bool,
             moe: bool) -> dict[str, float]:
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
        "clip/m2po_masked_frac": t.mean("masked"),
        "loss/abs_logp_diff_behaviour": t.mean("abs_logp_diff"),
        "advantage/token_mean": t.mean("advantage"),
        "learner/loss_tokens": t.tokens,
    }
    if with_kl:
        m.update({"kl/mean": t.mean("kl"), "kl/max": t.maxima.get("kl", 0.0), "loss/kl": s["kl_term"]})
    if decoupled:
        m.update({"is_weight/mean": t.mean("is_weight"), "is_weight/max": t.maxima.get("is_weight", 0.0),
                  "is_weight/min": t.minima.get("is_weight", 0.0),
                  "is_weight/capped_frac": t.mean("is_weight_capped"),
                  "is_weight/masked_frac": t.mean("is_weight_masked")})
    if moe:
        num = int(s["moe_num"])
        lb = load_balance_from_sums(vectors["moe_counts"], vectors["moe_prob"], num)
        m.update({"loss/moe_load_balance": float(lb), "loss/moe_z": s["moe_lse_sq"] / max(num, 1)})
    if s["route_pairs"]:  # routing replay: the step's (position, layer) pairs
        recorded = max(s["route_recorded"], 1.0)
        m.update({"moe/route_agreement": s["route_used_agree"] / recorded,
                  "moe/own_route_agreement": s["route_own_agree"] / recorded,
                  "moe/route_coverage": s["route_recorded"] / s["route_pairs"]})
    return m
