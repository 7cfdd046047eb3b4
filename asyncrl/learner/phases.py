"""Per-phase wall time of learner steps: the model's body forward, the LM head, the backward and
the optimizer step, for `tools/gpu_check.py` to report where a step's time goes.

Outside `timing_phases` a phase label is a no-op. Inside it, each phase synchronizes the device
on entry and exit, so its wall time includes the kernels it launched: measuring costs those
syncs, which is why only a measuring step pays them. The backward includes the head's backward
and the layers recomputed under activation checkpointing.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

PHASES = ("forward", "head", "backward", "optimizer")
_clock: dict[str, float] | None = None


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Attribute the work inside to `name` (one of PHASES) while `timing_phases` runs."""
    clock = _clock
    if clock is None:
        yield
        return
    _sync()
    t0 = time.perf_counter()
    try:
        yield
    finally:
        _sync()
        clock[name] += time.perf_counter() - t0


@contextmanager
def timing_phases() -> Iterator[dict[str, float]]:
    """Seconds per phase of the learner work inside, filled in as it runs."""
    global _clock
    clock = dict.fromkeys(PHASES, 0.0)
    _clock = clock
    try:
        yield clock
    finally:
        _clock = None
