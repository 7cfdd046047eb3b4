"""RewardPool: rewards computed in worker processes while generation goes on, each call with a
hard timeout, so a verifier that hangs or crashes can never stall the run.

    submit(key, response, metadata) ─► queue ─► [dispatcher thread] ─► idle worker ─► poll() results

Each worker builds its verifier once (`factory`, e.g. the RewardRouter of the run's config) and
then runs the calls it is handed, in order, over a pipe, answering each as it finishes. A
dispatcher thread in the parent hands calls to workers and collects their answers; the caller
never blocks on a worker: `poll` returns the finished results, and for a call past `timeout_s`
the dispatcher kills the worker and yields reward 0 with outcome `timeout`; a worker that died
mid-call yields outcome `worker_crash`. Either way a fresh worker replaces it, the calls it had
been handed but not started go back to the head of the queue, and the pool's counters say how
often it happened.

Batches: one call per pipe message costs a round trip of two processes waking each other, about
0.25 ms, which caps a pool of cheap verifiers at a few thousand calls/s whatever their cost. So
when calls are waiting and recent calls were fast, a worker is handed several at once
(`batch_size`: about BATCH_S of work, at most MAX_BATCH calls); it still answers each as it
finishes, and each call keeps its own clock: it starts when the worker finished the call before
it (the worker says when), or when the batch was handed over, whichever is later. With slow
verifiers or a short queue every batch holds one call, as before batching existed.

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
BATCH_S = 0.02  # a worker is handed about this much work at once (by the recent mean call time)
MAX_BATCH = 64


def batch_size(num_waiting: int, num_idle: int, mean_call_s: float | None) -> int:
    """How many waiting calls to hand one idle worker: an even share of the queue, at most
    BATCH_S of work by the recent mean call time and at most MAX_BATCH; 1 until a call has been
    timed. Calls queued behind one that hangs wait for its timeout, so only fast verifiers batch."""
    if num_waiting <= 0 or num_idle <= 0:
        return 0
    if mean_call_s is None:
        return 1
    share = -(-num_waiting // num_idle)
    by_time = int(BATCH_S / max(mean_call_s, 1e-6))
    return max(1, min(share, by_time, MAX_BATCH))


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
        batch = conn.recv()
        if batch is None:
            return
        for task_id, response, metadata in batch:
            t0 = time.monotonic()
            try:
                reward, info = verifier(response, metadata)
                reward = float(reward)
            except Exception as e:  # a verifier bug costs this sample its reward, not the run
                reward, info = 0.0, {"outcome": "verifier_error", "error": repr(e)[:300]}
            t1 = time.monotonic()  # also when the next call of the batch starts (one clock, see time(7))
            conn.send((task_id, reward, info, t1 - t0, t1))


Task = tuple[int, Any, str, dict[str, Any]]  # (task id, key, response, metadata)


@dataclass
class _Worker:
    proc: Any
    conn: Connection
    ready: bool = False
    tasks: deque = field(default_factory=deque)
    """(task, time handed over) of every call handed to it and not answered, in its order."""
    started: float = 0.0
    """When its first unanswered call started: that call's clock for the timeout."""


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
        self._queue: deque[Task] = deque()
        self._mean_call_s: float | None = None  # recent verifier call time, for batch_size
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
            return len(self._queue) + len(self._results) + sum(len(w.tasks) for w in self._workers)

    @property
    def num_queued(self) -> int:
        """Calls waiting for a free worker (queued, or handed over in a batch and not started):
        when nonzero, the verifiers are a bottleneck."""
        with self._lock:
            return len(self._queue) + sum(max(len(w.tasks) - 1, 0) for w in self._workers)

    def wait_ready(self, timeout_s: float = 60.0) -> bool:
        """Wait until every worker has built its verifier (for benchmarks: start-up is not what
        they measure); True if all have."""
        with self._lock:
            self._lock.wait_for(lambda: self._error is not None or all(w.ready for w in self._workers), timeout_s)
            return all(w.ready for w in self._workers)

    def submit(self, key: Any, response: str, metadata: dict[str, Any]) -> None:
        self.submit_many([(key, response, metadata)])

    def submit_many(self, calls: list[tuple[Any, str, dict[str, Any]]]) -> None:
        """Several (key, response, metadata) calls at once: one lock and one wake-up for all."""
        if not calls:
            return
        with self._lock:
            self.stats.submitted += len(calls)
            self._queue.extend((next(self._ids), key, response, metadata) for key, response, metadata in calls)
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
    # A worker gets its next calls the moment it has answered, not when the training loop next
    # polls (every ~10 ms, longer under load): with short verifier calls that left workers idle
    # most of the time. It waits on the workers' pipes, the wake-up socket and the nearest deadline.

    def _dispatcher(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._closing:
                        return
                    self._dispatch()
                    conns = [w.conn for w in self._workers if w.tasks or not w.ready]
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
        times = [w.started + self.timeout_s for w in self._workers if w.tasks]
        times += [kill_at for _, kill_at in self._dying]
        return min(times, default=time.monotonic() + 0.1)

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            self._wake_w.send(b"x")

    def _collect(self, i: int, w: _Worker) -> list[RewardResult]:
        out = []
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                if msg[0] == "ready":
                    w.ready = True
                    continue
                if msg[0] == "failed":
                    raise RuntimeError(f"a reward worker could not build its verifier: {msg[1]}")
                task_id, reward, info, latency, finished = msg
                (done_id, key, _, _), _ = w.tasks.popleft()
                if done_id != task_id:
                    raise RuntimeError(f"reward worker answered call {task_id}, expected {done_id}")
                if w.tasks:  # the next call started when this one finished, or when handed over
                    w.started = max(finished, w.tasks[0][1])
                m = self._mean_call_s
                self._mean_call_s = latency if m is None else 0.9 * m + 0.1 * latency
                out.append(self._result(key, reward, info, latency))
        except (EOFError, OSError):
            pass  # the worker died: handled below
        if w.tasks and time.monotonic() - w.started > self.timeout_s:
            self.stats.timeouts += 1
            out.append(self._replace(i, "timeout"))
        elif not w.proc.is_alive():
            self.stats.crashes += 1
            out += [self._replace(i, "worker_crash")] if w.tasks else self._restart(i)
        return out

    def _result(self, key: Any, reward: float, info: dict[str, Any], latency: float) -> RewardResult:
        self.stats.completed += 1
        self.stats.outcomes[info.get("outcome", "unknown")] += 1
        return RewardResult(key, reward, info, latency)

    def _replace(self, i: int, outcome: str) -> RewardResult:
        """The worker's running call fails with `outcome`; the calls handed to it after that one
        never started and go back to the head of the queue, in order."""
        w = self._workers[i]
        (_, key, _, _), _ = w.tasks.popleft()
        self._queue.extendleft(task for task, _ in reversed(w.tasks))
        self._stop(w)
        self._workers[i] = self._start_worker()
        return self._result(key, 0.0, {"outcome": outcome}, time.monotonic() - w.started)

    def _restart(self, i: int) -> list[RewardResult]:
        self._stop(self._workers[i])
        self._workers[i] = self._start_worker()
        return []

    def _dispatch(self) -> None:
        idle = [w for w in self._workers if w.ready and not w.tasks]
        for j, w in enumerate(idle):
            k = batch_size(len(self._queue), len(idle) - j, self._mean_call_s)
            if k == 0:
                return
            now = time.monotonic()
            w.tasks.extend((self._queue.popleft(), now) for _ in range(k))
            w.started = now
            try:
                w.conn.send([(task_id, response, metadata) for (task_id, _, response, metadata), _ in w.tasks])
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
