"""RewardPool: rewards computed in worker processes while generation goes on, each call with a
hard timeout, so a verifier that hangs or crashes can never stall the run.

    submit(key, response, metadata) ─► queue ─► idle worker (one call at a time) ─► poll() results

Each worker builds its verifier once (`factory`, e.g. the RewardRouter of the run's config) and
then answers one call at a time over a pipe. The parent never blocks on a worker: `poll` collects
finished results, and for a call past `timeout_s` it kills the worker and yields reward 0 with
outcome `timeout`; a worker that died mid-call yields outcome `worker_crash`. Either way a fresh
worker replaces it and the pool's counters say how often it happened.

Workers come from a forkserver that has already imported the verifiers and warmed their caches
(reward/preload.py), so a replacement starts in milliseconds, warm, instead of re-importing sympy;
the clock of a call starts when a ready worker takes it. A killed worker first gets SIGTERM, on
which it kills the code sandboxes it is running (they sit in process groups of their own), then,
if it is still alive kill_grace_s later, SIGKILL; the caller never waits for either.

Sizing: a hung call holds a worker for timeout_s, so num_workers must exceed
samples/s x hang fraction x timeout_s, plus what the verifiers need when nothing hangs.
The factory must be importable (a module's function or class, not one defined in the script).
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import signal
import sys
import time
import types
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from asyncrl.reward.base import RewardFn

PRELOAD = ("asyncrl.reward.preload",)  # the verifiers, imported and warmed once for all workers


@dataclass
class RewardResult:
    key: Any
    reward: float
    info: dict[str, Any]
    latency_s: float


@dataclass
class PoolStats:
    submitted: int = 0
    completed: int = 0
    timeouts: int = 0
    crashes: int = 0
    workers_started: int = 0
    outcomes: Counter = field(default_factory=Counter)


def _worker_main(conn: Connection, factory: Callable[[], RewardFn]) -> None:
    def on_term(*_):  # take running sandboxes down with this worker
        sandbox = sys.modules.get("asyncrl.reward.sandbox")
        if sandbox is not None and hasattr(sandbox, "kill_active"):
            sandbox.kill_active()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    try:
        verifier = factory()
    except Exception as e:  # a replacement would fail the same way: the pool stops the run
        conn.send(("failed", repr(e)[:1000]))
        return
    conn.send(("ready",))
    while True:
        msg = conn.recv()
        if msg is None:
            return
        task_id, response, metadata = msg
        t0 = time.monotonic()
        try:
            reward, info = verifier(response, metadata)
            reward = float(reward)
        except Exception as e:  # a verifier bug costs this sample its reward, not the run
            reward, info = 0.0, {"outcome": "verifier_error", "error": repr(e)[:300]}
        conn.send((task_id, reward, info, time.monotonic() - t0))


@dataclass
class _Worker:
    proc: Any
    conn: Connection
    ready: bool = False
    task: tuple[int, Any, float] | None = None  # (task id, key, start time)


class RewardPool:
    def __init__(self, factory: Callable[[], RewardFn], num_workers: int, timeout_s: float,
                 kill_grace_s: float = 1.0, preload: tuple[str, ...] = PRELOAD):
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(f"need num_workers >= 1 and timeout_s > 0, got {num_workers}, {timeout_s}")
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload([m for m in preload if _importable(m)])
        self._factory = factory
        self.timeout_s = timeout_s
        self.kill_grace_s = kill_grace_s
        self.stats = PoolStats()
        self._ids = itertools.count()
        self._queue: deque[tuple[int, Any, str, dict[str, Any]]] = deque()
        self._dying: list[tuple[Any, float]] = []  # (process, when to SIGKILL it)
        self._early: list[RewardResult] = []  # collected by wait_ready, returned by the next poll
        self._workers = [self._start_worker() for _ in range(num_workers)]

    @property
    def num_pending(self) -> int:
        """Calls submitted and not yet returned by poll (queued or running)."""
        return len(self._queue) + len(self._early) + sum(w.task is not None for w in self._workers)

    def wait_ready(self, timeout_s: float = 60.0) -> bool:
        """Wait until every worker has built its verifier (for benchmarks: start-up is not what
        they measure); True if all have. Results that arrive meanwhile are kept for `poll`."""
        deadline = time.monotonic() + timeout_s
        while not all(w.ready for w in self._workers) and time.monotonic() < deadline:
            self._early.extend(self.poll(0.05))
        return all(w.ready for w in self._workers)

    def submit(self, key: Any, response: str, metadata: dict[str, Any]) -> None:
        self.stats.submitted += 1
        self._queue.append((next(self._ids), key, response, metadata))
        self._dispatch()

    def poll(self, timeout_s: float = 0.0) -> list[RewardResult]:
        """Results that are ready (waiting up to timeout_s for the first), timeouts and crashes."""
        out, self._early = self._early, []
        conns = [w.conn for w in self._workers if w.task is not None or not w.ready]
        if conns:
            wait(conns, timeout=timeout_s)
        for i, w in enumerate(self._workers):
            out.extend(self._collect(i, w))
        self._dispatch()
        self._reap()
        return out

    def _collect(self, i: int, w: _Worker) -> list[RewardResult]:
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                if msg[0] == "ready":
                    w.ready = True
                    continue
                if msg[0] == "failed":
                    raise RuntimeError(f"a reward worker could not build its verifier: {msg[1]}")
                task_id, reward, info, latency = msg
                _, key, _ = w.task
                w.task = None
                return [self._result(key, reward, info, latency)]
        except (EOFError, OSError):
            pass  # the worker died: handled below
        if w.task is not None and time.monotonic() - w.task[2] > self.timeout_s:
            self.stats.timeouts += 1
            return [self._replace(i, "timeout")]
        if not w.proc.is_alive():
            self.stats.crashes += 1
            return [self._replace(i, "worker_crash")] if w.task is not None else self._restart(i)
        return []

    def _result(self, key: Any, reward: float, info: dict[str, Any], latency: float) -> RewardResult:
        self.stats.completed += 1
        self.stats.outcomes[info.get("outcome", "unknown")] += 1
        return RewardResult(key, reward, info, latency)

    def _replace(self, i: int, outcome: str) -> RewardResult:
        w = self._workers[i]
        _, key, t0 = w.task
        self._stop(w)
        self._workers[i] = self._start_worker()
        return self._result(key, 0.0, {"outcome": outcome}, time.monotonic() - t0)

    def _restart(self, i: int) -> list[RewardResult]:
        self._stop(self._workers[i])
        self._workers[i] = self._start_worker()
        return []

    def _dispatch(self) -> None:
        for w in self._workers:
            if not self._queue:
                return
            if w.ready and w.task is None:
                task_id, key, response, metadata = self._queue.popleft()
                w.task = (task_id, key, time.monotonic())
                try:
                    w.conn.send((task_id, response, metadata))
                except (BrokenPipeError, OSError):
                    pass  # the worker is gone; the next poll reports it as a crash

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        proc = self._ctx.Process(target=_worker_main, args=(child, self._factory), daemon=True)
        with _main_hidden():
            proc.start()
        child.close()
        self.stats.workers_started += 1
        return _Worker(proc, parent)

    def _stop(self, w: _Worker) -> None:
        """SIGTERM now and SIGKILL after kill_grace_s (in `_reap`), without waiting here: a worker
        stuck in C code ignores SIGTERM, and the loop must not wait for it."""
        w.conn.close()
        if w.proc.is_alive():
            w.proc.terminate()
        self._dying.append((w.proc, time.monotonic() + self.kill_grace_s))

    def _reap(self) -> None:
        dying = []
        for proc, kill_at in self._dying:
            if proc.is_alive():  # also reaps it once it has exited
                if time.monotonic() > kill_at:
                    proc.kill()
                dying.append((proc, kill_at))
        self._dying = dying

    def metrics(self) -> dict[str, float]:
        s = self.stats
        return {"reward/pool_timeouts": s.timeouts, "reward/pool_crashes": s.crashes,
                "reward/pool_pending": self.num_pending, "reward/pool_workers_started": s.workers_started}

    def close(self) -> None:
        for w in self._workers:
            try:
                w.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for w in self._workers:
            w.proc.join(1.0)
            self._stop(w)
        self._workers = []
        deadline = time.monotonic() + self.kill_grace_s + 5
        while self._dying and time.monotonic() < deadline:
            self._reap()
            time.sleep(0.01)


@contextlib.contextmanager
def _main_hidden():
    """multiprocessing runs the parent's main script again in every child it starts, so that
    functions defined there can be unpickled; a worker needs nothing from it (the factory must be
    importable), and for a script that imports torch and Ray that costs seconds per worker, which
    under a short timeout turns one hang into a cascade. (Python 3.11's forkserver `__main__`
    preload, meant to do it once, never receives the script's path.)"""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")  # no __file__, no __spec__: skipped
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
