import pytest

from asyncrl.algo.reward_shaping import no_eos_penalty, shaped_reward, soft_overlong_penalty


def test_soft_overlong_small_case_by_hand():
    # L_max 10, L_cache 4: free up to 6, then -1/4 per token, -1 past 10
    got = [soft_overlong_penalty(n, 10, 4) for n in range(13)]
    assert got == pytest.approx([0.0] * 7 + [-0.25, -0.5, -0.75, -1.0, -1.0, -1.0], abs=1e-15)


def test_soft_overlong_dapo_settings():
    # DAPO: expected max 16384 + 4096 cache = L_max 20480
    assert soft_overlong_penalty(16384, 20480, 4096) == 0.0
    assert soft_overlong_penalty(16385, 20480, 4096) == pytest.approx(-1 / 4096)
    assert soft_overlong_penalty(18432, 20480, 4096) == pytest.approx(-0.5)
    assert soft_overlong_penalty(20480, 20480, 4096) == pytest.approx(-1.0)
    assert soft_overlong_penalty(20481, 20480, 4096) == -1.0


def test_soft_overlong_factor_and_errors():
    assert soft_overlong_penalty(9, 10, 4, penalty_factor=0.5) == pytest.approx(-0.375)
    assert soft_overlong_penalty(11, 10, 4, penalty_factor=0.5) == pytest.approx(-0.5)
    assert soft_overlong_penalty(3, 10, 10) == pytest.approx(-0.3)
    for args in [(5, 10, 0), (5, 10, 11), (-1, 10, 4)]:
        with pytest.raises(ValueError):
            soft_overlong_penalty(*args)


def test_no_eos_penalty():
    assert no_eos_penalty(1.0, True, 0.5) == 1.0
    assert no_eos_penalty(1.0, False, 0.5) == pytest.approx(0.5)
    assert no_eos_penalty(0.0, False, 0.5) == pytest.approx(-0.5)
    assert no_eos_penalty(1.0, False, 0.5, replace=True) == pytest.approx(-0.5)
    with pytest.raises(ValueError):
        no_eos_penalty(1.0, False, -0.1)


def test_shaped_reward_combines_both_and_reports_terms():
    reward, metrics = shaped_reward(1.0, 9, False, no_eos_penalty_value=0.5, max_length=10, overlong_buffer=4)
    assert reward == pytest.approx(1.0 - 0.5 - 0.75)
    assert metrics == pytest.approx({"reward/no_eos_penalty": -0.5, "reward/overlong_penalty": -0.75})
    assert shaped_reward(1.0, 10_000, False) == (1.0, {"reward/no_eos_penalty": 0.0, "reward/overlong_penalty": 0.0})
    with pytest.raises(ValueError):
        shaped_reward(1.0, 9, True, overlong_buffer=4)
