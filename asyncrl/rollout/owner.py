"""An engine's processes end with the rollout actor that owns them.

vLLM keeps its engine core (and, with several workers, each worker) in a process of its own, a
child of the actor. When the actor's process ends without running its shutdown (Ray kills it at
the end of a run or when it replaces it, `ray job stop`, SIGKILL, a driver that dies), nothing
signals those children: an engine core was seen spinning 15% of a core for 11 minutes after the
run that started it had ended.

So the actor names itself in ASYNCRL_ENGINE_OWNER (its pid and start time; the start time tells
it apart from a later process given the same pid) before it starts its engine. Every process vLLM
starts inherits the variable, and vLLM loads its general plugins in each of them, so `watch` (the
plugin) starts a thread there that kills its process within a second of the owner's end. A
process without the variable (any other use of vLLM) is left alone, and so is the owner itself.
"""

from __future__ import annotations

import os
import signal
import threading
import time

ENV = "ASYNCRL_ENGINE_OWNER"
POLL_S = 1.0
_watching = False


def owner_token(pid: int | None = None) -> str:
    """`<pid>:<start time>` of `pid` (default: this process)."""
    pid = os.getpid() if pid is None else pid
    return f"{pid}:{_start_time(pid) or ''}"


def alive(token: str) -> bool:
    """Whether the process a token names is still running (not the same pid reused, not a zombie)."""
    pid, _, started = token.partition(":")
    now = _start_time(int(pid))
    if now is None:
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not started  # no /proc: the pid answers; with /proc: gone, or a zombie
    return not started or now == started


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc/<pid>/stat field 22); None if it
    is gone, a zombie, or there is no /proc."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == b"Z" else fields[19].decode()


def watch() -> None:
    """The vLLM plugin: in a process started under a rollout actor, end it when the actor ends."""
    global _watching
    token = os.environ.get(ENV)
    if not token or _watching or token.partition(":")[0] == str(os.getpid()):
        return
    _watching = True
    _no_semaphore_for_progress_bars()
    threading.Thread(target=_watch, args=(token,), name="asyncrl-engine-owner", daemon=True).start()


def _no_semaphore_for_progress_bars() -> None:
    """tqdm guards its bars with a multiprocessing lock: a named semaphore that only a clean exit
    unlinks. These processes are killed (VllmEngine.shutdown on CPU after 1 s, `_watch` below), so
    the semaphore of vLLM's weight-loading bar was left to the resource tracker, whose "leaked
    semaphore" warning ended `asyncrl evaluate` in two of three runs. A thread lock is enough for
    a process that draws its bars from one process."""
    try:
        from tqdm import tqdm
    except ImportError:
        return
    tqdm.set_lock(threading.RLock())


def _watch(token: str) -> None:
    while alive(token):
        time.sleep(POLL_S)
    os.kill(os.getpid(), signal.SIGKILL)  # nothing to save: the engine's only user is gone
