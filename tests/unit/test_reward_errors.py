"""Reward errors are reported once per kind with their traceback, repeated at most once a minute,
and stop the run past reward.max_error_frac."""

import pytest

from asyncrl.reward.errors import RewardErrorMonitor, RewardErrorsExceeded, format_report
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


def test_stops_past_the_fraction_once_enough_samples_are_scored():
    mon = RewardErrorMonitor(max_frac=0.1, min_samples=20)
    for _ in range(17):
        mon.observe(OK, "", {})
    for _ in range(2):
        mon.observe(_err(), "bad response", {"answer": "4"})  # 2 of 19: below min_samples
    with pytest.raises(RewardErrorsExceeded) as e:
        mon.observe(_err(), "x", {})  # 3 of 20 = 15% > 10%
    msg = str(e.value)
    assert "import:mine:score failed on 3 of 20 scored samples (15%" in msg
    assert "KeyError('answer')" in msg and "'bad response'" in msg and "reward.max_error_frac=0.1" in msg


def test_at_the_fraction_exactly_it_goes_on():
    mon = RewardErrorMonitor(max_frac=0.1, min_samples=10)
    for i in range(10):
        mon.observe(_err() if i == 0 else OK, "", {})  # 1 of 10 = 10%, not above
    assert mon.scored == 10 and mon.num_errors == 1


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
