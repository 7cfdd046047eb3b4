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
    tokens_per_s: tuple[float, float] = (0.0, 0.0)
    """The twin's (asynchronous, baseline) loss tokens trained a second, zero-advantage ones too."""
    published_tokens_per_s: tuple[float, float] | None = None
    sensitivity: dict[str, list[tuple[float, float]]] | None = None
    """An assumed value -> (its value, the ratio) at the low and the high end of its range."""

    @property
    def error(self) -> float:
        return self.predicted / self.published - 1

    @property
    def within(self) -> bool:
        return abs(self.error) <= TOLERANCE

    def as_dict(self) -> dict[str, Any]:
        return {"anchor": self.anchor, "scenario": self.scenario, "baseline": self.baseline,
                "published": self.published, "predicted": round(self.predicted, 3), "error": round(self.error, 3),
                "within_15pct": self.within, "reason": self.reason,
                "tokens_per_s": [round(x) for x in self.tokens_per_s],
                "published_tokens_per_s": self.published_tokens_per_s and list(self.published_tokens_per_s),
                **({"sensitivity": {k: [[x, round(ratio, 3)] for x, ratio in v] for k, v in self.sensitivity.items()}}
                   if self.sensitivity is not None else {})}


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

    def rates(mode: str) -> tuple[float, float]:
        """(trained tokens/s with a non-zero advantage: the ratio's, all loss tokens/s)"""
        # the baseline's schedule ignores eta: rows that differ only there share it
        synchronous = mode in ("sync", "sync_decoupled")
        key = (str(path), mode, tuple(o for o in anchor.overrides
                                      if not (synchronous and o.startswith("run.max_staleness"))))
        if key not in cache:
            res = run(sc, mode)
            cache[key] = res["trained_tokens_per_s"], res["all_trained_tokens_per_s"]
        return cache[key]

    (useful, every), (useful0, every0) = rates(anchor.mode or sc.run.sync_mode), rates(anchor.baseline)
    return Row(anchor.anchor, sc.name, anchor.baseline, anchor.published, useful / useful0, anchor.reason,
               (every, every0), anchor.published_tokens_per_s)


def sensitivity(path: Path, anchor: Anchor, run: Callable[[Any, str], dict[str, Any]] | None = None,
                cache: dict | None = None) -> dict[str, list[tuple[float, float]]]:
    """The row's ratio with each of the scenario's assumed values (`Scenario.assumed`) at the low
    and at the high end of its range, the others as the scenario has them: field -> [(value,
    ratio), (value, ratio)]."""
    return {field: [(v, predict(path, anchor.model_copy(update={"overrides": [*anchor.overrides, f"{field}={v!r}"]}),
                                run, cache).predicted) for v in ends]
            for field, ends in load_scenario(path, anchor.overrides).assumed.items()}


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
        for field, ends in (r.sensitivity or {}).items():  # what an assumed value moves
            lines.append(f"{'':<4}{field} " + ", ".join(f"{v:g}: {ratio:.2f}x" for v, ratio in ends))
        if r.published_tokens_per_s:  # which side a miss is on
            (a, b), (pa, pb) = r.tokens_per_s, r.published_tokens_per_s
            lines.append(f"{'':<4}tokens/s, twin (published): asynchronous {a:,.0f} ({pa:,.0f}), "
                         f"{r.baseline} {b:,.0f} ({pb:,.0f})")
    return "\n".join(lines)
