"""RewardPool: rewards computed in worker processes while generation goes on, each call with a
hard timeout, so a verifier that hangs or crashes can never stall the run.

    submit(key, response, metadata) ─► queue ─► [dispatcher thread] ─► idle worker ─► poll() results

Each worker builds its verifier once (`factory`, e.g. the RewardRouter of the run's config) and
then runs the batches of calls it is handed over a pipe, in order, answering each batch with one
message. A dispatcher thread in the parent hands batches to idle workers and collects their
answers; the caller never blocks on a worker: `poll` returns the finished results, and for a call
past `timeout_s` the dispatcher kills the worker and yields reward 0 with outcome `timeout`; a
worker that died mid-call yields outcome `worker_crash`. Either way a fresh worker replaces it,
the other calls of its batch go back to the head of the queue (the ones it had finished too:
their answers died with it, and verifiers are pure, so they simply run again), and the pool's
counters say how often it happened.

Batches: one call per pipe message costs a round trip of two processes waking each other (about
0.25 ms) and the driver's thread two messages per sample, which caps a pool of cheap verifiers at
a few thousand calls/s whatever their cost. So when calls are waiting and recent calls were fast,
a worker is handed several at once (`batch_size`: about BATCH_S of work, at most MAX_BATCH
calls). Each call still has its own clock: before a call the worker writes its index in the batch
and its start time into two doubles it shares with the pool (no message), which the dispatcher
reads for deadlines and, when a worker fails, to tell the call that failed from the others. With
slow verifiers or a short queue every batch holds one call, as before batching existed. While a
worker is idle, calls of a fast verifier wait up to MAX_WAIT_S for others to share their batch:
a driver that submits a few samples at a time would otherwise still pay a message per sample.
A call of a batch that runs past STRAGGLER_S (ten batches' worth of work) hands the rest of its
batch back to the head of the queue, the calls it had finished too (their answers would come
only with the batch's): a hung verifier then holds one call for timeout_s, not up to MAX_BATCH,
whose groups would keep the run short of a step for as long. The worker learns of it through a
third shared double, the number of calls it may still run; one it has begun anyway runs twice.

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
BATCH_S = 0.02  # a worker is handed about this much work at once (by the recent mean call time)
MAX_BATCH = 64
MAX_WAIT_S = 0.002  # how long calls may wait for more to fill a batch while a worker is idle
STRAGGLER_S = 10 * BATCH_S  # a call of a batch running longer hands the others back


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


def _release_sandboxes() -> None:
    """Kill this worker's code sandbox runs and end their launchers (multiprocessing ends a worker
    with os._exit, which skips atexit; a worker killed outright leaves its launchers to notice)."""
    sandbox = sys.modules.get("asyncrl.reward.sandbox")
    if sandbox is not None and hasattr(sandbox, "kill_active"):
        sandbox.kill_active()
        sandbox.release()


def _worker_main(conn: Connection, factory: Callable[[], RewardFn], progress) -> None:
    def on_term(*_):  # take running sandboxes down with this worker
        _release_sandboxes()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    # Ctrl-C reaches every process of the terminal's group; the driver stops the run and then
    # this pool, so a worker's own KeyboardInterrupt would only print a traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _serve(conn, factory, progress)
    except (EOFError, OSError):  # the pool's process is gone: nothing to answer, nothing to say
        pass
    finally:
        _release_sandboxes()


def _serve(conn: Connection, factory: Callable[[], RewardFn], progress) -> None:
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
        results = []
        for index, (task_id, response, metadata) in enumerate(batch):
            if index >= progress[LIMIT]:  # the pool took the rest back (RewardPool._take_back)
                break
            t0 = time.monotonic()
            progress[START], progress[INDEX] = t0, index  # the start first: see RewardPool._running
            try:
                reward, info = verifier(response, metadata)
                reward = float(reward)
            except Exception as e:  # a verifier bug costs this sample its reward, not the run
                reward, info = 0.0, {"outcome": "verifier_error", "error": repr(e)[:300]}
            results.append((task_id, reward, info, time.monotonic() - t0))
        conn.send(results)


Task = tuple[int, Any, str, dict[str, Any]]  # (task id, key, response, metadata)
# A worker's progress: the call of its batch it runs, when that call began, and (written by the
# pool) how many calls of the batch it may run.
INDEX, START, LIMIT = 0, 1, 2


@dataclass
class _Worker:
    proc: Any
    conn: Connection
    progress: Any
    """Shared doubles [INDEX, START, LIMIT]: the first two written by the worker before each call
    (time.monotonic is one clock for all processes of the machine), the last by the pool."""
    ready: bool = False
    batch: list[Task] = field(default_factory=list)
    """The calls it was handed and has not answered (a running one only, once the rest is taken back)."""
    skip: int = 0
    """Answers at the head of its next reply that belong to calls taken back: ignored."""


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
        self._queued_since = 0.0  # when the queue last became non-empty
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
            return len(self._queue) + len(self._results) + sum(len(w.batch) for w in self._workers)

    @property
    def num_queued(self) -> int:
        """Calls waiting for a free worker: when nonzero, the verifiers are a bottleneck. (Calls
        that wait up to MAX_WAIT_S for company while a worker is idle do not count.)"""
        with self._lock:
            return 0 if self._idle() else len(self._queue)

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
            if not self._queue:
                self._queued_since = time.monotonic()
            self._queue.extend((next(self._ids), key, response, metadata) for key, response, metadata in calls)
            # the dispatcher wakes by itself when a worker answers or a wait ends: only a call
            # that may go to an idle worker now, or starts a wait, needs it woken (each wake-up
            # costs the caller's thread a switch to the dispatcher's)
            wake = self._idle() and (len(self._queue) == len(calls) or len(self._queue) >= self._full_batch())
        if wake:
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
                    conns = [w.conn for w in self._workers if w.batch or not w.ready]
                    timeout = self._next_deadline() - time.monotonic()
                wait([*conns, self._wake_r], timeout=min(max(timeout, 0.0), 0.1))
                with contextlib.suppress(BlockingIOError):
                    self._wake_r.recv(4096)
                with self._lock:
                    for i, w in enumerate(self._workers):
                        self._results.extend(self._collect(i, w))
                    self._take_back()
                    self._dispatch()
                    self._reap()
                    self._lock.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the caller by poll
            with self._lock:
                self._error = e
                self._lock.notify_all()

    def _next_deadline(self) -> float:
        times = [w.progress[START] + self.timeout_s for w in self._workers if w.batch]
        times += [w.progress[START] + STRAGGLER_S for w in self._workers if len(w.batch) > 1]
        if self._queue and self._idle():
            times.append(self._queued_since + MAX_WAIT_S)
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
                answers = msg[w.skip:w.skip + len(w.batch)]  # beyond: a call taken back as it began
                if [r[0] for r in answers] != [task[0] for task in w.batch]:
                    raise RuntimeError("a reward worker answered calls it was not handed")
                for (_, key, _, _), (_, reward, info, latency) in zip(w.batch, answers):
                    m = self._mean_call_s
                    self._mean_call_s = latency if m is None else 0.9 * m + 0.1 * latency
                    out.append(self._result(key, reward, info, latency))
                w.batch = []
        except (EOFError, OSError):
            pass  # the worker died: handled below
        if w.batch and time.monotonic() - w.progress[START] > self.timeout_s:
            out += self._replace(i, "timeout")
        elif not w.proc.is_alive():
            self.stats.crashes += 1
            out += self._replace(i, "worker_crash") if w.batch else self._restart(i)
        return out

    @staticmethod
    def _running(w: _Worker) -> int:
        """The call of its batch the worker runs (or ran last); len(w.batch) or more for a call
        taken back that it had begun. The worker writes the start time before the index, so a
        deadline read after the index is never older than that call's."""
        return int(w.progress[INDEX]) - w.skip

    def _take_back(self) -> None:
        """Every call of a batch but the one running, when that one has run past STRAGGLER_S,
        goes back to the head of the queue (the worker stops after the running call)."""
        now = time.monotonic()
        for w in self._workers:
            running = self._running(w)
            if len(w.batch) > 1 and running < len(w.batch) and now - w.progress[START] > STRAGGLER_S:
                w.progress[LIMIT] = w.skip + running + 1
                self._queue.extendleft(reversed(w.batch[:running] + w.batch[running + 1:]))
                self._queued_since = 0.0  # these have waited: no batching wait for them
                w.batch, w.skip = [w.batch[running]], w.skip + running

    def _result(self, key: Any, reward: float, info: dict[str, Any], latency: float) -> RewardResult:
        self.stats.completed += 1
        self.stats.outcomes[info.get("outcome", "unknown")] += 1
        return RewardResult(key, reward, info, latency)

    def _replace(self, i: int, outcome: str) -> list[RewardResult]:
        """The worker's running call fails with `outcome`; the rest of its batch goes back to the
        head of the queue, in order (the calls it had finished too: their answers are lost). A
        call taken back fails where it runs again, not here: then the whole batch goes back."""
        w = self._workers[i]
        running = self._running(w)
        failed = w.batch[running:running + 1]
        self._queue.extendleft(reversed(w.batch[:running] + w.batch[running + 1:]))
        self._queued_since = 0.0  # these have waited: no batching wait for them
        latency = time.monotonic() - w.progress[START]
        self._stop(w)
        self._workers[i] = self._start_worker()
        if outcome == "timeout":
            self.stats.timeouts += len(failed)
        return [self._result(task[1], 0.0, {"outcome": outcome}, latency) for task in failed]

    def _restart(self, i: int) -> list[RewardResult]:
        self._stop(self._workers[i])
        self._workers[i] = self._start_worker()
        return []

    def _idle(self) -> list[_Worker]:
        return [w for w in self._workers if w.ready and not w.batch]

    def _full_batch(self) -> int:
        return batch_size(MAX_BATCH, 1, self._mean_call_s)

    def _dispatch(self) -> None:
        """Hand idle workers the queue in even shares, once it fills a batch for one of them
        or its oldest call has waited MAX_WAIT_S (at once for verifiers too slow to batch)."""
        idle = self._idle()
        if not idle or not self._queue or (len(self._queue) < self._full_batch()
                                          and time.monotonic() - self._queued_since < MAX_WAIT_S):
            return
        for j, w in enumerate(idle):
            k = batch_size(len(self._queue), len(idle) - j, self._mean_call_s)
            if k == 0:
                return
            w.batch, w.skip = [self._queue.popleft() for _ in range(k)], 0
            w.progress[INDEX], w.progress[START], w.progress[LIMIT] = 0, time.monotonic(), k  # the clock runs from now
            try:
                w.conn.send([(task_id, response, metadata) for task_id, _, response, metadata in w.batch])
            except (BrokenPipeError, OSError):
                pass  # the worker is gone; the next collect reports it as a crash

    def _start_worker(self) -> _Worker:
        parent, child = self._ctx.Pipe()
        progress = self._ctx.RawArray("d", 3)
        proc = self._ctx.Process(target=_worker_main, args=(child, self._factory, progress), daemon=True)
        with _main_hidden():
            proc.start()
        child.close()
        self.stats.workers_started += 1
        return _Worker(proc, parent, progress)

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
