"""zmq PUSH/PULL streams of msgpack frames: the bulk-data edges between processes.

A `FrameReceiver` binds (on the cluster's own address, on a free port) and decodes each frame
with the codec it was given; a frame the codec rejects is dropped and counted, and the stream
goes on. A `FrameSender` connects to a receiver's endpoint. Rollout actors stream samples to the
orchestrator this way, and the orchestrator streams batches to learner ranks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Generic, TypeVar

import zmq

from asyncrl.transport.codec import FrameError

T = TypeVar("T")
log = logging.getLogger(__name__)

# Bounded queues: a sender blocks (instead of growing memory without limit) when a receiver
# stops reading; 10k frames is far beyond what one step needs.
HIGH_WATER_MARK = 10_000


class FrameReceiver(Generic[T]):
    """PULL socket bound to `tcp://host:<free port>`; `endpoint` is what senders connect to."""

    def __init__(self, decode: Callable[[bytes], T], host: str = "127.0.0.1"):
        self._decode = decode
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self.num_received = 0
        self.num_dropped = 0

    def recv(self, timeout_s: float) -> T | None:
        """The next valid record, or None if none arrives within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sock.poll(remaining_ms):
                return None
            record = self._decode_one(self._sock.recv(copy=True))
            if record is not None:
                return record
            if time.monotonic() >= deadline:
                return None

    def drain(self, max_items: int = 100_000) -> list[T]:
        """Every valid record already waiting, without blocking."""
        out: list[T] = []
        while len(out) < max_items:
            try:
                frame = self._sock.recv(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            record = self._decode_one(frame)
            if record is not None:
                out.append(record)
        return out

    def _decode_one(self, frame: bytes) -> T | None:
        self.num_received += 1
        try:
            return self._decode(frame)
        except FrameError as e:
            self.num_dropped += 1
            log.warning("dropped a malformed frame on %s: %s", self.endpoint, e)
            return None

    def close(self) -> None:
        self._sock.close(linger=0)


class FrameSender:
    """PUSH socket connected to one receiver's endpoint."""

    def __init__(self, endpoint: str, send_timeout_s: float = 60.0):
        self._sock = zmq.Context.instance().socket(zmq.PUSH)
        self._sock.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
        self._sock.setsockopt(zmq.SNDTIMEO, int(send_timeout_s * 1000))
        self._sock.setsockopt(zmq.LINGER, 5000)
        self._sock.connect(endpoint)
        self.endpoint = endpoint

    def send(self, frame: bytes) -> None:
        try:
            self._sock.send(frame, copy=False)
        except zmq.Again as e:
            raise TimeoutError(f"receiver at {self.endpoint} stopped reading") from e

    def close(self) -> None:
        self._sock.close()
