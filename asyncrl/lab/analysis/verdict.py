"""Verdicts: a study's findings (asyncrl/lab/study/config.py) judged on the arms' seed-mean curves.

Pure: the curves come in as a mapping arm -> metric -> Series (the mean over seeds per step,
asyncrl/lab/analysis/curves.py) and the verdict goes out as text with the numbers it was decided on.
A finding with a `source` (a paper's claim) is `reproduced` / `not reproduced`; one without (a new
hypothesis) `holds` / `does not hold`; either is `inconclusive` when a number is missing (an arm
that did not run, a metric it did not log, a statistic that needs more steps). A collapse step
that never happened counts as infinitely late, so "collapses later" holds against an arm that
collapsed and fails between two arms that both never did.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from asyncrl.lab.analysis import curves
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


def judge_compare(arms: ArmCurves, check: CompareCheck, analysis: AnalysisSpec) -> CheckResult:
    left = stat_value(arms, check.left, analysis)
    if isinstance(check.right, StatRef):
        right, right_text = stat_value(arms, check.right, analysis), _describe(check.right)
    else:
        right, right_text = check.right, "constant"
    sign = ">" if check.op == "gt" else "<"
    factor = "" if check.factor == 1 else f"{fmt(check.factor)} x "
    holds = None
    if left is not None and right is not None:
        scaled = check.factor * right
        holds = left > scaled if check.op == "gt" else left < scaled
    text = f"{_describe(check.left)} = {fmt(left)} {sign} {factor}{right_text} = {fmt(right)}"
    return CheckResult(holds, text + _mark(holds))


def judge_ordered(arms: ArmCurves, check: OrderedCheck, analysis: AnalysisSpec) -> CheckResult:
    values = [stat_value(arms, ref, analysis) for ref in check.refs()]
    holds = None
    if all(v is not None for v in values):
        pairs = list(zip(values, values[1:]))
        holds = all(b > a for a, b in pairs) if check.direction == "increasing" else all(b < a for a, b in pairs)
    sign = " < " if check.direction == "increasing" else " > "
    text = f"{check.stat} of {check.metric}: " + sign.join(f"{a} {fmt(v)}" for a, v in zip(check.arms, values))
    return CheckResult(holds, text + _mark(holds))


def _mark(holds: bool | None) -> str:
    return {True: " (yes)", False: " (no)", None: " (missing)"}[holds]


def judge(arms: ArmCurves, finding: Finding, analysis: AnalysisSpec) -> Verdict:
    results = [judge_compare(arms, c, analysis) if isinstance(c, CompareCheck) else judge_ordered(arms, c, analysis)
               for c in finding.checks]
    if any(r.holds is False for r in results):
        outcome = "not reproduced" if finding.source else "does not hold"
    elif any(r.holds is None for r in results):
        outcome = "inconclusive"
    else:
        outcome = "reproduced" if finding.source else "holds"
    return Verdict(finding, outcome, results)
