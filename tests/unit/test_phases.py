"""Per-phase wall time of learner work (learner/phases.py): nothing is kept outside a timing, and
inside one each phase's time is added up, nested work included."""

import time

from asyncrl.learner.phases import PHASES, phase, timing_phases


def test_phases_add_up_only_while_timed():
    with phase("forward"):
        time.sleep(0.01)  # not timed: no clock to add it to
    with timing_phases() as clock:
        for _ in range(2):
            with phase("forward"):
                time.sleep(0.02)
        with phase("optimizer"):
            time.sleep(0.01)
    with phase("forward"):
        time.sleep(0.01)  # after the timing: the clock it returned stays as it was
    assert set(clock) == set(PHASES)
    # at least the sleeps; the untimed ones (0.02 s) are not in it, whatever a loaded machine adds
    assert 0.04 <= clock["forward"] < 0.04 + 1.0 and 0.01 <= clock["optimizer"] < 0.01 + 1.0
    assert clock["head"] == clock["backward"] == 0.0
