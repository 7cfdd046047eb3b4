"""The pure rules of the offline tools: the difficulty filter's pass rates and verdicts, and the
entropy band's choice of a checkpoint (asyncrl/lab/offline/difficulty.py, entropy_band.py)."""

import pytest

from asyncrl.lab.offline.difficulty import DifficultyRule, apply_rule, pass_rate
from asyncrl.lab.offline.entropy_band import CheckpointEntropy, NoneInBand, choose


def test_pass_rate_counts_rewards_at_or_above_the_threshold():
    assert pass_rate([1.0, 0.0, 1.0, 0.5]) == 0.5          # 0.5 is partial credit, not solved
    assert pass_rate([1.0, 0.0, 1.0, 0.5], threshold=0.5) == 0.75
    with pytest.raises(ValueError):
        pass_rate([])


def test_default_rule_drops_exactly_the_never_and_always_solved():
    rewards = {0: [0.0] * 4, 1: [1.0, 0.0, 0.0, 0.0], 2: [1.0] * 4, 3: [1.0, 1.0, 1.0, 0.0]}
    result = apply_rule(5, rewards, DifficultyRule())          # record 4 was never sampled
    assert result.rates == {0: 0.0, 1: 0.25, 2: 1.0, 3: 0.75}
    assert result.verdicts == {0: "too_hard", 1: "kept", 2: "too_easy", 3: "kept", 4: "too_long"}
    assert result.kept() == [1, 3]
    assert result.counts() == {"kept": 2, "too_hard": 1, "too_easy": 1, "too_long": 1}


def test_thresholds_are_inclusive_bounds_of_what_is_dropped():
    rule = DifficultyRule(min_rate=0.25, max_rate=0.75)
    assert [rule.verdict(r) for r in (0.0, 0.25, 0.5, 0.75, 1.0)] == [
        "too_hard", "too_hard", "kept", "too_easy", "too_easy"]
    for bad in ((0.5, 0.5), (-0.1, 1.0), (0.0, 1.1)):
        with pytest.raises(ValueError):
            DifficultyRule(*bad)


def ck(path: str, entropy: float) -> CheckpointEntropy:
    return CheckpointEntropy(path, entropy, sampled_entropy=entropy, accuracy=0.0, num_tokens=10)


def test_choose_picks_by_preference_inside_the_band():
    measured = [ck("e1", 0.62), ck("e3", 0.48), ck("e5", 0.41), ck("e7", 0.33), ck("e9", 0.21)]
    assert choose(measured, 0.3, 0.5).path == "e5"                  # |0.41 - 0.40| is the least
    assert choose(measured, 0.3, 0.5, prefer="lowest").path == "e7"
    assert choose(measured, 0.3, 0.5, prefer="highest").path == "e3"
    assert choose(measured, 0.21, 0.25).path == "e9"                # the band's edges are inside


def test_choose_says_which_side_each_checkpoint_fell_on_when_none_is_in_the_band():
    with pytest.raises(NoneInBand, match=r"a: 0\.100 \(below\), b: 0\.900 \(above\)"):
        choose([ck("a", 0.1), ck("b", 0.9)], 0.3, 0.5)
    with pytest.raises(ValueError, match="low < high"):
        choose([ck("a", 0.4)], 0.5, 0.3)
