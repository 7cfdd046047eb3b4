"""Split one step's chunks across learner ranks, balanced by tokens (pure).

Greedy longest-first onto the least-loaded rank: the forward cost of a chunk is its full length
(context included), so that is what is balanced; the loss normalizer stays global regardless.
`rank_batches` builds each rank's `Batch` of a step: its part, the step's global counts, and
when the step opens a rollout batch, its share of that batch for the learner's no-grad pass.
"""

from __future__ import annotations

from itertools import accumulate

from asyncrl.types import Batch, ResponseSpan, SequenceChunk


def split_for_ranks(chunks: list[SequenceChunk], num_ranks: int) -> list[list[SequenceChunk]]:
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    ranks: list[list[SequenceChunk]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for c in sorted(chunks, key=lambda c: c.num_tokens, reverse=True):
        r = min(range(num_ranks), key=load.__getitem__)
        ranks[r].append(c)
        load[r] += c.num_tokens
    return ranks


def rank_batches(step: int, chunks: list[SequenceChunk], num_ranks: int, token_budget: int, role: str = "own",
                 opened: list[SequenceChunk] | None = None) -> list[Batch]:
    """One `Batch` per rank: its part of the step's chunks with the step's global counts, and
    with role "open" its share of the opened rollout batch's responses plus the whole batch's
    layout (rank 0's share first), so that the ranks can sum their parts into one vector."""
    shares = split_for_ranks(opened or [], num_ranks)
    layout = [ResponseSpan.of(c) for share in shares for c in share]
    offsets = [0, *accumulate(len(share) for share in shares)]
    num_loss_tokens, num_sequences = sum(c.num_loss_tokens for c in chunks), len(chunks)
    return [Batch(step=step, rank=r, chunks=part, num_loss_tokens_global=num_loss_tokens,
                  num_sequences_global=num_sequences, token_budget=token_budget, role=role, opened=shares[r],
                  opened_layout=layout, opened_offset=offsets[r])
            for r, part in enumerate(split_for_ranks(chunks, num_ranks))]
