"""Sparse weight deltas and push checksums, as pure tensor functions (the arithmetic of
`sync.transfer: delta`; the senders and receivers move what these produce).

After one RL step only a few percent of a model's elements change at all in the engine's dtype
(bf16/fp16 round most of an lr-1e-6 update away), so a push can carry, per bucket, the indices and
new bit patterns of the elements that changed instead of every element. Everything here compares
and copies *bits*, never values: the learner keeps a shadow of what the engines hold in their
dtype, and an engine that applies a delta to exactly that shadow ends equal to the full push bit
for bit, whatever the values are (-0.0 against 0.0, NaN payloads, subnormals).

A delta is not always smaller: k changed of n elements cost k * (4 + itemsize) bytes as int32
indices and values, n / 8 + k * itemsize as a bitmask and values, against n * itemsize whole. So a
bucket travels whichever way is smallest: indices while few elements change (under about one in 30
for 2-byte dtypes), a bitmask up to about nine in ten, whole past that.

A bucket's push (`encode_bucket` on the learner, `decode_bucket` on each engine) is a prefix of
three int64, [how (WHOLE, INDICES or MASK), changed elements, checksum], then one payload. A
bucket's padding bytes (between aligned tensors) take part like any others, so a sender must write
them the same way every push or they show as changes.

The checksum is what an engine verifies after applying a push: CRC-32 of the bucket's bytes in
host memory (any single flipped bit, any burst of up to 32, a moved word all change it), and on
GPUs a position-weighted sum of its 32-bit words in wrapping int64 arithmetic (exact and
order-free; each word is weighted by an odd number, so any single flipped bit changes the sum, since
2^k times an odd number is never 0 mod 2^64, as does moving a word).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np
import torch

from asyncrl.sync.buckets import dtype_from_str

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


def checksum(t: torch.Tensor) -> int:
    """The checksum a push carries for these bytes: CRC-32 where they are in host memory (gloo's
    pushes: zlib's runs at ~4 GB/s on these cores, faster than the broadcast), the weighted word
    sum on a GPU (NCCL's pushes: both ends hold the bytes on a GPU, where it runs at memory speed
    and a CRC would first copy them to the host)."""
    if t.device.type == "cpu":
        return zlib.crc32(t.detach().reshape(-1).view(torch.uint8).numpy())
    return weighted_sum(t)


def weighted_sum(t: torch.Tensor, chunk_words: int = 1 << 22) -> int:
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


WHOLE, INDICES, MASK = 0, 1, 2
"""How a bucket travels (a prefix's first word): its bytes; the changed elements' int32 indices then
their values; or a bitmask of the changed elements then their values."""
PREFIX_WORDS = 3
"""A bucket's prefix: [how, changed elements (-1: not compared), checksum], int64."""


class ChecksumMismatch(ValueError):
    """What an engine applied differs from what the learner sent (a corrupted or misapplied push)."""


def bucket_word(bucket: dict) -> int:
    """The element size a bucket's delta is taken in: its tensors' common dtype size (a bucket's
    offsets are aligned to 16 bytes, so its bytes divide into such words), else single bytes."""
    sizes = {dtype_from_str(e["dtype"]).itemsize for e in bucket["tensors"]}
    word = sizes.pop() if len(sizes) == 1 else 1
    return word if bucket["nbytes"] % word == 0 else 1


def payload_nbytes(prefix: list[int], bucket_nbytes: int, word: int) -> int:
    """The size of the payload that follows `prefix` (what a receiver allocates before it arrives)."""
    how, changed = prefix[0], prefix[1]
    if how == WHOLE:
        return bucket_nbytes
    if how == INDICES:
        return changed * (INDEX_BYTES + word)
    if how == MASK:
        return mask_nbytes(bucket_nbytes // word) + changed * word
    raise ValueError(f"a bucket prefix says {prefix}: not a way a bucket travels")


def mask_nbytes(elements: int) -> int:
    """A bitmask of `elements` bits, padded to whole 8-byte words so the values after it stay aligned."""
    return -(-elements // 64) * 8


def encode_bucket(shadow: torch.Tensor | None, new: torch.Tensor, word: int,
                  whole: bool = False) -> tuple[list[int], torch.Tensor, int | None]:
    """What one bucket's push sends: its prefix (PREFIX_WORDS) and payload, whichever of the three
    ways is smallest: `new` itself, or the changed elements' positions (int32 indices, or a bitmask
    of the bucket's elements: past about one element in 30 changing the mask is smaller) then
    their new bits, as one uint8 tensor; and how many `word`-sized elements changed (None without
    a shadow to compare with). `shadow`: the bytes the engines hold (None: unknown, so whole); both
    are uint8 of one size. `whole`: whole even if smaller ways exist (a periodic or healing push)."""
    if shadow is None:
        return [WHOLE, -1, checksum(new)], new, None
    old_bits, new_bits = shadow.view(_BITS[word]), new.view(_BITS[word])
    differs = old_bits != new_bits
    changed = int(np.count_nonzero(differs.numpy()))  # torch's sum of a bool tensor is ~50x slower here
    sizes = {how: payload_nbytes([how, changed], new.numel(), word) for how in (WHOLE, INDICES, MASK)}
    how = WHOLE if whole else min(sizes, key=lambda h: (sizes[h], h))  # a tie goes whole
    if how == WHOLE:
        payload = new
    elif changed == 0:
        payload = new.new_empty(0)
    elif how == INDICES:
        where = torch.from_numpy(np.flatnonzero(differs.numpy()).astype(np.int32))
        payload = torch.cat([where.view(torch.uint8), new_bits[where.long()].view(torch.uint8)])
    else:
        mask = torch.zeros(mask_nbytes(differs.numel()), dtype=torch.uint8)
        mask.numpy()[: -(-differs.numel() // 8)] = np.packbits(differs.numpy())
        payload = torch.cat([mask, new_bits[differs].view(torch.uint8)])
    return [how, changed, checksum(new)], payload, changed


def decode_bucket(prefix: list[int], payload: torch.Tensor, target: torch.Tensor, word: int) -> None:
    """Apply one bucket's push to `target` (uint8: the engine's bytes of the bucket, in place) and
    verify it against the sender's checksum; ChecksumMismatch if it differs."""
    apply_bucket(prefix, payload, target, word)
    if (got := checksum(target)) != prefix[2]:
        raise ChecksumMismatch(f"bucket checksum {got} after applying the push, the learner sent {prefix[2]}")


def apply_bucket(prefix: list[int], payload: torch.Tensor, target: torch.Tensor, word: int) -> None:
    """Write one bucket's push into `target` (uint8, in place), unchecked: the learner's own shadow,
    and the first half of `decode_bucket`."""
    how, changed, _ = prefix
    if how == WHOLE:
        if payload.data_ptr() != target.data_ptr():
            target.copy_(payload)
    elif how == INDICES:
        split = changed * INDEX_BYTES
        apply(target.view(_BITS[word]), Delta(payload[:split].view(torch.int32), payload[split:].view(_BITS[word])))
    else:
        flat = target.view(_BITS[word])
        split = mask_nbytes(flat.numel())
        differs = torch.from_numpy(np.unpackbits(payload[:split].numpy(), count=flat.numel()).view(np.bool_))
        if int(differs.sum()) != changed:
            raise ChecksumMismatch(f"a bucket's bitmask marks {int(differs.sum())} elements, its prefix {changed}")
        flat[differs] = payload[split:].view(_BITS[word])
