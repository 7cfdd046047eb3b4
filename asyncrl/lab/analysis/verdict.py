"""Verdicts: a study's findings (asyncrl/lab/study/config.py) judged on paired seed differences
with 95% intervals and the A/A noise floor (`judge_paired`; the rule is in paired.py).

Pure: the curves come in as a mapping arm -> seed -> metric -> Series (each run's curve,
asyncrl/lab/analysis/curves.py) and the verdict goes out as text with the numbers it was decided on.
A finding with a `source` (a paper's claim) is `reproduced` / `not reproduced`; one without (a new
hypothesis) `holds` / `does not hold`; either is `inconclusive` when its intervals do not decide
(or a number is missing: an arm that did not run, a metric it did not log). A collapse that never
happened in a run counts as happening one step after its last (censored: "collapses later" can
then hold against an arm that collapsed, and two arms that never did differ by nothing).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from asyncrl.lab.analysis import curves, paired
from asyncrl.lab.analysis.curves import Series
from asyncrl.lab.study.config import AnalysisSpec, CompareCheck, Finding, OrderedCheck, StatRef

ArmCurves = Mapping[str, Mapping[str, Series]]


def stat_value(arms: ArmCurves, ref: StatRef, analysis: AnalysisSpec) -> float | None:
    """The number a StatRef names (None when it cannot be computed)."""
    s = arms.get(ref.arm, {}).get(ref.metric)
    if s is None or not len(s):
        return None
    w, tail = analysis.window, analysis.tail_frac
    match ref.stat:
        case "initial":
            return curves.initial(s, w)
        case "final":
            return curves.final(s, w)
        case "last":
            return s.values[-1]
        case "peak":
            return curves.peak(s, w)
        case "min":
            return curves.minimum(s, w)
        case "mean":
            return curves.mean(s)
        case "collapse_step":
            return curves.collapse_step(s, w, analysis.collapse_fraction)
        case "slope":
            return curves.slope(s, tail)
        case "mean_abs_dev":
            return curves.mean_abs_dev(s, ref.target, tail)
        case "reset_ratio":
            resets = arms.get(ref.arm, {}).get("kl/reset")
            steps = curves.steps_where(resets, lambda v: v > 0) if resets is not None else []
            return curves.reset_ratio(s, steps, w)
    raise ValueError(f"unknown stat {ref.stat!r}")


def fmt(value: float | None) -> str:
    if value is None:
        return "n/a"
    if math.isinf(value):
        return "never"
    if value == int(value) and abs(value) >= 1:
        return str(int(value))
    return f"{value:.3g}"


def _describe(ref: StatRef) -> str:
    target = f" from {fmt(ref.target)}" if ref.target is not None else ""
    return f"{ref.stat}{target} of {ref.metric} [{ref.arm}]"


@dataclass(frozen=True)
class CheckResult:
    holds: bool | None  # None: a number is missing
    text: str


@dataclass(frozen=True)
class Verdict:
    finding: Finding
    outcome: str
    checks: list[CheckResult]

    @property
    def numbers(self) -> str:
        return "; ".join(c.text for c in self.checks)


def _mark(holds: bool | None) -> str:
    return {True: " (yes)", False: " (no)", None: " (undecided)"}[holds]


SeedCurves = Mapping[str, Mapping[int, Mapping[str, Series]]]
"""arm -> seed -> metric -> that run's curve."""


def per_seed(runs: SeedCurves, ref: StatRef, analysis: AnalysisSpec) -> dict[int, float | None]:
    """seed -> the StatRef's statistic on that seed's run of its arm."""
    out = {}
    for seed, curves_of_run in runs.get(ref.arm, {}).items():
        value = stat_value({ref.arm: curves_of_run}, ref, analysis)
        if value == math.inf and ref.stat == "collapse_step":  # never: after the run's last step
            value = curves_of_run[ref.metric].steps[-1] + 1
        out[seed] = value
    return out


def aa_floor(runs: SeedCurves, aa: tuple[str, str] | None, metric: str, stat: str, analysis: AnalysisSpec,
             target: float | None = None) -> paired.Interval | None:
    """The A/A pair's paired interval of this statistic (the noise floor), None without one."""
    if aa is None:
        return None
    refs = [StatRef(arm=a, metric=metric, stat=stat, target=target) for a in aa]
    return paired.interval(paired.paired_differences(*(per_seed(runs, r, analysis) for r in refs)))


def _paired_check(runs: SeedCurves, left: StatRef, right: StatRef | float, op: str, factor: float,
                  analysis: AnalysisSpec, aa: tuple[str, str] | None) -> CheckResult:
    right_values = per_seed(runs, right, analysis) if isinstance(right, StatRef) else right
    iv = paired.interval(paired.paired_differences(per_seed(runs, left, analysis), right_values, factor))
    # the A/A spread is the noise between two arms in one statistic: it bounds a comparison of
    # that statistic across arms, not one of two metrics, or of one arm with itself or a constant
    across = isinstance(right, StatRef) and right.arm != left.arm and (right.metric, right.stat) == (left.metric, left.stat)
    floor = aa_floor(runs, aa, left.metric, left.stat, analysis, left.target) if across else None
    holds = paired.decide(iv, op, floor.spread if floor is not None else 0.0)
    right_text = _describe(right) if isinstance(right, StatRef) else fmt(right)
    scaled = "" if factor == 1 else f"{fmt(factor)} x "
    text = (f"{_describe(left)} - {scaled}{right_text} {'>' if op == 'gt' else '<'} 0: "
            + (iv.text() if iv is not None else "fewer than 2 paired seeds")
            + (f"; A/A spread {floor.spread:.3g}" if floor is not None else ""))
    return CheckResult(holds, text + _mark(holds))


def judge_paired(runs: SeedCurves, finding: Finding, analysis: AnalysisSpec,
                 aa: tuple[str, str] | None = None) -> Verdict:
    """The finding on paired seed differences (paired.py); `aa`: (arm, its A/A copy)."""
    results = []
    for c in finding.checks:
        if isinstance(c, CompareCheck):
            results.append(_paired_check(runs, c.left, c.right, c.op, c.factor, analysis, aa))
            continue
        refs = c.refs()
        for a, b in zip(refs, refs[1:]):  # increasing: each next arm above the one before
            results.append(_paired_check(runs, b, a, "gt" if c.direction == "increasing" else "lt", 1.0,
                                         analysis, aa))
    return Verdict(finding, paired.outcome([r.holds for r in results], bool(finding.source)), results)
