"""zmq PUSH/PULL streams of msgpack frames: the bulk-data edges between processes.

A `FrameReceiver` binds (on the cluster's own address, on a free port) and decodes each frame
into its records with the codec it was given; a frame the codec rejects is dropped and counted,
and the stream goes on. A `FrameSender` connects to a receiver's endpoint. Rollout actors stream samples to the
orchestrator this way, and the orchestrator streams batches to learner ranks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
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
    """PULL socket bound to `tcp://host:<free port>`; `endpoint` is what senders connect to.

    `decode` turns one frame into the records it carries (a rollout actor sends the samples
    that finished together in one frame); `recv` and `drain` hand out records, not frames."""

    def __init__(self, decode: Callable[[bytes], list[T]], host: str = "127.0.0.1"):
        self._decode = decode
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{port}"
        self._ready: deque[T] = deque()  # decoded, not handed out yet
        self.num_frames = 0
        self.num_received = 0  # records in valid frames
        self.num_dropped = 0  # frames

    def recv(self, timeout_s: float) -> T | None:
        """The next valid record, or None if none arrives within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while not self._ready:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sock.poll(remaining_ms):
                return None
            self._ready.extend(self._decode_one(self._sock.recv(copy=True)))
            if not self._ready and time.monotonic() >= deadline:
                return None
        return self._ready.popleft()

    def take(self, wait_s: float) -> list[T]:
        """Every record waiting; with none, the first to arrive within `wait_s` (a loop that
        turns on arrivals waits a little instead of spinning)."""
        out = self.drain()
        if not out and (record := self.recv(timeout_s=wait_s)) is not None:
            out = [record]
        return out

    def drain(self, max_frames: int = 100_000) -> list[T]:
        """Every valid record already waiting, without blocking."""
        out, self._ready = list(self._ready), deque()
        for _ in range(max_frames):
            try:
                frame = self._sock.recv(flags=zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            out += self._decode_one(frame)
        return out

    def _decode_one(self, frame: bytes) -> list[T]:
        self.num_frames += 1
        try:
            records = self._decode(frame)
        except FrameError as e:
            self.num_dropped += 1
            log.warning("dropped a malformed frame on %s: %s", self.endpoint, e)
            return []
        self.num_received += len(records)
        return records

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


class RecordBatcher(Generic[T]):
    """Sends records as they come, in one frame for all those that come in the same turn of the
    asyncio event loop: the samples of one engine step finish together, and a frame per sample
    costs the receiver (the driver's one thread, decoding every actor's stream) a socket read and
    a decode each. Nothing waits for a batch to fill: the frame leaves at the end of the turn.
    Call it from the event loop's thread only (a zmq socket is not thread-safe)."""

    MAX_RECORDS = 1024  # a frame's records at most: a burst goes out in several frames

    def __init__(self, sender: FrameSender, encode: Callable[[list[T]], bytes]):
        self._sender, self._encode = sender, encode
        self._pending: list[T] = []

    def __call__(self, record: T) -> None:
        self._pending.append(record)
        if len(self._pending) >= self.MAX_RECORDS:
            self.flush()
        elif len(self._pending) == 1:
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        records, self._pending = self._pending, []
        if records:
            self._sender.send(self._encode(records))

    def close(self) -> None:
        """Drop what is not sent yet and close the socket (a run's stream that is over)."""
        self._pending = []
        self._sender.close()
