"""Learner side of the CPU weight sync: bucketed gloo broadcasts from rank 0 to every receiver.

The group is a standalone `ProcessGroupGloo` over its own TCPStore, never the default process
group: the learner's DDP group is the default one, and weight pushes must not interleave
with its collectives. Receivers (vLLM workers, see `vllm_gloo_engine.py`) join the same
group with `open_gloo_group` and ranks 1..world_size-1.

Wire format: see wire.py (a header, then per bucket a prefix and its payload). A bucket that is one large
tensor is broadcast whole from the parameter's own memory; small tensors are packed into one of two reusable buffers
(allocated once, so no push pays page faults on fresh memory). Up to MAX_IN_FLIGHT broadcasts
are queued at once, over the group's GLOO_CONNECTIONS connections, so gloo sends bucket after
bucket with no gap while the next is packed. All ranks must open the group with
`open_gloo_group` (same connections); the vLLM receiver does.

With `transfer="delta"` the sender keeps a shadow of each bucket as the engines hold it (their
dtype's bytes, one model copy on this rank) and sends only the elements whose bits changed
(`delta.encode_bucket`); a bucket goes whole when that is smaller, when there is no shadow (the
first push after `metadata()`, i.e. after any change of the group's members), on a push asked
`whole`, and on one push in `full_every`.
"""

from __future__ import annotations

import time
from collections import deque

import torch
from torch.distributed import ProcessGroupGloo, TCPStore

from asyncrl.sync.buckets import copy_bytes, is_direct, pack_bucket, plan_buckets, specs_of, zero_padding
from asyncrl.sync.delta import WHOLE, bucket_word, checksum, encode_bucket
from asyncrl.sync.protocol import NamedTensors, WeightSyncError
from asyncrl.sync.wire import MAX_IN_FLIGHT, broadcast, open_gloo_group, push_header

