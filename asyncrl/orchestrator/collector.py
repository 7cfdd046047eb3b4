"""The driver's cyclic garbage collector, run on a schedule instead of automatically.

The driver's one thread handles every sample of every actor: a record, a few lists and dicts
each, nearly all freed by reference counting as soon as their batch leaves. CPython's automatic
collector still walks them: a young collection every 700 container allocations, and full ones
over every live container (the buffered samples, the ledger, the step's statistics). Measured with
tools/bench_orchestrator.py (64 simulated actors, actor-scored samples, 2 cores) it took about
40% of the driver's time: about 12,000 samples/s with it, 20,000 without. Larger thresholds
alone recovered only half of that.

So the driver's process, once started:
- takes what start-up left alive (torch, transformers, Ray: a few hundred thousand objects) out
  of the collector's view for good (`gc.freeze`),
- turns automatic collection off,
- and collects in full every `every_s` seconds from its loop (`maybe_collect`), so reference
  cycles (tracebacks of caught exceptions, library internals) are still freed, within a bounded
  delay. Each collection is timed: `timing/gc_s` in the step metrics says what it costs.
`release` undoes all of it at shutdown: the interpreter's exit never collects frozen objects, and
extension types that count their live instances (nanobind's, in vLLM's dependencies) would print
leak reports after the run's last line.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

COLLECT_EVERY_S = 10.0


class ScheduledCollector:
    def __init__(self, every_s: float = COLLECT_EVERY_S, clock: Callable[[], float] = time.monotonic):
        self.every_s, self.clock = every_s, clock
        self._next: float | None = None  # None: not started (automatic collection as usual)
        self._was_enabled = True
        self.num_collections = 0
        self.total_s = 0.0
        self._window_s = 0.0  # since the last metrics row

    def start(self) -> None:
        """At the end of start-up."""
        gc.collect()
        gc.freeze()
        self._was_enabled = gc.isenabled()
        gc.disable()
        self._next = self.clock() + self.every_s

    def maybe_collect(self) -> bool:
        """A full collection if one is due; returns whether it ran."""
        if self._next is None or self.clock() < self._next:
            return False
        t0 = time.perf_counter()
        gc.collect()
        took = time.perf_counter() - t0
        self.num_collections += 1
        self.total_s += took
        self._window_s += took
        self._next = self.clock() + self.every_s
        return True

    def metrics(self) -> dict[str, float]:
        """Time spent collecting since the last call, and in all."""
        out = {"timing/gc_s": self._window_s, "timing/gc_total_s": self.total_s}
        self._window_s = 0.0
        return out

    def release(self) -> None:
        """At shutdown: frozen objects back in view, automatic collection as it was."""
        if self._next is None:
            return
        self._next = None
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
