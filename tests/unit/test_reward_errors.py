"""Reward errors are reported once per kind with their traceback, repeated at most once a minute,
and stop the run past reward.max_error_frac."""

import math

import pytest

from asyncrl.reward.errors import RewardErrorMonitor, RewardErrorsExceeded, error_rate_floor, format_report
from asyncrl.reward.registry import RewardRouter
from asyncrl.config import RewardConfig

OK = {"outcome": "correct", "verifier": "math_verify"}


def _err(kind="KeyError('answer')", verifier="import:mine:score"):
    return {"outcome": "verifier_error", "error": kind, "traceback": "Traceback ...\nKeyError: 'answer'\n",
            "verifier": verifier, "data_source": "d"}


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_first_error_of_each_kind_is_reported_with_traceback_then_rate_limited():
    clock = Clock()
    mon = RewardErrorMonitor(max_frac=1.0, repeat_every_s=60, clock=clock)
    first = mon.observe(_err(), "resp", {"answer": None, "record_key": "k"})
    assert first["traceback"].startswith("Traceback") and first["count"] == 1 and first["scored"] == 1
    assert first["response"] == "resp" and first["metadata"] == "{'answer': None}"
    assert mon.observe(_err(), "r2", {}) is None  # same kind within a minute
    other = mon.observe(_err("ValueError('x')"), "r3", {})  # a new kind is shown at once
    assert other is not None and other["error"] == "ValueError('x')"
    clock.t = 61.0
    again = mon.observe(_err(), "r4", {})
    assert again["count"] == 3 and "traceback" not in again  # a repeat: the count, not the traceback
    assert mon.num_errors == 4 and mon.metrics() == {"reward/errors_total": 4}
    # one type, other messages: a repeat says how many and shows the latest, not the first again
    mon.observe(_err("KeyError('label')"), "r5", {})
    clock.t = 122.0
    later = mon.observe(_err("KeyError('id')"), "r6", {})
    assert later["count"] == 5 and later["error"] == "KeyError('id')" and later["messages"] == 3
    assert format_report(later).endswith("(data source 'd', 5 of 6 samples so far): 3 different messages, "
                                         "the latest: KeyError('id')")


def test_the_error_rate_floor_is_the_wilson_interval_lower_end():
    # by hand, in float64: p = 4/50, z = 3: ((p + 9/100) - 3 sqrt(p(1-p)/50 + 9/10000)) / (1 + 9/50)
    p = 4 / 50
    want = ((p + 9 / 100) - 3 * math.sqrt(p * (1 - p) / 50 + 9 / 10000)) / (1 + 9 / 50)
    assert error_rate_floor(4, 50) == pytest.approx(want, rel=1e-12) and want == pytest.approx(0.020247, abs=1e-6)
    assert error_rate_floor(10, 10) == pytest.approx(10 / 19, rel=1e-12)  # all errors: n / (n + z^2)
    assert error_rate_floor(0, 1000) == 0.0 and error_rate_floor(0, 0) == 0.0


def test_stops_once_the_errors_show_the_rate_above_the_limit_with_confidence():
    mon = RewardErrorMonitor(max_frac=0.1)
    for _ in range(9):
        mon.observe(_err(), "bad response", {"answer": "4"})  # 9 of 9: fewer than MIN_ERRORS
    with pytest.raises(RewardErrorsExceeded) as e:
        mon.observe(_err(), "x", {})  # 10 of 10: the rate is at least 10/19 = 53%
    msg = str(e.value)
    assert "import:mine:score failed on 10 of 10 scored samples (100%; at least 52.6%" in msg
    assert "KeyError('answer')" in msg and "'bad response'" in msg and "reward.max_error_frac=0.1" in msg


def test_a_rate_near_or_below_the_limit_goes_on_however_early_the_errors_come():
    mon = RewardErrorMonitor(max_frac=0.05)
    for i in range(50):
        mon.observe(_err() if i < 4 else OK, "", {})  # 4 of 50 = 8%, at least 2.0%: not above 5%
    for i in range(2000):
        mon.observe(_err() if i % 50 == 0 else OK, "", {})  # then 2%, for long
    assert mon.scored == 2050 and mon.num_errors == 44
    assert error_rate_floor(44, 2050) < 0.05


def test_router_attaches_the_traceback_of_a_raising_function(tmp_path, monkeypatch):
    (tmp_path / "userfn.py").write_text("def score(response, metadata):\n    return metadata['nope']\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    router = RewardRouter(RewardConfig(type="import:userfn:score"))
    reward, info = router("r", {"answer": "1"})
    assert reward == 0.0 and info["outcome"] == "verifier_error" and info["error"] == "KeyError('nope')"
    assert "userfn.py" in info["traceback"] and "metadata['nope']" in info["traceback"]
    text = format_report(dict(RewardErrorMonitor(1.0).observe(info, "r", {"answer": "1"})))
    assert text.startswith("reward error in import:userfn:score (data source None, 1 of 1 samples so far): KeyError")
    assert "metadata['nope']" in text
