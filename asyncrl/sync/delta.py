"""Sparse weight deltas and push checksums, as pure tensor functions (the arithmetic of
`sync.transfer: delta`; the senders and receivers move what these produce).

After one RL step only a few percent of a model's elements change at all in the engine's dtype
(bf16/fp16 round most of an lr-1e-6 update away), so a push can carry, per bucket, the indices and
new bit patterns of the elements that changed instead of every element. Everything here compares
and copies *bits*, never values: the learner keeps a shadow of what the engines hold in their
dtype, and an engine that applies a delta to exactly that shadow ends equal to the full push bit
for bit, whatever the values are (-0.0 against 0.0, NaN payloads, subnormals).

A delta is not always smaller: k changed elements cost k * (4 + itemsize) bytes against
numel * itemsize for the whole bucket, so past about a third (2-byte dtypes) of the elements
changing the bucket goes whole (`encode` returns None).

The checksum is what an engine verifies after applying a push: a position-weighted sum of the
bucket's 32-bit words in wrapping int64 arithmetic (exact and order-free, so a GPU and a CPU
reduction give the same number). Each word is weighted by an odd number, so any single flipped bit
changes the sum (2^k times an odd number is never 0 mod 2^64), as does moving a word.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
INDEX_BYTES = 4  # int32 indices: a bucket has fewer than 2**31 elements (buckets.py bounds it far below)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, flat, as a signed integer tensor of the same element size (a view)."""
    return t.reshape(-1).view(_BITS[t.element_size()])


@dataclass(frozen=True)
class Delta:
    """The elements of one flat tensor that changed: their positions and new bit patterns."""

    indices: torch.Tensor
    """int32, ascending."""
    values: torch.Tensor
    """The new bits at those positions, in the tensor's integer view (`bits`)."""

    @property
    def nbytes(self) -> int:
        return self.indices.numel() * INDEX_BYTES + self.values.numel() * self.values.element_size()


def delta_nbytes(changed: int, itemsize: int) -> int:
    return changed * (INDEX_BYTES + itemsize)


def encode(shadow: torch.Tensor, new: torch.Tensor) -> Delta | None:
    """The delta that turns `shadow` into `new` (same shape and dtype), or None when sending `new`
    whole costs no more bytes."""
    if shadow.shape != new.shape or shadow.dtype != new.dtype:
        raise ValueError(f"delta between {tuple(shadow.shape)} {shadow.dtype} and {tuple(new.shape)} {new.dtype}")
    if new.numel() >= 2**31:
        raise ValueError(f"a delta's tensor has {new.numel()} elements, more than int32 indices address")
    old_bits, new_bits = bits(shadow), bits(new)
    changed = torch.nonzero(old_bits != new_bits).reshape(-1)
    if delta_nbytes(changed.numel(), new.element_size()) >= new.numel() * new.element_size():
        return None
    return Delta(changed.to(torch.int32), new_bits[changed])


def apply(target: torch.Tensor, delta: Delta) -> None:
    """Write the delta's bits into `target` in place (the engine's copy of the tensor)."""
    flat = bits(target)
    if delta.values.dtype != flat.dtype:
        raise ValueError(f"a delta of {delta.values.dtype} bits applied to a {target.dtype} tensor")
    flat[delta.indices.long()] = delta.values


def checksum(t: torch.Tensor, chunk_words: int = 1 << 22) -> int:
    """Position-weighted sum of the tensor's bytes as 32-bit words, wrapping int64 (padded with zero
    bytes to a whole word). Summed `chunk_words` at a time, so a bucket of any size needs at most
    2 x 8 x chunk_words bytes of scratch (64 MiB by default); wrapping makes the chunking exact."""
    raw = t.reshape(-1).view(torch.uint8)
    if raw.numel() % 4:
        raw = torch.cat([raw, raw.new_zeros(4 - raw.numel() % 4)])
    words = raw.view(torch.int32)
    total = 0
    for start in range(0, words.numel(), chunk_words):
        chunk = words[start:start + chunk_words].to(torch.int64)
        weights = torch.arange(2 * start + 1, 2 * (start + chunk.numel()), 2, dtype=torch.int64, device=chunk.device)
        total += int((chunk * weights).sum())
    return (total + 2**63) % 2**64 - 2**63
