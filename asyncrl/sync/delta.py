"""Sparse weight deltas and push checksums, as pure tensor functions (the arithmetic of
`sync.transfer: delta`; the senders and receivers move what these produce).

After one RL step only a few percent of a model's elements change at all in the engine's dtype
(bf16/fp16 round most of an lr-1e-6 update away), so a push can carry, per bucket, the indices and
new bit patterns of the elements that changed instead of every element. Everything here compares
and copies *bits*, never values: the learner keeps a shadow of what the engines hold in their
dtype, and an engine that applies a delta to exactly that shadow ends equal to the full push bit
for bit, whatever the values are (-0.0 against 0.0, NaN payloads, subnormals).

A delta is not always smaller: k changed of n elements cost k * (2 + itemsize) bytes as uint16 gaps
between their positions and their values (k * (4 + itemsize) as int32 indices when some gap passes
65,535), against n * itemsize whole; past half the elements of a 2-byte dtype changing the bucket
goes whole. (A bitmask of the changed elements, n / 8 + k * itemsize, is smaller past one element in
16, but decoding it took 6x as long on these cores as the gaps' cumulative sum, and time is what a
push is for.)

A bucket's push (`encode_bucket` on the learner, `decode_bucket` on each engine) is a prefix of
three int64, [how (WHOLE, INDICES or GAPS), changed elements, checksum], then one payload. A
bucket's padding bytes (between aligned tensors) take part like any others, so a sender must write
them the same way every push or they show as changes.

The checksum is what an engine verifies after applying a push: XXH3-64 of the bucket's bytes in
host memory (a 64-bit hash: any change of the bytes passes unseen with probability 2^-64; 31 GB/s
on these cores, where zlib's CRC-32 ran at 4 GB/s and cost a full push 40% of its speed), and on
GPUs a position-weighted sum of its 32-bit words in wrapping int64 arithmetic (exact and
order-free; each word is weighted by an odd number, so any single flipped bit changes the sum, since
2^k times an odd number is never 0 mod 2^64, as does moving a word).
"""

from __future__ import annotations

import functools
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
import xxhash

from asyncrl.compat import usable_cores
from asyncrl.sync.buckets import dtype_from_str

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
INDEX_BYTES = 4  # int32 indices: a bucket has fewer than 2**31 elements (buckets.py bounds it far below)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns, flat, as a signed integer tensor of the same element size (a view)."""
    return t.reshape(-1).view(_BITS[t.element_size()])


def checksum(t: torch.Tensor) -> int:
    """The checksum a push carries for these bytes, as a signed int64: XXH3-64 where they are in
    host memory (gloo's pushes), the weighted word sum on a GPU (NCCL's pushes: both ends hold the
    bytes on a GPU, where it runs at memory speed and a hash would first copy them to the host)."""
    if t.device.type == "cpu":
        digest = xxhash.xxh3_64_intdigest(t.detach().reshape(-1).view(torch.uint8).numpy())
        return digest - 2**64 if digest >= 2**63 else digest
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


WHOLE, INDICES, GAPS = 0, 1, 2
"""How a bucket travels (a prefix's first word): its bytes; the changed elements' int32 indices then
their values; or the gaps between the changed elements' positions as uint16, then their values."""
PREFIX_WORDS = 3
"""A bucket's prefix: [how, changed elements (-1: not compared), checksum], int64."""
MAX_GAP = 2**16 - 1


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
    if how == GAPS:
        return gaps_nbytes(changed) + changed * word
    raise ValueError(f"a bucket prefix says {prefix}: not a way a bucket travels")


