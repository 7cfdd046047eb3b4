"""Decoupled PPO's proximal policy: pi_prox of every token of the open rollout batch.

AReaL (Fu et al. 2025) recomputes the proximal logprobs once per rollout batch, with no grad,
before that batch's minibatch updates, and keeps them fixed across them: the ratio
pi_theta / pi_prox then measures how far the updates of *this* batch have moved the policy, and
the clip bounds that, as PPO's does, while the truncated weight pi_prox / pi_b corrects for the
rollouts' staleness. asyncrl's learner does the same: when a step opens a rollout batch
(types.Batch.role == "open"), every rank runs a no-grad forward over its share of the batch's
responses, the ranks sum their parts into one vector (so every rank holds all of it, whichever
rank later trains a token), and `ProximalLogprobs` keeps it, keyed by (group_id, sample_index)
and token position, for the batch's N_SGD steps.

A step that is its own rollout batch (streaming, or one step per batch) needs no table: its
pi_prox is the policy at the start of the step, which is the policy of its own forward (one
optimizer update per step, after all micro-batches), so the learner takes that forward's
logprobs, detached: the ratio is 1 in value and decoupled PPO reduces to the truncated weight
on the policy gradient. A separate no-grad forward would recompute the same numbers.

The previous batch's entries are kept until the next batch opens: in token mode the first step
of a batch also trains the previous batch's carried tail, whose pi_prox is its own batch's.
"""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.learner.collate import MicroBatch
from asyncrl.types import ResponseSpan

Entries = dict[tuple[str, int], tuple[int, torch.Tensor]]  # (group, sample) -> (first token, logprobs)


class ProximalLogprobs:
    def __init__(self) -> None:
        self.current: Entries = {}
        self.previous: Entries = {}

    def open(self, layout: list[ResponseSpan], values: torch.Tensor) -> None:
        """A new rollout batch: `values` [sum of num_tokens] holds its responses' logprobs in
        `layout` order."""
        if values.numel() != sum(s.num_tokens for s in layout):
            raise ValueError(f"{values.numel()} proximal logprobs for {sum(s.num_tokens for s in layout)} tokens")
        entries, offset = {}, 0
        for s in layout:
            entries[(s.group_id, s.sample_index)] = (s.loss_start, values[offset:offset + s.num_tokens])
            offset += s.num_tokens
        self.previous, self.current = self.current, entries

    def lookup(self, mb: MicroBatch) -> torch.Tensor:
        """pi_prox logprobs [T] of mb's loss tokens, in collate's order."""
        parts = []
        for group_id, sample_index, start, end in mb.spans:
            key = (group_id, sample_index)
            entry = self.current.get(key) or self.previous.get(key)
            if entry is None:
                raise KeyError(f"no proximal logprobs for response {group_id}/{sample_index}: the step continues a "
                               "rollout batch this learner did not see open (a checkpoint without them?)")
            first, values = entry
            if start < first or end - first > values.numel():
                raise KeyError(f"response {group_id}/{sample_index}: tokens [{start}, {end}) are outside the "
                               f"proximal logprobs of [{first}, {first + values.numel()})")
            parts.append(values[start - first:end - first])
        return torch.cat(parts) if parts else torch.zeros(0)

    def state_dict(self) -> dict[str, Any]:
        return {"current": self.current, "previous": self.previous}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.current, self.previous = state.get("current", {}), state.get("previous", {})
