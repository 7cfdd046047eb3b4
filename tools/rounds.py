"""Comparative benchmarks in alternating rounds, with the machine's other load measured: a torch
process with two threads slows several-fold when anything else runs on two cores, so a side
measured beside other work is not a measurement of that side.

    results = alternate({"trl": run_trl, "asyncrl": run_ours}, rounds=3)

Each round runs every side once (ABAB...); `LoadMeter` records, while a side runs, the cores used
by processes outside this benchmark's process tree. `verdict` refuses a comparison whose sides
saw different load (by more than `max_gap` cores, medians) or a busy machine (`max_other` cores).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from typing import Any


class LoadMeter:
    """CPU seconds a second used by processes that are not this one or its descendants (Ray's
    workers, vLLM's engine, reward workers are descendants), sampled every `every_s`."""

    def __init__(self, every_s: float = 0.25):
        self.every_s = every_s
        self.other_cores = 0.0

    def _ours(self) -> float:
        import psutil

        me = psutil.Process(os.getpid())
        for p in [me, *me.children(recursive=True)]:
            try:
                t = p.cpu_times()
                cpu = t.user + t.system
            except psutil.Error:
                continue
            self._first.setdefault(p.pid, 0.0 if self._started else cpu)  # born during the side: from 0
            self._last[p.pid] = cpu
        return sum(self._last[pid] - self._first[pid] for pid in self._last)

    def _busy(self) -> float:
        import psutil

        t = psutil.cpu_times()
        return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)

    def __enter__(self) -> "LoadMeter":
        self._first, self._last, self._started = {}, {}, False
        self._ours()
        self._started = True
        self._t0, self._busy0, self._stop = time.monotonic(), self._busy(), threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            self._ours()

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        ours, wall = self._ours(), time.monotonic() - self._t0
        self.other_cores = max(self._busy() - self._busy0 - ours, 0.0) / wall


def alternate(sides: dict[str, Callable[[], dict]], rounds: int, say=print) -> dict[str, list[dict]]:
    """Every side once a round, in turns; each result gets its `other_cores`."""
    out: dict[str, list[dict]] = {name: [] for name in sides}
    for r in range(rounds):
        for name, run in sides.items():
            with LoadMeter() as load:
                result = run()
            result["other_cores"] = load.other_cores
            out[name].append(result)
            say(f"round {r + 1} {name}: " + ", ".join(f"{k} {v:.4g}" for k, v in result.items()
                                                    if isinstance(v, (int, float)) and not isinstance(v, bool)))
    return out


def verdict(results: dict[str, list[dict]], max_gap: float = 0.3, max_other: float = 0.5) -> str | None:
    """Why the comparison must not be reported (None: it may be): the sides' median other load
    differs by more than `max_gap` cores, or one of them exceeds `max_other`."""
    loads = {name: statistics.median(r["other_cores"] for r in rs) for name, rs in results.items()}
    text = ", ".join(f"{name} {v:.2f}" for name, v in loads.items())
    if max(loads.values()) - min(loads.values()) > max_gap:
        return f"uneven load between the sides (other processes' cores, median: {text}); rerun on an idle machine"
    if max(loads.values()) > max_other:
        return f"the machine was busy (other processes' cores, median: {text}); rerun on an idle machine"
    return None


def median_ratio(results: dict[str, list[dict]], key: str, num: str, den: str) -> float:
    """Median over rounds of num's `key` / den's `key` (each round's own pair)."""
    return statistics.median(a[key] / b[key] for a, b in zip(results[num], results[den]))


def report(results: dict[str, list[dict]], keys: tuple[str, ...], ratio_keys: tuple[str, ...], num: str, den: str,
           started: float) -> None:
    """The medians of every side, the median ratios num / den, and the JSON last line; exits 3
    without the ratios when `verdict` refuses the comparison."""
    print(f"{'':<9}" + "".join(f"{k:>22}" for k in keys) + "   (medians)")
    for name, rs in results.items():
        print(f"{name:<9}" + "".join(f"{statistics.median(r[k] for r in rs):>22.4g}" for k in keys))
    ratios = {k: median_ratio(results, k, num, den) for k in ratio_keys}
    refused = verdict(results)
    out = {"rounds": results, "ratios": ratios, "refused": refused, "bench_s": time.monotonic() - started}
    if refused:
        print(f"not reported: {refused}")
        print(json.dumps(out))
        sys.exit(3)
    print(f"{num} / {den} (median of the rounds' ratios): " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    print(json.dumps(out))
