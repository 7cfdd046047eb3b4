"""Verdict rules on hand-made curves: the statistics, paired seed intervals by hand, the A/A floor,
ordered checks as adjacent comparisons, one seed inconclusive."""

import math

import pytest

from asyncrl.lab.analysis.curves import Series
from asyncrl.lab.analysis import paired
from asyncrl.lab.analysis.verdict import fmt, judge_paired, stat_value
from asyncrl.lab.study.config import AnalysisSpec, Finding, StatRef

AN = AnalysisSpec(window=2, tail_frac=0.5, collapse_fraction=0.5)


def s(values):
    return Series(tuple(float(i) for i in range(1, len(values) + 1)), tuple(float(v) for v in values))


# entropy (window 2, threshold 0.5): fast collapses at step 4, slow at step 5, flat never
ARMS = {
    "fast": {"entropy/learner": s([1, 1, 0.2, 0.2, 0.2, 0.2]), "reward/mean": s([0, 0.1, 0.2, 0.3, 0.4, 0.5])},
    "slow": {"entropy/learner": s([1, 1, 0.9, 0.5, 0.3, 0.3]), "reward/mean": s([0, 0.1, 0.1, 0.1, 0.1, 0.1])},
    "flat": {"entropy/learner": s([1, 1, 1, 1, 1, 1])},
    "reset": {"kl/mean": s([1, 2, 3, 4, 0.2, 0.2, 1, 2]), "kl/reset": s([0, 0, 0, 1, 0, 0, 0, 0])},
}


def finding(*checks, source="paper 1"):
    return Finding.model_validate({"name": "x", "source": source, "checks": list(checks)})


def test_stat_values_by_hand():
    assert stat_value(ARMS, StatRef(arm="fast", stat="collapse_step"), AN) == 4.0  # smoothed 1, 1, 0.6, 0.2
    assert stat_value(ARMS, StatRef(arm="slow", stat="collapse_step"), AN) == 5.0  # 0.95, 0.7, 0.4
    assert stat_value(ARMS, StatRef(arm="flat", stat="collapse_step"), AN) == float("inf")
    assert stat_value(ARMS, StatRef(arm="slow", stat="final"), AN) == pytest.approx(0.3)
    assert stat_value(ARMS, StatRef(arm="fast", metric="reward/mean", stat="last"), AN) == 0.5
    assert stat_value(ARMS, StatRef(arm="fast", metric="reward/mean", stat="slope"), AN) == pytest.approx(0.1)
    assert stat_value(ARMS, StatRef(arm="reset", metric="kl/mean", stat="reset_ratio"), AN) == pytest.approx(0.2 / 3.5)
    assert stat_value(ARMS, StatRef(arm="flat", stat="mean_abs_dev", target=0.75), AN) == pytest.approx(0.25)
    assert stat_value(ARMS, StatRef(arm="flat", metric="kl/mean"), AN) is None
    assert stat_value(ARMS, StatRef(arm="nobody"), AN) is None


def seeds(arm_values):
    """arm -> seed -> {"entropy/learner": a flat curve at that value} (final = the value)."""
    return {arm: {seed: {"entropy/learner": s([v] * 4)} for seed, v in enumerate(values)}
            for arm, values in arm_values.items()}


def check(left, right, op="gt", factor=1.0):
    right = {"arm": right} if isinstance(right, str) else right
    return {"kind": "compare", "left": {"arm": left}, "op": op, "right": right, "factor": factor}


def test_paired_interval_by_hand():
    # d = [0.1, 0.3, 0.2]: mean 0.2, sd 0.1, half-width t(0.975, 2) * 0.1 / sqrt(3) = 4.303 * 0.057735
    iv = paired.interval(paired.paired_differences({0: 1.1, 1: 1.3, 2: 1.2}, {0: 1.0, 1: 1.0, 2: 1.0, 3: 9.0}))
    half = 4.303 * 0.1 / math.sqrt(3)
    assert (iv.mean, iv.n) == (pytest.approx(0.2), 3)
    assert (iv.lo, iv.hi) == (pytest.approx(0.2 - half), pytest.approx(0.2 + half))
    assert iv.spread == pytest.approx(0.2 + half)
    assert paired.interval([0.5]) is None  # one paired seed: no interval
    # against a constant, with a factor: d_s = left - 2 * 0.5
    assert paired.paired_differences({0: 1.5, 1: None, 2: 2.0}, 0.5, factor=2.0) == [0.5, 1.0]
    assert paired.t975(1) == 12.706 and paired.t975(29) == 2.045 and paired.t975(100) == 1.96


