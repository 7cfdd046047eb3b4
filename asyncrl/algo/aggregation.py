"""Per-token weights that turn per-token terms into one optimizer step's loss (pure torch).

The step's loss is sum_t w_t * l_t over every loss token t of the step, with

    budget               w_t = 1 / Phi                 (Ring-lite C3PO eq. 5, fixed token budget)
    token_mean           w_t = 1 / N_tok               (DAPO; Skywork-OR1 eq. 3.1, 1 / T_k)
    seq_mean_token_mean  w_t = 1 / (N_seq * |y_s(t)|)  (GRPO, Skywork-OR1 eq. 2.4)
    seq_mean_token_sum   w_t = 1 / N_seq

where N_tok and N_seq count the loss tokens and the sequences of the whole step (all
micro-batches, all ranks) and |y_s(t)| is the number of loss tokens of the sequence that token t
belongs to, in this step. Because every weight depends on global counts only, a micro-batch's
`weighted_sum` is its exact share of the step's loss: summing the shares of any split into
micro-batches and ranks gives the full-batch loss and gradient (a rank with no tokens adds 0).

Deviation: the papers average over a batch of prompts; a "sequence" here is whatever the learner
trains on in the step (a response, or the part of a long response chunked into this step), so
|y_s(t)| must count that sequence's loss tokens in this step, wherever they sit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AGGREGATIONS = ("budget", "token_mean", "seq_mean_token_mean", "seq_mean_token_sum")


@dataclass(frozen=True)
class StepCounts:
    """Global counts of one optimizer step, the same on every micro-batch and rank."""

    num_tokens: int
    """Loss tokens in the step over all micro-batches and ranks."""
    num_sequences: int
    """Sequences with at least one loss token in the step, over all ranks."""
    token_budget: int | None = None
    """Phi, the fixed token budget of budget mode (C3PO)."""

    @classmethod
    def from_sequence_lengths(
        cls, lengths: list[int], token_budget: int | None = None
    ) -> StepCounts:
        """Counts from the loss-token count of every sequence in the step (zeros are skipped)."""
        if any(n < 0 for n in lengths):
            raise ValueError(f"negative sequence length in {lengths}")
        return cls(sum(lengths), sum(1 for n in lengths if n > 0), token_budget)


def token_weights(
    aggregation: str,
    seq_loss_tokens: torch.Tensor,
    counts: StepCounts,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Weights w_t [T] for a micro-batch's loss tokens.

    seq_loss_tokens [T] int: for each loss token, the loss-token count of its whole sequence in
    the step (only read by seq_mean_token_mean, but its length sets T for every mode).
    """
    shape, device = seq_loss_tokens.shape, seq_loss_tokens.device
    if aggregation == "budget":
        if not counts.token_budget or counts.token_budget <= 0:
            raise ValueError(f"budget mode needs token_budget > 0, got {counts.token_budget}")
        return torch.full(shape, 1.0 / counts.token_budget, dtype=dtype, device=device)
    if aggregation == "token_mean":
        _check_positive("num_tokens", counts.num_tokens, shape)
        return torch.full(shape, 1.0 / max(counts.num_tokens, 1), dtype=dtype, device=device)
    if aggregation in ("seq_mean_token_mean", "seq_mean_token_sum"):
        _check_positive("num_sequences", counts.num_sequences, shape)
        per_seq = 1.0 / max(counts.num_sequences, 1)
        if aggregation == "seq_mean_token_sum":
            return torch.full(shape, per_seq, dtype=dtype, device=device)
        if seq_loss_tokens.numel() and int(seq_loss_tokens.min()) <= 0:
            raise ValueError("every loss token's sequence must have at least one loss token")
        return per_seq / seq_loss_tokens.to(dtype)
    raise ValueError(f"unknown aggregation {aggregation!r} (allowed: {', '.join(AGGREGATIONS)})")


def weighted_sum(per_token: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """sum_t w_t * x_t: this micro-batch's share of the step's loss (0 for no tokens)."""
    if per_token.shape != weights.shape:
        raise ValueError(f"terms {tuple(per_token.shape)} vs weights {tuple(weights.shape)}")
    return (per_token * weights).sum()


def _check_positive(name: str, value: int, shape: torch.Size) -> None:
    # An empty micro-batch (a rank with no tokens) may see a step of zero tokens; anything else
    # with tokens needs a positive global count.
    if value <= 0 and shape.numel() > 0:
        raise ValueError(f"{name} must be positive when there are loss tokens, got {value}")
