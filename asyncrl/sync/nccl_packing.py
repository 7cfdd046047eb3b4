"""The producer side of vLLM's packed NCCL weight transfer, without vLLM.

vLLM's receivers (`packed_nccl_broadcast_consumer` in vllm/distributed/weight_transfer/
packed_tensor.py) read a push as a sequence of uint8 broadcasts cut from the update's metadata:
tensors in order, each appended whole as its raw bytes, and a chunk closes right after the tensor
that takes its size past `bucket_bytes` (a chunk can exceed the bound by one tensor; the last
chunk holds the rest). The receiver allocates each chunk, receives it, splits it by the tensors'
byte sizes and views each piece with its dtype and shape. This module cuts the same chunks on the
learner's side, as vLLM's own producer does, so that only the rendezvous needs vLLM: the packing
runs, and is tested, where vLLM is absent (CI on CPU tensors, a GPU machine without vLLM).

On CUDA the chunks are packed and broadcast on `num_buffers` side streams in turn (double
buffering: packing chunk i+1 overlaps the broadcast of chunk i), as in vLLM's producer, into
buffers the sender allocates once and keeps (vLLM's producer concatenates a new one per chunk).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import cache
from typing import Protocol

import torch


class Broadcaster(Protocol):
    """What a push needs of the group: vLLM's PyNcclCommunicator has this method."""

    def broadcast(self, tensor: torch.Tensor, src: int) -> None: ...


def chunk_sizes(sizes: Iterable[int], bucket_bytes: int) -> list[int]:
    """The byte size of each broadcast a push of tensors of these byte sizes makes (the same rule
    as `packed_chunks`, from sizes alone)."""
    chunks, filled = [], 0
    for size in sizes:
        filled += size
        if filled > bucket_bytes:
            chunks, filled = chunks + [filled], 0
    return chunks + ([filled] if filled else [])


def num_chunks(sizes: Iterable[int], bucket_bytes: int) -> int:
    return len(chunk_sizes(sizes, bucket_bytes))


def packed_chunks(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, device: torch.device,
                  buffers: list[torch.Tensor] | None = None) -> Iterator[tuple[torch.Tensor, list[str]]]:
    """(flat uint8 chunk on `device`, names in it) for each broadcast, read lazily: a sharded
    learner gathers each parameter only when it is its turn. With `buffers` (uint8, on `device`,
    each as large as the largest chunk), chunk i is packed into the front of buffers[i % len],
    which the caller must no longer be sending from; else each chunk is a new tensor."""
    pieces: list[torch.Tensor] = []
    names: list[str] = []
    filled = sent = 0

    def pack():
        if buffers is None:
            return torch.cat(pieces)
        return torch.cat(pieces, out=buffers[sent % len(buffers)][:filled])

    for name, tensor in named:
        flat = tensor.detach().to(device).contiguous().view(-1).view(torch.uint8)
        pieces.append(flat)
        names.append(name)
        filled += flat.numel()
        if filled > bucket_bytes:
            yield pack(), names
            pieces, names, filled, sent = [], [], 0, sent + 1
    if pieces:
        yield pack(), names


@cache
def _streams(device_index: int, num_buffers: int) -> tuple:
    # cached: the caching allocator keys blocks by stream, so fresh streams per push would strand
    # each push's chunk memory (the reason vLLM caches its producer's streams too)
    return tuple(torch.cuda.Stream(device=device_index) for _ in range(num_buffers))


def reset_streams() -> None:
    """Forget the cached side streams (after an aborted push: kernels of the dead communicator
    may still be queued on them); the next push makes new ones."""
    _streams.cache_clear()


def broadcast_packed(group: Broadcaster, named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int,
                     device: torch.device, num_buffers: int = 2, src: int = 0,
                     buffers: list[torch.Tensor] | None = None) -> int:
    """Broadcast the tensors as vLLM's packed consumer expects; returns the chunks sent.
    `buffers`: `num_buffers` of them to pack into (`packed_chunks`), kept by the caller across
    pushes; chunk i goes out of buffer i % num_buffers on stream i % num_buffers, so a buffer is
    refilled only after its stream's last broadcast has finished."""
    if buffers is not None and len(buffers) != num_buffers:
        raise ValueError(f"{len(buffers)} packing buffers for {num_buffers} streams")
    chunks = packed_chunks(named, bucket_bytes, device, buffers)
    if device.type != "cuda":
        sent = 0
        for packed, _ in chunks:
            group.broadcast(packed, src=src)
            sent += 1
        return sent
    streams = _streams(device.index if device.index is not None else torch.cuda.current_device(), num_buffers)
    in_flight: list = [None] * num_buffers  # a chunk must outlive its asynchronous broadcast
    slot = sent = 0
    while True:
        streams[slot].synchronize()  # the broadcast that last used this slot has finished
        in_flight[slot] = None
        with torch.cuda.stream(streams[slot]):
            chunk = next(chunks, None)  # packs on this stream: the generator runs here
            if chunk is None:
                break
            group.broadcast(chunk[0], src=src)
        in_flight[slot] = chunk
        slot, sent = (slot + 1) % num_buffers, sent + 1
    for stream in streams:
        stream.synchronize()
    return sent