def test_decide_needs_the_interval_beyond_zero_and_the_floor():
    iv = paired.Interval(0.2, 0.05, 0.35, 5)
    assert paired.decide(iv, "gt") is True
    assert paired.decide(iv, "gt", floor=0.1) is None  # not beyond the A/A spread
    assert paired.decide(iv, "lt") is False
    assert paired.decide(paired.Interval(0.0, -0.1, 0.1, 5), "gt") is None
    assert paired.decide(None, "gt") is None


def test_a_difference_within_the_aa_spread_is_inconclusive():
    # a - b per seed: 0.10, 0.12, 0.08, 0.11, 0.09 (interval about [0.08, 0.12]); the A/A copy of b
    # differs from b by -0.2 .. +0.2: spread about 0.4, so the difference does not count
    runs = seeds({"a": [0.60, 0.62, 0.58, 0.61, 0.59], "b": [0.5] * 5,
                  "b-aa": [0.7, 0.3, 0.5, 0.6, 0.4]})
    with_floor = judge_paired(runs, finding(check("a", "b")), AN, aa=("b", "b-aa"))
    assert with_floor.outcome == "inconclusive" and "A/A spread" in with_floor.checks[0].text
    assert judge_paired(runs, finding(check("a", "b")), AN).outcome == "reproduced"
    assert judge_paired(runs, finding(check("a", "b", op="lt")), AN).outcome == "not reproduced"
    assert judge_paired(runs, finding(check("a", "b"), source=""), AN).outcome == "holds"


def test_ordered_checks_are_adjacent_paired_comparisons_and_one_seed_is_inconclusive():
    runs = seeds({"x": [0.9, 0.8, 0.85], "y": [0.5, 0.45, 0.52], "z": [0.1, 0.15, 0.12]})
    ordered = {"kind": "ordered", "arms": ["x", "y", "z"], "stat": "final", "direction": "decreasing"}
    v = judge_paired(runs, finding(ordered), AN)
    assert v.outcome == "reproduced" and len(v.checks) == 2
    assert judge_paired(runs, finding({**ordered, "direction": "increasing"}), AN).outcome == "not reproduced"
    one = seeds({"x": [0.9], "y": [0.5]})
    v = judge_paired(one, finding({**ordered, "arms": ["x", "y"]}), AN)
    assert v.outcome == "inconclusive" and "fewer than 2 paired seeds" in v.checks[0].text


def test_two_metrics_of_one_arm_are_compared_without_the_aa_floor():
    runs = {arm: {seed: {"a/x": s([x] * 4), "a/y": s([y] * 4)} for seed, (x, y) in enumerate(values)}
            for arm, values in {"a": [(0.30, 0.10), (0.32, 0.11), (0.31, 0.12)],
                                "a-aa": [(0.9, 0.1), (0.1, 0.1), (0.5, 0.1)]}.items()}
    within = {"kind": "compare", "left": {"arm": "a", "metric": "a/x", "stat": "mean"}, "op": "gt",
              "right": {"arm": "a", "metric": "a/y", "stat": "mean"}}
    v = judge_paired(runs, finding(within), AN, aa=("a", "a-aa"))
    assert v.outcome == "reproduced" and "A/A" not in v.checks[0].text


def test_compare_with_a_constant_ignores_the_aa_floor():
    runs = seeds({"a": [0.3, 0.35, 0.32], "a-aa": [0.1, 0.6, 0.3]})
    v = judge_paired(runs, finding(check("a", 0.2)), AN, aa=("a", "a-aa"))
    assert v.outcome == "reproduced" and "A/A" not in v.checks[0].text


def test_fmt():
    assert fmt(None) == "n/a" and fmt(float("inf")) == "never" and fmt(12.0) == "12" and fmt(0.12345) == "0.123"
