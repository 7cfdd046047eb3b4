"""The twin against published results: each scenario in configs/twin/published/ names the
speedups it stands for (`Scenario.published`: the figure, the baseline it is against, the row's
overrides); the twin runs the asynchronous mode and that baseline and compares its ratio with the
published one (tools/twin_published.py).

A row counts as reproduced within `TOLERANCE` of the published figure. A row whose anchor gives a
`reason` stays in the table, not counted among those expected to match: the twin's model says
why it cannot (what it does not model, or a source too incomplete to configure).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.twin.cluster import Twin
from asyncrl.twin.scenario import Anchor, load_scenario

TOLERANCE = 0.15


@dataclass
class Row:
    anchor: str
    scenario: str
    baseline: str
    published: float
    predicted: float
    reason: str | None

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1

    @property
    def within(self) -> bool:
        return abs(self.error) <= TOLERANCE

    def as_dict(self) -> dict[str, Any]:
        return {"anchor": self.anchor, "scenario": self.scenario, "baseline": self.baseline,
                "published": self.published, "predicted": round(self.predicted, 3), "error": round(self.error, 3),
                "within_15pct": self.within, "reason": self.reason}


def anchors(paths: list[Path]) -> list[tuple[Path, Anchor]]:
    """Every published row of these scenario files, in order."""
    return [(path, a) for path in paths for a in load_scenario(path).published]


def predict(path: Path, anchor: Anchor, run: Callable[[Any, str], dict[str, Any]] | None = None,
            cache: dict | None = None) -> Row:
    """The twin's ratio for one row: the anchor's mode over its baseline, in trained tokens/s,
    on the scenario with the row's overrides (the driver's time not charged: a pure function of
    the scenario). Runs shared by rows (one baseline for several etas) are made once via `cache`."""
    run = run or (lambda sc, mode: Twin(sc, mode, charge_driver=False).run())
    cache = {} if cache is None else cache
    sc = load_scenario(path, anchor.overrides)

    def rate(mode: str) -> float:
        # the baseline's schedule ignores eta: rows that differ only there share it
        synchronous = mode in ("sync", "sync_decoupled")
        key = (str(path), mode, tuple(o for o in anchor.overrides
                                      if not (synchronous and o.startswith("run.max_staleness"))))
        if key not in cache:
            cache[key] = run(sc, mode)["trained_tokens_per_s"]
        return cache[key]

    mode = anchor.mode or sc.run.sync_mode
    return Row(anchor.anchor, sc.name, anchor.baseline, anchor.published, rate(mode) / rate(anchor.baseline),
               anchor.reason)


def summary(rows: list[Row]) -> dict[str, Any]:
    """The last line of tools/twin_published.py: every row, and how many of those expected to
    match are within TOLERANCE."""
    expected = [r for r in rows if r.reason is None]
    return {"rows": [r.as_dict() for r in rows], "within_15pct": sum(r.within for r in expected),
            "total": len(rows), "expected": len(expected)}


def table(rows: list[Row]) -> str:
    head = f"{'anchor':<58} {'baseline':<15} {'published':>9} {'twin':>7} {'error':>7}"
    lines = [head]
    for r in rows:
        mark = "" if r.reason is None else f"  (not expected: {r.reason})"
        lines.append(f"{r.anchor[:58]:<58} {r.baseline:<15} {r.published:>8.2f}x {r.predicted:>6.2f}x "
                     f"{r.error:>+7.0%}{mark}")
    return "\n".join(lines)
