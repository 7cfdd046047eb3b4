"""Token logprobs and entropies from logits, computed in chunks of tokens (pure torch).

Only the selected loss positions' logits reach here, and log-softmax is taken `chunk` rows at a
time, so a [T, V] float32 log-softmax of the whole batch never exists at once besides the
logits themselves. Logits are divided by the sampling temperature first so the learner scores
the same distribution the actors sampled from.
"""

from __future__ import annotations

import torch


def token_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, chunk: int = 1024
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, V], targets [T] int -> (logprob of target [T], entropy H_t [T]), float32."""
    if logits.shape[0] != targets.shape[0]:
        raise ValueError(f"{logits.shape[0]} logit rows for {targets.shape[0]} targets")
    logps, ents = [], []
    for start in range(0, logits.shape[0], chunk):
        rows = logits[start : start + chunk].float() / temperature
        logp_all = torch.log_softmax(rows, dim=-1)
        logps.append(logp_all.gather(-1, targets[start : start + chunk, None]).squeeze(-1))
        ents.append(-(logp_all.exp() * logp_all).sum(-1))
    if not logps:
        empty = logits.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat(logps), torch.cat(ents)
