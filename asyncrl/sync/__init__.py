"""Weight sync: the learner's senders (gloo on CPU, NCCL on GPUs) and the engines' receivers.

`make_sender` is the factory; the protocol is in protocol.py, what both ends share in wire.py.
"""

from __future__ import annotations

from typing import Literal

from asyncrl.sync.protocol import WeightSender


def make_sender(
    kind: Literal["gloo", "nccl"],
    host: str,
    port: int,
    world_size: int,
    timeout_s: float = 300.0,
    bucket_bytes: int = 256 << 20,
    transfer: Literal["full", "delta"] = "full",
    full_every: int = 0,
    join_timeout_s: float | None = None,
) -> WeightSender:
    """Build the sender for `kind`; `world_size` counts the learner plus every receiving worker.
    `transfer`/`full_every`: see GlooWeightSender (NCCL pushes are whole). `join_timeout_s`: how
    long connect() waits for the members, where it differs from a push's timeout_s."""
    if kind == "gloo":
        from asyncrl.sync.gloo_sender import GlooWeightSender

        return GlooWeightSender(host, port, world_size, timeout_s, bucket_bytes, transfer, full_every, join_timeout_s)
    if transfer != "full":
        raise ValueError(f"sync.transfer={transfer!r} is implemented for sync.type=gloo only; NCCL pushes are whole")
    if kind == "nccl":
        from asyncrl.sync.nccl_sender import NcclWeightSender

        return NcclWeightSender(host, port, world_size, timeout_s, bucket_bytes, join_timeout_s)
    raise ValueError(f"sync kind must be 'gloo' or 'nccl', got {kind!r}")
