"""A rank's part of a step cut into micro-batches of at most `learner.micro_batch_tokens`
tokens, context included (pure). The step's gradient does not depend on the cut: every
micro-batch's loss is normalized by the step's global counts, so the cut is free to minimise
the work, filled by length:

- packed rows (no padding) pay per micro-batch, not per length: first-fit decreasing, longest
  sequences first, each into the first micro-batch with room (at most 11/9 of the fewest
  micro-batches plus one);
- padded rows pay every row's padding to the longest: sorted by length and cut consecutively,
  so sequences of similar lengths share a micro-batch.
"""

from __future__ import annotations

from asyncrl.types import SequenceChunk


def micro_batches(chunks: list[SequenceChunk], max_tokens: int, packed: bool = True) -> list[list[SequenceChunk]]:
    """Groups of chunks whose total length stays within max_tokens (a chunk longer than that
    alone gets a micro-batch of its own)."""
    longest_first = sorted(chunks, key=lambda c: -c.num_tokens)  # stable: equal lengths keep their order
    out: list[list[SequenceChunk]] = []
    sizes: list[int] = []
    for c in longest_first:
        candidates = range(len(out)) if packed else range(max(len(out) - 1, 0), len(out))  # padded: the last only
        slot = next((i for i in candidates if sizes[i] + c.num_tokens <= max_tokens), None)
        if slot is None:
            out.append([])
            sizes.append(0)
            slot = len(out) - 1
        out[slot].append(c)
        sizes[slot] += c.num_tokens
    return out
