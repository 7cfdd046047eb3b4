"""Split one step's chunks across learner ranks, balanced by tokens (pure).

Greedy longest-first onto the least-loaded rank: the forward cost of a chunk is its full length
(context included), so that is what is balanced; the loss normalizer stays global regardless.
"""

from __future__ import annotations

from asyncrl.types import SequenceChunk


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


def micro_batches(chunks: list[SequenceChunk], max_tokens: int) -> list[list[SequenceChunk]]:
    """Consecutive groups of chunks whose total length stays within max_tokens (one chunk at
    least, even if it alone is longer)."""
    out: list[list[SequenceChunk]] = []
    current: list[SequenceChunk] = []
    size = 0
    for c in chunks:
        if current and size + c.num_tokens > max_tokens:
            out.append(current)
            current, size = [], 0
        current.append(c)
        size += c.num_tokens
    if current:
        out.append(current)
    return out
