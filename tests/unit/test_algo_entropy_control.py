import math
import random
import warnings

import pytest

from asyncrl.algo.entropy_control import AdaptiveEntropyController


def _eq_3_2(entropies, target, delta, c_max=math.inf):
    """Skywork-OR1 eq. 3.2 written literally (with c kept in [0, c_max])."""
    c, alphas = 0.0, []
    for e in entropies:
        alphas.append(c * (1.0 if e <= target else 0.0))
        if e < target:
            c = c + delta
        elif e > target:
            c = c - delta
        c = min(max(c, 0.0), c_max)
    return alphas


def test_alpha_sequence_by_hand():
    # tgt 0.2, Delta 0.01, c_max 0.025; alpha_k uses c_k, then c moves
    ctrl = AdaptiveEntropyController(target=0.2, delta=0.01, c_max=0.025)
    entropies = [0.3, 0.1, 0.1, 0.2, 0.25, 0.1, 0.1, 0.1]
    # c:      0 -> 0 (floor) -> .01 -> .02 -> .02 (e == tgt) -> .01 -> .02 -> .025 (cap) -> .025
    # alpha:  0 (e > tgt), 0, .01, .02 (e == tgt counts as <=), 0 (e > tgt), .01, .02, .025
    alphas = [ctrl.update(e) for e in entropies]
    assert alphas == pytest.approx([0.0, 0.0, 0.01, 0.02, 0.0, 0.01, 0.02, 0.025], abs=1e-15)
    assert ctrl.coef == pytest.approx(0.025) and ctrl.num_updates == 8
    assert ctrl.metrics() == pytest.approx({"entropy_control/alpha": 0.025, "entropy_control/c": 0.025,
                                            "entropy_control/saturated": 1.0})


def test_saturated_says_when_c_sits_at_its_cap():
    """The shipped Skywork preset's c sat at its cap 0.005 from step 1 (delta 0.005): a fixed
    coefficient, not a controller. `saturated` is 1 exactly while c == c_max."""
    ctrl = AdaptiveEntropyController(target=0.2, delta=0.005, c_max=0.005)
    seen = []
    for e in [0.1, 0.1, 0.3, 0.1]:
        ctrl.update(e)
        seen.append(ctrl.metrics()["entropy_control/saturated"])
    assert seen == [1.0, 1.0, 0.0, 1.0]  # c: 0.005, 0.005, 0, 0.005
    free = AdaptiveEntropyController(target=0.2, delta=0.005)  # the paper's text: no cap
    for _ in range(3):
        free.update(0.1)
        assert free.metrics()["entropy_control/saturated"] == 0.0
    assert free.coef == pytest.approx(0.015, abs=1e-15)


def test_a_cap_reached_in_one_step_is_warned_at_start():
    from asyncrl.config import AlgoConfig

    with pytest.warns(UserWarning, match=r"coef_max \(0.005\) <= delta \(0.005\)"):
        AlgoConfig(entropy_control={"enabled": True})  # the defaults: the paper's delta, the scripts' cap
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        AlgoConfig(entropy_control={"enabled": True, "coef_max": None})
        AlgoConfig(entropy_control={"enabled": True, "coef_max": 0.05})
        AlgoConfig(entropy_control={"enabled": False})


def test_alpha_sequence_matches_equation_on_a_long_run():
    rng = random.Random(0)
    entropies = [max(0.0, 0.2 + rng.gauss(0, 0.05)) for _ in range(300)] + [0.2] * 5 + [0.05] * 50
    ctrl = AdaptiveEntropyController(target=0.2, delta=0.005)  # Skywork-OR1's settings
    got = [ctrl.update(e) for e in entropies]
    assert got == pytest.approx(_eq_3_2(entropies, 0.2, 0.005), abs=1e-12)
    assert all(a >= 0 for a in got)


def test_state_dict_roundtrip_continues_identically():
    a = AdaptiveEntropyController(0.2, 0.01, c_max=1.0)
    for e in [0.1, 0.1, 0.1, 0.3]:
        a.update(e)
    state = a.state_dict()
    b = AdaptiveEntropyController(0.2, 0.01, c_max=1.0)
    b.load_state_dict(dict(state))
    assert b.coef == a.coef and b.num_updates == 4 and b.last_alpha == a.last_alpha
    rest = [0.15, 0.25, 0.1, 0.2]
    assert [b.update(e) for e in rest] == [a.update(e) for e in rest]


def test_errors():
    with pytest.raises(ValueError):
        AdaptiveEntropyController(0.2, 0.0)
    with pytest.raises(ValueError):
        AdaptiveEntropyController(0.2, 0.01, c_max=-1.0)
    ctrl = AdaptiveEntropyController(0.2, 0.01, c_max=0.05)
    with pytest.raises(ValueError):
        ctrl.update(float("nan"))
    with pytest.raises(ValueError):
        ctrl.load_state_dict({"coef": 0.5, "num_updates": 3})
