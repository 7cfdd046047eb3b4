"""Learner side of the CPU weight sync: bucketed gloo broadcasts from rank 0 to every receiver.

The group is a standalone `ProcessGroupGloo` over its own TCPStore, never the default process
group: the learner's DDP group is the default one, and weight pushes must not interleave
with its collectives. Receivers (vLLM workers, see `vllm_gloo_engine.py`) join the same
group with `open_gloo_group` and ranks 1..world_size-1.

Wire format of one push: a 4 x int64 header [magic, version, num_buckets, num_bytes], then
one uint8 broadcast per bucket of the plan from `buckets.plan_buckets`. The header lets a
receiver refuse a push whose shape differs from the metadata it was given, instead of
loading garbage. Packing bucket k+1 overlaps with the broadcast of bucket k (two buffers).
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta

import torch
from torch.distributed import BroadcastOptions, PrefixStore, ProcessGroupGloo, TCPStore

from asyncrl.sync.buckets import pack_bucket, plan_buckets, specs_of
from asyncrl.sync.protocol import NamedTensors, WeightSyncError

HEADER_MAGIC = 0x5753594E43  # "WSYNC": guards against a receiver joining the wrong stream


def open_gloo_group(
    host: str, port: int, rank: int, world_size: int, timeout_s: float
) -> tuple[ProcessGroupGloo, TCPStore]:
    """Join the weight-sync group; rank 0 hosts the TCPStore. Blocks until all ranks join.

    Returns the gloo backend (ranks are group ranks) and the store, which must outlive it.
    """
    timeout = timedelta(seconds=timeout_s)
    where = f"gloo weight-sync group {host}:{port} (rank {rank} of {world_size})"
    try:
        store = TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout,
                         wait_for_workers=False)
        group = ProcessGroupGloo(PrefixStore("asyncrl/weights", store), rank, world_size, timeout)
    except RuntimeError as exc:  # torch raises DistStoreError (a RuntimeError) on timeout
        raise WeightSyncError(f"could not join {where} within {timeout_s:.0f}s: {exc}") from exc
    return group, store


def broadcast(group: ProcessGroupGloo, tensor: torch.Tensor):
    """Start a broadcast from rank 0 of `tensor` (in place on receivers); returns the Work."""
    opts = BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    return group.broadcast([tensor], opts)


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on `host` (the weight-sync rendezvous; tests)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class GlooWeightSender:
    """Rank 0 of the weight-sync group. Not thread-safe: one push at a time.

    Parameters are CPU tensors named as in the Hugging Face checkpoint (what vLLM's
    `load_weights` expects), e.g. `model.named_parameters()` of the unwrapped model. On
    these machines buckets of 16-64 MB suit vLLM-CPU receivers better than 256 MB (see
    tools/bench_weight_sync.py).
    """

    def __init__(self, host: str, port: int, world_size: int, timeout_s: float = 300.0,
                 bucket_bytes: int = 256 << 20):
        self.host, self.port, self.world_size = host, port, world_size
        self.timeout_s, self.bucket_bytes = timeout_s, bucket_bytes
        self._group: ProcessGroupGloo | None = None
        self._store: TCPStore | None = None
        self._plan: list[dict] | None = None
        self._buffers: list[torch.Tensor] = []

    def connect(self) -> None:
        """Host the store and join as rank 0; every receiver must be joining concurrently."""
        self._group, self._store = open_gloo_group(
            self.host, self.port, 0, self.world_size, self.timeout_s)

    def metadata(self, named_params: NamedTensors) -> dict:
        """The bucket plan for these parameters (plain data); receivers need it before `push`."""
        self._plan = plan_buckets(specs_of(named_params), self.bucket_bytes)
        return {
            "kind": "gloo",
            "update_info": {"buckets": self._plan},
            "num_tensors": sum(len(b["tensors"]) for b in self._plan),
            "num_bytes": sum(b["nbytes"] for b in self._plan),
        }

    def push(self, named_params: NamedTensors, version: int) -> dict:
        """Broadcast the parameters bucket by bucket; returns `sync/...` stats.

        `named_params` must match the last `metadata()` (names, shapes, dtypes, order). It is
        read lazily, one bucket ahead at most: a sharded learner gathers each parameter as it
        is needed, never the whole model at once.
        """
        if self._group is None:
            raise RuntimeError("GlooWeightSender.push before connect() (or after close())")
        if self._plan is None:
            raise RuntimeError("GlooWeightSender.push before metadata(): receivers need the plan")
        plan, params = self._plan, iter(named_params)
        num_bytes = sum(b["nbytes"] for b in plan)
        start = time.perf_counter()
        header = torch.tensor([HEADER_MAGIC, version, len(plan), num_bytes], dtype=torch.int64)
        self._wait(broadcast(self._group, header), version, "header")
        pending = None
        for index, bucket in enumerate(plan):
            tensors = [self._checked(entry, next(params, None)) for entry in bucket["tensors"]]
            buffer = pack_bucket(bucket, tensors, self._buffer(index))
            work = broadcast(self._group, buffer)
            if pending is not None:  # bucket index-1 done: its buffer may be reused next
                self._wait(pending, version, f"bucket {index - 1}/{len(plan)}")
            pending = work
        if pending is not None:
            self._wait(pending, version, f"bucket {len(plan) - 1}/{len(plan)}")
        if next(params, None) is not None:
            raise ValueError("push() got more parameters than the last metadata() planned")
        seconds = time.perf_counter() - start
        return {"sync/version": version, "sync/num_bytes": num_bytes,
                "sync/num_buckets": len(plan), "sync/push_s": seconds,
                "sync/push_gb_per_s": num_bytes / seconds / 1e9}

    def close(self) -> None:
        """Drop the group and the store (receivers see their next collective fail)."""
        self._group = self._store = None
        self._buffers = []

    @staticmethod
    def _checked(entry: dict, item: tuple[str, torch.Tensor] | None) -> torch.Tensor:
        """The next parameter, which must be the one the plan has next. A mismatch is caught
        before its bucket is broadcast, so receivers never load a wrong layout."""
        got = None if item is None else specs_of([item])[0]
        if got != (entry["name"], list(entry["shape"]), entry["dtype"]):
            raise ValueError(f"push() parameter {got} differs from the last metadata()'s "
                             f"{(entry['name'], entry['shape'], entry['dtype'])}; call metadata() again and "
                             "send it to the receivers first")
        return item[1]

    def _buffer(self, index: int) -> torch.Tensor:
        """One of two reusable pack buffers, large enough for the biggest bucket."""
        size = max(b["nbytes"] for b in self._plan)
        if len(self._buffers) != 2 or self._buffers[0].numel() < size:
            self._buffers = [torch.empty(size, dtype=torch.uint8) for _ in range(2)]
        return self._buffers[index % 2]

    def _wait(self, work, version: int, what: str) -> None:
        try:
            work.wait()
        except RuntimeError as exc:  # gloo: timeout or a peer that went away
            self._group = None  # a failed collective leaves the group unusable
            raise WeightSyncError(
                f"weight push version {version}: {what} to gloo group {self.host}:{self.port} "
                f"(world size {self.world_size}) failed after <= {self.timeout_s:.0f}s: {exc}"
            ) from exc
