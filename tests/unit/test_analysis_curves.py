"""Seed aggregation and the curve statistics against hand-computed values."""

import math

import pytest

from asyncrl.lab.analysis import curves
from asyncrl.lab.analysis.curves import Series, aggregate


def s(values, start=1):
    return Series(tuple(float(i) for i in range(start, start + len(values))), tuple(float(v) for v in values))


def test_aggregate_mean_and_sample_sd_per_step():
    # step 1: 1, 3, 8 -> mean 4, sd sqrt(((-3)^2 + (-1)^2 + 4^2) / 2) = sqrt(13); step 2: 2, 4 -> 3, sqrt(2)
    # step 3 only in the first seed: 5, sd 0
    band = aggregate([s([1, 2, 5]), s([3, 4]), s([8])])
    assert band.steps == (1.0, 2.0, 3.0)
    assert band.mean == (4.0, 3.0, 5.0)
    assert band.sd[0] == pytest.approx(math.sqrt(13), abs=1e-12)
    assert band.sd[1] == pytest.approx(math.sqrt(2), abs=1e-12)
    assert band.sd[2] == 0.0
    assert band.count == (3, 2, 1)


def test_one_seed_is_its_own_mean_with_zero_sd():
    band = aggregate([s([0.5, 0.25])])
    assert band.mean == (0.5, 0.25) and band.sd == (0.0, 0.0)


def test_smooth_is_a_trailing_mean():
    assert curves.smooth([4, 2, 6, 0], 2) == [4, 3, 4, 3]
    assert curves.smooth([3, 6, 9], 5) == [3, 4.5, 6]


def test_initial_final_peak_min_mean():
    c = s([1, 3, 5, 7, 2, 0])
    assert curves.initial(c, 2) == 2.0          # (1 + 3) / 2
    assert curves.final(c, 2) == 1.0            # (2 + 0) / 2
    assert curves.peak(c, 2) == 6.0             # smoothed 1, 2, 4, 6, 4.5, 1
    assert curves.minimum(c, 2) == 1.0
    assert curves.mean(c) == 3.0


def test_collapse_step_is_the_first_smoothed_value_below_the_fraction():
    # window 2, initial = (1.0 + 1.0) / 2 = 1; threshold 0.5
    # smoothed from index 1: 1.0, 0.8, 0.55, 0.45 (step 5), ...
    c = s([1.0, 1.0, 0.6, 0.5, 0.4, 0.3])
    assert curves.collapse_step(c, 2, 0.5) == 5.0
    assert curves.collapse_step(c, 2, 0.3) == math.inf  # smoothed never below 0.3 (last is 0.35)
    assert curves.collapse_step(s([1.0]), 2, 0.5) is None  # shorter than the window


def test_one_low_value_does_not_count_as_a_collapse_when_smoothed():
    c = s([1, 1, 1, 0.1, 1, 1])
    assert curves.collapse_step(c, 3, 0.5) == math.inf  # trailing 3-mean is at least 0.7
    assert curves.collapse_step(c, 1, 0.5) == 4.0


def test_slope_over_the_tail():
    c = s([5, 5, 1, 2, 3, 4])  # last half: steps 4, 5, 6 -> 2, 3, 4: slope 1
    assert curves.slope(c, 0.5) == pytest.approx(1.0, abs=1e-12)
    assert curves.slope(s([3.0]), 1.0) is None


def test_mean_abs_dev_over_the_tail():
    c = s([9, 9, 0.1, 0.3])  # tail 0.5: 0.1, 0.3 against 0.2 -> 0.1
    assert curves.mean_abs_dev(c, 0.2, 0.5) == pytest.approx(0.1, abs=1e-12)


def test_reset_ratio_before_and_after_each_reset():
    kl = s([1, 2, 3, 4, 0.5, 1.5, 3, 4])
    # reset after step 4: before (steps 3, 4) = 3.5, after (steps 5, 6) = 1 -> 1 / 3.5
    assert curves.reset_ratio(kl, [4.0], 2) == pytest.approx(1 / 3.5, abs=1e-12)
    # a reset at step 7 has one step after it: skipped; the ratio is the step-4 one alone
    assert curves.reset_ratio(kl, [4.0, 7.0], 2) == pytest.approx(1 / 3.5, abs=1e-12)
    assert curves.reset_ratio(kl, [], 2) is None


def test_steps_where():
    assert curves.steps_where(s([0, 1, 0, 1]), lambda v: v > 0) == [2.0, 4.0]


def test_reindex_puts_a_curve_on_another_axis():
    samples = Series((1.0, 2.0, 4.0), (64.0, 128.0, 256.0))  # step 3 has no sample count
    assert curves.reindex(s([0.5, 0.4, 0.3, 0.2]), samples) == Series((64.0, 128.0, 256.0), (0.5, 0.4, 0.2))
    # statistics are then in samples: the collapse happens at 256 samples
    assert curves.collapse_step(curves.reindex(s([1, 1, 0.1, 0.1]), Series((1.0, 2.0, 3.0, 4.0),
                                                                             (8.0, 16.0, 24.0, 32.0))), 2, 0.5) == 32.0


def test_centred_mean_takes_half_width_points_either_side_and_fewer_at_the_ends():
    # half width 1: (0 + 0.5) / 2, (0 + 0.5 + 0.1) / 3, (0.5 + 0.1 + 0.55) / 3, (0.1 + 0.55) / 2
    assert curves.centred_mean([0.0, 0.5, 0.1, 0.55], 1) == pytest.approx([0.25, 0.2, 1.15 / 3, 0.325], abs=1e-15)
    # half width 2 on 3 points: every point sees the whole curve
    assert curves.centred_mean([3, 6, 9], 2) == [6, 6, 6]
    assert curves.centred_mean([4, 2, 6], 0) == [4, 2, 6]
    assert curves.centred_mean([], 3) == []
