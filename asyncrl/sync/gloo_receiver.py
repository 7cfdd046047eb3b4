"""A gloo weight push received in place, into tensors the receiver already holds.

The receiving end for weights kept as plain tensors in checkpoint layout (name -> tensor), and
the reference receiver of the wire format in `gloo_sender.py`: tools/bench_weight_sync.py times
pushes against it, and tests check the protocol with it without vLLM. vLLM's receiver
(`vllm_gloo_engine.py`) cannot receive in place, because its layers repack weights when they
load, so it receives each bucket into a buffer and hands views of it to vLLM's loader; both check
the same header first and follow the same bucket plan.

A bucket that is one whole tensor (`buckets.is_direct`) is received straight into that tensor's
memory: no copy. Buckets of small tensors arrive in one of two reusable buffers and are copied
out while the next ones arrive. Up to MAX_IN_FLIGHT broadcasts are posted at once, in the plan's
order, so the receiver is always ready for the next bucket. A delta (`delta.py`) arrives in a
buffer of its own and is applied where the bucket's bytes are (the tensor's own memory, or a
bucket gathered from the tensors and copied back); every bucket is then checked against its
checksum.
"""

from __future__ import annotations

import time
from collections import deque

import torch

from asyncrl.sync.buckets import copy_bytes, dtype_to_str, is_direct, pack_bucket, unpack_bucket, zero_padding
from asyncrl.sync.delta import (PREFIX_WORDS, WHOLE, ChecksumMismatch, bucket_word, checksum, decode_bucket,
                                payload_nbytes)
from asyncrl.sync.wire import MAX_IN_FLIGHT, broadcast, check_header, open_gloo_group
from asyncrl.sync.protocol import WeightSyncError


