import math

import pytest

from asyncrl.algo.advantages import (
    group_advantages,
    groups_with_signal,
    is_zero_variance,
    masked_group_advantages,
)


def _loo_reference(rewards):
    # RLOO written literally: r_i minus the mean of the other rewards
    n = len(rewards)
    return [r - (sum(rewards) - r) / (n - 1) for r in rewards]


def test_rloo_hand_computed():
    # [1, 0, 0, 0]: A_0 = 1 - mean(0, 0, 0) = 1; A_j = 0 - mean(1, 0, 0) = -1/3
    assert group_advantages([1.0, 0.0, 0.0, 0.0], "rloo") == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])
    rewards = [0.3, 1.0, -0.5, 2.0, 0.0]
    assert group_advantages(rewards, "rloo") == pytest.approx(_loo_reference(rewards), abs=1e-12)


def test_grpo_and_drgrpo_unchanged():
    # [1, 0, 0, 0]: mean 1/4, population std sqrt(3)/4 -> sqrt(3), -1/sqrt(3)
    s3 = math.sqrt(3.0)
    assert group_advantages([1.0, 0.0, 0.0, 0.0], "grpo", eps=0.0) == pytest.approx([s3, -1 / s3, -1 / s3, -1 / s3])
    assert group_advantages([1.0, 0.0, 0.0, 0.0], "drgrpo") == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_grpo_std_population_or_sample():
    """[1, 0, 0, 0]: centred (3/4, -1/4, -1/4, -1/4), sum of squares 3/4. Population std
    sqrt(3/16) = sqrt(3)/4 gives sqrt(3), -1/sqrt(3); sample std sqrt(3/4 / 3) = 1/2 (verl's and
    TRL's torch.std) gives exactly 3/2, -1/2. A masked group uses the same convention."""
    s3 = math.sqrt(3.0)
    r = [1.0, 0.0, 0.0, 0.0]
    assert group_advantages(r, "grpo", eps=0.0, std="population") == pytest.approx([s3, -1 / s3, -1 / s3, -1 / s3])
    assert group_advantages(r, "grpo", eps=0.0, std="sample") == [1.5, -0.5, -0.5, -0.5]
    assert masked_group_advantages(r + [0.0], [False] * 4 + [True], "before", "grpo", eps=0.0,
                                   std="sample") == [1.5, -0.5, -0.5, -0.5, 0.0]
    # the std does not enter drgrpo / rloo; one sample, or all equal, is 0 either way
    assert group_advantages(r, "drgrpo", std="sample") == group_advantages(r, "drgrpo")
    assert group_advantages([0.7], "grpo", std="sample") == [0.0]
    assert group_advantages([0.5, 0.5], "grpo", std="sample") == [0.0, 0.0]
    with pytest.raises(ValueError, match="std"):
        group_advantages(r, "grpo", std="unbiased")


@pytest.mark.parametrize("kind", ["grpo", "drgrpo", "rloo"])
def test_all_equal_and_single_sample_groups_give_zero(kind):
    assert group_advantages([0.5, 0.5, 0.5], kind) == [0.0, 0.0, 0.0]
    assert group_advantages([0.7], kind) == [0.0]


def test_unknown_kind_and_empty_group_raise():
    with pytest.raises(ValueError):
        group_advantages([1.0, 0.0], "ppo")
    with pytest.raises(ValueError):
        group_advantages([], "rloo")


REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0]
TRUNCATED = [False, False, True, False, True]


def test_no_mask_is_plain_grpo():
    # mean 0.4, std sqrt(0.24): 0.6 / sqrt(0.24) = sqrt(1.5), -0.4 / sqrt(0.24) = -sqrt(2/3)
    a, b = math.sqrt(1.5), -math.sqrt(2 / 3)
    got = masked_group_advantages(REWARDS, TRUNCATED, "none", "grpo", eps=0.0)
    assert got == pytest.approx([a, b, b, a, b], abs=1e-12)


def test_mask_after_uses_all_rewards_then_zeroes_truncated():
    a, b = math.sqrt(1.5), -math.sqrt(2 / 3)
    got = masked_group_advantages(REWARDS, TRUNCATED, "after", "grpo", eps=0.0)
    assert got == pytest.approx([a, b, 0.0, a, 0.0], abs=1e-12)


def test_mask_before_uses_only_non_truncated_rewards():
    # non-truncated rewards [1, 0, 1]: mean 2/3, std sqrt(2)/3 -> 1/sqrt(2), -sqrt(2)
    a, b = 1 / math.sqrt(2), -math.sqrt(2)
    got = masked_group_advantages(REWARDS, TRUNCATED, "before", "grpo", eps=0.0)
    assert got == pytest.approx([a, b, 0.0, a, 0.0], abs=1e-12)


def test_masks_apply_to_other_estimators():
    # RLOO over the non-truncated [1, 0, 1]: 1 - mean(0, 1) = 0.5, 0 - mean(1, 1) = -1
    got = masked_group_advantages(REWARDS, TRUNCATED, "before", "rloo")
    assert got == pytest.approx([0.5, -1.0, 0.0, 0.5, 0.0], abs=1e-12)
    # Dr. GRPO over all five (mean 0.4), truncated zeroed
    got = masked_group_advantages(REWARDS, TRUNCATED, "after", "drgrpo")
    assert got == pytest.approx([0.6, -0.4, 0.0, 0.6, 0.0], abs=1e-12)


@pytest.mark.parametrize("mask", ["before", "after"])
def test_fully_truncated_group_is_all_zero(mask):
    assert masked_group_advantages([0.0, 1.0, 0.0], [True] * 3, mask) == [0.0, 0.0, 0.0]


def test_fully_truncated_group_without_mask_keeps_signal():
    got = masked_group_advantages([0.0, 1.0], [True, True], "none", "drgrpo")
    assert got == pytest.approx([-0.5, 0.5])


def test_single_non_truncated_response():
    # before: a group of one -> 0; after: the pair [1, 0] gives +1 to the kept one
    assert masked_group_advantages([1.0, 0.0], [False, True], "before") == [0.0, 0.0]
    assert masked_group_advantages([1.0, 0.0], [False, True], "after", eps=0.0) == pytest.approx([1.0, 0.0])


def test_mask_errors():
    with pytest.raises(ValueError):
        masked_group_advantages([1.0, 0.0], [False], "after")
    with pytest.raises(ValueError):
        masked_group_advantages([1.0, 0.0], [False, False], "sometimes")


def test_zero_variance_filter():
    groups = [[1.0, 1.0], [0.0, 1.0], [0.5], [2.0, 2.0, 2.0 + 1e-6]]
    assert groups_with_signal(groups) == [1, 3]
    assert is_zero_variance([0.5]) and not is_zero_variance([0.0, 1.0])


def test_skywork_filter_on_masked_advantages():
    # only the truncated response differs: "before" leaves no signal, "after" does
    rewards, truncated = [0.0, 1.0, 1.0], [True, False, False]
    before = masked_group_advantages(rewards, truncated, "before")
    after = masked_group_advantages(rewards, truncated, "after")
    assert groups_with_signal([before, after]) == [1]
