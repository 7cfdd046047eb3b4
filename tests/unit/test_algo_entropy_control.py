import math
import random

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
    assert ctrl.metrics() == pytest.approx({"entropy_control/alpha": 0.025, "entropy_control/c": 0.025})


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
