import gc
import weakref

from asyncrl.orchestrator.collector import ScheduledCollector


class Node:
    def __init__(self):
        self.other = None


def cycle() -> weakref.ref:
    """Two objects that refer to each other: only the cyclic collector frees them."""
    a, b = Node(), Node()
    a.other, b.other = b, a
    return weakref.ref(a)


def test_the_collector_runs_only_when_due_frees_cycles_then_and_release_restores_the_interpreter():
    now = [100.0]
    collector = ScheduledCollector(every_s=10.0, clock=lambda: now[0])
    assert gc.isenabled()
    collector.start()
    try:
        assert not gc.isenabled() and gc.get_freeze_count() > 0  # start-up's heap is frozen
        assert collector.maybe_collect() is False  # not due yet
        ref = cycle()
        for _ in range(20_000):  # far past the automatic collector's thresholds: nothing runs
            [[]]
        assert ref() is not None
        now[0] = 109.9
        assert collector.maybe_collect() is False and ref() is not None
        now[0] = 110.0
        assert collector.maybe_collect() is True
        assert ref() is None  # the cycle was freed by the scheduled collection
        assert collector.maybe_collect() is False  # the next one is due 10 s later
        m = collector.metrics()
        assert collector.num_collections == 1 and m["timing/gc_s"] == m["timing/gc_total_s"] > 0
        assert collector.metrics()["timing/gc_s"] == 0.0  # a window per metrics row
    finally:
        collector.release()
    assert gc.isenabled() and gc.get_freeze_count() == 0
    collector.release()  # a second release (shutdown after a failed start) changes nothing
    assert gc.isenabled()


def test_release_without_start_leaves_the_collector_alone():
    collector = ScheduledCollector()
    gc.disable()
    try:
        collector.release()
        assert not gc.isenabled()  # a process that had it off keeps it off
        assert collector.maybe_collect() is False
    finally:
        gc.enable()
