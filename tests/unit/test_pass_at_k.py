"""pass@k and avg@n (algo/pass_at_k.py) against values worked out by hand from binomials."""

from fractions import Fraction

import pytest

from asyncrl.algo.pass_at_k import eval_metrics, pass_at_k


def approx(x: Fraction):
    return pytest.approx(float(x), rel=1e-12, abs=1e-15)


def test_pass_at_k_is_one_minus_the_chance_that_k_draws_miss_every_correct_sample():
    # 2 correct of 5, draw 2: all-wrong pairs C(3,2)=3 of C(5,2)=10.
    assert pass_at_k(5, 2, 2) == approx(1 - Fraction(3, 10))
    # k=1 is the fraction correct: 1 - C(3,1)/C(5,1) = 2/5.
    assert pass_at_k(5, 2, 1) == approx(Fraction(2, 5))
    # 1 correct of 4, draw 2: 1 - C(3,2)/C(4,2) = 1 - 3/6.
    assert pass_at_k(4, 1, 2) == approx(Fraction(1, 2))
    # 3 correct of 8, draw 4: 1 - C(5,4)/C(8,4) = 1 - 5/70.
    assert pass_at_k(8, 3, 4) == approx(1 - Fraction(5, 70))


def test_pass_at_k_edges():
    assert pass_at_k(5, 0, 3) == 0.0  # nothing correct to draw
    assert pass_at_k(5, 3, 3) == 1.0  # n - c = 2 < k = 3: every draw of 3 holds a correct one
    assert pass_at_k(4, 1, 4) == 1.0  # k = n draws everything
    assert pass_at_k(1, 1, 1) == 1.0


@pytest.mark.parametrize("n, c, k", [(5, 6, 1), (5, -1, 1), (5, 2, 0), (5, 2, 6), (0, 0, 1)])
def test_pass_at_k_rejects_impossible_arguments(n, c, k):
    with pytest.raises(ValueError, match="pass@k needs"):
        pass_at_k(n, c, k)


def test_eval_metrics_averages_over_complete_prompts_and_counts_the_others():
    rewards = [
        [1.0, 0.0, 1.0, 0.0],  # c=2: pass@1 = 2/4, pass@2 = 1 - C(2,2)/C(4,2) = 5/6
        [0.0, 0.0, 0.0, 1.0],  # c=1: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1/2
        [1.0, 1.0],            # two of four samples lost: left out, counted
    ]
    m = eval_metrics(rewards, n=4, ks=[1, 2])
    assert set(m) == {"avg@4", "pass@1", "pass@2", "num_prompts", "num_incomplete"}
    assert m["avg@4"] == approx(Fraction(2 + 1, 8))
    assert m["pass@1"] == approx((Fraction(1, 2) + Fraction(1, 4)) / 2)
    assert m["pass@2"] == approx((Fraction(5, 6) + Fraction(1, 2)) / 2)
    assert m["num_prompts"] == 2
    assert m["num_incomplete"] == 1


def test_eval_metrics_threshold_decides_what_passes_but_avg_keeps_the_raw_rewards():
    rewards = [[0.5, 1.0, 0.25, 0.0]]
    strict = eval_metrics(rewards, n=4, ks=[1])
    assert strict["avg@4"] == approx(Fraction(7, 4) / 4)
    assert strict["pass@1"] == approx(Fraction(1, 4))  # only the 1.0 passes
    lenient = eval_metrics(rewards, n=4, ks=[1], threshold=0.5)
    assert lenient["avg@4"] == strict["avg@4"]
    assert lenient["pass@1"] == approx(Fraction(2, 4))  # 0.5 and 1.0 pass


def test_eval_metrics_without_a_complete_prompt_raises():
    with pytest.raises(ValueError, match="no prompt has all 3 samples"):
        eval_metrics([[1.0], [0.0, 1.0]], n=3, ks=[1])
