"""What a study does with each run directory it finds: skip, start, resume or restart; and the
check that a finished run was made with the fields the study sets."""

import json
import signal

import pytest
import yaml

from asyncrl.lab.analysis.runs import read_run, status_of
from asyncrl.lab.study.plan import StopSignals
from asyncrl.lab.study.runner import decide, mismatches

START = {"step": 0, "event": "start"}
RESUME = {"step": 4, "event": "resume"}


def end(status):
    return {"step": 4, "event": "end", "status": status}


@pytest.mark.parametrize("events, status", [
    ([], "new"),
    ([START], "unfinished"),                                   # running, or killed without a word
    ([START, end("finished")], "finished"),
    ([START, end("interrupted")], "interrupted"),
    ([START, end("failed")], "failed"),
    ([START, end("interrupted"), RESUME], "unfinished"),       # resumed after the stop, not ended yet
    ([START, end("interrupted"), RESUME, end("finished")], "finished"),
])
def test_status_from_events(events, status):
    assert status_of(events) == status


@pytest.mark.parametrize("status, checkpoint, action", [
    ("finished", False, "skip"), ("finished", True, "skip"),
    ("new", False, "start"),
    ("interrupted", True, "resume"), ("failed", True, "resume"), ("unfinished", True, "resume"),
    ("interrupted", False, "restart"), ("unfinished", False, "restart"),
])
def test_decide(status, checkpoint, action):
    assert decide(status, checkpoint) == action


def test_mismatches_name_the_fields():
    cfg = {"algo": {"eps_high": 0.28, "decoupled": False}, "total_steps": 40, "learner": {"betas": [0.9, 0.99]}}
    assert mismatches(cfg, {"algo.eps_high": 0.28, "total_steps": 40.0, "learner.betas": (0.9, 0.99)}) == []
    assert mismatches(cfg, {"algo.eps_high": 0.2, "algo.decoupled": False, "seed": 1}) == [
        "algo.eps_high: the run has 0.28, the study sets 0.2", "seed: the run has None, the study sets 1"]


def test_read_run_skips_a_half_written_line_and_finds_checkpoints(tmp_path):
    run = tmp_path / "r"
    (run / "checkpoints" / "step_2").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "a": 1.0}) + "\n" + '{"step": 2, "a"')
    (run / "events.jsonl").write_text(json.dumps(START) + "\n")
    (run / "config.yaml").write_text(yaml.safe_dump({"seed": 3}))
    rec = read_run(run)
    assert rec.rows == [{"step": 1, "a": 1.0}] and rec.status == "unfinished" and rec.config == {"seed": 3}
    assert not rec.has_checkpoint()  # no COMPLETE marker: a checkpoint being written
    (run / "checkpoints" / "step_2" / "COMPLETE").touch()
    assert rec.has_checkpoint()


def test_series_skips_missing_and_non_finite_values_and_keeps_the_last_row_of_a_step():
    from asyncrl.lab.analysis.runs import series_of

    rows = [{"step": 1, "m": 1.0}, {"step": 2, "m": None}, {"step": 3}, {"step": 4, "m": float("nan")},
            {"step": 5, "m": 2}, {"step": 5, "m": 3}]
    s = series_of(rows, "m")
    assert s.steps == (1.0, 5.0) and s.values == (1.0, 3.0)


def test_a_studys_first_signal_says_how_it_stops_and_a_second_only_counts():
    signals = StopSignals()
    assert (signals.count, signals.first) == (0, None)
    assert signals.received(signal.SIGTERM) is True  # the running runs stop after their step
    assert signals.received(signal.SIGINT) is False  # the caller stops at once
    assert (signals.count, signals.first) == (2, signal.SIGTERM)  # the exit code is 128 + the first
