"""The twin's virtual clock: a queue of callbacks by time, ties in the order they were scheduled
(so a run is a pure function of its inputs)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventQueue:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[float], None]) -> None:
        if t < self.now:
            raise ValueError(f"an event at {t} is in the past (now {self.now})")
        heapq.heappush(self._heap, (t, next(self._seq), fn))

    def run_next(self) -> bool:
        """Run the earliest event; False when none is left."""
        if not self._heap:
            return False
        self.now, _, fn = heapq.heappop(self._heap)
        fn(self.now)
        return True
