"""Bucket plans for weight pushes: many tensors travel as a few flat byte buffers.

One collective per tensor would cost a round trip per parameter (hundreds per push), so the
sender packs small tensors into buckets of at most `bucket_bytes` and broadcasts each bucket
once. A tensor of DIRECT_BYTES or more gets a bucket of its own instead: it is broadcast
straight from the parameter's memory and can be received straight into the destination's, with
no copy on either side (on a 2-core machine the copies into and out of buckets compete with the
transfer itself for the cores: a push at 0.5-0.6x a raw broadcast of the same bytes, against
about 0.85x without them; tools/bench_weight_sync.py). The plan is plain data
(lists/dicts of str/int) so it can travel as msgpack or as a Ray / vLLM RPC argument ahead of
the bytes; both sides derive byte offsets from it, so they can never disagree about where a
tensor starts.

No torch.distributed here: planning is arithmetic, packing is memcpy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

# Offsets are rounded up to this many bytes so every slice of the uint8 buffer can be
# reinterpreted (`Tensor.view(dtype)`) as any dtype without a copy.
ALIGN_BYTES = 16
# A tensor this large travels alone, without a copy: past it a broadcast's fixed cost (tens of
# microseconds) is below what copying it into a bucket and out again would cost.
DIRECT_BYTES = 1 << 20

TensorSpec = tuple[str, Sequence[int], str]  # (name, shape, dtype string such as "float32")


def dtype_from_str(name: str) -> torch.dtype:
    """"float32" or "torch.float32" -> torch.float32; anything else raises."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype string {name!r}")
    return dtype


