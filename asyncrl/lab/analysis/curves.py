"""Curves of one metric: aggregation over seeds and the statistics that reports and verdicts read.

Everything here is pure (plain floats in, floats out) and float64. A curve is a `Series` of
(step, value) pairs; one run gives one per metric (asyncrl/lab/analysis/runs.py). `step` is the x
value: the optimizer step, or another running column the curve was reindexed to (samples
generated), and every statistic below is in those units. Definitions, with w the analysis window
(StudyConfig.analysis.window):

- seed aggregate: at each step, the mean over the seeds that logged the metric at that step and
  their sample standard deviation (n - 1; 0 for one seed) -> `Band`;
- smoothed: the trailing mean, s_i = mean(y_{max(0, i-w+1)} .. y_i);
- drawn smoothed (figures only, never a statistic): the centred mean over h points either side,
  c_i = mean(y_{max(0, i-h)} .. y_{min(n-1, i+h)}), fewer at the ends; centred so that a peak or a
  collapse is drawn at the step it happened, not h steps late as a trailing mean or EMA would;
- mean: of all values; initial / final: mean of the first / last w values;
- peak / min: max / min of the smoothed curve;
- collapse step: the first step i (counting from the w-th value on) at which s_i < fraction x
  initial; infinite when it never does (None when the curve has fewer than w values). With the default
  w = 10 and fraction 0.5: the first step where the 10-step trailing mean of the entropy is below
  half the mean of its first 10 steps;
- slope: the least-squares slope of y against the step over the last `tail_frac` of the values;
- mean_abs_dev(target): mean |y - target| over that tail;
- reset_ratio: for each reference reset at step r (a step whose kl/reset is 1; the reset happens
  after the step's update, so step r's KL is the last measured against the old reference), the mean
  of the w values after r divided by the mean of the w values up to and including r, averaged over
  the resets with a full window on both sides. Small means the reset gave the KL term its room back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

SMOOTH_HALF_WIDTH = 5
"""Points either side of the centred mean drawn over each curve (11 steps), unless told otherwise."""


@dataclass(frozen=True)
class Series:
    """One metric of one run (or a seed mean): steps ascending, one value each."""

    steps: tuple[float, ...]
    values: tuple[float, ...]

    def __len__(self) -> int:
        return len(self.steps)


@dataclass(frozen=True)
class Band:
    """A metric over seeds: per step the mean, the sample sd and how many seeds logged it."""

    steps: tuple[float, ...]
    mean: tuple[float, ...]
    sd: tuple[float, ...]
    count: tuple[int, ...]

    @property
    def series(self) -> Series:
        return Series(self.steps, self.mean)


def aggregate(per_seed: list[Series]) -> Band:
    """Mean and sample sd over seeds at every step any seed logged."""
    by_step: dict[float, list[float]] = {}
    for s in per_seed:
        for step, v in zip(s.steps, s.values):
            by_step.setdefault(step, []).append(v)
    steps = sorted(by_step)
    means, sds = [], []
    for step in steps:
        vals = by_step[step]
        m = math.fsum(vals) / len(vals)
        means.append(m)
        sds.append(math.sqrt(math.fsum((v - m) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0)
    return Band(tuple(steps), tuple(means), tuple(sds), tuple(len(by_step[s]) for s in steps))


def reindex(s: Series, x: Series) -> Series:
    """s against another axis: each step replaced by x's value at that step (steps x lacks are
    dropped), e.g. against rollout/samples_total to line up arms with equal data budgets."""
    at = dict(zip(x.steps, x.values))
    keep = [(at[step], v) for step, v in zip(s.steps, s.values) if step in at]
    return Series(tuple(a for a, _ in keep), tuple(v for _, v in keep))


def smooth(values: tuple[float, ...] | list[float], window: int) -> list[float]:
    """Trailing mean over `window` values (fewer at the start)."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - window + 1): i + 1]
        out.append(math.fsum(part) / len(part))
    return out


def centred_mean(values: tuple[float, ...] | list[float], half_width: int) -> list[float]:
    """Mean over `half_width` values either side (fewer at the ends); half_width 0 is the curve itself."""
    out = []
    for i in range(len(values)):
        part = values[max(0, i - half_width): i + half_width + 1]
        out.append(math.fsum(part) / len(part))
    return out


def _mean(values) -> float | None:
    values = list(values)
    return math.fsum(values) / len(values) if values else None


def mean(s: Series) -> float | None:
    return _mean(s.values)


def initial(s: Series, window: int) -> float | None:
    return _mean(s.values[:window])


def final(s: Series, window: int) -> float | None:
    return _mean(s.values[-window:])


def peak(s: Series, window: int) -> float | None:
    return max(smooth(s.values, window)) if len(s) else None


def minimum(s: Series, window: int) -> float | None:
    return min(smooth(s.values, window)) if len(s) else None


def collapse_step(s: Series, window: int, fraction: float) -> float | None:
    """The first step where the trailing `window` mean falls below `fraction` of the initial mean;
    math.inf when it never does, None when the curve is shorter than `window`."""
    if len(s) < window:
        return None
    threshold = fraction * initial(s, window)
    smoothed = smooth(s.values, window)
    for i in range(window - 1, len(s)):
        if smoothed[i] < threshold:
            return s.steps[i]
    return math.inf


def _tail(s: Series, tail_frac: float) -> Series:
    n = max(1, math.ceil(len(s) * tail_frac))
    return Series(s.steps[-n:], s.values[-n:])


def slope(s: Series, tail_frac: float) -> float | None:
    """Least-squares slope (value per step) over the last tail_frac of the curve."""
    t = _tail(s, tail_frac)
    if len(t) < 2:
        return None
    mx, my = _mean(t.steps), _mean(t.values)
    sxx = math.fsum((x - mx) ** 2 for x in t.steps)
    return math.fsum((x - mx) * (y - my) for x, y in zip(t.steps, t.values)) / sxx


def mean_abs_dev(s: Series, target: float, tail_frac: float) -> float | None:
    return _mean(abs(v - target) for v in _tail(s, tail_frac).values) if len(s) else None


def reset_ratio(s: Series, reset_steps: list[float], window: int) -> float | None:
    """Mean over resets of mean(after) / mean(up to and including the reset step)."""
    ratios = []
    for r in reset_steps:
        before = [v for x, v in zip(s.steps, s.values) if x <= r][-window:]
        after = [v for x, v in zip(s.steps, s.values) if x > r][:window]
        if len(before) == window and len(after) == window and _mean(before) > 0:
            ratios.append(_mean(after) / _mean(before))
    return _mean(ratios)


def steps_where(s: Series, predicate) -> list[float]:
    """Steps whose value satisfies predicate (e.g. the reset steps of a kl/reset curve)."""
    return [x for x, v in zip(s.steps, s.values) if predicate(v)]
