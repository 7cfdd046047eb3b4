"""The weight-sync edge seen from the learner: one protocol, a gloo (CPU) and an NCCL (GPU) sender.

Order of calls (learner rank 0; the rollout side is in `vllm_receiver.py`):
    sender.connect()                  # concurrently with every actor's init_receiver
    meta = sender.metadata(params)    # plain data, sent to actors (Ray call) before the bytes
    sender.push(params, version)      # concurrently with every actor's receive_weights
    sender.close()
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightSyncError(RuntimeError):
    """A push or join failed or timed out; the message names the version and the group."""


class WeightSender(Protocol):
    def connect(self) -> None:
        """Host the rendezvous and join the group as rank 0 (blocks until all ranks join)."""

    def metadata(self, named_params: NamedTensors) -> dict:
        """Plain-data description of the next pushes (names, shapes, dtypes, buckets)."""

    def push(self, named_params: NamedTensors, version: int, whole: bool = False) -> dict:
        """Broadcast the weights; returns `sync/...` stats. Raises WeightSyncError on timeout.
        `whole`: no part of it as a delta against what the engines held (after a failed checksum)."""

    def close(self) -> None:
        """Leave the group; the sender cannot push afterwards."""
