"""Arms: the runs of one setting over seeds, and the numbers a report gives per arm.

An arm's curve of a metric is the mean over its seeds at each step (curves.aggregate), against the
analysis x axis (the step, or e.g. the seed mean of rollout/samples_total at each step); its
statistics (final, peak, collapse step, ...) are read from that mean curve, and the ± beside them
is the sample sd over seeds of the same statistic computed on each seed's own curve.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.lab.analysis.curves import Band, Series, aggregate, reindex
from asyncrl.lab.analysis.runs import RunRecord, read_run
from asyncrl.lab.analysis.verdict import stat_value
from asyncrl.lab.study.config import AnalysisSpec, Stat, StatRef

SEED_SUFFIX = re.compile(r"-s\d+$")


@dataclass
class Arm:
    name: str
    runs: list[RunRecord]
    _bands: dict[str, Band] = field(default_factory=dict, repr=False)

    def band(self, metric: str) -> Band:
        if metric not in self._bands:
            self._bands[metric] = aggregate([r.series(metric) for r in self.runs])
        return self._bands[metric]

    def curve(self, metric: str, x_axis: str = "step", values: str = "mean") -> Series:
        """The seed mean (or sd: values="sd") of `metric` per step, against x_axis (the seed mean
        of that column at each step) unless it is `step`."""
        band = self.band(metric)
        s = Series(band.steps, band.mean if values == "mean" else band.sd)
        return s if x_axis == "step" else reindex(s, self.band(x_axis).series)

    def metrics(self) -> list[str]:
        """Every numeric key any of its runs logged."""
        keys = {k for r in self.runs for row in r.rows for k in row if k not in ("step", "time")}
        return sorted(keys)

    @property
    def num_steps(self) -> int:
        return max((int(r.rows[-1]["step"]) for r in self.runs if r.rows), default=0)


def run_curve(run: RunRecord, metric: str, x_axis: str = "step") -> Series:
    """One run's `metric` per step, against x_axis unless it is `step`."""
    s = run.series(metric)
    return s if x_axis == "step" else reindex(s, run.series(x_axis))


def mean_curves(arms: list[Arm], x_axis: str = "step") -> dict[str, dict[str, Series]]:
    """arm -> metric -> seed-mean curve against x_axis, for every metric the arm logged."""
    return {a.name: {m: a.curve(m, x_axis) for m in a.metrics()} for a in arms}


def stat_with_spread(arm: Arm, metric: str, stat: Stat, analysis: AnalysisSpec,
                     target: float | None = None) -> tuple[float | None, float | None]:
    """(the statistic of the seed-mean curve, sample sd over seeds of the per-seed statistic; None
    with fewer than two finite per-seed values)."""
    ref = StatRef(arm=arm.name, metric=metric, stat=stat, target=target)
    needs = [metric, "kl/reset"] if stat == "reset_ratio" else [metric]
    x = analysis.x_axis
    value = stat_value({arm.name: {m: arm.curve(m, x) for m in needs}}, ref, analysis)
    per_seed = [stat_value({arm.name: {m: run_curve(r, m, x) for m in needs}}, ref, analysis) for r in arm.runs]
    finite = [v for v in per_seed if v is not None and math.isfinite(v)]
    if len(finite) < 2:
        return value, None
    m = sum(finite) / len(finite)
    return value, math.sqrt(sum((v - m) ** 2 for v in finite) / (len(finite) - 1))


def arms_from_dirs(paths: list[str | Path], group_seeds: bool = False) -> list[Arm]:
    """One arm per run directory, or (group_seeds) one per name without its `-s<seed>` suffix,
    in the order first seen."""
    arms: dict[str, Arm] = {}
    for p in paths:
        run = read_run(p)
        name = SEED_SUFFIX.sub("", run.name) if group_seeds else run.name
        if not group_seeds and name in arms:  # two runs of the same name in different places
            name = f"{run.path.parent.name}/{run.name}"
        arms.setdefault(name, Arm(name, [])).runs.append(run)
    return list(arms.values())
