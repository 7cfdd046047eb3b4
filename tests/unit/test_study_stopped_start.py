"""A study's run stopped while it starts (asyncrl/lab/study/warm_runs.py): the run's log says what
`asyncrl run` says, the exit code is 128 + the signal, the run's processes end, and processes left
by the last run that the stopped one had not taken over end too (the next run starts fresh)."""

import signal

import pytest

import asyncrl.orchestrator.orchestrator as orchestrator_module
import asyncrl.preflight as preflight_module
from asyncrl.lab.study.warm_runs import _one_run
from asyncrl.types import StartInterrupted


class StoppedWhileStarting:
    """An Orchestrator whose start a SIGTERM interrupts before it takes anything over."""

    made: list["StoppedWhileStarting"] = []

    def __init__(self, cfg, log_fn, run_lock):
        self.learner, self.stop_reason, self.shut = None, "SIGTERM", False
        self.run_lock = run_lock
        StoppedWhileStarting.made.append(self)

    def run(self, warm=None):
        raise StartInterrupted(self.stop_reason)

    def release(self):
        raise AssertionError("a stopped start has nothing to hand on")

    def shutdown(self):
        self.shut = True
        self.run_lock.release()


class LastRunsProcesses:
    learner = object()

    def __init__(self):
        self.shut = False

    def fits(self, cfg):
        return []  # the same process-shaping fields: the run would take them over

    def shutdown(self, say=print):
        self.shut = True


@pytest.fixture
def fake_start(monkeypatch):
    StoppedWhileStarting.made = []
    monkeypatch.setattr(orchestrator_module, "Orchestrator", StoppedWhileStarting)
    monkeypatch.setattr(preflight_module, "preflight", lambda cfg: cfg)  # no model to check here


@pytest.mark.parametrize("with_warm", [False, True])
def test_a_study_run_stopped_while_starting_exits_like_asyncrl_run_and_ends_its_processes(
        tmp_path, fake_start, with_warm):
    log = tmp_path / "run.log"
    warm = LastRunsProcesses() if with_warm else None
    current = [None]
    with open(log, "w") as out:
        code, left, reused = _one_run(None, [f"observe.output_dir={tmp_path}", "name=arm"], warm, current, out)
    assert code == 128 + signal.SIGTERM == 143
    assert left is None and reused is with_warm and current == [None]
    assert log.read_text() == "SIGTERM during start-up: stopped before the first step, nothing to save\n"
    (orch,) = StoppedWhileStarting.made
    assert orch.shut
    if with_warm:
        assert warm.shut  # not taken over: ended here, so the next run starts its own
