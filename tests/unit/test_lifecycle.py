"""A run's start and shutdown (orchestrator/lifecycle.py): what started is shut down, in reverse,
whatever fails on the way. Fake parts stand in for the processes here; the real start, take-over
and learner restart run in tests/integration (test_warm_runs.py, test_fault_matrix.py)."""

from types import SimpleNamespace

import pytest

from asyncrl.config import load_config
from asyncrl.orchestrator import lifecycle
from asyncrl.types import StartInterrupted


def test_shut_down_runs_every_closer_in_order_and_says_which_failed():
    done, said = [], []

    def broken():
        done.append("learner")
        raise RuntimeError("rank 1 gone")

    lifecycle.shut_down(said.append, broken, None, lambda: done.append("pool"), lambda: done.append("lock"))
    assert done == ["learner", "pool", "lock"]  # the failure and the part never started stop nothing
    assert len(said) == 1 and "broken" in said[0] and "rank 1 gone" in said[0]


def fake_start(monkeypatch, events, build_driver=None):
    """start_run's parts as fakes that record, in `events`, what was done to them and when (a part's
    wait checks `stopping` once, as the real wait does between its polls)."""
    def part(name):
        def close():
            events.append(f"close {name}")

        def wait_started(stopping=None, say=None):
            events.append(f"wait for the {name}")
            lifecycle.components.check_stop(stopping)

        return SimpleNamespace(close=close, shutdown=close, wait_started=wait_started,
                               endpoint="tcp://127.0.0.1:1", answer_storage_probe=None)

    def start_processes(*a):
        events.append("spawn the processes")
        return lifecycle.Processes(learner=part("learner"), pool=part("pool"), weight_sync=None)

    def driver(*a, teacher):  # no teacher: no algo.distill
        events.append("build the driver")
        return part("driver")

    monkeypatch.setattr(lifecycle.components, "resolve_model_path", lambda cfg, log: "base")
    monkeypatch.setattr(lifecycle.components, "node_ip", lambda: "127.0.0.1")
    monkeypatch.setattr(lifecycle.components, "tiny_spec", lambda cfg: None)
    monkeypatch.setattr(lifecycle, "build_driver", build_driver or driver)
    monkeypatch.setattr(lifecycle, "FrameReceiver", lambda *a, **k: part("samples"))
    monkeypatch.setattr(lifecycle, "start_processes", start_processes)


def test_a_start_that_fails_shuts_down_what_it_started_in_reverse(monkeypatch, tmp_path):
    events = []
    fake_start(monkeypatch, events)

    def no_shared_storage(run_dir, probe):
        raise RuntimeError("the run directory is not shared")

    monkeypatch.setattr(lifecycle.checkpoint, "check_shared", no_shared_storage)
    cfg = load_config(None)
    with pytest.raises(RuntimeError, match="not shared"):
        lifecycle.start_run(cfg, tmp_path, None, None, metrics=None, say=lambda m: None)
    # the driver is built while the engines load: after their processes are spawned, before the wait
    assert events == ["spawn the processes", "build the driver", "wait for the pool", "wait for the learner",
                      "close learner", "close pool", "close samples", "close driver"]


def test_a_driver_that_fails_to_build_stops_the_processes_spawned_before_it(monkeypatch, tmp_path):
    events = []

    def bad_data(*a, teacher):
        raise ValueError("data.path: no such file")

    fake_start(monkeypatch, events, build_driver=bad_data)
    with pytest.raises(ValueError, match="no such file"):
        lifecycle.start_run(load_config(None), tmp_path, None, None, metrics=None, say=lambda m: None)
    assert events == ["spawn the processes", "close learner", "close pool", "close samples"]


def test_a_stop_asked_for_while_the_engines_load_ends_the_start_and_shuts_down_what_started(monkeypatch, tmp_path):
    events, asked = [], []
    fake_start(monkeypatch, events)

    def stopping():  # SIGTERM arrives once the driver is built, while the engines load
        return "SIGTERM" if "build the driver" in events else None

    monkeypatch.setattr(lifecycle.checkpoint, "check_shared", lambda *a: asked.append("storage"))
    with pytest.raises(StartInterrupted) as e:
        lifecycle.start_run(load_config(None), tmp_path, None, None, metrics=None, say=lambda m: None,
                            stopping=stopping)
    assert e.value.reason == "SIGTERM" and str(e.value) == "SIGTERM during start-up"
    assert e.value.line() == "SIGTERM during start-up: stopped before the first step, nothing to save"
    # neither the learner's wait nor anything after it ran; what started is shut down in reverse
    assert events == ["spawn the processes", "build the driver", "wait for the pool",
                      "close learner", "close pool", "close samples", "close driver"] and not asked


def test_a_stop_asked_for_before_the_start_starts_nothing(monkeypatch, tmp_path):
    events = []
    fake_start(monkeypatch, events)
    with pytest.raises(StartInterrupted, match="SIGINT during start-up"):
        lifecycle.start_run(load_config(None), tmp_path, None, None, metrics=None, say=lambda m: None,
                            stopping=lambda: "SIGINT")
    assert events == []
