"""One optimizer step's forward/backward over micro-batches, with the loss from asyncrl.algo.

Every token's weight comes from the step's global counts (`StepCounts`: Phi, the step's loss
tokens and sequences over all ranks), and gradients accumulate, so the step's gradient equals
the full-batch gradient however the batch was cut. Returns the step's metrics, pooled over all
its loss tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from asyncrl.algo.aggregation import StepCounts, token_weights, weighted_sum
from asyncrl.algo.policy_loss import clipped_policy_loss
from asyncrl.algo.token_stats import token_logprobs_and_entropy
from asyncrl.config import AlgoConfig
from asyncrl.learner.collate import MicroBatch


def forward_backward(
    logits_fn: Callable[[MicroBatch], torch.Tensor],
    micro_batches: list[MicroBatch],
    algo: AlgoConfig,
    counts: StepCounts,
    temperature: float,
    entropy_chunk: int,
) -> dict[str, float]:
    """Accumulate gradients for one step; `logits_fn(mb)` returns logits [B, L, V]."""
    sums = {"loss": 0.0, "pg": 0.0, "entropy": 0.0, "ratio": 0.0, "clip_low": 0.0,
            "clip_high": 0.0, "clip_dual": 0.0, "abs_logp_diff": 0.0}
    ratio_max, tokens = 0.0, 0
    for mb in micro_batches:
        if mb.num_loss_tokens == 0:
            continue
        logits = logits_fn(mb)[mb.rows, mb.cols]  # [T, V]
        logp, entropy = token_logprobs_and_entropy(logits, mb.targets, temperature, entropy_chunk)
        pg, diag = clipped_policy_loss(logp, mb.old_logprobs, mb.advantages, algo.eps_low, algo.eps_high,
                                       dual_clip=algo.dual_clip)
        weights = token_weights(algo.aggregation, mb.seq_loss_tokens, counts, dtype=pg.dtype)
        pg_share = weighted_sum(pg, weights)
        loss = pg_share - algo.entropy_coef * weighted_sum(entropy, weights)
        loss.backward()
        with torch.no_grad():
            sums["loss"] += float(loss)
            sums["pg"] += float(pg_share)
            sums["entropy"] += float(entropy.sum())
            sums["ratio"] += float(diag["ratio"].sum())
            sums["clip_low"] += float(diag["clipped_low"].sum())
            sums["clip_high"] += float(diag["clipped_high"].sum())
            if "clipped_dual" in diag:
                sums["clip_dual"] += float(diag["clipped_dual"].sum())
            sums["abs_logp_diff"] += float((logp - mb.old_logprobs).abs().sum())
            ratio_max = max(ratio_max, float(diag["ratio"].max()))
            tokens += mb.num_loss_tokens
    t = max(tokens, 1)
    return {
        "loss/total": sums["loss"],
        "loss/policy": sums["pg"],
        "entropy/learner": sums["entropy"] / t,
        "ratio/mean": sums["ratio"] / t,
        "ratio/max": ratio_max,
        "clip/low_frac": sums["clip_low"] / t,
        "clip/high_frac": sums["clip_high"] / t,
        "clip/dual_frac": sums["clip_dual"] / t,
        "loss/abs_logp_diff_behaviour": sums["abs_logp_diff"] / t,
        "learner/loss_tokens": tokens,
    }