class GlooWeightReceiver:
    """Rank `rank` (>= 1) of the weight-sync group; `receive` loads a push into `params`."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0,
                 local_host: str | None = None, join_timeout_s: float | None = None):
        self.host, self.port, self.rank, self.world_size = host, port, rank, world_size
        self.local_host = local_host  # this member's node address (open_gloo_group)
        self.timeout_s, self.join_timeout_s = timeout_s, join_timeout_s  # a push's; connect()'s (default timeout_s)
        self.where = f"gloo weight-sync group {host}:{port} (rank {rank} of {world_size})"
        self._group = self._store = None
        self._buffers: list[torch.Tensor] = []

    def connect(self) -> None:
        """Join the group; blocks until the sender and every other receiver join."""
        self._group, self._store = open_gloo_group(self.host, self.port, self.rank, self.world_size,
                                                   self.timeout_s, self.local_host, self.join_timeout_s)

    def receive(self, plan: list[dict], version: int, params: dict[str, torch.Tensor]) -> dict:
        """Receive push `version` (whose plan is `plan`, from the sender's metadata) into
        `params`, name -> CPU tensor of the planned shape and dtype; returns `sync/...` stats.

        Each bucket is checked against its checksum once applied; a bucket that fails is counted in
        `sync/verify_failures` rather than raised, so the group stays in step and the sender can
        follow with a whole push. A push whose header does not match raises WeightSyncError before
        any tensor changes; one that fails later leaves `params` a mix of two versions."""
        if self._group is None:
            raise RuntimeError("GlooWeightReceiver.receive before connect()")
        _check_params(plan, params)
        start = time.perf_counter()
        header = torch.zeros(4, dtype=torch.int64)
        self._wait(broadcast(self._group, header), version, "header")
        check_header(header, plan, version, self.where)
        self._failures = self._received = 0
        in_flight: deque = deque()  # (index, prefix, work, payload, packed buffer to copy out of or None)
        last_use: dict[int, int] = {}
        num_packed = 0
        prefix = torch.zeros(PREFIX_WORDS, dtype=torch.int64)
        prefix_work = broadcast(self._group, prefix)
        for index, bucket in enumerate(plan):
            self._wait(prefix_work, version, f"bucket {index}/{len(plan)}'s prefix")
            announced = prefix.tolist()
            buffer = None
            if announced[0] != WHOLE:  # a delta: applied where the bucket's bytes are once it is in
                payload = torch.empty(payload_nbytes(announced, bucket["nbytes"], bucket_word(bucket)),
                                      dtype=torch.uint8)
            elif (payload := _in_place(bucket, params)) is not None:
                pass
            elif is_direct(bucket):  # a strided destination: copy after
                buffer = payload = torch.empty(bucket["nbytes"], dtype=torch.uint8)
            else:
                slot, num_packed = num_packed % 2, num_packed + 1
                while in_flight and in_flight[0][0] <= last_use.get(slot, -1):
                    self._finish_oldest(in_flight, plan, params, version)  # frees its buffer
                buffer = payload = self._buffer(plan, slot)[: bucket["nbytes"]]
                last_use[slot] = index
            in_flight.append((index, announced, broadcast(self._group, payload), payload, buffer))
            self._received += 8 * PREFIX_WORDS + payload.numel()
            if index + 1 < len(plan):
                prefix = torch.zeros(PREFIX_WORDS, dtype=torch.int64)
                prefix_work = broadcast(self._group, prefix)
            if len(in_flight) > MAX_IN_FLIGHT:
                self._finish_oldest(in_flight, plan, params, version)
        while in_flight:
            self._finish_oldest(in_flight, plan, params, version)
        seconds = time.perf_counter() - start
        num_bytes = sum(b["nbytes"] for b in plan)
        return {"sync/version": version, "sync/num_bytes": num_bytes, "sync/push_bytes": self._received,
                "sync/verify_failures": self._failures, "sync/receive_s": seconds,
                "sync/receive_gb_per_s": num_bytes / seconds / 1e9}

    def close(self) -> None:
        self._group = self._store = None
        self._buffers = []

    def _finish_oldest(self, in_flight: deque, plan: list[dict], params: dict, version: int) -> None:
        index, announced, work, payload, buffer = in_flight.popleft()
        self._wait(work, version, f"bucket {index}/{len(plan)}")
        bucket = plan[index]
        if announced[0] == WHOLE:
            ok = checksum(payload) == announced[2]
        else:  # the bucket's current bytes: the tensor's own, or gathered from its tensors
            target = _in_place(bucket, params)
            if target is None:
                buffer = target = self._gather(bucket, params)
            try:
                decode_bucket(announced, payload, target, bucket_word(bucket))
                ok = True
            except ChecksumMismatch:
                ok = False
        self._failures += not ok
        if buffer is not None:
            for name, view in unpack_bucket(bucket, buffer):
                if params[name].is_contiguous():
                    copy_bytes(params[name], view)
                else:  # copy_bytes writes flat memory; a strided tensor needs torch's copy
                    params[name].copy_(view)

    @staticmethod
    def _gather(bucket: dict, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """The bucket's bytes as the receiver holds them, padding zeroed as the sender's are."""
        buffer = pack_bucket(bucket, [params[e["name"]] for e in bucket["tensors"]],
                             out=torch.empty(bucket["nbytes"], dtype=torch.uint8))
        if not is_direct(bucket):
            zero_padding(bucket, buffer)
        return buffer  # a copy: a bucket whose tensor's own bytes can take a delta never comes here

    def _buffer(self, plan: list[dict], slot: int) -> torch.Tensor:
        size = max(b["nbytes"] for b in plan if not is_direct(b))
        if len(self._buffers) != 2 or self._buffers[0].numel() < size:
            self._buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]
        return self._buffers[slot]

    def _wait(self, work, version: int, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:  # gloo timeout or the sender went away
            self._group = None
            raise WeightSyncError(f"weight receive version {version}: {what} from rank 0 of "
                                  f"{self.where} failed: {exc}") from exc


def _in_place(bucket: dict, params: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The destination's own bytes for a one-tensor bucket, when it is contiguous CPU memory."""
    if not is_direct(bucket):
        return None
    tensor = params[bucket["tensors"][0]["name"]]
    if not tensor.is_contiguous() or tensor.device.type != "cpu":
        return None
    return tensor.detach().reshape(-1).view(torch.uint8)


def _check_params(plan: list[dict], params: dict[str, torch.Tensor]) -> None:
    for bucket in plan:
        for entry in bucket["tensors"]:
            tensor = params.get(entry["name"])
            if tensor is None:
                raise ValueError(f"push plans {entry['name']}, which the receiver does not hold")
            if list(tensor.shape) != entry["shape"] or dtype_to_str(tensor.dtype) != entry["dtype"]:
                raise ValueError(f"{entry['name']}: planned {entry['dtype']}{entry['shape']}, "
                                 f"held {dtype_to_str(tensor.dtype)}{list(tensor.shape)}")
