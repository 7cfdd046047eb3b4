"""RewardPool: rewards computed in worker processes while generation goes on, each call with a
hard timeout, so a verifier that hangs or crashes can never stall the run.

    submit(key, response, metadata) ─► queue ─► [dispatcher thread] ─► idle worker ─► poll() results

Each worker builds its verifier once (`factory`, e.g. the RewardRouter of the run's config) and
then answers one call at a time over a pipe. A dispatcher thread in the parent hands each call
to an idle worker and collects its answer; the caller never blocks on a worker: `poll` returns
the finished results, and for a call past `timeout_s` the dispatcher kills the worker and yields
reward 0 with outcome `timeout`; a worker that died mid-call yields outcome `worker_crash`.
Either way a fresh worker replaces it and the pool's counters say how often it happened.

Workers come from a forkserver that has already imported the verifiers and warmed their caches
(reward/preload.py), so a replacement starts in milliseconds, warm, instead of re-importing sympy;
the clock of a call starts when a ready worker takes it. A killed worker first gets SIGTERM, on
which it kills the code sandbox runs it has and ends their launchers, then, if it is still alive
kill_grace_s later, SIGKILL (its launchers then kill their runs themselves, seeing it gone); the
caller never waits for either.

Sizing: a hung call holds a worker for timeout_s, so num_workers must exceed
samples/s x hang fraction x timeout_s, plus what the verifiers need when nothing hangs.
The factory must be importable (a module's function or class, not one defined in the script).
"""

from __future__ import annotations

import contextlib
import itertools
import multiprocessing as mp
import signal
import socket
import sys
import threading
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


def _release_sandboxes() -> None:
    """Kill this worker's code sandbox runs and end their launchers (multiprocessing ends a worker
    with os._exit, which skips atexit; a worker killed outright leaves its launchers to notice)."""
    sandbox = sys.modules.get("asyncrl.reward.sandbox")
    if sandbox is not None and hasattr(sandbox, "kill_active"):
        sandbox.kill_active()
        sandbox.release()


def _worker_main(conn: Connection, factory: Callable[[], RewardFn]) -> None:
    def on_term(*_):  # take running sandboxes down with this worker
        _release_sandboxes()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    try:
        _serve(conn, factory)
    finally:
        _release_sandboxes()


def _serve(conn: Connection, factory: Callable[[], RewardFn]) -> None:
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
        # Everything above and below is shared with the dispatcher thread, under this lock.
        self._lock = threading.Condition()
        self._results: list[RewardResult] = []  # finished, until the next poll
        self._error: BaseException | None = None  # what stopped the dispatcher, raised by poll
        self._closing = False
        self._wake_r, self._wake_w = socket.socketpair()  # submit and close interrupt its wait
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._workers = [self._start_worker() for _ in range(num_workers)]
        self._thread = threading.Thread(target=self._dispatcher, name="reward-pool", daemon=True)
        self._thread.start()

    @property
    def num_pending(self) -> int:
        """Calls submitted and not yet returned by poll (queued, running or finished)."""
        with self._lock:
            return len(self._queue) + len(self._results) + sum(w.task is not None for w in self._workers)

    @property
    def num_queued(self) -> int:
        """Calls waiting for a free worker: when nonzero, the verifiers are a bottleneck."""
        return len(self._queue)

    def wait_ready(self, timeout_s: float = 60.0) -> bool:
        """Wait until every worker has built its verifier (for benchmarks: start-up is not what
        they measure); True if all have."""
        with self._lock:
            self._lock.wait_for(lambda: self._error is not None or all(w.ready for w in self._workers), timeout_s)
            return all(w.ready for w in self._workers)

    def submit(self, key: Any, response: str, metadata: dict[str, Any]) -> None:
        with self._lock:
            self.stats.submitted += 1
            self._queue.append((next(self._ids), key, response, metadata))
        self._wake()

    def poll(self, timeout_s: float = 0.0) -> list[RewardResult]:
        """Results that are ready, timeouts and crashes included (waiting up to timeout_s for the
        first). Raises what stopped the pool, e.g. a worker that cannot build its verifier."""
        with self._lock:
            self._lock.wait_for(lambda: self._results or self._error is not None, timeout_s)
            if self._error is not None:
                raise RuntimeError(f"the reward pool stopped: {self._error}") from self._error
            out, self._results = self._results, []
        return out

    # -- the dispatcher thread ------------------------------------------------------------------
    # A worker gets its next call the moment it answers, not when the training loop next polls
    # (every ~10 ms, longer under load): with short verifier calls that left workers idle most
    # of the time. It waits on the workers' pipes, the wake-up socket and the nearest deadline.

    def _dispatcher(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closing:
                        return
                    self._dispatch()
                    conns = [w.conn for w in self._workers if w.task is not None or not w.ready]
                    timeout = self._next_deadline() - time.monotonic()
                wait([*conns, self._wake_r], timeout=min(max(timeout, 0.0), 0.1))
                with contextlib.suppress(BlockingIOError):
                    self._wake_r.recv(4096)
                with self._lock:
                    for i, w in enumerate(self._workers):
                        self._results.extend(self._collect(i, w))
                    self._dispatch()
                    self._reap()
                    self._lock.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the caller by poll
            with self._lock:
                self._error = e
                self._lock.notify_all()

    def _next_deadline(self) -> float:
        times = [w.task[2] + self.timeout_s for w in self._workers if w.task is not None]
        times += [kill_at for _, kill_at in self._dying]
        return min(times, default=time.monotonic() + 0.1)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"x")

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
                    pass  # the worker is gone; the next collect reports it as a crash

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
        return {"reward/pool_timeouts_total": s.timeouts, "reward/pool_crashes_total": s.crashes,
                "reward/pool_pending": self.num_pending, "reward/pool_workers_started_total": s.workers_started}

    def close(self) -> None:
        with self._lock:
            self._closing = True
        self._wake()
        self._thread.join(5.0)
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
        self._wake_r.close()
        self._wake_w.close()


@contextlib.contextmanager
def _main_hidden():
    """multiprocessing runs the parent's main script again in every child it starts, so that
    functions defined there can be unpickled; a worker needs nothing from it (the factory must be
    importable), and for a script that imports torch and Ray that costs seconds per worker, which
    under a short timeout turns one hang into a cascade. (Python 3.11's forkserver `__main__`
    preload, meant to do it once, never receives the script's path.)

    Replacements start on the dispatcher thread, so for the few milliseconds of `proc.start` the
    main thread also sees the empty `__main__`; what it could do with it then, pickling a function
    defined in the script, cloudpickle does by value either way."""
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
