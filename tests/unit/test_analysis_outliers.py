"""Which arms get a panel of their own (asyncrl/lab/analysis/outliers.py), on hand-made extents."""

from asyncrl.lab.analysis.outliers import outlier_arms


def test_one_exploding_arm_is_the_outlier():
    # reference: the median height, b (0.4; a 0.5, boom 3.4) -> band [0.1, 0.5]; boom's 3.5 is
    # 3.0 above it, more than 3 x 0.4 = 1.2
    extents = {"a": (0.1, 0.6), "b": (0.1, 0.5), "boom": (0.1, 3.5)}
    assert outlier_arms(extents) == ["boom"]
    assert outlier_arms(extents, factor=10.0) == []  # 3.0 < 10 x 0.4


def test_two_arms_the_lower_median_is_the_reference():
    # heights 0.5 and 3.4: the lower median is a's; boom leaves [0.1, 0.6] by 2.9 > 1.5
    assert outlier_arms({"a": (0.1, 0.6), "boom": (0.1, 3.5)}) == ["boom"]


def test_several_exploding_arms_are_all_outliers_while_they_are_a_minority():
    extents = {"a": (0.1, 0.6), "b": (0.1, 0.5), "c": (0.1, 3.2), "d": (0.1, 3.5), "e": (0.0, 0.55)}
    assert outlier_arms(extents) == ["c", "d"]


def test_below_counts_as_well_and_a_level_far_away_is_an_outlier():
    # heights c 0.9, a 1, b 1.5: reference a, band [0, 1]; b sits 10.5 above its max (> 3 x 1)
    assert outlier_arms({"a": (0.0, 1.0), "b": (10.0, 11.5), "c": (-0.5, 0.4)}) == ["b"]
    # heights c 0.9, a 1, b 5.5: b reaches 5 below a's min
    assert outlier_arms({"a": (0.0, 1.0), "b": (-5.0, 0.5), "c": (0.2, 1.1)}) == ["b"]


def test_no_outliers_with_one_arm_or_a_flat_reference():
    assert outlier_arms({"a": (0.0, 100.0)}) == []
    assert outlier_arms({"a": (0.5, 0.5), "b": (0.5, 0.5), "c": (0.0, 9.0)}) == []
    assert outlier_arms({}) == []