def gaps_nbytes(changed: int) -> int:
    """`changed` uint16 gaps, padded to whole 8-byte words so the values after them stay aligned."""
    return -(-2 * changed // 8) * 8


def encode_bucket(shadow: torch.Tensor | None, new: torch.Tensor, word: int, whole: bool = False,
                  advance: bool = False) -> tuple[list[int], torch.Tensor, int | None]:
    """What one bucket's push sends: its prefix (PREFIX_WORDS) and payload, whichever way is smallest:
    `new` itself, or the changed elements' positions then their new bits, as one uint8 tensor; and how
    many `word`-sized elements changed (None without a shadow to compare with). Positions go as
    uint16 gaps from the one before (the first from -1) while every gap fits, else as int32 indices.
    `shadow`: the bytes the engines hold (None: unknown, so whole); both are uint8 of one size, in
    host memory. `whole`: whole even if a delta is smaller (a periodic or healing push).
    `advance`: also bring `shadow` to `new` (the changed elements written in place, or a copy).

    numpy, a large bucket in one slice per core (`_slices`) on Python threads, which numpy's loops
    let run at once: finding the changed positions is bound by the cores more than by memory (the
    embedding's 136M bf16 elements, 3% changed: 137 ms in one slice, 95 ms in two on these 2 cores).
    Not torch: its element-wise ops run OpenMP regions whose threads spin-wait after them, which on
    a 2-core machine starves gloo's threads sending the bucket before (see `buckets.copy_bytes`)."""
    if shadow is None:
        return [WHOLE, -1, checksum(new)], new, None
    if shadow.shape != new.shape or shadow.dtype != new.dtype:
        raise ValueError(f"a delta between {tuple(shadow.shape)} {shadow.dtype} and {tuple(new.shape)} {new.dtype}")
    if new.numel() // word >= 2**31:
        raise ValueError(f"a bucket of {new.numel() // word} elements, more than int32 indices address")
    old_words, new_words = _words(shadow, word), _words(new, word)
    slices = _slices(new_words.size)
    differs = _PARALLEL.map(lambda s: old_words[s] != new_words[s], slices)
    counts = [int(np.count_nonzero(d)) for d in differs]  # cheap next to the compare: not worth a thread
    changed = sum(counts)

    def send_whole():
        if advance:
            old_words[:] = new_words
        return [WHOLE, changed, checksum(new)], new, changed

    if whole or payload_nbytes([GAPS, changed], new.numel(), word) >= new.numel():  # gaps: the least a delta costs
        return send_whole()
    where, values = np.empty(changed, dtype=np.int64), np.empty(changed, dtype=new_words.dtype)
    starts = np.cumsum([0] + counts).tolist()

    def gather(i):  # one slice's changed positions and values into their places in `where` and `values`
        part, got, put = slices[i], where[starts[i]:starts[i + 1]], values[starts[i]:starts[i + 1]]
        got[:] = np.flatnonzero(differs[i])
        np.take(new_words[part], got, out=put)
        if advance:  # harmless if the bucket goes whole after all: send_whole copies every element
            old_words[part][got] = put
        got += part.start

    _PARALLEL.map(gather, range(len(slices)))
    gaps = np.diff(where, prepend=-1)
    how = GAPS if not changed or gaps.max() <= MAX_GAP else INDICES
    if payload_nbytes([how, changed], new.numel(), word) >= new.numel():
        return send_whole()
    split = gaps_nbytes(changed) if how == GAPS else changed * INDEX_BYTES
    payload = np.empty(split + changed * word, dtype=np.uint8)
    if how == GAPS:
        payload[2 * changed:split] = 0  # the padding: the same bytes every push
        payload[:2 * changed].view(np.uint16)[:] = gaps
    else:
        payload[:split].view(np.int32)[:] = where
    payload[split:].view(new_words.dtype)[:] = values
    return [how, changed, checksum(new)], torch.from_numpy(payload), changed


def decode_bucket(prefix: list[int], payload: torch.Tensor, target: torch.Tensor, word: int) -> None:
    """Apply one bucket's push to `target` (uint8: the engine's bytes of the bucket, in place) and
    verify it against the sender's checksum; ChecksumMismatch if it differs."""
    apply_bucket(prefix, payload, target, word)
    if (got := checksum(target)) != prefix[2]:
        raise ChecksumMismatch(f"bucket checksum {got} after applying the push, the learner sent {prefix[2]}")


def apply_bucket(prefix: list[int], payload: torch.Tensor, target: torch.Tensor, word: int) -> None:
    """Write one bucket's push into `target` (uint8, in host memory, in place), unchecked: the first
    half of `decode_bucket`. numpy, as `encode_bucket` is and for the same reason."""
    how, changed, _ = prefix
    if how == WHOLE:
        if payload.data_ptr() != target.data_ptr():
            target.copy_(payload)
        return
    flat, raw = _words(target, word), payload.numpy()
    if how == INDICES:
        split = changed * INDEX_BYTES
        where = raw[:split].view(np.int32)
        lowest, highest = (int(where.min()), int(where.max())) if changed else (0, 0)
    else:
        split = gaps_nbytes(changed)
        where = np.cumsum(raw[: 2 * changed].view(np.uint16), dtype=np.int64) - 1
        lowest, highest = (int(where[0]), int(where[-1])) if changed else (0, 0)  # rising: gaps are >= 0
    if changed and not 0 <= lowest <= highest < flat.size:
        raise ChecksumMismatch(f"a delta addresses elements {lowest}..{highest} of {flat.size}")
    flat[where] = raw[split:].view(flat.dtype)


_WORDS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}
MIN_SLICE = 1 << 20
"""Elements below which a bucket is not split across threads (a thread's hand-off costs more)."""


def _slices(size: int) -> list[slice]:
    """`size` elements as one contiguous slice per core, none under MIN_SLICE (at least one)."""
    count = max(1, min(_cores(), size // MIN_SLICE))
    bounds = [size * i // count for i in range(count + 1)]
    return [slice(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


_cores = functools.cache(usable_cores)


class _Parallel:
    """`map` over a thread per core, started on first use (not at import: a process that forks after
    importing this module should not carry a pool's threads into its child)."""

    def __init__(self):
        self._pool: ThreadPoolExecutor | None = None

    def map(self, fn, items) -> list:
        items = list(items)
        if len(items) == 1:
            return [fn(items[0])]
        if self._pool is None:
            self._pool = ThreadPoolExecutor(_cores(), thread_name_prefix="asyncrl-delta")
        return list(self._pool.map(fn, items))


_PARALLEL = _Parallel()


def _words(t: torch.Tensor, word: int) -> np.ndarray:
    """A host uint8 tensor's bytes as a flat numpy array of `word`-byte integers (a view)."""
    if t.device.type != "cpu":
        raise ValueError(f"sparse deltas are taken in host memory; this bucket is on {t.device}")
    return t.reshape(-1).numpy().view(_WORDS[word])