def dtype_to_str(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32" (the form that plans carry)."""
    return str(dtype).removeprefix("torch.")


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def plan_buckets(specs: Iterable[TensorSpec], bucket_bytes: int,
                 direct_bytes: int = DIRECT_BYTES) -> list[dict]:
    """Bucket the tensors `specs` lists (in the order a sender produces them): the broadcast order.

    A tensor of `direct_bytes` or more, or larger than `bucket_bytes` (the only way a bucket
    exceeds the bound), gets a bucket of its own (`is_direct`), placed where the tensor comes.
    Smaller tensors collect, in order, in a packed bucket that large tensors pass: it is closed
    when the next small tensor would overflow it, once `bucket_bytes` of large tensors have passed
    it, or at the end, and placed where it closes. So a layer's biases and norms share one
    broadcast instead of one each between its matrices, and a small tensor trails its neighbours by
    at most `bucket_bytes`. Buckets are therefore not in the tensors' order; every tensor is in
    exactly one. Returns a list of buckets, each
    `{"nbytes": int, "tensors": [{"name", "shape", "dtype", "offset", "nbytes"}, ...]}`,
    where `offset` is the tensor's byte offset in the bucket buffer (multiple of ALIGN_BYTES).
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[dict] = []
    packed: list[dict] = []  # the open packed bucket's entries
    used = passed = 0  # its bytes so far; bytes of large tensors that passed it
    for name, shape, dtype in specs:
        dtype = dtype_to_str(dtype_from_str(dtype))  # normalize "torch.float32" -> "float32"
        numel = 1
        for dim in shape:
            numel *= int(dim)
        nbytes = numel * dtype_from_str(dtype).itemsize
        entry = {"name": name, "shape": [int(d) for d in shape], "dtype": dtype, "offset": 0,
                 "nbytes": nbytes}
        if nbytes >= direct_bytes or nbytes > bucket_bytes:
            buckets.append({"nbytes": nbytes, "tensors": [entry]})
            passed += nbytes if packed else 0
            continue
        offset = _align(used)
        if packed and (offset + nbytes > bucket_bytes or passed >= bucket_bytes):
            buckets.append({"nbytes": used, "tensors": packed})
            packed, offset, passed = [], 0, 0
        entry["offset"] = offset
        packed.append(entry)
        used = offset + nbytes
    if packed:
        buckets.append({"nbytes": used, "tensors": packed})
    return buckets


def is_direct(bucket: dict) -> bool:
    """A bucket that is one whole tensor: its bytes are the tensor's own, no packing needed."""
    entries = bucket["tensors"]
    return len(entries) == 1 and entries[0]["offset"] == 0 and entries[0]["nbytes"] == bucket["nbytes"]


def specs_of(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    """(name, tensor) pairs -> (name, shape, dtype string) specs for `plan_buckets`."""
    return [(name, list(t.shape), dtype_to_str(t.dtype)) for name, t in named_tensors]


def pack_bucket(
    bucket: dict, tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None
) -> torch.Tensor:
    """Copy `tensors` (in plan order) into one flat uint8 buffer of `bucket["nbytes"]` bytes.

    `out` (uint8, at least that long) is reused when given, else a buffer is allocated.
    A bucket holding one contiguous tensor is returned as a zero-copy uint8 view of it.
    Padding bytes between tensors are left as they are (never read by `unpack_bucket`; a sender
    that compares buckets across pushes clears them with `zero_padding`).
    """
    entries = bucket["tensors"]
    if len(entries) != len(tensors):
        raise ValueError(f"bucket plans {len(entries)} tensors, got {len(tensors)}")
    for entry, tensor in zip(entries, tensors, strict=True):
        _check(entry, tensor)
    if len(tensors) == 1 and tensors[0].is_contiguous() and tensors[0].device.type == "cpu":
        return tensors[0].detach().reshape(-1).view(torch.uint8)
    nbytes = bucket["nbytes"]
    buffer = torch.empty(nbytes, dtype=torch.uint8) if out is None else out[:nbytes]
    for entry, tensor in zip(entries, tensors, strict=True):
        start = entry["offset"]
        copy_bytes(buffer[start : start + entry["nbytes"]], tensor)
    return buffer


def copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy the bytes of CPU tensor `src` into the contiguous tensor `dst` (same byte size).

    A single-threaded memcpy through numpy, on purpose: torch's copy runs an OpenMP region
    whose threads then spin-wait, and on a 2-core machine that starves gloo's network
    threads (measured: a push at 0.7 GB/s instead of 2 GB/s).
    """
    src = src.detach()
    if not src.is_contiguous():
        src = src.contiguous()
    dst.reshape(-1).view(torch.uint8).numpy()[:] = src.reshape(-1).view(torch.uint8).numpy()


def zero_padding(bucket: dict, buffer: torch.Tensor) -> None:
    """Zero the bytes of `buffer` (uint8, the bucket's) that no tensor occupies: the gaps of
    ALIGN_BYTES alignment. A reused pack buffer holds stale bytes there, which a delta push would
    send as changes and a checksum would cover."""
    end = 0
    for entry in bucket["tensors"]:
        if entry["offset"] > end:
            buffer[end:entry["offset"]].zero_()
        end = entry["offset"] + entry["nbytes"]
    if bucket["nbytes"] > end:
        buffer[end:bucket["nbytes"]].zero_()


def unpack_bucket(bucket: dict, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Zero-copy views of a received uint8 buffer: [(name, tensor of the planned shape)].

    The views share `buffer`'s memory: do not reuse the buffer while they are alive.
    """
    if buffer.dtype != torch.uint8 or buffer.numel() < bucket["nbytes"]:
        raise ValueError(f"need a uint8 buffer of {bucket['nbytes']} bytes, got "
                         f"{buffer.dtype} x {buffer.numel()}")
    out = []
    for entry in bucket["tensors"]:
        start = entry["offset"]
        raw = buffer[start : start + entry["nbytes"]]
        out.append((entry["name"], raw.view(dtype_from_str(entry["dtype"])).view(entry["shape"])))
    return out


def _check(entry: dict, tensor: torch.Tensor) -> None:
    if list(tensor.shape) != entry["shape"] or dtype_to_str(tensor.dtype) != entry["dtype"]:
        raise ValueError(
            f"{entry['name']}: planned {entry['dtype']}{entry['shape']}, "
            f"got {dtype_to_str(tensor.dtype)}{list(tensor.shape)}"
        )