class GlooWeightSender:
    """Rank 0 of the weight-sync group. Not thread-safe: one push at a time.

    Parameters are CPU tensors named as in the Hugging Face checkpoint (what vLLM's
    `load_weights` expects), e.g. `model.named_parameters()` of the unwrapped model. On
    these machines buckets of 16-64 MB suit vLLM-CPU receivers better than 256 MB (see
    tools/bench_weight_sync.py).
    """

    def __init__(self, host: str, port: int, world_size: int, timeout_s: float = 300.0,
                 bucket_bytes: int = 256 << 20, transfer: str = "full", full_every: int = 0,
                 join_timeout_s: float | None = None):
        if transfer not in ("full", "delta"):
            raise ValueError(f"transfer must be 'full' or 'delta', got {transfer!r}")
        self.host, self.port, self.world_size = host, port, world_size
        self.timeout_s, self.bucket_bytes = timeout_s, bucket_bytes
        self.join_timeout_s = join_timeout_s  # connect()'s (default timeout_s): see wire.open_gloo_group
        self.transfer, self.full_every = transfer, full_every
        self._shadows: list[torch.Tensor | None] = []  # per bucket, what the engines hold (delta only)
        self._deltas_since_whole = 0
        self.corrupt_next = False
        """Fault injection: flip one bit of the next push's first payload after its checksum is taken."""
        self._group: ProcessGroupGloo | None = None
        self._store: TCPStore | None = None
        self._plan: list[dict] | None = None
        self._buffers: list[torch.Tensor] = []  # two pack buffers for buckets of small tensors

    def connect(self) -> None:
        """Host the store and join as rank 0; every receiver must be joining concurrently."""
        self._group, self._store = open_gloo_group(
            self.host, self.port, 0, self.world_size, self.timeout_s, join_timeout_s=self.join_timeout_s)

    def metadata(self, named_params: NamedTensors) -> dict:
        """The bucket plan for these parameters (plain data); receivers need it before `push`."""
        self._specs = specs_of(named_params)
        self._plan = plan_buckets(self._specs, self.bucket_bytes)
        self._place = {e["name"]: (index, e) for index, b in enumerate(self._plan) for e in b["tensors"]}
        self._shadows = [None] * len(self._plan)  # a new plan or new members: what they hold is unknown
        return {
            "kind": "gloo",
            "update_info": {"buckets": self._plan, "transfer": self.transfer},
            "num_tensors": sum(len(b["tensors"]) for b in self._plan),
            "num_bytes": sum(b["nbytes"] for b in self._plan),
        }

    def push(self, named_params: NamedTensors, version: int, whole: bool = False) -> dict:
        """Broadcast the parameters bucket by bucket; returns `sync/...` stats. `whole`: no bucket
        as a delta (after an engine failed a checksum).

        `named_params` must match the last `metadata()` (names, shapes, dtypes, order). It is
        read lazily: a sharded learner gathers each parameter as it is needed, never the whole
        model at once. A small tensor is copied into its bucket when it comes; a large one is
        held until its broadcast is done (at most MAX_IN_FLIGHT of them).
        """
        if self._group is None:
            raise RuntimeError("GlooWeightSender.push before connect() (or after close())")
        if self._plan is None:
            raise RuntimeError("GlooWeightSender.push before metadata(): receivers need the plan")
        plan = self._plan
        start = time.perf_counter()
        self._whole = whole or self.transfer == "full" or any(s is None for s in self._shadows) or (
            self.full_every > 0 and self._deltas_since_whole >= self.full_every - 1)
        self._sent_bytes, self._compared_bytes, self._changed_bytes = 0, 0, 0
        header = torch.tensor(push_header(plan, version), dtype=torch.int64)
        self._wait(broadcast(self._group, header), version, "header")
        self._in_flight: deque = deque()  # (bucket index, work, buffer: kept alive until sent)
        staged: dict[int, torch.Tensor] = {}  # complete buckets waiting for their turn
        packed: dict[int, tuple[torch.Tensor, int]] = {}  # open packed bucket -> (buffer, tensors in)
        last_in_slot = [-1, -1]  # the packed bucket that last used each pack buffer
        sent = num_packed = 0
        for count, item in enumerate(named_params):
            tensor = self._checked(count, item)
            index, entry = self._place[item[0]]
            bucket = plan[index]
            if is_direct(bucket):
                staged[index] = pack_bucket(bucket, [tensor])  # its own bytes (a copy if strided)
            else:
                if index not in packed:  # a new bucket: the pack buffer of the one two back
                    slot, num_packed = num_packed % 2, num_packed + 1
                    if last_in_slot[slot] >= sent:  # cannot happen: plan_buckets closes in order
                        raise RuntimeError(f"bucket {last_in_slot[slot]} still waits in its pack buffer")
                    self._wait_through(last_in_slot[slot], version, len(plan))  # then it is free
                    last_in_slot[slot] = index
                    packed[index] = (self._buffer(slot)[: bucket["nbytes"]], 0)
                    zero_padding(bucket, packed[index][0])  # stale bytes there would read as changes
                buffer, filled = packed[index]
                copy_bytes(buffer[entry["offset"] : entry["offset"] + entry["nbytes"]], tensor)
                packed[index] = (buffer, filled + 1)
                if filled + 1 == len(bucket["tensors"]):
                    staged[index] = packed.pop(index)[0]
            while sent in staged:
                self._send(sent, staged.pop(sent), version, len(plan))
                sent += 1
        if sent != len(plan):
            raise ValueError("push() got fewer parameters than the last metadata() planned")
        self._wait_through(len(plan) - 1, version, len(plan))
        seconds = time.perf_counter() - start
        num_bytes = sum(b["nbytes"] for b in plan)
        self._deltas_since_whole = 0 if self._whole else self._deltas_since_whole + 1
        out = {"sync/version": version, "sync/num_bytes": num_bytes, "sync/push_bytes": self._sent_bytes,
               "sync/whole": float(self._whole), "sync/num_buckets": len(plan), "sync/push_s": seconds,
               "sync/push_gb_per_s": num_bytes / seconds / 1e9}
        if self._compared_bytes:  # the fraction of compared bytes in changed elements
            out["sync/changed_frac"] = self._changed_bytes / self._compared_bytes
        return out

    def close(self) -> None:
        """Drop the group and the store (receivers see their next collective fail)."""
        self._group = self._store = None
        self._buffers, self._shadows = [], []

    def _checked(self, count: int, item: tuple[str, torch.Tensor]) -> torch.Tensor:
        """Parameter `count`, which must be the one the metadata had there. A mismatch is caught
        before its bucket is broadcast, so receivers never load a wrong layout."""
        want = self._specs[count] if count < len(self._specs) else None
        got = specs_of([item])[0]
        if want is None:
            raise ValueError("push() got more parameters than the last metadata() planned")
        if got != want:
            raise ValueError(f"push() parameter {got} differs from the last metadata()'s {want}; call "
                             "metadata() again and send it to the receivers first")
        return item[1]

    def _buffer(self, slot: int) -> torch.Tensor:
        """Pack buffer `slot` (0 or 1), large enough for the biggest packed bucket; kept for
        later pushes."""
        size = max(b["nbytes"] for b in self._plan if not is_direct(b))
        if len(self._buffers) != 2 or self._buffers[0].numel() < size:
            self._buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]
        return self._buffers[slot]

    def _send(self, index: int, buffer: torch.Tensor, version: int, num_buckets: int) -> None:
        """Broadcast bucket `index` (`buffer`: its bytes) as its prefix and payload."""
        if self.transfer == "delta":
            word = bucket_word(self._plan[index])
            # the shadow advances as the bucket is encoded: the changed elements written in place
            prefix, payload, changed = encode_bucket(self._shadows[index], buffer, word, self._whole, advance=True)
            if changed is not None:
                self._compared_bytes += buffer.numel()
                self._changed_bytes += changed * word
            if self._shadows[index] is None:
                self._shadows[index] = buffer.clone()
        else:
            prefix, payload = [WHOLE, -1, checksum(buffer)], buffer
        if self.corrupt_next:
            payload, self.corrupt_next = payload.clone(), False
            payload[-1] ^= 1
        prefix = torch.tensor(prefix, dtype=torch.int64)
        self._sent_bytes += prefix.numel() * 8 + payload.numel()
        self._in_flight.append((index, broadcast(self._group, prefix), prefix))
        self._in_flight.append((index, broadcast(self._group, payload), payload))
        while len(self._in_flight) > MAX_IN_FLIGHT:
            self._wait_through(self._in_flight[0][0], version, num_buckets)

    def _wait_through(self, index: int, version: int, num_buckets: int) -> None:
        """Wait until the broadcasts of buckets up to `index` are done."""
        while self._in_flight and self._in_flight[0][0] <= index:
            done, work, _ = self._in_flight.popleft()
            self._wait(work, version, f"bucket {done}/{num_buckets}")

    def _wait(self, work, version: int, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:  # gloo: timeout or a peer that went away
            self._group = None  # a failed collective leaves the group unusable
            raise WeightSyncError(
                f"weight push version {version}: {what} to gloo group {self.host}:{self.port} "
                f"(world size {self.world_size}) failed after <= {self.timeout_s:.0f}s: {exc}"
            ) from exc
