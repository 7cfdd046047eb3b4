"""A rank's part of a step cut into micro-batches of at most `learner.micro_batch_tokens`
tokens, context included (pure). The step's gradient does not depend on the cut: every
micro-batch's loss is normalized by the step's global counts."""

from __future__ import annotations

from asyncrl.types import SequenceChunk


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
