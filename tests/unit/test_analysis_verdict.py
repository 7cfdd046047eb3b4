"""Verdict rules on hand-made seed-mean curves: compare, ordered, missing numbers, the wording."""

import pytest

from asyncrl.lab.analysis.curves import Series
from asyncrl.lab.analysis.verdict import fmt, judge, stat_value
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
    assert stat_value(ARMS, StatRef(arm="fast", metric="reward/mean", stat="slope"), AN) == pytest.approx(0.1)
    assert stat_value(ARMS, StatRef(arm="reset", metric="kl/mean", stat="reset_ratio"), AN) == pytest.approx(0.2 / 3.5)
    assert stat_value(ARMS, StatRef(arm="flat", stat="mean_abs_dev", target=0.75), AN) == pytest.approx(0.25)
    assert stat_value(ARMS, StatRef(arm="flat", metric="kl/mean"), AN) is None
    assert stat_value(ARMS, StatRef(arm="nobody"), AN) is None


def test_ordered_collapse_steps_reproduced():
    v = judge(ARMS, finding({"kind": "ordered", "arms": ["flat", "slow", "fast"], "stat": "collapse_step",
                             "direction": "decreasing"}), AN)
    assert v.outcome == "reproduced"
    assert v.numbers == "collapse_step of entropy/learner: flat never > slow 5 > fast 4 (yes)"


def test_two_arms_that_never_collapse_are_not_ordered():
    arms = {**ARMS, "flat2": ARMS["flat"]}
    v = judge(arms, finding({"kind": "ordered", "arms": ["flat", "flat2"], "stat": "collapse_step",
                             "direction": "decreasing"}), AN)
    assert v.outcome == "not reproduced"


def test_compare_with_factor_and_constant():
    later = {"kind": "compare", "left": {"arm": "slow", "stat": "collapse_step"}, "op": "gt",
             "right": {"arm": "fast", "stat": "collapse_step"}}
    assert judge(ARMS, finding(later), AN).outcome == "reproduced"
    # 5 > 2 x 4 is false
    assert judge(ARMS, finding({**later, "factor": 2.0}), AN).outcome == "not reproduced"
    near = {"kind": "compare", "left": {"arm": "flat", "stat": "mean_abs_dev", "target": 0.9}, "op": "lt",
            "right": 0.15}
    v = judge(ARMS, finding(near, source=""), AN)
    assert v.outcome == "holds"  # |1 - 0.9| = 0.1 < 0.15
    assert v.numbers == "mean_abs_dev from 0.9 of entropy/learner [flat] = 0.1 < constant = 0.15 (yes)"


def test_a_missing_number_is_inconclusive_unless_another_check_fails():
    missing = {"kind": "compare", "left": {"arm": "flat", "metric": "kl/mean"}, "op": "gt", "right": 0.0}
    failing = {"kind": "compare", "left": {"arm": "fast", "stat": "final"}, "op": "gt", "right": 1.0}
    assert judge(ARMS, finding(missing), AN).outcome == "inconclusive"
    assert judge(ARMS, finding(missing, failing), AN).outcome == "not reproduced"
    assert judge(ARMS, finding(failing, source=""), AN).outcome == "does not hold"


def test_fmt():
    assert fmt(None) == "n/a" and fmt(float("inf")) == "never" and fmt(12.0) == "12" and fmt(0.12345) == "0.123"
