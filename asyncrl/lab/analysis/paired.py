"""Statistical verdicts: a finding judged on paired seed differences with 95% intervals, against
the noise floor of an A/A arm.

Arms of a study share seeds, and a seed fixes the prompt order and every request's sampling seed,
so arm L and arm R run with seed s differ by their setting and by the run's asynchrony. For a check
`L op factor * R` the per-seed difference d_s = stat(L, s) - factor * stat(R, s) is taken over the
seeds both arms ran (against a constant: d_s = stat(L, s) - constant), and its mean gets the
two-sided 95% Student-t interval mean ± t(0.975, n - 1) * sd / sqrt(n), sd the sample sd.

The A/A arm (`aa_arm` in the study: the same config, seeds and prompts run again under another
name with another sampling seed, since a run of one seed is deterministic) gives the noise floor:
the same statistic's paired differences between the arm and its copy, whose spread |mean| +
half-width is what a rerun varies between two arms. A check of one
statistic between two arms then (a check against a constant, of two metrics, or within one arm,
has no floor: 0)

    holds          when its interval lies beyond max(0, A/A spread) on the side `op` names,
    does not hold  when its interval lies entirely on the other side of 0,
    is undecided   otherwise (the interval is given), and with fewer than 2 paired seeds.

A finding is `reproduced` (`holds` for a hypothesis) when every check holds, `not reproduced`
(`does not hold`) when any check does not, else `inconclusive`. Ordered checks are their adjacent
pairs, each a comparison. Pure: per-seed numbers in, verdicts out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)
"""t(0.975, df) for df = 1 .. 30 (Student's t table); 1.96 beyond."""

PerSeed = Mapping[int, float | None]
"""seed -> a run's statistic (None: it could not be computed)."""


def t975(df: int) -> float:
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return T975[df - 1] if df <= len(T975) else 1.96


@dataclass(frozen=True)
class Interval:
    mean: float
    lo: float
    hi: float
    n: int

    @property
    def spread(self) -> float:
        """|mean| + half-width: how far from 0 this difference may reach."""
        return abs(self.mean) + (self.hi - self.mean)

    def text(self) -> str:
        return f"{self.mean:+.3g} [{self.lo:+.3g}, {self.hi:+.3g}] (n={self.n})"


def paired_differences(left: PerSeed, right: PerSeed | float, factor: float = 1.0) -> list[float]:
    """d_s over the seeds where both numbers exist and are finite."""
    if isinstance(right, (int, float)):
        pairs = [(v, float(right)) for v in left.values()]
    else:
        pairs = [(left[s], right[s]) for s in sorted(set(left) & set(right))]
    return [a - factor * b for a, b in pairs
            if a is not None and b is not None and math.isfinite(a) and math.isfinite(b)]


def interval(diffs: list[float]) -> Interval | None:
    """The mean of `diffs` with its 95% t interval; None with fewer than 2."""
    n = len(diffs)
    if n < 2:
        return None
    mean = sum(diffs) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n)


def decide(iv: Interval | None, op: str, floor: float = 0.0) -> bool | None:
    """True: the interval lies beyond max(0, floor) on `op`'s side (gt: above); False: it lies
    entirely on the other side of 0; None: undecided or no interval."""
    if iv is None:
        return None
    bound = max(0.0, floor)
    if op == "gt":
        return True if iv.lo > bound else False if iv.hi < 0 else None
    return True if iv.hi < -bound else False if iv.lo > 0 else None


def outcome(results: list[bool | None], has_source: bool) -> str:
    if any(r is False for r in results):
        return "not reproduced" if has_source else "does not hold"
    if any(r is None for r in results):
        return "inconclusive"
    return "reproduced" if has_source else "holds"
